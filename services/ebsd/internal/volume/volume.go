// Package volume is one volume's data path: a sparse data file, a bitmap of
// blocks the data file holds (written, or hydrated from the snapshot the
// volume was made from), and a bitmap of blocks changed since the volume's
// last snapshot. Reads of blocks the data file does not hold come from the
// base snapshot (and hydrate the block); writes to such blocks hydrate the
// block first. While a snapshot is being captured, a write to a block not
// yet captured first hands the old block to the capture (copy-on-write).
//
// Durability: Flush fsyncs the data file before it writes the bitmap pages
// it took before the fsync, so a bit on disk always covers data on disk.
// Bits only go from 0 to 1 between snapshots, so a torn bitmap page can
// only lose bits whose data was never flushed. The changed bitmap is reset
// only at a snapshot's completion, by an atomic file replacement.
//
// It knows nothing about snapshots beyond reading base blocks through a
// Source and handing captured blocks to a Capture.
package volume

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"hangar.dev/hangar/services/ebsd/internal/bitmap"
)

// BlockSize is the unit of hydration, change tracking and snapshots.
const BlockSize = 512 << 10

// Source reads blocks of the snapshot a volume was made from.
type Source interface {
	// ReadBlock fills buf (BlockSize) with block index; zeros when the
	// snapshot holds no such block.
	ReadBlock(index uint64, buf []byte) error
}

// Capture receives blocks of a snapshot being taken.
type Capture func(index uint64, data []byte) error

// ErrOutOfRange is an access past the end of the volume.
var ErrOutOfRange = errors.New("access past the end of the volume")

const stripes = 256

// Volume is an open volume.
type Volume struct {
	dir  string
	data *chunks
	base Source

	size    atomic.Uint64
	resize  sync.RWMutex // I/O holds it shared; Grow and capture start exclusively
	stripes [stripes]sync.Mutex
	flushMu sync.Mutex

	present     *bitmap.Bitmap
	presentFile *os.File
	changed     *bitmap.Bitmap
	changedFile *os.File

	// While a snapshot is captured: the blocks still to capture, where
	// they go, and the writes since its start (the next changed set).
	cow        atomic.Pointer[cowState]
	sinceStart atomic.Pointer[bitmap.Bitmap]
}

type cowState struct {
	pending *bitmap.Bitmap
	capture Capture
	total   uint64
	done    atomic.Uint64
}

var bufPool = sync.Pool{New: func() any { b := make([]byte, BlockSize); return &b }}

func getBuf() *[]byte  { return bufPool.Get().(*[]byte) }
func putBuf(b *[]byte) { bufPool.Put(b) }

// Blocks returns the number of blocks a size needs.
func Blocks(size uint64) uint64 { return (size + BlockSize - 1) / BlockSize }

// Create makes a new volume in dir (which must not hold one).
func Create(dir string, size uint64) error {
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return fmt.Errorf("creating %s: %w", dir, err)
	}
	if err := createChunks(dir, size); err != nil {
		return err
	}
	for _, name := range []string{"present.bitmap", "changed.bitmap"} {
		if err := writeBitmapFile(filepath.Join(dir, name), bitmap.New(Blocks(size))); err != nil {
			return err
		}
	}
	return syncDir(dir)
}

// writeBitmapFile replaces a bitmap file atomically, its space allocated.
func writeBitmapFile(path string, b *bitmap.Bitmap) error {
	tmp := path + ".tmp"
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o640)
	if err != nil {
		return fmt.Errorf("creating %s: %w", tmp, err)
	}
	raw := b.Encode()
	// Allocate for real: in-place page writes later must never hit ENOSPC.
	werr := unix.Fallocate(int(f.Fd()), 0, 0, int64(len(raw)))
	if werr == nil {
		_, werr = f.WriteAt(raw, 0)
	}
	if werr == nil {
		werr = f.Sync()
	}
	if cerr := f.Close(); werr == nil {
		werr = cerr
	}
	if werr == nil {
		werr = os.Rename(tmp, path)
	}
	if werr != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("writing %s: %w", path, werr)
	}
	return syncDir(filepath.Dir(path))
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("syncing %s: %w", dir, err)
	}
	return nil
}

func openBitmap(path string, n uint64) (*bitmap.Bitmap, *os.File, error) {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("opening %s: %w", path, err)
	}
	b := bitmap.New(n)
	raw := make([]byte, b.Bytes())
	if _, err := f.ReadAt(raw, 0); err != nil && !errors.Is(err, io.EOF) {
		f.Close()
		return nil, nil, fmt.Errorf("reading %s: %w", path, err)
	}
	b.Load(raw)
	return b, f, nil
}

// Open opens the volume in dir of the given size; base is nil for a
// volume not made from a snapshot.
func Open(dir string, size uint64, base Source) (*Volume, error) {
	// openChunks also completes a grow that crashed between the record
	// and the files.
	data, err := openChunks(dir, size)
	if err != nil {
		return nil, err
	}
	v := &Volume{dir: dir, data: data, base: base}
	v.size.Store(size)
	n := Blocks(size)
	if v.present, v.presentFile, err = openBitmap(filepath.Join(dir, "present.bitmap"), n); err != nil {
		data.Close()
		return nil, err
	}
	if v.changed, v.changedFile, err = openBitmap(filepath.Join(dir, "changed.bitmap"), n); err != nil {
		data.Close()
		v.presentFile.Close()
		return nil, err
	}
	if int64(len(v.present.Encode())) > fileSize(v.presentFile) || int64(len(v.changed.Encode())) > fileSize(v.changedFile) {
		if err := v.growBitmapFiles(); err != nil {
			v.Close()
			return nil, err
		}
	}
	return v, nil
}

func fileSize(f *os.File) int64 {
	st, err := f.Stat()
	if err != nil {
		return 0
	}
	return st.Size()
}

// Close closes the files; it does not flush.
func (v *Volume) Close() error {
	err := v.data.Close()
	v.presentFile.Close()
	v.changedFile.Close()
	return err
}

// Size returns the volume's size in bytes.
func (v *Volume) Size() uint64 { return v.size.Load() }

// PresentBytes returns the bytes of blocks the data file holds.
func (v *Volume) PresentBytes() uint64 { return v.present.Count() * BlockSize }

// Hydrated reports whether every block is in the data file.
func (v *Volume) Hydrated() bool { return v.present.Count() == Blocks(v.Size()) }

func (v *Volume) check(off, n uint64) error {
	if off+n < off || off+n > v.size.Load() {
		return fmt.Errorf("%w: %d bytes at %d of %d", ErrOutOfRange, n, off, v.size.Load())
	}
	return nil
}

// readBlock fills buf with block i's current content. The caller holds
// the block's stripe or knows the block is not being written.
func (v *Volume) readBlock(i uint64, buf []byte) error {
	if v.present.Test(i) || v.base == nil {
		n, err := v.data.ReadAt(buf, i*BlockSize)
		if err != nil {
			return fmt.Errorf("reading block %d: %w", i, err)
		}
		clear(buf[n:])
		return nil
	}
	return v.base.ReadBlock(i, buf)
}

// ReadAt reads len(p) bytes at off.
func (v *Volume) ReadAt(p []byte, off uint64) error {
	v.resize.RLock()
	defer v.resize.RUnlock()
	if err := v.check(off, uint64(len(p))); err != nil {
		return err
	}
	for len(p) > 0 {
		i := off / BlockSize
		in := off % BlockSize
		n := min(uint64(len(p)), BlockSize-in)
		if v.present.Test(i) || v.base == nil {
			if _, err := v.data.ReadAt(p[:n], off); err != nil {
				return fmt.Errorf("reading %d bytes at %d: %w", n, off, err)
			}
		} else if err := v.hydrateRead(i, p[:n], in); err != nil {
			return err
		}
		p = p[n:]
		off += n
	}
	return nil
}

// hydrateRead reads part of a block that only the base snapshot holds and
// copies the block into the data file, as EBS hydrates on first access. A
// failed copy (a full disk) still answers the read from the snapshot.
func (v *Volume) hydrateRead(i uint64, p []byte, in uint64) error {
	mu := &v.stripes[i%stripes]
	mu.Lock()
	defer mu.Unlock()
	if v.present.Test(i) {
		_, err := v.data.ReadAt(p, i*BlockSize+in)
		if err != nil {
			return fmt.Errorf("reading block %d: %w", i, err)
		}
		return nil
	}
	bp := getBuf()
	defer putBuf(bp)
	buf := (*bp)[:v.blockLen(i)]
	if err := v.base.ReadBlock(i, buf); err != nil {
		return fmt.Errorf("reading block %d from the snapshot: %w", i, err)
	}
	copy(p, buf[in:])
	if _, err := v.data.WriteAt(buf, i*BlockSize); err == nil {
		v.present.Set(i)
	}
	return nil
}

// blockLen is BlockSize except for a last, short block.
func (v *Volume) blockLen(i uint64) uint64 {
	size := v.size.Load()
	if (i+1)*BlockSize > size {
		return size - i*BlockSize
	}
	return BlockSize
}

// prepare readies block i for a change: captures it for a pending snapshot
// and hydrates it when the change does not cover it. The caller holds the
// block's stripe.
func (v *Volume) prepare(i uint64, whole bool) error {
	if c := v.cow.Load(); c != nil && c.pending.Test(i) {
		if err := v.captureOne(c, i); err != nil {
			return err
		}
	}
	if whole || v.base == nil || v.present.Test(i) {
		return nil
	}
	bp := getBuf()
	defer putBuf(bp)
	buf := (*bp)[:v.blockLen(i)]
	if err := v.base.ReadBlock(i, buf); err != nil {
		return fmt.Errorf("hydrating block %d: %w", i, err)
	}
	if _, err := v.data.WriteAt(buf, i*BlockSize); err != nil {
		return fmt.Errorf("hydrating block %d: %w", i, err)
	}
	v.present.Set(i)
	return nil
}

// marked records a change of block i.
func (v *Volume) marked(i uint64) {
	v.present.Set(i)
	v.changed.Set(i)
	if s := v.sinceStart.Load(); s != nil {
		s.Set(i)
	}
}

// WriteAt writes p at off.
func (v *Volume) WriteAt(p []byte, off uint64) error {
	v.resize.RLock()
	defer v.resize.RUnlock()
	if err := v.check(off, uint64(len(p))); err != nil {
		return err
	}
	for len(p) > 0 {
		i := off / BlockSize
		in := off % BlockSize
		n := min(uint64(len(p)), BlockSize-in)
		mu := &v.stripes[i%stripes]
		mu.Lock()
		err := v.prepare(i, in == 0 && n == v.blockLen(i))
		if err == nil {
			_, err = v.data.WriteAt(p[:n], off)
			if err != nil {
				err = fmt.Errorf("writing %d bytes at %d: %w", n, off, err)
			}
		}
		if err == nil {
			v.marked(i)
		}
		mu.Unlock()
		if err != nil {
			return err
		}
		p = p[n:]
		off += n
	}
	return nil
}

var zeroBlock = make([]byte, BlockSize)

// Zero makes n bytes at off read as zeros, punching holes for whole blocks.
func (v *Volume) Zero(off, n uint64) error {
	v.resize.RLock()
	defer v.resize.RUnlock()
	if err := v.check(off, n); err != nil {
		return err
	}
	for n > 0 {
		i := off / BlockSize
		in := off % BlockSize
		k := min(n, BlockSize-in)
		whole := in == 0 && k == v.blockLen(i)
		mu := &v.stripes[i%stripes]
		mu.Lock()
		err := v.prepare(i, whole)
		if err == nil {
			if whole {
				err = v.data.PunchHole(off, k)
			} else {
				_, err = v.data.WriteAt(zeroBlock[:k], off)
			}
			if err != nil {
				err = fmt.Errorf("zeroing %d bytes at %d: %w", k, off, err)
			}
		}
		if err == nil {
			v.marked(i)
		}
		mu.Unlock()
		if err != nil {
			return err
		}
		n -= k
		off += k
	}
	return nil
}

// Flush makes every completed write durable: data first, then the bitmap
// pages taken before the data was synced.
func (v *Volume) Flush() error {
	v.flushMu.Lock()
	defer v.flushMu.Unlock()
	pp := v.present.TakeDirty()
	cp := v.changed.TakeDirty()
	fail := func(err error) error {
		v.present.MarkDirty(pp)
		v.changed.MarkDirty(cp)
		return err
	}
	if err := v.data.Sync(); err != nil {
		return fail(fmt.Errorf("syncing volume data: %w", err))
	}
	if len(pp) == 0 && len(cp) == 0 {
		return nil
	}
	v.resize.RLock() // the bitmap files are replaced under the write lock
	defer v.resize.RUnlock()
	for _, b := range []struct {
		f     *os.File
		pages []bitmap.Page
	}{{v.presentFile, pp}, {v.changedFile, cp}} {
		if len(b.pages) == 0 {
			continue
		}
		for _, p := range b.pages {
			if _, err := b.f.WriteAt(p.Data, int64(p.Index)*bitmap.PageBytes); err != nil {
				return fail(fmt.Errorf("writing the block bitmap: %w", err))
			}
		}
		if err := unix.Fdatasync(int(b.f.Fd())); err != nil {
			return fail(fmt.Errorf("syncing the block bitmap: %w", err))
		}
	}
	return nil
}

// Grow extends the volume to size bytes.
func (v *Volume) Grow(size uint64) error {
	if err := v.Flush(); err != nil {
		return err
	}
	v.flushMu.Lock()
	defer v.flushMu.Unlock()
	v.resize.Lock()
	defer v.resize.Unlock()
	if size <= v.size.Load() {
		return nil
	}
	if err := v.data.grow(size); err != nil {
		return err
	}
	v.present.Grow(Blocks(size))
	v.changed.Grow(Blocks(size))
	if s := v.sinceStart.Load(); s != nil {
		s.Grow(Blocks(size))
	}
	if err := v.growBitmapFiles(); err != nil {
		return err
	}
	v.size.Store(size)
	return nil
}

func (v *Volume) growBitmapFiles() error {
	for _, b := range []struct {
		bm   *bitmap.Bitmap
		f    **os.File
		name string
	}{{v.present, &v.presentFile, "present.bitmap"}, {v.changed, &v.changedFile, "changed.bitmap"}} {
		path := filepath.Join(v.dir, b.name)
		if err := writeBitmapFile(path, b.bm); err != nil {
			return err
		}
		f, err := os.OpenFile(path, os.O_RDWR, 0)
		if err != nil {
			return err
		}
		(*b.f).Close()
		*b.f = f
	}
	return nil
}

// ChangedCount returns how many blocks changed since the last snapshot.
func (v *Volume) ChangedCount() uint64 { return v.changed.Count() }

// StartCapture begins a point-in-time capture of the blocks changed since
// the last snapshot: from now on a write to one of them first hands its old
// content to capture. It returns how many blocks are to be captured.
func (v *Volume) StartCapture(capture Capture) (uint64, error) {
	if err := v.Flush(); err != nil {
		return 0, err
	}
	v.resize.Lock()
	defer v.resize.Unlock()
	if v.cow.Load() != nil {
		return 0, errors.New("a snapshot of this volume is already being taken")
	}
	set := v.changed.Clone()
	c := &cowState{pending: set, capture: capture, total: set.Count()}
	v.sinceStart.Store(bitmap.New(v.changed.Len()))
	v.cow.Store(c)
	return c.total, nil
}

func (v *Volume) captureOne(c *cowState, i uint64) error {
	bp := getBuf()
	defer putBuf(bp)
	buf := (*bp)[:v.blockLen(i)]
	if err := v.readBlock(i, buf); err != nil {
		return err
	}
	if err := c.capture(i, buf); err != nil {
		return fmt.Errorf("capturing block %d for the snapshot: %w", i, err)
	}
	c.pending.Clear(i)
	c.done.Add(1)
	return nil
}

// RunCapture captures every block still pending, calling progress now and
// then with (done, total). It returns when all are captured or on error.
func (v *Volume) RunCapture(ctx context.Context, progress func(done, total uint64)) error {
	c := v.cow.Load()
	if c == nil {
		return errors.New("no capture started")
	}
	for i, ok := c.pending.Next(0); ok; i, ok = c.pending.Next(i + 1) {
		if err := ctx.Err(); err != nil {
			return err
		}
		v.resize.RLock()
		mu := &v.stripes[i%stripes]
		mu.Lock()
		var err error
		if c.pending.Test(i) {
			err = v.captureOne(c, i)
		}
		mu.Unlock()
		v.resize.RUnlock()
		if err != nil {
			return err
		}
		if d := c.done.Load(); progress != nil && (d%256 == 0 || d == c.total) {
			progress(d, c.total)
		}
	}
	if progress != nil {
		progress(c.total, c.total)
	}
	return nil
}

// EndCapture ends a capture. On success the changed set becomes the
// writes made since the capture started, written atomically; on failure
// the changed set keeps everything, so the next snapshot misses nothing.
func (v *Volume) EndCapture(ok bool) error {
	if err := v.Flush(); err != nil && ok {
		return err
	}
	v.flushMu.Lock()
	defer v.flushMu.Unlock()
	v.resize.Lock()
	defer v.resize.Unlock()
	since := v.sinceStart.Load()
	v.cow.Store(nil)
	v.sinceStart.Store(nil)
	if !ok || since == nil {
		return nil
	}
	if err := writeBitmapFile(filepath.Join(v.dir, "changed.bitmap"), since); err != nil {
		return err
	}
	f, err := os.OpenFile(filepath.Join(v.dir, "changed.bitmap"), os.O_RDWR, 0)
	if err != nil {
		return err
	}
	v.changedFile.Close()
	v.changedFile = f
	v.changed = since
	return nil
}

// Capturing reports the progress of a capture in percent, or -1.
func (v *Volume) Capturing() int {
	c := v.cow.Load()
	if c == nil {
		return -1
	}
	if c.total == 0 {
		return 100
	}
	return int(c.done.Load() * 100 / c.total)
}
