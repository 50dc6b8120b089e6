// Package store keeps a service's records in one bbolt file as JSON, one
// bucket per kind of record, keyed by id.
//
// It owns only the encoding and the transaction boundaries; what a record
// means belongs to the service that stores it. Every service has its own
// file: nothing here lets one service read another's records.
package store

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	bolt "go.etcd.io/bbolt"
)

// ErrNotFound is returned by Get when no record has the id.
var ErrNotFound = errors.New("record not found")

// DB is an open state file.
type DB struct {
	bolt *bolt.DB

	watchMu  sync.RWMutex
	watchers []func([]Change)
}

// Change is one record written or deleted by a committed transaction, with
// its encoded value before and after (nil when absent).
type Change struct {
	Kind, ID string
	Old, New []byte
}

// Watch registers fn to be called, in the committing goroutine, with every
// change of each read-write transaction that commits. A service uses it to
// follow its own records (the gateway pushes the VPCs whose records changed
// to hangar-netd) without every writer having to remember to say so.
func (db *DB) Watch(fn func([]Change)) {
	db.watchMu.Lock()
	db.watchers = append(db.watchers, fn)
	db.watchMu.Unlock()
}

// Open opens (creating if needed) the state file at path. A second process
// holding the file makes Open fail after a few seconds instead of hanging.
func Open(path string) (*DB, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
		return nil, fmt.Errorf("creating state directory: %w", err)
	}
	b, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: 5 * time.Second})
	if err != nil {
		return nil, fmt.Errorf("opening state file %s: %w", path, err)
	}
	return &DB{bolt: b}, nil
}

// Close closes the file.
func (db *DB) Close() error { return db.bolt.Close() }

// Tx is one transaction. It is valid only inside the function given to
// Update or View.
type Tx struct {
	tx *bolt.Tx
	// changes is non-nil when someone watches the DB.
	changes map[string]*Change
	order   []string
}

// Update runs fn in a read-write transaction; an error from fn rolls back
// everything fn wrote. Watchers hear of the changes after the commit.
func (db *DB) Update(fn func(*Tx) error) error {
	db.watchMu.RLock()
	watched := len(db.watchers) > 0
	db.watchMu.RUnlock()
	var t *Tx
	err := db.bolt.Update(func(tx *bolt.Tx) error {
		t = &Tx{tx: tx}
		if watched {
			t.changes = map[string]*Change{}
		}
		return fn(t)
	})
	if err != nil || !watched || len(t.order) == 0 {
		return err
	}
	out := make([]Change, 0, len(t.order))
	for _, k := range t.order {
		out = append(out, *t.changes[k])
	}
	db.watchMu.RLock()
	ws := append([]func([]Change){}, db.watchers...)
	db.watchMu.RUnlock()
	for _, w := range ws {
		w(out)
	}
	return nil
}

// note records a write of kind/id for the watchers: the value the record
// had when the transaction first touched it, and its value now.
func (tx *Tx) note(b *bolt.Bucket, kind, id string, now []byte) {
	if tx.changes == nil {
		return
	}
	key := kind + "\x00" + id
	c, ok := tx.changes[key]
	if !ok {
		c = &Change{Kind: kind, ID: id}
		if b != nil {
			if old := b.Get([]byte(id)); old != nil {
				c.Old = append([]byte(nil), old...)
			}
		}
		tx.changes[key] = c
		tx.order = append(tx.order, key)
	}
	c.New = now
}

// View runs fn in a read-only transaction.
func (db *DB) View(fn func(*Tx) error) error {
	return db.bolt.View(func(tx *bolt.Tx) error { return fn(&Tx{tx: tx}) })
}

// Writable reports whether the transaction may write.
func (tx *Tx) Writable() bool { return tx.tx.Writable() }

func (tx *Tx) bucket(kind string, create bool) (*bolt.Bucket, error) {
	if b := tx.tx.Bucket([]byte(kind)); b != nil || !create {
		return b, nil
	}
	b, err := tx.tx.CreateBucket([]byte(kind))
	if err != nil {
		return nil, fmt.Errorf("creating bucket %s: %w", kind, err)
	}
	return b, nil
}

// Get decodes the record kind/id into v, or returns ErrNotFound.
func (tx *Tx) Get(kind, id string, v any) error {
	b, _ := tx.bucket(kind, false)
	if b == nil {
		return ErrNotFound
	}
	raw := b.Get([]byte(id))
	if raw == nil {
		return ErrNotFound
	}
	if err := json.Unmarshal(raw, v); err != nil {
		return fmt.Errorf("decoding %s %s: %w", kind, id, err)
	}
	return nil
}

// Has reports whether kind/id exists.
func (tx *Tx) Has(kind, id string) bool {
	b, _ := tx.bucket(kind, false)
	return b != nil && b.Get([]byte(id)) != nil
}

// Put stores v as kind/id, replacing what was there.
func (tx *Tx) Put(kind, id string, v any) error {
	raw, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("encoding %s %s: %w", kind, id, err)
	}
	b, err := tx.bucket(kind, true)
	if err != nil {
		return err
	}
	tx.note(b, kind, id, raw)
	if err := b.Put([]byte(id), raw); err != nil {
		return fmt.Errorf("writing %s %s: %w", kind, id, err)
	}
	return nil
}

// Delete removes kind/id; deleting what is not there is not an error.
func (tx *Tx) Delete(kind, id string) error {
	b, _ := tx.bucket(kind, false)
	if b == nil {
		return nil
	}
	if b.Get([]byte(id)) != nil {
		tx.note(b, kind, id, nil)
	}
	if err := b.Delete([]byte(id)); err != nil {
		return fmt.Errorf("deleting %s %s: %w", kind, id, err)
	}
	return nil
}

// Count returns how many records of kind exist.
func (tx *Tx) Count(kind string) int {
	b, _ := tx.bucket(kind, false)
	if b == nil {
		return 0
	}
	return b.Stats().KeyN
}

// Kinds lists the buckets in the file.
func (tx *Tx) Kinds() []string {
	var out []string
	_ = tx.tx.ForEach(func(name []byte, _ *bolt.Bucket) error {
		out = append(out, string(name))
		return nil
	})
	return out
}

// Each calls fn for every record of kind in id order, starting after the id
// `after` ("" for the beginning), until fn returns false or an error.
// decode unmarshals the current record into its argument.
func (tx *Tx) Each(kind, after string, fn func(id string, decode func(v any) error) (bool, error)) error {
	b, _ := tx.bucket(kind, false)
	if b == nil {
		return nil
	}
	c := b.Cursor()
	var k, raw []byte
	if after == "" {
		k, raw = c.First()
	} else {
		k, raw = c.Seek([]byte(after))
		if k != nil && string(k) == after {
			k, raw = c.Next()
		}
	}
	for ; k != nil; k, raw = c.Next() {
		id := string(k)
		decode := func(v any) error {
			if err := json.Unmarshal(raw, v); err != nil {
				return fmt.Errorf("decoding %s %s: %w", kind, id, err)
			}
			return nil
		}
		more, err := fn(id, decode)
		if err != nil {
			return err
		}
		if !more {
			return nil
		}
	}
	return nil
}

// All decodes every record of kind, in id order.
func All[T any](tx *Tx, kind string) ([]T, error) {
	var out []T
	err := tx.Each(kind, "", func(_ string, decode func(any) error) (bool, error) {
		var v T
		if err := decode(&v); err != nil {
			return false, err
		}
		out = append(out, v)
		return true, nil
	})
	return out, err
}
