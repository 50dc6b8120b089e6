// Package ec2 implements the EC2 API over the gateway's records: it owns
// the AWS view of VPCs, subnets, security groups, key pairs, tags, internet
// gateways and route tables (later instances, volumes, images), validates
// every request as EC2 does, and answers with the SDK's own output types.
//
// Handlers are methods named after the EC2 operation they implement; the
// server finds them by name. Each handler does its checks and its writes in
// one store transaction, so a failed request changes nothing.
package ec2

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"reflect"
	"sync"
	"time"

	"hangar.dev/hangar/services/gateway/awserr"
	"hangar.dev/hangar/services/gateway/server"
	"hangar.dev/hangar/services/internal/awsid"
	"hangar.dev/hangar/services/internal/hostconf"
	"hangar.dev/hangar/services/internal/store"
)

// Service is the EC2 API.
type Service struct {
	db  *store.DB
	cfg hostconf.Config
	log *slog.Logger
	now func() time.Time

	tokenMu sync.Mutex
	tokens  map[string]*sync.Mutex

	// storage is hangar-ebsd (volume.go); nil until SetStorage.
	storage Storage
	// net pushes VPCs to hangar-netd (netsync.go); nil until SetNetwork,
	// and then records are only records (unit tests).
	net *netSync
	// compute is hangar-vmd (instances.go); nil until SetCompute.
	compute Compute
	// identity is IAM and STS (profiles.go), signer the key of instance
	// identity documents (identity.go); nil until SetIdentity, and then
	// instance profiles are refused and documents go unsigned.
	identity Identity
	signer   *IdentitySigner
}

// SetIdentity gives EC2 the IAM and STS it resolves instance profiles and
// issues role credentials with, and the key it signs identity documents
// with.
func (s *Service) SetIdentity(id Identity, signer *IdentitySigner) {
	s.identity, s.signer = id, signer
}

// SetStorage gives EC2 the storage service that holds volume and snapshot
// data.
func (s *Service) SetStorage(st Storage) { s.storage = st }

// New makes the EC2 service over db.
func New(db *store.DB, cfg hostconf.Config, log *slog.Logger) *Service {
	return &Service{db: db, cfg: cfg, log: log, now: time.Now, tokens: map[string]*sync.Mutex{}}
}

// Init creates what a new AWS account has: the default VPC with a default
// subnet in the host's zone, its default security group, main route table
// and internet gateway. It runs at every start and creates only what is
// missing, so it is safe to repeat.
func (s *Service) Init(ctx context.Context) error {
	err := s.db.Update(func(tx *store.Tx) error {
		if tx.Has(bucketMeta, metaDefaultVPC) {
			return nil
		}
		return s.createDefaultVPC(ctx, tx)
	})
	if err != nil {
		return err
	}
	return s.failInterruptedImages()
}

const (
	bucketIDs    = "ids"
	bucketMeta   = "meta"
	bucketTokens = "client-tokens"

	metaDefaultVPC = "default-vpc"
)

// newID issues an id with prefix that no record has ever had: AWS never
// reuses an id, and scripts rely on that.
func newID(tx *store.Tx, prefix string) (string, error) {
	for {
		id := awsid.New(prefix)
		if tx.Has(bucketIDs, id) {
			continue
		}
		if err := tx.Put(bucketIDs, id, time.Now().Unix()); err != nil {
			return "", err
		}
		return id, nil
	}
}

func ptr[T any](v T) *T { return &v }

func deref[T any](p *T) T {
	var zero T
	if p == nil {
		return zero
	}
	return *p
}

// account returns the host's account id.
func (s *Service) account() string { return s.cfg.AccountID }

// tokenRecord is a remembered ClientToken request.
type tokenRecord struct {
	Op        string
	InputHash string
	Output    json.RawMessage
	Created   time.Time
}

// Idempotency is the server middleware that makes requests carrying a
// ClientToken idempotent, as EC2 documents: a retry with the same token and
// the same parameters gets the first response; the same token with other
// parameters is IdempotentParameterMismatch.
func (s *Service) Idempotency(ctx context.Context, h server.Handler, in any, next func(context.Context, any) (any, error)) (any, error) {
	tokField := reflect.ValueOf(in).Elem().FieldByName("ClientToken")
	if !tokField.IsValid() || tokField.Kind() != reflect.Pointer || tokField.IsNil() || tokField.Elem().String() == "" {
		return next(ctx, in)
	}
	token := tokField.Elem().String()
	if len(token) > 64 {
		return nil, awserr.InvalidParameterValue("The client token must be no longer than 64 characters")
	}
	hash, err := inputHash(in)
	if err != nil {
		return nil, err
	}
	key := h.Op + "/" + token

	s.tokenMu.Lock()
	mu := s.tokens[key]
	if mu == nil {
		mu = &sync.Mutex{}
		s.tokens[key] = mu
	}
	s.tokenMu.Unlock()
	mu.Lock()
	defer mu.Unlock()

	var rec tokenRecord
	err = s.db.View(func(tx *store.Tx) error { return tx.Get(bucketTokens, key, &rec) })
	switch {
	case err == nil:
		if rec.InputHash != hash {
			return nil, awserr.New(400, "IdempotentParameterMismatch",
				"The client token %s has already been used with different parameters", token)
		}
		out := reflect.New(h.Out)
		if err := json.Unmarshal(rec.Output, out.Interface()); err != nil {
			return nil, fmt.Errorf("replaying client token: %w", err)
		}
		return out.Interface(), nil
	case !errors.Is(err, store.ErrNotFound):
		return nil, err
	}
	out, err := next(ctx, in)
	if err != nil {
		return nil, err
	}
	raw, err := json.Marshal(out)
	if err != nil {
		return nil, fmt.Errorf("remembering client token: %w", err)
	}
	rec = tokenRecord{Op: h.Op, InputHash: hash, Output: raw, Created: s.now()}
	if err := s.db.Update(func(tx *store.Tx) error { return tx.Put(bucketTokens, key, rec) }); err != nil {
		return nil, err
	}
	return out, nil
}

// inputHash hashes the request parameters, without the token and DryRun.
func inputHash(in any) (string, error) {
	v := reflect.New(reflect.TypeOf(in).Elem())
	v.Elem().Set(reflect.ValueOf(in).Elem())
	if f := v.Elem().FieldByName("ClientToken"); f.IsValid() {
		f.Set(reflect.Zero(f.Type()))
	}
	if f := v.Elem().FieldByName("DryRun"); f.IsValid() {
		f.Set(reflect.Zero(f.Type()))
	}
	raw, err := json.Marshal(v.Interface())
	if err != nil {
		return "", err
	}
	sum := sha256.Sum256(raw)
	return hex.EncodeToString(sum[:]), nil
}
