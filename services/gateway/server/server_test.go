package server

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/xml"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	v4 "github.com/aws/aws-sdk-go-v2/aws/signer/v4"
	"github.com/aws/aws-sdk-go-v2/service/ec2"
	ec2types "github.com/aws/aws-sdk-go-v2/service/ec2/types"
	"github.com/aws/aws-sdk-go-v2/service/sts"
	ststypes "github.com/aws/aws-sdk-go-v2/service/sts/types"
	"github.com/aws/smithy-go"

	"hangar.dev/hangar/services/gateway/awserr"
	"hangar.dev/hangar/services/gateway/awsmodel"
	"hangar.dev/hangar/services/gateway/reqctx"
	gwsts "hangar.dev/hangar/services/gateway/sts"
	"hangar.dev/hangar/services/internal/creds"
)

const (
	testAccount = "123456789012"
	testRegion  = "us-east-1"
	stsVersion  = "2011-06-15"
	ec2Version  = "2016-11-15"
)

var (
	rootKey = creds.Key{Profile: "default", AccessKeyID: "AKIAROOTROOTROOTROOT", SecretAccessKey: "rootSecretRootSecretRootSecretRootSecret", Access: creds.FullAccess}
	userKey = creds.Key{Profile: "alice", AccessKeyID: "AKIAALICEALICEALICE2", SecretAccessKey: "aliceSecretAliceSecretAliceSecretAliceSe", Access: creds.FullAccess}
	roKey   = creds.Key{Profile: "auditor", AccessKeyID: "AKIAAUDITORAUDITOR23", SecretAccessKey: "auditorSecretAuditorSecretAuditorSecretA", Access: creds.ReadOnlyAccess}
	tempKey = creds.Key{Profile: "temp", AccessKeyID: "ASIATEMPTEMPTEMPTEMP", SecretAccessKey: "tempSecretTempSecretTempSecretTempSecret", SessionToken: "FwoGZXIvYXdzEXAMPLEsessionTOKEN", Access: creds.FullAccess}
	noKey   = creds.Key{AccessKeyID: "AKIANOBODYNOBODYNOBO", SecretAccessKey: "nobodySecretNobodySecretNobodySecretNobo"}
)

// fakeEC2 is a tiny EC2: enough operations to exercise routing, decoding,
// DryRun and read-only keys. It counts the calls that reach it.
type fakeEC2 struct {
	calls atomic.Int64
}

func (f *fakeEC2) DescribeVpcs(ctx context.Context, in *ec2.DescribeVpcsInput) (*ec2.DescribeVpcsOutput, error) {
	f.calls.Add(1)
	return &ec2.DescribeVpcsOutput{Vpcs: []ec2types.Vpc{{VpcId: aws.String("vpc-0123456789abcdef0"), CidrBlock: aws.String("10.0.0.0/16"), State: ec2types.VpcStateAvailable}}}, nil
}

func (f *fakeEC2) CreateVpc(ctx context.Context, in *ec2.CreateVpcInput) (*ec2.CreateVpcOutput, error) {
	f.calls.Add(1)
	return &ec2.CreateVpcOutput{Vpc: &ec2types.Vpc{VpcId: aws.String("vpc-new"), CidrBlock: in.CidrBlock, InstanceTenancy: in.InstanceTenancy}}, nil
}

func (f *fakeEC2) RunInstances(ctx context.Context, in *ec2.RunInstancesInput) (*ec2.RunInstancesOutput, error) {
	f.calls.Add(1)
	return &ec2.RunInstancesOutput{ReservationId: aws.String("r-1")}, nil
}

// fakeSTS is hangar's STS plus an AssumeRole, a mutation for the
// read-only key to be refused.
type fakeSTS struct {
	gwsts.Service
	calls atomic.Int64
}

func (f *fakeSTS) AssumeRole(ctx context.Context, in *sts.AssumeRoleInput) (*sts.AssumeRoleOutput, error) {
	f.calls.Add(1)
	return &sts.AssumeRoleOutput{AssumedRoleUser: &ststypes.AssumedRoleUser{Arn: aws.String("arn:aws:sts::" + testAccount + ":assumed-role/r/" + *in.RoleSessionName), AssumedRoleId: aws.String("AROA:s")}}, nil
}

// testbed is a gateway server with the fakes behind an httptest listener,
// its clock under the test's control.
type testbed struct {
	*httptest.Server
	srv  *Server
	ec2  *fakeEC2
	sts  *fakeSTS
	mu   sync.Mutex
	now  time.Time // zero: the real clock
	host string
}

func newTestbed(t *testing.T) *testbed {
	tb := &testbed{ec2: &fakeEC2{}, sts: &fakeSTS{}}
	tb.srv = New(Config{AccountID: testAccount, Region: testRegion, Keys: StaticKeys{rootKey, userKey, roKey, tempKey},
		Log: slog.New(slog.DiscardHandler), Now: tb.clock})
	tb.srv.RegisterQuery("ec2", awsmodel.MustLoad("ec2"), tb.ec2)
	tb.srv.RegisterQuery("sts", awsmodel.MustLoad("sts"), tb.sts)
	tb.Server = httptest.NewServer(tb.srv)
	t.Cleanup(tb.Close)
	u, _ := url.Parse(tb.URL)
	tb.host = u.Host
	return tb
}

func (tb *testbed) clock() time.Time {
	tb.mu.Lock()
	defer tb.mu.Unlock()
	if tb.now.IsZero() {
		return time.Now()
	}
	return tb.now
}

func (tb *testbed) setNow(t time.Time) {
	tb.mu.Lock()
	tb.now = t
	tb.mu.Unlock()
}

func sdkCreds(k creds.Key) aws.CredentialsProvider {
	return aws.CredentialsProviderFunc(func(context.Context) (aws.Credentials, error) {
		return aws.Credentials{AccessKeyID: k.AccessKeyID, SecretAccessKey: k.SecretAccessKey, SessionToken: k.SessionToken}, nil
	})
}

func (tb *testbed) ec2Client(k creds.Key, region string) *ec2.Client {
	return ec2.New(ec2.Options{Region: region, BaseEndpoint: aws.String(tb.URL), Credentials: sdkCreds(k), HTTPClient: tb.Client(), RetryMaxAttempts: 1})
}

func (tb *testbed) stsClient(k creds.Key, region string) *sts.Client {
	return sts.New(sts.Options{Region: region, BaseEndpoint: aws.String(tb.URL), Credentials: sdkCreds(k), HTTPClient: tb.Client(), RetryMaxAttempts: 1})
}

// req is a request signed with aws-sdk-go-v2's SigV4 signer, with the
// knobs a misbehaving client could turn.
type req struct {
	method    string // POST unless set
	service   string
	region    string // testRegion unless set
	key       creds.Key
	token     string // session token to sign with
	form      string // the body (POST) or query (GET)
	at        time.Time
	presign   bool
	expires   int    // X-Amz-Expires for a presigned request
	unsigned  bool   // UNSIGNED-PAYLOAD
	claimHash string // an X-Amz-Content-Sha256 that is not the body's
	noAuth    bool
	tamper    func(*http.Request)
}

type resp struct {
	status int
	header http.Header
	body   []byte
}

func (tb *testbed) do(t *testing.T, r req) resp {
	t.Helper()
	if r.method == "" {
		r.method = http.MethodPost
	}
	if r.region == "" {
		r.region = testRegion
	}
	if r.at.IsZero() {
		r.at = tb.clock()
	}
	u := tb.URL + "/"
	var body []byte
	if r.method == http.MethodGet || r.presign {
		u += "?" + r.form
	} else {
		body = []byte(r.form)
	}
	hr, err := http.NewRequest(r.method, u, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if body != nil {
		hr.Header.Set("Content-Type", "application/x-www-form-urlencoded; charset=utf-8")
	}
	sum := sha256.Sum256(body)
	payload := hex.EncodeToString(sum[:])
	if r.unsigned {
		payload = "UNSIGNED-PAYLOAD"
		hr.Header.Set("X-Amz-Content-Sha256", payload)
	}
	if r.claimHash != "" {
		payload = r.claimHash
		hr.Header.Set("X-Amz-Content-Sha256", payload)
	}
	c := aws.Credentials{AccessKeyID: r.key.AccessKeyID, SecretAccessKey: r.key.SecretAccessKey, SessionToken: r.token}
	switch {
	case r.noAuth:
	case r.presign:
		if r.expires > 0 {
			q := hr.URL.Query()
			q.Set("X-Amz-Expires", strconv.Itoa(r.expires))
			hr.URL.RawQuery = q.Encode()
		}
		uri, hdr, err := v4.NewSigner().PresignHTTP(context.Background(), c, hr, payload, r.service, r.region, r.at)
		if err != nil {
			t.Fatal(err)
		}
		hr.URL, _ = url.Parse(uri)
		for k, v := range hdr {
			if k != "Host" {
				hr.Header[k] = v
			}
		}
	default:
		if err := v4.NewSigner().SignHTTP(context.Background(), c, hr, payload, r.service, r.region, r.at); err != nil {
			t.Fatal(err)
		}
	}
	if r.tamper != nil {
		r.tamper(hr)
	}
	res, err := tb.Client().Do(hr)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp{status: res.StatusCode, header: res.Header, body: b}
}

// awsError is an error response read the way AWS writes it: EC2's
// <Response><Errors><Error> with <RequestID>, or the Query protocol's
// <ErrorResponse><Error> with <Type> and <RequestId>.
type awsError struct {
	Shape, Type, Code, Message, RequestID string
}

func parseError(t *testing.T, body []byte) awsError {
	t.Helper()
	var ec2Shape struct {
		XMLName xml.Name `xml:"Response"`
		Errors  struct {
			Error struct{ Code, Message string }
		}
		RequestID string `xml:"RequestID"`
	}
	if err := xml.Unmarshal(body, &ec2Shape); err == nil {
		return awsError{Shape: "ec2", Code: ec2Shape.Errors.Error.Code, Message: ec2Shape.Errors.Error.Message, RequestID: ec2Shape.RequestID}
	}
	var query struct {
		XMLName   xml.Name `xml:"ErrorResponse"`
		Error     struct{ Type, Code, Message string }
		RequestID string `xml:"RequestId"`
	}
	if err := xml.Unmarshal(body, &query); err != nil {
		t.Fatalf("not an AWS error document: %v\n%s", err, body)
	}
	return awsError{Shape: "query", Type: query.Error.Type, Code: query.Error.Code, Message: query.Error.Message, RequestID: query.RequestID}
}

// sdkReads replays a response to aws-sdk-go-v2's client for service and
// returns the error code the SDK reports.
func sdkReads(t *testing.T, service string, r resp) string {
	t.Helper()
	replay := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		for k, v := range r.header {
			w.Header()[k] = v
		}
		w.WriteHeader(r.status)
		_, _ = w.Write(r.body)
	}))
	defer replay.Close()
	var err error
	switch service {
	case "ec2":
		_, err = ec2.New(ec2.Options{Region: testRegion, BaseEndpoint: aws.String(replay.URL), Credentials: sdkCreds(rootKey), RetryMaxAttempts: 1}).
			DescribeVpcs(context.Background(), &ec2.DescribeVpcsInput{})
	default:
		_, err = sts.New(sts.Options{Region: testRegion, BaseEndpoint: aws.String(replay.URL), Credentials: sdkCreds(rootKey), RetryMaxAttempts: 1}).
			GetCallerIdentity(context.Background(), &sts.GetCallerIdentityInput{})
	}
	var api smithy.APIError
	if !errors.As(err, &api) {
		t.Fatalf("the SDK did not read an API error from %d %s: %v", r.status, r.body, err)
	}
	return api.ErrorCode()
}

// expectError checks status, shape, code, message, request id, and that
// aws-sdk-go-v2 reads the same code.
func expectError(t *testing.T, r resp, service string, status int, code, message string) awsError {
	t.Helper()
	if r.status != status {
		t.Errorf("status %d, want %d: %s", r.status, status, r.body)
	}
	e := parseError(t, r.body)
	wantShape := "query"
	if service == "ec2" {
		wantShape = "ec2"
	}
	if e.Shape != wantShape {
		t.Errorf("error in the %s shape, want %s: %s", e.Shape, wantShape, r.body)
	}
	if e.Shape == "query" && e.Type != "Sender" && status < 500 {
		t.Errorf("<Type>%s</Type>, want Sender", e.Type)
	}
	if e.Code != code {
		t.Errorf("code %q, want %q: %s", e.Code, code, r.body)
	}
	if !strings.Contains(e.Message, message) {
		t.Errorf("message %q does not contain %q", e.Message, message)
	}
	if id := r.header.Get("X-Amzn-Requestid"); id == "" || id != e.RequestID {
		t.Errorf("request id header %q, body %q", id, e.RequestID)
	}
	if got := sdkReads(t, service, r); got != code {
		t.Errorf("aws-sdk-go-v2 reads code %q, want %q", got, code)
	}
	return e
}

func TestSDKClientsAreServed(t *testing.T) {
	tb := newTestbed(t)
	ctx := context.Background()
	out, err := tb.ec2Client(rootKey, testRegion).DescribeVpcs(ctx, &ec2.DescribeVpcsInput{})
	if err != nil {
		t.Fatal(err)
	}
	if len(out.Vpcs) != 1 || *out.Vpcs[0].VpcId != "vpc-0123456789abcdef0" {
		t.Fatalf("DescribeVpcs = %+v", out.Vpcs)
	}
	for _, c := range []struct {
		key  creds.Key
		arn  string
		user string
	}{
		{rootKey, "arn:aws:iam::" + testAccount + ":root", testAccount},
		{userKey, "arn:aws:iam::" + testAccount + ":user/alice", ""},
		{tempKey, "arn:aws:iam::" + testAccount + ":user/temp", ""},
	} {
		id, err := tb.stsClient(c.key, testRegion).GetCallerIdentity(ctx, &sts.GetCallerIdentityInput{})
		if err != nil {
			t.Fatalf("%s: %v", c.key.Profile, err)
		}
		if *id.Arn != c.arn || *id.Account != testAccount || (c.user != "" && *id.UserId != c.user) {
			t.Fatalf("%s: GetCallerIdentity = %s %s %s", c.key.Profile, *id.Arn, *id.Account, *id.UserId)
		}
	}
	// STS is global: a client signing for us-east-1 is served by a host in
	// another region, and one signing for the host's region too.
	tb2 := newTestbed(t)
	tb2.srv.cfg.Region = "eu-west-1"
	for _, region := range []string{"us-east-1", "eu-west-1"} {
		if _, err := tb2.stsClient(rootKey, region).GetCallerIdentity(ctx, &sts.GetCallerIdentityInput{}); err != nil {
			t.Fatalf("sts signed for %s: %v", region, err)
		}
	}
}

// TestSDKReadsAuthErrors drives the SDK's own clients into each failure and
// checks the code it reports.
func TestSDKReadsAuthErrors(t *testing.T) {
	tb := newTestbed(t)
	ctx := context.Background()
	code := func(err error) string {
		var api smithy.APIError
		if errors.As(err, &api) {
			return api.ErrorCode()
		}
		return "no API error: " + errString(err)
	}
	wrong := rootKey
	wrong.SecretAccessKey = "x" + wrong.SecretAccessKey[1:]
	for _, c := range []struct {
		name string
		call func() error
		want string
	}{
		{"ec2 wrong secret", func() error { _, err := tb.ec2Client(wrong, testRegion).DescribeVpcs(ctx, nil); return err }, "AuthFailure"},
		{"sts wrong secret", func() error {
			_, err := tb.stsClient(wrong, testRegion).GetCallerIdentity(ctx, nil)
			return err
		}, "SignatureDoesNotMatch"},
		{"ec2 unknown key", func() error { _, err := tb.ec2Client(noKey, testRegion).DescribeVpcs(ctx, nil); return err }, "AuthFailure"},
		{"sts unknown key", func() error {
			_, err := tb.stsClient(noKey, testRegion).GetCallerIdentity(ctx, nil)
			return err
		}, "InvalidClientTokenId"},
		{"ec2 wrong region", func() error { _, err := tb.ec2Client(rootKey, "us-west-2").DescribeVpcs(ctx, nil); return err }, "AuthFailure"},
		{"ec2 read-only create", func() error {
			_, err := tb.ec2Client(roKey, testRegion).CreateVpc(ctx, &ec2.CreateVpcInput{CidrBlock: aws.String("10.0.0.0/16")})
			return err
		}, "UnauthorizedOperation"},
		{"sts read-only assume", func() error {
			_, err := tb.stsClient(roKey, testRegion).AssumeRole(ctx, &sts.AssumeRoleInput{RoleArn: aws.String("arn:aws:iam::1:role/r"), RoleSessionName: aws.String("s")})
			return err
		}, "AccessDenied"},
		{"ec2 dry run", func() error {
			_, err := tb.ec2Client(rootKey, testRegion).CreateVpc(ctx, &ec2.CreateVpcInput{CidrBlock: aws.String("10.0.0.0/16"), DryRun: aws.Bool(true)})
			return err
		}, "DryRunOperation"},
		{"ec2 unimplemented", func() error {
			_, err := tb.ec2Client(rootKey, testRegion).DeleteVpc(ctx, &ec2.DeleteVpcInput{VpcId: aws.String("vpc-1")})
			return err
		}, "UnsupportedOperation"},
		{"ec2 bad enum", func() error {
			_, err := tb.ec2Client(rootKey, testRegion).CreateVpc(ctx, &ec2.CreateVpcInput{CidrBlock: aws.String("10.0.0.0/16"), InstanceTenancy: "timeshare"})
			return err
		}, "InvalidParameterValue"},
	} {
		if got := code(c.call()); got != c.want {
			t.Errorf("%s: the SDK reports %q, want %q", c.name, got, c.want)
		}
	}
	if n := tb.ec2.calls.Load() + tb.sts.calls.Load(); n != 0 {
		t.Fatalf("%d refused calls reached a handler", n)
	}
	// The read-only key still reads.
	if _, err := tb.ec2Client(roKey, testRegion).DescribeVpcs(ctx, nil); err != nil {
		t.Fatalf("read-only DescribeVpcs: %v", err)
	}
	if _, err := tb.stsClient(roKey, testRegion).GetCallerIdentity(ctx, nil); err != nil {
		t.Fatalf("read-only GetCallerIdentity: %v", err)
	}
}

func errString(err error) string {
	if err == nil {
		return "<nil>"
	}
	return err.Error()
}

const fmtAmz = "20060102T150405Z"

func TestSignatureFailures(t *testing.T) {
	tb := newTestbed(t)
	now := time.Date(2026, 3, 14, 15, 9, 26, 0, time.UTC)
	tb.setNow(now)
	ec2Form := "Action=DescribeVpcs&Version=" + ec2Version
	stsForm := "Action=GetCallerIdentity&Version=" + stsVersion
	wrong := userKey
	wrong.SecretAccessKey = "y" + wrong.SecretAccessKey[1:]
	const authFailure = "AWS was not able to validate the provided access credentials"
	const mismatch = "The request signature we calculated does not match the signature you provided. Check your AWS Secret Access Key and signing method. Consult the service documentation for details."
	const invalidToken = "The security token included in the request is invalid."
	late, early := now.Add(-16*time.Minute), now.Add(16*time.Minute)

	cases := []struct {
		name    string
		r       req
		status  int
		code    string
		message string
	}{
		{"ec2 wrong secret", req{service: "ec2", key: wrong, form: ec2Form}, 401, "AuthFailure", authFailure},
		{"sts wrong secret", req{service: "sts", key: wrong, form: stsForm}, 403, "SignatureDoesNotMatch", mismatch},
		{"ec2 unknown key", req{service: "ec2", key: noKey, form: ec2Form}, 401, "AuthFailure", authFailure},
		{"sts unknown key", req{service: "sts", key: noKey, form: stsForm}, 403, "InvalidClientTokenId", invalidToken},
		{"ec2 16 minutes late", req{service: "ec2", key: rootKey, form: ec2Form, at: late}, 400, "RequestExpired", "Request has expired."},
		{"ec2 16 minutes early", req{service: "ec2", key: rootKey, form: ec2Form, at: early}, 400, "RequestExpired", "Request has expired."},
		{"sts 16 minutes late", req{service: "sts", key: rootKey, form: stsForm, at: late}, 403, "SignatureDoesNotMatch",
			"Signature expired: " + late.Format(fmtAmz) + " is now earlier than " + now.Add(-15*time.Minute).Format(fmtAmz) + " (" + now.Format(fmtAmz) + " - 15 min.)"},
		{"sts 16 minutes early", req{service: "sts", key: rootKey, form: stsForm, at: early}, 403, "SignatureDoesNotMatch",
			"Signature not yet current: " + early.Format(fmtAmz) + " is still later than " + now.Add(15*time.Minute).Format(fmtAmz) + " (" + now.Format(fmtAmz) + " + 15 min.)"},
		{"ec2 presigned, expired", req{method: "GET", service: "ec2", key: rootKey, form: ec2Form, presign: true, expires: 60, at: now.Add(-2 * time.Minute)}, 400, "RequestExpired", "Request has expired."},
		{"sts presigned, expired", req{method: "GET", service: "sts", key: rootKey, form: stsForm, presign: true, expires: 60, at: now.Add(-2 * time.Minute)}, 403, "SignatureDoesNotMatch", "Request has expired"},
		{"sts presigned, older than 15 minutes", req{method: "GET", service: "sts", key: rootKey, form: stsForm, presign: true, expires: 3600, at: late}, 403, "SignatureDoesNotMatch", "Signature expired: " + late.Format(fmtAmz)},
		{"sts presigned, tampered", req{method: "GET", service: "sts", key: rootKey, form: stsForm, presign: true, tamper: func(r *http.Request) {
			r.URL.RawQuery = strings.Replace(r.URL.RawQuery, "Action=GetCallerIdentity", "Action=GetSessionToken", 1)
		}}, 403, "SignatureDoesNotMatch", mismatch},
		{"ec2 presigned, signature changed", req{method: "GET", service: "ec2", key: rootKey, form: ec2Form, presign: true, tamper: func(r *http.Request) {
			q := r.URL.Query()
			sig := []byte(q.Get("X-Amz-Signature"))
			sig[0] ^= 1
			q.Set("X-Amz-Signature", string(sig))
			r.URL.RawQuery = q.Encode()
		}}, 401, "AuthFailure", authFailure},
		{"ec2 body changed after signing", req{service: "ec2", key: rootKey, form: ec2Form, tamper: func(r *http.Request) {
			r.Body = io.NopCloser(strings.NewReader("Action=DescribeVpcs&Version=2016-11-16"))
		}}, 401, "AuthFailure", authFailure},
		{"ec2 content hash mismatch", req{service: "ec2", key: rootKey, form: ec2Form, claimHash: strings.Repeat("ab", 32)}, 401, "AuthFailure", authFailure},
		{"sts content hash mismatch", req{service: "sts", key: rootKey, form: stsForm, claimHash: strings.Repeat("ab", 32)}, 403, "SignatureDoesNotMatch", "x-amz-content-sha256"},
		{"ec2 session token missing", req{service: "ec2", key: tempKey, form: ec2Form}, 401, "AuthFailure", authFailure},
		{"sts session token missing", req{service: "sts", key: tempKey, form: stsForm}, 403, "InvalidClientTokenId", invalidToken},
		{"sts session token wrong", req{service: "sts", key: tempKey, token: tempKey.SessionToken + "x", form: stsForm}, 403, "InvalidClientTokenId", invalidToken},
		{"sts session token extra", req{service: "sts", key: rootKey, token: "FwoGZXIvYXdzEXTRA", form: stsForm}, 403, "InvalidClientTokenId", invalidToken},
		{"ec2 wrong region", req{service: "ec2", region: "us-west-2", key: rootKey, form: ec2Form}, 401, "AuthFailure", "region 'us-east-1', not 'us-west-2'"},
		{"sts wrong region", req{service: "sts", region: "eu-west-1", key: rootKey, form: stsForm}, 403, "SignatureDoesNotMatch", "Credential should be scoped to a valid region"},
		{"ec2 no signature", req{service: "ec2", form: ec2Form, noAuth: true}, 401, "AuthFailure", "missing Authentication Token"},
		{"sts no signature", req{service: "sts", form: stsForm, noAuth: true}, 403, "MissingAuthenticationToken", "Request is missing Authentication Token"},
		{"ec2 not AWS4-HMAC-SHA256", req{service: "ec2", key: rootKey, form: ec2Form, tamper: func(r *http.Request) {
			r.Header.Set("Authorization", strings.Replace(r.Header.Get("Authorization"), "AWS4-HMAC-SHA256", "AWS4-HMAC-SHA1", 1))
		}}, 401, "AuthFailure", "only AWS4-HMAC-SHA256"},
		{"sts signature missing a part", req{service: "sts", key: rootKey, form: stsForm, tamper: func(r *http.Request) {
			h := r.Header.Get("Authorization")
			r.Header.Set("Authorization", h[:strings.Index(h, ", Signature=")])
		}}, 400, "IncompleteSignature", "requires 'Signature'"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := tb.do(t, c.r)
			service := c.r.service
			expectError(t, r, service, c.status, c.code, c.message)
		})
	}
	if n := tb.ec2.calls.Load() + tb.sts.calls.Load(); n != 0 {
		t.Fatalf("%d refused requests reached a handler", n)
	}

	// What does verify.
	for _, c := range []struct {
		name string
		r    req
	}{
		{"ec2 presigned GET", req{method: "GET", service: "ec2", key: rootKey, form: ec2Form, presign: true}},
		{"sts presigned GET", req{method: "GET", service: "sts", key: rootKey, form: stsForm, presign: true, at: now.Add(-14 * time.Minute)}},
		{"ec2 UNSIGNED-PAYLOAD", req{service: "ec2", key: rootKey, form: ec2Form, unsigned: true}},
		{"ec2 GET query", req{method: "GET", service: "ec2", key: rootKey, form: ec2Form}},
		{"sts with session token", req{service: "sts", key: tempKey, token: tempKey.SessionToken, form: stsForm}},
		{"ec2 14 minutes late", req{service: "ec2", key: rootKey, form: ec2Form, at: now.Add(-14 * time.Minute)}},
		{"ec2 14 minutes early", req{service: "ec2", key: rootKey, form: ec2Form, at: now.Add(14 * time.Minute)}},
	} {
		r := tb.do(t, c.r)
		if r.status != 200 {
			t.Errorf("%s: %d %s", c.name, r.status, r.body)
		}
		if r.header.Get("X-Amzn-Requestid") == "" || !bytes.Contains(r.body, []byte(r.header.Get("X-Amzn-Requestid"))) {
			t.Errorf("%s: request id %q not in the body %s", c.name, r.header.Get("X-Amzn-Requestid"), r.body)
		}
	}
	// The SDK's own presigned GetCallerIdentity, as EKS tokens are made.
	tb.setNow(time.Time{})
	pre, err := sts.NewPresignClient(tb.stsClient(userKey, testRegion)).PresignGetCallerIdentity(context.Background(), &sts.GetCallerIdentityInput{})
	if err != nil {
		t.Fatal(err)
	}
	hr, _ := http.NewRequest(pre.Method, pre.URL, nil)
	for k, v := range pre.SignedHeader {
		if k != "Host" {
			hr.Header[k] = v
		}
	}
	res, err := tb.Client().Do(hr)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if res.StatusCode != 200 || !bytes.Contains(b, []byte("<Arn>arn:aws:iam::"+testAccount+":user/alice</Arn>")) {
		t.Fatalf("presigned GetCallerIdentity: %d %s", res.StatusCode, b)
	}
}

func TestQueryProtocolErrors(t *testing.T) {
	tb := newTestbed(t)
	ec2Base := "Version=" + ec2Version
	run := "Action=RunInstances&ImageId=ami-1&MinCount=1&MaxCount=1&" + ec2Base
	cases := []struct {
		name, service, form string
		key                 creds.Key
		status              int
		code, message       string
	}{
		{"malformed form", "ec2", "Action=DescribeVpcs&" + ec2Base + "&%zz", rootKey, 400, "MalformedQueryString", "not a well-formed form"},
		{"missing Action", "ec2", ec2Base, rootKey, 400, "MissingAction", "Action"},
		{"sts missing Action", "sts", "Version=" + stsVersion, rootKey, 400, "MissingAction", "Action"},
		{"unknown action", "ec2", "Action=LaunchRockets&" + ec2Base, rootKey, 400, "InvalidAction", "The action LaunchRockets is not valid for this web service."},
		{"sts unknown action", "sts", "Action=LaunchRockets&Version=" + stsVersion, rootKey, 400, "InvalidAction", "LaunchRockets"},
		{"known but not implemented", "ec2", "Action=DeleteVpc&VpcId=vpc-1&" + ec2Base, rootKey, 400, "UnsupportedOperation", "DeleteVpc"},
		{"wrong Version", "ec2", "Action=DescribeVpcs&Version=2014-10-01", rootKey, 400, "NoSuchVersion", "2014-10-01"},
		{"missing Version", "ec2", "Action=DescribeVpcs", rootKey, 400, "MissingParameter", "Version"},
		{"sts wrong Version", "sts", "Action=GetCallerIdentity&Version=" + ec2Version, rootKey, 400, "NoSuchVersion", ec2Version},
		{"unknown parameter", "ec2", "Action=DescribeVpcs&VpcId.1=vpc-1&Colour=blue&" + ec2Base, rootKey, 400, "UnknownParameter", "Colour"},
		{"sts unknown parameter", "sts", "Action=GetCallerIdentity&Colour=blue&Version=" + stsVersion, rootKey, 400, "UnknownParameter", "Colour"},
		{"bad integer", "ec2", "Action=RunInstances&ImageId=ami-1&MinCount=one&MaxCount=1&" + ec2Base, rootKey, 400, "InvalidParameterValue", "MinCount"},
		{"integer overflow", "ec2", "Action=RunInstances&ImageId=ami-1&MinCount=4294967296&MaxCount=1&" + ec2Base, rootKey, 400, "InvalidParameterValue", "MinCount"},
		{"bad boolean", "ec2", run + "&DryRun=yes", rootKey, 400, "InvalidParameterValue", "DryRun"},
		{"bad enum", "ec2", "Action=CreateVpc&CidrBlock=10.0.0.0/16&InstanceTenancy=timeshare&" + ec2Base, rootKey, 400, "InvalidParameterValue", "InstanceTenancy"},
		{"missing required", "ec2", "Action=RunInstances&ImageId=ami-1&MinCount=1&" + ec2Base, rootKey, 400, "MissingParameter", "MaxCount"},
		{"Action twice", "ec2", "Action=DescribeVpcs&Action=CreateVpc&" + ec2Base, rootKey, 400, "InvalidParameterValue", "Action"},
		{"dry run", "ec2", run + "&DryRun=true", rootKey, 412, "DryRunOperation", "Request would have succeeded, but DryRun flag is set."},
		{"read-only mutation", "ec2", "Action=CreateVpc&CidrBlock=10.0.0.0/16&" + ec2Base, roKey, 403, "UnauthorizedOperation", "ec2:CreateVpc"},
		{"read-only dry run", "ec2", "Action=CreateVpc&CidrBlock=10.0.0.0/16&DryRun=true&" + ec2Base, roKey, 403, "UnauthorizedOperation", "ec2:CreateVpc"},
		{"sts read-only mutation", "sts", "Action=AssumeRole&RoleArn=arn:aws:iam::1:role/r&RoleSessionName=s&Version=" + stsVersion, roKey, 403, "AccessDenied", "sts:AssumeRole"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := tb.do(t, req{service: c.service, key: c.key, form: c.form})
			expectError(t, r, c.service, c.status, c.code, c.message)
		})
	}
	if n := tb.ec2.calls.Load() + tb.sts.calls.Load(); n != 0 {
		t.Fatalf("%d refused requests reached a handler", n)
	}
	r := tb.do(t, req{service: "ec2", key: roKey, form: "Action=DescribeVpcs&DryRun=true&" + ec2Base})
	expectError(t, r, "ec2", 412, "DryRunOperation", "DryRun")
	r = tb.do(t, req{service: "ec2", key: rootKey, form: run})
	if r.status != 200 || tb.ec2.calls.Load() != 1 {
		t.Fatalf("RunInstances: %d %s", r.status, r.body)
	}
}

// countingBody is a request body that counts what the server reads.
type countingBody struct {
	n, size int64
}

func (c *countingBody) Read(p []byte) (int, error) {
	if c.n >= c.size {
		return 0, io.EOF
	}
	k := int64(len(p))
	if k > c.size-c.n {
		k = c.size - c.n
	}
	for i := range p[:k] {
		p[i] = 'a'
	}
	c.n += k
	return int(k), nil
}

func (c *countingBody) Close() error { return nil }

func TestBodyLimit(t *testing.T) {
	tb := newTestbed(t)
	sign := func(r *http.Request) {
		if err := v4.NewSigner().SignHTTP(context.Background(), aws.Credentials{AccessKeyID: rootKey.AccessKeyID, SecretAccessKey: rootKey.SecretAccessKey},
			r, "UNSIGNED-PAYLOAD", "ec2", testRegion, time.Now()); err != nil {
			t.Fatal(err)
		}
	}
	// A declared length over the limit is refused before a byte is read.
	body := &countingBody{size: MaxQueryBody + 1}
	r := httptest.NewRequest(http.MethodPost, "http://"+tb.host+"/", body)
	r.ContentLength = MaxQueryBody + 1
	r.Header.Set("X-Amz-Content-Sha256", "UNSIGNED-PAYLOAD")
	sign(r)
	w := httptest.NewRecorder()
	tb.srv.ServeHTTP(w, r)
	expectError(t, resp{status: w.Code, header: w.Header(), body: w.Body.Bytes()}, "ec2", 413, "RequestEntityTooLarge", "larger than")
	if body.n != 0 {
		t.Fatalf("read %d bytes of a body declared too large", body.n)
	}
	// A chunked body is read to the limit and one byte past it, no more.
	body = &countingBody{size: 3 * MaxQueryBody}
	r = httptest.NewRequest(http.MethodPost, "http://"+tb.host+"/", body)
	r.ContentLength = -1
	r.Header.Set("X-Amz-Content-Sha256", "UNSIGNED-PAYLOAD")
	sign(r)
	w = httptest.NewRecorder()
	tb.srv.ServeHTTP(w, r)
	expectError(t, resp{status: w.Code, header: w.Header(), body: w.Body.Bytes()}, "ec2", 413, "RequestEntityTooLarge", "larger than")
	if body.n > MaxQueryBody+1 {
		t.Fatalf("read %d bytes, past the %d-byte limit", body.n, MaxQueryBody)
	}
	// Over a real connection, the client hears 413 too.
	big := bytes.Repeat([]byte("a"), MaxQueryBody+1)
	hr, _ := http.NewRequest(http.MethodPost, tb.URL+"/", bytes.NewReader(big))
	hr.Header.Set("X-Amz-Content-Sha256", "UNSIGNED-PAYLOAD")
	sign(hr)
	res, err := tb.Client().Do(hr)
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if res.StatusCode != 413 {
		t.Fatalf("status %d", res.StatusCode)
	}
}

func TestUnknownServiceAnswersAtOnce(t *testing.T) {
	tb := newTestbed(t)
	// Signed for S3, with a body it will never finish sending: the answer
	// must come without waiting for it.
	pr, pw := io.Pipe()
	defer pw.Close()
	hr, _ := http.NewRequest(http.MethodPut, tb.URL+"/bucket/key", pr)
	hr.ContentLength = 1 << 20
	if err := v4.NewSigner().SignHTTP(context.Background(), aws.Credentials{AccessKeyID: rootKey.AccessKeyID, SecretAccessKey: rootKey.SecretAccessKey},
		hr, "UNSIGNED-PAYLOAD", "s3", testRegion, time.Now()); err != nil {
		t.Fatal(err)
	}
	go func() { _, _ = pw.Write([]byte("partial")) }()
	client := &http.Client{Timeout: 10 * time.Second}
	start := time.Now()
	res, err := client.Do(hr)
	if err != nil {
		t.Fatalf("no answer for an unknown service: %v", err)
	}
	b, _ := io.ReadAll(res.Body)
	res.Body.Close()
	e := expectErrorNoSDK(t, resp{status: res.StatusCode, header: res.Header, body: b}, 400, "UnknownService")
	if !strings.Contains(e.Message, `"s3"`) || !strings.Contains(e.Message, "ec2, sts") {
		t.Fatalf("message %q should name s3 and what is served", e.Message)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("took %v", d)
	}
	// A JSON-protocol service hangar has a model for hears it in JSON.
	r := tb.do(t, req{method: "GET", service: "eks", key: rootKey, form: ""})
	if r.status != 400 || r.header.Get("X-Amzn-Errortype") != "UnknownService" || !bytes.Contains(r.body, []byte(`"message":"hangar does not serve the service \"eks\"`)) {
		t.Fatalf("eks: %d %v %s", r.status, r.header, r.body)
	}
}

func expectErrorNoSDK(t *testing.T, r resp, status int, code string) awsError {
	t.Helper()
	if r.status != status {
		t.Errorf("status %d, want %d", r.status, status)
	}
	e := parseError(t, r.body)
	if e.Code != code {
		t.Errorf("code %q, want %q", e.Code, code)
	}
	if e.RequestID == "" || e.RequestID != r.header.Get("X-Amzn-Requestid") {
		t.Errorf("request id %q, header %q", e.RequestID, r.header.Get("X-Amzn-Requestid"))
	}
	return e
}

// TestHandlersSeeTheVerifiedPath: a REST handler sees the path the
// signature covered, with dot segments resolved.
func TestHandlersSeeTheVerifiedPath(t *testing.T) {
	tb := newTestbed(t)
	var seen atomic.Value
	tb.srv.RegisterREST("eks", restFunc(func(w http.ResponseWriter, r *http.Request, body []byte) {
		seen.Store(r.URL.Path)
		if reqctx.From(r.Context()).Caller == nil {
			t.Error("no caller in the context")
		}
		w.WriteHeader(200)
	}))
	for _, p := range []string{"/clusters/a/../b", "/clusters//b", "/clusters/./b"} {
		hr, _ := http.NewRequest(http.MethodGet, tb.URL+p, nil)
		hr.URL.RawPath = p
		hr.URL.Path = p
		sum := sha256.Sum256(nil)
		if err := v4.NewSigner().SignHTTP(context.Background(), aws.Credentials{AccessKeyID: rootKey.AccessKeyID, SecretAccessKey: rootKey.SecretAccessKey},
			hr, hex.EncodeToString(sum[:]), "eks", testRegion, time.Now()); err != nil {
			t.Fatal(err)
		}
		res, err := tb.Client().Do(hr)
		if err != nil {
			t.Fatal(err)
		}
		res.Body.Close()
		if res.StatusCode != 200 || seen.Load() != "/clusters/b" {
			t.Fatalf("%s: status %d, handler saw %v", p, res.StatusCode, seen.Load())
		}
	}
	// An escaped slash is part of its segment, not a separator: the dot
	// segment after it is not one either.
	hr, _ := http.NewRequest(http.MethodGet, tb.URL+"/clusters/a%2F..%2Fb//x", nil)
	sum := sha256.Sum256(nil)
	if err := v4.NewSigner().SignHTTP(context.Background(), aws.Credentials{AccessKeyID: rootKey.AccessKeyID, SecretAccessKey: rootKey.SecretAccessKey},
		hr, hex.EncodeToString(sum[:]), "eks", testRegion, time.Now()); err != nil {
		t.Fatal(err)
	}
	res, err := tb.Client().Do(hr)
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if res.StatusCode != 200 || seen.Load() != "/clusters/a/../b/x" {
		t.Fatalf("escaped slash: status %d, handler saw %v", res.StatusCode, seen.Load())
	}
}

type restFunc func(w http.ResponseWriter, r *http.Request, body []byte)

func (f restFunc) ServeAWS(w http.ResponseWriter, r *http.Request, body []byte) { f(w, r, body) }
func (restFunc) MaxBody() int64                                                 { return 1 << 20 }
func (restFunc) WriteError(w http.ResponseWriter, requestID string, err *awserr.Error) {
	w.WriteHeader(err.Status)
}

// fakeTemporary is STS's temporary keys as the server sees them.
type fakeTemporary map[string]struct {
	caller  reqctx.Caller
	expires time.Time
}

func (f fakeTemporary) LookupTemporary(id string) (*reqctx.Caller, time.Time, bool) {
	e, ok := f[id]
	if !ok {
		return nil, time.Time{}, false
	}
	c := e.caller
	return &c, e.expires, true
}

func TestTemporaryKeys(t *testing.T) {
	tb := newTestbed(t)
	roleARN := "arn:aws:sts::" + testAccount + ":assumed-role/web/i-0123456789abcdef0"
	live := creds.Key{AccessKeyID: "ASIALIVELIVELIVELIVE", SecretAccessKey: "liveSecretLiveSecretLiveSecretLiveSecret", SessionToken: "live-token", Access: creds.FullAccess}
	ro := creds.Key{AccessKeyID: "ASIAREADREADREADREAD", SecretAccessKey: "readSecretReadSecretReadSecretReadSecret", SessionToken: "read-token", Access: creds.ReadOnlyAccess}
	old := creds.Key{AccessKeyID: "ASIAOLDOLDOLDOLDOLDO", SecretAccessKey: "oldSecretOldSecretOldSecretOldSecretOldS", SessionToken: "old-token", Access: creds.FullAccess}
	tb.srv.cfg.Temporary = fakeTemporary{
		live.AccessKeyID: {reqctx.Caller{Key: live, AccountID: testAccount, ARN: roleARN, UserID: "AROAEXAMPLEEXAMPLE12:i-0123456789abcdef0"}, time.Now().Add(time.Hour)},
		ro.AccessKeyID:   {reqctx.Caller{Key: ro, AccountID: testAccount, ARN: roleARN, UserID: "AROAEXAMPLEEXAMPLE12:ro"}, time.Now().Add(time.Hour)},
		old.AccessKeyID:  {reqctx.Caller{Key: old, AccountID: testAccount, ARN: roleARN, UserID: "AROAEXAMPLEEXAMPLE12:old"}, time.Now().Add(-time.Second)},
	}
	ctx := context.Background()
	code := func(err error) string {
		var ae smithy.APIError
		if errors.As(err, &ae) {
			return ae.ErrorCode()
		}
		return errString(err)
	}

	id, err := tb.stsClient(live, testRegion).GetCallerIdentity(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if *id.Arn != roleARN || *id.UserId != "AROAEXAMPLEEXAMPLE12:i-0123456789abcdef0" {
		t.Fatalf("temporary key's identity: %s %s", *id.Arn, *id.UserId)
	}
	wrongToken, noToken := live, live
	wrongToken.SessionToken, noToken.SessionToken = "other-token", ""
	wrongSecret := live
	wrongSecret.SecretAccessKey = strings.Repeat("x", 40)
	expiredWrongSecret := old
	expiredWrongSecret.SecretAccessKey = strings.Repeat("x", 40)
	for _, c := range []struct {
		name string
		call func() error
		want string
	}{
		{"sts wrong token", func() error { _, err := tb.stsClient(wrongToken, testRegion).GetCallerIdentity(ctx, nil); return err }, "InvalidClientTokenId"},
		{"sts no token", func() error { _, err := tb.stsClient(noToken, testRegion).GetCallerIdentity(ctx, nil); return err }, "InvalidClientTokenId"},
		{"ec2 wrong token", func() error { _, err := tb.ec2Client(wrongToken, testRegion).DescribeVpcs(ctx, nil); return err }, "AuthFailure"},
		{"sts wrong secret", func() error { _, err := tb.stsClient(wrongSecret, testRegion).GetCallerIdentity(ctx, nil); return err }, "SignatureDoesNotMatch"},
		{"sts expired", func() error { _, err := tb.stsClient(old, testRegion).GetCallerIdentity(ctx, nil); return err }, "ExpiredToken"},
		{"ec2 expired", func() error { _, err := tb.ec2Client(old, testRegion).DescribeVpcs(ctx, nil); return err }, "RequestExpired"},
		// Expiry is told only to a request that proves it holds the key.
		{"sts expired, wrong secret", func() error {
			_, err := tb.stsClient(expiredWrongSecret, testRegion).GetCallerIdentity(ctx, nil)
			return err
		}, "SignatureDoesNotMatch"},
		{"ec2 read-only create", func() error {
			_, err := tb.ec2Client(ro, testRegion).CreateVpc(ctx, &ec2.CreateVpcInput{CidrBlock: aws.String("10.0.0.0/16")})
			return err
		}, "UnauthorizedOperation"},
	} {
		if got := code(c.call()); got != c.want {
			t.Errorf("%s: %q, want %q", c.name, got, c.want)
		}
	}
	_, err = tb.stsClient(old, testRegion).GetCallerIdentity(ctx, nil)
	if !strings.Contains(errString(err), "The security token included in the request is expired") {
		t.Errorf("expired key's message: %v", err)
	}
	if n := tb.ec2.calls.Load(); n != 0 {
		t.Fatalf("%d refused calls reached EC2", n)
	}
	if _, err := tb.ec2Client(ro, testRegion).DescribeVpcs(ctx, nil); err != nil {
		t.Fatalf("read-only temporary key cannot read: %v", err)
	}
	// The host's own keys are found first, as before.
	if _, err := tb.stsClient(rootKey, testRegion).GetCallerIdentity(ctx, nil); err != nil {
		t.Fatal(err)
	}
}
