package catalog

import (
	"encoding/json"
	"fmt"
	"maps"
	"math/rand"
	"path/filepath"
	"sort"
	"testing"

	"hangar.dev/hangar/services/internal/store"
)

// memTx is an in-memory Tx with the store's ordering and not-found error.
type memTx struct{ b map[string]map[string][]byte }

func newMem() *memTx { return &memTx{b: map[string]map[string][]byte{}} }

func (m *memTx) Get(kind, id string, v any) error {
	raw, ok := m.b[kind][id]
	if !ok {
		return store.ErrNotFound
	}
	return json.Unmarshal(raw, v)
}

func (m *memTx) Put(kind, id string, v any) error {
	raw, err := json.Marshal(v)
	if err != nil {
		return err
	}
	if m.b[kind] == nil {
		m.b[kind] = map[string][]byte{}
	}
	m.b[kind][id] = raw
	return nil
}

func (m *memTx) Delete(kind, id string) error {
	delete(m.b[kind], id)
	return nil
}

func (m *memTx) Each(kind, after string, fn func(string, func(any) error) (bool, error)) error {
	keys := make([]string, 0, len(m.b[kind]))
	for k := range m.b[kind] {
		if k > after {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	for _, k := range keys {
		raw := m.b[kind][k]
		more, err := fn(k, func(v any) error { return json.Unmarshal(raw, v) })
		if err != nil || !more {
			return err
		}
	}
	return nil
}

func hashOf(n int) string { return fmt.Sprintf("%064x", n) }

// model is what each visible snapshot must read as.
type model struct {
	full   map[string]map[uint64]string
	parent map[string]string
}

func checkConsistent(t *testing.T, tx Tx, m *model, freedEver map[string]bool, step int) {
	t.Helper()
	want, err := AllRefs(tx)
	if err != nil {
		t.Fatal(err)
	}
	got, err := StoredRefs(tx)
	if err != nil {
		t.Fatal(err)
	}
	if !maps.Equal(want, got) {
		t.Fatalf("step %d: stored refs %v, entries reference %v", step, got, want)
	}
	for h := range want {
		if freedEver[h] {
			t.Fatalf("step %d: block %s was freed but is still referenced", step, h)
		}
	}
	for id, full := range m.full {
		var all []Entry
		var start uint64
		for {
			page, next, more, err := Blocks(tx, id, start, 3)
			if err != nil {
				t.Fatal(err)
			}
			all = append(all, page...)
			if !more {
				break
			}
			start = next
		}
		gotMap := map[uint64]string{}
		for _, e := range all {
			gotMap[e.Index] = e.Hash
		}
		if !maps.Equal(gotMap, full) {
			t.Fatalf("step %d: snapshot %s reads %v, want %v", step, id, gotMap, full)
		}
		s, err := GetSnapshot(tx, id)
		if err != nil {
			t.Fatal(err)
		}
		if s.BlockCount != uint64(len(full)) {
			t.Fatalf("step %d: snapshot %s BlockCount %d, want %d", step, id, s.BlockCount, len(full))
		}
		if p := m.parent[id]; p != "" {
			if _, ok := m.full[p]; !ok {
				continue
			}
			var ch []Changed
			start = 0
			for {
				page, next, more, err := ChangedBlocks(tx, p, id, start, 2)
				if err != nil {
					t.Fatal(err)
				}
				ch = append(ch, page...)
				if !more {
					break
				}
				start = next
			}
			wantN := 0
			for i := uint64(0); i < 32; i++ {
				if m.full[p][i] != full[i] {
					wantN++
				}
			}
			if len(ch) != wantN {
				t.Fatalf("step %d: %s→%s changed %d blocks, want %d (%v)", step, p, id, len(ch), wantN, ch)
			}
			for _, c := range ch {
				if c.First != m.full[p][c.Index] || c.Second != full[c.Index] {
					t.Fatalf("step %d: changed block %+v disagrees with the model", step, c)
				}
			}
		}
	}
}

// TestRandomLineages creates and deletes snapshots (and volumes that keep
// them alive) in random orders and checks after every step that each
// snapshot still reads as it was written, that reference counts equal the
// entries that hold them, and that no freed block is referenced.
func TestRandomLineages(t *testing.T) {
	for seed := int64(1); seed <= 40; seed++ {
		rng := rand.New(rand.NewSource(seed))
		tx := newMem()
		m := &model{full: map[string]map[uint64]string{}, parent: map[string]string{}}
		freedEver := map[string]bool{}
		n := 0
		var vols []string
		for step := 0; step < 60; step++ {
			switch op := rng.Intn(10); {
			case op < 5: // new snapshot, child of a random visible one or a root
				n++
				id := fmt.Sprintf("snap-%04d", n)
				var ids []string
				for k := range m.full {
					ids = append(ids, k)
				}
				sort.Strings(ids)
				parent := ""
				full := map[uint64]string{}
				if len(ids) > 0 && rng.Intn(4) > 0 {
					parent = ids[rng.Intn(len(ids))]
					maps.Copy(full, m.full[parent])
				}
				entries := map[uint64]string{}
				for k := rng.Intn(8); k >= 0; k-- {
					i := uint64(rng.Intn(32))
					if rng.Intn(4) == 0 {
						entries[i] = Tombstone
						delete(full, i)
						continue
					}
					h := hashOf(rng.Intn(20)) // small space: lots of sharing
					entries[i] = h
					full[i] = h
				}
				s := &Snapshot{ID: id, ParentID: parent, State: "completed"}
				fresh, err := Commit(tx, s, entries, 512<<10)
				if err != nil {
					t.Fatal(err)
				}
				for _, h := range fresh {
					delete(freedEver, h) // written again: a new life
				}
				m.full[id] = full
				m.parent[id] = parent
			case op < 6 && len(m.full) > 0: // a volume that depends on a snapshot
				var ids []string
				for k := range m.full {
					ids = append(ids, k)
				}
				sort.Strings(ids)
				v := &Volume{ID: fmt.Sprintf("vol-%04d", step), Base: ids[rng.Intn(len(ids))]}
				if err := PutVolume(tx, v); err != nil {
					t.Fatal(err)
				}
				vols = append(vols, v.ID)
			case op < 7 && len(vols) > 0: // delete a volume, purge what it held
				i := rng.Intn(len(vols))
				if err := tx.Delete(KindVolume, vols[i]); err != nil {
					t.Fatal(err)
				}
				vols = append(vols[:i], vols[i+1:]...)
				freed, err := Purge(tx)
				if err != nil {
					t.Fatal(err)
				}
				for _, h := range freed {
					freedEver[h] = true
				}
			case len(m.full) > 0: // delete a snapshot
				var ids []string
				for k := range m.full {
					ids = append(ids, k)
				}
				sort.Strings(ids)
				id := ids[rng.Intn(len(ids))]
				freed, err := Delete(tx, id)
				if err != nil {
					t.Fatal(err)
				}
				for _, h := range freed {
					freedEver[h] = true
				}
				delete(m.full, id)
				// The model's parent links skip the deleted snapshot.
				for c, p := range m.parent {
					if p == id {
						m.parent[c] = m.parent[id]
					}
				}
			}
			checkConsistent(t, tx, m, freedEver, step)
		}
		// Deleting everything leaves no reference and no entry behind.
		for _, v := range vols {
			_ = tx.Delete(KindVolume, v)
		}
		for id := range m.full {
			if _, err := Delete(tx, id); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := Purge(tx); err != nil {
			t.Fatal(err)
		}
		if len(tx.b[KindRef]) != 0 || len(tx.b[KindEntry]) != 0 || len(tx.b[KindSnapshot]) != 0 {
			t.Fatalf("seed %d: leaked refs %d entries %d snapshots %d", seed, len(tx.b[KindRef]), len(tx.b[KindEntry]), len(tx.b[KindSnapshot]))
		}
	}
}

// TestChangedBlocksReadsOnlyTheDelta proves list-changed-blocks is
// O(changed): a child of a 100 000-block snapshot with 10 changes answers
// with exactly those 10, reading only its own 10 entries.
func TestChangedBlocksReadsOnlyTheDelta(t *testing.T) {
	db, err := store.Open(filepath.Join(t.TempDir(), "state.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	err = db.Update(func(tx *store.Tx) error {
		base := map[uint64]string{}
		for i := uint64(0); i < 100000; i++ {
			base[i] = hashOf(int(i))
		}
		if _, err := Commit(tx, &Snapshot{ID: "snap-a", State: "completed"}, base, 512<<10); err != nil {
			return err
		}
		child := map[uint64]string{}
		for i := uint64(0); i < 10; i++ {
			child[i*997] = hashOf(1 << 30)
		}
		_, err := Commit(tx, &Snapshot{ID: "snap-b", ParentID: "snap-a", State: "completed"}, child, 512<<10)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	counting := &countingTx{}
	_ = db.View(func(tx *store.Tx) error {
		counting.Tx = tx
		ch, _, more, err := ChangedBlocks(counting, "snap-a", "snap-b", 0, 1000)
		if err != nil {
			t.Fatal(err)
		}
		if len(ch) != 10 || more {
			t.Fatalf("changed = %d blocks (more %v), want 10", len(ch), more)
		}
		return nil
	})
	if counting.visited > 20 {
		t.Fatalf("listing 10 changes visited %d entries; it must read only the delta", counting.visited)
	}
}

type countingTx struct {
	*store.Tx
	visited int
}

func (c *countingTx) Each(kind, after string, fn func(string, func(any) error) (bool, error)) error {
	return c.Tx.Each(kind, after, func(id string, decode func(any) error) (bool, error) {
		if kind == KindEntry {
			c.visited++
		}
		return fn(id, decode)
	})
}
