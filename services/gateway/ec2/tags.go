package ec2

import (
	"context"
	"sort"
	"strings"

	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"

	"hangar.dev/hangar/services/gateway/awserr"
	"hangar.dev/hangar/services/internal/store"
)

const bucketTags = "tags"

// maxTags is EC2's limit of user tags per resource.
const maxTags = 50

type tagRecord struct {
	Key, Value string
}

// tagsOf returns the tags of a resource, sorted by key.
func tagsOf(tx *store.Tx, id string) []types.Tag {
	var recs []tagRecord
	if err := tx.Get(bucketTags, id, &recs); err != nil {
		return nil
	}
	out := make([]types.Tag, len(recs))
	for i, r := range recs {
		out[i] = types.Tag{Key: ptr(r.Key), Value: ptr(r.Value)}
	}
	return out
}

func validateTag(t types.Tag) error {
	if t.Key == nil {
		return awserr.MissingParameter("Tag.Key")
	}
	k := *t.Key
	if k == "" || len(k) > 128 {
		return awserr.InvalidParameterValue("Tag key must be 1 to 128 characters long, not %d", len(k))
	}
	if strings.HasPrefix(strings.ToLower(k), "aws:") {
		return awserr.InvalidParameterValue("Tag keys starting with 'aws:' are reserved for internal use")
	}
	if len(deref(t.Value)) > 256 {
		return awserr.InvalidParameterValue("Tag value must be no longer than 256 characters")
	}
	return nil
}

// addTags sets tags on id, replacing values of keys it already has.
func addTags(tx *store.Tx, id string, tags []types.Tag) error {
	cur := map[string]string{}
	for _, t := range tagsOf(tx, id) {
		cur[*t.Key] = *t.Value
	}
	for _, t := range tags {
		if err := validateTag(t); err != nil {
			return err
		}
		cur[*t.Key] = deref(t.Value)
	}
	if len(cur) > maxTags {
		return awserr.New(400, "TagLimitExceeded", "The maximum number of tags per resource is %d; %s would have %d", maxTags, id, len(cur))
	}
	return writeTags(tx, id, cur)
}

func writeTags(tx *store.Tx, id string, m map[string]string) error {
	if len(m) == 0 {
		return tx.Delete(bucketTags, id)
	}
	recs := make([]tagRecord, 0, len(m))
	for k, v := range m {
		recs = append(recs, tagRecord{k, v})
	}
	sort.Slice(recs, func(i, j int) bool { return recs[i].Key < recs[j].Key })
	return tx.Put(bucketTags, id, recs)
}

// tagSpecs validates the TagSpecifications of a create call for resource
// type rt and returns the tags to apply. It runs before anything is created,
// so a bad tag leaves nothing behind.
func tagSpecs(specs []types.TagSpecification, rt types.ResourceType) ([]types.Tag, error) {
	var out []types.Tag
	for _, s := range specs {
		if s.ResourceType == "" {
			return nil, awserr.InvalidParameterValue("Tag specification resource type must have a value")
		}
		if s.ResourceType != rt {
			return nil, awserr.InvalidParameterValue("'%s' is not a valid taggable resource type for this operation.", s.ResourceType)
		}
		for _, t := range s.Tags {
			if err := validateTag(t); err != nil {
				return nil, err
			}
		}
		out = append(out, s.Tags...)
	}
	if len(out) > maxTags {
		return nil, awserr.New(400, "TagLimitExceeded", "The maximum number of tags per resource is %d", maxTags)
	}
	return out, nil
}

// resourceExists checks that id names an existing taggable resource.
func resourceExists(tx *store.Tx, id string) error {
	k := kindOf(id)
	if k == nil || k.ByName {
		return awserr.New(400, "InvalidID", "The ID '%s' is not valid", clip(id))
	}
	if err := k.check(id); err != nil {
		return err
	}
	if !tx.Has(k.Prefix, id) {
		return k.notFound(id)
	}
	return nil
}

// CreateTags adds or overwrites tags on resources.
func (s *Service) CreateTags(ctx context.Context, in *ec2.CreateTagsInput) (*ec2.CreateTagsOutput, error) {
	if len(in.Resources) == 0 {
		return nil, awserr.MissingParameter("ResourceId")
	}
	if len(in.Tags) == 0 {
		return nil, awserr.MissingParameter("Tag")
	}
	err := s.db.Update(func(tx *store.Tx) error {
		for _, id := range in.Resources {
			if err := resourceExists(tx, id); err != nil {
				return err
			}
		}
		for _, id := range in.Resources {
			if err := addTags(tx, id, in.Tags); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return &ec2.CreateTagsOutput{}, nil
}

// DeleteTags removes tags: a tag given with a value is removed only when the
// value matches; with no tags given, all of a resource's tags go.
func (s *Service) DeleteTags(ctx context.Context, in *ec2.DeleteTagsInput) (*ec2.DeleteTagsOutput, error) {
	if len(in.Resources) == 0 {
		return nil, awserr.MissingParameter("ResourceId")
	}
	err := s.db.Update(func(tx *store.Tx) error {
		for _, id := range in.Resources {
			if err := resourceExists(tx, id); err != nil {
				return err
			}
		}
		for _, id := range in.Resources {
			cur := map[string]string{}
			for _, t := range tagsOf(tx, id) {
				cur[*t.Key] = *t.Value
			}
			if len(in.Tags) == 0 {
				cur = nil
			}
			for _, t := range in.Tags {
				if t.Key == nil {
					return awserr.MissingParameter("Tag.Key")
				}
				if v, ok := cur[*t.Key]; ok && (t.Value == nil || *t.Value == v) {
					delete(cur, *t.Key)
				}
			}
			if err := writeTags(tx, id, cur); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return &ec2.DeleteTagsOutput{}, nil
}

type tagRow struct {
	ResourceID string
	Key, Value string
	Type       types.ResourceType
}

var tagFilters = filterSet[tagRow]{
	"key":           func(r *tagRow) []string { return []string{r.Key} },
	"value":         func(r *tagRow) []string { return []string{r.Value} },
	"resource-id":   func(r *tagRow) []string { return []string{r.ResourceID} },
	"resource-type": func(r *tagRow) []string { return []string{string(r.Type)} },
}

// DescribeTags lists tags across every resource.
func (s *Service) DescribeTags(ctx context.Context, in *ec2.DescribeTagsInput) (*ec2.DescribeTagsOutput, error) {
	match, err := tagFilters.compile(in.Filters)
	if err != nil {
		return nil, err
	}
	p, err := newPager(in.MaxResults, in.NextToken, 5, 1000)
	if err != nil {
		return nil, err
	}
	out := &ec2.DescribeTagsOutput{Tags: []types.TagDescription{}}
	afterID, afterKey, _ := strings.Cut(p.after, "\x00")
	err = s.db.View(func(tx *store.Tx) error {
		start := ""
		if afterID != "" {
			// Seek to the resource, then skip its keys up to afterKey.
			start = afterID
		}
		var last tagRow
		n := 0
		visit := func(id string) (bool, error) {
			k := kindOf(id)
			rt := types.ResourceType("")
			if k != nil {
				rt = k.ResourceType
			}
			for _, t := range tagsOf(tx, id) {
				row := tagRow{ResourceID: id, Key: *t.Key, Value: *t.Value, Type: rt}
				if id == afterID && row.Key <= afterKey {
					continue
				}
				if !match(&row, nil) {
					continue
				}
				if p.max > 0 && n == p.max {
					out.NextToken = token(last.ResourceID + "\x00" + last.Key)
					return false, nil
				}
				out.Tags = append(out.Tags, types.TagDescription{Key: ptr(row.Key), Value: ptr(row.Value), ResourceId: ptr(id), ResourceType: rt})
				n++
				last = row
			}
			return true, nil
		}
		if start != "" {
			more, err := visit(start)
			if err != nil || !more {
				return err
			}
		}
		return tx.Each(bucketTags, start, func(id string, _ func(any) error) (bool, error) { return visit(id) })
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}
