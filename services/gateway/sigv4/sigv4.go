// Package sigv4 verifies AWS Signature Version 4 on incoming requests, in
// both forms AWS accepts: the Authorization header and the presigned query
// string. It computes what the client must have signed from the request as
// received and compares signatures in constant time.
//
// It knows nothing of services or error wording; it reports what went wrong
// as a Kind, and the gateway words it as each service does. Secrets never
// appear in errors.
package sigv4

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Algorithm is the only algorithm accepted.
const Algorithm = "AWS4-HMAC-SHA256"

// UnsignedPayload is the payload hash a client sends when it does not sign
// the body.
const UnsignedPayload = "UNSIGNED-PAYLOAD"

// MaxSkew is how far a request's time may be from the server's: AWS's
// documented 15 minutes.
const MaxSkew = 15 * time.Minute

// MaxPresignExpiry is the longest X-Amz-Expires AWS accepts: seven days.
const MaxPresignExpiry = 7 * 24 * time.Hour

// Kind classifies a failure.
type Kind int

const (
	MissingAuth     Kind = iota // no signature at all
	Malformed                   // a signature that cannot be parsed
	UnknownKey                  // the access key id is not known
	BadSignature                // the signature does not match
	Expired                     // the request time is too far off, or a presigned URL ran out
	BadScope                    // the credential scope names the wrong date, region or terminator
	BadToken                    // the session token is missing, extra or wrong
	PayloadMismatch             // X-Amz-Content-Sha256 is not the body's hash
)

// Error is a verification failure.
type Error struct {
	Kind    Kind
	Message string
	// RequestTime is set for an Expired request whose X-Amz-Date is more
	// than MaxSkew from ServerTime, so the caller can write AWS's
	// "Signature expired: X is now earlier than Y" message; it is zero
	// when a presigned request outlived its X-Amz-Expires.
	RequestTime, ServerTime time.Time
}

func (e *Error) Error() string { return e.Message }

func fail(k Kind, format string, args ...any) *Error {
	return &Error{Kind: k, Message: fmt.Sprintf(format, args...)}
}

// Auth is what a request claims about its signature, read without
// verifying it. The gateway routes on Service before it verifies.
type Auth struct {
	AccessKeyID   string
	Date          string // yyyymmdd from the scope
	Region        string
	Service       string
	SignedHeaders []string
	Signature     string
	Time          time.Time // X-Amz-Date (or Date)
	Presigned     bool
	Expires       time.Duration // presigned only
	SessionToken  string
}

// Scope is the credential scope string.
func (a *Auth) Scope() string {
	return a.Date + "/" + a.Region + "/" + a.Service + "/aws4_request"
}

// ParseAuth reads the signature parameters of r from its Authorization
// header or its presigned query.
func ParseAuth(r *http.Request) (*Auth, error) {
	q := r.URL.Query()
	presigned := q.Has("X-Amz-Algorithm") || q.Has("X-Amz-Signature")
	if h := r.Header.Get("Authorization"); h != "" {
		// AWS refuses a request that carries both forms rather than
		// guessing which one the client meant.
		if presigned {
			return nil, fail(Malformed, "Only one auth mechanism allowed; only the X-Amz-Algorithm query parameter, Signature query string parameter or the Authorization header should be specified")
		}
		return parseHeader(r, h)
	}
	if presigned {
		return parsePresigned(r)
	}
	return nil, fail(MissingAuth, "Request is missing Authentication Token")
}

func parseHeader(r *http.Request, h string) (*Auth, error) {
	alg, rest, _ := strings.Cut(strings.TrimSpace(h), " ")
	if alg != Algorithm {
		return nil, fail(Malformed, "Unsupported authorization type %q; only %s is accepted", clip(alg), Algorithm)
	}
	params := map[string]string{}
	for _, part := range strings.Split(rest, ",") {
		k, v, ok := strings.Cut(strings.TrimSpace(part), "=")
		if !ok {
			return nil, fail(Malformed, "Authorization header requires each component to be key=value; found %q", clip(part))
		}
		params[k] = v
	}
	for _, want := range []string{"Credential", "SignedHeaders", "Signature"} {
		if params[want] == "" {
			return nil, fail(Malformed, "Authorization header requires '%s' parameter. Authorization=%s", want, clip(h))
		}
	}
	a := &Auth{Signature: params["Signature"], SessionToken: r.Header.Get("X-Amz-Security-Token")}
	if err := a.setCredential(params["Credential"]); err != nil {
		return nil, err
	}
	a.SignedHeaders = strings.Split(params["SignedHeaders"], ";")
	raw := r.Header.Get("X-Amz-Date")
	if raw == "" {
		raw = r.Header.Get("Date")
		if raw == "" {
			return nil, fail(Malformed, "Authorization header requires existence of either a 'X-Amz-Date' or a 'Date' header. Authorization=%s", clip(h))
		}
		t, err := http.ParseTime(raw)
		if err != nil {
			return nil, fail(Malformed, "Date header %q is not an HTTP date", clip(raw))
		}
		a.Time = t.UTC()
	} else {
		t, err := time.Parse("20060102T150405Z", raw)
		if err != nil {
			return nil, fail(Malformed, "X-Amz-Date %q is not in the form 20060102T150405Z", clip(raw))
		}
		a.Time = t
	}
	return a, nil
}

func parsePresigned(r *http.Request) (*Auth, error) {
	q := r.URL.Query()
	if alg := q.Get("X-Amz-Algorithm"); alg != Algorithm {
		return nil, fail(Malformed, "X-Amz-Algorithm %q is not %s", clip(alg), Algorithm)
	}
	for _, want := range []string{"X-Amz-Credential", "X-Amz-Date", "X-Amz-SignedHeaders", "X-Amz-Signature"} {
		if q.Get(want) == "" {
			return nil, fail(Malformed, "AWS query-string parameters must include '%s'", want)
		}
	}
	a := &Auth{Presigned: true, Signature: q.Get("X-Amz-Signature"), SessionToken: q.Get("X-Amz-Security-Token")}
	if a.SessionToken == "" {
		// A presigned request may carry its token as a signed header
		// instead (the suite's post-sts-header-before, presigned).
		a.SessionToken = r.Header.Get("X-Amz-Security-Token")
	}
	if err := a.setCredential(q.Get("X-Amz-Credential")); err != nil {
		return nil, err
	}
	a.SignedHeaders = strings.Split(q.Get("X-Amz-SignedHeaders"), ";")
	t, err := time.Parse("20060102T150405Z", q.Get("X-Amz-Date"))
	if err != nil {
		return nil, fail(Malformed, "X-Amz-Date %q is not in the form 20060102T150405Z", clip(q.Get("X-Amz-Date")))
	}
	a.Time = t
	a.Expires = MaxPresignExpiry
	if e := q.Get("X-Amz-Expires"); e != "" {
		secs, err := strconv.Atoi(e)
		if err != nil || secs < 1 || time.Duration(secs)*time.Second > MaxPresignExpiry {
			return nil, fail(Malformed, "X-Amz-Expires must be a number of seconds from 1 to %d", int(MaxPresignExpiry.Seconds()))
		}
		a.Expires = time.Duration(secs) * time.Second
	}
	return a, nil
}

func (a *Auth) setCredential(c string) error {
	parts := strings.Split(c, "/")
	if len(parts) != 5 {
		return fail(Malformed, "Credential should be scoped to a valid region, not a malformed scope: %q", clip(c))
	}
	if parts[4] != "aws4_request" {
		return fail(BadScope, "Credential should be scoped with a valid terminator: 'aws4_request', not '%s'.", clip(parts[4]))
	}
	a.AccessKeyID, a.Date, a.Region, a.Service = parts[0], parts[1], parts[2], parts[3]
	if a.AccessKeyID == "" || a.Service == "" || a.Region == "" {
		return fail(Malformed, "Credential %q is missing a part", clip(c))
	}
	if len(a.Date) != 8 {
		return fail(BadScope, "Credential should be scoped to a valid date in the form yyyymmdd, not %q", clip(a.Date))
	}
	return nil
}

// Key is the secret the verifier checks against.
type Key struct {
	SecretAccessKey string
	SessionToken    string // required on the request when set
}

// Verify checks r (whose body has been read into body) against key at time
// now. auth must come from ParseAuth(r).
func Verify(r *http.Request, body []byte, auth *Auth, key Key, now time.Time) error {
	if auth.Date != auth.Time.Format("20060102") {
		return fail(BadScope, "Date in Credential scope does not match YYYYMMDD from ISO-8601 version of date from HTTP: '%s' != '%s', from '%s'.",
			auth.Date, auth.Time.Format("20060102"), auth.Time.Format("20060102T150405Z"))
	}
	if auth.Presigned {
		if until := auth.Time.Add(auth.Expires); now.After(until) {
			return &Error{Kind: Expired, ServerTime: now, Message: fmt.Sprintf("Request has expired: the presigned request was valid until %s (X-Amz-Date %s plus X-Amz-Expires %d) and it is now %s.",
				until.UTC().Format("20060102T150405Z"), auth.Time.UTC().Format("20060102T150405Z"), int(auth.Expires.Seconds()), now.UTC().Format("20060102T150405Z"))}
		}
		if auth.Time.After(now.Add(MaxSkew)) {
			return &Error{Kind: Expired, Message: "Request is not yet valid", RequestTime: auth.Time, ServerTime: now}
		}
	} else if d := now.Sub(auth.Time); d > MaxSkew || d < -MaxSkew {
		return &Error{Kind: Expired, Message: "Signature expired", RequestTime: auth.Time, ServerTime: now}
	}
	if key.SessionToken != "" && !hmac.Equal([]byte(auth.SessionToken), []byte(key.SessionToken)) {
		return fail(BadToken, "The security token included in the request is invalid.")
	}
	if key.SessionToken == "" && auth.SessionToken != "" {
		return fail(BadToken, "The security token included in the request is invalid.")
	}
	signsHost := false
	for _, h := range auth.SignedHeaders {
		if h == "host" {
			signsHost = true
		}
	}
	if !signsHost {
		return fail(Malformed, "Signed headers must include 'host'")
	}

	sk := SigningKey(key.SecretAccessKey, auth.Date, auth.Region, auth.Service)
	got := []byte(strings.ToLower(auth.Signature))
	// AWS's own services normalise the path (dot segments, repeated
	// slashes) before signing it, and so do botocore (the aws CLI) and the
	// JavaScript and Java SDKs. aws-sdk-go-v2 signs the path exactly as it
	// sends it. Both forms are tried, so a request verifies whichever SDK
	// made it; both are computed from the bytes received, so accepting
	// either lets no one alter a signed request.
	for _, normalize := range []bool{true, false} {
		if !normalize && normalizePath(wirePath(r)) == wirePath(r) {
			break
		}
		creq, err := CanonicalRequestOf(r, body, auth, normalize)
		if err != nil {
			return err
		}
		want := hex.EncodeToString(hmacSHA256(sk, []byte(StringToSign(auth.Time, auth.Scope(), creq))))
		if hmac.Equal([]byte(want), got) {
			return nil
		}
	}
	return fail(BadSignature, "The request signature we calculated does not match the signature you provided. Check your AWS Secret Access Key and signing method. Consult the service documentation for details.")
}

// CanonicalRequestOf is the canonical request the signer of r must have
// built, with the path normalised (as AWS's services do) or as received.
// body is r's body, already read.
func CanonicalRequestOf(r *http.Request, body []byte, auth *Auth, normalize bool) (string, error) {
	payload, err := payloadHash(r, body, auth)
	if err != nil {
		return "", err
	}
	return CanonicalRequest(r.Method, CanonicalURI(wirePath(r), normalize), canonicalQuery(r.URL.RawQuery, auth.Presigned),
		canonicalHeaders(r, auth.SignedHeaders), auth.SignedHeaders, payload), nil
}

func payloadHash(r *http.Request, body []byte, auth *Auth) (string, error) {
	claimed := r.Header.Get("X-Amz-Content-Sha256")
	if claimed == "" && auth.Presigned {
		claimed = r.URL.Query().Get("X-Amz-Content-Sha256")
	}
	if claimed == UnsignedPayload {
		return claimed, nil
	}
	actual := sha256.Sum256(body)
	actualHex := hex.EncodeToString(actual[:])
	if claimed != "" && !strings.EqualFold(claimed, actualHex) {
		return "", fail(PayloadMismatch, "The provided 'x-amz-content-sha256' header does not match what was computed.")
	}
	return actualHex, nil
}

// wirePath is the path exactly as the client sent it.
func wirePath(r *http.Request) string {
	p := r.RequestURI
	if i := strings.IndexByte(p, '?'); i >= 0 {
		p = p[:i]
	}
	if strings.HasPrefix(p, "http://") || strings.HasPrefix(p, "https://") {
		if u, err := url.Parse(p); err == nil {
			p = u.EscapedPath()
		}
	}
	if p == "" {
		p = "/"
	}
	return p
}

// CanonicalURI is the path part of the canonical request: with normalize,
// dot segments and repeated slashes removed; then every byte outside the
// unreserved set percent-encoded. Applied to a path that is already
// percent-encoded on the wire, this is the double encoding AWS specifies
// for every service but S3.
func CanonicalURI(path string, normalize bool) string {
	if normalize {
		path = normalizePath(path)
	}
	if path == "" {
		path = "/"
	}
	return Escape(path, false)
}

func normalizePath(p string) string {
	if p == "" {
		return "/"
	}
	trailing := strings.HasSuffix(p, "/") && p != "/"
	var out []string
	for _, seg := range strings.Split(p, "/") {
		switch seg {
		case "", ".":
		case "..":
			if len(out) > 0 {
				out = out[:len(out)-1]
			}
		default:
			out = append(out, seg)
		}
	}
	s := "/" + strings.Join(out, "/")
	if trailing && s != "/" {
		s += "/"
	}
	return s
}

// Escape percent-encodes s as SigV4 requires (RFC 3986 unreserved
// characters pass; '/' passes unless encodeSlash).
func Escape(s string, encodeSlash bool) string {
	const hexDigits = "0123456789ABCDEF"
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c >= 'A' && c <= 'Z' || c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.' || c == '~' || (c == '/' && !encodeSlash) {
			b.WriteByte(c)
			continue
		}
		b.WriteByte('%')
		b.WriteByte(hexDigits[c>>4])
		b.WriteByte(hexDigits[c&15])
	}
	return b.String()
}

// canonicalQuery sorts and re-encodes the query string. A presigned
// request's own signature is not part of what it signed.
func canonicalQuery(raw string, presigned bool) string {
	type kv struct{ k, v string }
	var pairs []kv
	for _, part := range strings.Split(raw, "&") {
		if part == "" {
			continue
		}
		k, v, _ := strings.Cut(part, "=")
		dk, err := url.QueryUnescape(k)
		if err != nil {
			dk = k
		}
		dv, err := url.QueryUnescape(v)
		if err != nil {
			dv = v
		}
		if presigned && dk == "X-Amz-Signature" {
			continue
		}
		pairs = append(pairs, kv{Escape(dk, true), Escape(dv, true)})
	}
	sort.Slice(pairs, func(i, j int) bool {
		if pairs[i].k != pairs[j].k {
			return pairs[i].k < pairs[j].k
		}
		return pairs[i].v < pairs[j].v
	})
	parts := make([]string, len(pairs))
	for i, p := range pairs {
		parts[i] = p.k + "=" + p.v
	}
	return strings.Join(parts, "&")
}

// canonicalHeaders renders the signed headers: lower-case names, values
// trimmed with inner runs of spaces collapsed, repeated headers joined by
// commas in the order received.
func canonicalHeaders(r *http.Request, signed []string) []string {
	out := make([]string, 0, len(signed))
	for _, name := range signed {
		var vals []string
		switch name {
		case "host":
			vals = []string{r.Host}
		case "content-length":
			vals = r.Header.Values("Content-Length")
			if len(vals) == 0 && r.ContentLength >= 0 {
				vals = []string{strconv.FormatInt(r.ContentLength, 10)}
			}
		default:
			vals = r.Header.Values(name)
		}
		vals = append([]string(nil), vals...)
		for i, v := range vals {
			vals[i] = trimValue(v)
		}
		out = append(out, name+":"+strings.Join(vals, ","))
	}
	return out
}

// trimValue trims a header value and collapses each run of spaces to one,
// as the SDKs do (tabs inside a value are left alone, as they leave them).
func trimValue(v string) string {
	v = strings.TrimSpace(v)
	if !strings.Contains(v, "  ") {
		return v
	}
	var b strings.Builder
	for i := 0; i < len(v); i++ {
		if v[i] == ' ' && i > 0 && v[i-1] == ' ' {
			continue
		}
		b.WriteByte(v[i])
	}
	return b.String()
}

// CanonicalRequest assembles the canonical request from its parts: uri
// from CanonicalURI, query the canonical query string, headers the
// canonical "name:value" lines in signed-header order.
func CanonicalRequest(method, uri, query string, headers, signed []string, payloadHash string) string {
	return method + "\n" +
		uri + "\n" +
		query + "\n" +
		strings.Join(headers, "\n") + "\n\n" +
		strings.Join(signed, ";") + "\n" +
		payloadHash
}

// StringToSign is the string the signature is the HMAC of.
func StringToSign(t time.Time, scope, canonicalRequest string) string {
	h := sha256.Sum256([]byte(canonicalRequest))
	return Algorithm + "\n" + t.UTC().Format("20060102T150405Z") + "\n" + scope + "\n" + hex.EncodeToString(h[:])
}

type keyID struct{ secret, date, region, service string }

var (
	keyCacheMu sync.Mutex
	keyCache   = map[keyID][]byte{}
)

// SigningKey derives the key for one day, region and service (cached: the
// four HMACs are the largest fixed cost of a verification).
func SigningKey(secret, date, region, service string) []byte {
	id := keyID{secret, date, region, service}
	keyCacheMu.Lock()
	k, ok := keyCache[id]
	keyCacheMu.Unlock()
	if ok {
		return k
	}
	k = hmacSHA256([]byte("AWS4"+secret), []byte(date))
	k = hmacSHA256(k, []byte(region))
	k = hmacSHA256(k, []byte(service))
	k = hmacSHA256(k, []byte("aws4_request"))
	keyCacheMu.Lock()
	if len(keyCache) > 1024 {
		keyCache = map[keyID][]byte{}
	}
	keyCache[id] = k
	keyCacheMu.Unlock()
	return k
}

func hmacSHA256(key, data []byte) []byte {
	m := hmac.New(sha256.New, key)
	m.Write(data)
	return m.Sum(nil)
}

func clip(s string) string {
	if len(s) > 80 {
		return s[:80] + "…"
	}
	return s
}
