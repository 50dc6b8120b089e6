// Package iam implements the part of AWS IAM that hangar's users need to
// give instances and scripts an identity: roles with their trust and
// permission policies, and instance profiles. It keeps those records in
// the gateway's state file (buckets iam-*), answers the IAM Query API with
// AWS's error codes, and tells STS and EC2 what they need of a role or a
// profile.
//
// It must never pretend to evaluate policies. Exactly one thing follows
// from a role's policies: a role whose policies grant only reads
// (Describe*, Get*, List*, or an AWS-managed read-only policy) gets
// read-only temporary credentials (ReadOnly); everything else is full
// access. docs/iam.md says so to users.
package iam

import (
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"log/slog"
	"math/big"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"time"

	"github.com/aws/aws-sdk-go-v2/service/iam/types"

	"hangar.dev/hangar/services/gateway/awserr"
	"hangar.dev/hangar/services/internal/store"
)

// Buckets in the gateway's state file.
const (
	bucketRoles    = "iam-roles"             // lower-case role name → roleRecord
	bucketProfiles = "iam-instance-profiles" // lower-case profile name → profileRecord
	bucketIDs      = "iam-ids"               // every unique id ever issued
)

// ErrNotFound is what InstanceProfile and Role return (wrapped) for a name
// that no record has.
var ErrNotFound = errors.New("no such IAM entity")

// Service is the IAM API over the gateway's state file.
type Service struct {
	db      *store.DB
	account string
	log     *slog.Logger
	now     func() time.Time
}

// New makes the IAM service for account over db.
func New(db *store.DB, account string, log *slog.Logger) *Service {
	return &Service{db: db, account: account, log: log, now: time.Now}
}

// Account is the account the service's ARNs name.
func (s *Service) Account() string { return s.account }

// IAM's errors, with the codes and statuses AWS sends.

func noSuchEntity(format string, args ...any) *awserr.Error {
	return awserr.New(http.StatusNotFound, "NoSuchEntity", format, args...)
}

func entityAlreadyExists(format string, args ...any) *awserr.Error {
	return awserr.New(http.StatusConflict, "EntityAlreadyExists", format, args...)
}

func deleteConflict(format string, args ...any) *awserr.Error {
	return awserr.New(http.StatusConflict, "DeleteConflict", format, args...)
}

func limitExceeded(format string, args ...any) *awserr.Error {
	return awserr.New(http.StatusConflict, "LimitExceeded", format, args...)
}

func malformedPolicy(format string, args ...any) *awserr.Error {
	return awserr.New(http.StatusBadRequest, "MalformedPolicyDocument", format, args...)
}

func invalidInput(format string, args ...any) *awserr.Error {
	return awserr.New(http.StatusBadRequest, "InvalidInput", format, args...)
}

// validationError is AWS's wording for a parameter that breaks the
// model's constraints.
func validationError(value, member, constraint string) *awserr.Error {
	return awserr.New(http.StatusBadRequest, "ValidationError",
		"1 validation error detected: Value '%s' at '%s' failed to satisfy constraint: %s", clip(value), member, constraint)
}

func missing(member string) *awserr.Error {
	return awserr.New(http.StatusBadRequest, "ValidationError",
		"1 validation error detected: Value null at '%s' failed to satisfy constraint: Member must not be null", member)
}

func clip(s string) string {
	if len(s) > 128 {
		return s[:128] + "…"
	}
	return s
}

// Names of roles, profiles and policies: IAM's documented pattern and
// length.
var nameRE = regexp.MustCompile(`^[\w+=,.@-]+$`)

func checkName(v *string, member string, max int) (string, error) {
	if v == nil {
		return "", missing(member)
	}
	n := *v
	if n == "" {
		return "", validationError(n, member, "Member must have length greater than or equal to 1")
	}
	if len(n) > max {
		return "", validationError(n, member, fmt.Sprintf("Member must have length less than or equal to %d", max))
	}
	if !nameRE.MatchString(n) {
		return "", validationError(n, member, `Member must satisfy regular expression pattern: [\w+=,.@-]+`)
	}
	return n, nil
}

// checkPath validates an IAM path: "/" or "/a/b/", printable ASCII.
func checkPath(v *string, member string) (string, error) {
	if v == nil {
		return "/", nil
	}
	p := *v
	if len(p) > 512 {
		return "", validationError(p, member, "Member must have length less than or equal to 512")
	}
	ok := p == "/" || (len(p) >= 3 && strings.HasPrefix(p, "/") && strings.HasSuffix(p, "/"))
	for _, c := range p {
		if c < 0x21 || c > 0x7e {
			ok = false
		}
	}
	if !ok || strings.Contains(p, "//") {
		return "", validationError(p, member, `Member must satisfy regular expression pattern: (\u002F)|(\u002F[\u0021-\u007F]+\u002F)`)
	}
	return p, nil
}

// key is how a name is stored: IAM names are unique regardless of case,
// and looked up regardless of case.
func key(name string) string { return strings.ToLower(name) }

const idAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"

// newID issues a unique id: prefix (AROA for roles, AIPA for instance
// profiles) and 17 characters, 21 in all as AWS's are, never reused.
func newID(tx *store.Tx, prefix string) (string, error) {
	for {
		var b strings.Builder
		b.WriteString(prefix)
		max := big.NewInt(int64(len(idAlphabet)))
		for range 21 - len(prefix) {
			i, err := rand.Int(rand.Reader, max)
			if err != nil {
				return "", fmt.Errorf("making an IAM id: %w", err)
			}
			b.WriteByte(idAlphabet[i.Int64()])
		}
		id := b.String()
		if tx.Has(bucketIDs, id) {
			continue
		}
		if err := tx.Put(bucketIDs, id, time.Now().Unix()); err != nil {
			return "", err
		}
		return id, nil
	}
}

// encodeDocument writes a policy document as IAM's API returns it:
// URL-encoded (RFC 3986), which the aws CLI decodes back to JSON.
func encodeDocument(doc string) *string {
	s := strings.ReplaceAll(url.QueryEscape(doc), "+", "%20")
	return &s
}

// page is one Marker/MaxItems window over a sorted list of keys.
type page struct {
	after string // the last key of the previous page, "" for the first
	max   int
}

const markerPrefix = "hangar-iam1:"

func newPage(marker *string, maxItems *int32) (page, error) {
	p := page{max: 100}
	if maxItems != nil {
		if *maxItems < 1 || *maxItems > 1000 {
			return p, validationError(fmt.Sprint(*maxItems), "maxItems", "Member must have value between 1 and 1000")
		}
		p.max = int(*maxItems)
	}
	if marker != nil && *marker != "" {
		raw, err := base64.RawURLEncoding.DecodeString(*marker)
		if err != nil || !strings.HasPrefix(string(raw), markerPrefix) {
			return p, invalidInput("Invalid Marker: %s", clip(*marker))
		}
		p.after = strings.TrimPrefix(string(raw), markerPrefix)
	}
	return p, nil
}

// cut returns the items of keys (sorted) past the page start, at most max,
// and the marker of the next page when more remain.
func (p page) cut(keys []string) (window []string, truncated bool, next *string) {
	start := 0
	for start < len(keys) && p.after != "" && keys[start] <= p.after {
		start++
	}
	end := start + p.max
	if end >= len(keys) {
		return keys[start:], false, nil
	}
	m := base64.RawURLEncoding.EncodeToString([]byte(markerPrefix + keys[end-1]))
	return keys[start:end], true, &m
}

type tag struct{ Key, Value string }

func tagsView(ts []tag) []types.Tag {
	out := make([]types.Tag, 0, len(ts))
	for _, t := range ts {
		out = append(out, types.Tag{Key: ptr(t.Key), Value: ptr(t.Value)})
	}
	return out
}

const maxTags = 50

// mergeTags adds in to have (tag keys are unique regardless of case).
func mergeTags(have []tag, in []types.Tag) ([]tag, error) {
	seen := map[string]bool{}
	for _, t := range in {
		if t.Key == nil {
			return nil, missing("tags.member.key")
		}
		k, v := *t.Key, deref(t.Value)
		if k == "" || len(k) > 128 {
			return nil, validationError(k, "tags.member.key", "Member must have length between 1 and 128")
		}
		if len(v) > 256 {
			return nil, validationError(v, "tags.member.value", "Member must have length less than or equal to 256")
		}
		if strings.HasPrefix(strings.ToLower(k), "aws:") {
			return nil, invalidInput("User-defined tag keys can't start with 'aws:'. This prefix is reserved for AWS tags.")
		}
		if seen[strings.ToLower(k)] {
			return nil, invalidInput("Duplicate tag keys found. Please note that Tag keys are case insensitive.")
		}
		seen[strings.ToLower(k)] = true
	}
	out := append([]tag(nil), have...)
	for _, t := range in {
		replaced := false
		for i := range out {
			if strings.EqualFold(out[i].Key, *t.Key) {
				out[i] = tag{*t.Key, deref(t.Value)}
				replaced = true
			}
		}
		if !replaced {
			out = append(out, tag{*t.Key, deref(t.Value)})
		}
	}
	if len(out) > maxTags {
		return nil, limitExceeded("The number of tags has reached the maximum limit.")
	}
	return out, nil
}

func ptr[T any](v T) *T { return &v }

func deref[T any](p *T) T {
	var zero T
	if p == nil {
		return zero
	}
	return *p
}
