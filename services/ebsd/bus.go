package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"

	"github.com/godbus/dbus/v5"
	"github.com/godbus/dbus/v5/introspect"
	"github.com/godbus/dbus/v5/prop"
	"golang.org/x/sys/unix"

	"hangar.dev/hangar/services/ebsd/internal/engine"
	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/internal/busutil"
	"hangar.dev/hangar/services/internal/version"
)

// busObject is dev.hangar.Storage1: the root object with the methods, and
// one object per volume and per snapshot whose properties show its state.
type busObject struct {
	bus     *busutil.Server
	eng     *engine.Engine
	log     *slog.Logger
	started time.Time

	mu    sync.Mutex
	last  map[dbus.ObjectPath]map[string]any // property values last set
	ready bool
}

func newBusObject(bus *busutil.Server, eng *engine.Engine, log *slog.Logger) *busObject {
	return &busObject{bus: bus, eng: eng, log: log, started: time.Now(), last: map[dbus.ObjectPath]map[string]any{}}
}

// asDBus turns an engine error into a named D-Bus error.
func asDBus(err error) *dbus.Error {
	if err == nil {
		return nil
	}
	if e, ok := api.AsError(err); ok {
		return dbus.NewError(e.Name, []any{e.Message})
	}
	return api.Errorf(api.ErrFailed, "%v", err)
}

func (b *busObject) status() api.ServiceStatus {
	return api.ServiceStatus{
		State:   "running",
		Detail:  fmt.Sprintf("serving %d NBD exports", b.eng.Exports()),
		Version: version.String(),
		Started: b.started.Unix(),
		Counts:  b.eng.Counts(),
	}
}

func (b *busObject) methods() map[string]any {
	e := b.eng
	return map[string]any{
		api.MethodStatus: func() (api.ServiceStatus, *dbus.Error) { return b.status(), nil },
		api.MethodCreateVolume: func(id string, size uint64, from string) (api.VolumeInfo, *dbus.Error) {
			v, err := e.CreateVolume(id, size, from)
			return v, asDBus(err)
		},
		api.MethodDeleteVolume: func(id string) *dbus.Error { return asDBus(e.DeleteVolume(id)) },
		api.MethodResizeVolume: func(id string, size uint64) (api.VolumeInfo, *dbus.Error) {
			v, err := e.ResizeVolume(id, size)
			return v, asDBus(err)
		},
		api.MethodGetVolume: func(id string) (api.VolumeInfo, *dbus.Error) {
			v, err := e.GetVolume(id)
			return v, asDBus(err)
		},
		api.MethodListVolumes: func() ([]api.VolumeInfo, *dbus.Error) { return e.ListVolumes(), nil },
		api.MethodAttachVolume: func(id, instance, device string) (api.VolumeInfo, *dbus.Error) {
			v, err := e.AttachVolume(id, instance, device)
			return v, asDBus(err)
		},
		api.MethodDetachVolume: func(id, instance string) (api.VolumeInfo, *dbus.Error) {
			v, err := e.DetachVolume(id, instance)
			return v, asDBus(err)
		},
		api.MethodCreateSnapshot: func(snap, vol string) (api.SnapshotInfo, *dbus.Error) {
			s, err := e.CreateSnapshot(snap, vol)
			return s, asDBus(err)
		},
		api.MethodDeleteSnapshot: func(snap string) *dbus.Error { return asDBus(e.DeleteSnapshot(snap)) },
		api.MethodGetSnapshot: func(snap string) (api.SnapshotInfo, *dbus.Error) {
			s, err := e.GetSnapshot(snap)
			return s, asDBus(err)
		},
		api.MethodListSnapshots: func() ([]api.SnapshotInfo, *dbus.Error) {
			s, err := e.ListSnapshots()
			return s, asDBus(err)
		},
		api.MethodStartSnapshot: func(a api.StartSnapshotArgs) (api.SnapshotInfo, *dbus.Error) {
			s, err := e.StartSnapshot(a)
			return s, asDBus(err)
		},
		api.MethodPutBlock: func(snap string, index uint64, length uint32, checksum string, fd dbus.UnixFD) *dbus.Error {
			f := os.NewFile(uintptr(fd), "block")
			defer f.Close()
			if length > api.SnapshotBlockSize {
				return api.Errorf(api.ErrInvalidArgument, "a block must be %d bytes, not %d", api.SnapshotBlockSize, length)
			}
			buf, release, err := blockFrom(f, int(length))
			if err != nil {
				return api.Errorf(api.ErrInvalidArgument, "%v", err)
			}
			defer release()
			return asDBus(e.PutBlock(snap, index, buf, checksum))
		},
		api.MethodCompleteSnapshot: func(a api.CompleteSnapshotArgs) (api.SnapshotInfo, *dbus.Error) {
			s, err := e.CompleteSnapshot(a)
			return s, asDBus(err)
		},
		api.MethodGetBlock: func(snap string, index uint64, token string, fd dbus.UnixFD) (uint32, string, *dbus.Error) {
			f := os.NewFile(uintptr(fd), "block")
			defer f.Close()
			n, sum, err := e.GetBlock(snap, index, token, f)
			return n, sum, asDBus(err)
		},
		api.MethodListBlocks: func(snap string, start uint64, max uint32) (api.BlockPage, *dbus.Error) {
			p, err := e.ListBlocks(snap, start, max)
			return p, asDBus(err)
		},
		api.MethodListChangedBlocks: func(first, second string, start uint64, max uint32) (api.ChangedBlockPage, *dbus.Error) {
			p, err := e.ListChangedBlocks(first, second, start, max)
			return p, asDBus(err)
		},
	}
}

// export exports the root object and every volume and snapshot object,
// then claims the name.
func (b *busObject) export() error {
	root := &busutil.Object{
		Path:      api.Storage.Path,
		Interface: api.Storage.Interface,
		Methods:   b.methods(),
		Props: map[string]*prop.Prop{
			api.PropVersion: {Value: version.String(), Emit: prop.EmitConst},
			api.PropStarted: {Value: b.started.Unix(), Emit: prop.EmitConst},
			api.PropState:   {Value: "running", Emit: prop.EmitTrue},
			"Exports":       {Value: uint32(b.eng.Exports()), Emit: prop.EmitTrue},
		},
		Signals: []introspect.Signal{
			{Name: api.SignalVolumeStateChanged, Args: []introspect.Arg{{Name: "volume", Type: "s"}, {Name: "state", Type: "s"}}},
			{Name: api.SignalSnapshotProgress, Args: []introspect.Arg{{Name: "snapshot", Type: "s"}, {Name: "state", Type: "s"}, {Name: "progress", Type: "u"}}},
		},
	}
	if err := b.bus.Export(root); err != nil {
		return err
	}
	for _, v := range b.eng.ListVolumes() {
		b.volumeChanged(v, true)
	}
	snaps, err := b.eng.ListSnapshots()
	if err != nil {
		return err
	}
	for _, s := range snaps {
		b.snapshotChanged(s, true)
	}
	b.eng.SetHooks(engine.Hooks{VolumeChanged: b.volumeChanged, SnapshotChanged: b.snapshotChanged})
	b.mu.Lock()
	b.ready = true
	b.mu.Unlock()
	return b.bus.ClaimName(api.Storage.Name)
}

func volumeProps(v api.VolumeInfo) map[string]any {
	return map[string]any{
		"VolumeId": v.VolumeID, "SizeBytes": v.SizeBytes, "State": v.State, "FromSnapshot": v.FromSnapshot,
		"ExportSocket": v.ExportSocket, "AttachedTo": v.AttachedTo, "Device": v.Device, "WrittenBytes": v.WrittenBytes,
	}
}

func snapshotProps(s api.SnapshotInfo) map[string]any {
	return map[string]any{
		"SnapshotId": s.SnapshotID, "VolumeId": s.VolumeID, "ParentId": s.ParentID, "State": s.State,
		"Progress": s.Progress, "VolumeSizeBytes": s.VolumeSizeBytes, "BlockCount": s.BlockCount,
		"ChangedBlocks": s.ChangedBlocks, "StoredBytes": s.StoredBytes, "Error": s.Error,
	}
}

// sync exports, updates or removes one object's properties.
func (b *busObject) sync(path dbus.ObjectPath, iface string, props map[string]any, alive bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	last, exported := b.last[path]
	if !alive {
		if exported {
			b.bus.Unexport(path)
			delete(b.last, path)
		}
		return
	}
	if !exported {
		ps := map[string]*prop.Prop{}
		for k, v := range props {
			ps[k] = &prop.Prop{Value: v, Emit: prop.EmitTrue}
		}
		if err := b.bus.Export(&busutil.Object{Path: path, Interface: iface, Methods: map[string]any{}, Props: ps}); err != nil {
			b.log.Error("exporting object", "path", path, "err", err)
			return
		}
		b.last[path] = props
		return
	}
	for k, v := range props {
		if last[k] != v {
			if err := b.bus.Set(path, k, v); err != nil {
				b.log.Warn("updating property", "path", path, "prop", k, "err", err)
			}
		}
	}
	b.last[path] = props
}

func (b *busObject) volumeChanged(v api.VolumeInfo, alive bool) {
	b.sync(api.VolumePath(v.VolumeID), api.StorageVolumeInterface, volumeProps(v), alive)
	state := v.State
	if !alive {
		state = "deleted"
	}
	b.emit(api.SignalVolumeStateChanged, v.VolumeID, state)
}

func (b *busObject) snapshotChanged(s api.SnapshotInfo, alive bool) {
	b.sync(api.SnapshotPath(s.SnapshotID), api.StorageSnapshotInterface, snapshotProps(s), alive)
	state := s.State
	if !alive {
		state = "deleted"
	}
	b.emit(api.SignalSnapshotProgress, s.SnapshotID, state, s.Progress)
}

func (b *busObject) emit(name string, args ...any) {
	b.mu.Lock()
	ready := b.ready
	b.mu.Unlock()
	if !ready {
		return
	}
	if err := b.bus.Emit(api.Storage.Path, api.Storage.Interface, name, args...); err != nil {
		b.log.Warn("emitting signal", "signal", name, "err", err)
	}
}

// refresh keeps WrittenBytes and the export count current.
func (b *busObject) refresh(ctx context.Context) {
	t := time.NewTicker(2 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		for _, v := range b.eng.ListVolumes() {
			b.sync(api.VolumePath(v.VolumeID), api.StorageVolumeInterface, volumeProps(v), true)
		}
		_ = b.bus.Set(api.Storage.Path, "Exports", uint32(b.eng.Exports()))
	}
}

var blockPool = sync.Pool{New: func() any { b := make([]byte, api.SnapshotBlockSize); return &b }}

// blockFrom returns the n bytes a PutBlock descriptor holds. A memfd sealed
// against writes and shrinking is mapped and used in place (its content
// cannot change under the hash, and the mapping is page-aligned, so the
// block store writes it to disk straight from the caller's pages); any
// other descriptor is copied into a pooled buffer first.
func blockFrom(f *os.File, n int) ([]byte, func(), error) {
	fd := int(f.Fd())
	const sealed = unix.F_SEAL_WRITE | unix.F_SEAL_SHRINK
	if seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0); err == nil && seals&sealed == sealed && n > 0 {
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err == nil && st.Size >= int64(n) {
			if m, err := unix.Mmap(fd, 0, n, unix.PROT_READ, unix.MAP_SHARED|unix.MAP_POPULATE); err == nil {
				return m, func() { _ = unix.Munmap(m) }, nil
			}
		}
	}
	bp := blockPool.Get().(*[]byte)
	buf := (*bp)[:n]
	if k, err := f.ReadAt(buf, 0); k != n {
		blockPool.Put(bp)
		return nil, nil, fmt.Errorf("the descriptor holds %d bytes, not the %d announced: %v", k, n, err)
	}
	return buf, func() { blockPool.Put(bp) }, nil
}
