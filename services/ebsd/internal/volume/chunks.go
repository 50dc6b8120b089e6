package volume

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// ChunkSize is how much of a volume one data file holds. ext4 caps a file
// at 16 TiB, so a 16 TiB (or 64 TiB) volume spans several sparse files.
// It is a multiple of BlockSize, so no block straddles two files.
const ChunkSize = 1 << 40

// chunks is a volume's data: sparse files data.0000, data.0001, … each
// ChunkSize long except the last.
type chunks struct {
	dir   string
	mu    sync.RWMutex // guards files (grow appends)
	files []*os.File
	dirty []atomic.Bool
}

func chunkName(dir string, i int) string { return filepath.Join(dir, fmt.Sprintf("data.%04d", i)) }

func nChunks(size uint64) int { return int((size + ChunkSize - 1) / ChunkSize) }

// createChunks makes the data files of a new volume.
func createChunks(dir string, size uint64) error {
	for i := 0; i < nChunks(size); i++ {
		f, err := os.OpenFile(chunkName(dir, i), os.O_CREATE|os.O_RDWR, 0o640)
		if err != nil {
			return fmt.Errorf("creating data file: %w", err)
		}
		err = f.Truncate(int64(min(ChunkSize, size-uint64(i)*ChunkSize)))
		if err == nil {
			err = f.Sync()
		}
		f.Close()
		if err != nil {
			return fmt.Errorf("sizing data file %d: %w", i, err)
		}
	}
	return nil
}

func openChunks(dir string, size uint64) (*chunks, error) {
	c := &chunks{dir: dir}
	if err := c.grow(size); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// grow opens (creating where missing) and sizes the files for size bytes.
func (c *chunks) grow(size uint64) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := nChunks(size)
	for i := 0; i < n; i++ {
		want := int64(min(ChunkSize, size-uint64(i)*ChunkSize))
		if i >= len(c.files) {
			f, err := os.OpenFile(chunkName(c.dir, i), os.O_CREATE|os.O_RDWR, 0o640)
			if err != nil {
				return fmt.Errorf("opening data file %d: %w", i, err)
			}
			c.files = append(c.files, f)
		}
		st, err := c.files[i].Stat()
		if err != nil {
			return err
		}
		if st.Size() < want {
			if err := c.files[i].Truncate(want); err != nil {
				return fmt.Errorf("growing data file %d: %w", i, err)
			}
		}
	}
	dirty := make([]atomic.Bool, len(c.files))
	for i := range c.dirty {
		dirty[i].Store(c.dirty[i].Load())
	}
	c.dirty = dirty
	return nil
}

func (c *chunks) at(off uint64) (*os.File, int64, int) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	i := int(off / ChunkSize)
	return c.files[i], int64(off % ChunkSize), i
}

// ReadAt reads within one chunk (callers never cross a block).
func (c *chunks) ReadAt(p []byte, off uint64) (int, error) {
	f, o, _ := c.at(off)
	n, err := f.ReadAt(p, o)
	if errors.Is(err, io.EOF) {
		err = nil
	}
	return n, err
}

// WriteAt writes within one chunk.
func (c *chunks) WriteAt(p []byte, off uint64) (int, error) {
	f, o, i := c.at(off)
	c.dirty[i].Store(true)
	return f.WriteAt(p, o)
}

// PunchHole frees a range within one chunk; it then reads as zeros.
func (c *chunks) PunchHole(off, n uint64) error {
	f, o, i := c.at(off)
	c.dirty[i].Store(true)
	return unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, o, int64(n))
}

// Sync fdatasyncs every chunk written since the last Sync.
func (c *chunks) Sync() error {
	c.mu.RLock()
	defer c.mu.RUnlock()
	for i, f := range c.files {
		if !c.dirty[i].Swap(false) {
			continue
		}
		if err := unix.Fdatasync(int(f.Fd())); err != nil {
			c.dirty[i].Store(true)
			return err
		}
	}
	return nil
}

// Close closes the files.
func (c *chunks) Close() error {
	var err error
	for _, f := range c.files {
		if e := f.Close(); e != nil && err == nil {
			err = e
		}
	}
	return err
}
