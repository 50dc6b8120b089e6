package sigv4

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/aws/aws-sdk-go-v2/aws"
	v4 "github.com/aws/aws-sdk-go-v2/aws/signer/v4"
)

// The fuzz and SDK tests sign with aws-sdk-go-v2's own signer, put the
// request on the wire with Go's client code, read it back with Go's server
// code, and verify it: what a real client sends is what is checked.

const (
	sdkKeyID  = "AKIAFUZZFUZZFUZZFUZZ"
	sdkSecret = "fuzzSecretFuzzSecretFuzzSecretFuzzSecret"
)

var sdkTime = time.Date(2026, 3, 14, 15, 9, 26, 0, time.UTC)

type sdkRequest struct {
	method, path string
	query        url.Values
	header       http.Header
	body         []byte
	presign      bool
	unsigned     bool // UNSIGNED-PAYLOAD
	token        string
}

// sign returns the wire bytes of r signed by the SDK, and where in them the
// signed bytes are (so a caller can mutate exactly those).
func (s sdkRequest) sign(t testing.TB) (wire []byte, signed []int, err error) {
	u := &url.URL{Scheme: "http", Host: "127.0.0.1:4566", Path: s.path, RawQuery: s.query.Encode()}
	req, err := http.NewRequest(s.method, u.String(), bytes.NewReader(s.body))
	if err != nil {
		return nil, nil, err
	}
	for k, vs := range s.header {
		for _, v := range vs {
			req.Header.Add(k, v)
		}
	}
	payload := UnsignedPayload
	if !s.unsigned {
		sum := sha256.Sum256(s.body)
		payload = hex.EncodeToString(sum[:])
	} else {
		req.Header.Set("X-Amz-Content-Sha256", UnsignedPayload)
	}
	creds := aws.Credentials{AccessKeyID: sdkKeyID, SecretAccessKey: sdkSecret, SessionToken: s.token}
	signer := v4.NewSigner()
	if s.presign {
		uri, hdr, err := signer.PresignHTTP(context.Background(), creds, req, payload, "ec2", "us-east-1", sdkTime)
		if err != nil {
			return nil, nil, err
		}
		pu, err := url.Parse(uri)
		if err != nil {
			return nil, nil, err
		}
		req.URL = pu
		req.Header = hdr.Clone()
		req.Header.Del("Host")
	} else if err := signer.SignHTTP(context.Background(), creds, req, payload, "ec2", "us-east-1", sdkTime); err != nil {
		return nil, nil, err
	}
	var buf bytes.Buffer
	if err := req.Write(&buf); err != nil {
		return nil, nil, err
	}
	wire = buf.Bytes()
	signed = signedPositions(t, wire, s.unsigned)
	return wire, signed, nil
}

// signedPositions lists the offsets of wire that the signature covers: the
// method and target, every signed header line and the Authorization line,
// and the body unless it is UNSIGNED-PAYLOAD.
func signedPositions(t testing.TB, wire []byte, unsigned bool) []int {
	r, err := http.ReadRequest(bufio.NewReader(bytes.NewReader(wire)))
	if err != nil {
		t.Fatalf("reading back the SDK's request: %v", err)
	}
	auth, err := ParseAuth(r)
	if err != nil {
		t.Fatalf("parsing the SDK's signature: %v", err)
	}
	signedName := map[string]bool{"authorization": true}
	for _, h := range auth.SignedHeaders {
		signedName[h] = true
	}
	head, _, _ := bytes.Cut(wire, []byte("\r\n\r\n"))
	var out []int
	pos := 0
	for i, line := range strings.Split(string(head), "\r\n") {
		switch {
		case i == 0:
			end := strings.LastIndexByte(line, ' ')
			for j := 0; j < end; j++ {
				if line[j] != ' ' {
					out = append(out, pos+j)
				}
			}
		default:
			name, _, _ := strings.Cut(line, ":")
			// Content-Length is framing: a changed length is caught as a
			// short or long body, not by the signature, when unsigned.
			if signedName[strings.ToLower(name)] {
				for j := len(name) + 1; j < len(line); j++ {
					out = append(out, pos+j)
				}
			}
		}
		pos += len(line) + 2
	}
	if !unsigned {
		for j := len(head) + 4; j < len(wire); j++ {
			out = append(out, j)
		}
	}
	return out
}

// verifyWire reads wire as the gateway's server does and verifies it.
func verifyWire(wire []byte, token string, now time.Time) error {
	r, err := http.ReadRequest(bufio.NewReader(bytes.NewReader(wire)))
	if err != nil {
		return err
	}
	body, err := io.ReadAll(r.Body)
	if err != nil {
		return err
	}
	auth, err := ParseAuth(r)
	if err != nil {
		return err
	}
	if auth.AccessKeyID != sdkKeyID {
		return errors.New("unknown access key")
	}
	return Verify(r, body, auth, Key{SecretAccessKey: sdkSecret, SessionToken: token}, now)
}

// wirePathOf is the path of the request line of wire.
func wirePathOf(wire []byte) string {
	line, _, _ := bytes.Cut(wire, []byte("\r\n"))
	_, rest, _ := strings.Cut(string(line), " ")
	target := rest[:max(strings.LastIndexByte(rest, ' '), 0)]
	p, _, _ := strings.Cut(target, "?")
	return p
}

// equivalentPath reports whether a mutated path is, by AWS's rules, the
// same path as the one signed: a byte in a segment that dot-segment removal
// drops.
func equivalentPath(orig, mutated []byte) bool {
	a, b := wirePathOf(orig), wirePathOf(mutated)
	return a != b && normalizePath(a) == normalizePath(b)
}

func TestSDKSignsWhatVerifyChecks(t *testing.T) {
	cases := []sdkRequest{
		{method: "POST", path: "/", header: http.Header{"Content-Type": {"application/x-www-form-urlencoded; charset=utf-8"}},
			body: []byte("Action=DescribeVpcs&Version=2016-11-15&Filter.1.Name=tag%3AName&Filter.1.Value.1=a+b")},
		{method: "GET", path: "/", query: url.Values{"Action": {"GetCallerIdentity"}, "Version": {"2011-06-15"}}},
		// A space in the path goes out as %20 and is signed as %2520:
		// the double encoding every service but S3 uses.
		{method: "GET", path: "/example space/", query: url.Values{"a b": {"c+d", "/?&="}}},
		{method: "GET", path: "/ሴ/é"},
		// aws-sdk-go-v2 signs dot segments and double slashes as sent.
		{method: "GET", path: "/a/./b/../c//d"},
		{method: "DELETE", path: "/clusters/my-cluster", header: http.Header{"X-Custom": {"  spaced   out  ", "second"}}},
		{method: "POST", path: "/snapshots", header: http.Header{"Content-Type": {"application/json"}}, body: []byte(`{"VolumeSize":8}`), unsigned: true},
		{method: "GET", path: "/", query: url.Values{"Action": {"DescribeRegions"}}, presign: true},
		{method: "POST", path: "/", query: url.Values{"Action": {"GetCallerIdentity"}}, presign: true, token: "FQoGZXIvYXdzEXAMPLETOKEN"},
		{method: "POST", path: "/", body: []byte("Action=GetCallerIdentity&Version=2011-06-15"), token: "FQoGZXIvYXdzEXAMPLETOKEN"},
	}
	for _, c := range cases {
		name := c.method + " " + c.path
		if c.presign {
			name += " presigned"
		}
		t.Run(name, func(t *testing.T) {
			wire, signed, err := c.sign(t)
			if err != nil {
				t.Fatal(err)
			}
			if err := verifyWire(wire, c.token, sdkTime.Add(time.Minute)); err != nil {
				t.Fatalf("Verify rejected what the SDK signed: %v\n%s", err, wire)
			}
			if c.path == "/example space/" && !bytes.Contains(wire, []byte("/example%20space/")) {
				t.Fatalf("the SDK sent %q", wire)
			}
			// The wrong secret, the wrong token, a stale clock.
			r, _ := http.ReadRequest(bufio.NewReader(bytes.NewReader(wire)))
			body, _ := io.ReadAll(r.Body)
			auth, _ := ParseAuth(r)
			if err := Verify(r, body, auth, Key{SecretAccessKey: "not" + sdkSecret, SessionToken: c.token}, sdkTime); kindOf(err) != BadSignature {
				t.Errorf("wrong secret: %v", err)
			}
			if err := Verify(r, body, auth, Key{SecretAccessKey: sdkSecret, SessionToken: c.token + "x"}, sdkTime); kindOf(err) != BadToken {
				t.Errorf("wrong token: %v", err)
			}
			if !c.presign {
				if err := Verify(r, body, auth, Key{SecretAccessKey: sdkSecret, SessionToken: c.token}, sdkTime.Add(16*time.Minute)); kindOf(err) != Expired {
					t.Errorf("16 minutes late: %v", err)
				}
			}
			for _, i := range signed {
				m := bytes.Clone(wire)
				m[i] = mutateByte(m[i])
				if equivalentPath(wire, m) {
					continue
				}
				if err := verifyWire(m, c.token, sdkTime); err == nil {
					t.Fatalf("accepted the request with byte %d (%q) changed:\n%s", i, wire[i], m)
				}
			}
		})
	}
}

func kindOf(err error) Kind {
	var e *Error
	if errors.As(err, &e) {
		return e.Kind
	}
	return -1
}

// FuzzVerify signs arbitrary requests with aws-sdk-go-v2's signer: Verify
// must accept every one and reject it with any one signed byte changed. It
// also throws the raw inputs at the parser as an Authorization header,
// which must never panic nor verify.
func FuzzVerify(f *testing.F) {
	f.Add("POST", "/", "Action", "DescribeVpcs", "text/plain", []byte("Action=DescribeVpcs&Version=2016-11-15"), uint16(0), false, false)
	f.Add("GET", "/a b/ሴ", "x y", "+/?=&", "  a   b  ", []byte{}, uint16(7), true, false)
	f.Add("PUT", "/a/../b//c/./", "", "", "", []byte{0, 1, 2, 255}, uint16(500), false, true)
	f.Add("DELETE", "/%2F%25", "%", "%zz", "\t", []byte("x"), uint16(65535), true, true)
	f.Fuzz(func(t *testing.T, method, path, qk, qv, hv string, body []byte, at uint16, presign, unsigned bool) {
		// The raw inputs as an Authorization header: no panic, no pass.
		raw := httpRequestWithAuth(method+" Credential="+qk+"/20260314/us-east-1/ec2/aws4_request, SignedHeaders=host;"+hv+", Signature="+qv, path, body)
		if raw != nil {
			if auth, err := ParseAuth(raw); err == nil && Verify(raw, body, auth, Key{SecretAccessKey: sdkSecret}, sdkTime) == nil {
				t.Fatalf("verified a request nobody signed: %q", raw.Header.Get("Authorization"))
			}
		}

		if !validToken(method) || !utf8.ValidString(path) || !utf8.ValidString(qk) || !utf8.ValidString(qv) || !printable(hv) {
			return
		}
		if !strings.HasPrefix(path, "/") {
			path = "/" + path
		}
		s := sdkRequest{method: method, path: path, body: body, presign: presign, unsigned: unsigned,
			query: url.Values{}, header: http.Header{"X-Fuzz": {hv}}}
		if qk != "" {
			s.query.Set(qk, qv)
		}
		wire, signed, err := s.sign(t)
		if err != nil {
			return // a request Go's client will not send
		}
		if err := verifyWire(wire, "", sdkTime.Add(time.Minute)); err != nil {
			t.Fatalf("Verify rejected what the SDK signed: %v\n%q", err, wire)
		}
		if len(signed) == 0 {
			t.Fatal("nothing signed")
		}
		i := signed[int(at)%len(signed)]
		m := bytes.Clone(wire)
		m[i] = mutateByte(m[i])
		if equivalentPath(wire, m) {
			return
		}
		if err := verifyWire(m, "", sdkTime); err == nil {
			t.Fatalf("accepted the request with byte %d (%q) changed:\n%q", i, wire[i], m)
		}
	})
}

func httpRequestWithAuth(authz, path string, body []byte) *http.Request {
	r, err := http.NewRequest(http.MethodPost, "http://127.0.0.1:4566/", bytes.NewReader(body))
	if err != nil {
		return nil
	}
	r.RequestURI = path
	r.Header.Set("Authorization", authz)
	r.Header.Set("X-Amz-Date", sdkTime.Format("20060102T150405Z"))
	return r
}

func validToken(s string) bool {
	if s == "" || len(s) > 16 {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'A' && c <= 'Z' || c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-') {
			return false
		}
	}
	return true
}

func printable(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 && s[i] != '\t' || s[i] == 0x7f {
			return false
		}
	}
	return true
}
