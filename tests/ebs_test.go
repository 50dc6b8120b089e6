package tests

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/ebs"
	ebstypes "github.com/aws/aws-sdk-go-v2/service/ebs/types"
	"github.com/aws/aws-sdk-go-v2/service/ec2"
	ec2types "github.com/aws/aws-sdk-go-v2/service/ec2/types"
	"github.com/aws/smithy-go"

	"hangar.dev/hangar/tests/harness"
)

const blockSize = 512 << 10

func b64sha(b []byte) string {
	s := sha256.Sum256(b)
	return base64.StdEncoding.EncodeToString(s[:])
}

// exportSocket is where `hangar dev` serves a volume over NBD.
func exportSocket(d *harness.Dev, vol string) string {
	return filepath.Join(d.Dir, "run", "ebs", vol+".sock")
}

// readVolume copies a volume out over NBD with qemu-img, as QEMU reads it.
func readVolume(t *testing.T, sock string) []byte {
	t.Helper()
	out := filepath.Join(t.TempDir(), "vol.raw")
	if b, err := exec.Command("qemu-img", "convert", "-f", "raw", "-O", "raw", "nbd:unix:"+sock, out).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img convert: %v\n%s", err, b)
	}
	raw, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	return raw
}

func ebsAPICode(err error) string {
	var ae smithy.APIError
	if errors.As(err, &ae) {
		return ae.ErrorCode()
	}
	return ""
}

func waitVolumeSnapshot(t *testing.T, c *ec2.Client, id string) ec2types.Snapshot {
	t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		out, err := c.DescribeSnapshots(context.Background(), &ec2.DescribeSnapshotsInput{SnapshotIds: []string{id}})
		if err != nil {
			t.Fatal(err)
		}
		s := out.Snapshots[0]
		if s.State == ec2types.SnapshotStateCompleted {
			return s
		}
		if s.State == ec2types.SnapshotStateError || time.Now().After(deadline) {
			t.Fatalf("snapshot %s did not complete: %s %s", id, s.State, aws.ToString(s.StateMessage))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestEBSDirectImportToVolumeWithSDK imports a 1 GiB sparse disk image with
// the EBS direct API as the SDK does it, makes a volume of it with EC2,
// reads the volume over NBD and compares hashes; then writes an
// incremental child with 10 changed blocks and lists exactly those.
func TestEBSDirectImportToVolumeWithSDK(t *testing.T) {
	harness.Require(t, "qemu-img")
	d := harness.StartDev(t, harness.Options{})
	ctx := context.Background()
	cfg := d.SDK()
	eb := ebs.NewFromConfig(cfg)
	ec := ec2.NewFromConfig(cfg)

	// A sparse 1 GiB image: 96 random blocks and a partly written one, the
	// rest zeros (which, as import tools do, are not uploaded).
	const size = 1 << 30
	img := make([]byte, size)
	rng := rand.New(rand.NewSource(42))
	written := map[int32]bool{}
	for len(written) < 96 {
		i := int32(rng.Intn(size / blockSize))
		written[i] = true
		rng.Read(img[int(i)*blockSize : int(i+1)*blockSize])
	}
	copy(img[5*blockSize+1000:], "hangar was here")
	written[5] = true

	start, err := eb.StartSnapshot(ctx, &ebs.StartSnapshotInput{VolumeSize: aws.Int64(1), Description: aws.String("import"),
		ClientToken: aws.String("import-1"), Timeout: aws.Int32(60), Tags: []ebstypes.Tag{{Key: aws.String("Name"), Value: aws.String("disk")}}})
	if err != nil {
		t.Fatal(err)
	}
	snap := aws.ToString(start.SnapshotId)
	if start.Status != ebstypes.StatusPending || aws.ToInt32(start.BlockSize) != blockSize || aws.ToInt64(start.VolumeSize) != 1 {
		t.Fatalf("StartSnapshot = %+v", start)
	}
	// The same ClientToken gets the same snapshot.
	again, err := eb.StartSnapshot(ctx, &ebs.StartSnapshotInput{VolumeSize: aws.Int64(1), Description: aws.String("import"),
		ClientToken: aws.String("import-1"), Timeout: aws.Int32(60), Tags: []ebstypes.Tag{{Key: aws.String("Name"), Value: aws.String("disk")}}})
	if err != nil || aws.ToString(again.SnapshotId) != snap {
		t.Fatalf("a retried StartSnapshot: %v %v", err, again)
	}
	put := func(snap string, i int32, data []byte) error {
		_, err := eb.PutSnapshotBlock(ctx, &ebs.PutSnapshotBlockInput{SnapshotId: aws.String(snap), BlockIndex: aws.Int32(i),
			BlockData: bytes.NewReader(data), DataLength: aws.Int32(int32(len(data))), Checksum: aws.String(b64sha(data)),
			ChecksumAlgorithm: ebstypes.ChecksumAlgorithmChecksumAlgorithmSha256})
		return err
	}
	for i := range written {
		if err := put(snap, i, img[int(i)*blockSize:int(i+1)*blockSize]); err != nil {
			t.Fatalf("PutSnapshotBlock %d: %v", i, err)
		}
	}

	// Bad input: each refused with EBS's error, nothing stored.
	blk := img[5*blockSize : 6*blockSize]
	_, err = eb.PutSnapshotBlock(ctx, &ebs.PutSnapshotBlockInput{SnapshotId: aws.String(snap), BlockIndex: aws.Int32(7),
		BlockData: bytes.NewReader(blk), DataLength: aws.Int32(blockSize), Checksum: aws.String(b64sha([]byte("not it"))),
		ChecksumAlgorithm: ebstypes.ChecksumAlgorithmChecksumAlgorithmSha256})
	var ve *ebstypes.ValidationException
	if !errors.As(err, &ve) || ve.Reason != ebstypes.ValidationExceptionReasonInvalidBlock {
		t.Fatalf("a wrong checksum: %v", err)
	}
	if err := put(snap, 2048, blk); !errors.As(err, &ve) || ve.Reason != ebstypes.ValidationExceptionReasonInvalidBlock {
		t.Fatalf("an index past the end: %v", err)
	}
	if err := put(snap, 8, blk[:4096]); !errors.As(err, &ve) {
		t.Fatalf("a short block: %v", err)
	}
	if err := put("snap-0000000000000000f", 1, blk); ebsAPICode(err) != "ResourceNotFoundException" {
		t.Fatalf("an unknown snapshot: %v", err)
	}
	_, err = eb.CompleteSnapshot(ctx, &ebs.CompleteSnapshotInput{SnapshotId: aws.String(snap), ChangedBlocksCount: aws.Int32(3)})
	if !errors.As(err, &ve) {
		t.Fatalf("completing with a wrong count: %v", err)
	}
	done, err := eb.CompleteSnapshot(ctx, &ebs.CompleteSnapshotInput{SnapshotId: aws.String(snap), ChangedBlocksCount: aws.Int32(int32(len(written)))})
	if err != nil || done.Status != ebstypes.StatusCompleted {
		t.Fatalf("CompleteSnapshot: %v %+v", err, done)
	}
	if err := put(snap, 9, blk); !errors.As(err, &ve) {
		t.Fatalf("a block to a completed snapshot: %v", err)
	}

	// EC2 sees the import, and a volume made of it reads byte-identical.
	ds, err := ec.DescribeSnapshots(ctx, &ec2.DescribeSnapshotsInput{OwnerIds: []string{"self"}, SnapshotIds: []string{snap}})
	if err != nil || len(ds.Snapshots) != 1 || ds.Snapshots[0].State != ec2types.SnapshotStateCompleted || aws.ToInt32(ds.Snapshots[0].VolumeSize) != 1 {
		t.Fatalf("DescribeSnapshots: %v %+v", err, ds)
	}
	vol, err := ec.CreateVolume(ctx, &ec2.CreateVolumeInput{AvailabilityZone: aws.String("us-east-1a"), SnapshotId: aws.String(snap), VolumeType: ec2types.VolumeTypeGp3})
	if err != nil {
		t.Fatal(err)
	}
	if aws.ToInt32(vol.Size) != 1 || aws.ToInt32(vol.Iops) != 3000 || aws.ToInt32(vol.Throughput) != 125 {
		t.Fatalf("CreateVolume = %+v", vol)
	}
	got := readVolume(t, exportSocket(d, aws.ToString(vol.VolumeId)))
	if sha256.Sum256(got) != sha256.Sum256(img) {
		t.Fatalf("the volume made from the import differs from the image")
	}

	// Reading blocks back through the API.
	var listed []ebstypes.Block
	var next *string
	for {
		page, err := eb.ListSnapshotBlocks(ctx, &ebs.ListSnapshotBlocksInput{SnapshotId: aws.String(snap), MaxResults: aws.Int32(100), NextToken: next})
		if err != nil {
			t.Fatal(err)
		}
		listed = append(listed, page.Blocks...)
		if next = page.NextToken; next == nil {
			break
		}
	}
	if len(listed) != len(written) {
		t.Fatalf("ListSnapshotBlocks paged out %d blocks, want %d", len(listed), len(written))
	}
	gb, err := eb.GetSnapshotBlock(ctx, &ebs.GetSnapshotBlockInput{SnapshotId: aws.String(snap), BlockIndex: listed[3].BlockIndex, BlockToken: listed[3].BlockToken})
	if err != nil {
		t.Fatal(err)
	}
	data, _ := io.ReadAll(gb.BlockData)
	i := int(aws.ToInt32(listed[3].BlockIndex))
	if !bytes.Equal(data, img[i*blockSize:(i+1)*blockSize]) || aws.ToString(gb.Checksum) != b64sha(data) {
		t.Fatal("GetSnapshotBlock returned other bytes or checksum")
	}
	if _, err := eb.GetSnapshotBlock(ctx, &ebs.GetSnapshotBlockInput{SnapshotId: aws.String(snap), BlockIndex: aws.Int32(int32(i + 1)), BlockToken: listed[3].BlockToken}); !errors.As(err, &ve) || ve.Reason != ebstypes.ValidationExceptionReasonInvalidBlockToken {
		t.Fatalf("another block's token: %v", err)
	}

	// An incremental child with 10 changed blocks lists exactly those.
	child, err := eb.StartSnapshot(ctx, &ebs.StartSnapshotInput{VolumeSize: aws.Int64(1), ParentSnapshotId: aws.String(snap)})
	if err != nil {
		t.Fatal(err)
	}
	changed := map[int32]bool{}
	for k := int32(0); k < 10; k++ {
		idx := k * 150
		changed[idx] = true
		b := make([]byte, blockSize)
		rng.Read(b)
		if err := put(aws.ToString(child.SnapshotId), idx, b); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := eb.CompleteSnapshot(ctx, &ebs.CompleteSnapshotInput{SnapshotId: child.SnapshotId, ChangedBlocksCount: aws.Int32(10)}); err != nil {
		t.Fatal(err)
	}
	cb, err := eb.ListChangedBlocks(ctx, &ebs.ListChangedBlocksInput{FirstSnapshotId: aws.String(snap), SecondSnapshotId: child.SnapshotId})
	if err != nil {
		t.Fatal(err)
	}
	if len(cb.ChangedBlocks) != 10 {
		t.Fatalf("ListChangedBlocks = %d blocks, want 10", len(cb.ChangedBlocks))
	}
	for _, c := range cb.ChangedBlocks {
		if !changed[aws.ToInt32(c.BlockIndex)] || c.SecondBlockToken == nil {
			t.Fatalf("unexpected changed block %+v", c)
		}
	}
}

// TestVolumesAndSnapshotsWithCLI drives EC2 volumes and snapshots and the
// EBS direct API with /usr/bin/aws.
func TestVolumesAndSnapshotsWithCLI(t *testing.T) {
	harness.Require(t, "qemu-io", "busctl")
	d := harness.StartDev(t, harness.Options{})
	js := func(args ...string) map[string]any {
		t.Helper()
		var m map[string]any
		if err := json.Unmarshal([]byte(d.MustAWS(append(args, "--output", "json")...)), &m); err != nil {
			t.Fatal(err)
		}
		return m
	}
	// EBS direct with the CLI: one block, completed with the aggregated
	// checksum.
	start := js("ebs", "start-snapshot", "--volume-size", "1", "--timeout", "60")
	snap := start["SnapshotId"].(string)
	block := bytes.Repeat([]byte("cli!"), blockSize/4)
	path := filepath.Join(t.TempDir(), "block.bin")
	if err := os.WriteFile(path, block, 0o644); err != nil {
		t.Fatal(err)
	}
	d.MustAWS("ebs", "put-snapshot-block", "--snapshot-id", snap, "--block-index", "3", "--block-data", path,
		"--data-length", fmt.Sprint(blockSize), "--checksum", b64sha(block), "--checksum-algorithm", "SHA256")
	sum := sha256.Sum256(block)
	agg := sha256.Sum256(sum[:])
	d.MustAWS("ebs", "complete-snapshot", "--snapshot-id", snap, "--changed-blocks-count", "1",
		"--checksum", base64.StdEncoding.EncodeToString(agg[:]), "--checksum-algorithm", "SHA256", "--checksum-aggregation-method", "LINEAR")
	blocks := js("ebs", "list-snapshot-blocks", "--snapshot-id", snap)["Blocks"].([]any)
	if len(blocks) != 1 {
		t.Fatalf("list-snapshot-blocks = %v", blocks)
	}
	tok := blocks[0].(map[string]any)["BlockToken"].(string)
	outFile := filepath.Join(t.TempDir(), "out.bin")
	got := js("ebs", "get-snapshot-block", "--snapshot-id", snap, "--block-index", "3", "--block-token", tok, outFile)
	raw, _ := os.ReadFile(outFile)
	if !bytes.Equal(raw, block) || got["Checksum"] != b64sha(block) {
		t.Fatal("get-snapshot-block returned other bytes")
	}
	if _, err := d.AWS("ebs", "put-snapshot-block", "--snapshot-id", snap, "--block-index", "4", "--block-data", path,
		"--data-length", fmt.Sprint(blockSize), "--checksum", b64sha(block), "--checksum-algorithm", "SHA256"); err == nil || !strings.Contains(err.Error(), "ValidationException") {
		t.Fatalf("a block to a completed snapshot: %v", err)
	}

	// EC2 volumes: validation, create, describe with filters, grow.
	if _, err := d.AWS("ec2", "create-volume", "--availability-zone", "us-east-1a", "--size", "10", "--volume-type", "io1"); err == nil || !strings.Contains(err.Error(), "MissingParameter") {
		t.Fatalf("io1 without iops: %v", err)
	}
	if _, err := d.AWS("ec2", "create-volume", "--availability-zone", "us-east-1a", "--size", "10", "--volume-type", "gp3", "--iops", "3000", "--throughput", "1000"); err == nil || !strings.Contains(err.Error(), "InvalidParameterValue") {
		t.Fatalf("gp3 throughput above iops/4: %v", err)
	}
	if _, err := d.AWS("ec2", "create-volume", "--availability-zone", "us-west-2a", "--size", "1"); err == nil || !strings.Contains(err.Error(), "InvalidParameterValue") {
		t.Fatalf("another zone: %v", err)
	}
	big := js("ec2", "create-volume", "--availability-zone", "us-east-1a", "--size", "16384", "--volume-type", "gp3",
		"--tag-specifications", "ResourceType=volume,Tags=[{Key=Name,Value=big}]")
	bigID := big["VolumeId"].(string)
	fromSnap := js("ec2", "create-volume", "--availability-zone", "us-east-1a", "--snapshot-id", snap)
	volID := fromSnap["VolumeId"].(string)
	if fromSnap["VolumeType"] != "gp2" || fromSnap["Size"] != float64(1) || fromSnap["Iops"] != float64(100) {
		t.Fatalf("create-volume from a snapshot = %v", fromSnap)
	}
	desc := js("ec2", "describe-volumes", "--filters", "Name=tag:Name,Values=big")
	if vs := desc["Volumes"].([]any); len(vs) != 1 || vs[0].(map[string]any)["VolumeId"] != bigID || vs[0].(map[string]any)["State"] != "available" {
		t.Fatalf("describe-volumes by tag = %v", desc)
	}
	// ebsd's own view, as an operator sees it.
	bus := d.BusAddress()
	obj := "/dev/hangar/Storage1/volume/" + strings.ReplaceAll(volID, "-", "_")
	out, err := exec.Command("busctl", "--address="+bus, "introspect", "dev.hangar.Storage1", obj).CombinedOutput()
	if err != nil || !strings.Contains(string(out), ".ExportSocket") || !strings.Contains(string(out), exportSocket(d, volID)) {
		t.Fatalf("busctl introspect %s: %v\n%s", obj, err, out)
	}
	if o, err := exec.Command("qemu-io", "-f", "raw", "-c", "read -P 0 0 1M", "-c", "write -P 0x33 1M 4k", "-c", "flush",
		"nbd:unix:"+exportSocket(d, volID)).CombinedOutput(); err != nil || strings.Contains(string(o), "fail") {
		t.Fatalf("qemu-io on the volume: %v\n%s", err, o)
	}

	mod := js("ec2", "modify-volume", "--volume-id", volID, "--size", "2", "--volume-type", "gp3")["VolumeModification"].(map[string]any)
	if mod["TargetSize"] != float64(2) || mod["TargetVolumeType"] != "gp3" {
		t.Fatalf("modify-volume = %v", mod)
	}
	if _, err := d.AWS("ec2", "modify-volume", "--volume-id", volID, "--size", "1"); err == nil || !strings.Contains(err.Error(), "InvalidParameterValue") {
		t.Fatalf("shrinking: %v", err)
	}
	mods := js("ec2", "describe-volumes-modifications", "--volume-ids", volID)["VolumesModifications"].([]any)
	if len(mods) != 1 || mods[0].(map[string]any)["ModificationState"] != "completed" {
		t.Fatalf("describe-volumes-modifications = %v", mods)
	}
	if o, err := exec.Command("qemu-io", "-f", "raw", "-c", "read -P 0x33 1M 4k", "-c", "write -P 0x44 1G 4k", "-c", "read -P 0x44 1G 4k",
		"nbd:unix:"+exportSocket(d, volID)).CombinedOutput(); err != nil || strings.Contains(string(o), "fail") {
		t.Fatalf("qemu-io past the old end after growing: %v\n%s", err, o)
	}
	st := js("ec2", "describe-volume-status", "--volume-ids", volID)["VolumeStatuses"].([]any)
	if st[0].(map[string]any)["VolumeStatus"].(map[string]any)["Status"] != "ok" {
		t.Fatalf("describe-volume-status = %v", st)
	}

	// A snapshot of the volume; a volume made from it keeps reading it
	// after the snapshot is deleted (EBS hydrates lazily; ebsd keeps the
	// blocks until no volume needs them).
	vsnap := js("ec2", "create-snapshot", "--volume-id", volID, "--description", "cli")
	vsnapID := vsnap["SnapshotId"].(string)
	waitVolumeSnapshot(t, ec2.NewFromConfig(d.SDK()), vsnapID)
	restored := js("ec2", "create-volume", "--availability-zone", "us-east-1a", "--snapshot-id", vsnapID)["VolumeId"].(string)
	d.MustAWS("ec2", "delete-snapshot", "--snapshot-id", vsnapID)
	if o, err := exec.Command("qemu-io", "-f", "raw", "-c", "read -P 0x33 1M 4k", "-c", "read -P 0x44 1G 4k",
		"nbd:unix:"+exportSocket(d, restored)).CombinedOutput(); err != nil || strings.Contains(string(o), "fail") {
		t.Fatalf("a volume whose snapshot was deleted: %v\n%s", err, o)
	}
	snaps := js("ec2", "describe-snapshots", "--owner-ids", "self", "--filters", "Name=status,Values=completed")["Snapshots"].([]any)
	if len(snaps) != 1 || snaps[0].(map[string]any)["SnapshotId"] != snap { // the import
		t.Fatalf("describe-snapshots = %d snapshots: %v", len(snaps), snaps)
	}
	for _, v := range []string{bigID, volID, restored} {
		d.MustAWS("ec2", "delete-volume", "--volume-id", v)
	}
	if _, err := d.AWS("ec2", "delete-volume", "--volume-id", volID); err == nil || !strings.Contains(err.Error(), "InvalidVolume.NotFound") {
		t.Fatalf("deleting twice: %v", err)
	}
}
