package store

import (
	"errors"
	"path/filepath"
	"strings"
	"testing"
)

type rec struct {
	Name string
	N    int
}

func TestPutGetEachSurvivesReopen(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state.db")
	db, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	err = db.Update(func(tx *Tx) error {
		for i, id := range []string{"b", "a", "c"} {
			if err := tx.Put("things", id, rec{Name: id, N: i}); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := db.Close(); err != nil {
		t.Fatal(err)
	}

	db, err = Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	err = db.View(func(tx *Tx) error {
		var r rec
		if err := tx.Get("things", "a", &r); err != nil || r.N != 1 {
			t.Errorf("Get a = %+v, %v", r, err)
		}
		if err := tx.Get("things", "zz", &r); !errors.Is(err, ErrNotFound) {
			t.Errorf("Get of a missing id = %v, want ErrNotFound", err)
		}
		if err := tx.Get("nothing", "a", &r); !errors.Is(err, ErrNotFound) {
			t.Errorf("Get in a missing bucket = %v, want ErrNotFound", err)
		}
		if n := tx.Count("things"); n != 3 {
			t.Errorf("Count = %d", n)
		}
		var ids []string
		err := tx.Each("things", "a", func(id string, _ func(any) error) (bool, error) {
			ids = append(ids, id)
			return true, nil
		})
		if err != nil || len(ids) != 2 || ids[0] != "b" || ids[1] != "c" {
			t.Errorf("Each after a = %v, %v", ids, err)
		}
		all, err := All[rec](tx, "things")
		if err != nil || len(all) != 3 || all[0].Name != "a" {
			t.Errorf("All = %+v, %v", all, err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

func TestUpdateErrorRollsBack(t *testing.T) {
	db, err := Open(filepath.Join(t.TempDir(), "state.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	boom := errors.New("boom")
	err = db.Update(func(tx *Tx) error {
		if err := tx.Put("things", "a", rec{}); err != nil {
			return err
		}
		return boom
	})
	if !errors.Is(err, boom) {
		t.Fatalf("Update = %v", err)
	}
	_ = db.View(func(tx *Tx) error {
		if tx.Has("things", "a") {
			t.Error("a write from a failed Update is visible")
		}
		return nil
	})
}

func TestWatchSeesCommittedChangesOnly(t *testing.T) {
	db, err := Open(filepath.Join(t.TempDir(), "state.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	_ = db.Update(func(tx *Tx) error { return tx.Put("things", "a", rec{Name: "old"}) })
	var seen [][]Change
	db.Watch(func(c []Change) { seen = append(seen, c) })

	err = db.Update(func(tx *Tx) error {
		if err := tx.Put("things", "a", rec{Name: "mid"}); err != nil {
			return err
		}
		if err := tx.Put("things", "a", rec{Name: "new"}); err != nil {
			return err
		}
		if err := tx.Put("things", "b", rec{Name: "b"}); err != nil {
			return err
		}
		return tx.Delete("things", "missing")
	})
	if err != nil {
		t.Fatal(err)
	}
	_ = db.Update(func(tx *Tx) error {
		_ = tx.Put("things", "c", rec{})
		return errors.New("rolled back")
	})
	_ = db.Update(func(tx *Tx) error { return tx.Delete("things", "b") })

	if len(seen) != 2 {
		t.Fatalf("watcher called %d times, want 2 (the rolled-back transaction must not count)", len(seen))
	}
	first := seen[0]
	if len(first) != 2 || first[0].ID != "a" || first[1].ID != "b" {
		t.Fatalf("first commit changes: %+v", first)
	}
	if !strings.Contains(string(first[0].Old), "old") || !strings.Contains(string(first[0].New), "new") {
		t.Fatalf("a: old %s new %s, want the value before the transaction and the last one", first[0].Old, first[0].New)
	}
	if first[1].Old != nil {
		t.Fatalf("b was new, but Old = %s", first[1].Old)
	}
	if del := seen[1]; len(del) != 1 || del[0].ID != "b" || del[0].New != nil || del[0].Old == nil {
		t.Fatalf("delete change: %+v", del)
	}
}
