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

// profileRecord is an instance profile as stored. It holds at most one
// role, by name, as IAM allows.
type profileRecord struct {
	Name, Path, ID, ARN string
	Created             time.Time
	Role                string // the role's name; "" for none
	Tags                []tag
}

func getProfile(tx *store.Tx, name string) (*profileRecord, error) {
	var p profileRecord
	if err := tx.Get(bucketProfiles, key(name), &p); err != nil {
		if errors.Is(err, store.ErrNotFound) {
			return nil, noSuchEntity("Instance Profile %s cannot be found.", name)
		}
		return nil, err
	}
	return &p, nil
}

func profileNamed(tx *store.Tx, name *string) (*profileRecord, error) {
	n, err := checkName(name, "instanceProfileName", 128)
	if err != nil {
		return nil, err
	}
	return getProfile(tx, n)
}

func (p *profileRecord) view(tx *store.Tx, withTags bool) (types.InstanceProfile, error) {
	v := types.InstanceProfile{Arn: ptr(p.ARN), CreateDate: ptr(p.Created), InstanceProfileId: ptr(p.ID),
		InstanceProfileName: ptr(p.Name), Path: ptr(p.Path), Roles: []types.Role{}}
	if p.Role != "" {
		r, err := getRole(tx, p.Role)
		if err != nil {
			return v, fmt.Errorf("instance profile %s names role %s: %w", p.Name, p.Role, err)
		}
		v.Roles = append(v.Roles, r.view(false))
	}
	if withTags && len(p.Tags) > 0 {
		v.Tags = tagsView(p.Tags)
	}
	return v, nil
}

// profilesOfRole returns the profiles that hold the role, by name.
func profilesOfRole(tx *store.Tx, role string) ([]profileRecord, error) {
	all, err := store.All[profileRecord](tx, bucketProfiles)
	if err != nil {
		return nil, err
	}
	var out []profileRecord
	for _, p := range all {
		if p.Role != "" && key(p.Role) == key(role) {
			out = append(out, p)
		}
	}
	sort.Slice(out, func(i, j int) bool { return key(out[i].Name) < key(out[j].Name) })
	return out, nil
}

// CreateInstanceProfile creates an empty instance profile.
func (s *Service) CreateInstanceProfile(ctx context.Context, in *iam.CreateInstanceProfileInput) (*iam.CreateInstanceProfileOutput, error) {
	name, err := checkName(in.InstanceProfileName, "instanceProfileName", 128)
	if err != nil {
		return nil, err
	}
	path, err := checkPath(in.Path, "path")
	if err != nil {
		return nil, err
	}
	tags, err := mergeTags(nil, in.Tags)
	if err != nil {
		return nil, err
	}
	var out types.InstanceProfile
	err = s.db.Update(func(tx *store.Tx) error {
		if tx.Has(bucketProfiles, key(name)) {
			return entityAlreadyExists("Instance Profile %s already exists.", name)
		}
		id, err := newID(tx, "AIPA")
		if err != nil {
			return err
		}
		p := &profileRecord{Name: name, Path: path, ID: id, ARN: fmt.Sprintf("arn:aws:iam::%s:instance-profile%s%s", s.account, path, name),
			Created: s.now().UTC().Truncate(time.Second), Tags: tags}
		if err := tx.Put(bucketProfiles, key(name), p); err != nil {
			return err
		}
		out, err = p.view(tx, true)
		return err
	})
	if err != nil {
		return nil, err
	}
	s.log.Info("created instance profile", "profile", name, "id", *out.InstanceProfileId)
	return &iam.CreateInstanceProfileOutput{InstanceProfile: &out}, nil
}

// GetInstanceProfile returns a profile with its role.
func (s *Service) GetInstanceProfile(ctx context.Context, in *iam.GetInstanceProfileInput) (*iam.GetInstanceProfileOutput, error) {
	var out types.InstanceProfile
	err := s.db.View(func(tx *store.Tx) error {
		p, err := profileNamed(tx, in.InstanceProfileName)
		if err != nil {
			return err
		}
		out, err = p.view(tx, true)
		return err
	})
	if err != nil {
		return nil, err
	}
	return &iam.GetInstanceProfileOutput{InstanceProfile: &out}, nil
}

// listProfiles pages through profiles that keep says to list.
func (s *Service) listProfiles(marker *string, maxItems *int32, pre func(tx *store.Tx) error, keep func(*profileRecord) bool) ([]types.InstanceProfile, bool, *string, error) {
	pg, err := newPage(marker, maxItems)
	if err != nil {
		return nil, false, nil, err
	}
	list := []types.InstanceProfile{}
	var (
		truncated bool
		next      *string
	)
	err = s.db.View(func(tx *store.Tx) error {
		if pre != nil {
			if err := pre(tx); err != nil {
				return err
			}
		}
		all, err := store.All[profileRecord](tx, bucketProfiles)
		if err != nil {
			return err
		}
		byKey := map[string]*profileRecord{}
		var keys []string
		for i := range all {
			if keep(&all[i]) {
				byKey[key(all[i].Name)] = &all[i]
				keys = append(keys, key(all[i].Name))
			}
		}
		sort.Strings(keys)
		var window []string
		window, truncated, next = pg.cut(keys)
		for _, k := range window {
			v, err := byKey[k].view(tx, false)
			if err != nil {
				return err
			}
			list = append(list, v)
		}
		return nil
	})
	return list, truncated, next, err
}

// ListInstanceProfiles lists profiles, optionally under a path prefix.
func (s *Service) ListInstanceProfiles(ctx context.Context, in *iam.ListInstanceProfilesInput) (*iam.ListInstanceProfilesOutput, error) {
	prefix, err := checkPathPrefix(in.PathPrefix)
	if err != nil {
		return nil, err
	}
	list, truncated, next, err := s.listProfiles(in.Marker, in.MaxItems, nil, func(p *profileRecord) bool { return strings.HasPrefix(p.Path, prefix) })
	if err != nil {
		return nil, err
	}
	return &iam.ListInstanceProfilesOutput{InstanceProfiles: list, IsTruncated: truncated, Marker: next}, nil
}

// ListInstanceProfilesForRole lists the profiles that hold a role.
func (s *Service) ListInstanceProfilesForRole(ctx context.Context, in *iam.ListInstanceProfilesForRoleInput) (*iam.ListInstanceProfilesForRoleOutput, error) {
	var role string
	list, truncated, next, err := s.listProfiles(in.Marker, in.MaxItems,
		func(tx *store.Tx) error {
			r, err := roleNamed(tx, in.RoleName)
			if err == nil {
				role = r.Name
			}
			return err
		},
		func(p *profileRecord) bool { return p.Role != "" && key(p.Role) == key(role) })
	if err != nil {
		return nil, err
	}
	return &iam.ListInstanceProfilesForRoleOutput{InstanceProfiles: list, IsTruncated: truncated, Marker: next}, nil
}

// AddRoleToInstanceProfile puts a role in a profile; a profile holds one.
func (s *Service) AddRoleToInstanceProfile(ctx context.Context, in *iam.AddRoleToInstanceProfileInput) (*iam.AddRoleToInstanceProfileOutput, error) {
	err := s.db.Update(func(tx *store.Tx) error {
		p, err := profileNamed(tx, in.InstanceProfileName)
		if err != nil {
			return err
		}
		r, err := roleNamed(tx, in.RoleName)
		if err != nil {
			return err
		}
		if p.Role != "" {
			return limitExceeded("Cannot exceed quota for InstanceSessionsPerInstanceProfile: 1")
		}
		p.Role = r.Name
		return tx.Put(bucketProfiles, key(p.Name), p)
	})
	if err != nil {
		return nil, err
	}
	s.log.Info("added role to instance profile", "profile", deref(in.InstanceProfileName), "role", deref(in.RoleName))
	return &iam.AddRoleToInstanceProfileOutput{}, nil
}

// RemoveRoleFromInstanceProfile empties a profile.
func (s *Service) RemoveRoleFromInstanceProfile(ctx context.Context, in *iam.RemoveRoleFromInstanceProfileInput) (*iam.RemoveRoleFromInstanceProfileOutput, error) {
	err := s.db.Update(func(tx *store.Tx) error {
		p, err := profileNamed(tx, in.InstanceProfileName)
		if err != nil {
			return err
		}
		r, err := roleNamed(tx, in.RoleName)
		if err != nil {
			return err
		}
		if p.Role == "" || key(p.Role) != key(r.Name) {
			return noSuchEntity("The role with name %s cannot be found in instance profile %s.", r.Name, p.Name)
		}
		p.Role = ""
		return tx.Put(bucketProfiles, key(p.Name), p)
	})
	if err != nil {
		return nil, err
	}
	return &iam.RemoveRoleFromInstanceProfileOutput{}, nil
}

// DeleteInstanceProfile deletes a profile that holds no role.
func (s *Service) DeleteInstanceProfile(ctx context.Context, in *iam.DeleteInstanceProfileInput) (*iam.DeleteInstanceProfileOutput, error) {
	err := s.db.Update(func(tx *store.Tx) error {
		p, err := profileNamed(tx, in.InstanceProfileName)
		if err != nil {
			return err
		}
		if p.Role != "" {
			return deleteConflict("Cannot delete entity, must remove roles from instance profile first.")
		}
		return tx.Delete(bucketProfiles, key(p.Name))
	})
	if err != nil {
		return nil, err
	}
	return &iam.DeleteInstanceProfileOutput{}, nil
}

// InstanceProfileInfo is what EC2 needs of an instance profile.
type InstanceProfileInfo struct {
	Name, ID, ARN string
	// RoleName is "" when the profile holds no role.
	RoleName, RoleARN, RoleID string
}

// InstanceProfile finds a profile by ARN (which must be this account's
// and carry the profile's path) or, when arn is "", by name. A profile
// that does not exist is an error wrapping ErrNotFound.
func (s *Service) InstanceProfile(tx *store.Tx, arn, name string) (InstanceProfileInfo, error) {
	if arn != "" {
		prefix := "arn:aws:iam::" + s.account + ":instance-profile/"
		if !strings.HasPrefix(arn, prefix) {
			return InstanceProfileInfo{}, fmt.Errorf("instance profile %s: %w", arn, ErrNotFound)
		}
		name = arn[strings.LastIndexByte(arn, '/')+1:]
	}
	var p profileRecord
	if err := tx.Get(bucketProfiles, key(name), &p); err != nil {
		if errors.Is(err, store.ErrNotFound) {
			return InstanceProfileInfo{}, fmt.Errorf("instance profile %s: %w", name, ErrNotFound)
		}
		return InstanceProfileInfo{}, err
	}
	if arn != "" && arn != p.ARN {
		return InstanceProfileInfo{}, fmt.Errorf("instance profile %s: %w", arn, ErrNotFound)
	}
	info := InstanceProfileInfo{Name: p.Name, ID: p.ID, ARN: p.ARN}
	if p.Role != "" {
		r, err := getRole(tx, p.Role)
		if err != nil {
			return InstanceProfileInfo{}, fmt.Errorf("instance profile %s names role %s: %w", p.Name, p.Role, err)
		}
		info.RoleName, info.RoleARN, info.RoleID = r.Name, r.ARN, r.ID
	}
	return info, nil
}
