// Package sts answers the STS actions: who a caller is (GetCallerIdentity)
// and temporary credentials (AssumeRole of an IAM role, GetSessionToken of
// the caller's own identity, and the role credentials EC2 serves to
// instances through IMDS). It keeps every temporary key it issued in the
// gateway's state file (bucket sts-sessions), with its expiry, and is the
// server's TemporaryKeys: the verifier finds those keys here.
//
// It never evaluates policies beyond iam's one rule: a session of a role
// whose policies (or whose session policies) grant only reads is
// read-only.
package sts

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"log/slog"
	"math/big"
	"net/http"
	"regexp"
	"strings"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sts"
	"github.com/aws/aws-sdk-go-v2/service/sts/types"

	"hangar.dev/hangar/services/gateway/awserr"
	"hangar.dev/hangar/services/gateway/iam"
	"hangar.dev/hangar/services/gateway/reqctx"
	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/internal/creds"
	"hangar.dev/hangar/services/internal/store"
)

const bucketSessions = "sts-sessions" // access key id → sessionRecord

// Retention is how long a temporary key is kept after it expired, so that
// a client still using it hears ExpiredToken rather than that the key is
// unknown.
const Retention = 7 * 24 * time.Hour

// Service implements STS. The zero value answers GetCallerIdentity only;
// New makes one that issues credentials.
type Service struct {
	iam     *iam.Service
	db      *store.DB
	account string
	log     *slog.Logger
	now     func() time.Time
}

// New makes STS over the IAM records (and their state file).
func New(i *iam.Service, log *slog.Logger) *Service {
	return &Service{iam: i, db: i.DB(), account: i.Account(), log: log, now: time.Now}
}

// sessionRecord is one temporary key.
type sessionRecord struct {
	AccessKeyID, SecretAccessKey, SessionToken string
	Issued, Expiration                         time.Time

	// A role session (AssumeRole, instance profiles).
	RoleName, RoleID, SessionName string
	// SessionReadOnly: the session policies given to AssumeRole grant
	// only reads.
	SessionReadOnly bool

	// A GetSessionToken session acts as the key it was issued to.
	Profile      string
	Access       creds.Access
	ParentARN    string
	ParentUserID string
}

func (r *sessionRecord) roleARN(account string) string {
	return fmt.Sprintf("arn:aws:sts::%s:assumed-role/%s/%s", account, r.RoleName, r.SessionName)
}

// GetCallerIdentity returns the verified caller.
func (*Service) GetCallerIdentity(ctx context.Context, _ *sts.GetCallerIdentityInput) (*sts.GetCallerIdentityOutput, error) {
	c := reqctx.From(ctx).Caller
	return &sts.GetCallerIdentityOutput{
		Account: aws.String(c.AccountID),
		Arn:     aws.String(c.ARN),
		UserId:  aws.String(c.UserID),
	}, nil
}

// STS's errors, as AWS words them.

func validationError(value, member, constraint string) *awserr.Error {
	return awserr.New(http.StatusBadRequest, "ValidationError",
		"1 validation error detected: Value '%s' at '%s' failed to satisfy constraint: %s", value, member, constraint)
}

func accessDenied(format string, args ...any) *awserr.Error {
	return awserr.New(http.StatusForbidden, "AccessDenied", format, args...)
}

// temporary reports whether the caller is itself an assumed role.
func temporaryRole(c *reqctx.Caller) bool {
	return strings.HasPrefix(c.ARN, "arn:aws:sts::")
}

var sessionNameRE = regexp.MustCompile(`^[\w+=,.@-]*$`)

func checkSessionName(v *string) (string, error) {
	if v == nil {
		return "", awserr.MissingParameter("RoleSessionName")
	}
	n := *v
	switch {
	case len(n) < 2:
		return "", validationError(n, "roleSessionName", "Member must have length greater than or equal to 2")
	case len(n) > 64:
		return "", validationError(n, "roleSessionName", "Member must have length less than or equal to 64")
	case !sessionNameRE.MatchString(n):
		return "", validationError(n, "roleSessionName", `Member must satisfy regular expression pattern: [\w+=,.@-]*`)
	}
	return n, nil
}

// roleNameOf returns the role name of a role ARN of this account.
func (s *Service) roleNameOf(arn string) (name string, ok bool) {
	rest, ok := strings.CutPrefix(arn, "arn:aws:iam::"+s.account+":role/")
	if !ok || rest == "" || strings.HasSuffix(rest, "/") {
		return "", false
	}
	return rest[strings.LastIndexByte(rest, '/')+1:], true
}

// AssumeRole issues temporary credentials of a role to the account (its
// root key, a user key, or a GetSessionToken session of one).
func (s *Service) AssumeRole(ctx context.Context, in *sts.AssumeRoleInput) (*sts.AssumeRoleOutput, error) {
	caller := reqctx.From(ctx).Caller
	roleArn := aws.ToString(in.RoleArn)
	if len(roleArn) < 20 || len(roleArn) > 2048 {
		return nil, validationError(roleArn, "roleArn", "Member must have length between 20 and 2048")
	}
	session, err := checkSessionName(in.RoleSessionName)
	if err != nil {
		return nil, err
	}
	duration := int32(3600)
	if in.DurationSeconds != nil {
		duration = *in.DurationSeconds
		if duration < 900 {
			return nil, validationError(fmt.Sprint(duration), "durationSeconds", "Member must have value greater than or equal to 900")
		}
		if duration > 43200 {
			return nil, validationError(fmt.Sprint(duration), "durationSeconds", "Member must have value less than or equal to 43200")
		}
	}
	if in.SerialNumber != nil || in.TokenCode != nil {
		return nil, accessDenied("MultiFactorAuthentication failed: hangar has no MFA devices")
	}
	if len(in.Tags) > 0 || len(in.TransitiveTagKeys) > 0 {
		return nil, awserr.New(http.StatusBadRequest, "InvalidParameterValue", "Session tags are not supported by hangar; assume the role without --tags.")
	}
	if len(in.ProvidedContexts) > 0 {
		return nil, awserr.New(http.StatusBadRequest, "InvalidParameterValue", "Provided contexts are not supported by hangar.")
	}
	sessionRO, packed, err := sessionPolicies(in.Policy, in.PolicyArns)
	if err != nil {
		return nil, err
	}
	if temporaryRole(caller) {
		return nil, accessDenied("User: %s is not authorized to perform: sts:AssumeRole on resource: %s (hangar does not chain roles: assume roles with the account's own keys)", caller.ARN, roleArn)
	}
	denied := accessDenied("User: %s is not authorized to perform: sts:AssumeRole on resource: %s", caller.ARN, roleArn)
	name, ok := s.roleNameOf(roleArn)
	if !ok {
		return nil, denied
	}
	var rec *sessionRecord
	err = s.db.Update(func(tx *store.Tx) error {
		role, err := s.iam.Role(tx, name)
		if errors.Is(err, iam.ErrNotFound) || err == nil && role.ARN != roleArn {
			return denied
		}
		if err != nil {
			return err
		}
		if time.Duration(duration)*time.Second > role.MaxSessionDuration {
			return validationError(fmt.Sprint(duration), "durationSeconds",
				"The requested DurationSeconds exceeds the MaxSessionDuration set for this role.")
		}
		rec = &sessionRecord{RoleName: role.Name, RoleID: role.ID, SessionName: session, SessionReadOnly: sessionRO}
		return s.issue(tx, rec, time.Duration(duration)*time.Second)
	})
	if err != nil {
		return nil, err
	}
	s.log.Info("assumed role", "role", rec.RoleName, "session", session, "key", rec.AccessKeyID, "by", caller.ARN, "expires", rec.Expiration)
	out := &sts.AssumeRoleOutput{
		Credentials: credentialsOf(rec),
		AssumedRoleUser: &types.AssumedRoleUser{Arn: aws.String(rec.roleARN(s.account)),
			AssumedRoleId: aws.String(rec.RoleID + ":" + session)},
		SourceIdentity: in.SourceIdentity,
	}
	if packed > 0 {
		out.PackedPolicySize = aws.Int32(packed)
	}
	return out, nil
}

// maxSessionPolicy is AWS's limit on an inline session policy.
const maxSessionPolicy = 2048

// sessionPolicies checks AssumeRole's session policies and reports
// whether together they allow only reads (then the session is read-only
// whatever the role allows, as the session's permissions are the
// intersection), and the packed size as a percentage of the limit.
func sessionPolicies(doc *string, arns []types.PolicyDescriptorType) (readOnly bool, packed int32, err error) {
	if doc == nil && len(arns) == 0 {
		return false, 0, nil
	}
	readOnly = true
	if doc != nil {
		if len(*doc) > maxSessionPolicy {
			return false, 0, awserr.New(http.StatusBadRequest, "PackedPolicyTooLarge", "Packed size of consumed session policies exceeds the limit of %d characters.", maxSessionPolicy)
		}
		ro, err := iam.PolicyGrantsOnlyRead(*doc)
		if err != nil {
			return false, 0, err
		}
		readOnly = readOnly && ro
		packed = int32(len(*doc) * 100 / maxSessionPolicy)
	}
	if len(arns) > 10 {
		return false, 0, validationError(fmt.Sprint(len(arns)), "policyArns", "Member must have length less than or equal to 10")
	}
	for _, a := range arns {
		ro, known := iam.ManagedPolicyReadOnly(aws.ToString(a.Arn))
		if !known {
			return false, 0, awserr.New(http.StatusBadRequest, "InvalidParameterValue", "Policy %s does not exist or is not attachable.", aws.ToString(a.Arn))
		}
		readOnly = readOnly && ro
	}
	if packed == 0 {
		packed = 1
	}
	return readOnly, packed, nil
}

// GetSessionToken issues temporary credentials that act as the calling
// key: the same identity, the same access.
func (s *Service) GetSessionToken(ctx context.Context, in *sts.GetSessionTokenInput) (*sts.GetSessionTokenOutput, error) {
	caller := reqctx.From(ctx).Caller
	if caller.Key.SessionToken != "" {
		return nil, accessDenied("Cannot call GetSessionToken with session credentials")
	}
	if in.SerialNumber != nil || in.TokenCode != nil {
		return nil, accessDenied("MultiFactorAuthentication failed: hangar has no MFA devices")
	}
	duration := int32(43200)
	if in.DurationSeconds != nil {
		duration = *in.DurationSeconds
		if duration < 900 {
			return nil, validationError(fmt.Sprint(duration), "durationSeconds", "Member must have value greater than or equal to 900")
		}
		if duration > 129600 {
			return nil, validationError(fmt.Sprint(duration), "durationSeconds", "Member must have value less than or equal to 129600")
		}
	}
	if caller.Key.Root() && duration > 3600 {
		duration = 3600 // AWS holds the account's root sessions to an hour
	}
	rec := &sessionRecord{Profile: caller.Key.Profile, Access: caller.Key.Access, ParentARN: caller.ARN, ParentUserID: caller.UserID}
	if err := s.db.Update(func(tx *store.Tx) error { return s.issue(tx, rec, time.Duration(duration)*time.Second) }); err != nil {
		return nil, err
	}
	s.log.Info("issued session token", "for", caller.ARN, "key", rec.AccessKeyID, "expires", rec.Expiration)
	return &sts.GetSessionTokenOutput{Credentials: credentialsOf(rec)}, nil
}

func credentialsOf(r *sessionRecord) *types.Credentials {
	return &types.Credentials{AccessKeyId: aws.String(r.AccessKeyID), SecretAccessKey: aws.String(r.SecretAccessKey),
		SessionToken: aws.String(r.SessionToken), Expiration: aws.Time(r.Expiration)}
}

const (
	idAlphabet     = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"
	secretAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
)

func randomString(alphabet string, n int) (string, error) {
	var b strings.Builder
	max := big.NewInt(int64(len(alphabet)))
	for range n {
		i, err := rand.Int(rand.Reader, max)
		if err != nil {
			return "", fmt.Errorf("reading random bytes: %w", err)
		}
		b.WriteByte(alphabet[i.Int64()])
	}
	return b.String(), nil
}

// issue fills in r's key (an ASIA id no key ever had, a 40-character
// secret, an opaque session token) and times, and stores it.
func (s *Service) issue(tx *store.Tx, r *sessionRecord, lifetime time.Duration) error {
	for {
		tail, err := randomString(idAlphabet, 16)
		if err != nil {
			return err
		}
		r.AccessKeyID = "ASIA" + tail
		if !tx.Has(bucketSessions, r.AccessKeyID) {
			break
		}
	}
	secret, err := randomString(secretAlphabet, 40)
	if err != nil {
		return err
	}
	var tok [96]byte
	if _, err := rand.Read(tok[:]); err != nil {
		return fmt.Errorf("making a session token: %w", err)
	}
	r.SecretAccessKey, r.SessionToken = secret, base64.StdEncoding.EncodeToString(tok[:])
	r.Issued = s.now().UTC().Truncate(time.Second)
	r.Expiration = r.Issued.Add(lifetime)
	return tx.Put(bucketSessions, r.AccessKeyID, r)
}

// LookupTemporary finds a temporary key for the server: the caller it
// acts as and when it expires. A role session is read-only when its role's
// policies (now, not when it was issued) or its session policies grant
// only reads; a session of a role that was deleted is no key at all,
// unless it has expired anyway.
func (s *Service) LookupTemporary(accessKeyID string) (*reqctx.Caller, time.Time, bool) {
	if s.db == nil || !strings.HasPrefix(accessKeyID, "ASIA") {
		return nil, time.Time{}, false
	}
	var (
		c   *reqctx.Caller
		exp time.Time
	)
	err := s.db.View(func(tx *store.Tx) error {
		var r sessionRecord
		if err := tx.Get(bucketSessions, accessKeyID, &r); err != nil {
			return err
		}
		exp = r.Expiration
		key := creds.Key{Profile: r.Profile, AccessKeyID: r.AccessKeyID, SecretAccessKey: r.SecretAccessKey, SessionToken: r.SessionToken, Access: r.Access}
		if r.RoleName == "" {
			c = &reqctx.Caller{Key: key, AccountID: s.account, ARN: r.ParentARN, UserID: r.ParentUserID}
			return nil
		}
		key.Access = creds.FullAccess
		role, err := s.iam.Role(tx, r.RoleName)
		switch {
		case err == nil && role.ID == r.RoleID:
			if role.ReadOnly || r.SessionReadOnly {
				key.Access = creds.ReadOnlyAccess
			}
		case err == nil || errors.Is(err, iam.ErrNotFound):
			if s.now().Before(r.Expiration) {
				return store.ErrNotFound // the role it belonged to is gone
			}
		default:
			return err
		}
		c = &reqctx.Caller{Key: key, AccountID: s.account, ARN: r.roleARN(s.account), UserID: r.RoleID + ":" + r.SessionName}
		return nil
	})
	if err != nil {
		if !errors.Is(err, store.ErrNotFound) {
			s.log.Error("looking up a temporary key", "key", accessKeyID, "err", err)
		}
		return nil, time.Time{}, false
	}
	return c, exp, true
}

// InstanceProfile finds an instance profile for EC2 (by ARN, or by name
// when arn is ""), within EC2's transaction on the same state file.
func (s *Service) InstanceProfile(tx *store.Tx, arn, name string) (iam.InstanceProfileInfo, error) {
	return s.iam.InstanceProfile(tx, arn, name)
}

// IssueRoleCredentials issues credentials of a role for EC2 to serve to an
// instance through IMDS (session name: the instance id), within EC2's
// transaction on the same state file.
func (s *Service) IssueRoleCredentials(tx *store.Tx, roleName, sessionName string, lifetime time.Duration) (api.IAMCredentials, error) {
	role, err := s.iam.Role(tx, roleName)
	if err != nil {
		return api.IAMCredentials{}, fmt.Errorf("issuing credentials of role %s: %w", roleName, err)
	}
	r := &sessionRecord{RoleName: role.Name, RoleID: role.ID, SessionName: sessionName}
	if err := s.issue(tx, r, lifetime); err != nil {
		return api.IAMCredentials{}, fmt.Errorf("issuing credentials of role %s: %w", roleName, err)
	}
	s.log.Info("issued role credentials", "role", role.Name, "session", sessionName, "key", r.AccessKeyID, "expires", r.Expiration)
	return api.IAMCredentials{AccessKeyID: r.AccessKeyID, SecretAccessKey: r.SecretAccessKey, Token: r.SessionToken,
		Expiration: r.Expiration.Unix(), LastUpdated: r.Issued.Unix()}, nil
}

// Purge deletes the keys that expired more than Retention ago and returns
// how many it deleted.
func (s *Service) Purge() (int, error) {
	cutoff := s.now().Add(-Retention)
	n := 0
	err := s.db.Update(func(tx *store.Tx) error {
		var stale []string
		err := tx.Each(bucketSessions, "", func(id string, decode func(any) error) (bool, error) {
			var r sessionRecord
			if err := decode(&r); err != nil {
				return false, err
			}
			if r.Expiration.Before(cutoff) {
				stale = append(stale, id)
			}
			return true, nil
		})
		if err != nil {
			return err
		}
		for _, id := range stale {
			if err := tx.Delete(bucketSessions, id); err != nil {
				return err
			}
		}
		n = len(stale)
		return nil
	})
	return n, err
}

// RunPurge purges expired keys every hour until ctx ends.
func (s *Service) RunPurge(ctx context.Context) {
	t := time.NewTicker(time.Hour)
	defer t.Stop()
	for {
		if n, err := s.Purge(); err != nil {
			s.log.Error("purging expired temporary keys", "err", err)
		} else if n > 0 {
			s.log.Info("purged expired temporary keys", "count", n)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
