package ec2

import (
	"context"
	"fmt"
	"regexp"
	"sort"
	"strconv"
	"time"

	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"

	"hangar.dev/hangar/services/gateway/awserr"
	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/internal/store"
)

// Storage is what EC2 needs of hangar-ebsd, which holds the data of every
// volume and snapshot; *api.StorageClient has it. The gateway keeps the
// records as the API shows them and calls ebsd with the ids it chose.
type Storage interface {
	CreateVolume(ctx context.Context, volID string, sizeBytes uint64, fromSnapshot string) (api.VolumeInfo, error)
	DeleteVolume(ctx context.Context, volID string) error
	GetVolume(ctx context.Context, volID string) (api.VolumeInfo, error)
	ResizeVolume(ctx context.Context, volID string, sizeBytes uint64) (api.VolumeInfo, error)
	AttachVolume(ctx context.Context, volID, instanceID, device string) (api.VolumeInfo, error)
	DetachVolume(ctx context.Context, volID, instanceID string) (api.VolumeInfo, error)
	CreateSnapshot(ctx context.Context, snapID, volID string) (api.SnapshotInfo, error)
	DeleteSnapshot(ctx context.Context, snapID string) error
	GetSnapshot(ctx context.Context, snapID string) (api.SnapshotInfo, error)
	StartSnapshot(ctx context.Context, a api.StartSnapshotArgs) (api.SnapshotInfo, error)
	CompleteSnapshot(ctx context.Context, a api.CompleteSnapshotArgs) (api.SnapshotInfo, error)
}

var kindVolume = register(&kind{Prefix: "vol", ResourceType: types.ResourceTypeVolume, NotFound: "InvalidVolume.NotFound", Malformed: "InvalidVolumeID.Malformed", Noun: "volume"})

const (
	bucketVolumeMods = "volume-modifications"
	gib              = 1 << 30
)

// volumeRecord is a volume as stored. Tags live in the tags bucket.
type volumeRecord struct {
	types.Volume
}

func (v *volumeRecord) view(tags []types.Tag) types.Volume {
	out := v.Volume
	out.Tags = tags
	return out
}

// ebsd returns the storage service, or the error EC2 gives when its storage is down.
func (s *Service) ebsd() (Storage, error) {
	if s.storage == nil {
		return nil, awserr.New(503, "Unavailable", "The storage service (hangar-ebsd) is not running on this host.")
	}
	return s.storage, nil
}

// storageErr words an ebsd error as EC2 would.
func storageErr(err error, id string) error {
	e, ok := api.AsError(err)
	if !ok {
		return fmt.Errorf("calling hangar-ebsd for %s: %w", id, err)
	}
	switch e.Name {
	case api.ErrInsufficientCapacity:
		return awserr.New(503, "InsufficientVolumeCapacity", "There is not enough storage on this host for %s: %s", id, e.Message)
	case api.ErrInUse:
		return awserr.New(400, "VolumeInUse", "%s", e.Message)
	case api.ErrInvalidArgument:
		return awserr.InvalidParameterValue("%s", e.Message)
	case api.ErrNotFound:
		return awserr.New(400, "IncorrectState", "hangar-ebsd does not hold %s: %s", id, e.Message)
	case api.ErrUnavailable, "org.freedesktop.DBus.Error.ServiceUnknown", "org.freedesktop.DBus.Error.NameHasNoOwner":
		return awserr.New(503, "Unavailable", "The storage service (hangar-ebsd) is not available: %s", e.Message)
	}
	return fmt.Errorf("hangar-ebsd refused %s: %w", id, err)
}

// volumeLimits are the documented size, IOPS and throughput ranges per type.
type volumeLimits struct {
	minGiB, maxGiB     int32
	minIOPS, maxIOPS   int32
	iopsPerGiB         int32 // 0: IOPS not settable
	defaultIOPS        int32
	throughput         bool
	minTput, maxTput   int32
	defaultThroughput  int32
	iopsRequired       bool
	baselineIOPSPerGiB int32 // gp2: burst bucket baseline shown as Iops
}

var volumeTypes = map[types.VolumeType]volumeLimits{
	types.VolumeTypeGp2:      {minGiB: 1, maxGiB: 16384, baselineIOPSPerGiB: 3},
	types.VolumeTypeGp3:      {minGiB: 1, maxGiB: 16384, minIOPS: 3000, maxIOPS: 16000, iopsPerGiB: 500, defaultIOPS: 3000, throughput: true, minTput: 125, maxTput: 1000, defaultThroughput: 125},
	types.VolumeTypeIo1:      {minGiB: 4, maxGiB: 16384, minIOPS: 100, maxIOPS: 64000, iopsPerGiB: 50, iopsRequired: true},
	types.VolumeTypeIo2:      {minGiB: 4, maxGiB: 65536, minIOPS: 100, maxIOPS: 256000, iopsPerGiB: 1000, iopsRequired: true},
	types.VolumeTypeSt1:      {minGiB: 125, maxGiB: 16384},
	types.VolumeTypeSc1:      {minGiB: 125, maxGiB: 16384},
	types.VolumeTypeStandard: {minGiB: 1, maxGiB: 1024},
}

// volumeSpec is a validated size/type/performance triple.
type volumeSpec struct {
	size       int32
	vtype      types.VolumeType
	iops       *int32
	throughput *int32
}

// checkVolumeSpec applies EC2's rules for a volume type: size range, the
// IOPS range and IOPS-per-GiB ratio, throughput only on gp3 and at most
// 0.25 MiB/s per provisioned IOPS.
func checkVolumeSpec(size int32, vtype types.VolumeType, iops, tput *int32) (volumeSpec, error) {
	if vtype == "" {
		vtype = types.VolumeTypeGp2
	}
	lim, ok := volumeTypes[vtype]
	if !ok {
		return volumeSpec{}, awserr.InvalidParameterValue("Value (%s) for parameter volumeType is invalid. Valid values: gp2, gp3, io1, io2, st1, sc1, standard.", clip(string(vtype)))
	}
	if size < lim.minGiB || size > lim.maxGiB {
		return volumeSpec{}, awserr.InvalidParameterValue("Volume of %dGiB is invalid for volume type %s: the size must be between %d and %d GiB.", size, vtype, lim.minGiB, lim.maxGiB)
	}
	spec := volumeSpec{size: size, vtype: vtype}
	switch {
	case iops != nil && lim.iopsPerGiB == 0:
		return volumeSpec{}, awserr.InvalidParameterCombination("The parameter iops is not supported for %s volumes.", vtype)
	case iops == nil && lim.iopsRequired:
		return volumeSpec{}, awserr.MissingParameter("Iops")
	case iops != nil:
		n := *iops
		if n < lim.minIOPS || n > lim.maxIOPS {
			return volumeSpec{}, awserr.InvalidParameterValue("Volume iops of %d is invalid for %s: it must be between %d and %d.", n, vtype, lim.minIOPS, lim.maxIOPS)
		}
		if n > lim.iopsPerGiB*size && n > lim.minIOPS {
			return volumeSpec{}, awserr.InvalidParameterValue("Iops to volume size ratio of %.1f is too high; maximum is %d.", float64(n)/float64(size), lim.iopsPerGiB)
		}
		spec.iops = ptr(n)
	case lim.defaultIOPS > 0:
		spec.iops = ptr(lim.defaultIOPS)
	case lim.baselineIOPSPerGiB > 0:
		spec.iops = ptr(min(max(100, lim.baselineIOPSPerGiB*size), 16000))
	}
	switch {
	case tput != nil && !lim.throughput:
		return volumeSpec{}, awserr.InvalidParameterCombination("The parameter throughput is not supported for %s volumes.", vtype)
	case tput != nil:
		t := *tput
		if t < lim.minTput || t > lim.maxTput {
			return volumeSpec{}, awserr.InvalidParameterValue("Throughput of %d MiB/s is invalid: it must be between %d and %d.", t, lim.minTput, lim.maxTput)
		}
		if spec.iops != nil && t*4 > *spec.iops && t > lim.minTput {
			return volumeSpec{}, awserr.InvalidParameterValue("Throughput (MiBps) to iops ratio of %.2f is too high; maximum is 0.25 MiBps per iops.", float64(t)/float64(*spec.iops))
		}
		spec.throughput = ptr(t)
	case lim.throughput:
		spec.throughput = ptr(lim.defaultThroughput)
	}
	return spec, nil
}

// CreateVolume creates a volume, empty or from a snapshot, in the host's zone.
func (s *Service) CreateVolume(ctx context.Context, in *ec2.CreateVolumeInput) (*ec2.CreateVolumeOutput, error) {
	zone := deref(in.AvailabilityZone)
	if zone == "" && in.AvailabilityZoneId != nil {
		if *in.AvailabilityZoneId != zoneID(s.cfg.Region, s.cfg.AvailabilityZone) {
			return nil, awserr.InvalidParameterValue("Invalid availability zone ID: [%s]", clip(*in.AvailabilityZoneId))
		}
		zone = s.cfg.AvailabilityZone
	}
	if zone == "" {
		return nil, awserr.MissingParameter("AvailabilityZone")
	}
	if zone != s.cfg.AvailabilityZone {
		return nil, awserr.InvalidParameterValue("Invalid availability zone: [%s]; this host serves %s", clip(zone), s.cfg.AvailabilityZone)
	}
	if deref(in.Encrypted) || in.KmsKeyId != nil {
		return nil, awserr.UnsupportedOperation("Encrypted volumes are not supported by hangar.")
	}
	if deref(in.MultiAttachEnabled) {
		return nil, awserr.UnsupportedOperation("Multi-Attach is not supported by hangar.")
	}
	if in.OutpostArn != nil {
		return nil, awserr.InvalidParameterValue("Outposts are not supported by hangar.")
	}
	snapID := deref(in.SnapshotId)
	if in.Size == nil && snapID == "" {
		return nil, awserr.MissingParameter("Size or SnapshotId")
	}
	tags, err := tagSpecs(in.TagSpecifications, types.ResourceTypeVolume)
	if err != nil {
		return nil, err
	}
	st, err := s.ebsd()
	if err != nil {
		return nil, err
	}
	var size int32
	if snapID != "" {
		var snap *snapshotRecord
		err := s.db.View(func(tx *store.Tx) (err error) { snap, err = get[snapshotRecord](tx, kindSnapshot, snapID); return err })
		if err != nil {
			return nil, err
		}
		if snap.State != types.SnapshotStateCompleted {
			return nil, awserr.New(400, "IncorrectState", "Snapshot '%s' is %s; a volume can only be made from a completed snapshot.", snapID, snap.State)
		}
		size = deref(snap.VolumeSize)
		if in.Size != nil {
			if *in.Size < size {
				return nil, awserr.InvalidParameterValue("Volume of size %dGiB is smaller than snapshot '%s', expect size >= %dGiB", *in.Size, snapID, size)
			}
			size = *in.Size
		}
	} else {
		size = *in.Size
	}
	spec, err := checkVolumeSpec(size, in.VolumeType, in.Iops, in.Throughput)
	if err != nil {
		return nil, err
	}
	var id string
	if err := s.db.Update(func(tx *store.Tx) (err error) { id, err = newID(tx, kindVolume.Prefix); return err }); err != nil {
		return nil, err
	}
	// The data first: a volume record exists only for a volume that does.
	if _, err := st.CreateVolume(ctx, id, uint64(size)*gib, snapID); err != nil {
		return nil, storageErr(err, id)
	}
	now := s.now().UTC()
	rec := &volumeRecord{types.Volume{
		VolumeId: ptr(id), Size: ptr(size), SnapshotId: ptr(snapID), AvailabilityZone: ptr(zone),
		State: types.VolumeStateAvailable, CreateTime: &now, VolumeType: spec.vtype, Iops: spec.iops,
		Throughput: spec.throughput, Encrypted: ptr(false), MultiAttachEnabled: ptr(false),
		Attachments: []types.VolumeAttachment{},
	}}
	var out types.Volume
	err = s.db.Update(func(tx *store.Tx) error {
		if err := put(tx, kindVolume, id, rec); err != nil {
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
		_ = st.DeleteVolume(ctx, id)
		return nil, err
	}
	// EC2 answers "creating"; the record is available at once.
	out.State = types.VolumeStateCreating
	s.log.Info("created volume", "volume", id, "size_gib", size, "type", spec.vtype, "snapshot", snapID)
	return &ec2.CreateVolumeOutput{
		VolumeId: out.VolumeId, Size: out.Size, SnapshotId: out.SnapshotId, AvailabilityZone: out.AvailabilityZone,
		State: out.State, CreateTime: out.CreateTime, VolumeType: out.VolumeType, Iops: out.Iops, Throughput: out.Throughput,
		Encrypted: out.Encrypted, MultiAttachEnabled: out.MultiAttachEnabled, Tags: out.Tags, Attachments: out.Attachments,
	}, nil
}

var volumeFilters = filterSet[volumeRecord]{
	"volume-id":         func(v *volumeRecord) []string { return []string{deref(v.VolumeId)} },
	"size":              func(v *volumeRecord) []string { return []string{strconv.Itoa(int(deref(v.Size)))} },
	"status":            func(v *volumeRecord) []string { return []string{string(v.State)} },
	"snapshot-id":       func(v *volumeRecord) []string { return []string{deref(v.SnapshotId)} },
	"volume-type":       func(v *volumeRecord) []string { return []string{string(v.VolumeType)} },
	"availability-zone": func(v *volumeRecord) []string { return []string{deref(v.AvailabilityZone)} },
	"encrypted":         func(v *volumeRecord) []string { return []string{boolString(deref(v.Encrypted))} },
	"create-time": func(v *volumeRecord) []string {
		if v.CreateTime == nil {
			return nil
		}
		return []string{v.CreateTime.UTC().Format(time.RFC3339)}
	},
	"multi-attach-enabled": func(v *volumeRecord) []string { return []string{boolString(deref(v.MultiAttachEnabled))} },
	"attachment.instance-id": func(v *volumeRecord) []string {
		var out []string
		for _, a := range v.Attachments {
			out = append(out, deref(a.InstanceId))
		}
		return out
	},
	"attachment.device": func(v *volumeRecord) []string {
		var out []string
		for _, a := range v.Attachments {
			out = append(out, deref(a.Device))
		}
		return out
	},
	"attachment.status": func(v *volumeRecord) []string {
		var out []string
		for _, a := range v.Attachments {
			out = append(out, string(a.State))
		}
		return out
	},
	"attachment.delete-on-termination": func(v *volumeRecord) []string {
		var out []string
		for _, a := range v.Attachments {
			out = append(out, boolString(deref(a.DeleteOnTermination)))
		}
		return out
	},
}

// DescribeVolumes lists volumes.
func (s *Service) DescribeVolumes(ctx context.Context, in *ec2.DescribeVolumesInput) (*ec2.DescribeVolumesOutput, error) {
	match, err := volumeFilters.compile(in.Filters)
	if err != nil {
		return nil, err
	}
	// EC2 documents MaxResults as 5 to 500 and answers a larger value with
	// 500 volumes rather than an error; a plain `aws ec2 describe-volumes`
	// asks for 1000 (the CLI's EC2 page-size injector).
	maxResults := in.MaxResults
	if maxResults != nil && *maxResults > 500 {
		maxResults = ptr(int32(500))
	}
	p, err := newPager(maxResults, in.NextToken, 5, 500)
	if err != nil {
		return nil, err
	}
	out := &ec2.DescribeVolumesOutput{Volumes: []types.Volume{}}
	err = s.db.View(func(tx *store.Tx) error {
		next, err := list(tx, kindVolume, in.VolumeIds, match, p, func(_ string, v *volumeRecord, tags []types.Tag) {
			out.Volumes = append(out.Volumes, v.view(tags))
		})
		out.NextToken = next
		return err
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// DeleteVolume deletes a volume that is not attached.
func (s *Service) DeleteVolume(ctx context.Context, in *ec2.DeleteVolumeInput) (*ec2.DeleteVolumeOutput, error) {
	if in.VolumeId == nil {
		return nil, awserr.MissingParameter("VolumeId")
	}
	id := *in.VolumeId
	st, err := s.ebsd()
	if err != nil {
		return nil, err
	}
	var v *volumeRecord
	if err := s.db.View(func(tx *store.Tx) (err error) { v, err = get[volumeRecord](tx, kindVolume, id); return err }); err != nil {
		return nil, err
	}
	if len(v.Attachments) > 0 {
		return nil, awserr.New(400, "VolumeInUse", "Volume %s is currently attached to %s", id, deref(v.Attachments[0].InstanceId))
	}
	if err := st.DeleteVolume(ctx, id); err != nil {
		return nil, storageErr(err, id)
	}
	err = s.db.Update(func(tx *store.Tx) error {
		if err := remove(tx, kindVolume, id); err != nil {
			return err
		}
		return tx.Delete(bucketVolumeMods, id)
	})
	if err != nil {
		return nil, err
	}
	return &ec2.DeleteVolumeOutput{}, nil
}

// ModifyVolume grows a volume and changes its type or performance. The
// change applies at once, so the modification is completed when returned.
func (s *Service) ModifyVolume(ctx context.Context, in *ec2.ModifyVolumeInput) (*ec2.ModifyVolumeOutput, error) {
	if in.VolumeId == nil {
		return nil, awserr.MissingParameter("VolumeId")
	}
	id := *in.VolumeId
	if in.Size == nil && in.VolumeType == "" && in.Iops == nil && in.Throughput == nil && in.MultiAttachEnabled == nil {
		return nil, awserr.New(400, "InvalidParameterCombination", "At least one of Size, VolumeType, Iops or Throughput must be given")
	}
	if deref(in.MultiAttachEnabled) {
		return nil, awserr.UnsupportedOperation("Multi-Attach is not supported by hangar.")
	}
	st, err := s.ebsd()
	if err != nil {
		return nil, err
	}
	var v *volumeRecord
	if err := s.db.View(func(tx *store.Tx) (err error) { v, err = get[volumeRecord](tx, kindVolume, id); return err }); err != nil {
		return nil, err
	}
	size := deref(v.Size)
	if in.Size != nil {
		if *in.Size < size {
			return nil, awserr.InvalidParameterValue("New size cannot be smaller than existing size: %dGiB is smaller than %dGiB", *in.Size, size)
		}
		size = *in.Size
	}
	vtype := v.VolumeType
	if in.VolumeType != "" {
		vtype = in.VolumeType
	}
	iops, tput := in.Iops, in.Throughput
	if iops == nil && vtype == v.VolumeType && volumeTypes[vtype].iopsPerGiB > 0 {
		iops = v.Iops
	}
	if tput == nil && vtype == v.VolumeType && volumeTypes[vtype].throughput {
		tput = v.Throughput
	}
	spec, err := checkVolumeSpec(size, vtype, iops, tput)
	if err != nil {
		return nil, err
	}
	if size != deref(v.Size) {
		if _, err := st.ResizeVolume(ctx, id, uint64(size)*gib); err != nil {
			return nil, storageErr(err, id)
		}
	}
	now := s.now().UTC()
	mod := types.VolumeModification{
		VolumeId: ptr(id), ModificationState: types.VolumeModificationStateCompleted, Progress: ptr(int64(100)),
		StartTime: &now, EndTime: &now,
		OriginalSize: v.Size, TargetSize: ptr(size), OriginalVolumeType: v.VolumeType, TargetVolumeType: spec.vtype,
		OriginalIops: v.Iops, TargetIops: spec.iops, OriginalThroughput: v.Throughput, TargetThroughput: spec.throughput,
		OriginalMultiAttachEnabled: ptr(false), TargetMultiAttachEnabled: ptr(false),
	}
	err = s.db.Update(func(tx *store.Tx) error {
		cur, err := get[volumeRecord](tx, kindVolume, id)
		if err != nil {
			return err
		}
		cur.Size, cur.VolumeType, cur.Iops, cur.Throughput = ptr(size), spec.vtype, spec.iops, spec.throughput
		if err := put(tx, kindVolume, id, cur); err != nil {
			return err
		}
		return tx.Put(bucketVolumeMods, id, mod)
	})
	if err != nil {
		return nil, err
	}
	return &ec2.ModifyVolumeOutput{VolumeModification: &mod}, nil
}

var volumeModFilters = filterSet[types.VolumeModification]{
	"volume-id":            func(m *types.VolumeModification) []string { return []string{deref(m.VolumeId)} },
	"modification-state":   func(m *types.VolumeModification) []string { return []string{string(m.ModificationState)} },
	"target-size":          func(m *types.VolumeModification) []string { return []string{strconv.Itoa(int(deref(m.TargetSize)))} },
	"target-iops":          func(m *types.VolumeModification) []string { return []string{strconv.Itoa(int(deref(m.TargetIops)))} },
	"target-volume-type":   func(m *types.VolumeModification) []string { return []string{string(m.TargetVolumeType)} },
	"original-size":        func(m *types.VolumeModification) []string { return []string{strconv.Itoa(int(deref(m.OriginalSize)))} },
	"original-iops":        func(m *types.VolumeModification) []string { return []string{strconv.Itoa(int(deref(m.OriginalIops)))} },
	"original-volume-type": func(m *types.VolumeModification) []string { return []string{string(m.OriginalVolumeType)} },
	"start-time": func(m *types.VolumeModification) []string {
		if m.StartTime == nil {
			return nil
		}
		return []string{m.StartTime.UTC().Format(time.RFC3339)}
	},
}

// DescribeVolumesModifications lists the latest modification of volumes.
func (s *Service) DescribeVolumesModifications(ctx context.Context, in *ec2.DescribeVolumesModificationsInput) (*ec2.DescribeVolumesModificationsOutput, error) {
	match, err := volumeModFilters.compile(in.Filters)
	if err != nil {
		return nil, err
	}
	p, err := newPager(in.MaxResults, in.NextToken, 5, 500)
	if err != nil {
		return nil, err
	}
	out := &ec2.DescribeVolumesModificationsOutput{VolumesModifications: []types.VolumeModification{}}
	err = s.db.View(func(tx *store.Tx) error {
		if len(in.VolumeIds) > 0 {
			ids := append([]string(nil), in.VolumeIds...)
			sort.Strings(ids)
			for _, id := range ids {
				if _, err := get[volumeRecord](tx, kindVolume, id); err != nil {
					return err
				}
				var m types.VolumeModification
				if err := tx.Get(bucketVolumeMods, id, &m); err != nil {
					return awserr.New(400, "InvalidVolumeModification.NotFound", "Modification for volume '%s' does not exist.", id)
				}
				if match(&m, nil) {
					out.VolumesModifications = append(out.VolumesModifications, m)
				}
			}
			return nil
		}
		n := 0
		return tx.Each(bucketVolumeMods, p.after, func(id string, decode func(any) error) (bool, error) {
			var m types.VolumeModification
			if err := decode(&m); err != nil {
				return false, err
			}
			if !match(&m, nil) {
				return true, nil
			}
			if p.max > 0 && n == p.max {
				out.NextToken = token(deref(out.VolumesModifications[n-1].VolumeId))
				return false, nil
			}
			out.VolumesModifications = append(out.VolumesModifications, m)
			n++
			return true, nil
		})
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// validDevice is the EBS device names Linux instances take.
var validDevice = regexp.MustCompile(`^/dev/(sd[a-z]([1-9]|1[0-5])?|xvd[a-z]{1,2}|vd[a-z]|nvme[0-9]+n1)$`)

// instanceKind is the prefix of instance records; instances are another
// engineer's records, read here only for existence.
const instanceKind = "i"

// AttachVolume records that a volume is attached to an instance as a
// device; hangar-vmd acts on the record.
func (s *Service) AttachVolume(ctx context.Context, in *ec2.AttachVolumeInput) (*ec2.AttachVolumeOutput, error) {
	switch {
	case in.VolumeId == nil:
		return nil, awserr.MissingParameter("VolumeId")
	case in.InstanceId == nil:
		return nil, awserr.MissingParameter("InstanceId")
	case in.Device == nil:
		return nil, awserr.MissingParameter("Device")
	}
	id, inst, dev := *in.VolumeId, *in.InstanceId, *in.Device
	if !validDevice.MatchString(dev) {
		return nil, awserr.InvalidParameterValue("Value (%s) for parameter device is invalid. %s is not a valid EBS device name.", clip(dev), clip(dev))
	}
	st, err := s.ebsd()
	if err != nil {
		return nil, err
	}
	var (
		v        *volumeRecord
		instance *instanceRecord
	)
	err = s.db.View(func(tx *store.Tx) error {
		var err error
		if v, err = get[volumeRecord](tx, kindVolume, id); err != nil {
			return err
		}
		ir, err := get[instanceRecord](tx, kindInstance, inst)
		if err != nil {
			return err
		}
		instance = ir
		switch ir.state() {
		case types.InstanceStateNameTerminated, types.InstanceStateNameShuttingDown:
			return awserr.New(400, "IncorrectState", "Instance '%s' is not 'running' or 'stopped'.", inst)
		}
		if ir.Placement != nil && deref(v.AvailabilityZone) != deref(ir.Placement.AvailabilityZone) {
			return awserr.InvalidParameterValue("Volume '%s' is in a different Availability Zone from instance '%s'", id, inst)
		}
		if len(v.Attachments) > 0 {
			return awserr.New(400, "VolumeInUse", "%s is already attached to an instance", id)
		}
		return tx.Each(kindVolume.Prefix, "", func(other string, decode func(any) error) (bool, error) {
			var o volumeRecord
			if err := decode(&o); err != nil {
				return false, err
			}
			for _, a := range o.Attachments {
				if deref(a.InstanceId) == inst && deref(a.Device) == dev {
					return false, awserr.InvalidParameterValue("Attachment point %s is already in use", dev)
				}
			}
			return true, nil
		})
	})
	if err != nil {
		return nil, err
	}
	info, err := st.AttachVolume(ctx, id, inst, dev)
	if err != nil {
		return nil, storageErr(err, id)
	}
	// The guest gets the disk now (hot-plug) or at its next start.
	if s.compute != nil {
		if _, err := s.compute.AttachVolume(ctx, inst, api.InstanceDisk{ID: id, Socket: info.ExportSocket, Export: id, DeviceName: dev}); err != nil && !api.IsName(err, api.ErrNotFound) {
			_, _ = st.DetachVolume(context.WithoutCancel(ctx), id, inst)
			return nil, computeErr(err, inst, string(instance.InstanceType), s.cfg.AvailabilityZone)
		}
	}
	now := s.now().UTC()
	att := types.VolumeAttachment{VolumeId: ptr(id), InstanceId: ptr(inst), Device: ptr(dev), State: types.VolumeAttachmentStateAttached,
		AttachTime: &now, DeleteOnTermination: ptr(false)}
	err = s.db.Update(func(tx *store.Tx) error {
		cur, err := get[volumeRecord](tx, kindVolume, id)
		if err != nil {
			return err
		}
		cur.Attachments = []types.VolumeAttachment{att}
		cur.State = types.VolumeStateInUse
		return put(tx, kindVolume, id, cur)
	})
	if err != nil {
		return nil, err
	}
	return &ec2.AttachVolumeOutput{VolumeId: att.VolumeId, InstanceId: att.InstanceId, Device: att.Device,
		State: types.VolumeAttachmentStateAttaching, AttachTime: att.AttachTime, DeleteOnTermination: att.DeleteOnTermination}, nil
}

// DetachVolume clears a volume's attachment record.
func (s *Service) DetachVolume(ctx context.Context, in *ec2.DetachVolumeInput) (*ec2.DetachVolumeOutput, error) {
	if in.VolumeId == nil {
		return nil, awserr.MissingParameter("VolumeId")
	}
	id := *in.VolumeId
	st, err := s.ebsd()
	if err != nil {
		return nil, err
	}
	var v *volumeRecord
	if err := s.db.View(func(tx *store.Tx) (err error) { v, err = get[volumeRecord](tx, kindVolume, id); return err }); err != nil {
		return nil, err
	}
	if len(v.Attachments) == 0 {
		return nil, awserr.New(400, "IncorrectState", "Volume '%s' is in the 'available' state.", id)
	}
	att := v.Attachments[0]
	if in.InstanceId != nil && *in.InstanceId != deref(att.InstanceId) {
		return nil, awserr.New(400, "InvalidAttachment.NotFound", "Volume '%s' is not attached to instance '%s'", id, clip(*in.InstanceId))
	}
	if in.Device != nil && *in.Device != deref(att.Device) {
		return nil, awserr.New(400, "InvalidAttachment.NotFound", "Volume '%s' is not attached as device '%s'", id, clip(*in.Device))
	}
	inst := deref(att.InstanceId)
	var ir *instanceRecord
	_ = s.db.View(func(tx *store.Tx) (err error) { ir, err = get[instanceRecord](tx, kindInstance, inst); return err })
	if ir != nil && deref(att.Device) == deref(ir.RootDeviceName) && ir.state() != types.InstanceStateNameStopped && ir.state() != types.InstanceStateNameTerminated {
		return nil, awserr.New(400, "OperationNotPermitted", "Unable to detach root volume '%s' from instance '%s'; stop the instance first", id, inst)
	}
	// The guest lets go of the disk first, then ebsd stops serving it.
	if s.compute != nil && ir != nil && ir.state() != types.InstanceStateNameTerminated {
		if _, err := s.compute.DetachVolume(ctx, inst, id, deref(in.Force)); err != nil && !api.IsName(err, api.ErrNotFound) {
			return nil, computeErr(err, inst, string(ir.InstanceType), s.cfg.AvailabilityZone)
		}
	}
	if _, err := st.DetachVolume(ctx, id, inst); err != nil {
		return nil, storageErr(err, id)
	}
	err = s.db.Update(func(tx *store.Tx) error {
		cur, err := get[volumeRecord](tx, kindVolume, id)
		if err != nil {
			return err
		}
		cur.Attachments = []types.VolumeAttachment{}
		cur.State = types.VolumeStateAvailable
		return put(tx, kindVolume, id, cur)
	})
	if err != nil {
		return nil, err
	}
	return &ec2.DetachVolumeOutput{VolumeId: att.VolumeId, InstanceId: att.InstanceId, Device: att.Device,
		State: types.VolumeAttachmentStateDetaching, AttachTime: att.AttachTime, DeleteOnTermination: att.DeleteOnTermination}, nil
}

var volumeStatusFilters = filterSet[volumeRecord]{
	"volume-id":                  func(v *volumeRecord) []string { return []string{deref(v.VolumeId)} },
	"availability-zone":          func(v *volumeRecord) []string { return []string{deref(v.AvailabilityZone)} },
	"volume-status.status":       func(v *volumeRecord) []string { return []string{string(types.VolumeStatusInfoStatusOk)} },
	"volume-status.details-name": func(v *volumeRecord) []string { return []string{"io-enabled", "io-performance"} },
}

// DescribeVolumeStatus reports every volume's I/O as enabled: ebsd serves
// each volume's export from the moment it exists.
func (s *Service) DescribeVolumeStatus(ctx context.Context, in *ec2.DescribeVolumeStatusInput) (*ec2.DescribeVolumeStatusOutput, error) {
	match, err := volumeStatusFilters.compile(in.Filters)
	if err != nil {
		return nil, err
	}
	p, err := newPager(in.MaxResults, in.NextToken, 5, 1000)
	if err != nil {
		return nil, err
	}
	out := &ec2.DescribeVolumeStatusOutput{VolumeStatuses: []types.VolumeStatusItem{}}
	err = s.db.View(func(tx *store.Tx) error {
		next, err := list(tx, kindVolume, in.VolumeIds, match, p, func(id string, v *volumeRecord, _ []types.Tag) {
			perf := "not-applicable"
			if v.VolumeType == types.VolumeTypeIo1 || v.VolumeType == types.VolumeTypeIo2 {
				perf = "normal"
			}
			out.VolumeStatuses = append(out.VolumeStatuses, types.VolumeStatusItem{
				VolumeId: ptr(id), AvailabilityZone: v.AvailabilityZone,
				VolumeStatus: &types.VolumeStatusInfo{Status: types.VolumeStatusInfoStatusOk, Details: []types.VolumeStatusDetails{
					{Name: types.VolumeStatusNameIoEnabled, Status: ptr("passed")},
					{Name: types.VolumeStatusNameIoPerformance, Status: ptr(perf)},
				}},
				Actions: []types.VolumeStatusAction{}, Events: []types.VolumeStatusEvent{},
			})
		})
		out.NextToken = next
		return err
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}
