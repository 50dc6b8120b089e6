package ec2

import (
	"context"
	"encoding/base64"
	"fmt"
	"os"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"

	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/internal/store"
)

// fakeCompute is hangar-vmd as the gateway sees it: instances with states,
// a capacity in vCPUs, and state signals the test sends.
type fakeCompute struct {
	mu       sync.Mutex
	vcpus    uint32 // capacity
	inst     map[string]api.InstanceInfo
	specs    map[string]api.InstanceSpec
	attached map[string][]api.InstanceDisk
	signals  chan api.InstanceStateChange
}

func newFakeCompute(vcpus uint32) *fakeCompute {
	return &fakeCompute{vcpus: vcpus, inst: map[string]api.InstanceInfo{}, specs: map[string]api.InstanceSpec{},
		attached: map[string][]api.InstanceDisk{}, signals: make(chan api.InstanceStateChange, 100)}
}

func (f *fakeCompute) used() uint32 {
	var n uint32
	for _, i := range f.inst {
		if i.State != api.InstanceStateStopped && i.State != api.InstanceStateTerminated {
			n += i.VCPUs
		}
	}
	return n
}

// signal changes an instance's state as vmd would, and tells the gateway.
func (f *fakeCompute) signal(id, state, reason string) {
	f.mu.Lock()
	i := f.inst[id]
	i.State, i.StateReason = state, reason
	f.inst[id] = i
	f.mu.Unlock()
	f.signals <- api.InstanceStateChange{ID: id, State: state, Reason: reason}
}

func (f *fakeCompute) CreateInstance(_ context.Context, spec api.InstanceSpec) (api.InstanceInfo, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if i, ok := f.inst[spec.ID]; ok {
		return i, nil
	}
	if f.used()+spec.VCPUs > f.vcpus {
		return api.InstanceInfo{}, &api.Error{Name: api.ErrInsufficientCapacity, Message: fmt.Sprintf("%d vCPUs free", f.vcpus-f.used())}
	}
	i := api.InstanceInfo{ID: spec.ID, State: api.InstanceStatePending, VCPUs: spec.VCPUs, MemoryMiB: spec.MemoryMiB,
		SystemStatus: api.StatusCheckInitializing, InstanceStatus: api.StatusCheckInitializing}
	f.inst[spec.ID] = i
	f.specs[spec.ID] = spec
	return i, nil
}

func (f *fakeCompute) transition(id, to string) (api.InstanceInfo, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	i, ok := f.inst[id]
	if !ok {
		return i, &api.Error{Name: api.ErrNotFound, Message: "no " + id}
	}
	i.State = to
	f.inst[id] = i
	return i, nil
}

func (f *fakeCompute) StartInstance(_ context.Context, id string) (api.InstanceInfo, error) {
	return f.transition(id, api.InstanceStatePending)
}

func (f *fakeCompute) StopInstance(_ context.Context, id string, _ bool, _ uint32) (api.InstanceInfo, error) {
	return f.transition(id, api.InstanceStateStopping)
}

func (f *fakeCompute) RebootInstance(_ context.Context, id string) (api.InstanceInfo, error) {
	return f.transition(id, api.InstanceStateRunning)
}

func (f *fakeCompute) TerminateInstance(_ context.Context, id string) (api.InstanceInfo, error) {
	return f.transition(id, api.InstanceStateShuttingDown)
}

func (f *fakeCompute) DeleteInstance(_ context.Context, id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.inst, id)
	delete(f.specs, id)
	return nil
}

func (f *fakeCompute) AttachVolume(_ context.Context, id string, d api.InstanceDisk) (api.InstanceInfo, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.attached[id] = append(f.attached[id], d)
	return f.inst[id], nil
}

func (f *fakeCompute) DetachVolume(_ context.Context, id, vol string, _ bool) (api.InstanceInfo, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var keep []api.InstanceDisk
	for _, d := range f.attached[id] {
		if d.ID != vol {
			keep = append(keep, d)
		}
	}
	f.attached[id] = keep
	return f.inst[id], nil
}

func (f *fakeCompute) GetConsoleOutput(_ context.Context, id string, _ bool) (string, int64, error) {
	return "boot ok on " + id + "\n", time.Now().Unix(), nil
}

func (f *fakeCompute) ListInstances(context.Context) ([]api.InstanceInfo, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []api.InstanceInfo
	for _, i := range f.inst {
		out = append(out, i)
	}
	return out, nil
}

func (f *fakeCompute) WatchInstanceStates(ctx context.Context) (<-chan api.InstanceStateChange, error) {
	return f.signals, nil
}

// instanceHost is a Service with fake netd, ebsd and vmd, an image to launch
// and a key pair.
type instanceHost struct {
	s       *Service
	net     *fakeNet
	storage *fakeStorage
	vmd     *fakeCompute
	image   string
	snap    string
}

func newInstanceHost(t *testing.T, vcpus uint32) *instanceHost {
	t.Helper()
	s, fn := newNetSvc(t)
	st := newFakeStorage()
	s.SetStorage(st)
	vmd := newFakeCompute(vcpus)
	s.SetCompute(vmd)
	ctx, cancel := context.WithCancel(bg)
	t.Cleanup(cancel)
	if err := s.StartCompute(ctx); err != nil {
		t.Fatal(err)
	}
	h := &instanceHost{s: s, net: fn, storage: st, vmd: vmd, snap: "snap-0123456789abcdef0"}
	// A completed 8 GiB snapshot, as an EBS direct import leaves it.
	err := s.db.Update(func(tx *store.Tx) error {
		return put(tx, kindSnapshot, h.snap, &snapshotRecord{Snapshot: types.Snapshot{SnapshotId: ptr(h.snap), State: types.SnapshotStateCompleted,
			VolumeSize: ptr(int32(8)), OwnerId: ptr(testAccount)}})
	})
	if err != nil {
		t.Fatal(err)
	}
	out := must[*ec2.RegisterImageOutput](t)(s.RegisterImage(bg, &ec2.RegisterImageInput{
		Name: ptr("hangar/debian-12-x86_64"), RootDeviceName: ptr("/dev/xvda"), BootMode: types.BootModeValuesUefi,
		BlockDeviceMappings: []types.BlockDeviceMapping{{DeviceName: ptr("/dev/xvda"), Ebs: &types.EbsBlockDevice{SnapshotId: ptr(h.snap)}}},
	}))
	h.image = *out.ImageId
	must[*ec2.ImportKeyPairOutput](t)(s.ImportKeyPair(bg, &ec2.ImportKeyPairInput{KeyName: ptr("dev"),
		PublicKeyMaterial: []byte("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl dev@host")}))
	return h
}

func (h *instanceHost) run(t *testing.T, in *ec2.RunInstancesInput) *ec2.RunInstancesOutput {
	t.Helper()
	if in.ImageId == nil {
		in.ImageId = ptr(h.image)
	}
	if in.MinCount == nil {
		in.MinCount, in.MaxCount = ptr(int32(1)), ptr(int32(1))
	}
	if in.InstanceType == "" {
		in.InstanceType = types.InstanceTypeT3Micro
	}
	return must[*ec2.RunInstancesOutput](t)(h.s.RunInstances(bg, in))
}

func (h *instanceHost) describe(t *testing.T, id string) types.Instance {
	t.Helper()
	out := must[*ec2.DescribeInstancesOutput](t)(h.s.DescribeInstances(bg, &ec2.DescribeInstancesInput{InstanceIds: []string{id}}))
	return out.Reservations[0].Instances[0]
}

func (h *instanceHost) waitState(t *testing.T, id string, want types.InstanceStateName) {
	t.Helper()
	eventually(t, fmt.Sprintf("%s to be %s", id, want), func() bool { return h.describe(t, id).State.Name == want })
}

func TestRunInstancesLaunchesThroughEveryService(t *testing.T) {
	h := newInstanceHost(t, 8)
	ud := base64.StdEncoding.EncodeToString([]byte("#cloud-config\nruncmd: [echo hello]\n"))
	out := h.run(t, &ec2.RunInstancesInput{MinCount: ptr(int32(2)), MaxCount: ptr(int32(2)), KeyName: ptr("dev"), UserData: &ud,
		TagSpecifications: []types.TagSpecification{{ResourceType: types.ResourceTypeInstance, Tags: []types.Tag{{Key: ptr("Name"), Value: ptr("web")}}}},
		BlockDeviceMappings: []types.BlockDeviceMapping{
			{DeviceName: ptr("/dev/xvda"), Ebs: &types.EbsBlockDevice{VolumeSize: ptr(int32(20))}},
			{DeviceName: ptr("/dev/sdf"), Ebs: &types.EbsBlockDevice{VolumeSize: ptr(int32(5)), DeleteOnTermination: ptr(false)}},
		},
		MetadataOptions: &types.InstanceMetadataOptionsRequest{HttpTokens: types.HttpTokensStateRequired},
	})
	if len(out.Instances) != 2 || out.ReservationId == nil {
		t.Fatalf("launched %d instances", len(out.Instances))
	}
	a, b := out.Instances[0], out.Instances[1]
	if a.State.Name != types.InstanceStateNamePending || deref(a.PrivateIpAddress) != "172.31.0.4" || deref(b.PrivateIpAddress) != "172.31.0.5" {
		t.Fatalf("instances %s %s at %s %s", a.State.Name, *a.InstanceId, deref(a.PrivateIpAddress), deref(b.PrivateIpAddress))
	}
	if deref(a.PrivateDnsName) != "ip-172-31-0-4.ec2.internal" || len(a.NetworkInterfaces) != 1 || len(a.BlockDeviceMappings) != 2 || len(a.Tags) != 1 {
		t.Fatalf("instance view %+v", a)
	}
	id := *a.InstanceId

	// vmd got the guest: type's size, the tap netd made, the volumes ebsd serves.
	spec := h.vmd.specs[id]
	if spec.VCPUs != 2 || spec.MemoryMiB != 1024 || spec.BootMode != "uefi" || len(spec.NICs) != 1 || spec.NICs[0].Tap == "" ||
		spec.NICs[0].Namespace != "hangar-"+deref(a.VpcId) ||
		spec.RootVolume.DeviceName != "/dev/xvda" || !strings.HasSuffix(spec.RootVolume.Socket, ".sock") || len(spec.Volumes) != 1 {
		t.Fatalf("vmd spec %+v", spec)
	}
	if v := h.storage.vols[spec.RootVolume.ID]; v.SizeBytes != 20*gib || v.FromSnapshot != h.snap || v.AttachedTo != id {
		t.Fatalf("root volume in ebsd %+v", v)
	}
	// netd got the interface and what IMDS serves.
	eni := spec.NICs[0].ID
	md := h.net.md[eni]
	if md.InstanceID != id || string(md.UserData) != "#cloud-config\nruncmd: [echo hello]\n" || len(md.PublicKeys) != 1 || md.HttpTokens != "required" || md.AmiID != h.image {
		t.Fatalf("metadata %+v", md)
	}
	eventually(t, "the interfaces pushed with the VPC", func() bool {
		st, _ := h.net.state(deref(a.VpcId))
		return len(st.Interfaces) == 2
	})

	// vmd reports running; describe follows, with filters.
	h.vmd.signal(id, api.InstanceStateRunning, "")
	h.waitState(t, id, types.InstanceStateNameRunning)
	for _, f := range [][]types.Filter{
		{{Name: ptr("instance-state-name"), Values: []string{"running"}}},
		{{Name: ptr("private-ip-address"), Values: []string{"172.31.0.4"}}},
		{{Name: ptr("tag:Name"), Values: []string{"web"}}, {Name: ptr("instance-id"), Values: []string{id}}},
	} {
		got := must[*ec2.DescribeInstancesOutput](t)(h.s.DescribeInstances(bg, &ec2.DescribeInstancesInput{Filters: f}))
		var ids []string
		for _, r := range got.Reservations {
			for _, i := range r.Instances {
				ids = append(ids, *i.InstanceId)
			}
		}
		if f[0].Name != nil && *f[0].Name == "tag:Name" && len(ids) != 1 || *f[0].Name != "tag:Name" && (len(ids) != 1 || ids[0] != id) {
			t.Errorf("filter %s: %v", *f[0].Name, ids)
		}
	}
	console := must[*ec2.GetConsoleOutputOutput](t)(h.s.GetConsoleOutput(bg, &ec2.GetConsoleOutputInput{InstanceId: &id}))
	if raw, _ := base64.StdEncoding.DecodeString(deref(console.Output)); !strings.Contains(string(raw), id) {
		t.Fatalf("console %q", raw)
	}

	// A subnet or group in use cannot go.
	_, err := h.s.DeleteSubnet(bg, &ec2.DeleteSubnetInput{SubnetId: a.SubnetId})
	wantCode(t, err, "DependencyViolation")
	subnet := must[*ec2.DescribeSubnetsOutput](t)(h.s.DescribeSubnets(bg, &ec2.DescribeSubnetsInput{SubnetIds: []string{*a.SubnetId}})).Subnets[0]
	if deref(subnet.AvailableIpAddressCount) != 4091-2 {
		t.Fatalf("available addresses %d, want two fewer than 4091", deref(subnet.AvailableIpAddressCount))
	}

	// Terminate: the interface goes, DeleteOnTermination volumes go, the rest stay.
	term := must[*ec2.TerminateInstancesOutput](t)(h.s.TerminateInstances(bg, &ec2.TerminateInstancesInput{InstanceIds: []string{id}}))
	if term.TerminatingInstances[0].CurrentState.Name != types.InstanceStateNameShuttingDown {
		t.Fatalf("terminate answered %+v", term.TerminatingInstances[0].CurrentState)
	}
	h.vmd.signal(id, api.InstanceStateTerminated, "Client.UserInitiatedShutdown: User initiated shutdown")
	h.waitState(t, id, types.InstanceStateNameTerminated)
	eventually(t, "the interface released", func() bool {
		h.net.mu.Lock()
		defer h.net.mu.Unlock()
		_, still := h.net.ifaces[eni]
		_, md := h.net.md[eni]
		return !still && !md
	})
	eventually(t, "the kept volume detached and available", func() bool {
		data := must[*ec2.DescribeVolumesOutput](t)(h.s.DescribeVolumes(bg, &ec2.DescribeVolumesInput{VolumeIds: []string{spec.Volumes[0].ID}}))
		return data.Volumes[0].State == types.VolumeStateAvailable && len(data.Volumes[0].Attachments) == 0
	})
	h.storage.mu.Lock()
	_, rootKept := h.storage.vols[spec.RootVolume.ID]
	h.storage.mu.Unlock()
	if rootKept {
		t.Fatal("the root volume (DeleteOnTermination) is still in ebsd")
	}
	if v := h.describe(t, id); v.PrivateIpAddress != nil || len(v.NetworkInterfaces) != 0 || v.StateReason == nil {
		t.Fatalf("terminated instance still shows %v %d interfaces (reason %v)", v.PrivateIpAddress, len(v.NetworkInterfaces), v.StateReason)
	}
	subnet = must[*ec2.DescribeSubnetsOutput](t)(h.s.DescribeSubnets(bg, &ec2.DescribeSubnetsInput{SubnetIds: []string{*a.SubnetId}})).Subnets[0]
	if deref(subnet.AvailableIpAddressCount) != 4091-1 {
		t.Fatalf("available addresses %d after terminate", deref(subnet.AvailableIpAddressCount))
	}
}

func TestRunInstancesCapacityLeavesNothingBehind(t *testing.T) {
	h := newInstanceHost(t, 2) // room for one t3.micro (2 vCPUs)
	before := snapshot(t, h.s)
	_, err := h.s.RunInstances(bg, &ec2.RunInstancesInput{ImageId: &h.image, InstanceType: types.InstanceTypeT3Micro, MinCount: ptr(int32(2)), MaxCount: ptr(int32(2))})
	wantCode(t, err, "InsufficientInstanceCapacity")
	eventually(t, "netd to forget the interfaces", func() bool {
		h.net.mu.Lock()
		defer h.net.mu.Unlock()
		return len(h.net.ifaces) == 0 && len(h.net.md) == 0
	})
	if len(h.vmd.inst) != 0 || len(h.storage.vols) != 0 {
		t.Fatalf("left behind: vmd %d instances, ebsd %d volumes", len(h.vmd.inst), len(h.storage.vols))
	}
	after := snapshot(t, h.s)
	for _, k := range []string{"i", "eni", "vol"} {
		if len(after[k]) != len(before[k]) {
			t.Errorf("%d %s records after a refused launch, %d before", len(after[k]), k, len(before[k]))
		}
	}
	// Between MinCount and MaxCount: as many as fit.
	out := h.run(t, &ec2.RunInstancesInput{MinCount: ptr(int32(1)), MaxCount: ptr(int32(3))})
	if len(out.Instances) != 1 {
		t.Fatalf("launched %d, want the 1 that fits", len(out.Instances))
	}
	var n int
	_ = h.s.db.View(func(tx *store.Tx) error { n = tx.Count("i"); return nil })
	if n != 1 {
		t.Fatalf("%d instance records, want 1", n)
	}
}

func TestRunInstancesRefusesBadInput(t *testing.T) {
	h := newInstanceHost(t, 8)
	other := must[*ec2.CreateVpcOutput](t)(h.s.CreateVpc(bg, &ec2.CreateVpcInput{CidrBlock: ptr("10.9.0.0/16")})).Vpc
	foreign := must[*ec2.CreateSecurityGroupOutput](t)(h.s.CreateSecurityGroup(bg, &ec2.CreateSecurityGroupInput{VpcId: other.VpcId, GroupName: ptr("x"), Description: ptr("x")}))
	bad := func(name, code string, mod func(in *ec2.RunInstancesInput)) {
		t.Helper()
		in := &ec2.RunInstancesInput{ImageId: &h.image, InstanceType: types.InstanceTypeT3Micro, MinCount: ptr(int32(1)), MaxCount: ptr(int32(1))}
		mod(in)
		before := snapshot(t, h.s)
		_, err := h.s.RunInstances(bg, in)
		if got := code; got != "" {
			if c := codeOf(err); c != got {
				t.Errorf("%s: error %v, want %s", name, err, got)
			}
		}
		after := snapshot(t, h.s)
		if len(after["i"]) != len(before["i"]) || len(after["eni"]) != len(before["eni"]) {
			t.Errorf("%s: records left behind", name)
		}
	}
	bad("unknown image", "InvalidAMIID.NotFound", func(in *ec2.RunInstancesInput) { in.ImageId = ptr("ami-0123456789abcdef0") })
	bad("malformed image", "InvalidAMIID.Malformed", func(in *ec2.RunInstancesInput) { in.ImageId = ptr("ami-xyz") })
	bad("unknown type", "InvalidParameterValue", func(in *ec2.RunInstancesInput) { in.InstanceType = "p4d.24xlarge" })
	bad("metal type", "Unsupported", func(in *ec2.RunInstancesInput) { in.InstanceType = types.InstanceTypeM5Metal })
	bad("max below min", "InvalidParameterValue", func(in *ec2.RunInstancesInput) { in.MinCount = ptr(int32(3)) })
	bad("bad user data", "InvalidParameterValue", func(in *ec2.RunInstancesInput) { in.UserData = ptr("%%%not base64") })
	bad("user data too big", "InvalidParameterValue", func(in *ec2.RunInstancesInput) {
		in.UserData = ptr(base64.StdEncoding.EncodeToString(make([]byte, 17000)))
	})
	bad("reserved address", "InvalidParameterValue", func(in *ec2.RunInstancesInput) { in.PrivateIpAddress = ptr("172.31.0.2") })
	bad("address outside", "InvalidParameterValue", func(in *ec2.RunInstancesInput) { in.PrivateIpAddress = ptr("10.0.0.9") })
	bad("private ip for two", "InvalidParameterCombination", func(in *ec2.RunInstancesInput) {
		in.PrivateIpAddress, in.MaxCount = ptr("172.31.0.9"), ptr(int32(2))
	})
	bad("group of another VPC", "InvalidParameter", func(in *ec2.RunInstancesInput) { in.SecurityGroupIds = []string{*foreign.GroupId} })
	bad("unknown key", "InvalidKeyPair.NotFound", func(in *ec2.RunInstancesInput) { in.KeyName = ptr("nope") })
	bad("unknown subnet", "InvalidSubnetID.NotFound", func(in *ec2.RunInstancesInput) { in.SubnetId = ptr("subnet-0123456789abcdef0") })
	bad("hop limit", "InvalidParameterValue", func(in *ec2.RunInstancesInput) {
		in.MetadataOptions = &types.InstanceMetadataOptionsRequest{HttpPutResponseHopLimit: ptr(int32(65))}
	})
	bad("instance profile", "Unsupported", func(in *ec2.RunInstancesInput) {
		in.IamInstanceProfile = &types.IamInstanceProfileSpecification{Name: ptr("role")}
	})
	bad("root smaller than snapshot", "InvalidParameterValue", func(in *ec2.RunInstancesInput) {
		in.BlockDeviceMappings = []types.BlockDeviceMapping{{DeviceName: ptr("/dev/xvda"), Ebs: &types.EbsBlockDevice{VolumeSize: ptr(int32(4))}}}
	})
	bad("wrong tag resource", "InvalidParameterValue", func(in *ec2.RunInstancesInput) {
		in.TagSpecifications = []types.TagSpecification{{ResourceType: types.ResourceTypeVpc, Tags: []types.Tag{{Key: ptr("a"), Value: ptr("b")}}}}
	})

	// An address in use is refused, not shared.
	h.run(t, &ec2.RunInstancesInput{PrivateIpAddress: ptr("172.31.0.9")})
	bad("address in use", "InvalidIPAddress.InUse", func(in *ec2.RunInstancesInput) { in.PrivateIpAddress = ptr("172.31.0.9") })
}

func codeOf(err error) string { return code(err) }

func TestInstanceLifecycleStopStartReboot(t *testing.T) {
	h := newInstanceHost(t, 8)
	id := *h.run(t, &ec2.RunInstancesInput{}).Instances[0].InstanceId
	h.vmd.signal(id, api.InstanceStateRunning, "")
	h.waitState(t, id, types.InstanceStateNameRunning)

	must[*ec2.RebootInstancesOutput](t)(h.s.RebootInstances(bg, &ec2.RebootInstancesInput{InstanceIds: []string{id}}))
	stop := must[*ec2.StopInstancesOutput](t)(h.s.StopInstances(bg, &ec2.StopInstancesInput{InstanceIds: []string{id}}))
	if c := stop.StoppingInstances[0]; c.PreviousState.Name != types.InstanceStateNameRunning || c.CurrentState.Name != types.InstanceStateNameStopping {
		t.Fatalf("stop answered %s → %s", c.PreviousState.Name, c.CurrentState.Name)
	}
	_, err := h.s.StartInstances(bg, &ec2.StartInstancesInput{InstanceIds: []string{id}})
	wantCode(t, err, "IncorrectInstanceState")
	h.vmd.signal(id, api.InstanceStateStopped, "Client.UserInitiatedShutdown: User initiated shutdown")
	h.waitState(t, id, types.InstanceStateNameStopped)
	if v := h.describe(t, id); !strings.HasPrefix(deref(v.StateTransitionReason), "User initiated (") || deref(v.StateReason.Code) != "Client.UserInitiatedShutdown" {
		t.Fatalf("stopped with reason %q / %+v", deref(v.StateTransitionReason), v.StateReason)
	}
	_, err = h.s.RebootInstances(bg, &ec2.RebootInstancesInput{InstanceIds: []string{id}})
	wantCode(t, err, "IncorrectInstanceState")

	// Hot-plug on a stopped instance is recorded for its next start.
	vol := createVol(t, h.s, 4, types.VolumeTypeGp3)
	must[*ec2.AttachVolumeOutput](t)(h.s.AttachVolume(bg, &ec2.AttachVolumeInput{VolumeId: &vol, InstanceId: &id, Device: ptr("/dev/sdg")}))
	if d := h.vmd.attached[id]; len(d) != 1 || d[0].ID != vol || d[0].DeviceName != "/dev/sdg" || d[0].Socket == "" {
		t.Fatalf("vmd attached %+v", d)
	}
	start := must[*ec2.StartInstancesOutput](t)(h.s.StartInstances(bg, &ec2.StartInstancesInput{InstanceIds: []string{id}}))
	if c := start.StartingInstances[0]; c.CurrentState.Name != types.InstanceStateNamePending {
		t.Fatalf("start answered %s", c.CurrentState.Name)
	}
	h.vmd.signal(id, api.InstanceStateRunning, "")
	h.waitState(t, id, types.InstanceStateNameRunning)
	// The root volume of a running instance stays; another detaches.
	root := h.describe(t, id).BlockDeviceMappings[0].Ebs.VolumeId
	_, err = h.s.DetachVolume(bg, &ec2.DetachVolumeInput{VolumeId: root})
	wantCode(t, err, "OperationNotPermitted")
	must[*ec2.DetachVolumeOutput](t)(h.s.DetachVolume(bg, &ec2.DetachVolumeInput{VolumeId: &vol}))
	if d := h.vmd.attached[id]; len(d) != 0 {
		t.Fatalf("vmd still has %+v", d)
	}

	// Termination protection.
	must[*ec2.ModifyInstanceAttributeOutput](t)(h.s.ModifyInstanceAttribute(bg, &ec2.ModifyInstanceAttributeInput{InstanceId: &id, DisableApiTermination: &types.AttributeBooleanValue{Value: ptr(true)}}))
	_, err = h.s.TerminateInstances(bg, &ec2.TerminateInstancesInput{InstanceIds: []string{id}})
	wantCode(t, err, "OperationNotPermitted")
}

func TestReconcileFollowsVmd(t *testing.T) {
	h := newInstanceHost(t, 8)
	out := h.run(t, &ec2.RunInstancesInput{MinCount: ptr(int32(2)), MaxCount: ptr(int32(2))})
	a, b := *out.Instances[0].InstanceId, *out.Instances[1].InstanceId
	h.vmd.signal(a, api.InstanceStateRunning, "")
	h.vmd.signal(b, api.InstanceStateRunning, "")
	h.waitState(t, b, types.InstanceStateNameRunning)

	// While the gateway was not listening, a's guest powered itself off,
	// and vmd lost b altogether (a fresh host disk, say).
	h.vmd.mu.Lock()
	i := h.vmd.inst[a]
	i.State, i.StateReason = api.InstanceStateStopped, "Client.InstanceInitiatedShutdown: Instance initiated shutdown"
	h.vmd.inst[a] = i
	delete(h.vmd.inst, b)
	delete(h.vmd.specs, b)
	h.vmd.mu.Unlock()

	h.s.ComputeAppeared(bg)
	if v := h.describe(t, a); v.State.Name != types.InstanceStateNameStopped || deref(v.StateTransitionReason) != "Client.InstanceInitiatedShutdown: Instance initiated shutdown" {
		t.Fatalf("a is %s (%q) after reconcile", v.State.Name, deref(v.StateTransitionReason))
	}
	h.vmd.mu.Lock()
	_, relaunched := h.vmd.specs[b]
	h.vmd.mu.Unlock()
	if !relaunched {
		t.Fatal("b, running in the records but unknown to vmd, was not launched again")
	}

	// netd restarting loses metadata; it comes back.
	h.net.mu.Lock()
	h.net.md = map[string]api.InstanceMetadata{}
	h.net.mu.Unlock()
	h.s.NetworkAppeared(bg)
	h.net.mu.Lock()
	n := len(h.net.md)
	h.net.mu.Unlock()
	if n != 2 {
		t.Fatalf("metadata for %d instances after netd restarted, want 2", n)
	}
}

func TestDescribeInstanceStatusFromVmd(t *testing.T) {
	h := newInstanceHost(t, 8)
	id := *h.run(t, &ec2.RunInstancesInput{}).Instances[0].InstanceId
	out := must[*ec2.DescribeInstanceStatusOutput](t)(h.s.DescribeInstanceStatus(bg, &ec2.DescribeInstanceStatusInput{}))
	if len(out.InstanceStatuses) != 0 {
		t.Fatalf("a pending instance is listed without IncludeAllInstances")
	}
	h.vmd.mu.Lock()
	i := h.vmd.inst[id]
	i.SystemStatus, i.InstanceStatus = api.StatusCheckOK, api.StatusCheckOK
	h.vmd.inst[id] = i
	h.vmd.mu.Unlock()
	h.vmd.signal(id, api.InstanceStateRunning, "")
	h.waitState(t, id, types.InstanceStateNameRunning)
	out = must[*ec2.DescribeInstanceStatusOutput](t)(h.s.DescribeInstanceStatus(bg, &ec2.DescribeInstanceStatusInput{
		Filters: []types.Filter{{Name: ptr("instance-status.status"), Values: []string{"ok"}}}}))
	if len(out.InstanceStatuses) != 1 || out.InstanceStatuses[0].SystemStatus.Details[0].Status != types.StatusTypePassed {
		t.Fatalf("statuses %+v", out.InstanceStatuses)
	}
}

func TestImagesRegisterDescribeDeregister(t *testing.T) {
	h := newInstanceHost(t, 8)
	s := h.s
	_, err := s.RegisterImage(bg, &ec2.RegisterImageInput{Name: ptr("hangar/debian-12-x86_64"), RootDeviceName: ptr("/dev/xvda"),
		BlockDeviceMappings: []types.BlockDeviceMapping{{DeviceName: ptr("/dev/xvda"), Ebs: &types.EbsBlockDevice{SnapshotId: &h.snap}}}})
	wantCode(t, err, "InvalidAMIName.Duplicate")
	_, err = s.RegisterImage(bg, &ec2.RegisterImageInput{Name: ptr("x")})
	wantCode(t, err, "InvalidParameterValue")
	_, err = s.RegisterImage(bg, &ec2.RegisterImageInput{Name: ptr("no-root"), RootDeviceName: ptr("/dev/xvda")})
	wantCode(t, err, "InvalidParameterValue")
	_, err = s.RegisterImage(bg, &ec2.RegisterImageInput{Name: ptr("arm"), Architecture: types.ArchitectureValuesArm64,
		BlockDeviceMappings: []types.BlockDeviceMapping{{DeviceName: ptr("/dev/xvda"), Ebs: &types.EbsBlockDevice{SnapshotId: &h.snap}}}})
	wantCode(t, err, "InvalidParameterValue")

	second := must[*ec2.RegisterImageOutput](t)(s.RegisterImage(bg, &ec2.RegisterImageInput{Name: ptr("bios image"), BootMode: types.BootModeValuesLegacyBios,
		BlockDeviceMappings: []types.BlockDeviceMapping{{DeviceName: ptr("/dev/xvda"), Ebs: &types.EbsBlockDevice{SnapshotId: &h.snap, VolumeSize: ptr(int32(30))}}},
		TagSpecifications:   []types.TagSpecification{{ResourceType: types.ResourceTypeImage, Tags: []types.Tag{{Key: ptr("os"), Value: ptr("debian")}}}}})).ImageId
	all := must[*ec2.DescribeImagesOutput](t)(s.DescribeImages(bg, &ec2.DescribeImagesInput{Owners: []string{"self"}}))
	if len(all.Images) != 2 {
		t.Fatalf("%d images for owner self", len(all.Images))
	}
	byName := must[*ec2.DescribeImagesOutput](t)(s.DescribeImages(bg, &ec2.DescribeImagesInput{Filters: []types.Filter{{Name: ptr("name"), Values: []string{"hangar/*"}}}}))
	if len(byName.Images) != 1 || *byName.Images[0].ImageId != h.image || byName.Images[0].BootMode != types.BootModeValuesUefi {
		t.Fatalf("name filter: %+v", byName.Images)
	}
	tagged := must[*ec2.DescribeImagesOutput](t)(s.DescribeImages(bg, &ec2.DescribeImagesInput{Filters: []types.Filter{{Name: ptr("tag:os"), Values: []string{"debian"}}}}))
	if len(tagged.Images) != 1 || *tagged.Images[0].ImageId != *second || deref(tagged.Images[0].BlockDeviceMappings[0].Ebs.VolumeSize) != 30 {
		t.Fatalf("tag filter: %+v", tagged.Images)
	}
	_, err = s.DescribeImages(bg, &ec2.DescribeImagesInput{Owners: []string{"someone"}})
	wantCode(t, err, "InvalidParameterValue")

	// A snapshot an AMI maps stays until the AMI goes.
	_, err = s.DeleteSnapshot(bg, &ec2.DeleteSnapshotInput{SnapshotId: &h.snap})
	wantCode(t, err, "InvalidSnapshot.InUse")
	must[*ec2.DeregisterImageOutput](t)(s.DeregisterImage(bg, &ec2.DeregisterImageInput{ImageId: second}))
	_, err = s.DeregisterImage(bg, &ec2.DeregisterImageInput{ImageId: second})
	wantCode(t, err, "InvalidAMIID.NotFound")
	_, err = s.RunInstances(bg, &ec2.RunInstancesInput{ImageId: second, InstanceType: types.InstanceTypeT3Micro, MinCount: ptr(int32(1)), MaxCount: ptr(int32(1))})
	wantCode(t, err, "InvalidAMIID.NotFound")
	ids := []string{}
	for _, i := range must[*ec2.DescribeImagesOutput](t)(s.DescribeImages(bg, &ec2.DescribeImagesInput{})).Images {
		ids = append(ids, *i.ImageId)
	}
	sort.Strings(ids)
	if len(ids) != 1 || ids[0] != h.image {
		t.Fatalf("images after deregister: %v", ids)
	}
}

func TestCreateAndCopyImage(t *testing.T) {
	h := newInstanceHost(t, 8)
	id := *h.run(t, &ec2.RunInstancesInput{}).Instances[0].InstanceId
	h.vmd.signal(id, api.InstanceStateRunning, "")
	h.waitState(t, id, types.InstanceStateNameRunning)

	// Snapshots complete when ebsd says so; the fake says at once.
	go func() {
		for i := 0; i < 200; i++ {
			h.storage.mu.Lock()
			for sid, sn := range h.storage.snaps {
				sn.State, sn.Progress = api.SnapshotCompleted, 100
				h.storage.snaps[sid] = sn
			}
			h.storage.mu.Unlock()
			time.Sleep(20 * time.Millisecond)
		}
	}()
	img := must[*ec2.CreateImageOutput](t)(h.s.CreateImage(bg, &ec2.CreateImageInput{InstanceId: &id, Name: ptr("web-golden")})).ImageId
	// Without NoReboot the instance is stopped for the snapshots...
	eventually(t, "the instance stopping for the image", func() bool {
		st := h.describe(t, id).State.Name
		return st == types.InstanceStateNameStopping || st == types.InstanceStateNameStopped
	})
	h.vmd.signal(id, api.InstanceStateStopped, "")
	// ...and started again.
	eventually(t, "the instance started again", func() bool { return h.describe(t, id).State.Name == types.InstanceStateNamePending })
	eventually(t, "the image available", func() bool {
		out := must[*ec2.DescribeImagesOutput](t)(h.s.DescribeImages(bg, &ec2.DescribeImagesInput{ImageIds: []string{*img}}))
		return out.Images[0].State == types.ImageStateAvailable
	})
	got := must[*ec2.DescribeImagesOutput](t)(h.s.DescribeImages(bg, &ec2.DescribeImagesInput{ImageIds: []string{*img}})).Images[0]
	if len(got.BlockDeviceMappings) != 1 || deref(got.BlockDeviceMappings[0].Ebs.SnapshotId) == h.snap || deref(got.SourceInstanceId) != id {
		t.Fatalf("image %+v", got)
	}

	cp := must[*ec2.CopyImageOutput](t)(h.s.CopyImage(bg, &ec2.CopyImageInput{SourceImageId: img, SourceRegion: ptr("us-east-1"), Name: ptr("web-copy")})).ImageId
	c := must[*ec2.DescribeImagesOutput](t)(h.s.DescribeImages(bg, &ec2.DescribeImagesInput{ImageIds: []string{*cp}})).Images[0]
	if c.State != types.ImageStateAvailable || deref(c.BlockDeviceMappings[0].Ebs.SnapshotId) == deref(got.BlockDeviceMappings[0].Ebs.SnapshotId) {
		t.Fatalf("copy %+v", c)
	}
	_, err := h.s.CopyImage(bg, &ec2.CopyImageInput{SourceImageId: img, SourceRegion: ptr("eu-west-1"), Name: ptr("x-copy")})
	wantCode(t, err, "InvalidParameterValue")
	// The copy launches.
	h.run(t, &ec2.RunInstancesInput{ImageId: cp})
}

// blockSink records the blocks an import puts.
type blockSink struct {
	mu     sync.Mutex
	blocks map[uint64]int
}

func (b *blockSink) PutBlock(_ context.Context, snap string, index uint64, data []byte, sum string) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.blocks == nil {
		b.blocks = map[uint64]int{}
	}
	b.blocks[index] = len(data)
	return nil
}

func TestImportStarterAMIOnce(t *testing.T) {
	h := newInstanceHost(t, 8)
	dir := t.TempDir()
	disk := dir + "/debian-12-x86_64.raw"
	f, err := os.Create(disk)
	if err != nil {
		t.Fatal(err)
	}
	// A sparse 3 MiB disk with data in blocks 1 and 5 only.
	if err := f.Truncate(3 << 20); err != nil {
		t.Fatal(err)
	}
	for _, off := range []int64{512 << 10, 5*(512<<10) + 7} {
		if _, err := f.WriteAt([]byte("data"), off); err != nil {
			t.Fatal(err)
		}
	}
	f.Close()
	env := dir + "/ami.env"
	if err := os.WriteFile(env, []byte("name=hangar/test-x86_64\ndescription=test\ndisk=/elsewhere/debian-12-x86_64.raw\nboot_mode=uefi\narchitecture=x86_64\nroot_device_name=/dev/xvda\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	sink := &blockSink{}
	if err := h.s.ImportStarterAMI(bg, env, sink); err != nil {
		t.Fatal(err)
	}
	if len(sink.blocks) != 2 || sink.blocks[1] != 512<<10 || sink.blocks[5] != 512<<10 {
		t.Fatalf("blocks put: %v, want 1 and 5 only", sink.blocks)
	}
	out := must[*ec2.DescribeImagesOutput](t)(h.s.DescribeImages(bg, &ec2.DescribeImagesInput{Filters: []types.Filter{{Name: ptr("name"), Values: []string{"hangar/test-x86_64"}}}}))
	if len(out.Images) != 1 || out.Images[0].BootMode != types.BootModeValuesUefi || out.Images[0].State != types.ImageStateAvailable {
		t.Fatalf("images %+v", out.Images)
	}
	if err := h.s.ImportStarterAMI(bg, env, sink); err != nil {
		t.Fatal(err)
	}
	out = must[*ec2.DescribeImagesOutput](t)(h.s.DescribeImages(bg, &ec2.DescribeImagesInput{Filters: []types.Filter{{Name: ptr("name"), Values: []string{"hangar/test-x86_64"}}}}))
	if len(out.Images) != 1 {
		t.Fatalf("a second import made %d images", len(out.Images))
	}
	// It launches.
	h.run(t, &ec2.RunInstancesInput{ImageId: out.Images[0].ImageId})
}
