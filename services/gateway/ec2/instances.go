package ec2

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"

	"hangar.dev/hangar/services/gateway/awserr"
	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/internal/store"
)

var kindInstance = register(&kind{Prefix: instanceKind, ResourceType: types.ResourceTypeInstance, NotFound: "InvalidInstanceID.NotFound", Malformed: "InvalidInstanceID.Malformed", Noun: "instance ID"})

// Compute is what EC2 needs of hangar-vmd; *api.ComputeClient is the real
// one, and tests use a fake.
type Compute interface {
	CreateInstance(ctx context.Context, spec api.InstanceSpec) (api.InstanceInfo, error)
	StartInstance(ctx context.Context, id string) (api.InstanceInfo, error)
	StopInstance(ctx context.Context, id string, force bool, timeoutSec uint32) (api.InstanceInfo, error)
	RebootInstance(ctx context.Context, id string) (api.InstanceInfo, error)
	TerminateInstance(ctx context.Context, id string) (api.InstanceInfo, error)
	DeleteInstance(ctx context.Context, id string) error
	AttachVolume(ctx context.Context, id string, vol api.InstanceDisk) (api.InstanceInfo, error)
	DetachVolume(ctx context.Context, id, volumeID string, force bool) (api.InstanceInfo, error)
	GetConsoleOutput(ctx context.Context, id string, latest bool) (string, int64, error)
	ListInstances(ctx context.Context) ([]api.InstanceInfo, error)
	WatchInstanceStates(ctx context.Context) (<-chan api.InstanceStateChange, error)
}

// SetCompute connects EC2 to hangar-vmd.
func (s *Service) SetCompute(c Compute) { s.compute = c }

// instanceRecord is an instance as stored. Its interfaces, volumes and
// public address live in their own records and join it when described.
type instanceRecord struct {
	types.Instance
	ReservationID         string
	UserData              string // base64, as the API carries it
	ShutdownBehavior      types.ShutdownBehavior
	DisableAPITermination bool
	// PublicKey is the key pair's public half as of launch, which IMDS
	// serves even after the key pair is deleted, as EC2 does.
	PublicKey    string
	TerminatedAt *time.Time
	// CleanedUp is set once a terminated instance's interface and
	// volumes are released; until then reconcile retries the release.
	CleanedUp bool
}

// terminatedRetention is how long EC2 keeps showing a terminated instance.
const terminatedRetention = time.Hour

// maxPerLaunch bounds MaxCount of one RunInstances call.
const maxPerLaunch = 100

// maxUserData is EC2's user data limit: 16 KB before base64.
const maxUserData = 16 << 10

var stateCodes = map[types.InstanceStateName]int32{
	types.InstanceStateNamePending:      0,
	types.InstanceStateNameRunning:      16,
	types.InstanceStateNameShuttingDown: 32,
	types.InstanceStateNameTerminated:   48,
	types.InstanceStateNameStopping:     64,
	types.InstanceStateNameStopped:      80,
}

func instanceState(name types.InstanceStateName) *types.InstanceState {
	return &types.InstanceState{Name: name, Code: ptr(stateCodes[name])}
}

func (r *instanceRecord) state() types.InstanceStateName {
	if r.State == nil {
		return types.InstanceStateNamePending
	}
	return r.State.Name
}

// backends returns the three services a launch needs, or EC2's
// "Unavailable" naming the first missing one.
func (s *Service) backends() (Network, Storage, Compute, error) {
	unavailable := func(svc string) error {
		return awserr.New(503, "Unavailable", "The %s service (hangar-%s) is not running on this host; instances cannot be managed until it is.", map[string]string{"netd": "network", "ebsd": "storage", "vmd": "compute"}[svc], svc)
	}
	switch {
	case s.net == nil:
		return nil, nil, nil, unavailable("netd")
	case s.storage == nil:
		return nil, nil, nil, unavailable("ebsd")
	case s.compute == nil:
		return nil, nil, nil, unavailable("vmd")
	}
	return s.net.net, s.storage, s.compute, nil
}

// computeErr words a vmd error as EC2 would.
func computeErr(err error, id, instanceType string, zone string) error {
	e, ok := api.AsError(err)
	if !ok {
		return fmt.Errorf("calling hangar-vmd for %s: %w", id, err)
	}
	switch e.Name {
	case api.ErrInsufficientCapacity:
		return awserr.New(500, "InsufficientInstanceCapacity", "We currently do not have sufficient %s capacity in the Availability Zone you requested (%s). %s", instanceType, zone, e.Message)
	case api.ErrInvalidArgument:
		return awserr.InvalidParameterValue("%s", e.Message)
	case api.ErrConflict:
		return awserr.New(400, "IncorrectInstanceState", "%s", e.Message)
	case api.ErrNotFound:
		return awserr.New(400, "InvalidInstanceID.NotFound", "The instance ID '%s' does not exist", id)
	case api.ErrUnavailable, "org.freedesktop.DBus.Error.ServiceUnknown", "org.freedesktop.DBus.Error.NameHasNoOwner":
		return awserr.New(503, "Unavailable", "The compute service (hangar-vmd) is not available: %s", e.Message)
	}
	return fmt.Errorf("hangar-vmd refused %s: %w", id, err)
}

// networkErr words a netd error as EC2 would.
func networkErr(err error, id string) error {
	e, ok := api.AsError(err)
	if !ok {
		return fmt.Errorf("calling hangar-netd for %s: %w", id, err)
	}
	switch e.Name {
	case api.ErrInvalidArgument, api.ErrConflict:
		return awserr.InvalidParameterValue("%s", e.Message)
	case api.ErrUnavailable, "org.freedesktop.DBus.Error.ServiceUnknown", "org.freedesktop.DBus.Error.NameHasNoOwner":
		return awserr.New(503, "Unavailable", "The network service (hangar-netd) is not available: %s", e.Message)
	}
	return fmt.Errorf("hangar-netd refused %s: %w", id, err)
}

// runPlan is a RunInstances request checked for everything that does not
// need the records.
type runPlan struct {
	in           *ec2.RunInstancesInput
	min, max     int
	typ          InstanceType
	userData     string
	shutdown     types.ShutdownBehavior
	md           types.InstanceMetadataOptionsResponse
	subnetID     string
	groupIDs     []string
	groupNames   []string
	privateIP    string
	instanceTags []types.Tag
	volumeTags   []types.Tag
	eniTags      []types.Tag
	eniDelete    bool
}

func (s *Service) planRun(in *ec2.RunInstancesInput) (*runPlan, error) {
	p := &runPlan{in: in, eniDelete: true}
	if in.ImageId == nil || *in.ImageId == "" {
		return nil, awserr.MissingParameter("ImageId")
	}
	if in.MinCount == nil {
		return nil, awserr.MissingParameter("MinCount")
	}
	if in.MaxCount == nil {
		return nil, awserr.MissingParameter("MaxCount")
	}
	p.min, p.max = int(*in.MinCount), int(*in.MaxCount)
	if p.min < 1 {
		return nil, awserr.InvalidParameterValue("Value (%d) for parameter minCount is invalid. Expected a positive integer.", p.min)
	}
	if p.max < p.min {
		return nil, awserr.InvalidParameterValue("Value (%d) for parameter maxCount is invalid. Expected a value at least minCount (%d).", p.max, p.min)
	}
	if p.min > maxPerLaunch {
		return nil, awserr.New(400, "InstanceLimitExceeded", "You have requested more instances (%d) than your current instance limit of %d allows for one launch on this host.", p.min, maxPerLaunch)
	}
	if p.max > maxPerLaunch {
		p.max = maxPerLaunch
	}
	name := string(in.InstanceType)
	if name == "" {
		name = "m1.small" // EC2's documented default, which this host does not offer
	}
	t, ok := InstanceTypeInfo(name)
	if !ok {
		return nil, awserr.InvalidParameterValue("Invalid value '%s' for InstanceType. This host offers the types describe-instance-types lists.", clip(name))
	}
	if t.BareMetal {
		return nil, awserr.New(400, "Unsupported", "The requested configuration is currently not supported: %s is a bare-metal type, which cannot run as a guest on this host.", name)
	}
	p.typ = t
	if in.UserData != nil {
		raw, err := base64.StdEncoding.DecodeString(*in.UserData)
		if err != nil {
			return nil, awserr.InvalidParameterValue("Invalid BASE64 encoding of user data.")
		}
		if len(raw) > maxUserData {
			return nil, awserr.InvalidParameterValue("User data is limited to %d bytes; this is %d.", maxUserData, len(raw))
		}
		p.userData = *in.UserData
	}
	switch in.InstanceInitiatedShutdownBehavior {
	case "":
		p.shutdown = types.ShutdownBehaviorStop
	case types.ShutdownBehaviorStop, types.ShutdownBehaviorTerminate:
		p.shutdown = in.InstanceInitiatedShutdownBehavior
	default:
		return nil, awserr.InvalidParameterValue("Value (%s) for parameter instanceInitiatedShutdownBehavior is invalid.", in.InstanceInitiatedShutdownBehavior)
	}
	md, err := metadataOptions(types.InstanceMetadataOptionsResponse{}, in.MetadataOptions)
	if err != nil {
		return nil, err
	}
	p.md = md
	if in.HibernationOptions != nil && deref(in.HibernationOptions.Configured) {
		return nil, awserr.New(400, "UnsupportedHibernationConfiguration", "Hibernation is not supported by hangar.")
	}
	if in.Placement != nil && in.Placement.AvailabilityZone != nil && *in.Placement.AvailabilityZone != s.cfg.AvailabilityZone {
		return nil, awserr.InvalidParameterValue("Invalid availability zone: [%s]; this host serves %s", clip(*in.Placement.AvailabilityZone), s.cfg.AvailabilityZone)
	}
	p.subnetID, p.groupIDs, p.groupNames, p.privateIP = deref(in.SubnetId), in.SecurityGroupIds, in.SecurityGroups, deref(in.PrivateIpAddress)
	if len(in.NetworkInterfaces) > 0 {
		if len(in.NetworkInterfaces) > 1 {
			return nil, awserr.New(400, "Unsupported", "hangar launches instances with one network interface.")
		}
		ni := in.NetworkInterfaces[0]
		if p.subnetID != "" || len(p.groupIDs) > 0 || len(p.groupNames) > 0 || p.privateIP != "" {
			return nil, awserr.InvalidParameterCombination("Network interfaces and an instance-level subnet ID, security groups or private IP address may not be specified on the same request")
		}
		if deref(ni.DeviceIndex) != 0 {
			return nil, awserr.InvalidParameterValue("The first network interface must have device index 0")
		}
		if ni.NetworkInterfaceId != nil {
			return nil, awserr.New(400, "Unsupported", "Launching with an existing network interface is not supported by hangar; give SubnetId instead.")
		}
		p.subnetID, p.groupIDs, p.privateIP = deref(ni.SubnetId), ni.Groups, deref(ni.PrivateIpAddress)
		if ni.DeleteOnTermination != nil {
			p.eniDelete = *ni.DeleteOnTermination
		}
	}
	if p.privateIP != "" && p.max > 1 {
		return nil, awserr.InvalidParameterCombination("Cannot specify a private IP address when launching more than one instance")
	}
	for _, spec := range in.TagSpecifications {
		var target *[]types.Tag
		switch spec.ResourceType {
		case types.ResourceTypeInstance:
			target = &p.instanceTags
		case types.ResourceTypeVolume:
			target = &p.volumeTags
		case types.ResourceTypeNetworkInterface:
			target = &p.eniTags
		case "":
			return nil, awserr.InvalidParameterValue("Tag specification resource type must have a value")
		default:
			return nil, awserr.InvalidParameterValue("'%s' is not a valid taggable resource type for this operation.", spec.ResourceType)
		}
		for _, t := range spec.Tags {
			if err := validateTag(t); err != nil {
				return nil, err
			}
		}
		*target = append(*target, spec.Tags...)
	}
	return p, nil
}

// metadataOptions applies requested IMDS options over cur, checking them
// as EC2 does.
func metadataOptions(cur types.InstanceMetadataOptionsResponse, req *types.InstanceMetadataOptionsRequest) (types.InstanceMetadataOptionsResponse, error) {
	out := cur
	if out.HttpTokens == "" {
		out.HttpTokens = types.HttpTokensStateOptional
	}
	if out.HttpPutResponseHopLimit == nil {
		out.HttpPutResponseHopLimit = ptr(int32(1))
	}
	if out.HttpEndpoint == "" {
		out.HttpEndpoint = types.InstanceMetadataEndpointStateEnabled
	}
	if out.HttpProtocolIpv6 == "" {
		out.HttpProtocolIpv6 = types.InstanceMetadataProtocolStateDisabled
	}
	if out.InstanceMetadataTags == "" {
		out.InstanceMetadataTags = types.InstanceMetadataTagsStateDisabled
	}
	out.State = types.InstanceMetadataOptionsStateApplied
	if req == nil {
		return out, nil
	}
	switch req.HttpTokens {
	case "":
	case types.HttpTokensStateOptional, types.HttpTokensStateRequired:
		out.HttpTokens = types.HttpTokensState(req.HttpTokens)
	default:
		return out, awserr.InvalidParameterValue("Value (%s) for parameter HttpTokens is invalid. Expected optional or required.", req.HttpTokens)
	}
	if req.HttpPutResponseHopLimit != nil {
		if n := *req.HttpPutResponseHopLimit; n < 1 || n > 64 {
			return out, awserr.InvalidParameterValue("Value (%d) for parameter HttpPutResponseHopLimit is invalid. Expected 1 to 64.", n)
		}
		out.HttpPutResponseHopLimit = req.HttpPutResponseHopLimit
	}
	switch req.HttpEndpoint {
	case "":
	case types.InstanceMetadataEndpointStateEnabled, types.InstanceMetadataEndpointStateDisabled:
		out.HttpEndpoint = req.HttpEndpoint
	default:
		return out, awserr.InvalidParameterValue("Value (%s) for parameter HttpEndpoint is invalid. Expected enabled or disabled.", req.HttpEndpoint)
	}
	if req.HttpProtocolIpv6 == types.InstanceMetadataProtocolStateEnabled {
		return out, awserr.New(400, "Unsupported", "IMDS over IPv6 is not supported by hangar.")
	}
	if req.InstanceMetadataTags != "" {
		out.InstanceMetadataTags = req.InstanceMetadataTags
	}
	return out, nil
}

// launchVolume is one volume an instance gets at launch.
type launchVolume struct {
	device   string
	size     int32
	snapshot string
	vtype    types.VolumeType
	iops     *int32
	tput     *int32
	delete   bool
	root     bool
}

// volumesFor works out the volumes of an instance: the image's mappings,
// with the request's overriding them by device name.
func volumesFor(tx *store.Tx, img *imageRecord, req []types.BlockDeviceMapping) ([]launchVolume, error) {
	byDev := map[string]*launchVolume{}
	var order []string
	for _, m := range img.BlockDeviceMappings {
		if m.Ebs == nil {
			continue
		}
		dev := deref(m.DeviceName)
		byDev[dev] = &launchVolume{device: dev, size: deref(m.Ebs.VolumeSize), snapshot: deref(m.Ebs.SnapshotId), vtype: m.Ebs.VolumeType,
			iops: m.Ebs.Iops, tput: m.Ebs.Throughput, delete: deref(m.Ebs.DeleteOnTermination), root: dev == deref(img.RootDeviceName)}
		order = append(order, dev)
	}
	for _, m := range req {
		dev := deref(m.DeviceName)
		if dev == "" {
			return nil, awserr.MissingParameter("BlockDeviceMapping.DeviceName")
		}
		if !validDevice.MatchString(dev) {
			return nil, awserr.InvalidParameterValue("Invalid device name %s", clip(dev))
		}
		if m.NoDevice != nil {
			if dev == deref(img.RootDeviceName) {
				return nil, awserr.InvalidParameterValue("The root device %s cannot be suppressed with NoDevice", dev)
			}
			delete(byDev, dev)
			continue
		}
		if m.VirtualName != nil {
			continue // instance store: none of the offered types has any
		}
		if m.Ebs == nil {
			return nil, awserr.InvalidParameterValue("Block device mapping %s needs Ebs, NoDevice or VirtualName", dev)
		}
		if deref(m.Ebs.Encrypted) || m.Ebs.KmsKeyId != nil {
			return nil, awserr.New(400, "Unsupported", "Encrypted volumes are not supported by hangar.")
		}
		v := byDev[dev]
		if v == nil {
			v = &launchVolume{device: dev, delete: true, vtype: types.VolumeTypeGp3}
			byDev[dev] = v
			order = append(order, dev)
		}
		if snap := deref(m.Ebs.SnapshotId); snap != "" && snap != v.snapshot {
			if v.root {
				return nil, awserr.InvalidParameterValue("The snapshot of the root device %s comes from the image and cannot be changed", dev)
			}
			rec, err := get[snapshotRecord](tx, kindSnapshot, snap)
			if err != nil {
				return nil, err
			}
			if rec.State != types.SnapshotStateCompleted {
				return nil, awserr.New(400, "IncorrectState", "Snapshot '%s' is %s; launch from a completed snapshot", snap, rec.State)
			}
			v.snapshot, v.size = snap, deref(rec.VolumeSize)
		}
		if m.Ebs.VolumeSize != nil {
			v.size = *m.Ebs.VolumeSize
		}
		if m.Ebs.VolumeType != "" {
			v.vtype = m.Ebs.VolumeType
		}
		if m.Ebs.Iops != nil {
			v.iops = m.Ebs.Iops
		}
		if m.Ebs.Throughput != nil {
			v.tput = m.Ebs.Throughput
		}
		if m.Ebs.DeleteOnTermination != nil {
			v.delete = *m.Ebs.DeleteOnTermination
		}
	}
	var out []launchVolume
	for _, dev := range order {
		v := byDev[dev]
		if v == nil {
			continue
		}
		if v.size == 0 {
			return nil, awserr.MissingParameter("BlockDeviceMapping.Ebs.VolumeSize for " + dev)
		}
		if v.snapshot != "" {
			snap, err := get[snapshotRecord](tx, kindSnapshot, v.snapshot)
			if err != nil {
				return nil, err
			}
			if v.size < deref(snap.VolumeSize) {
				return nil, awserr.InvalidParameterValue("Volume of size %dGiB is smaller than snapshot '%s', expect size >= %dGiB", v.size, v.snapshot, deref(snap.VolumeSize))
			}
		}
		spec, err := checkVolumeSpec(v.size, v.vtype, v.iops, v.tput)
		if err != nil {
			return nil, err
		}
		v.vtype, v.iops, v.tput = spec.vtype, spec.iops, spec.throughput
		out = append(out, *v)
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].root && !out[j].root })
	if len(out) == 0 || !out[0].root {
		return nil, awserr.InvalidParameterValue("Image %s has no root volume mapping", deref(img.ImageId))
	}
	return out, nil
}

// launchSubnet resolves where an instance goes: the named subnet, or the
// default subnet of the default VPC, as EC2 does without --subnet-id.
func (s *Service) launchSubnet(tx *store.Tx, id string) (*subnetRecord, error) {
	if id != "" {
		return get[subnetRecord](tx, kindSubnet, id)
	}
	vpc := defaultVPC(tx)
	if vpc == "" {
		return nil, awserr.New(400, "VPCIdNotSpecified", "No default VPC for this user. Give --subnet-id.")
	}
	subnets, err := all(tx, kindSubnet, func(_ string, sn *subnetRecord) bool {
		return deref(sn.VpcId) == vpc && deref(sn.DefaultForAz)
	})
	if err != nil {
		return nil, err
	}
	for _, id := range sortedKeys(subnets) {
		return subnets[id], nil
	}
	return nil, awserr.New(400, "MissingInput", "No subnets found for the default VPC '%s'. Please specify a subnet.", vpc)
}

// launchGroups resolves the security groups of a launch within the VPC.
func launchGroups(tx *store.Tx, vpcID, subnetID string, ids, names []string) ([]types.GroupIdentifier, error) {
	var out []types.GroupIdentifier
	seen := map[string]bool{}
	add := func(g *securityGroupRecord) {
		if !seen[g.GroupID] {
			seen[g.GroupID] = true
			out = append(out, types.GroupIdentifier{GroupId: ptr(g.GroupID), GroupName: ptr(g.GroupName)})
		}
	}
	for _, id := range ids {
		g, err := get[securityGroupRecord](tx, kindSecurityGroup, id)
		if err != nil {
			return nil, err
		}
		if g.VpcID != vpcID {
			return nil, awserr.InvalidParameter("Security group %s and subnet %s belong to different networks.", id, subnetID)
		}
		add(g)
	}
	for _, name := range names {
		g, err := groupInVPC(tx, vpcID, name)
		if err != nil {
			return nil, err
		}
		add(g)
	}
	if len(out) == 0 {
		v, err := get[vpcRecord](tx, kindVPC, vpcID)
		if err != nil {
			return nil, err
		}
		g, err := get[securityGroupRecord](tx, kindSecurityGroup, v.DefaultSecurityGroup)
		if err != nil {
			return nil, err
		}
		add(g)
	}
	return out, nil
}

// reserveLaunch writes the records of every instance of a launch (pending
// instances, their interfaces with addresses, their volumes "creating") in
// one transaction, so a request that fails validation leaves nothing and
// concurrent launches cannot take the same address.
func (s *Service) reserveLaunch(tx *store.Tx, p *runPlan) ([]string, error) {
	img, err := imageForLaunch(tx, *p.in.ImageId)
	if err != nil {
		return nil, err
	}
	sn, err := s.launchSubnet(tx, p.subnetID)
	if err != nil {
		return nil, err
	}
	vpcID := deref(sn.VpcId)
	groups, err := launchGroups(tx, vpcID, *sn.SubnetId, p.groupIDs, p.groupNames)
	if err != nil {
		return nil, err
	}
	var key *keyPairRecord
	if p.in.KeyName != nil {
		if key, err = keyPairByName(tx, *p.in.KeyName); err != nil {
			return nil, err
		}
	}
	vols, err := volumesFor(tx, img, p.in.BlockDeviceMappings)
	if err != nil {
		return nil, err
	}
	reservation, err := newID(tx, "r")
	if err != nil {
		return nil, err
	}
	now := s.now().UTC()
	var ids []string
	for i := 0; i < p.max; i++ {
		want := ""
		if i == 0 {
			want = p.privateIP
		}
		ip, err := allocateAddress(tx, sn, want)
		if err != nil {
			if i >= p.min && awserr.As(err).Code == "InsufficientFreeAddressesInSubnet" {
				break // EC2 launches as many as it can, at least MinCount
			}
			return nil, err
		}
		id, err := newID(tx, kindInstance.Prefix)
		if err != nil {
			return nil, err
		}
		eni, err := s.createENI(tx, sn, id, groups, ip, p.eniDelete)
		if err != nil {
			return nil, err
		}
		if len(p.eniTags) > 0 {
			if err := addTags(tx, *eni.NetworkInterfaceId, p.eniTags); err != nil {
				return nil, err
			}
		}
		var bdm []types.InstanceBlockDeviceMapping
		for _, lv := range vols {
			volID, err := newID(tx, kindVolume.Prefix)
			if err != nil {
				return nil, err
			}
			v := &volumeRecord{types.Volume{
				VolumeId: ptr(volID), Size: ptr(lv.size), SnapshotId: ptr(lv.snapshot), AvailabilityZone: sn.AvailabilityZone,
				State: types.VolumeStateCreating, CreateTime: &now, VolumeType: lv.vtype, Iops: lv.iops, Throughput: lv.tput,
				Encrypted: ptr(false), MultiAttachEnabled: ptr(false),
				Attachments: []types.VolumeAttachment{{VolumeId: ptr(volID), InstanceId: ptr(id), Device: ptr(lv.device),
					State: types.VolumeAttachmentStateAttaching, AttachTime: &now, DeleteOnTermination: ptr(lv.delete)}},
			}}
			if err := put(tx, kindVolume, volID, v); err != nil {
				return nil, err
			}
			if len(p.volumeTags) > 0 {
				if err := addTags(tx, volID, p.volumeTags); err != nil {
					return nil, err
				}
			}
			bdm = append(bdm, types.InstanceBlockDeviceMapping{DeviceName: ptr(lv.device)})
		}
		rec := &instanceRecord{
			Instance: types.Instance{
				InstanceId:               ptr(id),
				ImageId:                  img.ImageId,
				InstanceType:             types.InstanceType(p.typ.Name),
				KeyName:                  p.in.KeyName,
				LaunchTime:               &now,
				Placement:                &types.Placement{AvailabilityZone: sn.AvailabilityZone, Tenancy: types.TenancyDefault, GroupName: ptr("")},
				PrivateDnsName:           eni.PrivateDnsName,
				PrivateIpAddress:         eni.PrivateIpAddress,
				SubnetId:                 sn.SubnetId,
				VpcId:                    sn.VpcId,
				State:                    instanceState(types.InstanceStateNamePending),
				StateTransitionReason:    ptr(""),
				Architecture:             img.Architecture,
				AmiLaunchIndex:           ptr(int32(i)),
				ClientToken:              p.in.ClientToken,
				EbsOptimized:             ptr(deref(p.in.EbsOptimized)),
				EnaSupport:               ptr(true),
				Hypervisor:               types.HypervisorTypeXen,
				RootDeviceName:           img.RootDeviceName,
				RootDeviceType:           types.DeviceTypeEbs,
				SecurityGroups:           groups,
				SourceDestCheck:          ptr(true),
				VirtualizationType:       types.VirtualizationTypeHvm,
				BootMode:                 img.BootMode,
				CurrentInstanceBootMode:  types.InstanceBootModeValues(img.BootMode),
				Monitoring:               &types.Monitoring{State: types.MonitoringStateDisabled},
				CpuOptions:               &types.CpuOptions{CoreCount: ptr(p.typ.Cores), ThreadsPerCore: ptr(p.typ.ThreadsPerCore)},
				MetadataOptions:          &p.md,
				PlatformDetails:          ptr("Linux/UNIX"),
				UsageOperation:           ptr("RunInstances"),
				UsageOperationUpdateTime: &now,
				PrivateDnsNameOptions: &types.PrivateDnsNameOptionsResponse{HostnameType: types.HostnameTypeIpName,
					EnableResourceNameDnsARecord: ptr(false), EnableResourceNameDnsAAAARecord: ptr(false)},
				MaintenanceOptions:               &types.InstanceMaintenanceOptions{AutoRecovery: types.InstanceAutoRecoveryStateDefault},
				HibernationOptions:               &types.HibernationOptions{Configured: ptr(false)},
				EnclaveOptions:                   &types.EnclaveOptions{Enabled: ptr(false)},
				CapacityReservationSpecification: &types.CapacityReservationSpecificationResponse{CapacityReservationPreference: types.CapacityReservationPreferenceOpen},
				BlockDeviceMappings:              bdm,
				ProductCodes:                     []types.ProductCode{},
			},
			ReservationID:    reservation,
			UserData:         p.userData,
			ShutdownBehavior: p.shutdown,
		}
		if p.in.DisableApiTermination != nil {
			rec.DisableAPITermination = *p.in.DisableApiTermination
		}
		if key != nil {
			rec.PublicKey = key.PublicKey
		}
		if rec.IamInstanceProfile, err = s.launchProfile(tx, id, p.in.IamInstanceProfile); err != nil {
			return nil, err
		}
		if err := put(tx, kindInstance, id, rec); err != nil {
			return nil, err
		}
		if len(p.instanceTags) > 0 {
			if err := addTags(tx, id, p.instanceTags); err != nil {
				return nil, err
			}
		}
		ids = append(ids, id)
	}
	return ids, nil
}

// RunInstances launches instances: records first, then netd (interface,
// metadata), ebsd (volumes), vmd (the guest), each call idempotent by the
// ids the records hold. As many instances as the host has room for are
// launched, between MinCount and MaxCount; below MinCount nothing is left
// behind.
func (s *Service) RunInstances(ctx context.Context, in *ec2.RunInstancesInput) (*ec2.RunInstancesOutput, error) {
	p, err := s.planRun(in)
	if err != nil {
		return nil, err
	}
	if _, _, _, err := s.backends(); err != nil {
		return nil, err
	}
	var ids []string
	if err := s.db.Update(func(tx *store.Tx) (err error) { ids, err = s.reserveLaunch(tx, p); return err }); err != nil {
		return nil, err
	}
	var launched []string
	for i, id := range ids {
		err := s.launch(ctx, id)
		if err == nil {
			launched = append(launched, id)
			continue
		}
		s.log.Warn("launch failed; undoing it", "instance", id, "err", err)
		s.undoLaunch(context.WithoutCancel(ctx), id)
		if awserr.As(err).Code == "InsufficientInstanceCapacity" && i >= p.min {
			for _, rest := range ids[i+1:] {
				s.undoLaunch(context.WithoutCancel(ctx), rest)
			}
			break
		}
		for _, other := range append(launched, ids[i+1:]...) {
			s.undoLaunch(context.WithoutCancel(ctx), other)
		}
		return nil, err
	}
	out := &ec2.RunInstancesOutput{OwnerId: ptr(s.account()), Groups: []types.GroupIdentifier{}, Instances: []types.Instance{}}
	err = s.db.View(func(tx *store.Tx) error {
		j := newJoin(tx)
		for _, id := range launched {
			rec, err := get[instanceRecord](tx, kindInstance, id)
			if err != nil {
				return err
			}
			out.ReservationId = ptr(rec.ReservationID)
			out.Instances = append(out.Instances, s.instanceView(rec, tagsOf(tx, id), j))
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	s.log.Info("launched instances", "instances", strings.Join(launched, ","), "type", in.InstanceType, "image", deref(in.ImageId))
	return out, nil
}

// instanceParts is what launching or describing an instance reads.
type instanceParts struct {
	rec     *instanceRecord
	enis    []*eniRecord
	volumes []*volumeRecord // root first, then by device name
}

func readInstance(tx *store.Tx, id string) (*instanceParts, error) {
	rec, err := get[instanceRecord](tx, kindInstance, id)
	if err != nil {
		return nil, err
	}
	enis, err := instanceENIs(tx, id)
	if err != nil {
		return nil, err
	}
	vols, err := instanceVolumes(tx, id)
	if err != nil {
		return nil, err
	}
	sort.SliceStable(vols, func(i, j int) bool {
		ri := deref(vols[i].Attachments[0].Device) == deref(rec.RootDeviceName)
		rj := deref(vols[j].Attachments[0].Device) == deref(rec.RootDeviceName)
		if ri != rj {
			return ri
		}
		return deref(vols[i].Attachments[0].Device) < deref(vols[j].Attachments[0].Device)
	})
	return &instanceParts{rec: rec, enis: enis, volumes: vols}, nil
}

func instanceVolumes(tx *store.Tx, id string) ([]*volumeRecord, error) {
	m, err := all(tx, kindVolume, func(_ string, v *volumeRecord) bool {
		return len(v.Attachments) > 0 && deref(v.Attachments[0].InstanceId) == id
	})
	if err != nil {
		return nil, err
	}
	out := make([]*volumeRecord, 0, len(m))
	for _, k := range sortedKeys(m) {
		out = append(out, m[k])
	}
	return out, nil
}

// launch makes the instance's records real: interface and metadata in
// netd, volumes in ebsd, the guest in vmd. Every step is idempotent, so a
// launch interrupted by a restart is finished by calling it again.
func (s *Service) launch(ctx context.Context, id string) error {
	netw, storage, compute, err := s.backends()
	if err != nil {
		return err
	}
	var parts *instanceParts
	if err := s.db.View(func(tx *store.Tx) (err error) { parts, err = readInstance(tx, id); return err }); err != nil {
		return err
	}
	rec := parts.rec
	if len(parts.enis) == 0 {
		return fmt.Errorf("instance %s has no network interface record", id)
	}
	// The VPC's network first (its bridge, the group rules and this
	// interface are all in the pushed state).
	if err := s.net.syncNow(ctx, deref(rec.VpcId)); err != nil {
		return networkErr(err, id)
	}
	spec := api.InstanceSpec{
		ID:               id,
		InstanceType:     string(rec.InstanceType),
		BootMode:         string(rec.BootMode),
		ShutdownBehavior: string(rec.ShutdownBehavior),
	}
	if t, ok := InstanceTypeInfo(string(rec.InstanceType)); ok {
		spec.VCPUs, spec.MemoryMiB = uint32(t.VCPUs), uint32(t.MemoryMiB)
	}
	for _, eni := range parts.enis {
		info, err := netw.AllocateInterface(ctx, eni.spec())
		if err != nil {
			return networkErr(err, id)
		}
		spec.NICs = append(spec.NICs, api.InstanceNIC{ID: deref(eni.NetworkInterfaceId), Tap: info.Tap, MAC: deref(eni.MacAddress), Namespace: info.Namespace})
	}
	if err := s.pushMetadata(ctx, id); err != nil {
		return networkErr(err, id)
	}
	for _, v := range parts.volumes {
		volID := deref(v.VolumeId)
		dev := deref(v.Attachments[0].Device)
		info, err := storage.CreateVolume(ctx, volID, uint64(deref(v.Size))*gib, deref(v.SnapshotId))
		if err != nil {
			return storageErr(err, volID)
		}
		if info, err = storage.AttachVolume(ctx, volID, id, dev); err != nil {
			return storageErr(err, volID)
		}
		// ebsd names each volume's NBD export after the volume.
		disk := api.InstanceDisk{ID: volID, Socket: info.ExportSocket, Export: volID, DeviceName: dev}
		if dev == deref(rec.RootDeviceName) {
			spec.RootVolume = disk
		} else {
			spec.Volumes = append(spec.Volumes, disk)
		}
		if v.State == types.VolumeStateCreating {
			err := s.db.Update(func(tx *store.Tx) error {
				cur, err := get[volumeRecord](tx, kindVolume, volID)
				if err != nil {
					return err
				}
				cur.State = types.VolumeStateInUse
				cur.Attachments[0].State = types.VolumeAttachmentStateAttached
				return put(tx, kindVolume, volID, cur)
			})
			if err != nil {
				return err
			}
		}
	}
	info, err := compute.CreateInstance(ctx, spec)
	if err != nil {
		return computeErr(err, id, string(rec.InstanceType), s.cfg.AvailabilityZone)
	}
	return s.applyState(ctx, id, info.State, info.StateReason)
}

// undoLaunch takes back whatever a failed launch made, in every service,
// and its records. Errors are logged: the records go regardless, and what
// netd and ebsd still hold is found by their own reconciles.
func (s *Service) undoLaunch(ctx context.Context, id string) {
	netw, storage, compute, err := s.backends()
	if err != nil {
		return
	}
	var parts *instanceParts
	if err := s.db.View(func(tx *store.Tx) (err error) { parts, err = readInstance(tx, id); return err }); err != nil {
		return
	}
	if _, err := compute.TerminateInstance(ctx, id); err != nil && !api.IsName(err, api.ErrNotFound) {
		s.log.Warn("undo: terminating in vmd", "instance", id, "err", err)
	}
	if err := compute.DeleteInstance(ctx, id); err != nil && !api.IsName(err, api.ErrNotFound) {
		s.log.Warn("undo: deleting in vmd", "instance", id, "err", err)
	}
	for _, v := range parts.volumes {
		volID := deref(v.VolumeId)
		if _, err := storage.DetachVolume(ctx, volID, id); err != nil && !api.IsName(err, api.ErrNotFound) {
			s.log.Warn("undo: detaching volume", "volume", volID, "err", err)
		}
		if err := storage.DeleteVolume(ctx, volID); err != nil && !api.IsName(err, api.ErrNotFound) {
			s.log.Warn("undo: deleting volume", "volume", volID, "err", err)
		}
	}
	for _, eni := range parts.enis {
		eniID := deref(eni.NetworkInterfaceId)
		_ = netw.ClearInstanceMetadata(ctx, eniID)
		if err := netw.ReleaseInterface(ctx, eniID); err != nil && !api.IsName(err, api.ErrNotFound) {
			s.log.Warn("undo: releasing interface", "eni", eniID, "err", err)
		}
	}
	err = s.db.Update(func(tx *store.Tx) error {
		for _, v := range parts.volumes {
			if err := remove(tx, kindVolume, deref(v.VolumeId)); err != nil {
				return err
			}
		}
		for _, eni := range parts.enis {
			if err := deleteENI(tx, deref(eni.NetworkInterfaceId)); err != nil {
				return err
			}
		}
		return remove(tx, kindInstance, id)
	})
	if err != nil {
		s.log.Error("undo: removing records", "instance", id, "err", err)
	}
}

// pushMetadata sends what IMDS serves to the instance's primary interface.
func (s *Service) pushMetadata(ctx context.Context, id string) error {
	if s.net == nil {
		return nil
	}
	var (
		md  api.InstanceMetadata
		eni string
	)
	err := s.db.View(func(tx *store.Tx) error {
		parts, err := readInstance(tx, id)
		if err != nil {
			return err
		}
		if len(parts.enis) == 0 {
			return nil
		}
		eni = deref(parts.enis[0].NetworkInterfaceId)
		md = s.metadata(tx, parts)
		return nil
	})
	if err != nil || eni == "" {
		return err
	}
	return s.net.net.SetInstanceMetadata(ctx, eni, md)
}

func (s *Service) metadata(tx *store.Tx, parts *instanceParts) api.InstanceMetadata {
	rec := parts.rec
	md := api.InstanceMetadata{
		InstanceID:       deref(rec.InstanceId),
		AmiID:            deref(rec.ImageId),
		InstanceType:     string(rec.InstanceType),
		AccountID:        s.account(),
		Region:           s.cfg.Region,
		AvailabilityZone: s.cfg.AvailabilityZone,
		ReservationID:    rec.ReservationID,
		HttpTokens:       "optional",
		HttpEndpoint:     "enabled",
	}
	if rec.LaunchTime != nil {
		md.LaunchTime = rec.LaunchTime.Unix()
	}
	for _, g := range rec.SecurityGroups {
		md.SecurityGroups = append(md.SecurityGroups, deref(g.GroupName))
	}
	if rec.PublicKey != "" {
		md.PublicKeys = []api.PublicKey{{Name: deref(rec.KeyName), OpenSSH: rec.PublicKey}}
	}
	if rec.UserData != "" {
		md.UserData, _ = base64.StdEncoding.DecodeString(rec.UserData)
	}
	if o := rec.MetadataOptions; o != nil {
		md.HttpTokens = string(o.HttpTokens)
		md.HttpEndpoint = string(o.HttpEndpoint)
		md.HttpPutResponseHopLimit = uint32(deref(o.HttpPutResponseHopLimit))
	}
	if len(parts.enis) > 0 {
		if addrs, err := addressesByENI(tx); err == nil {
			if a, ok := addrs[deref(parts.enis[0].NetworkInterfaceId)]; ok {
				md.PublicIPv4 = deref(a.PublicIp)
			}
		}
	}
	s.instanceIdentity(tx, parts, &md)
	return md
}

// applyState records a state vmd reported. A terminated instance's
// interface and volumes are released as EC2 releases them.
func (s *Service) applyState(ctx context.Context, id, state, reason string) error {
	name := types.InstanceStateName(state)
	if _, ok := stateCodes[name]; !ok {
		return fmt.Errorf("vmd reported unknown state %q for %s", state, id)
	}
	changed := false
	err := s.db.Update(func(tx *store.Tx) error {
		rec, err := get[instanceRecord](tx, kindInstance, id)
		if err != nil {
			return nil // a launch undone meanwhile
		}
		prev := rec.state()
		if prev == types.InstanceStateNameTerminated || prev == name {
			return nil
		}
		// A call's answer can arrive after the signal that overtook it
		// (CreateInstance answers pending; vmd signals running): never
		// step back from the state that followed.
		if name == types.InstanceStateNamePending && prev == types.InstanceStateNameRunning ||
			name == types.InstanceStateNameStopping && prev == types.InstanceStateNameStopped ||
			name == types.InstanceStateNameShuttingDown && prev == types.InstanceStateNameTerminated {
			return nil
		}
		now := s.now().UTC()
		rec.State = instanceState(name)
		code, msg := splitReason(reason)
		if code != "" {
			rec.StateReason = &types.StateReason{Code: ptr(code), Message: ptr(msg)}
		}
		switch name {
		case types.InstanceStateNameRunning, types.InstanceStateNamePending:
			rec.StateReason = nil
			rec.StateTransitionReason = ptr("")
		case types.InstanceStateNameStopped, types.InstanceStateNameStopping, types.InstanceStateNameShuttingDown, types.InstanceStateNameTerminated:
			if strings.HasPrefix(code, "Client.InstanceInitiated") {
				rec.StateTransitionReason = ptr(msg)
			} else {
				rec.StateTransitionReason = ptr(fmt.Sprintf("User initiated (%s)", now.Format("2006-01-02 15:04:05 GMT")))
			}
		}
		if name == types.InstanceStateNameTerminated {
			rec.TerminatedAt = &now
		}
		changed = true
		return put(tx, kindInstance, id, rec)
	})
	if err != nil {
		return err
	}
	if changed {
		s.log.Info("instance state", "instance", id, "state", state, "reason", reason)
	}
	if name == types.InstanceStateNameTerminated {
		return s.cleanupTerminated(ctx, id)
	}
	return nil
}

// splitReason splits vmd's "Code: message" state reason.
func splitReason(r string) (code, msg string) {
	if r == "" {
		return "", ""
	}
	code, _, _ = strings.Cut(r, ":")
	return strings.TrimSpace(code), r
}

// cleanupTerminated releases a terminated instance's interface (and any
// Elastic IP on it) and its volumes: DeleteOnTermination ones are deleted,
// the others detached. It is idempotent and retried by reconcile.
func (s *Service) cleanupTerminated(ctx context.Context, id string) error {
	netw, storage, _, err := s.backends()
	if err != nil {
		return err
	}
	var parts *instanceParts
	if err := s.db.View(func(tx *store.Tx) (err error) { parts, err = readInstance(tx, id); return err }); err != nil {
		return nil
	}
	if parts.rec.CleanedUp {
		return nil
	}
	var failed error
	for _, eni := range parts.enis {
		eniID := deref(eni.NetworkInterfaceId)
		_ = netw.ClearInstanceMetadata(ctx, eniID)
		if err := netw.ReleaseInterface(ctx, eniID); err != nil && !api.IsName(err, api.ErrNotFound) {
			failed = errors.Join(failed, networkErr(err, eniID))
		}
	}
	deleted := map[string]bool{}
	for _, v := range parts.volumes {
		volID := deref(v.VolumeId)
		if _, err := storage.DetachVolume(ctx, volID, id); err != nil && !api.IsName(err, api.ErrNotFound) {
			failed = errors.Join(failed, storageErr(err, volID))
			continue
		}
		if deref(v.Attachments[0].DeleteOnTermination) {
			if err := storage.DeleteVolume(ctx, volID); err != nil && !api.IsName(err, api.ErrNotFound) {
				failed = errors.Join(failed, storageErr(err, volID))
				continue
			}
			deleted[volID] = true
		}
	}
	err = s.db.Update(func(tx *store.Tx) error {
		rec, err := get[instanceRecord](tx, kindInstance, id)
		if err != nil {
			return err
		}
		for _, v := range parts.volumes {
			volID := deref(v.VolumeId)
			if deleted[volID] {
				if err := remove(tx, kindVolume, volID); err != nil {
					return err
				}
				continue
			}
			cur, err := get[volumeRecord](tx, kindVolume, volID)
			if err != nil {
				continue
			}
			cur.Attachments = []types.VolumeAttachment{}
			cur.State = types.VolumeStateAvailable
			if err := put(tx, kindVolume, volID, cur); err != nil {
				return err
			}
		}
		if failed != nil {
			return put(tx, kindInstance, id, rec)
		}
		for _, eni := range parts.enis {
			if err := disassociateENI(tx, deref(eni.NetworkInterfaceId)); err != nil {
				return err
			}
			if err := deleteENI(tx, deref(eni.NetworkInterfaceId)); err != nil {
				return err
			}
		}
		// EC2 shows no addresses on a terminated instance.
		rec.PrivateIpAddress, rec.PrivateDnsName = nil, ptr("")
		rec.CleanedUp = true
		return put(tx, kindInstance, id, rec)
	})
	if err != nil {
		return err
	}
	return failed
}

// disassociateENI drops the Elastic IP association of an interface, as EC2
// does when the instance terminates.
func disassociateENI(tx *store.Tx, eniID string) error {
	addrs, err := all(tx, kindAddress, func(_ string, a *addressRecord) bool { return deref(a.NetworkInterfaceId) == eniID })
	if err != nil {
		return err
	}
	for id, a := range addrs {
		a.AssociationId, a.InstanceId, a.NetworkInterfaceId, a.NetworkInterfaceOwnerId, a.PrivateIpAddress = nil, nil, nil, nil, nil
		a.NetworkVpcID = ""
		if err := put(tx, kindAddress, id, a); err != nil {
			return err
		}
	}
	return nil
}

// join holds what describing many instances needs, read once per call.
type join struct {
	enis  map[string][]*eniRecord    // by instance
	vols  map[string][]*volumeRecord // by instance
	addrs map[string]*addressRecord  // by interface
}

func newJoin(tx *store.Tx) *join {
	j := &join{enis: map[string][]*eniRecord{}, vols: map[string][]*volumeRecord{}}
	_ = tx.Each(kindENI.Prefix, "", func(_ string, decode func(any) error) (bool, error) {
		var r eniRecord
		if err := decode(&r); err == nil && r.Attachment != nil {
			j.enis[deref(r.Attachment.InstanceId)] = append(j.enis[deref(r.Attachment.InstanceId)], &r)
		}
		return true, nil
	})
	_ = tx.Each(kindVolume.Prefix, "", func(_ string, decode func(any) error) (bool, error) {
		var v volumeRecord
		if err := decode(&v); err == nil && len(v.Attachments) > 0 {
			inst := deref(v.Attachments[0].InstanceId)
			j.vols[inst] = append(j.vols[inst], &v)
		}
		return true, nil
	})
	j.addrs, _ = addressesByENI(tx)
	return j
}

// instanceView renders an instance as DescribeInstances shows it.
func (s *Service) instanceView(rec *instanceRecord, tags []types.Tag, j *join) types.Instance {
	out := rec.Instance
	out.Tags = tags
	out.NetworkInterfaces = []types.InstanceNetworkInterface{}
	out.BlockDeviceMappings = []types.InstanceBlockDeviceMapping{}
	out.PublicDnsName = ptr("")
	for _, eni := range j.enis[deref(rec.InstanceId)] {
		ni := types.InstanceNetworkInterface{
			NetworkInterfaceId: eni.NetworkInterfaceId, SubnetId: eni.SubnetId, VpcId: eni.VpcId, Description: eni.Description,
			Groups: eni.Groups, MacAddress: eni.MacAddress, OwnerId: eni.OwnerId, PrivateDnsName: eni.PrivateDnsName,
			PrivateIpAddress: eni.PrivateIpAddress, SourceDestCheck: eni.SourceDestCheck, Status: eni.Status,
			InterfaceType: ptr(string(eni.InterfaceType)), Ipv6Addresses: []types.InstanceIpv6Address{},
			Attachment: &types.InstanceNetworkInterfaceAttachment{
				AttachmentId: eni.Attachment.AttachmentId, AttachTime: eni.Attachment.AttachTime,
				DeleteOnTermination: eni.Attachment.DeleteOnTermination, DeviceIndex: eni.Attachment.DeviceIndex,
				NetworkCardIndex: eni.Attachment.NetworkCardIndex, Status: eni.Attachment.Status,
			},
		}
		var assoc *types.InstanceNetworkInterfaceAssociation
		if a, ok := j.addrs[deref(eni.NetworkInterfaceId)]; ok {
			assoc = &types.InstanceNetworkInterfaceAssociation{PublicIp: a.PublicIp, PublicDnsName: ptr(""), IpOwnerId: ptr(s.account())}
			ni.Association = assoc
			if deref(eni.Attachment.DeviceIndex) == 0 {
				out.PublicIpAddress = a.PublicIp
			}
		}
		for _, pa := range eni.PrivateIpAddresses {
			ni.PrivateIpAddresses = append(ni.PrivateIpAddresses, types.InstancePrivateIpAddress{
				Primary: pa.Primary, PrivateIpAddress: pa.PrivateIpAddress, PrivateDnsName: pa.PrivateDnsName, Association: assoc,
			})
		}
		out.NetworkInterfaces = append(out.NetworkInterfaces, ni)
	}
	vols := j.vols[deref(rec.InstanceId)]
	root := deref(rec.RootDeviceName)
	sort.Slice(vols, func(a, b int) bool {
		da, db := deref(vols[a].Attachments[0].Device), deref(vols[b].Attachments[0].Device)
		if (da == root) != (db == root) {
			return da == root // the root device first, as EC2 lists it
		}
		return da < db
	})
	for _, v := range vols {
		a := v.Attachments[0]
		status := types.AttachmentStatusAttached
		if a.State == types.VolumeAttachmentStateAttaching {
			status = types.AttachmentStatusAttaching
		} else if a.State == types.VolumeAttachmentStateDetaching {
			status = types.AttachmentStatusDetaching
		}
		out.BlockDeviceMappings = append(out.BlockDeviceMappings, types.InstanceBlockDeviceMapping{
			DeviceName: a.Device,
			Ebs:        &types.EbsInstanceBlockDevice{VolumeId: v.VolumeId, Status: status, AttachTime: a.AttachTime, DeleteOnTermination: a.DeleteOnTermination},
		})
	}
	return out
}

// visible reports whether DescribeInstances still shows an instance: EC2
// keeps terminated instances for about an hour.
func (s *Service) visible(rec *instanceRecord) bool {
	return rec.TerminatedAt == nil || s.now().Sub(*rec.TerminatedAt) < terminatedRetention
}

func instanceFilters(s *Service, j func() *join) filterSet[instanceRecord] {
	str := func(get func(r *instanceRecord) *string) func(*instanceRecord) []string {
		return func(r *instanceRecord) []string { return []string{deref(get(r))} }
	}
	enis := func(get func(e *eniRecord) []string) func(*instanceRecord) []string {
		return func(r *instanceRecord) []string {
			var out []string
			for _, e := range j().enis[deref(r.InstanceId)] {
				out = append(out, get(e)...)
			}
			return out
		}
	}
	vols := func(get func(v *volumeRecord) string) func(*instanceRecord) []string {
		return func(r *instanceRecord) []string {
			var out []string
			for _, v := range j().vols[deref(r.InstanceId)] {
				out = append(out, get(v))
			}
			return out
		}
	}
	groups := func(get func(g types.GroupIdentifier) string) func(*instanceRecord) []string {
		return func(r *instanceRecord) []string {
			var out []string
			for _, g := range r.SecurityGroups {
				out = append(out, get(g))
			}
			return out
		}
	}
	return filterSet[instanceRecord]{
		"ami-launch-index":                           func(r *instanceRecord) []string { return []string{fmt.Sprint(deref(r.AmiLaunchIndex))} },
		"architecture":                               func(r *instanceRecord) []string { return []string{string(r.Architecture)} },
		"availability-zone":                          func(r *instanceRecord) []string { return []string{deref(r.Placement.AvailabilityZone)} },
		"block-device-mapping.device-name":           vols(func(v *volumeRecord) string { return deref(v.Attachments[0].Device) }),
		"block-device-mapping.volume-id":             vols(func(v *volumeRecord) string { return deref(v.VolumeId) }),
		"block-device-mapping.status":                vols(func(v *volumeRecord) string { return string(v.Attachments[0].State) }),
		"block-device-mapping.delete-on-termination": vols(func(v *volumeRecord) string { return boolString(deref(v.Attachments[0].DeleteOnTermination)) }),
		"boot-mode":                                  func(r *instanceRecord) []string { return []string{string(r.BootMode)} },
		"client-token":                               str(func(r *instanceRecord) *string { return r.ClientToken }),
		"dns-name":                                   func(r *instanceRecord) []string { return []string{""} },
		"group-id":                                   groups(func(g types.GroupIdentifier) string { return deref(g.GroupId) }),
		"group-name":                                 groups(func(g types.GroupIdentifier) string { return deref(g.GroupName) }),
		"instance.group-id":                          groups(func(g types.GroupIdentifier) string { return deref(g.GroupId) }),
		"instance.group-name":                        groups(func(g types.GroupIdentifier) string { return deref(g.GroupName) }),
		"hypervisor":                                 func(r *instanceRecord) []string { return []string{string(r.Hypervisor)} },
		"image-id":                                   str(func(r *instanceRecord) *string { return r.ImageId }),
		"instance-id":                                str(func(r *instanceRecord) *string { return r.InstanceId }),
		"instance-lifecycle":                         func(r *instanceRecord) []string { return nil },
		"instance-state-code":                        func(r *instanceRecord) []string { return []string{fmt.Sprint(stateCodes[r.state()])} },
		"instance-state-name":                        func(r *instanceRecord) []string { return []string{string(r.state())} },
		"instance-type":                              func(r *instanceRecord) []string { return []string{string(r.InstanceType)} },
		"ip-address": func(r *instanceRecord) []string {
			var out []string
			for _, e := range j().enis[deref(r.InstanceId)] {
				if a, ok := j().addrs[deref(e.NetworkInterfaceId)]; ok {
					out = append(out, deref(a.PublicIp))
				}
			}
			return out
		},
		"key-name":     str(func(r *instanceRecord) *string { return r.KeyName }),
		"launch-index": func(r *instanceRecord) []string { return []string{fmt.Sprint(deref(r.AmiLaunchIndex))} },
		"launch-time": func(r *instanceRecord) []string {
			return []string{r.LaunchTime.UTC().Format("2006-01-02T15:04:05.000Z")}
		},
		"metadata-options.http-tokens":   func(r *instanceRecord) []string { return []string{string(r.MetadataOptions.HttpTokens)} },
		"metadata-options.http-endpoint": func(r *instanceRecord) []string { return []string{string(r.MetadataOptions.HttpEndpoint)} },
		"metadata-options.http-put-response-hop-limit": func(r *instanceRecord) []string {
			return []string{fmt.Sprint(deref(r.MetadataOptions.HttpPutResponseHopLimit))}
		},
		"monitoring-state":                       func(r *instanceRecord) []string { return []string{"disabled"} },
		"network-interface.network-interface-id": enis(func(e *eniRecord) []string { return []string{deref(e.NetworkInterfaceId)} }),
		"network-interface.mac-address":          enis(func(e *eniRecord) []string { return []string{deref(e.MacAddress)} }),
		"network-interface.private-dns-name":     enis(func(e *eniRecord) []string { return []string{deref(e.PrivateDnsName)} }),
		"network-interface.subnet-id":            enis(func(e *eniRecord) []string { return []string{deref(e.SubnetId)} }),
		"network-interface.vpc-id":               enis(func(e *eniRecord) []string { return []string{deref(e.VpcId)} }),
		"network-interface.addresses.private-ip-address": enis(func(e *eniRecord) []string {
			var out []string
			for _, a := range e.PrivateIpAddresses {
				out = append(out, deref(a.PrivateIpAddress))
			}
			return out
		}),
		"network-interface.group-id": enis(func(e *eniRecord) []string { return groupIDs(e.Groups) }),
		"owner-id":                   func(r *instanceRecord) []string { return []string{s.account()} },
		"placement-group-name":       func(r *instanceRecord) []string { return []string{""} },
		"platform-details":           str(func(r *instanceRecord) *string { return r.PlatformDetails }),
		"private-dns-name":           str(func(r *instanceRecord) *string { return r.PrivateDnsName }),
		"private-ip-address":         str(func(r *instanceRecord) *string { return r.PrivateIpAddress }),
		"reservation-id":             func(r *instanceRecord) []string { return []string{r.ReservationID} },
		"root-device-name":           str(func(r *instanceRecord) *string { return r.RootDeviceName }),
		"root-device-type":           func(r *instanceRecord) []string { return []string{string(r.RootDeviceType)} },
		"source-dest-check":          func(r *instanceRecord) []string { return []string{boolString(deref(r.SourceDestCheck))} },
		"state-reason-code": func(r *instanceRecord) []string {
			if r.StateReason == nil {
				return nil
			}
			return []string{deref(r.StateReason.Code)}
		},
		"subnet-id":           str(func(r *instanceRecord) *string { return r.SubnetId }),
		"tenancy":             func(r *instanceRecord) []string { return []string{string(r.Placement.Tenancy)} },
		"virtualization-type": func(r *instanceRecord) []string { return []string{string(r.VirtualizationType)} },
		"vpc-id":              str(func(r *instanceRecord) *string { return r.VpcId }),
	}
}

// DescribeInstances lists instances grouped by reservation.
func (s *Service) DescribeInstances(ctx context.Context, in *ec2.DescribeInstancesInput) (*ec2.DescribeInstancesOutput, error) {
	if len(in.InstanceIds) > 0 && in.MaxResults != nil {
		return nil, awserr.InvalidParameterCombination("The parameter instancesSet cannot be used with the parameter maxResults")
	}
	var (
		jn     *join
		joinTx *store.Tx
	)
	lazy := func() *join {
		if jn == nil {
			jn = newJoin(joinTx)
		}
		return jn
	}
	match, err := instanceFilters(s, lazy).compile(in.Filters)
	if err != nil {
		return nil, err
	}
	p, err := newPager(in.MaxResults, in.NextToken, 5, 1000)
	if err != nil {
		return nil, err
	}
	out := &ec2.DescribeInstancesOutput{Reservations: []types.Reservation{}}
	err = s.db.View(func(tx *store.Tx) error {
		joinTx = tx
		byRes := map[string]int{}
		next, err := list(tx, kindInstance, in.InstanceIds, func(r *instanceRecord, tags []types.Tag) bool {
			return s.visible(r) && match(r, tags)
		}, p, func(_ string, r *instanceRecord, tags []types.Tag) {
			i, ok := byRes[r.ReservationID]
			if !ok {
				i = len(out.Reservations)
				byRes[r.ReservationID] = i
				out.Reservations = append(out.Reservations, types.Reservation{ReservationId: ptr(r.ReservationID), OwnerId: ptr(s.account()), Groups: []types.GroupIdentifier{}})
			}
			out.Reservations[i].Instances = append(out.Reservations[i].Instances, s.instanceView(r, tags, lazy()))
		})
		out.NextToken = next
		return err
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// instancesFor loads the named instances, failing with EC2's error naming
// every id that does not exist.
func (s *Service) instancesFor(ids []string) (map[string]*instanceRecord, error) {
	if len(ids) == 0 {
		return nil, awserr.MissingParameter("InstanceId")
	}
	out := map[string]*instanceRecord{}
	err := s.db.View(func(tx *store.Tx) error {
		var missing []string
		for _, id := range ids {
			if err := kindInstance.check(id); err != nil {
				return err
			}
			r, err := get[instanceRecord](tx, kindInstance, id)
			if err != nil || !s.visible(r) {
				missing = append(missing, id)
				continue
			}
			out[id] = r
		}
		if len(missing) > 0 {
			return kindInstance.notFound(missing...)
		}
		return nil
	})
	return out, err
}

func stateChange(id string, prev, cur types.InstanceStateName) types.InstanceStateChange {
	return types.InstanceStateChange{InstanceId: ptr(id), PreviousState: instanceState(prev), CurrentState: instanceState(cur)}
}

func incorrectState(id, verb string) error {
	return awserr.New(400, "IncorrectInstanceState", "This instance '%s' is not in a state from which it can be %s.", id, verb)
}

// StopInstances powers instances down (ACPI, then forced after a timeout,
// or at once with --force).
func (s *Service) StopInstances(ctx context.Context, in *ec2.StopInstancesInput) (*ec2.StopInstancesOutput, error) {
	if deref(in.Hibernate) {
		return nil, awserr.New(400, "UnsupportedHibernationConfiguration", "Hibernation is not supported by hangar.")
	}
	_, _, compute, err := s.backends()
	if err != nil {
		return nil, err
	}
	recs, err := s.instancesFor(in.InstanceIds)
	if err != nil {
		return nil, err
	}
	for _, id := range in.InstanceIds {
		switch recs[id].state() {
		case types.InstanceStateNameTerminated, types.InstanceStateNameShuttingDown:
			return nil, incorrectState(id, "stopped")
		}
	}
	out := &ec2.StopInstancesOutput{StoppingInstances: []types.InstanceStateChange{}}
	for _, id := range in.InstanceIds {
		prev := recs[id].state()
		if prev == types.InstanceStateNameStopped || prev == types.InstanceStateNameStopping {
			out.StoppingInstances = append(out.StoppingInstances, stateChange(id, prev, prev))
			continue
		}
		info, err := compute.StopInstance(ctx, id, deref(in.Force), 0)
		if err != nil {
			return nil, computeErr(err, id, string(recs[id].InstanceType), s.cfg.AvailabilityZone)
		}
		st := info.State
		if st != api.InstanceStateStopped {
			st = api.InstanceStateStopping
		}
		if err := s.applyState(ctx, id, st, "Client.UserInitiatedShutdown: User initiated shutdown"); err != nil {
			return nil, err
		}
		out.StoppingInstances = append(out.StoppingInstances, stateChange(id, prev, types.InstanceStateName(st)))
	}
	return out, nil
}

// StartInstances starts stopped instances.
func (s *Service) StartInstances(ctx context.Context, in *ec2.StartInstancesInput) (*ec2.StartInstancesOutput, error) {
	_, _, compute, err := s.backends()
	if err != nil {
		return nil, err
	}
	recs, err := s.instancesFor(in.InstanceIds)
	if err != nil {
		return nil, err
	}
	for _, id := range in.InstanceIds {
		switch recs[id].state() {
		case types.InstanceStateNameTerminated, types.InstanceStateNameShuttingDown, types.InstanceStateNameStopping:
			return nil, incorrectState(id, "started")
		}
	}
	out := &ec2.StartInstancesOutput{StartingInstances: []types.InstanceStateChange{}}
	for _, id := range in.InstanceIds {
		prev := recs[id].state()
		if prev != types.InstanceStateNameStopped {
			out.StartingInstances = append(out.StartingInstances, stateChange(id, prev, prev))
			continue
		}
		now := s.now().UTC()
		if err := s.db.Update(func(tx *store.Tx) error {
			r, err := get[instanceRecord](tx, kindInstance, id)
			if err != nil {
				return err
			}
			r.LaunchTime = &now
			return put(tx, kindInstance, id, r)
		}); err != nil {
			return nil, err
		}
		_ = s.pushMetadata(ctx, id)
		info, err := compute.StartInstance(ctx, id)
		if api.IsName(err, api.ErrNotFound) {
			// vmd lost it (a fresh host disk, say): launch it anew from
			// the records, which hold everything it needs.
			err = s.launch(ctx, id)
			info.State = api.InstanceStatePending
		} else if err != nil {
			err = computeErr(err, id, string(recs[id].InstanceType), s.cfg.AvailabilityZone)
		}
		if err != nil {
			return nil, err
		}
		st := info.State
		if st == api.InstanceStateStopped || st == "" {
			st = api.InstanceStatePending
		}
		if err := s.applyState(ctx, id, st, ""); err != nil {
			return nil, err
		}
		out.StartingInstances = append(out.StartingInstances, stateChange(id, prev, types.InstanceStateName(st)))
	}
	return out, nil
}

// RebootInstances asks running instances to reboot.
func (s *Service) RebootInstances(ctx context.Context, in *ec2.RebootInstancesInput) (*ec2.RebootInstancesOutput, error) {
	_, _, compute, err := s.backends()
	if err != nil {
		return nil, err
	}
	recs, err := s.instancesFor(in.InstanceIds)
	if err != nil {
		return nil, err
	}
	for _, id := range in.InstanceIds {
		if recs[id].state() != types.InstanceStateNameRunning && recs[id].state() != types.InstanceStateNamePending {
			return nil, incorrectState(id, "rebooted")
		}
	}
	for _, id := range in.InstanceIds {
		if _, err := compute.RebootInstance(ctx, id); err != nil {
			return nil, computeErr(err, id, string(recs[id].InstanceType), s.cfg.AvailabilityZone)
		}
	}
	return &ec2.RebootInstancesOutput{}, nil
}

// TerminateInstances ends instances for good; their interfaces go, and
// volumes with DeleteOnTermination.
func (s *Service) TerminateInstances(ctx context.Context, in *ec2.TerminateInstancesInput) (*ec2.TerminateInstancesOutput, error) {
	_, _, compute, err := s.backends()
	if err != nil {
		return nil, err
	}
	recs, err := s.instancesFor(in.InstanceIds)
	if err != nil {
		return nil, err
	}
	for _, id := range in.InstanceIds {
		if recs[id].DisableAPITermination && recs[id].state() != types.InstanceStateNameTerminated {
			return nil, awserr.New(400, "OperationNotPermitted", "The instance '%s' may not be terminated. Modify its 'disableApiTermination' instance attribute and try again.", id)
		}
	}
	out := &ec2.TerminateInstancesOutput{TerminatingInstances: []types.InstanceStateChange{}}
	for _, id := range in.InstanceIds {
		prev := recs[id].state()
		if prev == types.InstanceStateNameTerminated {
			out.TerminatingInstances = append(out.TerminatingInstances, stateChange(id, prev, prev))
			continue
		}
		info, err := compute.TerminateInstance(ctx, id)
		st := info.State
		switch {
		case api.IsName(err, api.ErrNotFound):
			st = api.InstanceStateTerminated // never reached vmd
		case err != nil:
			return nil, computeErr(err, id, string(recs[id].InstanceType), s.cfg.AvailabilityZone)
		case st != api.InstanceStateTerminated:
			st = api.InstanceStateShuttingDown
		}
		if err := s.applyState(ctx, id, st, "Client.UserInitiatedShutdown: User initiated shutdown"); err != nil {
			s.log.Warn("terminate: releasing resources; reconcile will retry", "instance", id, "err", err)
		}
		out.TerminatingInstances = append(out.TerminatingInstances, stateChange(id, prev, types.InstanceStateName(st)))
	}
	return out, nil
}

// GetConsoleOutput returns the instance's serial console, base64-encoded
// as EC2 returns it.
func (s *Service) GetConsoleOutput(ctx context.Context, in *ec2.GetConsoleOutputInput) (*ec2.GetConsoleOutputOutput, error) {
	if in.InstanceId == nil {
		return nil, awserr.MissingParameter("InstanceId")
	}
	_, _, compute, err := s.backends()
	if err != nil {
		return nil, err
	}
	recs, err := s.instancesFor([]string{*in.InstanceId})
	if err != nil {
		return nil, err
	}
	text, ts, err := compute.GetConsoleOutput(ctx, *in.InstanceId, deref(in.Latest))
	if err != nil && !api.IsName(err, api.ErrNotFound) {
		return nil, computeErr(err, *in.InstanceId, string(recs[*in.InstanceId].InstanceType), s.cfg.AvailabilityZone)
	}
	when := s.now().UTC()
	if ts > 0 {
		when = time.Unix(ts, 0).UTC()
	}
	out := &ec2.GetConsoleOutputOutput{InstanceId: in.InstanceId, Timestamp: &when}
	if text != "" {
		out.Output = ptr(base64.StdEncoding.EncodeToString([]byte(text)))
	}
	return out, nil
}

// checkStatus maps vmd's status-check words to EC2's.
func checkStatus(v string) (types.SummaryStatus, types.StatusType) {
	switch v {
	case api.StatusCheckOK:
		return types.SummaryStatusOk, types.StatusTypePassed
	case api.StatusCheckImpaired:
		return types.SummaryStatusImpaired, types.StatusTypeFailed
	case api.StatusCheckInitializing:
		return types.SummaryStatusInitializing, types.StatusTypeInitializing
	case api.StatusCheckNotApplicable:
		return types.SummaryStatusNotApplicable, ""
	}
	return types.SummaryStatusInsufficientData, types.StatusTypeInsufficientData
}

func statusSummary(v string) *types.InstanceStatusSummary {
	sum, detail := checkStatus(v)
	out := &types.InstanceStatusSummary{Status: sum}
	if detail != "" {
		out.Details = []types.InstanceStatusDetails{{Name: types.StatusNameReachability, Status: detail}}
	}
	return out
}

var instanceStatusFilters = filterSet[types.InstanceStatus]{
	"availability-zone":            func(st *types.InstanceStatus) []string { return []string{deref(st.AvailabilityZone)} },
	"instance-state-name":          func(st *types.InstanceStatus) []string { return []string{string(st.InstanceState.Name)} },
	"instance-state-code":          func(st *types.InstanceStatus) []string { return []string{fmt.Sprint(deref(st.InstanceState.Code))} },
	"system-status.status":         func(st *types.InstanceStatus) []string { return []string{string(st.SystemStatus.Status)} },
	"instance-status.status":       func(st *types.InstanceStatus) []string { return []string{string(st.InstanceStatus.Status)} },
	"system-status.reachability":   func(st *types.InstanceStatus) []string { return reachability(st.SystemStatus) },
	"instance-status.reachability": func(st *types.InstanceStatus) []string { return reachability(st.InstanceStatus) },
	"event.code":                   func(st *types.InstanceStatus) []string { return nil },
}

func reachability(s *types.InstanceStatusSummary) []string {
	var out []string
	for _, d := range s.Details {
		out = append(out, string(d.Status))
	}
	return out
}

// DescribeInstanceStatus reports the status checks vmd measures: the
// system check is QEMU alive and answering, the instance check is the
// guest having reached DHCP or IMDS since it started.
func (s *Service) DescribeInstanceStatus(ctx context.Context, in *ec2.DescribeInstanceStatusInput) (*ec2.DescribeInstanceStatusOutput, error) {
	if len(in.InstanceIds) > 0 && in.MaxResults != nil {
		return nil, awserr.InvalidParameterCombination("The parameter instancesSet cannot be used with the parameter maxResults")
	}
	match, err := instanceStatusFilters.compile(in.Filters)
	if err != nil {
		return nil, err
	}
	p, err := newPager(in.MaxResults, in.NextToken, 5, 1000)
	if err != nil {
		return nil, err
	}
	if len(in.InstanceIds) > 0 {
		if _, err := s.instancesFor(in.InstanceIds); err != nil {
			return nil, err
		}
	}
	vmd := map[string]api.InstanceInfo{}
	if s.compute != nil {
		infos, err := s.compute.ListInstances(ctx)
		if err != nil && !absent(err) {
			return nil, computeErr(err, "", "", s.cfg.AvailabilityZone)
		}
		for _, i := range infos {
			vmd[i.ID] = i
		}
	}
	out := &ec2.DescribeInstanceStatusOutput{InstanceStatuses: []types.InstanceStatus{}}
	err = s.db.View(func(tx *store.Tx) error {
		next, err := list(tx, kindInstance, in.InstanceIds, func(r *instanceRecord, _ []types.Tag) bool {
			if !s.visible(r) {
				return false
			}
			if r.state() != types.InstanceStateNameRunning && !deref(in.IncludeAllInstances) {
				return false
			}
			st := s.instanceStatus(r, vmd)
			return match(&st, nil)
		}, p, func(_ string, r *instanceRecord, _ []types.Tag) {
			out.InstanceStatuses = append(out.InstanceStatuses, s.instanceStatus(r, vmd))
		})
		out.NextToken = next
		return err
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

func (s *Service) instanceStatus(r *instanceRecord, vmd map[string]api.InstanceInfo) types.InstanceStatus {
	sys, inst := api.StatusCheckNotApplicable, api.StatusCheckNotApplicable
	if r.state() == types.InstanceStateNameRunning {
		sys, inst = api.StatusCheckInsufficientData, api.StatusCheckInsufficientData
		if info, ok := vmd[deref(r.InstanceId)]; ok {
			sys, inst = info.SystemStatus, info.InstanceStatus
		}
	}
	return types.InstanceStatus{
		InstanceId:       r.InstanceId,
		AvailabilityZone: r.Placement.AvailabilityZone,
		InstanceState:    instanceState(r.state()),
		SystemStatus:     statusSummary(sys),
		InstanceStatus:   statusSummary(inst),
		Events:           []types.InstanceStatusEvent{},
	}
}

// ModifyInstanceMetadataOptions changes what IMDS requires of an instance;
// netd applies it at once.
func (s *Service) ModifyInstanceMetadataOptions(ctx context.Context, in *ec2.ModifyInstanceMetadataOptionsInput) (*ec2.ModifyInstanceMetadataOptionsOutput, error) {
	if in.InstanceId == nil {
		return nil, awserr.MissingParameter("InstanceId")
	}
	req := &types.InstanceMetadataOptionsRequest{HttpTokens: in.HttpTokens, HttpPutResponseHopLimit: in.HttpPutResponseHopLimit,
		HttpEndpoint: in.HttpEndpoint, HttpProtocolIpv6: in.HttpProtocolIpv6, InstanceMetadataTags: in.InstanceMetadataTags}
	var opts types.InstanceMetadataOptionsResponse
	err := s.db.Update(func(tx *store.Tx) error {
		r, err := get[instanceRecord](tx, kindInstance, *in.InstanceId)
		if err != nil {
			return err
		}
		if r.state() == types.InstanceStateNameTerminated {
			return incorrectState(*in.InstanceId, "modified")
		}
		cur := types.InstanceMetadataOptionsResponse{}
		if r.MetadataOptions != nil {
			cur = *r.MetadataOptions
		}
		if opts, err = metadataOptions(cur, req); err != nil {
			return err
		}
		r.MetadataOptions = &opts
		return put(tx, kindInstance, *in.InstanceId, r)
	})
	if err != nil {
		return nil, err
	}
	if err := s.pushMetadata(ctx, *in.InstanceId); err != nil {
		return nil, networkErr(err, *in.InstanceId)
	}
	return &ec2.ModifyInstanceMetadataOptionsOutput{InstanceId: in.InstanceId, InstanceMetadataOptions: &opts}, nil
}

// DescribeInstanceAttribute reports one attribute of an instance.
func (s *Service) DescribeInstanceAttribute(ctx context.Context, in *ec2.DescribeInstanceAttributeInput) (*ec2.DescribeInstanceAttributeOutput, error) {
	if in.InstanceId == nil {
		return nil, awserr.MissingParameter("InstanceId")
	}
	if in.Attribute == "" {
		return nil, awserr.MissingParameter("Attribute")
	}
	recs, err := s.instancesFor([]string{*in.InstanceId})
	if err != nil {
		return nil, err
	}
	r := recs[*in.InstanceId]
	out := &ec2.DescribeInstanceAttributeOutput{InstanceId: in.InstanceId}
	str := func(v string) *types.AttributeValue { return &types.AttributeValue{Value: ptr(v)} }
	boolean := func(v bool) *types.AttributeBooleanValue { return &types.AttributeBooleanValue{Value: ptr(v)} }
	switch in.Attribute {
	case types.InstanceAttributeNameInstanceType:
		out.InstanceType = str(string(r.InstanceType))
	case types.InstanceAttributeNameUserData:
		out.UserData = &types.AttributeValue{}
		if r.UserData != "" {
			out.UserData.Value = ptr(r.UserData)
		}
	case types.InstanceAttributeNameDisableApiTermination:
		out.DisableApiTermination = boolean(r.DisableAPITermination)
	case types.InstanceAttributeNameInstanceInitiatedShutdownBehavior:
		out.InstanceInitiatedShutdownBehavior = str(string(r.ShutdownBehavior))
	case types.InstanceAttributeNameRootDeviceName:
		out.RootDeviceName = str(deref(r.RootDeviceName))
	case types.InstanceAttributeNameSourceDestCheck:
		out.SourceDestCheck = boolean(deref(r.SourceDestCheck))
	case types.InstanceAttributeNameEbsOptimized:
		out.EbsOptimized = boolean(deref(r.EbsOptimized))
	case types.InstanceAttributeNameEnaSupport:
		out.EnaSupport = boolean(true)
	case types.InstanceAttributeNameGroupSet:
		out.Groups = r.SecurityGroups
	case types.InstanceAttributeNameBlockDeviceMapping:
		err := s.db.View(func(tx *store.Tx) error {
			out.BlockDeviceMappings = s.instanceView(r, nil, newJoin(tx)).BlockDeviceMappings
			return nil
		})
		if err != nil {
			return nil, err
		}
	default:
		return nil, awserr.InvalidParameterValue("Value (%s) for parameter attribute is not supported by hangar.", in.Attribute)
	}
	return out, nil
}

// ModifyInstanceAttribute changes one attribute: termination protection
// and shutdown behaviour at any time, type and user data while stopped.
func (s *Service) ModifyInstanceAttribute(ctx context.Context, in *ec2.ModifyInstanceAttributeInput) (*ec2.ModifyInstanceAttributeOutput, error) {
	if in.InstanceId == nil {
		return nil, awserr.MissingParameter("InstanceId")
	}
	id := *in.InstanceId
	err := s.db.Update(func(tx *store.Tx) error {
		r, err := get[instanceRecord](tx, kindInstance, id)
		if err != nil {
			return err
		}
		stopped := r.state() == types.InstanceStateNameStopped
		attr := string(in.Attribute)
		value := deref(in.Value)
		switch {
		case in.DisableApiTermination != nil || attr == "disableApiTermination":
			v := value == "true"
			if in.DisableApiTermination != nil {
				v = deref(in.DisableApiTermination.Value)
			}
			r.DisableAPITermination = v
		case in.InstanceInitiatedShutdownBehavior != nil || attr == "instanceInitiatedShutdownBehavior":
			v := value
			if in.InstanceInitiatedShutdownBehavior != nil {
				v = deref(in.InstanceInitiatedShutdownBehavior.Value)
			}
			if v != string(types.ShutdownBehaviorStop) && v != string(types.ShutdownBehaviorTerminate) {
				return awserr.InvalidParameterValue("Value (%s) for parameter instanceInitiatedShutdownBehavior is invalid.", clip(v))
			}
			r.ShutdownBehavior = types.ShutdownBehavior(v)
		case in.InstanceType != nil || attr == "instanceType":
			v := value
			if in.InstanceType != nil {
				v = deref(in.InstanceType.Value)
			}
			if !stopped {
				return awserr.New(400, "IncorrectInstanceState", "The instance '%s' is not in the 'stopped' state.", id)
			}
			t, ok := InstanceTypeInfo(v)
			if !ok || t.BareMetal {
				return awserr.InvalidParameterValue("Invalid value '%s' for InstanceType.", clip(v))
			}
			r.InstanceType = types.InstanceType(v)
			r.CpuOptions = &types.CpuOptions{CoreCount: ptr(t.Cores), ThreadsPerCore: ptr(t.ThreadsPerCore)}
		case in.UserData != nil || attr == "userData":
			if !stopped {
				return awserr.New(400, "IncorrectInstanceState", "The instance '%s' is not in the 'stopped' state.", id)
			}
			raw := []byte(value)
			if in.UserData != nil {
				raw = in.UserData.Value
			}
			if len(raw) > maxUserData {
				return awserr.InvalidParameterValue("User data is limited to %d bytes.", maxUserData)
			}
			r.UserData = base64.StdEncoding.EncodeToString(raw)
		case in.SourceDestCheck != nil || attr == "sourceDestCheck":
			v := value == "true"
			if in.SourceDestCheck != nil {
				v = deref(in.SourceDestCheck.Value)
			}
			r.SourceDestCheck = ptr(v)
		default:
			return awserr.InvalidParameterValue("Modifying attribute %q is not supported by hangar.", attr)
		}
		return put(tx, kindInstance, id, r)
	})
	if err != nil {
		return nil, err
	}
	if in.UserData != nil || in.Attribute == "userData" {
		_ = s.pushMetadata(ctx, id)
	}
	return &ec2.ModifyInstanceAttributeOutput{}, nil
}

// StartCompute follows vmd's state signals and purges terminated
// instances after EC2's hour, until ctx ends. Call ComputeAppeared when
// hangar-vmd (re)claims its name.
func (s *Service) StartCompute(ctx context.Context) error {
	if s.compute == nil {
		return nil
	}
	ch, err := s.compute.WatchInstanceStates(ctx)
	if err != nil {
		return err
	}
	go func() {
		janitor := time.NewTicker(time.Minute)
		defer janitor.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case c, ok := <-ch:
				if !ok {
					return
				}
				if err := s.applyState(ctx, c.ID, c.State, c.Reason); err != nil {
					s.log.Warn("applying an instance state from vmd", "instance", c.ID, "state", c.State, "err", err)
				}
			case <-janitor.C:
				s.purgeTerminated(ctx)
			}
		}
	}()
	return nil
}

var reconcileMu sync.Mutex

// ComputeAppeared reconciles instance records with what hangar-vmd holds,
// after vmd (or the gateway) started: states vmd knows win; an instance
// the records say runs but vmd does not know is launched again from its
// records; releases that failed are retried.
func (s *Service) ComputeAppeared(ctx context.Context) {
	if s.compute == nil {
		return
	}
	reconcileMu.Lock()
	defer reconcileMu.Unlock()
	infos, err := s.compute.ListInstances(ctx)
	if err != nil {
		s.log.Warn("reconciling with hangar-vmd", "err", err)
		return
	}
	known := map[string]api.InstanceInfo{}
	for _, i := range infos {
		known[i.ID] = i
	}
	var recs map[string]*instanceRecord
	if err := s.db.View(func(tx *store.Tx) (err error) { recs, err = all[instanceRecord](tx, kindInstance, nil); return err }); err != nil {
		s.log.Warn("reconciling with hangar-vmd", "err", err)
		return
	}
	for _, id := range sortedKeys(recs) {
		r := recs[id]
		st := r.state()
		if st == types.InstanceStateNameTerminated {
			if !r.CleanedUp {
				if err := s.cleanupTerminated(ctx, id); err != nil {
					s.log.Warn("releasing a terminated instance", "instance", id, "err", err)
				}
			}
			continue
		}
		if info, ok := known[id]; ok {
			if err := s.applyState(ctx, id, info.State, info.StateReason); err != nil {
				s.log.Warn("reconciling an instance", "instance", id, "err", err)
			}
			continue
		}
		switch st {
		case types.InstanceStateNamePending, types.InstanceStateNameRunning:
			s.log.Info("vmd does not know a running instance; launching it again from its records", "instance", id)
			if err := s.launch(ctx, id); err != nil {
				s.log.Warn("relaunching an instance", "instance", id, "err", err)
			}
		case types.InstanceStateNameStopping:
			_ = s.applyState(ctx, id, api.InstanceStateStopped, "")
		case types.InstanceStateNameShuttingDown:
			_ = s.applyState(ctx, id, api.InstanceStateTerminated, "")
		}
	}
}

// purgeTerminated forgets instances terminated more than an hour ago, in
// the records and in vmd (which keeps their console log until then).
func (s *Service) purgeTerminated(ctx context.Context) {
	var old []string
	_ = s.db.View(func(tx *store.Tx) error {
		recs, err := all(tx, kindInstance, func(_ string, r *instanceRecord) bool { return !s.visible(r) && r.CleanedUp })
		for id := range recs {
			old = append(old, id)
		}
		return err
	})
	for _, id := range old {
		if s.compute != nil {
			if err := s.compute.DeleteInstance(ctx, id); err != nil && !api.IsName(err, api.ErrNotFound) {
				continue
			}
		}
		_ = s.db.Update(func(tx *store.Tx) error { return remove(tx, kindInstance, id) })
	}
}

func init() {
	// netd keeps instance metadata in memory only: send it again when
	// netd has restarted.
	networkAppearedHooks = append(networkAppearedHooks, func(ctx context.Context, s *Service) {
		var ids []string
		_ = s.db.View(func(tx *store.Tx) error {
			recs, err := all(tx, kindInstance, func(_ string, r *instanceRecord) bool { return r.state() != types.InstanceStateNameTerminated })
			for id := range recs {
				ids = append(ids, id)
			}
			return err
		})
		sort.Strings(ids)
		for _, id := range ids {
			if err := s.pushMetadata(ctx, id); err != nil {
				s.log.Warn("sending instance metadata to hangar-netd", "instance", id, "err", err)
			}
		}
	})
}
