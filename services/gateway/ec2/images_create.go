package ec2

import (
	"context"
	"fmt"
	"sort"
	"time"

	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"

	"hangar.dev/hangar/services/gateway/awserr"
	"hangar.dev/hangar/services/internal/store"
)

// imageWait bounds how long CreateImage waits for the instance to stop and
// its snapshots to complete.
const imageWait = 30 * time.Minute

// CreateImage makes an AMI of an instance's volumes. Unless NoReboot, a
// running instance is stopped for the snapshots and started again, as EC2
// reboots it, so the file systems are consistent; with NoReboot the
// snapshots are still point-in-time (crash-consistent). The image is
// pending until every snapshot has completed.
func (s *Service) CreateImage(ctx context.Context, in *ec2.CreateImageInput) (*ec2.CreateImageOutput, error) {
	if in.InstanceId == nil {
		return nil, awserr.MissingParameter("InstanceId")
	}
	if err := checkImageName(in.Name); err != nil {
		return nil, err
	}
	if err := checkDescription(in.Description); err != nil {
		return nil, err
	}
	if _, err := s.ebsd(); err != nil {
		return nil, err
	}
	var imageTags, snapTags []types.Tag
	for _, spec := range in.TagSpecifications {
		switch spec.ResourceType {
		case types.ResourceTypeImage:
			imageTags = append(imageTags, spec.Tags...)
		case types.ResourceTypeSnapshot:
			snapTags = append(snapTags, spec.Tags...)
		default:
			return nil, awserr.InvalidParameterValue("'%s' is not a valid taggable resource type for this operation.", spec.ResourceType)
		}
		for _, t := range spec.Tags {
			if err := validateTag(t); err != nil {
				return nil, err
			}
		}
	}
	instID := *in.InstanceId
	var (
		id     string
		reboot bool
	)
	err := s.db.Update(func(tx *store.Tx) error {
		inst, err := get[instanceRecord](tx, kindInstance, instID)
		if err != nil {
			return err
		}
		switch inst.state() {
		case types.InstanceStateNameRunning:
			reboot = !deref(in.NoReboot)
		case types.InstanceStateNameStopped:
		default:
			return awserr.New(400, "IncorrectInstanceState", "The instance '%s' is not in the 'running' or 'stopped' state.", instID)
		}
		if err := imageNameFree(tx, s.account(), *in.Name); err != nil {
			return err
		}
		if id, err = newID(tx, kindImage.Prefix); err != nil {
			return err
		}
		rec := &imageRecord{Image: types.Image{
			ImageId: ptr(id), Name: in.Name, Description: in.Description, Architecture: inst.Architecture, BootMode: inst.BootMode,
			CreationDate: ptr(s.now().UTC().Format(time.RFC3339)), EnaSupport: ptr(true), Hypervisor: types.HypervisorTypeXen,
			ImageType: types.ImageTypeValuesMachine, ImageLocation: ptr(s.account() + "/" + *in.Name), OwnerId: ptr(s.account()),
			PlatformDetails: ptr("Linux/UNIX"), UsageOperation: ptr("RunInstances"), Public: ptr(false), RootDeviceName: inst.RootDeviceName,
			RootDeviceType: types.DeviceTypeEbs, SriovNetSupport: ptr("simple"), State: types.ImageStatePending,
			VirtualizationType: types.VirtualizationTypeHvm, SourceInstanceId: ptr(instID), ProductCodes: []types.ProductCode{},
			BlockDeviceMappings: []types.BlockDeviceMapping{},
		}, SourceInstanceID: instID}
		if err := put(tx, kindImage, id, rec); err != nil {
			return err
		}
		if len(imageTags) > 0 {
			return addTags(tx, id, imageTags)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	go s.buildImage(context.WithoutCancel(ctx), id, instID, reboot, in.BlockDeviceMappings, snapTags)
	return &ec2.CreateImageOutput{ImageId: &id}, nil
}

// buildImage does CreateImage's work after the call has answered.
func (s *Service) buildImage(ctx context.Context, imageID, instID string, reboot bool, overrides []types.BlockDeviceMapping, snapTags []types.Tag) {
	ctx, cancel := context.WithTimeout(ctx, imageWait)
	defer cancel()
	err := s.snapshotInstance(ctx, imageID, instID, reboot, overrides, snapTags)
	if err == nil {
		return
	}
	s.log.Warn("creating an image failed", "image", imageID, "instance", instID, "err", err)
	e := awserr.As(err)
	_ = s.db.Update(func(tx *store.Tx) error {
		r, gerr := get[imageRecord](tx, kindImage, imageID)
		if gerr != nil {
			return nil
		}
		r.State = types.ImageStateFailed
		r.StateReason = &types.StateReason{Code: ptr("Server.InternalError"), Message: ptr(e.Code + ": " + e.Message)}
		r.SourceInstanceID = ""
		return put(tx, kindImage, imageID, r)
	})
}

func (s *Service) snapshotInstance(ctx context.Context, imageID, instID string, reboot bool, overrides []types.BlockDeviceMapping, snapTags []types.Tag) error {
	if reboot {
		if _, err := s.StopInstances(ctx, &ec2.StopInstancesInput{InstanceIds: []string{instID}}); err != nil {
			return err
		}
		if err := s.waitInstance(ctx, instID, types.InstanceStateNameStopped); err != nil {
			return err
		}
	}
	var parts *instanceParts
	if err := s.db.View(func(tx *store.Tx) (err error) { parts, err = readInstance(tx, instID); return err }); err != nil {
		return err
	}
	skip := map[string]bool{}
	for _, m := range overrides {
		if m.NoDevice != nil {
			skip[deref(m.DeviceName)] = true
		}
	}
	var mappings []types.BlockDeviceMapping
	var snaps []string
	root := ""
	for _, v := range parts.volumes {
		a := v.Attachments[0]
		dev := deref(a.Device)
		if skip[dev] && dev != deref(parts.rec.RootDeviceName) {
			continue
		}
		snap, err := s.snapshotVolume(ctx, deref(v.VolumeId), fmt.Sprintf("Created by CreateImage(%s) for %s", instID, imageID), snapTags)
		if err != nil {
			return err
		}
		snaps = append(snaps, *snap.SnapshotId)
		if dev == deref(parts.rec.RootDeviceName) {
			root = *snap.SnapshotId
		}
		mappings = append(mappings, types.BlockDeviceMapping{DeviceName: ptr(dev), Ebs: &types.EbsBlockDevice{
			SnapshotId: snap.SnapshotId, VolumeSize: v.Size, VolumeType: v.VolumeType, Iops: v.Iops, Throughput: v.Throughput,
			DeleteOnTermination: a.DeleteOnTermination, Encrypted: ptr(false),
		}})
	}
	// The snapshots are point-in-time from here: the guest may run again.
	if reboot {
		if _, err := s.StartInstances(ctx, &ec2.StartInstancesInput{InstanceIds: []string{instID}}); err != nil {
			s.log.Warn("restarting an instance after imaging it", "instance", instID, "err", err)
		}
	}
	if root == "" {
		return awserr.New(400, "IncorrectInstanceState", "Instance %s has no root volume to image", instID)
	}
	if err := s.waitSnapshots(ctx, snaps); err != nil {
		return err
	}
	sort.Slice(mappings, func(i, j int) bool { return deref(mappings[i].DeviceName) < deref(mappings[j].DeviceName) })
	return s.db.Update(func(tx *store.Tx) error {
		r, err := get[imageRecord](tx, kindImage, imageID)
		if err != nil {
			return err
		}
		r.BlockDeviceMappings, r.RootSnapshotID, r.State, r.SourceInstanceID = mappings, root, types.ImageStateAvailable, ""
		return put(tx, kindImage, imageID, r)
	})
}

func (s *Service) waitInstance(ctx context.Context, id string, want types.InstanceStateName) error {
	for {
		var st types.InstanceStateName
		if err := s.db.View(func(tx *store.Tx) error {
			r, err := get[instanceRecord](tx, kindInstance, id)
			if err == nil {
				st = r.state()
			}
			return err
		}); err != nil {
			return err
		}
		if st == want {
			return nil
		}
		if st == types.InstanceStateNameTerminated {
			return awserr.New(400, "IncorrectInstanceState", "Instance %s terminated while being imaged", id)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("instance %s did not become %s: %w", id, want, ctx.Err())
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// waitSnapshots waits until every snapshot has completed, asking ebsd.
func (s *Service) waitSnapshots(ctx context.Context, ids []string) error {
	for {
		if err := s.refreshSnapshots(ctx); err != nil {
			return err
		}
		done := 0
		var failed string
		err := s.db.View(func(tx *store.Tx) error {
			for _, id := range ids {
				r, err := get[snapshotRecord](tx, kindSnapshot, id)
				if err != nil {
					return err
				}
				switch r.State {
				case types.SnapshotStateCompleted:
					done++
				case types.SnapshotStateError:
					failed = id
				}
			}
			return nil
		})
		if err != nil {
			return err
		}
		if failed != "" {
			return awserr.New(500, "InternalError", "Snapshot %s failed", failed)
		}
		if done == len(ids) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("snapshots did not complete: %w", ctx.Err())
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// CopyImage copies an AMI within this host's region: each snapshot is
// copied (sharing its blocks) and a new image registered over the copies.
func (s *Service) CopyImage(ctx context.Context, in *ec2.CopyImageInput) (*ec2.CopyImageOutput, error) {
	if in.SourceImageId == nil {
		return nil, awserr.MissingParameter("SourceImageId")
	}
	if in.SourceRegion == nil {
		return nil, awserr.MissingParameter("SourceRegion")
	}
	if *in.SourceRegion != s.cfg.Region {
		return nil, awserr.InvalidParameterValue("Value (%s) for parameter sourceRegion is invalid. This host serves region %s only.", clip(*in.SourceRegion), s.cfg.Region)
	}
	if deref(in.Encrypted) || in.KmsKeyId != nil {
		return nil, awserr.UnsupportedOperation("Encrypted images are not supported by hangar.")
	}
	if err := checkImageName(in.Name); err != nil {
		return nil, err
	}
	var src *imageRecord
	if err := s.db.View(func(tx *store.Tx) (err error) {
		if src, err = imageForLaunch(tx, *in.SourceImageId); err != nil {
			return err
		}
		return imageNameFree(tx, s.account(), *in.Name)
	}); err != nil {
		return nil, err
	}
	var copied []string
	undo := func() {
		for _, id := range copied {
			_, _ = s.DeleteSnapshot(context.WithoutCancel(ctx), &ec2.DeleteSnapshotInput{SnapshotId: ptr(id)})
		}
	}
	reg := &ec2.RegisterImageInput{
		Name: in.Name, Description: in.Description, Architecture: src.Architecture, BootMode: src.BootMode,
		RootDeviceName: src.RootDeviceName, EnaSupport: src.EnaSupport, VirtualizationType: ptr("hvm"),
	}
	if reg.Description == nil {
		reg.Description = src.Description
	}
	for _, m := range src.BlockDeviceMappings {
		if m.Ebs == nil || deref(m.Ebs.SnapshotId) == "" {
			reg.BlockDeviceMappings = append(reg.BlockDeviceMappings, m)
			continue
		}
		out, err := s.CopySnapshot(ctx, &ec2.CopySnapshotInput{SourceSnapshotId: m.Ebs.SnapshotId, SourceRegion: in.SourceRegion,
			Description: ptr(fmt.Sprintf("Copied for DestinationAmi from SourceAmi %s", *in.SourceImageId))})
		if err != nil {
			undo()
			return nil, err
		}
		copied = append(copied, *out.SnapshotId)
		ebs := *m.Ebs
		ebs.SnapshotId = out.SnapshotId
		reg.BlockDeviceMappings = append(reg.BlockDeviceMappings, types.BlockDeviceMapping{DeviceName: m.DeviceName, Ebs: &ebs})
	}
	var id string
	err := s.db.Update(func(tx *store.Tx) error {
		rec, err := s.registerImage(tx, reg, nil, types.ImageStateAvailable)
		if err != nil {
			return err
		}
		id = *rec.ImageId
		return nil
	})
	if err != nil {
		undo()
		return nil, err
	}
	return &ec2.CopyImageOutput{ImageId: &id}, nil
}

// failInterruptedImages marks images a restart interrupted while
// CreateImage built them: their snapshots were never all recorded.
func (s *Service) failInterruptedImages() error {
	return s.db.Update(func(tx *store.Tx) error {
		recs, err := all(tx, kindImage, func(_ string, r *imageRecord) bool {
			return r.State == types.ImageStatePending && r.SourceInstanceID != ""
		})
		if err != nil {
			return err
		}
		for id, r := range recs {
			r.State = types.ImageStateFailed
			r.StateReason = &types.StateReason{Code: ptr("Server.InternalError"), Message: ptr("Server.InternalError: the gateway restarted while the image was being created")}
			r.SourceInstanceID = ""
			if err := put(tx, kindImage, id, r); err != nil {
				return err
			}
		}
		return nil
	})
}
