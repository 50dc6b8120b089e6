package sts

import (
	"context"
	"errors"
	"log/slog"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/ec2"
	ec2types "github.com/aws/aws-sdk-go-v2/service/ec2/types"
	iamsdk "github.com/aws/aws-sdk-go-v2/service/iam"
	"github.com/aws/aws-sdk-go-v2/service/sts"
	"github.com/aws/aws-sdk-go-v2/service/sts/types"
	"github.com/aws/smithy-go"

	"hangar.dev/hangar/services/gateway/awsmodel"
	"hangar.dev/hangar/services/gateway/iam"
	"hangar.dev/hangar/services/gateway/server"
	"hangar.dev/hangar/services/internal/creds"
	"hangar.dev/hangar/services/internal/store"
)

const testAccount = "123456789012"

var (
	bg      = context.Background()
	rootKey = creds.Key{Profile: "default", AccessKeyID: "AKIAROOTROOTROOTROOT", SecretAccessKey: "rootSecretRootSecretRootSecretRootSecret", Access: creds.FullAccess}
	userKey = creds.Key{Profile: "alice", AccessKeyID: "AKIAALICEALICEALICE2", SecretAccessKey: "aliceSecretAliceSecretAliceSecretAliceSe", Access: creds.FullAccess}
	roKey   = creds.Key{Profile: "auditor", AccessKeyID: "AKIAAUDITORAUDITOR23", SecretAccessKey: "auditorSecretAuditorSecretAuditorSecretA", Access: creds.ReadOnlyAccess}
)

const trust = `{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Principal":{"AWS":"arn:aws:iam::123456789012:root"},"Action":"sts:AssumeRole"}]}`

// tinyEC2 is an EC2 with one read and one write, to see what temporary
// keys may do.
type tinyEC2 struct{}

func (tinyEC2) DescribeVpcs(context.Context, *ec2.DescribeVpcsInput) (*ec2.DescribeVpcsOutput, error) {
	return &ec2.DescribeVpcsOutput{}, nil
}

func (tinyEC2) CreateVpc(_ context.Context, in *ec2.CreateVpcInput) (*ec2.CreateVpcOutput, error) {
	return &ec2.CreateVpcOutput{Vpc: &ec2types.Vpc{VpcId: aws.String("vpc-0123456789abcdef0"), CidrBlock: in.CidrBlock}}, nil
}

// host is STS, IAM and a tiny EC2 behind the gateway's server, with STS's
// clock under the test's control (the server keeps the real one, so
// signatures stay current).
type host struct {
	sts *Service
	iam *iam.Service
	url string
	hs  *httptest.Server

	mu     sync.Mutex
	offset time.Duration
}

func newHost(t *testing.T) *host {
	t.Helper()
	db, err := store.Open(filepath.Join(t.TempDir(), "state.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	log := slog.New(slog.DiscardHandler)
	h := &host{iam: iam.New(db, testAccount, log)}
	h.sts = New(h.iam, log)
	h.sts.now = func() time.Time {
		h.mu.Lock()
		defer h.mu.Unlock()
		return time.Now().Add(h.offset)
	}
	srv := server.New(server.Config{AccountID: testAccount, Region: "eu-west-1", Keys: server.StaticKeys{rootKey, userKey, roKey},
		Temporary: h.sts, Log: log})
	srv.RegisterQuery("sts", awsmodel.MustLoad("sts"), h.sts)
	srv.RegisterQuery("iam", awsmodel.MustLoad("iam"), h.iam)
	srv.RegisterQuery("ec2", awsmodel.MustLoad("ec2"), tinyEC2{})
	h.hs = httptest.NewServer(srv)
	t.Cleanup(h.hs.Close)
	h.url = h.hs.URL
	return h
}

// setOffset moves STS's clock (what it issues and purges by).
func (h *host) setOffset(d time.Duration) {
	h.mu.Lock()
	h.offset = d
	h.mu.Unlock()
}

func provider(id, secret, token string) aws.CredentialsProvider {
	return aws.CredentialsProviderFunc(func(context.Context) (aws.Credentials, error) {
		return aws.Credentials{AccessKeyID: id, SecretAccessKey: secret, SessionToken: token}, nil
	})
}

func keyProvider(k creds.Key) aws.CredentialsProvider {
	return provider(k.AccessKeyID, k.SecretAccessKey, k.SessionToken)
}

func tempProvider(c *types.Credentials) aws.CredentialsProvider {
	return provider(*c.AccessKeyId, *c.SecretAccessKey, *c.SessionToken)
}

func (h *host) sts_(p aws.CredentialsProvider) *sts.Client {
	return sts.New(sts.Options{Region: "us-east-1", BaseEndpoint: aws.String(h.url), HTTPClient: h.hs.Client(), RetryMaxAttempts: 1, Credentials: p})
}

func (h *host) iam_() *iamsdk.Client {
	return iamsdk.New(iamsdk.Options{Region: "us-east-1", BaseEndpoint: aws.String(h.url), HTTPClient: h.hs.Client(), RetryMaxAttempts: 1, Credentials: keyProvider(rootKey)})
}

func (h *host) ec2_(p aws.CredentialsProvider) *ec2.Client {
	return ec2.New(ec2.Options{Region: "eu-west-1", BaseEndpoint: aws.String(h.url), HTTPClient: h.hs.Client(), RetryMaxAttempts: 1, Credentials: p})
}

func (h *host) role(t *testing.T, name string, managed ...string) string {
	t.Helper()
	out, err := h.iam_().CreateRole(bg, &iamsdk.CreateRoleInput{RoleName: aws.String(name), AssumeRolePolicyDocument: aws.String(trust)})
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range managed {
		if _, err := h.iam_().AttachRolePolicy(bg, &iamsdk.AttachRolePolicyInput{RoleName: aws.String(name), PolicyArn: aws.String(m)}); err != nil {
			t.Fatal(err)
		}
	}
	return *out.Role.Arn
}

func code(err error) string {
	var ae smithy.APIError
	if errors.As(err, &ae) {
		return ae.ErrorCode()
	}
	if err != nil {
		return "not an API error: " + err.Error()
	}
	return ""
}

func TestAssumeRole(t *testing.T) {
	h := newHost(t)
	arn := h.role(t, "deployer", "arn:aws:iam::aws:policy/AdministratorAccess")
	before := time.Now().Truncate(time.Second)
	out, err := h.sts_(keyProvider(userKey)).AssumeRole(bg, &sts.AssumeRoleInput{RoleArn: aws.String(arn), RoleSessionName: aws.String("ci-run.42"), DurationSeconds: aws.Int32(900)})
	if err != nil {
		t.Fatal(err)
	}
	c := out.Credentials
	if !strings.HasPrefix(*c.AccessKeyId, "ASIA") || len(*c.AccessKeyId) != 20 || len(*c.SecretAccessKey) != 40 || *c.SessionToken == "" {
		t.Fatalf("credentials %+v", c)
	}
	if d := c.Expiration.Sub(before); d < 900*time.Second || d > 905*time.Second {
		t.Fatalf("expires %v after the request, want 900 s", d)
	}
	u := out.AssumedRoleUser
	if *u.Arn != "arn:aws:sts::"+testAccount+":assumed-role/deployer/ci-run.42" || !strings.HasPrefix(*u.AssumedRoleId, "AROA") || !strings.HasSuffix(*u.AssumedRoleId, ":ci-run.42") {
		t.Fatalf("assumed role user %s %s", *u.Arn, *u.AssumedRoleId)
	}

	// The key works, as the role.
	id, err := h.sts_(tempProvider(c)).GetCallerIdentity(bg, nil)
	if err != nil {
		t.Fatal(err)
	}
	if *id.Arn != *u.Arn || *id.UserId != *u.AssumedRoleId || *id.Account != testAccount {
		t.Fatalf("caller identity %s %s %s", *id.Arn, *id.UserId, *id.Account)
	}
	if _, err := h.ec2_(tempProvider(c)).CreateVpc(bg, &ec2.CreateVpcInput{CidrBlock: aws.String("10.0.0.0/16")}); err != nil {
		t.Fatalf("an administrator role's session cannot write: %v", err)
	}
	// Without its token, or with another, it is no key.
	for _, tok := range []string{"", *c.SessionToken + "x"} {
		_, err := h.sts_(provider(*c.AccessKeyId, *c.SecretAccessKey, tok)).GetCallerIdentity(bg, nil)
		if code(err) != "InvalidClientTokenId" {
			t.Errorf("token %q: %v, want InvalidClientTokenId", tok, err)
		}
	}
	_, err = h.sts_(provider(*c.AccessKeyId, strings.Repeat("x", 40), *c.SessionToken)).GetCallerIdentity(bg, nil)
	if code(err) != "SignatureDoesNotMatch" {
		t.Errorf("wrong secret: %v", err)
	}
	// An assumed role cannot assume another (hangar does not chain).
	_, err = h.sts_(tempProvider(c)).AssumeRole(bg, &sts.AssumeRoleInput{RoleArn: aws.String(arn), RoleSessionName: aws.String("again")})
	if code(err) != "AccessDenied" {
		t.Errorf("role chaining: %v", err)
	}
}

func TestAssumeRoleErrors(t *testing.T) {
	h := newHost(t)
	arn := h.role(t, "r")
	c := h.sts_(keyProvider(rootKey))
	policy := `{"Statement":{"Effect":"Allow","Action":"ec2:Describe*","Resource":"*"}}`
	for _, tc := range []struct {
		name string
		in   sts.AssumeRoleInput
		code string
	}{
		{"no such role", sts.AssumeRoleInput{RoleArn: aws.String("arn:aws:iam::" + testAccount + ":role/nope"), RoleSessionName: aws.String("s1")}, "AccessDenied"},
		{"other account", sts.AssumeRoleInput{RoleArn: aws.String("arn:aws:iam::999999999999:role/r"), RoleSessionName: aws.String("s1")}, "AccessDenied"},
		{"wrong path", sts.AssumeRoleInput{RoleArn: aws.String("arn:aws:iam::" + testAccount + ":role/x/r"), RoleSessionName: aws.String("s1")}, "AccessDenied"},
		{"short arn", sts.AssumeRoleInput{RoleArn: aws.String("arn:r"), RoleSessionName: aws.String("s1")}, "ValidationError"},
		{"session name chars", sts.AssumeRoleInput{RoleArn: aws.String(arn), RoleSessionName: aws.String("a b")}, "ValidationError"},
		{"session name short", sts.AssumeRoleInput{RoleArn: aws.String(arn), RoleSessionName: aws.String("a")}, "ValidationError"},
		{"too short", sts.AssumeRoleInput{RoleArn: aws.String(arn), RoleSessionName: aws.String("s1"), DurationSeconds: aws.Int32(899)}, "ValidationError"},
		{"over the role's maximum", sts.AssumeRoleInput{RoleArn: aws.String(arn), RoleSessionName: aws.String("s1"), DurationSeconds: aws.Int32(7200)}, "ValidationError"},
		{"over 12 hours", sts.AssumeRoleInput{RoleArn: aws.String(arn), RoleSessionName: aws.String("s1"), DurationSeconds: aws.Int32(43201)}, "ValidationError"},
		{"malformed session policy", sts.AssumeRoleInput{RoleArn: aws.String(arn), RoleSessionName: aws.String("s1"), Policy: aws.String("{")}, "MalformedPolicyDocument"},
		{"unknown policy arn", sts.AssumeRoleInput{RoleArn: aws.String(arn), RoleSessionName: aws.String("s1"), Policy: aws.String(policy),
			PolicyArns: []types.PolicyDescriptorType{{Arn: aws.String("arn:aws:iam::aws:policy/Nope")}}}, "InvalidParameterValue"},
		{"session tags", sts.AssumeRoleInput{RoleArn: aws.String(arn), RoleSessionName: aws.String("s1"), Tags: []types.Tag{{Key: aws.String("k"), Value: aws.String("v")}}}, "InvalidParameterValue"},
		{"mfa", sts.AssumeRoleInput{RoleArn: aws.String(arn), RoleSessionName: aws.String("s1"), SerialNumber: aws.String("arn:aws:iam::123456789012:mfa/x"), TokenCode: aws.String("123456")}, "AccessDenied"},
	} {
		_, err := c.AssumeRole(bg, &tc.in)
		if got := code(err); got != tc.code {
			t.Errorf("%s: %v, want %s", tc.name, err, tc.code)
		}
	}
	_, err := h.sts_(keyProvider(roKey)).AssumeRole(bg, &sts.AssumeRoleInput{RoleArn: aws.String(arn), RoleSessionName: aws.String("s1")})
	if code(err) != "AccessDenied" {
		t.Errorf("read-only key assuming a role: %v", err)
	}
	n := 0
	_ = h.iam.DB().View(func(tx *store.Tx) error { n = tx.Count(bucketSessions); return nil })
	if n != 0 {
		t.Fatalf("%d sessions stored by failed requests", n)
	}
}

func TestReadOnlyRoleSessions(t *testing.T) {
	h := newHost(t)
	roArn := h.role(t, "auditor", "arn:aws:iam::aws:policy/ReadOnlyAccess")
	adminArn := h.role(t, "admin", "arn:aws:iam::aws:policy/AdministratorAccess")
	root := h.sts_(keyProvider(rootKey))

	ro, err := root.AssumeRole(bg, &sts.AssumeRoleInput{RoleArn: aws.String(roArn), RoleSessionName: aws.String("audit")})
	if err != nil {
		t.Fatal(err)
	}
	e := h.ec2_(tempProvider(ro.Credentials))
	if _, err := e.DescribeVpcs(bg, nil); err != nil {
		t.Fatalf("read-only role cannot read: %v", err)
	}
	_, err = e.CreateVpc(bg, &ec2.CreateVpcInput{CidrBlock: aws.String("10.0.0.0/16")})
	if code(err) != "UnauthorizedOperation" || !strings.Contains(err.Error(), "assumed-role/auditor/audit") {
		t.Fatalf("read-only role creating a VPC: %v", err)
	}
	// Policies are read at each request: attaching a writing policy to
	// the role lifts the limit for sessions already issued.
	if _, err := h.iam_().AttachRolePolicy(bg, &iamsdk.AttachRolePolicyInput{RoleName: aws.String("auditor"), PolicyArn: aws.String("arn:aws:iam::aws:policy/PowerUserAccess")}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.CreateVpc(bg, &ec2.CreateVpcInput{CidrBlock: aws.String("10.0.0.0/16")}); err != nil {
		t.Fatalf("after PowerUserAccess was attached: %v", err)
	}

	// A read-only session policy narrows an administrator's session.
	narrowed, err := root.AssumeRole(bg, &sts.AssumeRoleInput{RoleArn: aws.String(adminArn), RoleSessionName: aws.String("look"),
		Policy: aws.String(`{"Version":"2012-10-17","Statement":{"Effect":"Allow","Action":["ec2:Describe*"],"Resource":"*"}}`)})
	if err != nil {
		t.Fatal(err)
	}
	if narrowed.PackedPolicySize == nil {
		t.Error("no PackedPolicySize with a session policy")
	}
	_, err = h.ec2_(tempProvider(narrowed.Credentials)).CreateVpc(bg, &ec2.CreateVpcInput{CidrBlock: aws.String("10.0.0.0/16")})
	if code(err) != "UnauthorizedOperation" {
		t.Fatalf("administrator narrowed to Describe*: %v", err)
	}

	// Deleting the role ends its sessions.
	iamc := h.iam_()
	for _, p := range []string{"ReadOnlyAccess", "PowerUserAccess"} {
		if _, err := iamc.DetachRolePolicy(bg, &iamsdk.DetachRolePolicyInput{RoleName: aws.String("auditor"), PolicyArn: aws.String("arn:aws:iam::aws:policy/" + p)}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := iamc.DeleteRole(bg, &iamsdk.DeleteRoleInput{RoleName: aws.String("auditor")}); err != nil {
		t.Fatal(err)
	}
	_, err = e.DescribeVpcs(bg, nil)
	if code(err) != "AuthFailure" {
		t.Fatalf("session of a deleted role: %v", err)
	}
}

func TestExpiredAndPurged(t *testing.T) {
	h := newHost(t)
	arn := h.role(t, "r")
	// Issued by a clock 20 minutes behind: a 15-minute key that the
	// server, on the real clock, sees expired.
	h.setOffset(-20 * time.Minute)
	out, err := h.sts_(keyProvider(rootKey)).AssumeRole(bg, &sts.AssumeRoleInput{RoleArn: aws.String(arn), RoleSessionName: aws.String("old"), DurationSeconds: aws.Int32(900)})
	if err != nil {
		t.Fatal(err)
	}
	h.setOffset(0)
	_, err = h.sts_(tempProvider(out.Credentials)).GetCallerIdentity(bg, nil)
	if code(err) != "ExpiredToken" || !strings.Contains(err.Error(), "The security token included in the request is expired") {
		t.Fatalf("sts with an expired key: %v", err)
	}
	_, err = h.ec2_(tempProvider(out.Credentials)).DescribeVpcs(bg, nil)
	if code(err) != "RequestExpired" {
		t.Fatalf("ec2 with an expired key: %v", err)
	}
	// An expired key is ExpiredToken even when its role is gone.
	if _, err := h.iam_().DeleteRole(bg, &iamsdk.DeleteRoleInput{RoleName: aws.String("r")}); err != nil {
		t.Fatal(err)
	}
	_, err = h.sts_(tempProvider(out.Credentials)).GetCallerIdentity(bg, nil)
	if code(err) != "ExpiredToken" {
		t.Fatalf("expired key of a deleted role: %v", err)
	}

	if n, err := h.sts.Purge(); err != nil || n != 0 {
		t.Fatalf("purge right after expiry removed %d (%v); keys are kept for %v", n, err, Retention)
	}
	h.setOffset(Retention + time.Hour)
	if n, err := h.sts.Purge(); err != nil || n != 1 {
		t.Fatalf("purge after retention removed %d (%v), want 1", n, err)
	}
	h.setOffset(0)
	_, err = h.sts_(tempProvider(out.Credentials)).GetCallerIdentity(bg, nil)
	if code(err) != "InvalidClientTokenId" {
		t.Fatalf("purged key: %v", err)
	}
}

func TestGetSessionToken(t *testing.T) {
	h := newHost(t)
	before := time.Now().Truncate(time.Second)
	out, err := h.sts_(keyProvider(rootKey)).GetSessionToken(bg, &sts.GetSessionTokenInput{DurationSeconds: aws.Int32(7200)})
	if err != nil {
		t.Fatal(err)
	}
	if d := out.Credentials.Expiration.Sub(before); d < time.Hour || d > time.Hour+5*time.Second {
		t.Fatalf("root session lasts %v; AWS holds root sessions to an hour", d)
	}
	id, err := h.sts_(tempProvider(out.Credentials)).GetCallerIdentity(bg, nil)
	if err != nil || *id.Arn != "arn:aws:iam::"+testAccount+":root" {
		t.Fatalf("root session identity: %v %+v", err, id)
	}
	// A session may assume a role (the MFA pattern), not make sessions.
	arn := h.role(t, "r")
	if _, err := h.sts_(tempProvider(out.Credentials)).AssumeRole(bg, &sts.AssumeRoleInput{RoleArn: aws.String(arn), RoleSessionName: aws.String("s1")}); err != nil {
		t.Fatalf("root session assuming a role: %v", err)
	}
	_, err = h.sts_(tempProvider(out.Credentials)).GetSessionToken(bg, nil)
	if code(err) != "AccessDenied" {
		t.Fatalf("session from a session: %v", err)
	}

	user, err := h.sts_(keyProvider(userKey)).GetSessionToken(bg, nil)
	if err != nil {
		t.Fatal(err)
	}
	if d := user.Credentials.Expiration.Sub(before); d < 12*time.Hour || d > 12*time.Hour+5*time.Second {
		t.Fatalf("user session lasts %v, want AWS's default 12 h", d)
	}
	id, err = h.sts_(tempProvider(user.Credentials)).GetCallerIdentity(bg, nil)
	if err != nil || *id.Arn != "arn:aws:iam::"+testAccount+":user/alice" || !strings.HasPrefix(*id.UserId, "AIDA") {
		t.Fatalf("user session identity: %v %+v", err, id)
	}

	// A read-only key's session is read-only.
	ro, err := h.sts_(keyProvider(roKey)).GetSessionToken(bg, nil)
	if err != nil {
		t.Fatal(err)
	}
	_, err = h.ec2_(tempProvider(ro.Credentials)).CreateVpc(bg, &ec2.CreateVpcInput{CidrBlock: aws.String("10.0.0.0/16")})
	if code(err) != "UnauthorizedOperation" {
		t.Fatalf("read-only key's session creating a VPC: %v", err)
	}
	for _, d := range []int32{899, 129601} {
		_, err := h.sts_(keyProvider(userKey)).GetSessionToken(bg, &sts.GetSessionTokenInput{DurationSeconds: aws.Int32(d)})
		if code(err) != "ValidationError" {
			t.Errorf("duration %d: %v", d, err)
		}
	}
}

func TestIssueRoleCredentials(t *testing.T) {
	h := newHost(t)
	h.role(t, "web", "arn:aws:iam::aws:policy/ReadOnlyAccess")
	var got struct {
		id, secret, token string
		exp               int64
	}
	err := h.iam.DB().Update(func(tx *store.Tx) error {
		c, err := h.sts.IssueRoleCredentials(tx, "web", "i-0123456789abcdef0", 6*time.Hour)
		got.id, got.secret, got.token, got.exp = c.AccessKeyID, c.SecretAccessKey, c.Token, c.Expiration
		if err == nil && c.LastUpdated == 0 {
			t.Error("no LastUpdated")
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if d := time.Until(time.Unix(got.exp, 0)); d < 6*time.Hour-time.Minute || d > 6*time.Hour {
		t.Fatalf("role credentials last %v, want 6 h", d)
	}
	id, err := h.sts_(provider(got.id, got.secret, got.token)).GetCallerIdentity(bg, nil)
	if err != nil || *id.Arn != "arn:aws:sts::"+testAccount+":assumed-role/web/i-0123456789abcdef0" {
		t.Fatalf("instance credentials identity: %v %+v", err, id)
	}
	err = h.iam.DB().Update(func(tx *store.Tx) error {
		_, err := h.sts.IssueRoleCredentials(tx, "nope", "i-0123456789abcdef0", time.Hour)
		return err
	})
	if !errors.Is(err, iam.ErrNotFound) {
		t.Fatalf("credentials of a missing role: %v", err)
	}
}
