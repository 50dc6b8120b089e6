package iam

import (
	"context"
	"sort"
	"strings"

	"github.com/aws/aws-sdk-go-v2/service/iam"
	"github.com/aws/aws-sdk-go-v2/service/iam/types"

	"hangar.dev/hangar/services/internal/store"
)

// PutRolePolicy adds or replaces an inline policy of a role.
func (s *Service) PutRolePolicy(ctx context.Context, in *iam.PutRolePolicyInput) (*iam.PutRolePolicyOutput, error) {
	if _, err := checkName(in.RoleName, "roleName", 64); err != nil {
		return nil, err
	}
	name, err := checkName(in.PolicyName, "policyName", 128)
	if err != nil {
		return nil, err
	}
	if in.PolicyDocument == nil {
		return nil, missing("policyDocument")
	}
	doc := *in.PolicyDocument
	if _, err := parsePolicy(doc, permissionPolicy); err != nil {
		return nil, err
	}
	err = s.db.Update(func(tx *store.Tx) error {
		r, err := roleNamed(tx, in.RoleName)
		if err != nil {
			return err
		}
		var keep []inlinePolicy
		size := policySize(doc)
		for _, p := range r.Inline {
			if p.Name != name {
				keep = append(keep, p)
				size += policySize(p.Document)
			}
		}
		if size > maxInlinePolicySize {
			return limitExceeded("Maximum policy size of %d bytes exceeded for role %s", maxInlinePolicySize, r.Name)
		}
		r.Inline = append(keep, inlinePolicy{Name: name, Document: doc})
		sort.Slice(r.Inline, func(i, j int) bool { return r.Inline[i].Name < r.Inline[j].Name })
		return putRole(tx, r)
	})
	if err != nil {
		return nil, err
	}
	s.log.Info("put role policy", "role", deref(in.RoleName), "policy", name)
	return &iam.PutRolePolicyOutput{}, nil
}

// GetRolePolicy returns an inline policy's document (URL-encoded, as IAM
// returns it).
func (s *Service) GetRolePolicy(ctx context.Context, in *iam.GetRolePolicyInput) (*iam.GetRolePolicyOutput, error) {
	name, err := checkName(in.PolicyName, "policyName", 128)
	if err != nil {
		return nil, err
	}
	var r *roleRecord
	if err := s.db.View(func(tx *store.Tx) (err error) { r, err = roleNamed(tx, in.RoleName); return err }); err != nil {
		return nil, err
	}
	for _, p := range r.Inline {
		if p.Name == name {
			return &iam.GetRolePolicyOutput{RoleName: ptr(r.Name), PolicyName: ptr(p.Name), PolicyDocument: encodeDocument(p.Document)}, nil
		}
	}
	return nil, noSuchEntity("The role policy with name %s cannot be found.", name)
}

// ListRolePolicies lists the names of a role's inline policies.
func (s *Service) ListRolePolicies(ctx context.Context, in *iam.ListRolePoliciesInput) (*iam.ListRolePoliciesOutput, error) {
	p, err := newPage(in.Marker, in.MaxItems)
	if err != nil {
		return nil, err
	}
	var r *roleRecord
	if err := s.db.View(func(tx *store.Tx) (err error) { r, err = roleNamed(tx, in.RoleName); return err }); err != nil {
		return nil, err
	}
	var names []string
	for _, ip := range r.Inline {
		names = append(names, ip.Name)
	}
	window, truncated, next := p.cut(names)
	return &iam.ListRolePoliciesOutput{PolicyNames: append([]string{}, window...), IsTruncated: truncated, Marker: next}, nil
}

// DeleteRolePolicy deletes an inline policy.
func (s *Service) DeleteRolePolicy(ctx context.Context, in *iam.DeleteRolePolicyInput) (*iam.DeleteRolePolicyOutput, error) {
	name, err := checkName(in.PolicyName, "policyName", 128)
	if err != nil {
		return nil, err
	}
	err = s.db.Update(func(tx *store.Tx) error {
		r, err := roleNamed(tx, in.RoleName)
		if err != nil {
			return err
		}
		for i, p := range r.Inline {
			if p.Name == name {
				r.Inline = append(r.Inline[:i], r.Inline[i+1:]...)
				return putRole(tx, r)
			}
		}
		return noSuchEntity("The role policy with name %s cannot be found.", name)
	})
	if err != nil {
		return nil, err
	}
	return &iam.DeleteRolePolicyOutput{}, nil
}

// checkPolicyARN validates a managed policy ARN and requires it to be one
// of the AWS-managed policies hangar knows: hangar has no customer-managed
// policies (CreatePolicy).
func (s *Service) checkPolicyARN(v *string) (string, error) {
	if v == nil {
		return "", missing("policyArn")
	}
	arn := *v
	if len(arn) < 20 || len(arn) > 2048 || !strings.HasPrefix(arn, "arn:aws:iam::") || !strings.Contains(arn, ":policy/") {
		return "", invalidInput("ARN %s is not valid.", clip(arn))
	}
	if _, ok := awsManaged[arn]; !ok {
		return "", noSuchEntity("Policy %s does not exist or is not attachable.", arn)
	}
	return arn, nil
}

// AttachRolePolicy attaches an AWS-managed policy to a role.
func (s *Service) AttachRolePolicy(ctx context.Context, in *iam.AttachRolePolicyInput) (*iam.AttachRolePolicyOutput, error) {
	if _, err := checkName(in.RoleName, "roleName", 64); err != nil {
		return nil, err
	}
	arn, err := s.checkPolicyARN(in.PolicyArn)
	if err != nil {
		return nil, err
	}
	err = s.db.Update(func(tx *store.Tx) error {
		r, err := roleNamed(tx, in.RoleName)
		if err != nil {
			return err
		}
		for _, a := range r.Attached {
			if a == arn {
				return nil // attaching twice is not an error in IAM
			}
		}
		if len(r.Attached) >= maxAttached {
			return limitExceeded("Cannot exceed quota for PoliciesPerRole: %d", maxAttached)
		}
		r.Attached = append(r.Attached, arn)
		return putRole(tx, r)
	})
	if err != nil {
		return nil, err
	}
	s.log.Info("attached role policy", "role", deref(in.RoleName), "policy", arn)
	return &iam.AttachRolePolicyOutput{}, nil
}

// DetachRolePolicy detaches a managed policy from a role.
func (s *Service) DetachRolePolicy(ctx context.Context, in *iam.DetachRolePolicyInput) (*iam.DetachRolePolicyOutput, error) {
	if in.PolicyArn == nil {
		return nil, missing("policyArn")
	}
	arn := *in.PolicyArn
	err := s.db.Update(func(tx *store.Tx) error {
		r, err := roleNamed(tx, in.RoleName)
		if err != nil {
			return err
		}
		for i, a := range r.Attached {
			if a == arn {
				r.Attached = append(r.Attached[:i], r.Attached[i+1:]...)
				return putRole(tx, r)
			}
		}
		return noSuchEntity("Policy %s was not found.", clip(arn))
	})
	if err != nil {
		return nil, err
	}
	return &iam.DetachRolePolicyOutput{}, nil
}

// ListAttachedRolePolicies lists a role's managed policies.
func (s *Service) ListAttachedRolePolicies(ctx context.Context, in *iam.ListAttachedRolePoliciesInput) (*iam.ListAttachedRolePoliciesOutput, error) {
	p, err := newPage(in.Marker, in.MaxItems)
	if err != nil {
		return nil, err
	}
	prefix, err := checkPathPrefix(in.PathPrefix)
	if err != nil {
		return nil, err
	}
	var r *roleRecord
	if err := s.db.View(func(tx *store.Tx) (err error) { r, err = roleNamed(tx, in.RoleName); return err }); err != nil {
		return nil, err
	}
	var arns []string
	for _, a := range r.Attached {
		if strings.HasPrefix(policyPath(a), prefix) {
			arns = append(arns, a)
		}
	}
	sort.Strings(arns)
	window, truncated, next := p.cut(arns)
	out := &iam.ListAttachedRolePoliciesOutput{AttachedPolicies: []types.AttachedPolicy{}, IsTruncated: truncated, Marker: next}
	for _, a := range window {
		out.AttachedPolicies = append(out.AttachedPolicies, types.AttachedPolicy{PolicyArn: ptr(a), PolicyName: ptr(policyName(a))})
	}
	return out, nil
}
