package awsproto

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"reflect"
	"sync"
	"testing"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/sts"
	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
)

// The tests here put aws-sdk-go-v2 on both sides of the codecs: the SDK's
// own serializer makes the forms DecodeQuery must read, and the SDK's own
// deserializer reads what EncodeXML writes. An httptest server stands in
// for the gateway and either records the request or replays fixed bytes.

// fakeAWS is an httptest server that records each request body and
// answers with the status and body it is given.
type fakeAWS struct {
	*httptest.Server
	mu     sync.Mutex
	forms  []url.Values
	status int
	body   []byte
}

func newFakeAWS(t *testing.T) *fakeAWS {
	f := &fakeAWS{status: http.StatusOK}
	f.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		raw, _ := io.ReadAll(r.Body)
		form, err := url.ParseQuery(string(raw))
		if err != nil {
			t.Errorf("the SDK sent a body that is not a form: %v", err)
		}
		f.mu.Lock()
		f.forms = append(f.forms, form)
		status, body := f.status, f.body
		f.mu.Unlock()
		w.Header().Set("Content-Type", "text/xml")
		w.WriteHeader(status)
		_, _ = w.Write(body)
	}))
	t.Cleanup(f.Close)
	return f
}

// reply sets what the server answers next.
func (f *fakeAWS) reply(status int, body []byte) {
	f.mu.Lock()
	f.status, f.body = status, body
	f.mu.Unlock()
}

// lastForm returns the form of the last request.
func (f *fakeAWS) lastForm(t *testing.T) url.Values {
	t.Helper()
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.forms) == 0 {
		t.Fatal("the SDK sent nothing")
	}
	return f.forms[len(f.forms)-1]
}

var testCreds = aws.CredentialsProviderFunc(func(context.Context) (aws.Credentials, error) {
	return aws.Credentials{AccessKeyID: "AKIAIOSFODNN7EXAMPLE", SecretAccessKey: "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"}, nil
})

func (f *fakeAWS) ec2() *ec2.Client {
	return ec2.New(ec2.Options{Region: "us-east-1", BaseEndpoint: aws.String(f.URL), Credentials: testCreds,
		HTTPClient: f.Client(), RetryMaxAttempts: 1})
}

func (f *fakeAWS) sts() *sts.Client {
	return sts.New(sts.Options{Region: "us-east-1", BaseEndpoint: aws.String(f.URL), Credentials: testCreds,
		HTTPClient: f.Client(), RetryMaxAttempts: 1})
}

// sdkEqual compares SDK values: every field, unexported marker fields
// included, with a nil and an empty list the same (the wire cannot tell
// them apart).
var sdkEqual = []cmp.Option{
	cmp.Exporter(func(reflect.Type) bool { return true }),
	cmpopts.EquateEmpty(),
}

// capture runs call against a fake server that answers with an EC2 or
// Query error (so the SDK needs nothing parsed) and returns the form the
// SDK sent.
func capture(t *testing.T, call func(ctx context.Context, f *fakeAWS) error) url.Values {
	t.Helper()
	f := newFakeAWS(t)
	f.reply(http.StatusBadRequest, []byte(`<?xml version="1.0"?><Response><Errors><Error><Code>Captured</Code><Message>captured</Message></Error></Errors><RequestID>r</RequestID></Response>`))
	_ = call(context.Background(), f)
	return f.lastForm(t)
}
