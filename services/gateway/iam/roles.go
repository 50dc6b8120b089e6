package iam

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/aws/aws-sdk-go-v2/service/iam"
	"github.com/aws/aws-sdk-go-v2/service/iam/types"

	"hangar.dev/hangar/services/internal/store"
)

// roleRecord is a role as stored.
type roleRecord struct {
	Name, Path, ID, ARN string
	Created             time.Time
	// TrustPolicy is the assume-role policy document as the user gave it.
	TrustPolicy        string
	Description        *string
	MaxSessionDuration int32
	Tags               []tag
	Inline             []inlinePolicy // sorted by name
	Attached           []string       // managed policy ARNs, in attach order
}

type inlinePolicy struct{ Name, Document string }

// IAM's quotas that hangar enforces, as AWS words them.
const (
	maxTrustPolicySize  = 2048  // ACLSizePerRole
	maxInlinePolicySize = 10240 // RolePolicySizeQuota, all inline policies of a role together
	maxAttached         = 10    // PoliciesPerRole
)

func (r *roleRecord) view(withTags bool) types.Role {
	v := types.Role{
		Arn: ptr(r.ARN), CreateDate: ptr(r.Created), Path: ptr(r.Path), RoleId: ptr(r.ID), RoleName: ptr(r.Name),
		AssumeRolePolicyDocument: encodeDocument(r.TrustPolicy), Description: r.Description,
		MaxSessionDuration: ptr(r.MaxSessionDuration),
	}
	if withTags {
		if len(r.Tags) > 0 {
			v.Tags = tagsView(r.Tags)
		}
		v.RoleLastUsed = &types.RoleLastUsed{}
	}
	return v
}

// readOnly is the one conclusion hangar draws from a role's policies: it
// has at least one, and every one of them grants only reads.
func (r *roleRecord) readOnly() bool {
	if len(r.Inline) == 0 && len(r.Attached) == 0 {
		return false
	}
	for _, arn := range r.Attached {
		if ro, _ := ManagedPolicyReadOnly(arn); !ro {
			return false
		}
	}
	for _, p := range r.Inline {
		sts, err := parsePolicy(p.Document, permissionPolicy)
		if err != nil || !grantsOnlyRead(sts) {
			return false
		}
	}
	return true
}

func getRole(tx *store.Tx, name string) (*roleRecord, error) {
	var r roleRecord
	if err := tx.Get(bucketRoles, key(name), &r); err != nil {
		if errors.Is(err, store.ErrNotFound) {
			return nil, noSuchEntity("The role with name %s cannot be found.", name)
		}
		return nil, err
	}
	return &r, nil
}

func putRole(tx *store.Tx, r *roleRecord) error {
	return tx.Put(bucketRoles, key(r.Name), r)
}

// roleNamed validates a RoleName parameter and loads its role.
func roleNamed(tx *store.Tx, name *string) (*roleRecord, error) {
	n, err := checkName(name, "roleName", 64)
	if err != nil {
		return nil, err
	}
	return getRole(tx, n)
}

func checkMaxSession(v *int32) (int32, error) {
	if v == nil {
		return 3600, nil
	}
	if *v < 3600 || *v > 43200 {
		return 0, validationError(fmt.Sprint(*v), "maxSessionDuration", "Member must have value between 3600 and 43200")
	}
	return *v, nil
}

func checkDescription(v *string) error {
	if v != nil && len(*v) > 1000 {
		return validationError(*v, "description", "Member must have length less than or equal to 1000")
	}
	return nil
}

func checkTrustPolicy(doc *string) (string, error) {
	if doc == nil {
		return "", missing("assumeRolePolicyDocument")
	}
	if _, err := parsePolicy(*doc, trustPolicy); err != nil {
		return "", err
	}
	if policySize(*doc) > maxTrustPolicySize {
		return "", limitExceeded("Cannot exceed quota for ACLSizePerRole: %d", maxTrustPolicySize)
	}
	return *doc, nil
}

// CreateRole creates a role whose trust policy is well-formed JSON.
func (s *Service) CreateRole(ctx context.Context, in *iam.CreateRoleInput) (*iam.CreateRoleOutput, error) {
	name, err := checkName(in.RoleName, "roleName", 64)
	if err != nil {
		return nil, err
	}
	path, err := checkPath(in.Path, "path")
	if err != nil {
		return nil, err
	}
	trust, err := checkTrustPolicy(in.AssumeRolePolicyDocument)
	if err != nil {
		return nil, err
	}
	maxSession, err := checkMaxSession(in.MaxSessionDuration)
	if err != nil {
		return nil, err
	}
	if err := checkDescription(in.Description); err != nil {
		return nil, err
	}
	if in.PermissionsBoundary != nil {
		return nil, invalidInput("Permissions boundaries are not supported by hangar; create the role without one.")
	}
	tags, err := mergeTags(nil, in.Tags)
	if err != nil {
		return nil, err
	}
	var r *roleRecord
	err = s.db.Update(func(tx *store.Tx) error {
		if tx.Has(bucketRoles, key(name)) {
			return entityAlreadyExists("Role with name %s already exists.", name)
		}
		id, err := newID(tx, "AROA")
		if err != nil {
			return err
		}
		r = &roleRecord{Name: name, Path: path, ID: id, ARN: fmt.Sprintf("arn:aws:iam::%s:role%s%s", s.account, path, name),
			Created: s.now().UTC().Truncate(time.Second), TrustPolicy: trust, Description: in.Description,
			MaxSessionDuration: maxSession, Tags: tags}
		return putRole(tx, r)
	})
	if err != nil {
		return nil, err
	}
	s.log.Info("created role", "role", name, "id", r.ID)
	return &iam.CreateRoleOutput{Role: ptr(r.view(true))}, nil
}

// GetRole returns a role with its tags.
func (s *Service) GetRole(ctx context.Context, in *iam.GetRoleInput) (*iam.GetRoleOutput, error) {
	var r *roleRecord
	err := s.db.View(func(tx *store.Tx) (err error) { r, err = roleNamed(tx, in.RoleName); return err })
	if err != nil {
		return nil, err
	}
	return &iam.GetRoleOutput{Role: ptr(r.view(true))}, nil
}

// ListRoles lists roles by name, optionally under a path prefix.
func (s *Service) ListRoles(ctx context.Context, in *iam.ListRolesInput) (*iam.ListRolesOutput, error) {
	p, err := newPage(in.Marker, in.MaxItems)
	if err != nil {
		return nil, err
	}
	prefix, err := checkPathPrefix(in.PathPrefix)
	if err != nil {
		return nil, err
	}
	out := &iam.ListRolesOutput{Roles: []types.Role{}}
	err = s.db.View(func(tx *store.Tx) error {
		roles, err := store.All[roleRecord](tx, bucketRoles)
		if err != nil {
			return err
		}
		byKey := map[string]*roleRecord{}
		var keys []string
		for i := range roles {
			r := &roles[i]
			if strings.HasPrefix(r.Path, prefix) {
				byKey[key(r.Name)] = r
				keys = append(keys, key(r.Name))
			}
		}
		sort.Strings(keys)
		window, truncated, next := p.cut(keys)
		for _, k := range window {
			out.Roles = append(out.Roles, byKey[k].view(false))
		}
		out.IsTruncated, out.Marker = truncated, next
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

func checkPathPrefix(v *string) (string, error) {
	if v == nil {
		return "/", nil
	}
	p := *v
	if p == "" || len(p) > 512 || !strings.HasPrefix(p, "/") {
		return "", validationError(p, "pathPrefix", `Member must satisfy regular expression pattern: \u002F[\u0021-\u007F]*`)
	}
	return p, nil
}

// UpdateRole changes a role's description and maximum session duration.
func (s *Service) UpdateRole(ctx context.Context, in *iam.UpdateRoleInput) (*iam.UpdateRoleOutput, error) {
	if err := checkDescription(in.Description); err != nil {
		return nil, err
	}
	var maxSession int32
	if in.MaxSessionDuration != nil {
		var err error
		if maxSession, err = checkMaxSession(in.MaxSessionDuration); err != nil {
			return nil, err
		}
	}
	err := s.db.Update(func(tx *store.Tx) error {
		r, err := roleNamed(tx, in.RoleName)
		if err != nil {
			return err
		}
		if in.Description != nil {
			r.Description = in.Description
		}
		if maxSession != 0 {
			r.MaxSessionDuration = maxSession
		}
		return putRole(tx, r)
	})
	if err != nil {
		return nil, err
	}
	return &iam.UpdateRoleOutput{}, nil
}

// UpdateAssumeRolePolicy replaces a role's trust policy.
func (s *Service) UpdateAssumeRolePolicy(ctx context.Context, in *iam.UpdateAssumeRolePolicyInput) (*iam.UpdateAssumeRolePolicyOutput, error) {
	if _, err := checkName(in.RoleName, "roleName", 64); err != nil {
		return nil, err
	}
	trust, err := checkTrustPolicy(in.PolicyDocument)
	if err != nil {
		return nil, err
	}
	err = s.db.Update(func(tx *store.Tx) error {
		r, err := roleNamed(tx, in.RoleName)
		if err != nil {
			return err
		}
		r.TrustPolicy = trust
		return putRole(tx, r)
	})
	if err != nil {
		return nil, err
	}
	return &iam.UpdateAssumeRolePolicyOutput{}, nil
}

// DeleteRole deletes a role that is in no instance profile and has no
// policies, as IAM requires.
func (s *Service) DeleteRole(ctx context.Context, in *iam.DeleteRoleInput) (*iam.DeleteRoleOutput, error) {
	err := s.db.Update(func(tx *store.Tx) error {
		r, err := roleNamed(tx, in.RoleName)
		if err != nil {
			return err
		}
		profiles, err := profilesOfRole(tx, r.Name)
		if err != nil {
			return err
		}
		switch {
		case len(profiles) > 0:
			return deleteConflict("Cannot delete entity, must remove roles from instance profile first.")
		case len(r.Attached) > 0:
			return deleteConflict("Cannot delete entity, must detach all policies first.")
		case len(r.Inline) > 0:
			return deleteConflict("Cannot delete entity, must delete policies first.")
		}
		return tx.Delete(bucketRoles, key(r.Name))
	})
	if err != nil {
		return nil, err
	}
	s.log.Info("deleted role", "role", deref(in.RoleName))
	return &iam.DeleteRoleOutput{}, nil
}

// TagRole adds or replaces tags of a role.
func (s *Service) TagRole(ctx context.Context, in *iam.TagRoleInput) (*iam.TagRoleOutput, error) {
	err := s.db.Update(func(tx *store.Tx) error {
		r, err := roleNamed(tx, in.RoleName)
		if err != nil {
			return err
		}
		if r.Tags, err = mergeTags(r.Tags, in.Tags); err != nil {
			return err
		}
		return putRole(tx, r)
	})
	if err != nil {
		return nil, err
	}
	return &iam.TagRoleOutput{}, nil
}

// UntagRole removes tags (by key, regardless of case) from a role.
func (s *Service) UntagRole(ctx context.Context, in *iam.UntagRoleInput) (*iam.UntagRoleOutput, error) {
	err := s.db.Update(func(tx *store.Tx) error {
		r, err := roleNamed(tx, in.RoleName)
		if err != nil {
			return err
		}
		var keep []tag
		for _, t := range r.Tags {
			drop := false
			for _, k := range in.TagKeys {
				if strings.EqualFold(k, t.Key) {
					drop = true
				}
			}
			if !drop {
				keep = append(keep, t)
			}
		}
		r.Tags = keep
		return putRole(tx, r)
	})
	if err != nil {
		return nil, err
	}
	return &iam.UntagRoleOutput{}, nil
}

// ListRoleTags lists a role's tags.
func (s *Service) ListRoleTags(ctx context.Context, in *iam.ListRoleTagsInput) (*iam.ListRoleTagsOutput, error) {
	p, err := newPage(in.Marker, in.MaxItems)
	if err != nil {
		return nil, err
	}
	var r *roleRecord
	if err := s.db.View(func(tx *store.Tx) (err error) { r, err = roleNamed(tx, in.RoleName); return err }); err != nil {
		return nil, err
	}
	keys := make([]string, len(r.Tags))
	byKey := map[string]tag{}
	for i, t := range r.Tags {
		keys[i] = t.Key
		byKey[t.Key] = t
	}
	sort.Strings(keys)
	window, truncated, next := p.cut(keys)
	out := &iam.ListRoleTagsOutput{Tags: []types.Tag{}, IsTruncated: truncated, Marker: next}
	for _, k := range window {
		out.Tags = append(out.Tags, types.Tag{Key: ptr(k), Value: ptr(byKey[k].Value)})
	}
	return out, nil
}

// RoleInfo is what STS needs of a role.
type RoleInfo struct {
	Name, ID, ARN, Path string
	MaxSessionDuration  time.Duration
	// ReadOnly: every policy of the role grants only reads (see readOnly).
	ReadOnly bool
}

// Role returns the role named name (regardless of case), or an error
// wrapping ErrNotFound.
func (s *Service) Role(tx *store.Tx, name string) (RoleInfo, error) {
	var r roleRecord
	if err := tx.Get(bucketRoles, key(name), &r); err != nil {
		if errors.Is(err, store.ErrNotFound) {
			return RoleInfo{}, fmt.Errorf("role %s: %w", name, ErrNotFound)
		}
		return RoleInfo{}, err
	}
	return RoleInfo{Name: r.Name, ID: r.ID, ARN: r.ARN, Path: r.Path,
		MaxSessionDuration: time.Duration(r.MaxSessionDuration) * time.Second, ReadOnly: r.readOnly()}, nil
}

// DB is the state file the records live in, for callers that join IAM's
// records with their own in one transaction.
func (s *Service) DB() *store.DB { return s.db }
