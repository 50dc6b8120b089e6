package ec2

import (
	"context"
	"sync"
	"testing"

	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"

	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/internal/store"
)

// fakeStorage stands in for hangar-ebsd: it remembers what it was asked.
type fakeStorage struct {
	mu    sync.Mutex
	vols  map[string]api.VolumeInfo
	snaps map[string]api.SnapshotInfo
	fail  error // returned by the next call, then cleared
}

func newFakeStorage() *fakeStorage {
	return &fakeStorage{vols: map[string]api.VolumeInfo{}, snaps: map[string]api.SnapshotInfo{}}
}

func (f *fakeStorage) err() error {
	err := f.fail
	f.fail = nil
	return err
}

func (f *fakeStorage) CreateVolume(_ context.Context, id string, size uint64, from string) (api.VolumeInfo, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.err(); err != nil {
		return api.VolumeInfo{}, err
	}
	v := api.VolumeInfo{VolumeID: id, SizeBytes: size, FromSnapshot: from, State: api.VolumeAvailable, ExportSocket: "/run/hangar/ebs/" + id + ".sock"}
	f.vols[id] = v
	return v, nil
}

func (f *fakeStorage) DeleteVolume(_ context.Context, id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.err(); err != nil {
		return err
	}
	delete(f.vols, id)
	return nil
}

func (f *fakeStorage) GetVolume(_ context.Context, id string) (api.VolumeInfo, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	v, ok := f.vols[id]
	if !ok {
		return v, &api.Error{Name: api.ErrNotFound, Message: "no " + id}
	}
	return v, nil
}

func (f *fakeStorage) ResizeVolume(_ context.Context, id string, size uint64) (api.VolumeInfo, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	v := f.vols[id]
	v.SizeBytes = size
	f.vols[id] = v
	return v, f.err()
}

func (f *fakeStorage) AttachVolume(_ context.Context, id, inst, dev string) (api.VolumeInfo, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	v := f.vols[id]
	v.AttachedTo, v.Device = inst, dev
	f.vols[id] = v
	return v, f.err()
}

func (f *fakeStorage) DetachVolume(_ context.Context, id, inst string) (api.VolumeInfo, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	v := f.vols[id]
	v.AttachedTo, v.Device = "", ""
	f.vols[id] = v
	return v, f.err()
}

func (f *fakeStorage) CreateSnapshot(_ context.Context, snap, vol string) (api.SnapshotInfo, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	s := api.SnapshotInfo{SnapshotID: snap, VolumeID: vol, State: api.SnapshotPending, Progress: 40}
	f.snaps[snap] = s
	return s, f.err()
}

func (f *fakeStorage) DeleteSnapshot(_ context.Context, snap string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.snaps, snap)
	return f.err()
}

func (f *fakeStorage) GetSnapshot(_ context.Context, snap string) (api.SnapshotInfo, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	s, ok := f.snaps[snap]
	if !ok {
		return s, &api.Error{Name: api.ErrNotFound, Message: "no " + snap}
	}
	return s, nil
}

func (f *fakeStorage) StartSnapshot(_ context.Context, a api.StartSnapshotArgs) (api.SnapshotInfo, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	s := api.SnapshotInfo{SnapshotID: a.SnapshotID, ParentID: a.ParentID, State: api.SnapshotPending, VolumeSizeBytes: a.VolumeSizeBytes}
	f.snaps[a.SnapshotID] = s
	return s, f.err()
}

func (f *fakeStorage) CompleteSnapshot(_ context.Context, a api.CompleteSnapshotArgs) (api.SnapshotInfo, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	s := f.snaps[a.SnapshotID]
	s.State, s.Progress = api.SnapshotCompleted, 100
	f.snaps[a.SnapshotID] = s
	return s, f.err()
}

func (f *fakeStorage) complete(snap string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	s := f.snaps[snap]
	s.State, s.Progress = api.SnapshotCompleted, 100
	f.snaps[snap] = s
}

func newVolSvc(t *testing.T) (*Service, *fakeStorage) {
	s := newSvc(t)
	f := newFakeStorage()
	s.SetStorage(f)
	return s, f
}

func createVol(t *testing.T, s *Service, size int32, vt types.VolumeType) string {
	t.Helper()
	out, err := s.CreateVolume(bg, &ec2.CreateVolumeInput{AvailabilityZone: ptr("us-east-1a"), Size: ptr(size), VolumeType: vt})
	if err != nil {
		t.Fatal(err)
	}
	return *out.VolumeId
}

func TestCreateVolumeValidatesTypesAsEC2(t *testing.T) {
	s, f := newVolSvc(t)
	zone := ptr("us-east-1a")
	for _, c := range []struct {
		name string
		in   ec2.CreateVolumeInput
		code string
		iops int32
		tput int32
	}{
		{"gp2 default with 3 IOPS/GiB, at least 100", ec2.CreateVolumeInput{Size: ptr(int32(10))}, "", 100, 0},
		{"gp2 big", ec2.CreateVolumeInput{Size: ptr(int32(2000)), VolumeType: types.VolumeTypeGp2}, "", 6000, 0},
		{"gp3 defaults", ec2.CreateVolumeInput{Size: ptr(int32(10)), VolumeType: types.VolumeTypeGp3}, "", 3000, 125},
		{"gp3 16 TiB", ec2.CreateVolumeInput{Size: ptr(int32(16384)), VolumeType: types.VolumeTypeGp3, Iops: ptr(int32(16000)), Throughput: ptr(int32(1000))}, "", 16000, 1000},
		{"gp3 too big", ec2.CreateVolumeInput{Size: ptr(int32(16385)), VolumeType: types.VolumeTypeGp3}, "InvalidParameterValue", 0, 0},
		{"gp3 throughput over iops/4", ec2.CreateVolumeInput{Size: ptr(int32(100)), VolumeType: types.VolumeTypeGp3, Iops: ptr(int32(3000)), Throughput: ptr(int32(800))}, "InvalidParameterValue", 0, 0},
		{"gp3 iops ratio", ec2.CreateVolumeInput{Size: ptr(int32(8)), VolumeType: types.VolumeTypeGp3, Iops: ptr(int32(5000))}, "InvalidParameterValue", 0, 0},
		{"gp2 with iops", ec2.CreateVolumeInput{Size: ptr(int32(10)), VolumeType: types.VolumeTypeGp2, Iops: ptr(int32(300))}, "InvalidParameterCombination", 0, 0},
		{"io1 needs iops", ec2.CreateVolumeInput{Size: ptr(int32(10)), VolumeType: types.VolumeTypeIo1}, "MissingParameter", 0, 0},
		{"io1 50 per GiB", ec2.CreateVolumeInput{Size: ptr(int32(10)), VolumeType: types.VolumeTypeIo1, Iops: ptr(int32(501))}, "InvalidParameterValue", 0, 0},
		{"io1 ok", ec2.CreateVolumeInput{Size: ptr(int32(10)), VolumeType: types.VolumeTypeIo1, Iops: ptr(int32(500))}, "", 500, 0},
		{"io2 ok", ec2.CreateVolumeInput{Size: ptr(int32(100)), VolumeType: types.VolumeTypeIo2, Iops: ptr(int32(64000))}, "", 64000, 0},
		{"io2 throughput", ec2.CreateVolumeInput{Size: ptr(int32(100)), VolumeType: types.VolumeTypeIo2, Iops: ptr(int32(1000)), Throughput: ptr(int32(200))}, "InvalidParameterCombination", 0, 0},
		{"st1 minimum 125", ec2.CreateVolumeInput{Size: ptr(int32(100)), VolumeType: types.VolumeTypeSt1}, "InvalidParameterValue", 0, 0},
		{"sc1 ok", ec2.CreateVolumeInput{Size: ptr(int32(125)), VolumeType: types.VolumeTypeSc1}, "", 0, 0},
		{"unknown type", ec2.CreateVolumeInput{Size: ptr(int32(10)), VolumeType: "gp9"}, "InvalidParameterValue", 0, 0},
		{"no size or snapshot", ec2.CreateVolumeInput{}, "MissingParameter", 0, 0},
		{"encrypted", ec2.CreateVolumeInput{Size: ptr(int32(1)), Encrypted: ptr(true)}, "UnsupportedOperation", 0, 0},
		{"missing snapshot", ec2.CreateVolumeInput{SnapshotId: ptr("snap-0123456789abcdef0")}, "InvalidSnapshot.NotFound", 0, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			in := c.in
			in.AvailabilityZone = zone
			before := len(f.vols)
			out, err := s.CreateVolume(bg, &in)
			wantCode(t, err, c.code)
			if c.code != "" {
				if len(f.vols) != before {
					t.Fatal("a refused create reached ebsd")
				}
				return
			}
			if deref(out.Iops) != c.iops || deref(out.Throughput) != c.tput || out.State != types.VolumeStateCreating {
				t.Fatalf("created %+v; want iops %d throughput %d", out, c.iops, c.tput)
			}
			if f.vols[*out.VolumeId].SizeBytes != uint64(*in.Size)*gib {
				t.Fatalf("ebsd got %d bytes", f.vols[*out.VolumeId].SizeBytes)
			}
		})
	}
	_, err := s.CreateVolume(bg, &ec2.CreateVolumeInput{AvailabilityZone: ptr("us-east-1b"), Size: ptr(int32(1))})
	wantCode(t, err, "InvalidParameterValue")
	_, err = s.CreateVolume(bg, &ec2.CreateVolumeInput{Size: ptr(int32(1))})
	wantCode(t, err, "MissingParameter")
}

func TestVolumeStorageFailureLeavesNoRecord(t *testing.T) {
	s, f := newVolSvc(t)
	f.fail = &api.Error{Name: api.ErrInsufficientCapacity, Message: "disk full"}
	before := snapshot(t, s)
	_, err := s.CreateVolume(bg, &ec2.CreateVolumeInput{AvailabilityZone: ptr("us-east-1a"), Size: ptr(int32(1))})
	wantCode(t, err, "InsufficientVolumeCapacity")
	after := snapshot(t, s)
	if len(after[kindVolume.Prefix]) != len(before[kindVolume.Prefix]) {
		t.Fatal("a volume ebsd refused was recorded")
	}
	s.SetStorage(nil)
	_, err = s.CreateVolume(bg, &ec2.CreateVolumeInput{AvailabilityZone: ptr("us-east-1a"), Size: ptr(int32(1))})
	wantCode(t, err, "Unavailable")
}

func TestDescribeVolumesFiltersAndPages(t *testing.T) {
	s, _ := newVolSvc(t)
	var ids []string
	for i := 0; i < 7; i++ {
		vt := types.VolumeTypeGp2
		if i%2 == 1 {
			vt = types.VolumeTypeGp3
		}
		ids = append(ids, createVol(t, s, int32(i+1), vt))
	}
	out := must[*ec2.DescribeVolumesOutput](t)(s.DescribeVolumes(bg, &ec2.DescribeVolumesInput{Filters: []types.Filter{{Name: ptr("volume-type"), Values: []string{"gp3"}}}}))
	if len(out.Volumes) != 3 {
		t.Fatalf("gp3 volumes = %d, want 3", len(out.Volumes))
	}
	out = must[*ec2.DescribeVolumesOutput](t)(s.DescribeVolumes(bg, &ec2.DescribeVolumesInput{Filters: []types.Filter{{Name: ptr("size"), Values: []string{"1", "7"}}, {Name: ptr("status"), Values: []string{"available"}}}}))
	if len(out.Volumes) != 2 {
		t.Fatalf("size 1 or 7 = %d, want 2", len(out.Volumes))
	}
	seen := map[string]bool{}
	var next *string
	pages := 0
	for {
		page := must[*ec2.DescribeVolumesOutput](t)(s.DescribeVolumes(bg, &ec2.DescribeVolumesInput{MaxResults: ptr(int32(5)), NextToken: next}))
		pages++
		for _, v := range page.Volumes {
			seen[*v.VolumeId] = true
		}
		if next = page.NextToken; next == nil {
			break
		}
	}
	if len(seen) != 7 || pages != 2 {
		t.Fatalf("paging saw %d volumes in %d pages", len(seen), pages)
	}
	// Above 500 is 500 (what the aws CLI sends), below 5 is an error.
	out = must[*ec2.DescribeVolumesOutput](t)(s.DescribeVolumes(bg, &ec2.DescribeVolumesInput{MaxResults: ptr(int32(1000))}))
	if len(out.Volumes) != 7 || out.NextToken != nil {
		t.Fatalf("MaxResults 1000: %d volumes, token %v", len(out.Volumes), out.NextToken)
	}
	_, err := s.DescribeVolumes(bg, &ec2.DescribeVolumesInput{MaxResults: ptr(int32(4))})
	wantCode(t, err, "InvalidParameterValue")
	_, err = s.DescribeVolumes(bg, &ec2.DescribeVolumesInput{Filters: []types.Filter{{Name: ptr("colour"), Values: []string{"x"}}}})
	wantCode(t, err, "InvalidParameterValue")
	_, err = s.DescribeVolumes(bg, &ec2.DescribeVolumesInput{VolumeIds: []string{"vol-0123456789abcdef0"}})
	wantCode(t, err, "InvalidVolume.NotFound")
	_, err = s.DescribeVolumes(bg, &ec2.DescribeVolumesInput{VolumeIds: []string{"volume-1"}})
	wantCode(t, err, "InvalidVolumeID.Malformed")
}

func TestModifyAttachDetachDelete(t *testing.T) {
	s, f := newVolSvc(t)
	id := createVol(t, s, 8, types.VolumeTypeGp2)
	mod := must[*ec2.ModifyVolumeOutput](t)(s.ModifyVolume(bg, &ec2.ModifyVolumeInput{VolumeId: ptr(id), Size: ptr(int32(20)), VolumeType: types.VolumeTypeGp3}))
	m := mod.VolumeModification
	if deref(m.OriginalSize) != 8 || deref(m.TargetSize) != 20 || m.TargetVolumeType != types.VolumeTypeGp3 || deref(m.TargetIops) != 3000 {
		t.Fatalf("modification %+v", m)
	}
	if f.vols[id].SizeBytes != 20*gib {
		t.Fatalf("ebsd size %d", f.vols[id].SizeBytes)
	}
	_, err := s.ModifyVolume(bg, &ec2.ModifyVolumeInput{VolumeId: ptr(id), Size: ptr(int32(10))})
	wantCode(t, err, "InvalidParameterValue")
	mods := must[*ec2.DescribeVolumesModificationsOutput](t)(s.DescribeVolumesModifications(bg, &ec2.DescribeVolumesModificationsInput{VolumeIds: []string{id}}))
	if len(mods.VolumesModifications) != 1 || mods.VolumesModifications[0].ModificationState != types.VolumeModificationStateCompleted {
		t.Fatalf("modifications %+v", mods)
	}

	inst := "i-0123456789abcdef0"
	_, err = s.AttachVolume(bg, &ec2.AttachVolumeInput{VolumeId: ptr(id), InstanceId: ptr(inst), Device: ptr("/dev/sdf")})
	wantCode(t, err, "InvalidInstanceID.NotFound")
	rec := instanceRecord{Instance: types.Instance{InstanceId: ptr(inst), State: instanceState(types.InstanceStateNameRunning),
		Placement: &types.Placement{AvailabilityZone: ptr(s.cfg.AvailabilityZone)}, RootDeviceName: ptr("/dev/xvda")}}
	if err := s.db.Update(func(tx *store.Tx) error { return tx.Put(instanceKind, inst, rec) }); err != nil {
		t.Fatal(err)
	}
	for _, dev := range []string{"sdf", "/dev/hda", "/dev/sd", "/dev/xvdabc"} {
		_, err = s.AttachVolume(bg, &ec2.AttachVolumeInput{VolumeId: ptr(id), InstanceId: ptr(inst), Device: ptr(dev)})
		wantCode(t, err, "InvalidParameterValue")
	}
	att := must[*ec2.AttachVolumeOutput](t)(s.AttachVolume(bg, &ec2.AttachVolumeInput{VolumeId: ptr(id), InstanceId: ptr(inst), Device: ptr("/dev/sdf")}))
	if att.State != types.VolumeAttachmentStateAttaching || f.vols[id].AttachedTo != inst {
		t.Fatalf("attach %+v, ebsd %+v", att, f.vols[id])
	}
	other := createVol(t, s, 1, "")
	_, err = s.AttachVolume(bg, &ec2.AttachVolumeInput{VolumeId: ptr(other), InstanceId: ptr(inst), Device: ptr("/dev/sdf")})
	wantCode(t, err, "InvalidParameterValue") // the device is taken
	_, err = s.AttachVolume(bg, &ec2.AttachVolumeInput{VolumeId: ptr(id), InstanceId: ptr(inst), Device: ptr("/dev/sdg")})
	wantCode(t, err, "VolumeInUse")
	_, err = s.DeleteVolume(bg, &ec2.DeleteVolumeInput{VolumeId: ptr(id)})
	wantCode(t, err, "VolumeInUse")
	v := must[*ec2.DescribeVolumesOutput](t)(s.DescribeVolumes(bg, &ec2.DescribeVolumesInput{Filters: []types.Filter{{Name: ptr("attachment.instance-id"), Values: []string{inst}}}}))
	if len(v.Volumes) != 1 || v.Volumes[0].State != types.VolumeStateInUse {
		t.Fatalf("attached volumes %+v", v.Volumes)
	}
	_, err = s.DetachVolume(bg, &ec2.DetachVolumeInput{VolumeId: ptr(id), InstanceId: ptr("i-0aaaaaaaaaaaaaaaa")})
	wantCode(t, err, "InvalidAttachment.NotFound")
	must[*ec2.DetachVolumeOutput](t)(s.DetachVolume(bg, &ec2.DetachVolumeInput{VolumeId: ptr(id)}))
	_, err = s.DetachVolume(bg, &ec2.DetachVolumeInput{VolumeId: ptr(id)})
	wantCode(t, err, "IncorrectState")
	must[*ec2.DeleteVolumeOutput](t)(s.DeleteVolume(bg, &ec2.DeleteVolumeInput{VolumeId: ptr(id)}))
	if _, ok := f.vols[id]; ok {
		t.Fatal("ebsd still holds the deleted volume")
	}
	_, err = s.DeleteVolume(bg, &ec2.DeleteVolumeInput{VolumeId: ptr(id)})
	wantCode(t, err, "InvalidVolume.NotFound")
	st := must[*ec2.DescribeVolumeStatusOutput](t)(s.DescribeVolumeStatus(bg, &ec2.DescribeVolumeStatusInput{VolumeIds: []string{other}}))
	if len(st.VolumeStatuses) != 1 || st.VolumeStatuses[0].VolumeStatus.Status != types.VolumeStatusInfoStatusOk {
		t.Fatalf("status %+v", st)
	}
}

func TestSnapshotsPendingToCompleted(t *testing.T) {
	s, f := newVolSvc(t)
	vol := createVol(t, s, 4, types.VolumeTypeGp3)
	snap := must[*ec2.CreateSnapshotOutput](t)(s.CreateSnapshot(bg, &ec2.CreateSnapshotInput{VolumeId: ptr(vol), Description: ptr("d"),
		TagSpecifications: tagSpec(types.ResourceTypeSnapshot, "k", "v")}))
	if snap.State != types.SnapshotStatePending || deref(snap.Progress) != "40%" || deref(snap.VolumeSize) != 4 {
		t.Fatalf("created %+v", snap)
	}
	_, err := s.CreateVolume(bg, &ec2.CreateVolumeInput{AvailabilityZone: ptr("us-east-1a"), SnapshotId: snap.SnapshotId})
	wantCode(t, err, "IncorrectState")
	f.complete(*snap.SnapshotId)
	d := must[*ec2.DescribeSnapshotsOutput](t)(s.DescribeSnapshots(bg, &ec2.DescribeSnapshotsInput{OwnerIds: []string{"self"}}))
	if len(d.Snapshots) != 1 || d.Snapshots[0].State != types.SnapshotStateCompleted || deref(d.Snapshots[0].Progress) != "100%" || len(d.Snapshots[0].Tags) != 1 {
		t.Fatalf("described %+v", d.Snapshots)
	}
	if d := must[*ec2.DescribeSnapshotsOutput](t)(s.DescribeSnapshots(bg, &ec2.DescribeSnapshotsInput{OwnerIds: []string{"amazon"}})); len(d.Snapshots) != 0 {
		t.Fatalf("amazon owns %d snapshots here", len(d.Snapshots))
	}
	if d := must[*ec2.DescribeSnapshotsOutput](t)(s.DescribeSnapshots(bg, &ec2.DescribeSnapshotsInput{Filters: []types.Filter{{Name: ptr("volume-id"), Values: []string{vol}}}})); len(d.Snapshots) != 1 {
		t.Fatalf("by volume %+v", d.Snapshots)
	}
	// A volume from it may be bigger, never smaller.
	_, err = s.CreateVolume(bg, &ec2.CreateVolumeInput{AvailabilityZone: ptr("us-east-1a"), SnapshotId: snap.SnapshotId, Size: ptr(int32(2))})
	wantCode(t, err, "InvalidParameterValue")
	nv := must[*ec2.CreateVolumeOutput](t)(s.CreateVolume(bg, &ec2.CreateVolumeInput{AvailabilityZone: ptr("us-east-1a"), SnapshotId: snap.SnapshotId}))
	if deref(nv.Size) != 4 || f.vols[*nv.VolumeId].FromSnapshot != *snap.SnapshotId {
		t.Fatalf("volume from snapshot %+v", nv)
	}
	// A copy is a child with no changes of its own.
	_, err = s.CopySnapshot(bg, &ec2.CopySnapshotInput{SourceSnapshotId: snap.SnapshotId, SourceRegion: ptr("eu-west-1")})
	wantCode(t, err, "InvalidParameterValue")
	cp := must[*ec2.CopySnapshotOutput](t)(s.CopySnapshot(bg, &ec2.CopySnapshotInput{SourceSnapshotId: snap.SnapshotId, SourceRegion: ptr("us-east-1")}))
	if got := f.snaps[*cp.SnapshotId]; got.ParentID != *snap.SnapshotId || got.State != api.SnapshotCompleted {
		t.Fatalf("ebsd copy %+v", got)
	}
	must[*ec2.DeleteSnapshotOutput](t)(s.DeleteSnapshot(bg, &ec2.DeleteSnapshotInput{SnapshotId: snap.SnapshotId}))
	_, err = s.DeleteSnapshot(bg, &ec2.DeleteSnapshotInput{SnapshotId: snap.SnapshotId})
	wantCode(t, err, "InvalidSnapshot.NotFound")
	// A snapshot ebsd lost shows as error.
	lost := must[*ec2.CreateSnapshotOutput](t)(s.CreateSnapshot(bg, &ec2.CreateSnapshotInput{VolumeId: ptr(vol)}))
	delete(f.snaps, *lost.SnapshotId)
	d = must[*ec2.DescribeSnapshotsOutput](t)(s.DescribeSnapshots(bg, &ec2.DescribeSnapshotsInput{SnapshotIds: []string{*lost.SnapshotId}}))
	if d.Snapshots[0].State != types.SnapshotStateError {
		t.Fatalf("lost snapshot %+v", d.Snapshots[0])
	}
}

func TestDirectSnapshotClientToken(t *testing.T) {
	s, _ := newVolSvc(t)
	d := DirectStart{VolumeSizeGiB: 2, ClientToken: "t1", TimeoutMinutes: 60, Tags: []types.Tag{{Key: ptr("a"), Value: ptr("b")}}}
	a := must[*types.Snapshot](t)(s.StartDirectSnapshot(bg, d))
	d.Tags = []types.Tag{{Key: ptr("a"), Value: ptr("b")}} // equal, not the same pointers
	b := must[*types.Snapshot](t)(s.StartDirectSnapshot(bg, d))
	if *a.SnapshotId != *b.SnapshotId {
		t.Fatalf("a retry made %s after %s", *b.SnapshotId, *a.SnapshotId)
	}
	d.VolumeSizeGiB = 3
	if _, err := s.StartDirectSnapshot(bg, d); err != ErrDirectTokenMismatch {
		t.Fatalf("the token with other parameters: %v", err)
	}
	_, err := s.StartDirectSnapshot(bg, DirectStart{VolumeSizeGiB: 1, ParentID: *a.SnapshotId})
	wantCode(t, err, "IncorrectState") // the parent is still pending
	must[struct{}](t)(struct{}{}, s.FinishDirectSnapshot(bg, *a.SnapshotId, types.SnapshotStateCompleted))
	_, err = s.StartDirectSnapshot(bg, DirectStart{VolumeSizeGiB: 1, ParentID: *a.SnapshotId})
	wantCode(t, err, "InvalidParameterValue") // smaller than the parent
	_, direct, err := s.DirectSnapshot(bg, *a.SnapshotId)
	if err != nil || !direct {
		t.Fatalf("DirectSnapshot: %v %v", direct, err)
	}
	_, _, err = s.DirectSnapshot(bg, "snap-0123456789abcdef0")
	if !IsSnapshotNotFound(err) {
		t.Fatalf("unknown snapshot: %v", err)
	}
}
