// Package reqctx carries what the gateway learned about a request (who sent
// it, its request id, its logger) to the handlers, through the context.
package reqctx

import (
	"context"
	"log/slog"

	"hangar.dev/hangar/services/internal/creds"
)

// Caller is the verified identity behind a request.
type Caller struct {
	Key       creds.Key
	AccountID string
	// ARN and UserID are what sts get-caller-identity reports.
	ARN    string
	UserID string
}

// ReadOnly reports whether the caller may only read.
func (c *Caller) ReadOnly() bool { return c != nil && c.Key.Access == creds.ReadOnlyAccess }

// Request is the per-request state.
type Request struct {
	ID     string
	Caller *Caller
	Log    *slog.Logger
	Region string
	// Host is the Host header the client sent: the endpoint it used.
	Host string
}

type key struct{}

// With returns ctx carrying r.
func With(ctx context.Context, r *Request) context.Context {
	return context.WithValue(ctx, key{}, r)
}

// From returns the request state of ctx; a context without one (a unit
// test calling a handler directly) gets an empty one with a discarding
// logger.
func From(ctx context.Context) *Request {
	if r, ok := ctx.Value(key{}).(*Request); ok {
		return r
	}
	return &Request{Log: slog.New(slog.DiscardHandler), Caller: &Caller{}}
}
