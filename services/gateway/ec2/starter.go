package ec2

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"

	"hangar.dev/hangar/services/gateway/awserr"
	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/internal/store"
)

// BlockImporter is what importing a disk needs of ebsd beyond Storage: the
// EBS direct API's block writes.
type BlockImporter interface {
	PutBlock(ctx context.Context, snapID string, index uint64, data []byte, checksum string) error
}

// starterAMI describes a bundled disk (image/starter-ami writes ami.env
// next to the disk).
type starterAMI struct {
	Name, Description, Disk   string
	BootMode, Architecture    string
	RootDeviceName, DiskBytes string
}

func readStarterEnv(path string) (starterAMI, error) {
	var a starterAMI
	f, err := os.Open(path)
	if err != nil {
		return a, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(strings.TrimSpace(sc.Text()), "=")
		if !ok || strings.HasPrefix(k, "#") {
			continue
		}
		switch k {
		case "name":
			a.Name = v
		case "description":
			a.Description = v
		case "disk":
			a.Disk = v
		case "boot_mode":
			a.BootMode = v
		case "architecture":
			a.Architecture = v
		case "root_device_name":
			a.RootDeviceName = v
		case "disk_bytes":
			a.DiskBytes = v
		}
	}
	if err := sc.Err(); err != nil {
		return a, err
	}
	if a.Name == "" || a.Disk == "" {
		return a, fmt.Errorf("%s names no image or disk", path)
	}
	// The disk is found next to ami.env wherever the image put both.
	if _, err := os.Stat(a.Disk); err != nil {
		a.Disk = filepath.Join(filepath.Dir(path), filepath.Base(a.Disk))
	}
	return a, nil
}

// ImportStarterAMI imports the bundled disk that envPath describes through
// ebsd, as an EBS direct import would, and registers it as an AMI, unless
// an image of that name exists already. It waits for ebsd to be on the bus.
// Only blocks holding data are sent: the disk is sparse and mostly zeros.
func (s *Service) ImportStarterAMI(ctx context.Context, envPath string, blocks BlockImporter) error {
	a, err := readStarterEnv(envPath)
	if err != nil {
		return fmt.Errorf("reading the starter AMI description: %w", err)
	}
	have := false
	err = s.db.View(func(tx *store.Tx) error {
		have, err = exists(tx, kindImage, func(_ string, r *imageRecord) bool { return deref(r.Name) == a.Name })
		return err
	})
	if err != nil || have {
		return err
	}
	f, err := os.Open(a.Disk)
	if err != nil {
		return fmt.Errorf("opening the starter disk: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return err
	}
	sizeGiB := int32((st.Size() + gib - 1) / gib)
	start := time.Now()

	var snapID string
	for {
		storage, err := s.ebsd()
		if err == nil {
			var sid string
			if err := s.db.Update(func(tx *store.Tx) (err error) { sid, err = newID(tx, kindSnapshot.Prefix); return err }); err != nil {
				return err
			}
			if _, err = storage.StartSnapshot(ctx, api.StartSnapshotArgs{SnapshotID: sid, VolumeSizeBytes: uint64(sizeGiB) * gib, TimeoutMinutes: 60}); err == nil {
				snapID = sid
				break
			}
			s.log.Info("waiting for hangar-ebsd to import the starter AMI", "err", err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(2 * time.Second):
		}
	}
	buf := make([]byte, api.SnapshotBlockSize)
	zero := make([]byte, api.SnapshotBlockSize)
	var changed uint32
	for index := uint64(0); ; index++ {
		n, err := io.ReadFull(f, buf)
		if err == io.EOF {
			break
		}
		if err != nil && err != io.ErrUnexpectedEOF {
			return fmt.Errorf("reading the starter disk: %w", err)
		}
		block := buf[:n]
		if n < len(buf) {
			clear(buf[n:])
			block = buf
		}
		if !bytes.Equal(block, zero) {
			sum := sha256.Sum256(block)
			if err := blocks.PutBlock(ctx, snapID, index, block, base64.StdEncoding.EncodeToString(sum[:])); err != nil {
				return fmt.Errorf("importing block %d of the starter disk: %w", index, err)
			}
			changed++
		}
		if n < len(buf) {
			break
		}
	}
	storage, err := s.ebsd()
	if err != nil {
		return err
	}
	if _, err := storage.CompleteSnapshot(ctx, api.CompleteSnapshotArgs{SnapshotID: snapID, ChangedBlocks: changed}); err != nil {
		return fmt.Errorf("completing the starter snapshot: %w", err)
	}
	now := s.now().UTC()
	rec := &snapshotRecord{Direct: true, Snapshot: types.Snapshot{
		SnapshotId: ptr(snapID), VolumeId: ptr(unknownVolume), State: types.SnapshotStateCompleted, Progress: progress(100),
		StartTime: &now, CompletionTime: &now, VolumeSize: ptr(sizeGiB), OwnerId: ptr(s.account()),
		Description: ptr("hangar starter AMI " + a.Name), Encrypted: ptr(false), StorageTier: types.StorageTierStandard,
	}}
	root := a.RootDeviceName
	if root == "" {
		root = defaultRootDevice
	}
	in := &ec2.RegisterImageInput{
		Name: ptr(a.Name), Description: ptr(a.Description), Architecture: types.ArchitectureValues(a.Architecture),
		BootMode: types.BootModeValues(a.BootMode), RootDeviceName: ptr(root), EnaSupport: ptr(true),
		BlockDeviceMappings: []types.BlockDeviceMapping{{DeviceName: ptr(root), Ebs: &types.EbsBlockDevice{
			SnapshotId: ptr(snapID), VolumeSize: ptr(sizeGiB), VolumeType: types.VolumeTypeGp3, DeleteOnTermination: ptr(true)}}},
	}
	var imageID string
	err = s.db.Update(func(tx *store.Tx) error {
		if err := put(tx, kindSnapshot, snapID, rec); err != nil {
			return err
		}
		img, err := s.registerImage(tx, in, []types.Tag{{Key: ptr("hangar:starter"), Value: ptr("true")}}, types.ImageStateAvailable)
		if err != nil {
			return err
		}
		imageID = *img.ImageId
		return nil
	})
	if err != nil {
		if e := awserr.As(err); e.Code == "InvalidAMIName.Duplicate" {
			return nil // imported meanwhile
		}
		return err
	}
	s.log.Info("imported the starter AMI", "image", imageID, "name", a.Name, "snapshot", snapID,
		"blocks", changed, "bytes", strconv.FormatUint(uint64(changed)*api.SnapshotBlockSize, 10), "duration", time.Since(start).Round(time.Millisecond))
	return nil
}
