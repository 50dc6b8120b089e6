// Package server is the gateway's HTTP front door: it reads the SigV4
// credential scope to learn which service a request is for (the Host header
// is always the endpoint), verifies the signature against the host's keys,
// and hands the request to that service's protocol: EC2 and Query (form in,
// XML out) through typed handlers, REST-JSON services through their own
// http handlers. Every response carries a request id; every failure is the
// AWS error that service would send.
package server

import (
	"context"
	"crypto/sha256"
	"encoding/base32"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"hangar.dev/hangar/services/gateway/awserr"
	"hangar.dev/hangar/services/gateway/awsmodel"
	"hangar.dev/hangar/services/gateway/awsproto"
	"hangar.dev/hangar/services/gateway/reqctx"
	"hangar.dev/hangar/services/gateway/sigv4"
	"hangar.dev/hangar/services/internal/awsid"
	"hangar.dev/hangar/services/internal/creds"
)

// MaxQueryBody is the largest EC2/Query request body accepted.
const MaxQueryBody = 10 << 20

// KeyStore finds the key an access key id names.
type KeyStore interface {
	Lookup(accessKeyID string) (creds.Key, bool)
}

// StaticKeys is a KeyStore over a fixed list.
type StaticKeys []creds.Key

// Lookup implements KeyStore.
func (s StaticKeys) Lookup(id string) (creds.Key, bool) {
	for _, k := range s {
		if k.AccessKeyID == id {
			return k, true
		}
	}
	return creds.Key{}, false
}

// TemporaryKeys finds the temporary keys STS issued: each acts as a
// principal of its own (an assumed role, or the session of a host key)
// and stops working when it expires.
type TemporaryKeys interface {
	LookupTemporary(accessKeyID string) (caller *reqctx.Caller, expires time.Time, ok bool)
}

// Middleware wraps a handler call; the EC2 service uses it for ClientToken
// idempotency.
type Middleware func(ctx context.Context, h Handler, in any, next func(context.Context, any) (any, error)) (any, error)

// RESTService is a REST-JSON (or REST-XML) service: it gets the verified
// request with its body already read.
type RESTService interface {
	// ServeAWS answers r. The context carries the reqctx.Request.
	ServeAWS(w http.ResponseWriter, r *http.Request, body []byte)
	// MaxBody is the largest request body the service accepts.
	MaxBody() int64
	// WriteError writes err in the service's wire form.
	WriteError(w http.ResponseWriter, requestID string, err *awserr.Error)
}

type queryService struct {
	model    *awsmodel.Model
	handlers map[string]Handler
	mw       []Middleware
}

// Config configures a Server.
type Config struct {
	AccountID string
	Region    string
	Keys      KeyStore
	// Temporary, when set, is asked for the keys Keys does not have.
	Temporary TemporaryKeys
	Log       *slog.Logger
	// Now is the clock signatures are checked against; time.Now when nil.
	Now func() time.Time
}

// Server is the API endpoint.
type Server struct {
	cfg      Config
	query    map[string]*queryService
	rest     map[string]RESTService
	requests atomic.Int64
}

// New makes a server with no services.
func New(cfg Config) *Server {
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	return &Server{cfg: cfg, query: map[string]*queryService{}, rest: map[string]RESTService{}}
}

// Requests returns how many requests the server has answered.
func (s *Server) Requests() int64 { return s.requests.Load() }

// RegisterQuery serves an EC2- or Query-protocol service (the model says
// which) from the handler methods of impl.
func (s *Server) RegisterQuery(service string, m *awsmodel.Model, impl any, mw ...Middleware) {
	s.query[service] = &queryService{model: m, handlers: HandlersOf(impl, m), mw: mw}
}

// RegisterREST serves a REST service.
func (s *Server) RegisterREST(service string, svc RESTService) {
	s.rest[service] = svc
}

// Operations lists the operations a query service implements.
func (s *Server) Operations(service string) []string {
	q := s.query[service]
	if q == nil {
		return nil
	}
	var ops []string
	for op := range q.handlers {
		ops = append(ops, op)
	}
	return ops
}

// Services lists the signing names served.
func (s *Server) Services() []string {
	var out []string
	for k := range s.query {
		out = append(out, k)
	}
	for k := range s.rest {
		out = append(out, k)
	}
	return out
}

type statusWriter struct {
	http.ResponseWriter
	status int
}

func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	return w.ResponseWriter.Write(b)
}

// ServeHTTP implements http.Handler.
func (s *Server) ServeHTTP(rw http.ResponseWriter, r *http.Request) {
	start := time.Now()
	s.requests.Add(1)
	reqID := awsid.RequestID()
	w := &statusWriter{ResponseWriter: rw}
	w.Header().Set("x-amzn-RequestId", reqID)
	w.Header().Set("x-amz-request-id", reqID)
	log := s.cfg.Log.With("request", reqID)
	service, op := s.serve(w, r, reqID, log)
	level := slog.LevelInfo
	if w.status >= 500 {
		level = slog.LevelError
	}
	log.Log(r.Context(), level, "request", "service", service, "op", op, "method", r.Method, "path", r.URL.Path,
		"status", w.status, "duration", time.Since(start).Round(time.Microsecond))
}

func (s *Server) serve(w http.ResponseWriter, r *http.Request, reqID string, log *slog.Logger) (service, op string) {
	auth, err := sigv4.ParseAuth(r)
	if err != nil {
		var se *sigv4.Error
		if !errors.As(err, &se) {
			se = &sigv4.Error{Kind: sigv4.Malformed, Message: err.Error()}
		}
		return s.writeUnauthenticated(w, r, reqID, se), ""
	}
	service = auth.Service
	q, isQuery := s.query[service]
	rest, isREST := s.rest[service]
	if !isQuery && !isREST {
		// Answered before the body is read: a client of a service hangar
		// does not run hears so at once, whatever it is uploading.
		writeUnknownService(w, reqID, auth.Service, s.Services())
		return service, ""
	}
	writeErr := func(e *awserr.Error) {
		if isREST {
			rest.WriteError(w, reqID, e)
			return
		}
		status, body := awsproto.ErrorXML(q.model.Metadata.Protocol, reqID, e)
		w.Header().Set("Content-Type", "text/xml")
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		w.WriteHeader(status)
		_, _ = w.Write(body)
	}

	limit := int64(MaxQueryBody)
	if isREST {
		limit = rest.MaxBody()
	}
	if r.ContentLength > limit {
		writeErr(awserr.New(http.StatusRequestEntityTooLarge, "RequestEntityTooLarge", "Request body of %d bytes is larger than the %d bytes this service accepts", r.ContentLength, limit))
		return service, ""
	}
	body, err := readBody(r, limit)
	if err != nil {
		writeErr(awserr.New(http.StatusBadRequest, "IncompleteBody", "Reading the request body failed: %v", err))
		return service, ""
	}
	if int64(len(body)) > limit {
		writeErr(awserr.New(http.StatusRequestEntityTooLarge, "RequestEntityTooLarge", "Request body is larger than the %d bytes this service accepts", limit))
		return service, ""
	}

	caller, aerr := s.authenticate(r, body, auth)
	if aerr != nil {
		writeErr(aerr)
		return service, ""
	}
	// What was verified may be the normalised path (AWS's services sign
	// paths without dot segments or repeated slashes); handlers see that
	// same path, never a spelling the signature did not cover.
	// Normalised on the escaped path, as it was verified, so an escaped
	// slash stays part of its segment.
	if ep := r.URL.EscapedPath(); cleanPath(ep) != ep {
		clean := cleanPath(ep)
		if p, err := url.PathUnescape(clean); err == nil {
			u := *r.URL
			u.Path, u.RawPath = p, clean
			r.URL = &u
		}
	}
	ctx := reqctx.With(r.Context(), &reqctx.Request{ID: reqID, Caller: caller, Log: log, Region: s.cfg.Region, Host: r.Host})
	if isREST {
		rest.ServeAWS(w, r.WithContext(ctx), body)
		return service, r.Method + " " + r.URL.Path
	}
	op, resp, e := s.serveQuery(ctx, q, r, body, reqID)
	if e != nil {
		if e.Status >= 500 {
			log.Error("operation failed", "op", op, "err", e.Message)
		}
		writeErr(e)
		return service, op
	}
	// The length up front: a client knows where the body ends without
	// reading a chunked terminator, and the connection is reused cleanly.
	w.Header().Set("Content-Type", "text/xml;charset=UTF-8")
	w.Header().Set("Content-Length", strconv.Itoa(len(resp)))
	_, _ = w.Write(resp)
	return service, op
}

// authenticate verifies the signature and the scope and returns the caller.
func (s *Server) authenticate(r *http.Request, body []byte, auth *sigv4.Auth) (*reqctx.Caller, *awserr.Error) {
	now := s.cfg.Now()
	key, ok := s.cfg.Keys.Lookup(auth.AccessKeyID)
	var (
		temp    *reqctx.Caller
		expires time.Time
	)
	if !ok && s.cfg.Temporary != nil {
		if temp, expires, ok = s.cfg.Temporary.LookupTemporary(auth.AccessKeyID); ok {
			key = temp.Key
		}
	}
	if !ok {
		return nil, authError(auth.Service, &sigv4.Error{Kind: sigv4.UnknownKey}, now)
	}
	err := sigv4.Verify(r, body, auth, sigv4.Key{SecretAccessKey: key.SecretAccessKey, SessionToken: key.SessionToken}, now)
	if err == nil && auth.Presigned && (auth.Service == "sts" || auth.Service == "iam") {
		// STS and IAM hold a presigned request to the same 15 minutes
		// as a signed one, whatever its X-Amz-Expires (the lifetime EKS
		// tokens rely on).
		if d := now.Sub(auth.Time); d > sigv4.MaxSkew {
			err = &sigv4.Error{Kind: sigv4.Expired, Message: "Signature expired", RequestTime: auth.Time, ServerTime: now}
		}
	}
	if err != nil {
		var se *sigv4.Error
		if !errors.As(err, &se) {
			se = &sigv4.Error{Kind: sigv4.Malformed, Message: err.Error()}
		}
		return nil, authError(auth.Service, se, now)
	}
	// IAM and STS are global services whose clients may sign for us-east-1
	// whatever region they talk to.
	if auth.Region != s.cfg.Region && !((auth.Service == "iam" || auth.Service == "sts") && auth.Region == "us-east-1") {
		return nil, authError(auth.Service, &sigv4.Error{Kind: sigv4.BadScope,
			Message: fmt.Sprintf("Credential should be scoped to a valid region. This host serves region '%s', not '%s'.", s.cfg.Region, auth.Region)}, now)
	}
	if temp != nil {
		// Expiry is told only to whoever proved they hold the secret
		// and the token.
		if !now.Before(expires) {
			return nil, expiredToken(auth.Service)
		}
		return temp, nil
	}
	return callerOf(key, s.cfg.AccountID), nil
}

// expiredToken words a temporary key used after its expiry as each
// service does: EC2's RequestExpired (which the SDKs take as a cue to
// refresh credentials), the JSON services' ExpiredTokenException, and the
// Query services' ExpiredToken.
func expiredToken(service string) *awserr.Error {
	const msg = "The security token included in the request is expired"
	switch service {
	case "ec2":
		return awserr.New(http.StatusBadRequest, "RequestExpired", "Request has expired.")
	case "ebs", "eks":
		return awserr.New(http.StatusForbidden, "ExpiredTokenException", msg)
	default:
		return awserr.New(http.StatusForbidden, "ExpiredToken", msg)
	}
}

func callerOf(key creds.Key, account string) *reqctx.Caller {
	c := &reqctx.Caller{Key: key, AccountID: account}
	if key.Root() {
		c.ARN = "arn:aws:iam::" + account + ":root"
		c.UserID = account
		return c
	}
	c.ARN = "arn:aws:iam::" + account + ":user/" + key.Profile
	sum := sha256.Sum256([]byte(account + "/" + key.Profile))
	c.UserID = "AIDA" + base32.StdEncoding.EncodeToString(sum[:])[:17]
	return c
}

// authError words a verification failure as the service would.
func authError(service string, e *sigv4.Error, now time.Time) *awserr.Error {
	const fmtTime = "20060102T150405Z"
	expired := func() string {
		if e.RequestTime.IsZero() {
			return e.Message
		}
		if e.RequestTime.Before(now) {
			return fmt.Sprintf("Signature expired: %s is now earlier than %s (%s - 15 min.)",
				e.RequestTime.Format(fmtTime), now.Add(-sigv4.MaxSkew).UTC().Format(fmtTime), now.UTC().Format(fmtTime))
		}
		return fmt.Sprintf("Signature not yet current: %s is still later than %s (%s + 15 min.)",
			e.RequestTime.Format(fmtTime), now.Add(sigv4.MaxSkew).UTC().Format(fmtTime), now.UTC().Format(fmtTime))
	}
	const invalidToken = "The security token included in the request is invalid."
	switch service {
	case "ec2":
		switch e.Kind {
		case sigv4.Expired:
			return awserr.New(http.StatusBadRequest, "RequestExpired", "Request has expired.")
		case sigv4.Malformed, sigv4.MissingAuth, sigv4.BadScope:
			// EC2 says only AuthFailure; the reason is added because a
			// hangar user can act on it (a region or a clock to fix).
			return awserr.New(http.StatusUnauthorized, "AuthFailure", "AWS was not able to validate the provided access credentials: %s", e.Message)
		default:
			return awserr.New(http.StatusUnauthorized, "AuthFailure", "AWS was not able to validate the provided access credentials")
		}
	case "ebs", "eks":
		switch e.Kind {
		case sigv4.UnknownKey, sigv4.BadToken:
			return awserr.New(http.StatusForbidden, "UnrecognizedClientException", invalidToken)
		case sigv4.Expired:
			return awserr.New(http.StatusForbidden, "InvalidSignatureException", "%s", expired())
		case sigv4.MissingAuth:
			return awserr.New(http.StatusForbidden, "MissingAuthenticationTokenException", "Missing Authentication Token")
		case sigv4.Malformed:
			return awserr.New(http.StatusForbidden, "IncompleteSignatureException", "%s", e.Message)
		default:
			return awserr.New(http.StatusForbidden, "InvalidSignatureException", "%s", e.Message)
		}
	default: // sts, iam and anything unknown speak the Query protocol's words
		switch e.Kind {
		case sigv4.UnknownKey, sigv4.BadToken:
			return awserr.New(http.StatusForbidden, "InvalidClientTokenId", invalidToken)
		case sigv4.Expired:
			return awserr.New(http.StatusForbidden, "SignatureDoesNotMatch", "%s", expired())
		case sigv4.MissingAuth:
			return awserr.New(http.StatusForbidden, "MissingAuthenticationToken", "Request is missing Authentication Token")
		case sigv4.Malformed:
			return awserr.New(http.StatusBadRequest, "IncompleteSignature", "%s", e.Message)
		default:
			return awserr.New(http.StatusForbidden, "SignatureDoesNotMatch", "%s", e.Message)
		}
	}
}

func writeGenericError(w http.ResponseWriter, reqID string, e *awserr.Error) {
	status, body := awsproto.ErrorXML("query", reqID, e)
	w.Header().Set("Content-Type", "text/xml")
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// maxSniff is how much of an unauthenticated request's body is read to
// learn which service it was meant for.
const maxSniff = 64 << 10

// writeUnauthenticated answers a request with no usable signature. With no
// credential scope there is no service name, so the Query protocol's
// Version parameter (2016-11-15 is EC2's, 2011-06-15 STS's) picks the
// service whose words and error shape the client's SDK can read. It
// returns the service it chose, or "".
func (s *Server) writeUnauthenticated(w http.ResponseWriter, r *http.Request, reqID string, se *sigv4.Error) string {
	version := r.URL.Query().Get("Version")
	if version == "" && r.Method == http.MethodPost {
		raw, _ := io.ReadAll(io.LimitReader(r.Body, maxSniff))
		if form, err := url.ParseQuery(string(raw)); err == nil {
			version = form.Get("Version")
		}
	}
	for name, q := range s.query {
		if version != "" && q.model.Metadata.APIVersion == version {
			status, body := awsproto.ErrorXML(q.model.Metadata.Protocol, reqID, authError(name, se, s.cfg.Now()))
			w.Header().Set("Content-Type", "text/xml")
			w.WriteHeader(status)
			_, _ = w.Write(body)
			return name
		}
	}
	writeGenericError(w, reqID, authError("", se, s.cfg.Now()))
	return ""
}

// writeUnknownService answers a request signed for a service hangar does
// not run, in that service's own error shape where hangar knows its model
// (JSON for EKS, EBS and the other JSON protocols), else the Query XML
// shape, which the XML protocols' parsers all read.
func writeUnknownService(w http.ResponseWriter, reqID, service string, served []string) {
	sort.Strings(served)
	e := awserr.New(http.StatusBadRequest, "UnknownService",
		"hangar does not serve the service %q named in the credential scope; it serves %s", service, strings.Join(served, ", "))
	if m, err := awsmodel.Load(service); err == nil && (m.Metadata.Protocol == "rest-json" || m.Metadata.Protocol == "json") {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("X-Amzn-ErrorType", e.Code)
		w.WriteHeader(e.Status)
		body, _ := json.Marshal(map[string]string{"message": e.Message, "__type": e.Code})
		_, _ = w.Write(body)
		return
	}
	writeGenericError(w, reqID, e)
}

// cleanPath removes dot segments and repeated slashes, as AWS's services
// do before they sign a path.
func cleanPath(p string) string {
	if p == "" || p == "/" {
		return "/"
	}
	trailing := strings.HasSuffix(p, "/")
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
	c := "/" + strings.Join(out, "/")
	if trailing && c != "/" {
		c += "/"
	}
	return c
}

func (s *Server) serveQuery(ctx context.Context, q *queryService, r *http.Request, body []byte, reqID string) (string, []byte, *awserr.Error) {
	if r.Method != http.MethodPost && r.Method != http.MethodGet {
		return "", nil, awserr.New(http.StatusMethodNotAllowed, "InvalidHttpRequest", "The %s method is not allowed; send POST with a form body or GET with a query string", r.Method)
	}
	form, err := url.ParseQuery(r.URL.RawQuery)
	if err != nil {
		return "", nil, awserr.New(http.StatusBadRequest, "MalformedQueryString", "The query string is malformed: %v", err)
	}
	if r.Method == http.MethodPost && len(body) > 0 {
		ct := r.Header.Get("Content-Type")
		if ct != "" && !strings.HasPrefix(ct, "application/x-www-form-urlencoded") {
			return "", nil, awserr.New(http.StatusBadRequest, "InvalidHttpRequest", "Content-Type %q is not application/x-www-form-urlencoded", ct)
		}
		bodyForm, err := url.ParseQuery(string(body))
		if err != nil {
			return "", nil, awserr.New(http.StatusBadRequest, "MalformedQueryString", "The request body is not a well-formed form: %v", err)
		}
		for k, v := range bodyForm {
			form[k] = append(form[k], v...)
		}
	}
	op := form.Get("Action")
	if op == "" {
		return "", nil, awserr.New(http.StatusBadRequest, "MissingAction", "The request must contain the parameter Action")
	}
	if len(form["Action"]) > 1 {
		return op, nil, awserr.InvalidParameterValue("The parameter Action is given more than once")
	}
	version := form.Get("Version")
	if version == "" {
		return op, nil, awserr.MissingParameter("Version")
	}
	if version != q.model.Metadata.APIVersion {
		return op, nil, awserr.New(http.StatusBadRequest, "NoSuchVersion", "The requested version (%s) of service %s does not exist; hangar speaks %s",
			version, q.model.Metadata.ServiceID, q.model.Metadata.APIVersion)
	}
	if _, known := q.model.Operations[op]; !known {
		return op, nil, awserr.InvalidAction(op, q.model.Metadata.ServiceID)
	}
	h, ok := q.handlers[op]
	if !ok {
		return op, nil, awserr.New(http.StatusBadRequest, "UnsupportedOperation", "The operation %s is not supported by hangar.", op)
	}
	in := reflect.New(h.In).Interface()
	if err := awsproto.DecodeQuery(q.model, op, form, in); err != nil {
		e := awserr.As(err)
		if q.model.Metadata.Protocol == "query" && (e.Code == "MissingParameter" || e.Code == "InvalidParameterValue") {
			// IAM and STS say ValidationError for any parameter that
			// breaks the model's constraints.
			e = &awserr.Error{Code: "ValidationError", Message: e.Message, Status: e.Status, Sender: e.Sender}
		}
		return op, nil, e
	}
	caller := reqctx.From(ctx).Caller
	if caller.ReadOnly() && !readOnlyOp(op) {
		if q.model.Metadata.Protocol == "ec2" {
			return op, nil, awserr.UnauthorizedOperation("You are not authorized to perform this operation. User: %s is not authorized to perform: ec2:%s", caller.ARN, op)
		}
		return op, nil, awserr.New(http.StatusForbidden, "AccessDenied", "User: %s is not authorized to perform: %s:%s", caller.ARN, q.model.Metadata.EndpointPrefix, op)
	}
	if dryRun(in) {
		return op, nil, awserr.DryRunOperation()
	}
	call := func(ctx context.Context, in any) (any, error) { return h.Call(ctx, in) }
	for i := len(q.mw) - 1; i >= 0; i-- {
		mw, next := q.mw[i], call
		call = func(ctx context.Context, in any) (any, error) { return mw(ctx, h, in, next) }
	}
	out, err := call(ctx, in)
	if err != nil {
		e := awserr.As(err)
		if e.Code == "InternalError" {
			reqctx.From(ctx).Log.Error("handler failed", "op", op, "err", err)
		}
		return op, nil, e
	}
	resp, err := awsproto.EncodeXML(q.model, op, reqID, out)
	if err != nil {
		reqctx.From(ctx).Log.Error("encoding response", "op", op, "err", err)
		return op, nil, awserr.As(err)
	}
	return op, resp, nil
}

// readBody reads at most limit+1 bytes of the body: into one buffer of the
// announced size when the client sent Content-Length (a 512 KiB block is
// read once, without io.ReadAll's growing copies), growing otherwise.
func readBody(r *http.Request, limit int64) ([]byte, error) {
	if n := r.ContentLength; n >= 0 && n <= limit {
		buf := make([]byte, n)
		// net/http ends the body at Content-Length; a shorter one is
		// io.ErrUnexpectedEOF.
		if _, err := io.ReadFull(r.Body, buf); err != nil {
			return nil, err
		}
		return buf, nil
	}
	return io.ReadAll(io.LimitReader(r.Body, limit+1))
}
