package servers

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/netd/core"
)

// Instance is what IMDS knows of the caller.
type Instance struct {
	Metadata api.InstanceMetadata
	Net      core.NetInfo
}

// InstanceFunc identifies the caller by its source address within the
// VPC (never by anything it claims) and returns its instance, or false.
type InstanceFunc func(ip netip.Addr) (Instance, bool)

// IMDS is one VPC's instance metadata service.
type IMDS struct {
	srv  *http.Server
	done chan struct{}
}

type connKey struct{}

// StartIMDS serves instance metadata on 169.254.169.254:80 inside ns.
func StartIMDS(k Netns, ns string, lookup InstanceFunc, log *slog.Logger) (*IMDS, error) {
	var ln net.Listener
	err := k.In(ns, func() error {
		var err error
		ln, err = net.Listen("tcp4", netip.AddrPortFrom(core.IMDSAddr, 80).String())
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("listening for IMDS in %s: %w", ns, err)
	}
	h := NewIMDSHandler(lookup, time.Now)
	srv := &http.Server{
		Handler:           h,
		ReadHeaderTimeout: 10 * time.Second,
		ConnContext:       func(ctx context.Context, c net.Conn) context.Context { return context.WithValue(ctx, connKey{}, c) },
	}
	s := &IMDS{srv: srv, done: make(chan struct{})}
	go func() {
		defer close(s.done)
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Warn("IMDS stopped", "namespace", ns, "err", err)
		}
	}()
	return s, nil
}

// Close stops the server.
func (s *IMDS) Close() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_ = s.srv.Shutdown(ctx)
	_ = s.srv.Close()
	<-s.done
}

// IMDSHandler serves IMDSv1 and v2 for the instances lookup knows.
type IMDSHandler struct {
	lookup InstanceFunc
	mu     sync.Mutex
	tokens *core.Tokens
}

// NewIMDSHandler makes the HTTP handler (exported for unit tests).
func NewIMDSHandler(lookup InstanceFunc, now func() time.Time) *IMDSHandler {
	return &IMDSHandler{lookup: lookup, tokens: core.NewTokens(now)}
}

// setTTL sets the IP TTL of the connection's replies: the PUT response
// hop limit, so a token cannot be fetched from further away than allowed.
func setTTL(r *http.Request, ttl int) {
	c, ok := r.Context().Value(connKey{}).(net.Conn)
	if !ok {
		return
	}
	sc, ok := c.(syscall.Conn)
	if !ok {
		return
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return
	}
	_ = raw.Control(func(fd uintptr) { _ = unix.SetsockoptInt(int(fd), unix.IPPROTO_IP, unix.IP_TTL, ttl) })
}

func (h *IMDSHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Server", "EC2ws")
	ap, err := netip.ParseAddrPort(r.RemoteAddr)
	if err != nil {
		http.Error(w, "bad peer", http.StatusBadRequest)
		return
	}
	inst, ok := h.lookup(ap.Addr().Unmap())
	if !ok {
		http.NotFound(w, r)
		return
	}
	md := inst.Metadata
	if md.HttpEndpoint == "disabled" {
		http.Error(w, "Forbidden", http.StatusForbidden)
		return
	}
	hop := int(md.HttpPutResponseHopLimit)
	if hop <= 0 {
		hop = 1
	}
	ip := ap.Addr().Unmap()
	if r.URL.Path == "/latest/api/token" {
		if r.Method != http.MethodPut {
			w.Header().Set("Allow", "PUT")
			http.Error(w, "Method Not Allowed", http.StatusMethodNotAllowed)
			return
		}
		// IMDS refuses token requests that went through a proxy.
		if r.Header.Get("X-Forwarded-For") != "" {
			http.Error(w, "Forbidden", http.StatusForbidden)
			return
		}
		ttl, err := strconv.Atoi(r.Header.Get("X-aws-ec2-metadata-token-ttl-seconds"))
		if err != nil {
			http.Error(w, "Bad Request", http.StatusBadRequest)
			return
		}
		var b [32]byte
		_, _ = rand.Read(b[:])
		tok := base64.RawURLEncoding.EncodeToString(b[:])
		h.mu.Lock()
		err = h.tokens.Issue(tok, ip, ttl)
		h.mu.Unlock()
		if err != nil {
			http.Error(w, "Bad Request", http.StatusBadRequest)
			return
		}
		setTTL(r, hop)
		w.Header().Set("X-aws-ec2-metadata-token-ttl-seconds", strconv.Itoa(ttl))
		w.Header().Set("Content-Type", "text/plain")
		_, _ = w.Write([]byte(tok))
		return
	}
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD, PUT")
		http.Error(w, "Method Not Allowed", http.StatusMethodNotAllowed)
		return
	}
	setTTL(r, 64)
	if tok := r.Header.Get("X-aws-ec2-metadata-token"); tok != "" {
		h.mu.Lock()
		valid := h.tokens.Valid(tok, ip)
		h.mu.Unlock()
		if !valid {
			http.Error(w, "Unauthorized", http.StatusUnauthorized)
			return
		}
	} else if md.HttpTokens == "required" {
		http.Error(w, "Unauthorized", http.StatusUnauthorized)
		return
	}
	path := r.URL.Path
	if path == "/" || path == "" {
		writeText(w, strings.Join(imdsVersions, "\n"))
		return
	}
	// EC2 serves the same tree under each dated API version and "latest";
	// cloud-init's Ec2 datasource asks for dated ones (2021-03-23, then
	// 2018-09-24, then 2009-04-04) and never for "latest".
	version, rest, _ := strings.Cut(strings.TrimPrefix(path, "/"), "/")
	if !slices.Contains(imdsVersions, version) {
		http.NotFound(w, r)
		return
	}
	if rest == "" {
		writeText(w, "dynamic\nmeta-data\nuser-data")
		return
	}
	body, ok := core.ResolveMetadata(core.MetadataTree(md, inst.Net), md, rest)
	if !ok {
		http.NotFound(w, r)
		return
	}
	if rest == "user-data" {
		w.Header().Set("Content-Type", "application/octet-stream")
		_, _ = w.Write([]byte(body))
		return
	}
	writeText(w, body)
}

// imdsVersions are the API versions EC2's IMDS lists at "/", oldest first.
var imdsVersions = []string{
	"1.0", "2007-01-19", "2007-03-01", "2007-08-29", "2007-10-10", "2007-12-15",
	"2008-02-01", "2008-09-01", "2009-04-04", "2011-01-01", "2011-05-01",
	"2012-01-12", "2014-02-25", "2014-11-05", "2015-10-20", "2016-04-19",
	"2016-06-30", "2016-09-02", "2018-03-28", "2018-08-17", "2018-09-24",
	"2019-10-01", "2020-10-27", "2021-01-03", "2021-03-23", "2021-07-15",
	"2022-09-24", "latest",
}

func writeText(w http.ResponseWriter, s string) {
	w.Header().Set("Content-Type", "text/plain")
	_, _ = w.Write([]byte(s))
}
