package ec2

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"

	"hangar.dev/hangar/services/gateway/awserr"
	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/internal/store"
)

var kindSnapshot = register(&kind{Prefix: "snap", ResourceType: types.ResourceTypeSnapshot, NotFound: "InvalidSnapshot.NotFound", Malformed: "InvalidSnapshotID.Malformed", Noun: "snapshot"})

// unknownVolume is the VolumeId AWS shows for snapshots not taken of a
// volume (copies, EBS direct imports).
const unknownVolume = "vol-ffffffff"

const bucketDirectTokens = "ebs-client-tokens"

// snapshotRecord is a snapshot as stored.
type snapshotRecord struct {
	types.Snapshot
	Direct bool // written with the EBS direct API
}

func (r *snapshotRecord) view(tags []types.Tag) types.Snapshot {
	out := r.Snapshot
	out.Tags = tags
	return out
}

func progress(p uint32) *string { return ptr(strconv.Itoa(int(p)) + "%") }

// CreateSnapshot takes a point-in-time snapshot of a volume; it is pending
// until ebsd has captured every block changed since the volume's last one.
func (s *Service) CreateSnapshot(ctx context.Context, in *ec2.CreateSnapshotInput) (*ec2.CreateSnapshotOutput, error) {
	if in.VolumeId == nil {
		return nil, awserr.MissingParameter("VolumeId")
	}
	if in.OutpostArn != nil || in.Location != "" && in.Location != types.SnapshotLocationEnumRegional {
		return nil, awserr.InvalidParameterValue("Outposts and local snapshots are not supported by hangar.")
	}
	tags, err := tagSpecs(in.TagSpecifications, types.ResourceTypeSnapshot)
	if err != nil {
		return nil, err
	}
	if err := checkDescription(in.Description); err != nil {
		return nil, err
	}
	snap, err := s.snapshotVolume(ctx, *in.VolumeId, deref(in.Description), tags)
	if err != nil {
		return nil, err
	}
	return &ec2.CreateSnapshotOutput{
		SnapshotId: snap.SnapshotId, VolumeId: snap.VolumeId, State: snap.State, Progress: snap.Progress, StartTime: snap.StartTime,
		VolumeSize: snap.VolumeSize, OwnerId: snap.OwnerId, Description: snap.Description, Encrypted: snap.Encrypted, Tags: snap.Tags,
		StorageTier: snap.StorageTier,
	}, nil
}

func checkDescription(d *string) error {
	if d != nil && len(*d) > 255 {
		return awserr.InvalidParameterValue("The description must be no longer than 255 characters")
	}
	return nil
}

func (s *Service) snapshotVolume(ctx context.Context, volID, desc string, tags []types.Tag) (*types.Snapshot, error) {
	st, err := s.ebsd()
	if err != nil {
		return nil, err
	}
	var (
		vol *volumeRecord
		id  string
	)
	err = s.db.Update(func(tx *store.Tx) (err error) {
		if vol, err = get[volumeRecord](tx, kindVolume, volID); err != nil {
			return err
		}
		id, err = newID(tx, kindSnapshot.Prefix)
		return err
	})
	if err != nil {
		return nil, err
	}
	info, err := st.CreateSnapshot(ctx, id, volID)
	if err != nil {
		return nil, storageErr(err, id)
	}
	now := s.now().UTC()
	rec := &snapshotRecord{Snapshot: types.Snapshot{
		SnapshotId: ptr(id), VolumeId: ptr(volID), State: stateOf(info.State), Progress: progress(info.Progress),
		StartTime: &now, VolumeSize: vol.Size, OwnerId: ptr(s.account()), Description: ptr(desc),
		Encrypted: ptr(false), StorageTier: types.StorageTierStandard,
	}}
	var out types.Snapshot
	err = s.db.Update(func(tx *store.Tx) error {
		if err := put(tx, kindSnapshot, id, rec); err != nil {
			return err
		}
		if len(tags) > 0 {
			if err := addTags(tx, id, tags); err != nil {
				return err
			}
		}
		out = rec.view(tagsOf(tx, id))
		return nil
	})
	if err != nil {
		_ = st.DeleteSnapshot(ctx, id)
		return nil, err
	}
	return &out, nil
}

func stateOf(s string) types.SnapshotState {
	switch s {
	case api.SnapshotCompleted:
		return types.SnapshotStateCompleted
	case api.SnapshotError:
		return types.SnapshotStateError
	}
	return types.SnapshotStatePending
}

// CreateSnapshots snapshots every volume attached to an instance.
func (s *Service) CreateSnapshots(ctx context.Context, in *ec2.CreateSnapshotsInput) (*ec2.CreateSnapshotsOutput, error) {
	if in.InstanceSpecification == nil || in.InstanceSpecification.InstanceId == nil {
		return nil, awserr.MissingParameter("InstanceSpecification.InstanceId")
	}
	inst := *in.InstanceSpecification.InstanceId
	if err := checkDescription(in.Description); err != nil {
		return nil, err
	}
	tags, err := tagSpecs(in.TagSpecifications, types.ResourceTypeSnapshot)
	if err != nil {
		return nil, err
	}
	exclude := map[string]bool{}
	for _, v := range in.InstanceSpecification.ExcludeDataVolumeIds {
		exclude[v] = true
	}
	excludeBoot := deref(in.InstanceSpecification.ExcludeBootVolume)
	var vols []*volumeRecord
	err = s.db.View(func(tx *store.Tx) error {
		if !tx.Has(instanceKind, inst) {
			return awserr.New(400, "InvalidInstanceID.NotFound", "The instance ID '%s' does not exist", clip(inst))
		}
		all, err := all[volumeRecord](tx, kindVolume, func(_ string, v *volumeRecord) bool {
			for _, a := range v.Attachments {
				if deref(a.InstanceId) == inst {
					return true
				}
			}
			return false
		})
		for _, v := range all {
			vols = append(vols, v)
		}
		return err
	})
	if err != nil {
		return nil, err
	}
	sort.Slice(vols, func(i, j int) bool { return *vols[i].VolumeId < *vols[j].VolumeId })
	out := &ec2.CreateSnapshotsOutput{Snapshots: []types.SnapshotInfo{}}
	for _, v := range vols {
		dev := deref(v.Attachments[0].Device)
		boot := dev == "/dev/sda1" || dev == "/dev/xvda" || dev == "/dev/vda"
		if exclude[*v.VolumeId] || boot && excludeBoot {
			continue
		}
		snapTags := tags
		if in.CopyTagsFromSource == types.CopyTagsFromSourceVolume {
			var vt []types.Tag
			_ = s.db.View(func(tx *store.Tx) error { vt = tagsOf(tx, *v.VolumeId); return nil })
			snapTags = append(append([]types.Tag{}, vt...), tags...)
		}
		snap, err := s.snapshotVolume(ctx, *v.VolumeId, deref(in.Description), snapTags)
		if err != nil {
			return nil, err
		}
		out.Snapshots = append(out.Snapshots, types.SnapshotInfo{
			SnapshotId: snap.SnapshotId, VolumeId: snap.VolumeId, State: snap.State, Progress: snap.Progress,
			StartTime: snap.StartTime, VolumeSize: snap.VolumeSize, OwnerId: snap.OwnerId, Description: snap.Description,
			Encrypted: snap.Encrypted, Tags: snap.Tags,
		})
	}
	return out, nil
}

// refreshSnapshots asks ebsd how pending snapshots are doing and records
// what changed; the API then shows progress without a watcher.
func (s *Service) refreshSnapshots(ctx context.Context) error {
	if s.storage == nil {
		return nil
	}
	var pending []string
	err := s.db.View(func(tx *store.Tx) error {
		recs, err := all[snapshotRecord](tx, kindSnapshot, func(_ string, r *snapshotRecord) bool { return r.State == types.SnapshotStatePending })
		for id := range recs {
			pending = append(pending, id)
		}
		return err
	})
	if err != nil {
		return err
	}
	for _, id := range pending {
		info, err := s.storage.GetSnapshot(ctx, id)
		state, prog := types.SnapshotState(""), (*string)(nil)
		switch {
		case api.IsName(err, api.ErrNotFound):
			state, prog = types.SnapshotStateError, progress(0)
		case err != nil:
			s.log.Warn("asking ebsd about a pending snapshot", "snapshot", id, "err", err)
			continue
		default:
			state, prog = stateOf(info.State), progress(info.Progress)
		}
		err = s.db.Update(func(tx *store.Tx) error {
			r, err := get[snapshotRecord](tx, kindSnapshot, id)
			if err != nil {
				return nil // deleted meanwhile
			}
			if r.State == state && deref(r.Progress) == deref(prog) {
				return nil
			}
			r.State, r.Progress = state, prog
			if state == types.SnapshotStateError && info.Error != "" {
				r.StateMessage = ptr(info.Error)
			}
			return put(tx, kindSnapshot, id, r)
		})
		if err != nil {
			return err
		}
	}
	return nil
}

var snapshotFilters = filterSet[snapshotRecord]{
	"snapshot-id": func(r *snapshotRecord) []string { return []string{deref(r.SnapshotId)} },
	"volume-id":   func(r *snapshotRecord) []string { return []string{deref(r.VolumeId)} },
	"status":      func(r *snapshotRecord) []string { return []string{string(r.State)} },
	"owner-id":    func(r *snapshotRecord) []string { return []string{deref(r.OwnerId)} },
	"owner-alias": func(r *snapshotRecord) []string { return nil },
	"description": func(r *snapshotRecord) []string { return []string{deref(r.Description)} },
	"progress":    func(r *snapshotRecord) []string { return []string{deref(r.Progress)} },
	"volume-size": func(r *snapshotRecord) []string { return []string{strconv.Itoa(int(deref(r.VolumeSize)))} },
	"encrypted":   func(r *snapshotRecord) []string { return []string{boolString(deref(r.Encrypted))} },
	"storage-tier": func(r *snapshotRecord) []string {
		return []string{string(r.StorageTier)}
	},
	"start-time": func(r *snapshotRecord) []string {
		if r.StartTime == nil {
			return nil
		}
		return []string{r.StartTime.UTC().Format(time.RFC3339)}
	},
}

// DescribeSnapshots lists the snapshots this account owns. Owner "self",
// the account id, or none select them; "amazon" and other owners have no
// snapshots on this host.
func (s *Service) DescribeSnapshots(ctx context.Context, in *ec2.DescribeSnapshotsInput) (*ec2.DescribeSnapshotsOutput, error) {
	match, err := snapshotFilters.compile(in.Filters)
	if err != nil {
		return nil, err
	}
	p, err := newPager(in.MaxResults, in.NextToken, 5, 1000)
	if err != nil {
		return nil, err
	}
	mine := len(in.OwnerIds) == 0
	for _, o := range in.OwnerIds {
		if o == "self" || o == s.account() {
			mine = true
		}
	}
	if err := s.refreshSnapshots(ctx); err != nil {
		return nil, err
	}
	out := &ec2.DescribeSnapshotsOutput{Snapshots: []types.Snapshot{}}
	if !mine {
		return out, nil
	}
	err = s.db.View(func(tx *store.Tx) error {
		next, err := list(tx, kindSnapshot, in.SnapshotIds, match, p, func(_ string, r *snapshotRecord, tags []types.Tag) {
			out.Snapshots = append(out.Snapshots, r.view(tags))
		})
		out.NextToken = next
		return err
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// DeleteSnapshot deletes a snapshot; volumes made from it keep their data.
func (s *Service) DeleteSnapshot(ctx context.Context, in *ec2.DeleteSnapshotInput) (*ec2.DeleteSnapshotOutput, error) {
	if in.SnapshotId == nil {
		return nil, awserr.MissingParameter("SnapshotId")
	}
	id := *in.SnapshotId
	st, err := s.ebsd()
	if err != nil {
		return nil, err
	}
	err = s.db.View(func(tx *store.Tx) error {
		if _, err := get[snapshotRecord](tx, kindSnapshot, id); err != nil {
			return err
		}
		// AWS keeps a snapshot an AMI still maps.
		ami, err := imageUsingSnapshot(tx, id)
		if err != nil {
			return err
		}
		if ami != "" {
			return awserr.New(400, "InvalidSnapshot.InUse", "The snapshot %s is currently in use by %s", id, ami)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	if err := st.DeleteSnapshot(ctx, id); err != nil {
		if api.IsName(err, api.ErrInUse) {
			return nil, awserr.New(400, "IncorrectState", "Snapshot '%s' is still being taken; delete it once it has completed.", id)
		}
		return nil, storageErr(err, id)
	}
	if err := s.db.Update(func(tx *store.Tx) error { return remove(tx, kindSnapshot, id) }); err != nil {
		return nil, err
	}
	return &ec2.DeleteSnapshotOutput{}, nil
}

// CopySnapshot copies a completed snapshot within this host's region. The
// copy is a child of the source with no changes of its own, so it shares
// every block and survives the source's deletion.
func (s *Service) CopySnapshot(ctx context.Context, in *ec2.CopySnapshotInput) (*ec2.CopySnapshotOutput, error) {
	if in.SourceSnapshotId == nil {
		return nil, awserr.MissingParameter("SourceSnapshotId")
	}
	if in.SourceRegion == nil {
		return nil, awserr.MissingParameter("SourceRegion")
	}
	if *in.SourceRegion != s.cfg.Region {
		return nil, awserr.InvalidParameterValue("Value (%s) for parameter sourceRegion is invalid. This host serves region %s only.", clip(*in.SourceRegion), s.cfg.Region)
	}
	if deref(in.Encrypted) || in.KmsKeyId != nil {
		return nil, awserr.UnsupportedOperation("Encrypted snapshots are not supported by hangar.")
	}
	if err := checkDescription(in.Description); err != nil {
		return nil, err
	}
	tags, err := tagSpecs(in.TagSpecifications, types.ResourceTypeSnapshot)
	if err != nil {
		return nil, err
	}
	st, err := s.ebsd()
	if err != nil {
		return nil, err
	}
	src := *in.SourceSnapshotId
	var (
		srcRec *snapshotRecord
		id     string
	)
	err = s.db.Update(func(tx *store.Tx) (err error) {
		if srcRec, err = get[snapshotRecord](tx, kindSnapshot, src); err != nil {
			return err
		}
		if srcRec.State != types.SnapshotStateCompleted {
			return awserr.New(400, "IncorrectState", "Snapshot '%s' is %s; only completed snapshots can be copied.", src, srcRec.State)
		}
		id, err = newID(tx, kindSnapshot.Prefix)
		return err
	})
	if err != nil {
		return nil, err
	}
	size := uint64(deref(srcRec.VolumeSize)) * gib
	if _, err := st.StartSnapshot(ctx, api.StartSnapshotArgs{SnapshotID: id, VolumeSizeBytes: size, ParentID: src, TimeoutMinutes: 10}); err != nil {
		return nil, storageErr(err, id)
	}
	if _, err := st.CompleteSnapshot(ctx, api.CompleteSnapshotArgs{SnapshotID: id}); err != nil {
		_ = st.DeleteSnapshot(ctx, id)
		return nil, storageErr(err, id)
	}
	desc := deref(in.Description)
	if in.Description == nil {
		desc = fmt.Sprintf("[Copied %s from %s]", src, s.cfg.Region)
	}
	now := s.now().UTC()
	rec := &snapshotRecord{Snapshot: types.Snapshot{
		SnapshotId: ptr(id), VolumeId: ptr(unknownVolume), State: types.SnapshotStateCompleted, Progress: progress(100),
		StartTime: &now, VolumeSize: srcRec.VolumeSize, OwnerId: ptr(s.account()), Description: ptr(desc),
		Encrypted: ptr(false), StorageTier: types.StorageTierStandard,
	}}
	err = s.db.Update(func(tx *store.Tx) error {
		if err := put(tx, kindSnapshot, id, rec); err != nil {
			return err
		}
		if len(tags) > 0 {
			return addTags(tx, id, tags)
		}
		return nil
	})
	if err != nil {
		_ = st.DeleteSnapshot(ctx, id)
		return nil, err
	}
	return &ec2.CopySnapshotOutput{SnapshotId: ptr(id), Tags: tags}, nil
}

// DirectStart is an EBS direct StartSnapshot as the gateway records it.
type DirectStart struct {
	VolumeSizeGiB  int64
	ParentID       string
	Description    string
	ClientToken    string
	TimeoutMinutes int32
	Tags           []types.Tag
}

// ErrDirectTokenMismatch is a ClientToken reused with other parameters.
var ErrDirectTokenMismatch = errors.New("the client token was used with other parameters")

type directToken struct {
	SnapshotID string
	InputHash  string
}

// StartDirectSnapshot records a snapshot the EBS direct API starts and
// starts it in ebsd. A retry with the same ClientToken returns the first
// snapshot. It is how DescribeSnapshots comes to show imports.
func (s *Service) StartDirectSnapshot(ctx context.Context, d DirectStart) (*types.Snapshot, error) {
	st, err := s.ebsd()
	if err != nil {
		return nil, err
	}
	for _, t := range d.Tags {
		if err := validateTag(t); err != nil {
			return nil, err
		}
	}
	hash := fmt.Sprintf("%d|%s|%s|%d", d.VolumeSizeGiB, d.ParentID, d.Description, d.TimeoutMinutes)
	for _, t := range d.Tags {
		hash += "|" + deref(t.Key) + "=" + deref(t.Value)
	}
	sum := sha256.Sum256([]byte(hash))
	hash = hex.EncodeToString(sum[:])
	var (
		id     string
		replay bool
	)
	err = s.db.Update(func(tx *store.Tx) error {
		if d.ClientToken != "" {
			var tok directToken
			if err := tx.Get(bucketDirectTokens, d.ClientToken, &tok); err == nil {
				if tok.InputHash != hash {
					return ErrDirectTokenMismatch
				}
				id, replay = tok.SnapshotID, true
				return nil
			}
		}
		if d.ParentID != "" {
			p, err := get[snapshotRecord](tx, kindSnapshot, d.ParentID)
			if err != nil {
				return err
			}
			if p.State != types.SnapshotStateCompleted {
				return awserr.New(400, "IncorrectState", "Parent snapshot '%s' is %s", d.ParentID, p.State)
			}
			if int64(deref(p.VolumeSize)) > d.VolumeSizeGiB {
				return awserr.InvalidParameterValue("The volume size %d GiB is smaller than the parent snapshot's %d GiB", d.VolumeSizeGiB, deref(p.VolumeSize))
			}
		}
		var err error
		id, err = newID(tx, kindSnapshot.Prefix)
		if err != nil {
			return err
		}
		if d.ClientToken != "" {
			return tx.Put(bucketDirectTokens, d.ClientToken, directToken{SnapshotID: id, InputHash: hash})
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	if replay {
		var out types.Snapshot
		err := s.db.View(func(tx *store.Tx) error {
			r, err := get[snapshotRecord](tx, kindSnapshot, id)
			if err == nil {
				out = r.view(tagsOf(tx, id))
			}
			return err
		})
		return &out, err
	}
	if _, err := st.StartSnapshot(ctx, api.StartSnapshotArgs{SnapshotID: id, VolumeSizeBytes: uint64(d.VolumeSizeGiB) * gib,
		ParentID: d.ParentID, TimeoutMinutes: uint32(d.TimeoutMinutes)}); err != nil {
		_ = s.db.Update(func(tx *store.Tx) error { return tx.Delete(bucketDirectTokens, d.ClientToken) })
		return nil, storageErr(err, id)
	}
	now := s.now().UTC()
	rec := &snapshotRecord{Direct: true, Snapshot: types.Snapshot{
		SnapshotId: ptr(id), VolumeId: ptr(unknownVolume), State: types.SnapshotStatePending, Progress: progress(0),
		StartTime: &now, VolumeSize: ptr(int32(d.VolumeSizeGiB)), OwnerId: ptr(s.account()), Description: ptr(d.Description),
		Encrypted: ptr(false), StorageTier: types.StorageTierStandard,
	}}
	var out types.Snapshot
	err = s.db.Update(func(tx *store.Tx) error {
		if err := put(tx, kindSnapshot, id, rec); err != nil {
			return err
		}
		if len(d.Tags) > 0 {
			if err := addTags(tx, id, d.Tags); err != nil {
				return err
			}
		}
		out = rec.view(tagsOf(tx, id))
		return nil
	})
	return &out, err
}

// DirectSnapshot returns a snapshot's record for the EBS direct API.
func (s *Service) DirectSnapshot(ctx context.Context, id string) (*types.Snapshot, bool, error) {
	var (
		out    types.Snapshot
		direct bool
	)
	err := s.db.View(func(tx *store.Tx) error {
		r, err := get[snapshotRecord](tx, kindSnapshot, id)
		if err != nil {
			return err
		}
		out, direct = r.view(tagsOf(tx, id)), r.Direct
		return nil
	})
	if err != nil {
		return nil, false, err
	}
	return &out, direct, nil
}

// FinishDirectSnapshot records a direct snapshot's final state.
func (s *Service) FinishDirectSnapshot(ctx context.Context, id string, state types.SnapshotState) error {
	return s.db.Update(func(tx *store.Tx) error {
		r, err := get[snapshotRecord](tx, kindSnapshot, id)
		if err != nil {
			return err
		}
		r.State = state
		if state == types.SnapshotStateCompleted {
			r.Progress = progress(100)
		}
		return put(tx, kindSnapshot, id, r)
	})
}

// IsSnapshotNotFound reports whether err is EC2's unknown-snapshot error.
func IsSnapshotNotFound(err error) bool {
	var e *awserr.Error
	return errors.As(err, &e) && (e.Code == kindSnapshot.NotFound || strings.HasSuffix(e.Code, ".Malformed"))
}
