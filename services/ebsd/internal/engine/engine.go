// Package engine is hangar-ebsd's storage service without the bus: it
// creates, exports, snapshots and deletes volumes, runs EBS direct
// snapshots, and keeps the catalog, the block store and the volume files
// in step. Every method is idempotent by the AWS id the caller chose, and
// every failure is an *api.Error with a D-Bus error name.
package engine

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"hangar.dev/hangar/services/ebsd/internal/blockstore"
	"hangar.dev/hangar/services/ebsd/internal/catalog"
	"hangar.dev/hangar/services/ebsd/internal/nbd"
	"hangar.dev/hangar/services/ebsd/internal/volume"
	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/internal/awsid"
	"hangar.dev/hangar/services/internal/store"
)

// BlockSize is the snapshot block size.
const BlockSize = volume.BlockSize

// MaxVolumeSize is the largest volume: 64 TiB, io2 Block Express's limit.
const MaxVolumeSize = 64 << 40

// Hooks tell the bus layer what changed.
type Hooks struct {
	VolumeChanged   func(api.VolumeInfo, bool) // false: deleted
	SnapshotChanged func(api.SnapshotInfo, bool)
}

// Engine is the storage service.
type Engine struct {
	db         *store.DB
	blocks     *blockstore.Store
	stateDir   string
	runtimeDir string
	log        *slog.Logger
	hooks      Hooks
	ctx        context.Context
	cancel     context.CancelFunc
	wg         sync.WaitGroup

	mu      sync.Mutex
	vols    map[string]*openVolume
	pending map[string]*pendingSnapshot
}

type openVolume struct {
	rec   catalog.Volume
	v     *volume.Volume
	exp   *nbd.Export
	snapn string // snapshot being captured, "" when none
}

type pendingSnapshot struct {
	rec      catalog.Snapshot
	mu       sync.Mutex
	entries  map[uint64]string
	pack     *blockstore.Pack  // where its new blocks go (and its journal)
	slots    map[uint64]uint64 // index → pack slot of the entry (direct)
	closing  bool              // being committed: no more entries
	deadline time.Time
	// progress of a volume capture
	done, total uint64
}

func errf(name, format string, args ...any) *api.Error {
	return &api.Error{Name: name, Message: fmt.Sprintf(format, args...)}
}

// Open loads the catalog from stateDir, opens every volume and serves its
// export under runtimeDir.
func Open(ctx context.Context, stateDir, runtimeDir string, log *slog.Logger, hooks Hooks) (*Engine, error) {
	for _, d := range []string{stateDir, runtimeDir, filepath.Join(stateDir, "volumes")} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			return nil, fmt.Errorf("creating %s: %w", d, err)
		}
	}
	db, err := store.Open(filepath.Join(stateDir, "state.db"))
	if err != nil {
		return nil, err
	}
	blocks, err := blockstore.Open(filepath.Join(stateDir, "blocks"), db)
	if err != nil {
		db.Close()
		return nil, err
	}
	if hooks.VolumeChanged == nil {
		hooks.VolumeChanged = func(api.VolumeInfo, bool) {}
	}
	if hooks.SnapshotChanged == nil {
		hooks.SnapshotChanged = func(api.SnapshotInfo, bool) {}
	}
	e := &Engine{db: db, blocks: blocks, stateDir: stateDir, runtimeDir: runtimeDir, log: log, hooks: hooks,
		vols: map[string]*openVolume{}, pending: map[string]*pendingSnapshot{}}
	e.ctx, e.cancel = context.WithCancel(context.Background())
	if err := e.load(); err != nil {
		e.Close()
		return nil, err
	}
	e.wg.Add(1)
	go e.expire()
	return e, nil
}

// SetHooks replaces the hooks (the bus layer is built after the engine).
func (e *Engine) SetHooks(h Hooks) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if h.VolumeChanged != nil {
		e.hooks.VolumeChanged = h.VolumeChanged
	}
	if h.SnapshotChanged != nil {
		e.hooks.SnapshotChanged = h.SnapshotChanged
	}
}

func (e *Engine) load() error {
	var (
		vols  []*catalog.Volume
		snaps []*catalog.Snapshot
	)
	err := e.db.View(func(tx *store.Tx) (err error) {
		if vols, err = catalog.Volumes(tx); err != nil {
			return err
		}
		snaps, err = catalog.Snapshots(tx)
		return err
	})
	if err != nil {
		return fmt.Errorf("reading the catalog: %w", err)
	}
	for _, s := range snaps {
		if s.State != api.SnapshotPending {
			continue
		}
		if s.Direct {
			if err := e.resumeDirect(s); err != nil {
				e.log.Error("resuming EBS direct snapshot; marking it failed", "snapshot", s.ID, "err", err)
				e.failSnapshot(s.ID, "ebsd restarted and could not resume the snapshot: "+err.Error())
			}
			continue
		}
		// A volume capture cannot outlive the process that held its
		// copy-on-write state; the volume's changed set still covers it.
		e.failSnapshot(s.ID, "ebsd restarted while the snapshot was being taken")
	}
	for _, r := range vols {
		if err := e.openVolume(r); err != nil {
			return err
		}
	}
	pendingNames := map[string]bool{}
	for id := range e.pending {
		pendingNames[id] = true
	}
	n, err := e.blocks.Sweep(e.referenced, pendingNames)
	if err != nil {
		e.log.Warn("sweeping orphan blocks", "err", err)
	} else if n > 0 {
		e.log.Info("removed orphan blocks a crash left", "blocks", n)
	}
	return nil
}

func (e *Engine) volDir(id string) string { return filepath.Join(e.stateDir, "volumes", id) }

// SocketPath is where a volume's export listens.
func (e *Engine) SocketPath(id string) string { return filepath.Join(e.runtimeDir, id+".sock") }

func (e *Engine) openVolume(r *catalog.Volume) error {
	var src volume.Source
	if r.Base != "" {
		src = &snapSource{e: e, snap: r.Base}
	}
	v, err := volume.Open(e.volDir(r.ID), r.Size, src)
	if err != nil {
		return fmt.Errorf("opening volume %s: %w", r.ID, err)
	}
	exp, err := nbd.Listen(e.SocketPath(r.ID), r.ID, v, e.log.With("volume", r.ID))
	if err != nil {
		v.Close()
		return fmt.Errorf("exporting volume %s: %w", r.ID, err)
	}
	e.vols[r.ID] = &openVolume{rec: *r, v: v, exp: exp}
	return nil
}

// snapSource reads a volume's base snapshot.
type snapSource struct {
	e    *Engine
	snap string
}

func (s *snapSource) ReadBlock(index uint64, buf []byte) error {
	var h string
	err := s.e.db.View(func(tx *store.Tx) (err error) {
		h, err = catalog.Lookup(tx, s.snap, index)
		return err
	})
	if err != nil {
		return err
	}
	if h == "" {
		clear(buf)
		return nil
	}
	return s.e.blocks.Read(h, buf)
}

// Close stops every export, flushes every volume and closes the catalog.
func (e *Engine) Close() {
	e.cancel()
	e.wg.Wait()
	e.mu.Lock()
	defer e.mu.Unlock()
	for id, ov := range e.vols {
		ov.exp.Close()
		if err := ov.v.Flush(); err != nil {
			e.log.Error("flushing volume at shutdown", "volume", id, "err", err)
		}
		ov.v.Close()
	}
	for _, p := range e.pending {
		if p.pack != nil {
			p.pack.Close()
		}
	}
	e.db.Close()
}

// ---- volumes ----

func (e *Engine) volumeInfo(ov *openVolume) api.VolumeInfo {
	state := api.VolumeAvailable
	if ov.rec.AttachedTo != "" {
		state = api.VolumeInUse
	}
	return api.VolumeInfo{
		VolumeID:     ov.rec.ID,
		SizeBytes:    ov.rec.Size,
		State:        state,
		FromSnapshot: ov.rec.Base,
		ExportSocket: ov.exp.Path(),
		AttachedTo:   ov.rec.AttachedTo,
		Device:       ov.rec.Device,
		WrittenBytes: ov.v.PresentBytes(),
		Created:      ov.rec.Created,
	}
}

func checkID(prefix, id string) error {
	if !awsid.Valid(prefix, id) {
		return errf(api.ErrInvalidArgument, "%q is not a valid %s id", id, prefix)
	}
	return nil
}

// CreateVolume creates a volume, empty or from a completed snapshot.
func (e *Engine) CreateVolume(volID string, size uint64, fromSnap string) (api.VolumeInfo, error) {
	if err := checkID("vol", volID); err != nil {
		return api.VolumeInfo{}, err
	}
	if size == 0 || size%BlockSize != 0 || size > MaxVolumeSize {
		return api.VolumeInfo{}, errf(api.ErrInvalidArgument, "volume size %d must be a non-zero multiple of %d up to %d bytes", size, BlockSize, uint64(MaxVolumeSize))
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if ov := e.vols[volID]; ov != nil {
		// A retry (even after the volume grew) gets the volume.
		if ov.rec.Base != fromSnap {
			return api.VolumeInfo{}, errf(api.ErrConflict, "volume %s exists with other settings", volID)
		}
		return e.volumeInfo(ov), nil
	}
	rec := &catalog.Volume{ID: volID, Size: size, Base: fromSnap, LastSnap: fromSnap, Created: time.Now().Unix()}
	if fromSnap != "" {
		var s *catalog.Snapshot
		err := e.db.View(func(tx *store.Tx) (err error) { s, err = catalog.GetSnapshot(tx, fromSnap); return err })
		if errors.Is(err, catalog.ErrNotFound) || err == nil && s.Hidden {
			return api.VolumeInfo{}, errf(api.ErrNotFound, "snapshot %s does not exist", fromSnap)
		}
		if err != nil {
			return api.VolumeInfo{}, err
		}
		if s.State != api.SnapshotCompleted {
			return api.VolumeInfo{}, errf(api.ErrInvalidArgument, "snapshot %s is %s, not completed", fromSnap, s.State)
		}
		if size < s.VolumeSize {
			return api.VolumeInfo{}, errf(api.ErrInvalidArgument, "volume size %d is smaller than snapshot %s (%d bytes)", size, fromSnap, s.VolumeSize)
		}
	}
	dir := e.volDir(volID)
	_ = os.RemoveAll(dir) // a create that crashed before its record
	if err := volume.Create(dir, size); err != nil {
		_ = os.RemoveAll(dir)
		return api.VolumeInfo{}, capacity(err, "creating volume "+volID)
	}
	if err := e.db.Update(func(tx *store.Tx) error { return catalog.PutVolume(tx, rec) }); err != nil {
		_ = os.RemoveAll(dir)
		return api.VolumeInfo{}, capacity(err, "recording volume "+volID)
	}
	if err := e.openVolume(rec); err != nil {
		return api.VolumeInfo{}, err
	}
	info := e.volumeInfo(e.vols[volID])
	e.hooks.VolumeChanged(info, true)
	e.log.Info("created volume", "volume", volID, "size", size, "snapshot", fromSnap)
	return info, nil
}

func capacity(err error, what string) error {
	if errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT) || strings.Contains(err.Error(), "no space left") {
		return errf(api.ErrInsufficientCapacity, "%s: the host's storage is full", what)
	}
	return fmt.Errorf("%s: %w", what, err)
}

func (e *Engine) getVol(id string) (*openVolume, error) {
	ov := e.vols[id]
	if ov == nil {
		return nil, errf(api.ErrNotFound, "volume %s does not exist", id)
	}
	return ov, nil
}

// GetVolume returns a volume.
func (e *Engine) GetVolume(id string) (api.VolumeInfo, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	ov, err := e.getVol(id)
	if err != nil {
		return api.VolumeInfo{}, err
	}
	return e.volumeInfo(ov), nil
}

// ListVolumes returns every volume by id.
func (e *Engine) ListVolumes() []api.VolumeInfo {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := make([]api.VolumeInfo, 0, len(e.vols))
	for _, ov := range e.vols {
		out = append(out, e.volumeInfo(ov))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].VolumeID < out[j].VolumeID })
	return out
}

// DeleteVolume deletes a volume that is neither attached nor being written.
func (e *Engine) DeleteVolume(id string) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	ov := e.vols[id]
	if ov == nil {
		return nil
	}
	if ov.rec.AttachedTo != "" {
		return errf(api.ErrInUse, "volume %s is attached to %s", id, ov.rec.AttachedTo)
	}
	if ov.exp.HasWriter() {
		return errf(api.ErrInUse, "volume %s has a writer connected to its export", id)
	}
	if ov.snapn != "" {
		return errf(api.ErrInUse, "snapshot %s of volume %s is still being taken", ov.snapn, id)
	}
	ov.exp.Close()
	ov.v.Close()
	var freed []string
	err := e.db.Update(func(tx *store.Tx) (err error) {
		if err := tx.Delete(catalog.KindVolume, id); err != nil {
			return err
		}
		freed, err = catalog.Purge(tx)
		return err
	})
	if err != nil {
		return fmt.Errorf("deleting volume %s: %w", id, err)
	}
	delete(e.vols, id)
	if err := os.RemoveAll(e.volDir(id)); err != nil {
		e.log.Warn("removing volume files", "volume", id, "err", err)
	}
	e.free(freed)
	e.hooks.VolumeChanged(api.VolumeInfo{VolumeID: id}, false)
	e.log.Info("deleted volume", "volume", id)
	return nil
}

// ResizeVolume grows a volume.
func (e *Engine) ResizeVolume(id string, size uint64) (api.VolumeInfo, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	ov, err := e.getVol(id)
	if err != nil {
		return api.VolumeInfo{}, err
	}
	if size == ov.rec.Size {
		return e.volumeInfo(ov), nil
	}
	if size < ov.rec.Size || size%BlockSize != 0 || size > MaxVolumeSize {
		return api.VolumeInfo{}, errf(api.ErrInvalidArgument, "volume %s can only grow, to a multiple of %d bytes up to %d (it has %d, asked %d)", id, BlockSize, uint64(MaxVolumeSize), ov.rec.Size, size)
	}
	if ov.snapn != "" {
		return api.VolumeInfo{}, errf(api.ErrInUse, "snapshot %s of volume %s is still being taken", ov.snapn, id)
	}
	if err := ov.v.Grow(size); err != nil {
		return api.VolumeInfo{}, capacity(err, "growing volume "+id)
	}
	rec := ov.rec
	rec.Size = size
	if err := e.db.Update(func(tx *store.Tx) error { return catalog.PutVolume(tx, &rec) }); err != nil {
		return api.VolumeInfo{}, err
	}
	ov.rec = rec
	info := e.volumeInfo(ov)
	e.hooks.VolumeChanged(info, true)
	return info, nil
}

// AttachVolume records which instance uses a volume.
func (e *Engine) AttachVolume(id, instance, device string) (api.VolumeInfo, error) {
	if err := checkID("i", instance); err != nil {
		return api.VolumeInfo{}, err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	ov, err := e.getVol(id)
	if err != nil {
		return api.VolumeInfo{}, err
	}
	if ov.rec.AttachedTo == instance && ov.rec.Device == device {
		return e.volumeInfo(ov), nil
	}
	if ov.rec.AttachedTo != "" {
		return api.VolumeInfo{}, errf(api.ErrInUse, "volume %s is attached to %s", id, ov.rec.AttachedTo)
	}
	rec := ov.rec
	rec.AttachedTo, rec.Device = instance, device
	if err := e.db.Update(func(tx *store.Tx) error { return catalog.PutVolume(tx, &rec) }); err != nil {
		return api.VolumeInfo{}, err
	}
	ov.rec = rec
	info := e.volumeInfo(ov)
	e.hooks.VolumeChanged(info, true)
	return info, nil
}

// DetachVolume clears a volume's attachment.
func (e *Engine) DetachVolume(id, instance string) (api.VolumeInfo, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	ov, err := e.getVol(id)
	if err != nil {
		return api.VolumeInfo{}, err
	}
	if ov.rec.AttachedTo == "" {
		return e.volumeInfo(ov), nil
	}
	if instance != "" && instance != ov.rec.AttachedTo {
		return api.VolumeInfo{}, errf(api.ErrConflict, "volume %s is attached to %s, not %s", id, ov.rec.AttachedTo, instance)
	}
	rec := ov.rec
	rec.AttachedTo, rec.Device = "", ""
	if err := e.db.Update(func(tx *store.Tx) error { return catalog.PutVolume(tx, &rec) }); err != nil {
		return api.VolumeInfo{}, err
	}
	ov.rec = rec
	info := e.volumeInfo(ov)
	e.hooks.VolumeChanged(info, true)
	return info, nil
}

// ---- snapshots ----

func snapshotInfo(s *catalog.Snapshot) api.SnapshotInfo {
	progress := uint32(0)
	if s.State == api.SnapshotCompleted {
		progress = 100
	}
	return api.SnapshotInfo{
		SnapshotID: s.ID, VolumeID: s.VolumeID, ParentID: s.ParentID, State: s.State, Progress: progress,
		VolumeSizeBytes: s.VolumeSize, BlockCount: s.BlockCount, ChangedBlocks: s.ChangedBlocks,
		StoredBytes: s.StoredBytes, Started: s.Started, Completed: s.Completed, Error: s.Error,
	}
}

func (e *Engine) pendingInfo(p *pendingSnapshot) api.SnapshotInfo {
	p.mu.Lock()
	defer p.mu.Unlock()
	info := snapshotInfo(&p.rec)
	info.ChangedBlocks = uint64(len(p.entries))
	if p.total > 0 {
		info.Progress = uint32(p.done * 100 / p.total)
		if info.Progress == 100 {
			info.Progress = 99 // 100 only once committed
		}
	}
	return info
}

// GetSnapshot returns a snapshot.
func (e *Engine) GetSnapshot(id string) (api.SnapshotInfo, error) {
	e.mu.Lock()
	p := e.pending[id]
	e.mu.Unlock()
	if p != nil {
		return e.pendingInfo(p), nil
	}
	var s *catalog.Snapshot
	err := e.db.View(func(tx *store.Tx) (err error) { s, err = catalog.GetSnapshot(tx, id); return err })
	if errors.Is(err, catalog.ErrNotFound) || err == nil && s.Hidden {
		return api.SnapshotInfo{}, errf(api.ErrNotFound, "snapshot %s does not exist", id)
	}
	if err != nil {
		return api.SnapshotInfo{}, err
	}
	return snapshotInfo(s), nil
}

// ListSnapshots returns every visible snapshot.
func (e *Engine) ListSnapshots() ([]api.SnapshotInfo, error) {
	var snaps []*catalog.Snapshot
	if err := e.db.View(func(tx *store.Tx) (err error) { snaps, err = catalog.Snapshots(tx); return err }); err != nil {
		return nil, err
	}
	out := []api.SnapshotInfo{}
	for _, s := range snaps {
		if s.Hidden {
			continue
		}
		e.mu.Lock()
		p := e.pending[s.ID]
		e.mu.Unlock()
		if p != nil {
			out = append(out, e.pendingInfo(p))
			continue
		}
		out = append(out, snapshotInfo(s))
	}
	return out, nil
}

// CreateSnapshot starts a point-in-time snapshot of a volume. It returns
// at once with the snapshot pending; blocks are captured in the
// background, and a write meanwhile preserves the block it overwrites.
func (e *Engine) CreateSnapshot(snapID, volID string) (api.SnapshotInfo, error) {
	if err := checkID("snap", snapID); err != nil {
		return api.SnapshotInfo{}, err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if p := e.pending[snapID]; p != nil {
		if p.rec.VolumeID != volID {
			return api.SnapshotInfo{}, errf(api.ErrConflict, "snapshot %s exists for another volume", snapID)
		}
		return e.pendingInfo(p), nil
	}
	var existing *catalog.Snapshot
	err := e.db.View(func(tx *store.Tx) (err error) { existing, err = catalog.GetSnapshot(tx, snapID); return err })
	if err == nil {
		if existing.VolumeID != volID || existing.Hidden {
			return api.SnapshotInfo{}, errf(api.ErrConflict, "snapshot %s exists with other settings", snapID)
		}
		return snapshotInfo(existing), nil
	} else if !errors.Is(err, catalog.ErrNotFound) {
		return api.SnapshotInfo{}, err
	}
	ov, err := e.getVol(volID)
	if err != nil {
		return api.SnapshotInfo{}, err
	}
	if ov.snapn != "" {
		return api.SnapshotInfo{}, errf(api.ErrConflict, "snapshot %s of volume %s is still being taken; one at a time", ov.snapn, volID)
	}
	p := &pendingSnapshot{
		rec: catalog.Snapshot{ID: snapID, VolumeID: volID, ParentID: ov.rec.LastSnap, State: api.SnapshotPending,
			VolumeSize: ov.rec.Size, Started: time.Now().Unix()},
		entries: map[uint64]string{},
	}
	pack, err := e.blocks.CreatePack(snapID)
	if err != nil {
		return api.SnapshotInfo{}, capacity(err, "starting snapshot "+snapID)
	}
	p.pack = pack
	if err := e.db.Update(func(tx *store.Tx) error { return catalog.PutSnapshot(tx, &p.rec) }); err != nil {
		pack.Discard()
		return api.SnapshotInfo{}, capacity(err, "recording snapshot "+snapID)
	}
	total, err := ov.v.StartCapture(func(index uint64, data []byte) error { return e.captureBlock(p, index, data) })
	if err != nil {
		e.failSnapshotLocked(p, err.Error())
		return api.SnapshotInfo{}, fmt.Errorf("starting snapshot %s: %w", snapID, err)
	}
	p.total = total
	ov.snapn = snapID
	e.pending[snapID] = p
	info := e.pendingInfo(p)
	e.hooks.SnapshotChanged(info, true)
	e.log.Info("snapshot started", "snapshot", snapID, "volume", volID, "blocks", total, "parent", p.rec.ParentID)
	e.wg.Add(1)
	go e.runCapture(ov, p)
	return info, nil
}

func allZero(b []byte) bool {
	for len(b) >= 8 {
		if binary.LittleEndian.Uint64(b) != 0 {
			return false
		}
		b = b[8:]
	}
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// captureBlock stores a block of a volume snapshot in the snapshot's pack
// unless the store or the pack holds it already. Nothing is synced here:
// the commit seals the pack (one fdatasync) before the catalog records it.
func (e *Engine) captureBlock(p *pendingSnapshot, index uint64, data []byte) error {
	h := catalog.Tombstone
	if !allZero(data) {
		h = blockstore.Sum(data)
		e.blocks.Pin(h)
		if !p.pack.HasData(h) && !e.blocks.Stored(h) {
			if _, _, err := p.pack.Append(index, h, data); err != nil {
				e.blocks.Unpin(h)
				return err
			}
		}
	}
	p.mu.Lock()
	p.entries[index] = h
	p.done++
	p.mu.Unlock()
	return nil
}

func (e *Engine) runCapture(ov *openVolume, p *pendingSnapshot) {
	defer e.wg.Done()
	last := time.Now()
	err := ov.v.RunCapture(e.ctx, func(done, total uint64) {
		if time.Since(last) > 500*time.Millisecond {
			last = time.Now()
			e.hooks.SnapshotChanged(e.pendingInfo(p), true)
		}
	})
	e.mu.Lock()
	defer e.mu.Unlock()
	ov.snapn = ""
	if err == nil {
		err = e.commitLocked(p, func(tx *store.Tx) error {
			rec := ov.rec
			rec.LastSnap = p.rec.ID
			if err := catalog.PutVolume(tx, &rec); err != nil {
				return err
			}
			ov.rec = rec
			return nil
		})
	}
	if err != nil {
		if endErr := ov.v.EndCapture(false); endErr != nil {
			e.log.Error("ending a failed capture", "volume", ov.rec.ID, "err", endErr)
		}
		e.failSnapshotLocked(p, err.Error())
		return
	}
	if err := ov.v.EndCapture(true); err != nil {
		// The snapshot is committed; the changed set stays a superset,
		// so the next snapshot only stores a few blocks again.
		e.log.Warn("resetting the changed-block set", "volume", ov.rec.ID, "err", err)
	}
	e.purge()
}

// commitLocked writes a pending snapshot's map and completes it; extra runs
// in the same transaction.
func (e *Engine) commitLocked(p *pendingSnapshot, extra func(*store.Tx) error) error {
	p.mu.Lock()
	p.closing = true // a PutBlock not yet recorded is refused from now on
	entries := maps.Clone(p.entries)
	rec := p.rec
	p.mu.Unlock()
	reopen := func() {
		p.mu.Lock()
		p.closing = false
		p.mu.Unlock()
	}
	// Every block written, including captures never synced, is durable
	// before the catalog points at it.
	if err := p.pack.Quiesce(); err != nil {
		reopen()
		return capacity(err, "committing snapshot "+rec.ID)
	}
	var hashes []string
	for _, h := range entries {
		if h != catalog.Tombstone {
			hashes = append(hashes, h)
		}
	}
	rec.State = api.SnapshotCompleted
	rec.Completed = time.Now().Unix()
	var live map[uint64]bool
	err := e.db.Update(func(tx *store.Tx) (err error) {
		if _, err := catalog.Commit(tx, &rec, entries, BlockSize); err != nil {
			return err
		}
		if live, err = e.blocks.Commit(tx, p.pack, hashes); err != nil {
			return err
		}
		if extra != nil {
			return extra(tx)
		}
		return nil
	})
	if err != nil {
		reopen()
		return capacity(err, "committing snapshot "+rec.ID)
	}
	delete(e.pending, rec.ID)
	e.blocks.Trim(p.pack, live)
	e.unpin(entries)
	_ = os.Remove(e.journalPath(rec.ID)) // of an older ebsd
	p.mu.Lock()
	p.rec = rec
	p.mu.Unlock()
	e.hooks.SnapshotChanged(snapshotInfo(&rec), true)
	e.log.Info("snapshot completed", "snapshot", rec.ID, "changed", rec.ChangedBlocks, "blocks", rec.BlockCount, "new_bytes", rec.StoredBytes, "pack_syncs", p.pack.Syncs())
	return nil
}

func (e *Engine) unpin(entries map[uint64]string) {
	var hs []string
	for _, h := range entries {
		if h != catalog.Tombstone {
			e.blocks.Unpin(h)
			hs = append(hs, h)
		}
	}
	e.free(hs)
}

func (e *Engine) referenced(h string) bool {
	n := int64(0)
	_ = e.db.View(func(tx *store.Tx) (err error) { n, err = catalog.Refs(tx, h); return err })
	return n > 0
}

// free removes block files that nothing references or pins.
func (e *Engine) free(hashes []string) {
	if len(hashes) == 0 {
		return
	}
	n := e.blocks.Free(hashes, e.referenced)
	if n > 0 {
		e.log.Info("freed blocks", "blocks", n)
	}
}

func (e *Engine) purge() {
	var freed []string
	err := e.db.Update(func(tx *store.Tx) (err error) { freed, err = catalog.Purge(tx); return err })
	if err != nil {
		e.log.Error("purging deleted snapshots", "err", err)
		return
	}
	e.free(freed)
}

func (e *Engine) failSnapshot(id, reason string) {
	err := e.db.Update(func(tx *store.Tx) error {
		s, err := catalog.GetSnapshot(tx, id)
		if err != nil {
			return err
		}
		s.State = api.SnapshotError
		s.Error = reason
		return catalog.PutSnapshot(tx, s)
	})
	if err != nil {
		e.log.Error("marking snapshot failed", "snapshot", id, "err", err)
	}
	_ = os.Remove(e.journalPath(id))
}

func (e *Engine) failSnapshotLocked(p *pendingSnapshot, reason string) {
	delete(e.pending, p.rec.ID)
	p.mu.Lock()
	entries := p.entries
	p.entries = map[uint64]string{}
	p.rec.State = api.SnapshotError
	p.rec.Error = reason
	rec := p.rec
	p.mu.Unlock()
	if p.pack != nil {
		p.pack.Discard()
	}
	e.failSnapshot(rec.ID, reason)
	e.unpin(entries)
	e.hooks.SnapshotChanged(snapshotInfo(&rec), true)
	e.log.Warn("snapshot failed", "snapshot", rec.ID, "reason", reason)
}

// DeleteSnapshot deletes a snapshot; only blocks nothing else references
// are freed. A volume made from it keeps reading it (it is hidden, not
// removed, until no volume needs it).
func (e *Engine) DeleteSnapshot(id string) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if p := e.pending[id]; p != nil {
		if !p.rec.Direct {
			return errf(api.ErrInUse, "snapshot %s is still being taken", id)
		}
		e.failSnapshotLocked(p, "deleted while pending")
	}
	var freed []string
	err := e.db.Update(func(tx *store.Tx) (err error) {
		s, err := catalog.GetSnapshot(tx, id)
		if errors.Is(err, catalog.ErrNotFound) {
			return nil
		}
		if err != nil {
			return err
		}
		if s.Hidden {
			return nil
		}
		freed, err = catalog.Delete(tx, id)
		return err
	})
	if err != nil {
		return fmt.Errorf("deleting snapshot %s: %w", id, err)
	}
	e.free(freed)
	e.hooks.SnapshotChanged(api.SnapshotInfo{SnapshotID: id}, false)
	return nil
}

// ---- EBS direct ----

func (e *Engine) journalPath(id string) string {
	return filepath.Join(e.stateDir, "pending", id+".log")
}

// StartSnapshot starts an EBS direct snapshot.
func (e *Engine) StartSnapshot(a api.StartSnapshotArgs) (api.SnapshotInfo, error) {
	if err := checkID("snap", a.SnapshotID); err != nil {
		return api.SnapshotInfo{}, err
	}
	if a.VolumeSizeBytes == 0 || a.VolumeSizeBytes%BlockSize != 0 || a.VolumeSizeBytes > MaxVolumeSize {
		return api.SnapshotInfo{}, errf(api.ErrInvalidArgument, "volume size %d is not a multiple of %d up to %d bytes", a.VolumeSizeBytes, BlockSize, uint64(MaxVolumeSize))
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if p := e.pending[a.SnapshotID]; p != nil {
		return e.pendingInfo(p), nil
	}
	var existing *catalog.Snapshot
	err := e.db.View(func(tx *store.Tx) (err error) { existing, err = catalog.GetSnapshot(tx, a.SnapshotID); return err })
	if err == nil {
		if !existing.Direct || existing.VolumeSize != a.VolumeSizeBytes || existing.ParentID != a.ParentID {
			return api.SnapshotInfo{}, errf(api.ErrConflict, "snapshot %s exists with other settings", a.SnapshotID)
		}
		return snapshotInfo(existing), nil
	} else if !errors.Is(err, catalog.ErrNotFound) {
		return api.SnapshotInfo{}, err
	}
	if a.ParentID != "" {
		var parent *catalog.Snapshot
		err := e.db.View(func(tx *store.Tx) (err error) { parent, err = catalog.GetSnapshot(tx, a.ParentID); return err })
		if errors.Is(err, catalog.ErrNotFound) || err == nil && parent.Hidden {
			return api.SnapshotInfo{}, errf(api.ErrNotFound, "parent snapshot %s does not exist", a.ParentID)
		}
		if err != nil {
			return api.SnapshotInfo{}, err
		}
		if parent.State != api.SnapshotCompleted {
			return api.SnapshotInfo{}, errf(api.ErrInvalidArgument, "parent snapshot %s is %s, not completed", a.ParentID, parent.State)
		}
		if a.VolumeSizeBytes < parent.VolumeSize {
			return api.SnapshotInfo{}, errf(api.ErrInvalidArgument, "volume size %d is smaller than the parent's %d", a.VolumeSizeBytes, parent.VolumeSize)
		}
	}
	timeout := a.TimeoutMinutes
	if timeout == 0 {
		timeout = 60
	}
	p := &pendingSnapshot{
		rec: catalog.Snapshot{ID: a.SnapshotID, ParentID: a.ParentID, State: api.SnapshotPending, VolumeSize: a.VolumeSizeBytes,
			Started: time.Now().Unix(), Direct: true, TimeoutMinutes: timeout},
		entries: map[uint64]string{}, slots: map[uint64]uint64{},
	}
	p.deadline = time.Unix(p.rec.Started, 0).Add(time.Duration(timeout) * time.Minute)
	pack, err := e.blocks.CreatePack(a.SnapshotID)
	if err != nil {
		return api.SnapshotInfo{}, capacity(err, "creating the pack of "+a.SnapshotID)
	}
	p.pack = pack
	if err := e.db.Update(func(tx *store.Tx) error { return catalog.PutSnapshot(tx, &p.rec) }); err != nil {
		pack.Discard()
		return api.SnapshotInfo{}, capacity(err, "recording snapshot "+a.SnapshotID)
	}
	e.pending[a.SnapshotID] = p
	info := e.pendingInfo(p)
	e.hooks.SnapshotChanged(info, true)
	return info, nil
}

// resumeDirect rebuilds a pending direct snapshot after a restart from
// its pack: every slot that checks out is a block that may have been
// acknowledged, and a later slot of the same index wins, as it did before.
// (A journal of an older ebsd, "index sha256" lines naming block files, is
// read first.)
func (e *Engine) resumeDirect(s *catalog.Snapshot) error {
	p := &pendingSnapshot{rec: *s, entries: map[uint64]string{}, slots: map[uint64]uint64{}}
	p.deadline = time.Unix(s.Started, 0).Add(time.Duration(s.TimeoutMinutes) * time.Minute)
	set := func(idx uint64, h string) {
		if old, ok := p.entries[idx]; ok {
			e.blocks.Unpin(old)
		}
		e.blocks.Pin(h)
		p.entries[idx] = h
	}
	f, err := os.Open(e.journalPath(s.ID))
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	if f != nil {
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			var idx uint64
			var h string
			if _, err := fmt.Sscanf(sc.Text(), "%d %s", &idx, &h); err != nil || !blockstore.ValidHash(h) {
				break // a torn last line: that block was never acknowledged
			}
			if e.blocks.Stored(h) {
				set(idx, h)
			}
		}
		f.Close()
	}
	pack, recs, err := e.blocks.ResumePack(s.ID)
	if err != nil {
		return err
	}
	p.pack = pack
	for _, r := range recs {
		if !r.Data && !e.blocks.Stored(r.Hash) && !pack.HasData(r.Hash) {
			continue
		}
		set(r.Index, r.Hash)
		p.slots[r.Index] = r.Slot
	}
	e.pending[s.ID] = p
	e.log.Info("resumed EBS direct snapshot", "snapshot", s.ID, "blocks", len(p.entries))
	return nil
}

func (e *Engine) getPendingDirect(id string) (*pendingSnapshot, error) {
	e.mu.Lock()
	p := e.pending[id]
	e.mu.Unlock()
	if p != nil && p.rec.Direct {
		return p, nil
	}
	var s *catalog.Snapshot
	err := e.db.View(func(tx *store.Tx) (err error) { s, err = catalog.GetSnapshot(tx, id); return err })
	if errors.Is(err, catalog.ErrNotFound) || err == nil && s.Hidden {
		return nil, errf(api.ErrNotFound, "snapshot %s does not exist", id)
	}
	if err != nil {
		return nil, err
	}
	return nil, errf(api.ErrConflict, "snapshot %s is %s; blocks can only be written to a pending snapshot started with StartSnapshot", id, s.State)
}

// PutBlock stores one block of a pending direct snapshot after checking
// its length and SHA-256.
func (e *Engine) PutBlock(snapID string, index uint64, data []byte, checksum string) error {
	p, err := e.getPendingDirect(snapID)
	if err != nil {
		return err
	}
	if n := p.rec.VolumeSize / BlockSize; index >= n {
		return errf(api.ErrInvalidArgument, "block index %d is out of range: the snapshot's volume has %d blocks", index, n)
	}
	if len(data) != BlockSize {
		return errf(api.ErrInvalidArgument, "a block must be %d bytes, not %d", BlockSize, len(data))
	}
	sum := sha256.Sum256(data)
	if base64.StdEncoding.EncodeToString(sum[:]) != checksum {
		return errf(api.ErrInvalidArgument, "the checksum %s does not match the block's SHA-256", checksum)
	}
	h := hex.EncodeToString(sum[:])
	e.blocks.Pin(h)
	// The pack's slot is the journal entry; a block the store holds
	// already is written as a reference only.
	payload := data
	if e.blocks.Stored(h) {
		payload = nil
	}
	slot, ticket, err := p.pack.Append(index, h, payload)
	if err == nil {
		err = p.pack.Sync(ticket)
	}
	if err != nil {
		e.blocks.Unpin(h)
		if errors.Is(err, blockstore.ErrSealed) {
			return errf(api.ErrConflict, "snapshot %s is no longer pending", snapID)
		}
		return capacity(err, fmt.Sprintf("storing block %d of %s", index, snapID))
	}
	p.mu.Lock()
	if p.rec.State != api.SnapshotPending || p.closing {
		state := p.rec.State
		if p.closing {
			state = "being completed"
		}
		p.mu.Unlock()
		e.blocks.Unpin(h)
		return errf(api.ErrConflict, "snapshot %s is %s", snapID, state)
	}
	if cur, ok := p.slots[index]; ok && cur > slot {
		// A later put of this block (a later slot) already won, as it
		// would after a restart.
		p.mu.Unlock()
		e.blocks.Unpin(h)
		return nil
	}
	old, had := p.entries[index]
	p.entries[index] = h
	p.slots[index] = slot
	p.mu.Unlock()
	if had {
		e.blocks.Unpin(old)
		if old != h {
			e.free([]string{old})
		}
	}
	return nil
}

// CompleteSnapshot checks the block count (and the aggregated checksum when
// given) and commits a direct snapshot.
func (e *Engine) CompleteSnapshot(a api.CompleteSnapshotArgs) (api.SnapshotInfo, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	p := e.pending[a.SnapshotID]
	if p == nil || !p.rec.Direct {
		var s *catalog.Snapshot
		err := e.db.View(func(tx *store.Tx) (err error) { s, err = catalog.GetSnapshot(tx, a.SnapshotID); return err })
		if errors.Is(err, catalog.ErrNotFound) || err == nil && s.Hidden {
			return api.SnapshotInfo{}, errf(api.ErrNotFound, "snapshot %s does not exist", a.SnapshotID)
		}
		if err != nil {
			return api.SnapshotInfo{}, err
		}
		if s.State == api.SnapshotCompleted && s.Direct {
			return snapshotInfo(s), nil // a retried completion
		}
		return api.SnapshotInfo{}, errf(api.ErrConflict, "snapshot %s is %s", a.SnapshotID, s.State)
	}
	p.mu.Lock()
	n := len(p.entries)
	var idx []uint64
	for i := range p.entries {
		idx = append(idx, i)
	}
	sums := map[uint64]string{}
	for i, h := range p.entries {
		sums[i] = h
	}
	p.mu.Unlock()
	if uint32(n) != a.ChangedBlocks {
		return api.SnapshotInfo{}, errf(api.ErrInvalidArgument, "ChangedBlocksCount is %d but %d blocks were written", a.ChangedBlocks, n)
	}
	if a.Checksum != "" {
		if a.ChecksumAlgorithm != "SHA256" || a.AggregationMethod != "LINEAR" {
			return api.SnapshotInfo{}, errf(api.ErrInvalidArgument, "only SHA256 checksums aggregated LINEAR are supported, not %s/%s", a.ChecksumAlgorithm, a.AggregationMethod)
		}
		// LINEAR: the blocks' checksums in index order, concatenated, then
		// hashed. AWS's words ("concatenate them to form a single string")
		// fit both the raw digests and their base64 text; either is taken.
		sort.Slice(idx, func(i, j int) bool { return idx[i] < idx[j] })
		rawAgg, textAgg := sha256.New(), sha256.New()
		for _, i := range idx {
			raw, _ := hex.DecodeString(sums[i])
			rawAgg.Write(raw)
			textAgg.Write([]byte(base64.StdEncoding.EncodeToString(raw)))
		}
		got := base64.StdEncoding.EncodeToString(rawAgg.Sum(nil))
		if got != a.Checksum && base64.StdEncoding.EncodeToString(textAgg.Sum(nil)) != a.Checksum {
			return api.SnapshotInfo{}, errf(api.ErrInvalidArgument, "the aggregated checksum %s does not match the blocks written (%s)", a.Checksum, got)
		}
	}
	if err := e.commitLocked(p, nil); err != nil {
		return api.SnapshotInfo{}, err
	}
	return e.snapshotUnlocked(a.SnapshotID)
}

func (e *Engine) snapshotUnlocked(id string) (api.SnapshotInfo, error) {
	var s *catalog.Snapshot
	if err := e.db.View(func(tx *store.Tx) (err error) { s, err = catalog.GetSnapshot(tx, id); return err }); err != nil {
		return api.SnapshotInfo{}, err
	}
	return snapshotInfo(s), nil
}

// expire fails direct snapshots that outlived their Timeout.
func (e *Engine) expire() {
	defer e.wg.Done()
	t := time.NewTicker(30 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-e.ctx.Done():
			return
		case <-t.C:
		}
		e.mu.Lock()
		for _, p := range e.pending {
			if p.rec.Direct && !p.deadline.IsZero() && time.Now().After(p.deadline) {
				e.failSnapshotLocked(p, fmt.Sprintf("not completed within its timeout of %d minutes", p.rec.TimeoutMinutes))
			}
		}
		e.mu.Unlock()
	}
}

// Token is a block token: the block's index and hash, so GetBlock can
// check that the token belongs to that block of that snapshot.
func Token(index uint64, hash string) string {
	raw := make([]byte, 8, 40)
	binary.BigEndian.PutUint64(raw, index)
	h, _ := hex.DecodeString(hash)
	return base64.StdEncoding.EncodeToString(append(raw, h...))
}

func parseToken(tok string) (uint64, string, bool) {
	raw, err := base64.StdEncoding.DecodeString(tok)
	if err != nil || len(raw) != 40 {
		return 0, "", false
	}
	return binary.BigEndian.Uint64(raw), hex.EncodeToString(raw[8:]), true
}

func (e *Engine) completedSnapshot(id string) (*catalog.Snapshot, error) {
	var s *catalog.Snapshot
	err := e.db.View(func(tx *store.Tx) (err error) { s, err = catalog.GetSnapshot(tx, id); return err })
	if errors.Is(err, catalog.ErrNotFound) || err == nil && s.Hidden {
		return nil, errf(api.ErrNotFound, "snapshot %s does not exist", id)
	}
	if err != nil {
		return nil, err
	}
	if s.State != api.SnapshotCompleted {
		return nil, errf(api.ErrConflict, "snapshot %s is %s, not completed", id, s.State)
	}
	return s, nil
}

// GetBlock writes block index of a completed snapshot into w and returns
// its length and base64 SHA-256.
func (e *Engine) GetBlock(snapID string, index uint64, token string, w io.WriterAt) (uint32, string, error) {
	s, err := e.completedSnapshot(snapID)
	if err != nil {
		return 0, "", err
	}
	ti, th, ok := parseToken(token)
	if !ok || ti != index {
		return 0, "", errf(api.ErrInvalidArgument, "the block token is not valid for block %d", index)
	}
	if index >= s.VolumeSize/BlockSize {
		return 0, "", errf(api.ErrInvalidArgument, "block index %d is out of range", index)
	}
	var h string
	if err := e.db.View(func(tx *store.Tx) (err error) { h, err = catalog.Lookup(tx, snapID, index); return err }); err != nil {
		return 0, "", err
	}
	if h != th {
		return 0, "", errf(api.ErrInvalidArgument, "the block token is not valid for block %d of %s", index, snapID)
	}
	buf := make([]byte, BlockSize)
	if err := e.blocks.Read(h, buf); err != nil {
		return 0, "", err
	}
	if _, err := w.WriteAt(buf, 0); err != nil {
		return 0, "", fmt.Errorf("handing block %d over: %w", index, err)
	}
	raw, _ := hex.DecodeString(h)
	return BlockSize, base64.StdEncoding.EncodeToString(raw), nil
}

// ListBlocks lists the blocks of a completed snapshot.
func (e *Engine) ListBlocks(snapID string, start uint64, max uint32) (api.BlockPage, error) {
	s, err := e.completedSnapshot(snapID)
	if err != nil {
		return api.BlockPage{}, err
	}
	if max == 0 {
		max = 10000
	}
	page := api.BlockPage{Blocks: []api.Block{}, VolumeSizeBytes: s.VolumeSize, BlockSize: BlockSize}
	err = e.db.View(func(tx *store.Tx) error {
		es, next, more, err := catalog.Blocks(tx, snapID, start, int(max))
		for _, en := range es {
			page.Blocks = append(page.Blocks, api.Block{Index: en.Index, Token: Token(en.Index, en.Hash)})
		}
		page.NextIndex, page.More = next, more
		return err
	})
	return page, err
}

// ListChangedBlocks lists blocks that differ between two snapshots of one
// lineage.
func (e *Engine) ListChangedBlocks(first, second string, start uint64, max uint32) (api.ChangedBlockPage, error) {
	s, err := e.completedSnapshot(second)
	if err != nil {
		return api.ChangedBlockPage{}, err
	}
	if first != "" {
		if _, err := e.completedSnapshot(first); err != nil {
			return api.ChangedBlockPage{}, err
		}
	}
	if max == 0 {
		max = 10000
	}
	page := api.ChangedBlockPage{Blocks: []api.ChangedBlock{}, VolumeSizeBytes: s.VolumeSize, BlockSize: BlockSize}
	err = e.db.View(func(tx *store.Tx) error {
		cs, next, more, err := catalog.ChangedBlocks(tx, first, second, start, int(max))
		if errors.Is(err, catalog.ErrUnrelated) {
			return errf(api.ErrInvalidArgument, "snapshots %s and %s are not of one lineage", first, second)
		}
		for _, c := range cs {
			cb := api.ChangedBlock{Index: c.Index}
			if c.First != "" {
				cb.FirstToken = Token(c.Index, c.First)
			}
			if c.Second != "" {
				cb.SecondToken = Token(c.Index, c.Second)
			}
			page.Blocks = append(page.Blocks, cb)
		}
		page.NextIndex, page.More = next, more
		return err
	})
	return page, err
}

// Counts returns what the engine holds, for Status.
func (e *Engine) Counts() map[string]uint32 {
	e.mu.Lock()
	nv, np := len(e.vols), len(e.pending)
	e.mu.Unlock()
	out := map[string]uint32{"volume": uint32(nv), "pending-snapshot": uint32(np)}
	_ = e.db.View(func(tx *store.Tx) error {
		s, _ := catalog.Snapshots(tx)
		out["snapshot"] = uint32(len(s))
		return nil
	})
	return out
}

// Exports returns how many exports are served.
func (e *Engine) Exports() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.vols)
}

// Healthy reports whether the catalog answers.
func (e *Engine) Healthy() bool { return e.db.View(func(*store.Tx) error { return nil }) == nil }
