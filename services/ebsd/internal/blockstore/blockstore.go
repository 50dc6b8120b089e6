// Package blockstore keeps snapshot blocks as immutable files named by the
// SHA-256 of their content (blocks/ab/abcdef…), so equal blocks are stored
// once, whichever snapshot or volume they came from.
//
// It owns the files only. Whether a block is still wanted is the catalog's
// reference count plus the pins of snapshots still being written; Free
// removes a file only when both say nobody wants it, under one lock, so a
// block being written again is never removed under its writer.
package blockstore

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sync"
)

// Store is a directory of blocks.
type Store struct {
	dir  string
	mu   sync.Mutex
	pins map[string]int
}

// Open opens (creating) the store at dir.
func Open(dir string) (*Store, error) {
	if err := os.MkdirAll(filepath.Join(dir, "tmp"), 0o750); err != nil {
		return nil, fmt.Errorf("creating block store %s: %w", dir, err)
	}
	// Leftovers of writes a crash interrupted.
	if ents, err := os.ReadDir(filepath.Join(dir, "tmp")); err == nil {
		for _, e := range ents {
			_ = os.Remove(filepath.Join(dir, "tmp", e.Name()))
		}
	}
	return &Store{dir: dir, pins: map[string]int{}}, nil
}

// Sum returns the hex SHA-256 of data.
func Sum(data []byte) string {
	s := sha256.Sum256(data)
	return hex.EncodeToString(s[:])
}

// ValidHash reports whether h looks like a hex SHA-256.
func ValidHash(h string) bool {
	if len(h) != 64 {
		return false
	}
	_, err := hex.DecodeString(h)
	return err == nil
}

// Path is where the block with hash h lives.
func (s *Store) Path(h string) string { return filepath.Join(s.dir, h[:2], h) }

// Pin keeps h from being freed until Unpin; pending snapshots pin the
// blocks they have written but not yet committed.
func (s *Store) Pin(h string) {
	s.mu.Lock()
	s.pins[h]++
	s.mu.Unlock()
}

// Unpin releases a Pin.
func (s *Store) Unpin(h string) {
	s.mu.Lock()
	if s.pins[h]--; s.pins[h] <= 0 {
		delete(s.pins, h)
	}
	s.mu.Unlock()
}

// Has reports whether the block file exists.
func (s *Store) Has(h string) bool {
	_, err := os.Stat(s.Path(h))
	return err == nil
}

// Put stores data under its hash h (the caller has computed and checked
// it) durably: written to a temporary file, fsynced, renamed into place and
// the directory fsynced. It reports whether the block was new. The caller
// must hold a Pin on h.
func (s *Store) Put(h string, data []byte) (bool, error) { return s.put(h, data, true) }

// PutNoDirSync is Put without the directory fsync, for a caller that
// fsyncs a file on the same filesystem afterwards before acknowledging:
// ext4 and XFS commit metadata in order, so that later fsync makes the
// rename durable too.
func (s *Store) PutNoDirSync(h string, data []byte) (bool, error) { return s.put(h, data, false) }

func (s *Store) put(h string, data []byte, dirSync bool) (bool, error) {
	final := s.Path(h)
	if _, err := os.Stat(final); err == nil {
		return false, nil
	}
	dir := filepath.Dir(final)
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return false, fmt.Errorf("creating %s: %w", dir, err)
	}
	var rnd [8]byte
	_, _ = rand.Read(rnd[:])
	tmp := filepath.Join(s.dir, "tmp", h[:16]+"-"+hex.EncodeToString(rnd[:]))
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o640)
	if err != nil {
		return false, fmt.Errorf("creating block %s: %w", h, err)
	}
	_, werr := f.Write(data)
	if werr == nil {
		werr = f.Sync()
	}
	if cerr := f.Close(); werr == nil {
		werr = cerr
	}
	if werr == nil {
		werr = os.Rename(tmp, final)
	}
	if werr != nil {
		_ = os.Remove(tmp)
		return false, fmt.Errorf("writing block %s: %w", h, werr)
	}
	if dirSync {
		if err := syncDir(dir); err != nil {
			return false, err
		}
	}
	return true, nil
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("opening %s: %w", dir, err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("syncing %s: %w", dir, err)
	}
	return nil
}

// Open opens a block for reading.
func (s *Store) Open(h string) (*os.File, error) {
	f, err := os.Open(s.Path(h))
	if err != nil {
		return nil, fmt.Errorf("opening block %s: %w", h, err)
	}
	return f, nil
}

// Read fills buf with the block h (zero-padding a short block).
func (s *Store) Read(h string, buf []byte) error {
	f, err := s.Open(h)
	if err != nil {
		return err
	}
	defer f.Close()
	n, err := f.ReadAt(buf, 0)
	if err != nil && !errors.Is(err, io.EOF) {
		return fmt.Errorf("reading block %s: %w", h, err)
	}
	clear(buf[n:])
	return nil
}

// Free removes the files of blocks that referenced reports unreferenced
// and that no one has pinned. It returns how many files it removed.
func (s *Store) Free(hashes []string, referenced func(h string) bool) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, h := range hashes {
		if s.pins[h] > 0 || referenced(h) {
			continue
		}
		if err := os.Remove(s.Path(h)); err == nil {
			n++
		}
	}
	return n
}

// Sweep removes every block file that is neither referenced nor pinned:
// blocks a crash left between their write and their snapshot's commit.
func (s *Store) Sweep(referenced func(h string) bool) (int, error) {
	var orphans []string
	err := filepath.WalkDir(s.dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if path != s.dir && filepath.Base(path) == "tmp" {
				return filepath.SkipDir
			}
			return nil
		}
		if h := d.Name(); ValidHash(h) {
			orphans = append(orphans, h)
		}
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("sweeping the block store: %w", err)
	}
	return s.Free(orphans, referenced), nil
}

// Usage returns the number of block files and their bytes on disk.
func (s *Store) Usage() (files int, bytes int64) {
	_ = filepath.WalkDir(s.dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return nil
		}
		if info, err := d.Info(); err == nil {
			files++
			bytes += info.Size()
		}
		return nil
	})
	return files, bytes
}
