// Package catalog is ebsd's record of volumes and snapshots: each snapshot
// is a map block index → SHA-256 of a 512 KiB block, stored as a delta
// against its parent (a child holds only what changed, so listing changes
// costs O(changed)), and every map entry holds one reference on its block.
//
// It is pure bookkeeping over a transaction (the bbolt store in ebsd, a map
// in tests). It never touches block files: operations that drop the last
// reference to a block return its hash, and the caller decides, under the
// block store's lock, whether to remove the file.
package catalog

import (
	"errors"
	"fmt"
	"sort"
	"strings"

	"hangar.dev/hangar/services/internal/store"
)

// Tx is what the catalog needs of a transaction; *store.Tx has it.
type Tx interface {
	Get(kind, id string, v any) error
	Put(kind, id string, v any) error
	Delete(kind, id string) error
	Each(kind, after string, fn func(id string, decode func(v any) error) (bool, error)) error
}

// Buckets.
const (
	KindVolume   = "volume"
	KindSnapshot = "snapshot"
	KindEntry    = "snapblock" // "<snap>/<index as %016x>" → hash hex, "" for a tombstone
	KindRef      = "blockref"  // hash hex → references
)

// ErrNotFound is a snapshot or volume that is not there (or hidden).
var ErrNotFound = errors.New("not found")

// Tombstone is the entry of a block that a child snapshot holds as zero
// although an ancestor holds data for it.
const Tombstone = ""

// Snapshot is a snapshot's record.
type Snapshot struct {
	ID            string
	VolumeID      string // "" for EBS direct snapshots
	ParentID      string
	State         string
	VolumeSize    uint64
	Started       int64
	Completed     int64
	Error         string
	ChangedBlocks uint64 // entries in this snapshot's own delta
	BlockCount    uint64 // non-zero blocks in the full map
	StoredBytes   uint64 // bytes of blocks this snapshot added to the store
	// Hidden snapshots were deleted by the API but are kept while a volume
	// still reads from them (lazy hydration) or is measured against them
	// (its next incremental snapshot).
	Hidden bool
	// Direct snapshots are written with the EBS direct API.
	Direct         bool
	TimeoutMinutes uint32
}

// Volume is a volume's record.
type Volume struct {
	ID         string
	Size       uint64
	Base       string // snapshot the volume hydrates from, "" for an empty volume
	LastSnap   string // the snapshot the volume's changed-block bitmap is relative to
	AttachedTo string
	Device     string
	Created    int64
}

func entryKey(snap string, index uint64) string { return fmt.Sprintf("%s/%016x", snap, index) }

func prefixOf(snap string) string { return snap + "/" }

// GetSnapshot returns a snapshot record, hidden or not.
func GetSnapshot(tx Tx, id string) (*Snapshot, error) {
	var s Snapshot
	if err := tx.Get(KindSnapshot, id, &s); err != nil {
		if errors.Is(err, store.ErrNotFound) {
			return nil, ErrNotFound
		}
		return nil, err
	}
	return &s, nil
}

// PutSnapshot writes a snapshot record.
func PutSnapshot(tx Tx, s *Snapshot) error { return tx.Put(KindSnapshot, s.ID, s) }

// GetVolume returns a volume record.
func GetVolume(tx Tx, id string) (*Volume, error) {
	var v Volume
	if err := tx.Get(KindVolume, id, &v); err != nil {
		if errors.Is(err, store.ErrNotFound) {
			return nil, ErrNotFound
		}
		return nil, err
	}
	return &v, nil
}

// PutVolume writes a volume record.
func PutVolume(tx Tx, v *Volume) error { return tx.Put(KindVolume, v.ID, v) }

// Snapshots returns every snapshot record.
func Snapshots(tx Tx) ([]*Snapshot, error) {
	var out []*Snapshot
	err := tx.Each(KindSnapshot, "", func(_ string, decode func(any) error) (bool, error) {
		var s Snapshot
		if err := decode(&s); err != nil {
			return false, err
		}
		out = append(out, &s)
		return true, nil
	})
	return out, err
}

// Volumes returns every volume record.
func Volumes(tx Tx) ([]*Volume, error) {
	var out []*Volume
	err := tx.Each(KindVolume, "", func(_ string, decode func(any) error) (bool, error) {
		var v Volume
		if err := decode(&v); err != nil {
			return false, err
		}
		out = append(out, &v)
		return true, nil
	})
	return out, err
}

// Refs returns the references on a block.
func Refs(tx Tx, hash string) (int64, error) {
	var n int64
	if err := tx.Get(KindRef, hash, &n); err != nil {
		if errors.Is(err, store.ErrNotFound) {
			return 0, nil
		}
		return 0, err
	}
	return n, nil
}

// addRef changes a block's references by d and reports whether it dropped
// to zero.
func addRef(tx Tx, hash string, d int64) (bool, error) {
	n, err := Refs(tx, hash)
	if err != nil {
		return false, err
	}
	n += d
	if n < 0 {
		return false, fmt.Errorf("block %s would have %d references: the catalog is inconsistent", hash, n)
	}
	if n == 0 {
		return true, tx.Delete(KindRef, hash)
	}
	return false, tx.Put(KindRef, hash, n)
}

// Entry is one map entry of a snapshot's own delta.
type Entry struct {
	Index uint64
	Hash  string // Tombstone for a block that became zero
}

// eachEntry visits a snapshot's own delta from index start on, in order.
func eachEntry(tx Tx, snap string, start uint64, fn func(Entry) (bool, error)) error {
	prefix := prefixOf(snap)
	after := prefix
	if start > 0 {
		after = entryKey(snap, start-1)
	}
	return tx.Each(KindEntry, after, func(id string, decode func(any) error) (bool, error) {
		rest, ok := strings.CutPrefix(id, prefix)
		if !ok {
			return false, nil
		}
		var idx uint64
		if _, err := fmt.Sscanf(rest, "%016x", &idx); err != nil {
			return false, fmt.Errorf("malformed snapshot block key %q: %w", id, err)
		}
		var h string
		if err := decode(&h); err != nil {
			return false, err
		}
		return fn(Entry{Index: idx, Hash: h})
	})
}

// OwnEntries returns up to max entries (0: all) of a snapshot's own delta
// from start on.
func OwnEntries(tx Tx, snap string, start uint64, max int) ([]Entry, error) {
	var out []Entry
	err := eachEntry(tx, snap, start, func(e Entry) (bool, error) {
		out = append(out, e)
		return max == 0 || len(out) < max, nil
	})
	return out, err
}

func getEntry(tx Tx, snap string, index uint64) (string, bool, error) {
	var h string
	if err := tx.Get(KindEntry, entryKey(snap, index), &h); err != nil {
		if errors.Is(err, store.ErrNotFound) {
			return "", false, nil
		}
		return "", false, err
	}
	return h, true, nil
}

// Chain returns a snapshot and its ancestors, nearest first.
func Chain(tx Tx, snap string) ([]*Snapshot, error) {
	var out []*Snapshot
	seen := map[string]bool{}
	for id := snap; id != ""; {
		if seen[id] {
			return nil, fmt.Errorf("snapshot %s has a parent cycle", snap)
		}
		seen[id] = true
		s, err := GetSnapshot(tx, id)
		if err != nil {
			return nil, fmt.Errorf("snapshot %s in the lineage of %s: %w", id, snap, err)
		}
		out = append(out, s)
		id = s.ParentID
	}
	return out, nil
}

// Lookup returns the hash of block index in a snapshot's full map, or ""
// when the block is zero (absent).
func Lookup(tx Tx, snap string, index uint64) (string, error) {
	for id := snap; id != ""; {
		h, ok, err := getEntry(tx, id, index)
		if err != nil {
			return "", err
		}
		if ok {
			return h, nil
		}
		s, err := GetSnapshot(tx, id)
		if err != nil {
			return "", fmt.Errorf("walking the lineage of %s: %w", snap, err)
		}
		id = s.ParentID
	}
	return "", nil
}

// merged reads up to max entries at or after start from each of levels
// (nearest first) and resolves each index to its nearest level's entry. It
// returns the resolved entries (tombstones included) in index order, the
// index up to which the answer is complete, and whether entries past it
// may exist.
func merged(tx Tx, levels []string, start uint64, max int) ([]Entry, uint64, bool, error) {
	type hit struct {
		hash  string
		level int
	}
	res := map[uint64]hit{}
	cutoff := ^uint64(0)
	more := false
	for lvl, snap := range levels {
		es, err := OwnEntries(tx, snap, start, max)
		if err != nil {
			return nil, 0, false, err
		}
		if max > 0 && len(es) == max {
			more = true
			if last := es[len(es)-1].Index; last < cutoff {
				cutoff = last
			}
		}
		for _, e := range es {
			if h, ok := res[e.Index]; !ok || lvl < h.level {
				res[e.Index] = hit{e.Hash, lvl}
			}
		}
	}
	out := make([]Entry, 0, len(res))
	for idx, h := range res {
		if idx <= cutoff {
			out = append(out, Entry{idx, h.hash})
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Index < out[j].Index })
	return out, cutoff, more, nil
}

// Blocks lists the non-zero blocks of a snapshot's full map from start on:
// at most max of them, with next the index to continue from when more may
// follow.
func Blocks(tx Tx, snap string, start uint64, max int) (out []Entry, next uint64, more bool, err error) {
	chain, err := Chain(tx, snap)
	if err != nil {
		return nil, 0, false, err
	}
	levels := make([]string, len(chain))
	for i, s := range chain {
		levels[i] = s.ID
	}
	es, cutoff, more, err := merged(tx, levels, start, max)
	if err != nil {
		return nil, 0, false, err
	}
	for _, e := range es {
		if e.Hash == Tombstone {
			continue
		}
		if len(out) == max {
			return out, e.Index, true, nil
		}
		out = append(out, e)
	}
	if more {
		return out, cutoff + 1, true, nil
	}
	return out, 0, false, nil
}

// Changed is one block that differs between two snapshots.
type Changed struct {
	Index         uint64
	First, Second string // "" where the block is zero
}

// ErrUnrelated means two snapshots share no lineage.
var ErrUnrelated = errors.New("the snapshots are not of one lineage")

// ChangedBlocks lists blocks that differ between first (an ancestor of
// second, or "") and second, from start on, at most max. It reads only the
// deltas between the two, so it costs O(changed).
func ChangedBlocks(tx Tx, first, second string, start uint64, max int) (out []Changed, next uint64, more bool, err error) {
	chain, err := Chain(tx, second)
	if err != nil {
		return nil, 0, false, err
	}
	var levels []string
	found := first == ""
	for _, s := range chain {
		if s.ID == first {
			found = true
			break
		}
		levels = append(levels, s.ID)
	}
	if !found {
		// second may be the older one.
		fc, err := Chain(tx, first)
		if err != nil {
			return nil, 0, false, err
		}
		levels = levels[:0]
		found = false
		for _, s := range fc {
			if s.ID == second {
				found = true
				break
			}
			levels = append(levels, s.ID)
		}
		if !found {
			return nil, 0, false, ErrUnrelated
		}
	}
	es, cutoff, more, err := merged(tx, levels, start, max)
	if err != nil {
		return nil, 0, false, err
	}
	for _, e := range es {
		a, err := lookupOr(tx, first, e.Index)
		if err != nil {
			return nil, 0, false, err
		}
		b, err := Lookup(tx, second, e.Index)
		if err != nil {
			return nil, 0, false, err
		}
		if a == b {
			continue
		}
		if len(out) == max {
			return out, e.Index, true, nil
		}
		out = append(out, Changed{Index: e.Index, First: a, Second: b})
	}
	if more {
		return out, cutoff + 1, true, nil
	}
	return out, 0, false, nil
}

func lookupOr(tx Tx, snap string, index uint64) (string, error) {
	if snap == "" {
		return "", nil
	}
	return Lookup(tx, snap, index)
}

// Commit writes a pending snapshot's delta and completes it: each entry
// takes a reference on its block. entries maps index → hash (Tombstone for
// a block that became zero). It returns the hashes whose reference count
// went from zero to one (new blocks).
func Commit(tx Tx, s *Snapshot, entries map[uint64]string, blockSize uint64) (fresh []string, err error) {
	idx := make([]uint64, 0, len(entries))
	for i := range entries {
		idx = append(idx, i)
	}
	sort.Slice(idx, func(a, b int) bool { return idx[a] < idx[b] })
	parentCount := uint64(0)
	if s.ParentID != "" {
		p, err := GetSnapshot(tx, s.ParentID)
		if err != nil {
			return nil, fmt.Errorf("parent %s: %w", s.ParentID, err)
		}
		parentCount = p.BlockCount
	}
	count := int64(parentCount)
	for _, i := range idx {
		h := entries[i]
		if s.ParentID == "" && h == Tombstone {
			continue // nothing below to hide
		}
		before := ""
		if s.ParentID != "" {
			if before, err = Lookup(tx, s.ParentID, i); err != nil {
				return nil, err
			}
		}
		if before != "" {
			count--
		}
		if h != Tombstone {
			count++
			n, err := Refs(tx, h)
			if err != nil {
				return nil, err
			}
			if n == 0 {
				fresh = append(fresh, h)
			}
			if _, err := addRef(tx, h, 1); err != nil {
				return nil, err
			}
		}
		if err := tx.Put(KindEntry, entryKey(s.ID, i), h); err != nil {
			return nil, err
		}
		s.ChangedBlocks++
	}
	s.BlockCount = uint64(count)
	s.StoredBytes = uint64(len(fresh)) * blockSize
	return fresh, PutSnapshot(tx, s)
}

// Dependent names a volume that keeps a snapshot's blocks alive, or "".
func Dependent(tx Tx, snap string) (string, error) {
	vols, err := Volumes(tx)
	if err != nil {
		return "", err
	}
	for _, v := range vols {
		if v.Base == snap || v.LastSnap == snap {
			return v.ID, nil
		}
	}
	return "", nil
}

// Delete removes a snapshot. While a volume still depends on it the
// snapshot is only hidden; otherwise its children inherit the entries they
// do not override (so their full maps stay the same), its entries are
// dropped, and the hashes of blocks that lost their last reference are
// returned. Hidden snapshots that lose their last dependent are purged by
// Purge.
func Delete(tx Tx, snap string) (freed []string, err error) {
	s, err := GetSnapshot(tx, snap)
	if err != nil {
		return nil, err
	}
	dep, err := Dependent(tx, snap)
	if err != nil {
		return nil, err
	}
	if dep != "" {
		s.Hidden = true
		return nil, PutSnapshot(tx, s)
	}
	return purge(tx, s)
}

func purge(tx Tx, s *Snapshot) (freed []string, err error) {
	all, err := Snapshots(tx)
	if err != nil {
		return nil, err
	}
	own, err := OwnEntries(tx, s.ID, 0, 0)
	if err != nil {
		return nil, err
	}
	for _, c := range all {
		if c.ParentID != s.ID {
			continue
		}
		for _, e := range own {
			if _, ok, err := getEntry(tx, c.ID, e.Index); err != nil {
				return nil, err
			} else if ok {
				continue
			}
			if s.ParentID == "" && e.Hash == Tombstone {
				continue
			}
			if e.Hash != Tombstone {
				if _, err := addRef(tx, e.Hash, 1); err != nil {
					return nil, err
				}
			}
			if err := tx.Put(KindEntry, entryKey(c.ID, e.Index), e.Hash); err != nil {
				return nil, err
			}
			c.ChangedBlocks++
		}
		c.ParentID = s.ParentID
		if err := PutSnapshot(tx, c); err != nil {
			return nil, err
		}
	}
	for _, e := range own {
		if err := tx.Delete(KindEntry, entryKey(s.ID, e.Index)); err != nil {
			return nil, err
		}
		if e.Hash == Tombstone {
			continue
		}
		zero, err := addRef(tx, e.Hash, -1)
		if err != nil {
			return nil, err
		}
		if zero {
			freed = append(freed, e.Hash)
		}
	}
	if err := tx.Delete(KindSnapshot, s.ID); err != nil {
		return nil, err
	}
	return freed, nil
}

// Purge removes hidden snapshots that no volume depends on any more.
func Purge(tx Tx) (freed []string, err error) {
	all, err := Snapshots(tx)
	if err != nil {
		return nil, err
	}
	for _, s := range all {
		if !s.Hidden {
			continue
		}
		dep, err := Dependent(tx, s.ID)
		if err != nil {
			return nil, err
		}
		if dep != "" {
			continue
		}
		// Re-read: an earlier purge may have changed its parent.
		cur, err := GetSnapshot(tx, s.ID)
		if err != nil {
			return nil, err
		}
		f, err := purge(tx, cur)
		if err != nil {
			return nil, err
		}
		freed = append(freed, f...)
	}
	return freed, nil
}

// AllRefs counts references from every entry, for consistency checks.
func AllRefs(tx Tx) (map[string]int64, error) {
	out := map[string]int64{}
	err := tx.Each(KindEntry, "", func(_ string, decode func(any) error) (bool, error) {
		var h string
		if err := decode(&h); err != nil {
			return false, err
		}
		if h != Tombstone {
			out[h]++
		}
		return true, nil
	})
	return out, err
}

// StoredRefs returns the reference table as stored.
func StoredRefs(tx Tx) (map[string]int64, error) {
	out := map[string]int64{}
	err := tx.Each(KindRef, "", func(id string, decode func(any) error) (bool, error) {
		var n int64
		if err := decode(&n); err != nil {
			return false, err
		}
		out[id] = n
		return true, nil
	})
	return out, err
}
