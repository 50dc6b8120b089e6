package ec2

import (
	"errors"
	"fmt"
	"sort"
	"strings"

	"github.com/aws/aws-sdk-go-v2/service/ec2/types"

	"hangar.dev/hangar/services/gateway/awserr"
	"hangar.dev/hangar/services/internal/awsid"
	"hangar.dev/hangar/services/internal/store"
)

// kind describes one kind of EC2 record: where it is stored, what its tags
// call it, and how EC2 words "not found" for it.
type kind struct {
	Prefix       string // id prefix, and the store bucket
	ResourceType types.ResourceType
	NotFound     string // error code for an id that does not exist
	Malformed    string // error code for an id that cannot be one
	Noun         string // as in "The vpc ID 'vpc-1' does not exist"
	// ByName kinds (key pairs) are addressed by a name, not a prefixed id.
	ByName bool
}

var kinds = map[string]*kind{}

func register(k *kind) *kind {
	if kinds[k.Prefix] != nil {
		panic("ec2: kind registered twice: " + k.Prefix)
	}
	kinds[k.Prefix] = k
	return k
}

// kindOf returns the kind an id belongs to, by its prefix.
func kindOf(id string) *kind {
	return kinds[awsid.Prefix(id)]
}

func (k *kind) notFound(ids ...string) *awserr.Error {
	if len(ids) == 1 {
		return awserr.New(400, k.NotFound, "The %s '%s' does not exist", k.Noun, ids[0])
	}
	return awserr.New(400, k.NotFound, "The %ss '%s' do not exist", k.Noun, strings.Join(ids, ", "))
}

// check reports a malformed id.
func (k *kind) check(id string) error {
	if k.ByName {
		return nil
	}
	if !awsid.Valid(k.Prefix, id) {
		return awserr.New(400, k.Malformed, "Invalid id: \"%s\" (expecting \"%s-...\")", clip(id), k.Prefix)
	}
	return nil
}

// get loads the record k/id into a new T, or returns k's NotFound error.
func get[T any](tx *store.Tx, k *kind, id string) (*T, error) {
	if err := k.check(id); err != nil {
		return nil, err
	}
	var v T
	if err := tx.Get(k.Prefix, id, &v); err != nil {
		if errors.Is(err, store.ErrNotFound) {
			return nil, k.notFound(id)
		}
		return nil, err
	}
	return &v, nil
}

// list visits the records of kind k a Describe call asks for: the named ids
// (each must exist) or every record, filtered, one page at a time. It
// returns the NextToken when more records match past the page.
func list[T any](tx *store.Tx, k *kind, ids []string, match matcher[T], p pager, visit func(id string, r *T, tags []types.Tag)) (*string, error) {
	if len(ids) > 0 {
		var missing []string
		seen := map[string]bool{}
		type hit struct {
			id   string
			r    *T
			tags []types.Tag
		}
		var hits []hit
		for _, id := range ids {
			if seen[id] {
				continue
			}
			seen[id] = true
			if err := k.check(id); err != nil {
				return nil, err
			}
			var r T
			if err := tx.Get(k.Prefix, id, &r); err != nil {
				if errors.Is(err, store.ErrNotFound) {
					missing = append(missing, id)
					continue
				}
				return nil, err
			}
			tags := tagsOf(tx, id)
			if match == nil || match(&r, tags) {
				hits = append(hits, hit{id, &r, tags})
			}
		}
		if len(missing) > 0 {
			return nil, k.notFound(missing...)
		}
		sort.Slice(hits, func(i, j int) bool { return hits[i].id < hits[j].id })
		for _, h := range hits {
			visit(h.id, h.r, h.tags)
		}
		return nil, nil
	}
	var (
		n    int
		last string
		next *string
	)
	err := tx.Each(k.Prefix, p.after, func(id string, decode func(any) error) (bool, error) {
		var r T
		if err := decode(&r); err != nil {
			return false, err
		}
		tags := tagsOf(tx, id)
		if match != nil && !match(&r, tags) {
			return true, nil
		}
		if p.max > 0 && n == p.max {
			next = token(last)
			return false, nil
		}
		visit(id, &r, tags)
		n++
		last = id
		return true, nil
	})
	return next, err
}

// exists reports whether any record of kind k satisfies pred.
func exists[T any](tx *store.Tx, k *kind, pred func(id string, r *T) bool) (bool, error) {
	found := false
	err := tx.Each(k.Prefix, "", func(id string, decode func(any) error) (bool, error) {
		var r T
		if err := decode(&r); err != nil {
			return false, err
		}
		if pred(id, &r) {
			found = true
			return false, nil
		}
		return true, nil
	})
	return found, err
}

// all returns every record of kind k satisfying pred, keyed by id.
func all[T any](tx *store.Tx, k *kind, pred func(id string, r *T) bool) (map[string]*T, error) {
	out := map[string]*T{}
	err := tx.Each(k.Prefix, "", func(id string, decode func(any) error) (bool, error) {
		var r T
		if err := decode(&r); err != nil {
			return false, err
		}
		if pred == nil || pred(id, &r) {
			out[id] = &r
		}
		return true, nil
	})
	return out, err
}

// remove deletes the record k/id and its tags.
func remove(tx *store.Tx, k *kind, id string) error {
	if err := tx.Delete(k.Prefix, id); err != nil {
		return err
	}
	return tx.Delete(bucketTags, id)
}

func put(tx *store.Tx, k *kind, id string, v any) error {
	if err := tx.Put(k.Prefix, id, v); err != nil {
		return fmt.Errorf("storing %s: %w", id, err)
	}
	return nil
}
