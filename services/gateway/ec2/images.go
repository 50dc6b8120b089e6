package ec2

import (
	"context"
	"fmt"
	"regexp"
	"sort"
	"strings"
	"time"

	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"

	"hangar.dev/hangar/services/gateway/awserr"
	"hangar.dev/hangar/services/internal/store"
)

var kindImage = register(&kind{Prefix: "ami", ResourceType: types.ResourceTypeImage, NotFound: "InvalidAMIID.NotFound", Malformed: "InvalidAMIID.Malformed", Noun: "image id"})

// imageRecord is an AMI as stored: the API's view (tags apart) and the
// snapshot its root device boots from.
type imageRecord struct {
	types.Image
	RootSnapshotID string
	// SourceInstanceID is set while CreateImage is still snapshotting.
	SourceInstanceID string
}

// imageName is what AWS allows in an AMI name: 3 to 128 letters, digits,
// and ( ) [ ] space . / - ' @ _
var imageName = regexp.MustCompile(`^[A-Za-z0-9()\[\] ./\-'@_]{3,128}$`)

// defaultRootDevice is where Linux AMIs put their root volume.
const defaultRootDevice = "/dev/xvda"

func (r *imageRecord) view(tags []types.Tag) types.Image {
	out := r.Image
	out.Tags = tags
	return out
}

// rootMapping returns the image's root block device mapping.
func (r *imageRecord) rootMapping() (types.BlockDeviceMapping, bool) {
	for _, m := range r.BlockDeviceMappings {
		if deref(m.DeviceName) == deref(r.RootDeviceName) && m.Ebs != nil {
			return m, true
		}
	}
	return types.BlockDeviceMapping{}, false
}

func checkImageName(name *string) error {
	if name == nil {
		return awserr.MissingParameter("Name")
	}
	if !imageName.MatchString(*name) {
		return awserr.InvalidParameterValue("AMI names must be between 3 and 128 characters long, and may contain letters, numbers, '(', ')', '.', '-', '/', '_', '[', ']', ' ', '@' and '''; '%s' is not.", clip(*name))
	}
	return nil
}

func imageNameFree(tx *store.Tx, owner, name string) error {
	dup, err := exists(tx, kindImage, func(_ string, r *imageRecord) bool {
		return deref(r.Name) == name && deref(r.OwnerId) == owner
	})
	if err != nil {
		return err
	}
	if dup {
		return awserr.New(400, "InvalidAMIName.Duplicate", "AMI name %s is already in use by AMI", name)
	}
	return nil
}

// registerImage validates the mappings of a new AMI against the snapshots
// they name and writes the record.
func (s *Service) registerImage(tx *store.Tx, in *ec2.RegisterImageInput, tags []types.Tag, state types.ImageState) (*imageRecord, error) {
	if err := checkImageName(in.Name); err != nil {
		return nil, err
	}
	if err := imageNameFree(tx, s.account(), *in.Name); err != nil {
		return nil, err
	}
	if in.ImageLocation != nil {
		return nil, awserr.InvalidParameterValue("Instance-store (S3) AMIs are not supported by hangar; register an EBS snapshot")
	}
	arch := in.Architecture
	if arch == "" {
		arch = types.ArchitectureValuesX8664
	}
	if arch != types.ArchitectureValuesX8664 {
		return nil, awserr.InvalidParameterValue("Architecture %s is not supported by this host; it runs x86_64 guests", arch)
	}
	if in.VirtualizationType != nil && *in.VirtualizationType != "hvm" {
		return nil, awserr.InvalidParameterValue("Virtualization type %s is not supported; hangar runs hvm guests", *in.VirtualizationType)
	}
	boot := in.BootMode
	switch boot {
	case "":
		boot = types.BootModeValuesLegacyBios
	case types.BootModeValuesLegacyBios, types.BootModeValuesUefi:
	case types.BootModeValuesUefiPreferred:
		boot = types.BootModeValuesUefi
	default:
		return nil, awserr.InvalidParameterValue("Value (%s) for parameter bootMode is invalid.", boot)
	}
	root := deref(in.RootDeviceName)
	if root == "" {
		root = defaultRootDevice
	}
	if !validDevice.MatchString(root) {
		return nil, awserr.InvalidParameterValue("Value (%s) for parameter rootDeviceName is invalid.", clip(root))
	}
	var (
		mappings []types.BlockDeviceMapping
		rootSnap string
		seen     = map[string]bool{}
	)
	for _, m := range in.BlockDeviceMappings {
		dev := deref(m.DeviceName)
		if dev == "" {
			return nil, awserr.MissingParameter("BlockDeviceMapping.DeviceName")
		}
		if seen[dev] {
			return nil, awserr.InvalidParameterValue("The device name %s is used more than once", dev)
		}
		seen[dev] = true
		if m.NoDevice != nil || m.VirtualName != nil {
			mappings = append(mappings, m)
			continue
		}
		if m.Ebs == nil {
			return nil, awserr.InvalidParameterValue("Block device mapping %s needs Ebs, NoDevice or VirtualName", dev)
		}
		ebs := *m.Ebs
		if deref(ebs.Encrypted) || ebs.KmsKeyId != nil {
			return nil, awserr.UnsupportedOperation("Encrypted volumes are not supported by hangar.")
		}
		if snapID := deref(ebs.SnapshotId); snapID != "" {
			snap, err := get[snapshotRecord](tx, kindSnapshot, snapID)
			if err != nil {
				return nil, err
			}
			if snap.State != types.SnapshotStateCompleted && state == types.ImageStateAvailable {
				return nil, awserr.New(400, "IncorrectState", "Snapshot %s is %s; register an image from a completed snapshot", snapID, snap.State)
			}
			if ebs.VolumeSize == nil {
				ebs.VolumeSize = snap.VolumeSize
			} else if *ebs.VolumeSize < deref(snap.VolumeSize) {
				return nil, awserr.InvalidParameterValue("Volume of size %dGiB is smaller than snapshot '%s', expect size >= %dGiB", *ebs.VolumeSize, snapID, deref(snap.VolumeSize))
			}
			if dev == root {
				rootSnap = snapID
			}
		} else if ebs.VolumeSize == nil {
			return nil, awserr.MissingParameter("BlockDeviceMapping.Ebs.VolumeSize or SnapshotId")
		}
		if dev == root && deref(ebs.SnapshotId) == "" {
			return nil, awserr.InvalidParameterValue("The root device %s must be created from a snapshot", root)
		}
		if ebs.VolumeType == "" {
			ebs.VolumeType = types.VolumeTypeGp3
		}
		if _, err := checkVolumeSpec(deref(ebs.VolumeSize), ebs.VolumeType, ebs.Iops, ebs.Throughput); err != nil {
			return nil, err
		}
		if ebs.DeleteOnTermination == nil {
			ebs.DeleteOnTermination = ptr(true)
		}
		ebs.Encrypted = ptr(false)
		m.Ebs = &ebs
		mappings = append(mappings, m)
	}
	if rootSnap == "" && state == types.ImageStateAvailable {
		return nil, awserr.InvalidParameterValue("The root device %s has no block device mapping with a snapshot; give --block-device-mappings DeviceName=%s,Ebs={SnapshotId=snap-…}", root, root)
	}
	sort.Slice(mappings, func(i, j int) bool { return deref(mappings[i].DeviceName) < deref(mappings[j].DeviceName) })
	id, err := newID(tx, kindImage.Prefix)
	if err != nil {
		return nil, err
	}
	now := s.now().UTC().Format(time.RFC3339)
	ena := in.EnaSupport
	if ena == nil {
		ena = ptr(true)
	}
	rec := &imageRecord{Image: types.Image{
		ImageId:             ptr(id),
		Name:                in.Name,
		Description:         in.Description,
		Architecture:        arch,
		BootMode:            boot,
		BlockDeviceMappings: mappings,
		CreationDate:        ptr(now),
		EnaSupport:          ena,
		Hypervisor:          types.HypervisorTypeXen,
		ImageType:           types.ImageTypeValuesMachine,
		ImageLocation:       ptr(s.account() + "/" + *in.Name),
		OwnerId:             ptr(s.account()),
		PlatformDetails:     ptr("Linux/UNIX"),
		UsageOperation:      ptr("RunInstances"),
		Public:              ptr(false),
		RootDeviceName:      ptr(root),
		RootDeviceType:      types.DeviceTypeEbs,
		SriovNetSupport:     ptr("simple"),
		State:               state,
		VirtualizationType:  types.VirtualizationTypeHvm,
		ImdsSupport:         in.ImdsSupport,
		TpmSupport:          in.TpmSupport,
		ProductCodes:        []types.ProductCode{},
		SourceInstanceId:    nil,
		DeprecationTime:     nil,
	}, RootSnapshotID: rootSnap}
	if err := put(tx, kindImage, id, rec); err != nil {
		return nil, err
	}
	if len(tags) > 0 {
		if err := addTags(tx, id, tags); err != nil {
			return nil, err
		}
	}
	return rec, nil
}

// RegisterImage registers an AMI from EBS snapshots.
func (s *Service) RegisterImage(ctx context.Context, in *ec2.RegisterImageInput) (*ec2.RegisterImageOutput, error) {
	tags, err := tagSpecs(in.TagSpecifications, types.ResourceTypeImage)
	if err != nil {
		return nil, err
	}
	var id string
	err = s.db.Update(func(tx *store.Tx) error {
		rec, err := s.registerImage(tx, in, tags, types.ImageStateAvailable)
		if err != nil {
			return err
		}
		id = *rec.ImageId
		return nil
	})
	if err != nil {
		return nil, err
	}
	s.log.Info("registered image", "image", id, "name", deref(in.Name))
	return &ec2.RegisterImageOutput{ImageId: &id}, nil
}

var imageFilters = filterSet[imageRecord]{
	"architecture": func(r *imageRecord) []string { return []string{string(r.Architecture)} },
	"block-device-mapping.delete-on-termination": func(r *imageRecord) []string {
		return mappingValues(r, func(m types.BlockDeviceMapping) string { return boolString(deref(m.Ebs.DeleteOnTermination)) })
	},
	"block-device-mapping.device-name": func(r *imageRecord) []string {
		return mappingValues(r, func(m types.BlockDeviceMapping) string { return deref(m.DeviceName) })
	},
	"block-device-mapping.snapshot-id": func(r *imageRecord) []string {
		return mappingValues(r, func(m types.BlockDeviceMapping) string { return deref(m.Ebs.SnapshotId) })
	},
	"block-device-mapping.volume-size": func(r *imageRecord) []string {
		return mappingValues(r, func(m types.BlockDeviceMapping) string { return fmt.Sprint(deref(m.Ebs.VolumeSize)) })
	},
	"block-device-mapping.volume-type": func(r *imageRecord) []string {
		return mappingValues(r, func(m types.BlockDeviceMapping) string { return string(m.Ebs.VolumeType) })
	},
	"block-device-mapping.encrypted": func(r *imageRecord) []string {
		return mappingValues(r, func(m types.BlockDeviceMapping) string { return "false" })
	},
	"boot-mode":           func(r *imageRecord) []string { return []string{string(r.BootMode)} },
	"creation-date":       func(r *imageRecord) []string { return []string{deref(r.CreationDate)} },
	"description":         func(r *imageRecord) []string { return []string{deref(r.Description)} },
	"ena-support":         func(r *imageRecord) []string { return []string{boolString(deref(r.EnaSupport))} },
	"hypervisor":          func(r *imageRecord) []string { return []string{string(r.Hypervisor)} },
	"image-id":            func(r *imageRecord) []string { return []string{deref(r.ImageId)} },
	"image-type":          func(r *imageRecord) []string { return []string{string(r.ImageType)} },
	"is-public":           func(r *imageRecord) []string { return []string{boolString(deref(r.Public))} },
	"manifest-location":   func(r *imageRecord) []string { return []string{deref(r.ImageLocation)} },
	"name":                func(r *imageRecord) []string { return []string{deref(r.Name)} },
	"owner-alias":         func(r *imageRecord) []string { return []string{deref(r.ImageOwnerAlias)} },
	"owner-id":            func(r *imageRecord) []string { return []string{deref(r.OwnerId)} },
	"platform-details":    func(r *imageRecord) []string { return []string{deref(r.PlatformDetails)} },
	"root-device-name":    func(r *imageRecord) []string { return []string{deref(r.RootDeviceName)} },
	"root-device-type":    func(r *imageRecord) []string { return []string{string(r.RootDeviceType)} },
	"state":               func(r *imageRecord) []string { return []string{string(r.State)} },
	"usage-operation":     func(r *imageRecord) []string { return []string{deref(r.UsageOperation)} },
	"virtualization-type": func(r *imageRecord) []string { return []string{string(r.VirtualizationType)} },
	"source-instance-id":  func(r *imageRecord) []string { return []string{deref(r.SourceInstanceId)} },
}

func mappingValues(r *imageRecord, get func(types.BlockDeviceMapping) string) []string {
	var out []string
	for _, m := range r.BlockDeviceMappings {
		if m.Ebs != nil {
			out = append(out, get(m))
		}
	}
	return out
}

// DescribeImages lists AMIs. Every AMI on a host belongs to the host's
// account; owner "self", the account id, and "amazon" (hangar's own
// starter images carry the alias) select among them.
func (s *Service) DescribeImages(ctx context.Context, in *ec2.DescribeImagesInput) (*ec2.DescribeImagesOutput, error) {
	match, err := imageFilters.compile(in.Filters)
	if err != nil {
		return nil, err
	}
	p, err := newPager(in.MaxResults, in.NextToken, 5, 1000)
	if err != nil {
		return nil, err
	}
	owners := map[string]bool{}
	for _, o := range in.Owners {
		switch {
		case o == "self" || o == s.account():
			owners["self"] = true
		case o == "amazon" || o == "aws-marketplace" || o == "aws-backup-vault":
			owners[o] = true
		case len(o) == 12 && strings.Trim(o, "0123456789") == "":
			owners["other"] = true
		default:
			return nil, awserr.InvalidParameterValue("Invalid owner: %s", clip(o))
		}
	}
	for _, u := range in.ExecutableUsers {
		if u != "self" && u != "all" && u != s.account() {
			return nil, awserr.InvalidParameterValue("Invalid user id: %s", clip(u))
		}
	}
	ownerMatch := func(r *imageRecord) bool {
		if len(owners) == 0 {
			return true
		}
		if owners["self"] && deref(r.OwnerId) == s.account() {
			return true
		}
		return owners["amazon"] && deref(r.ImageOwnerAlias) == "amazon"
	}
	out := &ec2.DescribeImagesOutput{Images: []types.Image{}}
	err = s.db.View(func(tx *store.Tx) error {
		next, err := list(tx, kindImage, in.ImageIds, func(r *imageRecord, tags []types.Tag) bool {
			return ownerMatch(r) && match(r, tags)
		}, p, func(_ string, r *imageRecord, tags []types.Tag) {
			out.Images = append(out.Images, r.view(tags))
		})
		out.NextToken = next
		return err
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// DeregisterImage deregisters an AMI; its snapshots stay, as in AWS, and
// instances launched from it run on.
func (s *Service) DeregisterImage(ctx context.Context, in *ec2.DeregisterImageInput) (*ec2.DeregisterImageOutput, error) {
	if in.ImageId == nil {
		return nil, awserr.MissingParameter("ImageId")
	}
	var snaps []string
	err := s.db.Update(func(tx *store.Tx) error {
		r, err := get[imageRecord](tx, kindImage, *in.ImageId)
		if err != nil {
			return err
		}
		if deref(r.OwnerId) != s.account() {
			return awserr.UnauthorizedOperation("You are not authorized to deregister %s", *in.ImageId)
		}
		for _, m := range r.BlockDeviceMappings {
			if m.Ebs != nil && deref(m.Ebs.SnapshotId) != "" {
				snaps = append(snaps, *m.Ebs.SnapshotId)
			}
		}
		return remove(tx, kindImage, *in.ImageId)
	})
	if err != nil {
		return nil, err
	}
	out := &ec2.DeregisterImageOutput{Return: ptr(true)}
	if !deref(in.DeleteAssociatedSnapshots) {
		return out, nil
	}
	// AWS reports each snapshot's fate instead of failing the whole call.
	for _, id := range snaps {
		res := types.DeleteSnapshotReturnCode{SnapshotId: ptr(id), ReturnCode: types.SnapshotReturnCodesSuccess}
		if _, err := s.DeleteSnapshot(ctx, &ec2.DeleteSnapshotInput{SnapshotId: ptr(id)}); err != nil {
			switch e := awserr.As(err); {
			case e.Code == "InvalidSnapshot.InUse":
				res.ReturnCode = types.SnapshotReturnCodesWarnSkipped
			case e.Status >= 500:
				res.ReturnCode = types.SnapshotReturnCodesErrorCodeInternalError
			default:
				res.ReturnCode = types.SnapshotReturnCodesErrorCodeClientError
			}
		}
		out.DeleteSnapshotResults = append(out.DeleteSnapshotResults, res)
	}
	return out, nil
}

// imageForLaunch returns an image run-instances may use.
func imageForLaunch(tx *store.Tx, id string) (*imageRecord, error) {
	r, err := get[imageRecord](tx, kindImage, id)
	if err != nil {
		return nil, err
	}
	if r.State != types.ImageStateAvailable {
		return nil, awserr.New(400, "InvalidAMIID.Unavailable", "AMI '%s' is %s; only available images can be launched", id, r.State)
	}
	return r, nil
}

// imageUsingSnapshot names an AMI that boots from or maps snapID, or "".
func imageUsingSnapshot(tx *store.Tx, snapID string) (string, error) {
	found := ""
	_, err := exists(tx, kindImage, func(id string, r *imageRecord) bool {
		for _, m := range r.BlockDeviceMappings {
			if m.Ebs != nil && deref(m.Ebs.SnapshotId) == snapID {
				found = id
				return true
			}
		}
		return false
	})
	return found, err
}
