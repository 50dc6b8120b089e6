package ec2

import (
	"context"
	"errors"
	"time"

	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"

	"hangar.dev/hangar/services/gateway/awserr"
	"hangar.dev/hangar/services/gateway/iam"
	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/internal/store"
)

// Identity is IAM and STS as EC2 needs them for instance profiles (the
// gateway's *sts.Service). Both work inside EC2's own transaction on the
// state file they share, so associating a profile, recording it on the
// instance and issuing its first credentials happen together or not at
// all.
type Identity interface {
	// InstanceProfile finds a profile by ARN, or by name when arn is "";
	// a missing one is an error wrapping iam.ErrNotFound.
	InstanceProfile(tx *store.Tx, arn, name string) (iam.InstanceProfileInfo, error)
	// IssueRoleCredentials issues temporary credentials of a role.
	IssueRoleCredentials(tx *store.Tx, roleName, sessionName string, lifetime time.Duration) (api.IAMCredentials, error)
}

// Role credentials as EC2 serves them through IMDS: valid six hours,
// replaced when less than an hour is left, so a client that fetched them
// always has an hour or more.
const (
	roleCredentialLifetime = 6 * time.Hour
	roleCredentialRefresh  = time.Hour
	roleCredentialTick     = time.Minute
)

// kindProfileAssoc is an instance's association with an instance profile.
var kindProfileAssoc = register(&kind{Prefix: "iip-assoc", NotFound: "InvalidAssociationID.NotFound",
	Malformed: "InvalidAssociationID.Malformed", Noun: "association ID"})

// profileAssociation is the record of one association, with the role
// credentials IMDS currently serves for it.
type profileAssociation struct {
	ID, InstanceID                     string
	ProfileARN, ProfileID, ProfileName string
	// RoleName and RoleID are the profile's role when the credentials
	// were issued; "" while the profile holds none.
	RoleName, RoleID string
	Credentials      api.IAMCredentials
	Created          time.Time
}

func (a *profileAssociation) view(state types.IamInstanceProfileAssociationState) types.IamInstanceProfileAssociation {
	return types.IamInstanceProfileAssociation{AssociationId: ptr(a.ID), InstanceId: ptr(a.InstanceID), State: state,
		IamInstanceProfile: &types.IamInstanceProfile{Arn: ptr(a.ProfileARN), Id: ptr(a.ProfileID)}, Timestamp: ptr(a.Created)}
}

// associationOf returns the association of an instance, or nil.
func associationOf(tx *store.Tx, instanceID string) (*profileAssociation, error) {
	var found *profileAssociation
	err := tx.Each(kindProfileAssoc.Prefix, "", func(_ string, decode func(any) error) (bool, error) {
		var a profileAssociation
		if err := decode(&a); err != nil {
			return false, err
		}
		if a.InstanceID == instanceID {
			found = &a
			return false, nil
		}
		return true, nil
	})
	return found, err
}

// resolveProfile finds the profile a request names, worded as EC2 words a
// profile it cannot use.
func (s *Service) resolveProfile(tx *store.Tx, spec *types.IamInstanceProfileSpecification) (iam.InstanceProfileInfo, error) {
	if spec == nil || (spec.Arn == nil && spec.Name == nil) {
		return iam.InstanceProfileInfo{}, awserr.MissingParameter("IamInstanceProfile")
	}
	if spec.Arn != nil && spec.Name != nil {
		return iam.InstanceProfileInfo{}, awserr.InvalidParameterCombination("The parameter 'iamInstanceProfile.name' may not be used in combination with 'iamInstanceProfile.arn'")
	}
	if s.identity == nil {
		return iam.InstanceProfileInfo{}, awserr.New(400, "Unsupported", "This gateway was started without IAM, so instance profiles cannot be used.")
	}
	info, err := s.identity.InstanceProfile(tx, deref(spec.Arn), deref(spec.Name))
	if errors.Is(err, iam.ErrNotFound) {
		if spec.Arn != nil {
			return info, awserr.InvalidParameterValue("Value (%s) for parameter iamInstanceProfile.arn is invalid. Invalid IAM Instance Profile ARN", clip(*spec.Arn))
		}
		return info, awserr.InvalidParameterValue("Value (%s) for parameter iamInstanceProfile.name is invalid. Invalid IAM Instance Profile name", clip(*spec.Name))
	}
	return info, err
}

// associate records that instanceID uses profile, with credentials of its
// role (issued with the instance id as session name, as EC2 does).
func (s *Service) associate(tx *store.Tx, instanceID string, p iam.InstanceProfileInfo) (*profileAssociation, error) {
	id, err := newID(tx, kindProfileAssoc.Prefix)
	if err != nil {
		return nil, err
	}
	a := &profileAssociation{ID: id, InstanceID: instanceID, ProfileARN: p.ARN, ProfileID: p.ID, ProfileName: p.Name,
		Created: s.now().UTC().Truncate(time.Second)}
	if err := s.issueFor(tx, a, p); err != nil {
		return nil, err
	}
	return a, put(tx, kindProfileAssoc, id, a)
}

// issueFor gives a the credentials of p's role, or none when p has none.
func (s *Service) issueFor(tx *store.Tx, a *profileAssociation, p iam.InstanceProfileInfo) error {
	a.RoleName, a.RoleID, a.Credentials = p.RoleName, p.RoleID, api.IAMCredentials{}
	if p.RoleName == "" {
		return nil
	}
	c, err := s.identity.IssueRoleCredentials(tx, p.RoleName, a.InstanceID, roleCredentialLifetime)
	if err != nil {
		return err
	}
	a.Credentials = c
	return nil
}

// launchProfile is RunInstances' IamInstanceProfile: it resolves the
// profile, records the association of the new instance with it and issues
// its first credentials, all in the launch's transaction, and returns what
// the instance record shows (nil when spec is nil).
func (s *Service) launchProfile(tx *store.Tx, instanceID string, spec *types.IamInstanceProfileSpecification) (*types.IamInstanceProfile, error) {
	if spec == nil {
		return nil, nil
	}
	p, err := s.resolveProfile(tx, spec)
	if err != nil {
		return nil, err
	}
	if _, err := s.associate(tx, instanceID, p); err != nil {
		return nil, err
	}
	return &types.IamInstanceProfile{Arn: ptr(p.ARN), Id: ptr(p.ID)}, nil
}

// instanceIdentity fills in what IMDS serves about the instance's identity:
// its profile's role and credentials when it has one, and the identity
// document, signed by the gateway, when a signer is set.
func (s *Service) instanceIdentity(tx *store.Tx, parts *instanceParts, md *api.InstanceMetadata) {
	a, err := associationOf(tx, md.InstanceID)
	if err != nil {
		s.log.Error("reading the instance profile association", "instance", md.InstanceID, "err", err)
	}
	if a != nil && a.RoleName != "" && a.Credentials.AccessKeyID != "" {
		md.IAMRole, md.IAMProfileArn, md.IAMProfileID, md.Credentials = a.RoleName, a.ProfileARN, a.ProfileID, a.Credentials
	}
	if s.signer == nil {
		return
	}
	ip := ""
	if len(parts.enis) > 0 {
		ip = deref(parts.enis[0].PrivateIpAddress)
	}
	doc := IdentityDocument(*md, ip, string(parts.rec.Architecture))
	sig, p7, err := s.signer.Sign([]byte(doc))
	if err != nil {
		s.log.Error("signing the identity document; IMDS serves an unsigned one", "instance", md.InstanceID, "err", err)
		return
	}
	md.IdentityDocument, md.IdentitySignature, md.IdentityPKCS7 = doc, sig, p7
}

// associableInstance loads an instance that may take a profile.
func associableInstance(tx *store.Tx, id *string) (*instanceRecord, error) {
	if id == nil {
		return nil, awserr.MissingParameter("InstanceId")
	}
	rec, err := get[instanceRecord](tx, kindInstance, *id)
	if err != nil {
		return nil, err
	}
	switch rec.state() {
	case types.InstanceStateNameShuttingDown, types.InstanceStateNameTerminated:
		return nil, awserr.New(400, "IncorrectInstanceState", "The instance '%s' is not in a state from which an instance profile can be associated.", *id)
	}
	return rec, nil
}

// pushIdentity sends the instance's metadata to netd after its profile
// changed. netd being away is not the caller's problem: the gateway pushes
// every instance's metadata again when netd returns.
func (s *Service) pushIdentity(ctx context.Context, instanceID string) {
	if err := s.pushMetadata(ctx, instanceID); err != nil {
		s.log.Warn("pushing instance metadata after a profile change", "instance", instanceID, "err", err)
	}
}

// AssociateIamInstanceProfile attaches a profile to an instance that has
// none.
func (s *Service) AssociateIamInstanceProfile(ctx context.Context, in *ec2.AssociateIamInstanceProfileInput) (*ec2.AssociateIamInstanceProfileOutput, error) {
	var a *profileAssociation
	err := s.db.Update(func(tx *store.Tx) error {
		rec, err := associableInstance(tx, in.InstanceId)
		if err != nil {
			return err
		}
		p, err := s.resolveProfile(tx, in.IamInstanceProfile)
		if err != nil {
			return err
		}
		if cur, err := associationOf(tx, *in.InstanceId); err != nil {
			return err
		} else if cur != nil {
			return awserr.New(400, "IncorrectState", "There is an existing association for instance %s", *in.InstanceId)
		}
		if a, err = s.associate(tx, *in.InstanceId, p); err != nil {
			return err
		}
		rec.IamInstanceProfile = &types.IamInstanceProfile{Arn: ptr(p.ARN), Id: ptr(p.ID)}
		return put(tx, kindInstance, *in.InstanceId, rec)
	})
	if err != nil {
		return nil, err
	}
	s.log.Info("associated instance profile", "instance", a.InstanceID, "profile", a.ProfileName, "role", a.RoleName, "association", a.ID)
	s.pushIdentity(ctx, a.InstanceID)
	return &ec2.AssociateIamInstanceProfileOutput{IamInstanceProfileAssociation: ptr(a.view(types.IamInstanceProfileAssociationStateAssociating))}, nil
}

var profileAssocFilters = filterSet[profileAssociation]{
	"instance-id": func(a *profileAssociation) []string { return []string{a.InstanceID} },
	"state": func(*profileAssociation) []string {
		return []string{string(types.IamInstanceProfileAssociationStateAssociated)}
	},
}

// DescribeIamInstanceProfileAssociations lists associations by id or
// filter (instance-id, state).
func (s *Service) DescribeIamInstanceProfileAssociations(ctx context.Context, in *ec2.DescribeIamInstanceProfileAssociationsInput) (*ec2.DescribeIamInstanceProfileAssociationsOutput, error) {
	if len(in.AssociationIds) > 0 && in.MaxResults != nil {
		return nil, awserr.InvalidParameterCombination("The parameter AssociationIds cannot be used with the parameter MaxResults")
	}
	p, err := newPager(in.MaxResults, in.NextToken, 5, 1000)
	if err != nil {
		return nil, err
	}
	match, err := profileAssocFilters.compile(in.Filters)
	if err != nil {
		return nil, err
	}
	out := &ec2.DescribeIamInstanceProfileAssociationsOutput{IamInstanceProfileAssociations: []types.IamInstanceProfileAssociation{}}
	err = s.db.View(func(tx *store.Tx) error {
		next, err := list(tx, kindProfileAssoc, in.AssociationIds, match, p, func(_ string, a *profileAssociation, _ []types.Tag) {
			out.IamInstanceProfileAssociations = append(out.IamInstanceProfileAssociations, a.view(types.IamInstanceProfileAssociationStateAssociated))
		})
		out.NextToken = next
		return err
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// DisassociateIamInstanceProfile detaches a profile from its instance.
// Credentials already issued stay valid until they expire, as in EC2;
// IMDS stops serving them at once.
func (s *Service) DisassociateIamInstanceProfile(ctx context.Context, in *ec2.DisassociateIamInstanceProfileInput) (*ec2.DisassociateIamInstanceProfileOutput, error) {
	if in.AssociationId == nil {
		return nil, awserr.MissingParameter("AssociationId")
	}
	var a *profileAssociation
	err := s.db.Update(func(tx *store.Tx) (err error) {
		if a, err = get[profileAssociation](tx, kindProfileAssoc, *in.AssociationId); err != nil {
			return err
		}
		if err := tx.Delete(kindProfileAssoc.Prefix, a.ID); err != nil {
			return err
		}
		rec, err := get[instanceRecord](tx, kindInstance, a.InstanceID)
		if err != nil {
			return nil // the instance is gone already
		}
		rec.IamInstanceProfile = nil
		return put(tx, kindInstance, a.InstanceID, rec)
	})
	if err != nil {
		return nil, err
	}
	s.log.Info("disassociated instance profile", "instance", a.InstanceID, "profile", a.ProfileName, "association", a.ID)
	s.pushIdentity(ctx, a.InstanceID)
	return &ec2.DisassociateIamInstanceProfileOutput{IamInstanceProfileAssociation: ptr(a.view(types.IamInstanceProfileAssociationStateDisassociating))}, nil
}

// ReplaceIamInstanceProfileAssociation swaps an instance's profile for
// another without a moment with none: a new association replaces the old.
func (s *Service) ReplaceIamInstanceProfileAssociation(ctx context.Context, in *ec2.ReplaceIamInstanceProfileAssociationInput) (*ec2.ReplaceIamInstanceProfileAssociationOutput, error) {
	if in.AssociationId == nil {
		return nil, awserr.MissingParameter("AssociationId")
	}
	var a *profileAssociation
	err := s.db.Update(func(tx *store.Tx) error {
		old, err := get[profileAssociation](tx, kindProfileAssoc, *in.AssociationId)
		if err != nil {
			return err
		}
		rec, err := associableInstance(tx, &old.InstanceID)
		if err != nil {
			return err
		}
		p, err := s.resolveProfile(tx, in.IamInstanceProfile)
		if err != nil {
			return err
		}
		if err := tx.Delete(kindProfileAssoc.Prefix, old.ID); err != nil {
			return err
		}
		if a, err = s.associate(tx, old.InstanceID, p); err != nil {
			return err
		}
		rec.IamInstanceProfile = &types.IamInstanceProfile{Arn: ptr(p.ARN), Id: ptr(p.ID)}
		return put(tx, kindInstance, old.InstanceID, rec)
	})
	if err != nil {
		return nil, err
	}
	s.log.Info("replaced instance profile", "instance", a.InstanceID, "profile", a.ProfileName, "association", a.ID, "replaced", *in.AssociationId)
	s.pushIdentity(ctx, a.InstanceID)
	return &ec2.ReplaceIamInstanceProfileAssociationOutput{IamInstanceProfileAssociation: ptr(a.view(types.IamInstanceProfileAssociationStateAssociating))}, nil
}

// StartRoleCredentials keeps every instance's role credentials fresh until
// ctx ends: once a minute it replaces credentials with less than an hour
// left, follows a profile whose role changed or that was deleted, drops
// associations of instances that are gone, and pushes the metadata of
// every instance it changed to netd.
func (s *Service) StartRoleCredentials(ctx context.Context) {
	if s.identity == nil {
		return
	}
	go func() {
		t := time.NewTicker(roleCredentialTick)
		defer t.Stop()
		for {
			if err := s.refreshRoleCredentials(ctx); err != nil && ctx.Err() == nil {
				s.log.Error("refreshing instance role credentials", "err", err)
			}
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
		}
	}()
}

// refreshRoleCredentials is one pass of StartRoleCredentials.
func (s *Service) refreshRoleCredentials(ctx context.Context) error {
	var ids []string
	err := s.db.View(func(tx *store.Tx) error {
		return tx.Each(kindProfileAssoc.Prefix, "", func(id string, _ func(any) error) (bool, error) {
			ids = append(ids, id)
			return true, nil
		})
	})
	if err != nil {
		return err
	}
	var firstErr error
	for _, id := range ids {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		instance, changed, err := s.refreshAssociation(id)
		if err != nil {
			s.log.Error("refreshing role credentials", "association", id, "err", err)
			if firstErr == nil {
				firstErr = err
			}
			continue
		}
		if changed {
			s.pushIdentity(ctx, instance)
		}
	}
	return firstErr
}

// refreshAssociation measures one association against its instance and
// profile, and acts on what changed. It reports the instance and whether
// what IMDS serves it changed.
func (s *Service) refreshAssociation(id string) (instance string, changed bool, err error) {
	err = s.db.Update(func(tx *store.Tx) error {
		var a profileAssociation
		if err := tx.Get(kindProfileAssoc.Prefix, id, &a); err != nil {
			if errors.Is(err, store.ErrNotFound) {
				return nil // disassociated meanwhile
			}
			return err
		}
		instance = a.InstanceID
		rec, err := get[instanceRecord](tx, kindInstance, a.InstanceID)
		if err != nil || rec.state() == types.InstanceStateNameTerminated {
			// Terminated (or never launched): EC2 drops its association.
			return tx.Delete(kindProfileAssoc.Prefix, id)
		}
		p, err := s.identity.InstanceProfile(tx, "", a.ProfileName)
		switch {
		case errors.Is(err, iam.ErrNotFound) || err == nil && p.ID != a.ProfileID:
			// The profile was deleted: the instance keeps its
			// association, as in EC2, and gets no credentials.
			p = iam.InstanceProfileInfo{}
		case err != nil:
			return err
		}
		exp := time.Unix(a.Credentials.Expiration, 0)
		switch {
		case p.RoleID != a.RoleID:
		case p.RoleName != "" && exp.Sub(s.now()) < roleCredentialRefresh:
		default:
			return nil // nothing to do
		}
		if err := s.issueFor(tx, &a, p); err != nil {
			return err
		}
		changed = true
		return put(tx, kindProfileAssoc, id, &a)
	})
	return instance, changed, err
}
