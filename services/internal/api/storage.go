package api

// The dev.hangar.Storage1 contract: hangar-ebsd owns volume data, snapshot
// blocks and the NBD exports; the gateway owns the AWS records and calls
// these methods with the ids it chose, so every call is idempotent by id.
//
// Block payloads never ride the bus. PutBlock takes a file descriptor (type
// h, a sealed memfd) holding the block; GetBlock takes a memfd from the
// caller and writes the block into it. Volume data moves over NBD on the
// unix socket each volume's ExportSocket property names.

import (
	"context"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/godbus/dbus/v5"
	"golang.org/x/sys/unix"
)

// Storage1 root methods.
const (
	MethodCreateVolume      = "CreateVolume"      // (volID s, sizeBytes t, fromSnapshotID s) → VolumeInfo
	MethodDeleteVolume      = "DeleteVolume"      // (volID s); InUse while attached or written to
	MethodResizeVolume      = "ResizeVolume"      // (volID s, sizeBytes t) → VolumeInfo; grow only
	MethodGetVolume         = "GetVolume"         // (volID s) → VolumeInfo
	MethodListVolumes       = "ListVolumes"       // () → []VolumeInfo
	MethodAttachVolume      = "AttachVolume"      // (volID s, instanceID s, device s) → VolumeInfo
	MethodDetachVolume      = "DetachVolume"      // (volID s, instanceID s) → VolumeInfo
	MethodCreateSnapshot    = "CreateSnapshot"    // (snapID s, volID s) → SnapshotInfo (pending)
	MethodDeleteSnapshot    = "DeleteSnapshot"    // (snapID s)
	MethodGetSnapshot       = "GetSnapshot"       // (snapID s) → SnapshotInfo
	MethodListSnapshots     = "ListSnapshots"     // () → []SnapshotInfo
	MethodStartSnapshot     = "StartSnapshot"     // (StartSnapshotArgs) → SnapshotInfo
	MethodPutBlock          = "PutBlock"          // (snapID s, index t, length u, checksumB64 s, data h)
	MethodCompleteSnapshot  = "CompleteSnapshot"  // (CompleteSnapshotArgs) → SnapshotInfo
	MethodGetBlock          = "GetBlock"          // (snapID s, index t, token s, dest h) → (length u, checksumB64 s)
	MethodListBlocks        = "ListBlocks"        // (snapID s, startIndex t, max u) → BlockPage
	MethodListChangedBlocks = "ListChangedBlocks" // (firstSnapID s, secondSnapID s, startIndex t, max u) → ChangedBlockPage
)

// Signals of the Storage1 root interface.
const (
	// SignalVolumeStateChanged (volID s, state s) is sent when a volume is
	// created, attached, detached, resized or deleted.
	SignalVolumeStateChanged = "VolumeStateChanged"
	// SignalSnapshotProgress (snapID s, state s, progress u) is sent as a
	// snapshot captures blocks and when it completes or fails.
	SignalSnapshotProgress = "SnapshotProgress"
)

// Interfaces of the per-object paths.
const (
	StorageVolumeInterface   = "dev.hangar.Storage1.Volume"
	StorageSnapshotInterface = "dev.hangar.Storage1.Snapshot"
)

// Volume and snapshot states, as EC2 names them.
const (
	VolumeAvailable = "available"
	VolumeInUse     = "in-use"

	SnapshotPending   = "pending"
	SnapshotCompleted = "completed"
	SnapshotError     = "error"
)

// SnapshotBlockSize is the EBS snapshot block size: 512 KiB.
const SnapshotBlockSize = 512 << 10

// VolumeInfo is a volume as ebsd holds it. It is also the set of
// properties of the volume's object.
type VolumeInfo struct {
	VolumeID     string
	SizeBytes    uint64
	State        string // available, in-use
	FromSnapshot string
	ExportSocket string // NBD over this unix socket; export name is the volume id
	AttachedTo   string // instance id, "" when detached
	Device       string // device name given at attach
	WrittenBytes uint64 // bytes of blocks written or hydrated
	Created      int64  // unix seconds
}

// SnapshotInfo is a snapshot as ebsd holds it.
type SnapshotInfo struct {
	SnapshotID      string
	VolumeID        string // "" for snapshots made with the EBS direct API
	ParentID        string
	State           string // pending, completed, error
	Progress        uint32 // percent
	VolumeSizeBytes uint64
	BlockCount      uint64 // blocks this snapshot holds (with its ancestors)
	ChangedBlocks   uint64 // blocks this snapshot itself stores
	StoredBytes     uint64 // bytes of new, not deduplicated blocks this snapshot added
	Started         int64
	Completed       int64
	Error           string
}

// StartSnapshotArgs starts a snapshot written through the EBS direct API.
type StartSnapshotArgs struct {
	SnapshotID      string
	VolumeSizeBytes uint64
	ParentID        string
	TimeoutMinutes  uint32 // a pending snapshot not completed by then fails
}

// CompleteSnapshotArgs completes an EBS direct snapshot.
type CompleteSnapshotArgs struct {
	SnapshotID        string
	ChangedBlocks     uint32
	Checksum          string // base64, optional
	ChecksumAlgorithm string // SHA256 when Checksum is set
	AggregationMethod string // LINEAR when Checksum is set
}

// Block is one block of a snapshot listing.
type Block struct {
	Index uint64
	Token string
}

// BlockPage is one page of ListBlocks.
type BlockPage struct {
	Blocks          []Block
	NextIndex       uint64 // where the next page starts; 0 with More false when done
	More            bool
	VolumeSizeBytes uint64
	BlockSize       uint32
}

// ChangedBlock is one entry of ListChangedBlocks; a token is "" where the
// block is absent (zero) in that snapshot.
type ChangedBlock struct {
	Index       uint64
	FirstToken  string
	SecondToken string
}

// ChangedBlockPage is one page of ListChangedBlocks.
type ChangedBlockPage struct {
	Blocks          []ChangedBlock
	NextIndex       uint64
	More            bool
	VolumeSizeBytes uint64
	BlockSize       uint32
}

// VolumePath is the object path of a volume: dashes become underscores, as
// object paths allow only [A-Za-z0-9_].
func VolumePath(volID string) dbus.ObjectPath {
	return Storage.Path + "/volume/" + dbus.ObjectPath(strings.ReplaceAll(volID, "-", "_"))
}

// SnapshotPath is the object path of a snapshot.
func SnapshotPath(snapID string) dbus.ObjectPath {
	return Storage.Path + "/snapshot/" + dbus.ObjectPath(strings.ReplaceAll(snapID, "-", "_"))
}

// StorageClient calls hangar-ebsd. Errors are *Error with the names above
// (NotFound, InvalidArgument, Conflict, InUse, InsufficientCapacity).
type StorageClient struct {
	Conn *dbus.Conn
}

// NewStorageClient wraps a bus connection.
func NewStorageClient(conn *dbus.Conn) *StorageClient { return &StorageClient{Conn: conn} }

func (c *StorageClient) call(ctx context.Context, method string, out []any, args ...any) error {
	return Call(ctx, c.Conn, Storage, method, out, args...)
}

// CreateVolume creates a volume of sizeBytes, empty or from a snapshot. A
// retry with the same arguments returns the volume; other arguments are
// Conflict.
func (c *StorageClient) CreateVolume(ctx context.Context, volID string, sizeBytes uint64, fromSnapshot string) (VolumeInfo, error) {
	var v VolumeInfo
	err := c.call(ctx, MethodCreateVolume, []any{&v}, volID, sizeBytes, fromSnapshot)
	return v, err
}

// DeleteVolume deletes a volume; deleting one that is gone is not an error.
func (c *StorageClient) DeleteVolume(ctx context.Context, volID string) error {
	return c.call(ctx, MethodDeleteVolume, nil, volID)
}

// ResizeVolume grows a volume.
func (c *StorageClient) ResizeVolume(ctx context.Context, volID string, sizeBytes uint64) (VolumeInfo, error) {
	var v VolumeInfo
	err := c.call(ctx, MethodResizeVolume, []any{&v}, volID, sizeBytes)
	return v, err
}

// GetVolume returns one volume.
func (c *StorageClient) GetVolume(ctx context.Context, volID string) (VolumeInfo, error) {
	var v VolumeInfo
	err := c.call(ctx, MethodGetVolume, []any{&v}, volID)
	return v, err
}

// ListVolumes returns every volume.
func (c *StorageClient) ListVolumes(ctx context.Context) ([]VolumeInfo, error) {
	var v []VolumeInfo
	err := c.call(ctx, MethodListVolumes, []any{&v})
	return v, err
}

// AttachVolume records that instanceID uses the volume as device.
func (c *StorageClient) AttachVolume(ctx context.Context, volID, instanceID, device string) (VolumeInfo, error) {
	var v VolumeInfo
	err := c.call(ctx, MethodAttachVolume, []any{&v}, volID, instanceID, device)
	return v, err
}

// DetachVolume clears the attachment (instanceID "" detaches from anyone).
func (c *StorageClient) DetachVolume(ctx context.Context, volID, instanceID string) (VolumeInfo, error) {
	var v VolumeInfo
	err := c.call(ctx, MethodDetachVolume, []any{&v}, volID, instanceID)
	return v, err
}

// CreateSnapshot starts a point-in-time snapshot of a volume.
func (c *StorageClient) CreateSnapshot(ctx context.Context, snapID, volID string) (SnapshotInfo, error) {
	var s SnapshotInfo
	err := c.call(ctx, MethodCreateSnapshot, []any{&s}, snapID, volID)
	return s, err
}

// DeleteSnapshot deletes a snapshot; blocks nothing else references are freed.
func (c *StorageClient) DeleteSnapshot(ctx context.Context, snapID string) error {
	return c.call(ctx, MethodDeleteSnapshot, nil, snapID)
}

// GetSnapshot returns one snapshot.
func (c *StorageClient) GetSnapshot(ctx context.Context, snapID string) (SnapshotInfo, error) {
	var s SnapshotInfo
	err := c.call(ctx, MethodGetSnapshot, []any{&s}, snapID)
	return s, err
}

// ListSnapshots returns every snapshot.
func (c *StorageClient) ListSnapshots(ctx context.Context) ([]SnapshotInfo, error) {
	var s []SnapshotInfo
	err := c.call(ctx, MethodListSnapshots, []any{&s})
	return s, err
}

// StartSnapshot starts an EBS direct snapshot.
func (c *StorageClient) StartSnapshot(ctx context.Context, a StartSnapshotArgs) (SnapshotInfo, error) {
	var s SnapshotInfo
	err := c.call(ctx, MethodStartSnapshot, []any{&s}, a)
	return s, err
}

// PutBlock stores data as block index of a pending snapshot. checksum is the
// base64 SHA-256 the caller claims; ebsd verifies it. The bytes go to ebsd
// in a sealed memfd, not in the message.
func (c *StorageClient) PutBlock(ctx context.Context, snapID string, index uint64, data []byte, checksum string) error {
	fd, err := unix.MemfdCreate("hangar-block", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return fmt.Errorf("creating a memfd for block %d: %w", index, err)
	}
	f := os.NewFile(uintptr(fd), "hangar-block")
	defer f.Close()
	if _, err := f.Write(data); err != nil {
		return fmt.Errorf("filling the memfd for block %d: %w", index, err)
	}
	// Sealed, the receiver can trust the length and content not to change
	// under it.
	_, _ = unix.FcntlInt(f.Fd(), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_WRITE|unix.F_SEAL_SEAL)
	return c.call(ctx, MethodPutBlock, nil, snapID, index, uint32(len(data)), checksum, dbus.UnixFD(f.Fd()))
}

// GetBlock returns the bytes of block index of a completed snapshot and their
// base64 SHA-256. ebsd writes the bytes into a memfd the caller passes.
func (c *StorageClient) GetBlock(ctx context.Context, snapID string, index uint64, token string) ([]byte, string, error) {
	fd, err := unix.MemfdCreate("hangar-block", unix.MFD_CLOEXEC)
	if err != nil {
		return nil, "", fmt.Errorf("creating a memfd for block %d: %w", index, err)
	}
	f := os.NewFile(uintptr(fd), "hangar-block")
	defer f.Close()
	var (
		length   uint32
		checksum string
	)
	if err := c.call(ctx, MethodGetBlock, []any{&length, &checksum}, snapID, index, token, dbus.UnixFD(f.Fd())); err != nil {
		return nil, "", err
	}
	buf := make([]byte, length)
	if _, err := f.ReadAt(buf, 0); err != nil && err != io.EOF {
		return nil, "", fmt.Errorf("reading block %d of %s: %w", index, snapID, err)
	}
	return buf, checksum, nil
}

// CompleteSnapshot seals an EBS direct snapshot.
func (c *StorageClient) CompleteSnapshot(ctx context.Context, a CompleteSnapshotArgs) (SnapshotInfo, error) {
	var s SnapshotInfo
	err := c.call(ctx, MethodCompleteSnapshot, []any{&s}, a)
	return s, err
}

// ListBlocks lists up to max blocks of a snapshot from startIndex on.
func (c *StorageClient) ListBlocks(ctx context.Context, snapID string, startIndex uint64, max uint32) (BlockPage, error) {
	var p BlockPage
	err := c.call(ctx, MethodListBlocks, []any{&p}, snapID, startIndex, max)
	return p, err
}

// ListChangedBlocks lists blocks that differ between two snapshots of one
// lineage (first may be "": every block of second).
func (c *StorageClient) ListChangedBlocks(ctx context.Context, first, second string, startIndex uint64, max uint32) (ChangedBlockPage, error) {
	var p ChangedBlockPage
	err := c.call(ctx, MethodListChangedBlocks, []any{&p}, first, second, startIndex, max)
	return p, err
}

// Status returns ebsd's status.
func (c *StorageClient) Status(ctx context.Context) (ServiceStatus, error) {
	return Status(ctx, c.Conn, Storage)
}
