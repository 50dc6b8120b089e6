// Package ebs serves the EBS direct APIs (StartSnapshot, PutSnapshotBlock,
// CompleteSnapshot, GetSnapshotBlock, ListSnapshotBlocks,
// ListChangedBlocks) over REST-JSON. Snapshot records belong to the EC2
// service (so DescribeSnapshots shows imports); block data goes to and
// comes from hangar-ebsd in file descriptors, never in bus messages.
//
// It validates requests as EBS does and words every failure as EBS's
// ValidationException (with its Reason), ResourceNotFoundException and
// friends; it never decides where blocks live.
package ebs

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"reflect"
	"strconv"
	"strings"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/ebs"
	"github.com/aws/aws-sdk-go-v2/service/ebs/types"
	ec2types "github.com/aws/aws-sdk-go-v2/service/ec2/types"

	"hangar.dev/hangar/services/gateway/awserr"
	"hangar.dev/hangar/services/gateway/awsmodel"
	"hangar.dev/hangar/services/gateway/awsproto"
	"hangar.dev/hangar/services/gateway/ec2"
	"hangar.dev/hangar/services/gateway/reqctx"
	"hangar.dev/hangar/services/internal/api"
)

// BlockSize is the EBS snapshot block size.
const BlockSize = api.SnapshotBlockSize

// MaxVolumeGiB is the largest snapshot volume (64 TiB).
const MaxVolumeGiB = 65536

// Storage is what the EBS direct API needs of hangar-ebsd; *api.StorageClient
// has it.
type Storage interface {
	PutBlock(ctx context.Context, snapID string, index uint64, data []byte, checksum string) error
	GetBlock(ctx context.Context, snapID string, index uint64, token string) ([]byte, string, error)
	CompleteSnapshot(ctx context.Context, a api.CompleteSnapshotArgs) (api.SnapshotInfo, error)
	ListBlocks(ctx context.Context, snapID string, startIndex uint64, max uint32) (api.BlockPage, error)
	ListChangedBlocks(ctx context.Context, first, second string, startIndex uint64, max uint32) (api.ChangedBlockPage, error)
}

// Records is what it needs of the EC2 service's snapshot records.
type Records interface {
	StartDirectSnapshot(ctx context.Context, d ec2.DirectStart) (*ec2types.Snapshot, error)
	DirectSnapshot(ctx context.Context, id string) (*ec2types.Snapshot, bool, error)
	FinishDirectSnapshot(ctx context.Context, id string, state ec2types.SnapshotState) error
}

// Service is the EBS direct API.
type Service struct {
	model   *awsmodel.Model
	records Records
	storage Storage
	log     *slog.Logger
	now     func() time.Time
}

// New makes the service; storage may be nil while ebsd is absent.
func New(records Records, storage Storage, log *slog.Logger) *Service {
	return &Service{model: awsmodel.MustLoad("ebs"), records: records, storage: storage, log: log, now: time.Now}
}

// MaxBody is one block plus room for JSON requests.
func (s *Service) MaxBody() int64 { return BlockSize + 64<<10 }

// WriteError writes an error the server found before the request reached us.
func (s *Service) WriteError(w http.ResponseWriter, requestID string, e *awserr.Error) {
	awsproto.WriteRESTError(w, requestID, e)
}

type handler struct {
	in   reflect.Type
	call func(s *Service, ctx context.Context, in any) (any, error)
}

func h[I, O any](f func(*Service, context.Context, *I) (*O, error)) handler {
	return handler{in: reflect.TypeOf((*I)(nil)).Elem(), call: func(s *Service, ctx context.Context, in any) (any, error) {
		return f(s, ctx, in.(*I))
	}}
}

var handlers = map[string]handler{
	"StartSnapshot":      h((*Service).StartSnapshot),
	"PutSnapshotBlock":   h((*Service).PutSnapshotBlock),
	"CompleteSnapshot":   h((*Service).CompleteSnapshot),
	"GetSnapshotBlock":   h((*Service).GetSnapshotBlock),
	"ListSnapshotBlocks": h((*Service).ListSnapshotBlocks),
	"ListChangedBlocks":  h((*Service).ListChangedBlocks),
}

// ServeAWS answers one verified request.
func (s *Service) ServeAWS(w http.ResponseWriter, r *http.Request, body []byte) {
	rc := reqctx.From(r.Context())
	op, labels, ok := awsproto.MatchREST(s.model, r.Method, r.URL.Path)
	if !ok {
		awsproto.WriteRESTError(w, rc.ID, awserr.New(404, "UnknownOperationException", "No EBS operation answers %s %s", r.Method, r.URL.Path))
		return
	}
	hd := handlers[op]
	in := reflect.New(hd.in).Interface()
	if err := awsproto.DecodeREST(s.model, op, r, labels, body, in); err != nil {
		awsproto.WriteRESTError(w, rc.ID, err)
		return
	}
	if rc.Caller != nil && rc.Caller.ReadOnly() && !strings.HasPrefix(op, "Get") && !strings.HasPrefix(op, "List") {
		awsproto.WriteRESTError(w, rc.ID, &awsproto.RESTError{Err: awserr.New(403, "AccessDeniedException",
			"User: %s is not authorized to perform: ebs:%s", rc.Caller.ARN, op), Fields: map[string]any{"Reason": "UNAUTHORIZED_ACCOUNT"}})
		return
	}
	if s.storage == nil {
		awsproto.WriteRESTError(w, rc.ID, awserr.New(500, "InternalServerException", "The storage service (hangar-ebsd) is not running on this host."))
		return
	}
	out, err := hd.call(s, r.Context(), in)
	if err != nil {
		e := awserr.As(err)
		if e.Status >= 500 {
			rc.Log.Error("EBS operation failed", "op", op, "err", err)
		}
		awsproto.WriteRESTError(w, rc.ID, err)
		return
	}
	res, err := awsproto.EncodeREST(s.model, op, out)
	if err != nil {
		rc.Log.Error("encoding EBS response", "op", op, "err", err)
		awsproto.WriteRESTError(w, rc.ID, err)
		return
	}
	for k, v := range res.Header {
		w.Header()[k] = v
	}
	if res.Length >= 0 {
		w.Header().Set("Content-Length", strconv.FormatInt(res.Length, 10))
	}
	w.WriteHeader(res.Status)
	_, _ = io.Copy(w, res.Body)
}

func notFound(id string) error {
	return &awsproto.RESTError{Err: awserr.New(404, "ResourceNotFoundException", "The snapshot '%s' does not exist.", id),
		Fields: map[string]any{"Reason": "SNAPSHOT_NOT_FOUND"}}
}

// storageErr words an ebsd error as EBS would; reason is the
// ValidationException reason for InvalidArgument.
func storageErr(err error, id, reason string) error {
	e, ok := api.AsError(err)
	if !ok {
		return fmt.Errorf("calling hangar-ebsd for %s: %w", id, err)
	}
	switch e.Name {
	case api.ErrNotFound:
		return notFound(id)
	case api.ErrInvalidArgument:
		return awsproto.ValidationError(reason, "%s", e.Message)
	case api.ErrConflict:
		return awsproto.ValidationError("INVALID_SNAPSHOT_ID", "%s", e.Message)
	case api.ErrUnavailable, "org.freedesktop.DBus.Error.ServiceUnknown", "org.freedesktop.DBus.Error.NameHasNoOwner":
		return awserr.New(500, "InternalServerException", "The storage service (hangar-ebsd) is not available: %s", e.Message)
	case api.ErrInsufficientCapacity:
		return &awsproto.RESTError{Err: awserr.New(402, "ServiceQuotaExceededException", "%s", e.Message),
			Fields: map[string]any{"Reason": "DEPENDENCY_SERVICE_QUOTA_EXCEEDED"}}
	}
	return fmt.Errorf("hangar-ebsd refused %s: %w", id, err)
}

// snapshot loads a snapshot record; pending says whether it must be a
// pending EBS direct snapshot (to write) or a completed one (to read).
func (s *Service) snapshot(ctx context.Context, id string, pending bool) (*ec2types.Snapshot, error) {
	rec, direct, err := s.records.DirectSnapshot(ctx, id)
	if err != nil {
		if ec2.IsSnapshotNotFound(err) {
			return nil, notFound(id)
		}
		return nil, err
	}
	switch {
	case pending && (!direct || rec.State != ec2types.SnapshotStatePending):
		return nil, awsproto.ValidationError("INVALID_SNAPSHOT_ID", "The snapshot '%s' is %s; blocks can only be written to a pending snapshot started with StartSnapshot.", id, rec.State)
	case !pending && rec.State != ec2types.SnapshotStateCompleted:
		return nil, awsproto.ValidationError("INVALID_SNAPSHOT_ID", "The snapshot '%s' is %s; only completed snapshots can be read.", id, rec.State)
	}
	return rec, nil
}

// StartSnapshot starts a snapshot, empty or incremental on a parent.
func (s *Service) StartSnapshot(ctx context.Context, in *ebs.StartSnapshotInput) (*ebs.StartSnapshotOutput, error) {
	size := aws.ToInt64(in.VolumeSize)
	if size < 1 || size > MaxVolumeGiB {
		return nil, awsproto.ValidationError("INVALID_VOLUME_SIZE", "The volume size %d GiB is not between 1 and %d GiB.", size, MaxVolumeGiB)
	}
	if aws.ToBool(in.Encrypted) || in.KmsKeyArn != nil {
		return nil, awsproto.ValidationError("INVALID_PARAMETER_VALUE", "Encrypted snapshots are not supported by hangar.")
	}
	timeout := aws.ToInt32(in.Timeout)
	if timeout == 0 {
		timeout = 60
	}
	var tags []ec2types.Tag
	for _, t := range in.Tags {
		tags = append(tags, ec2types.Tag{Key: t.Key, Value: t.Value})
	}
	rec, err := s.records.StartDirectSnapshot(ctx, ec2.DirectStart{VolumeSizeGiB: size, ParentID: aws.ToString(in.ParentSnapshotId),
		Description: aws.ToString(in.Description), ClientToken: aws.ToString(in.ClientToken), TimeoutMinutes: timeout, Tags: tags})
	switch {
	case errors.Is(err, ec2.ErrDirectTokenMismatch):
		return nil, awserr.New(409, "ConflictException", "The client token %s was already used with other parameters.", aws.ToString(in.ClientToken))
	case err != nil && ec2.IsSnapshotNotFound(err):
		return nil, notFound(aws.ToString(in.ParentSnapshotId))
	case err != nil:
		var e *awserr.Error
		if errors.As(err, &e) && e.Status < 500 {
			return nil, awsproto.ValidationError("INVALID_PARAMETER_VALUE", "%s", e.Message)
		}
		return nil, err
	}
	out := &ebs.StartSnapshotOutput{SnapshotId: rec.SnapshotId, OwnerId: rec.OwnerId, Status: types.Status(rec.State),
		StartTime: rec.StartTime, VolumeSize: ptr(int64(aws.ToInt32(rec.VolumeSize))), BlockSize: ptr(int32(BlockSize)),
		ParentSnapshotId: in.ParentSnapshotId}
	if d := aws.ToString(rec.Description); d != "" {
		out.Description = rec.Description
	}
	for _, t := range rec.Tags {
		out.Tags = append(out.Tags, types.Tag{Key: t.Key, Value: t.Value})
	}
	return out, nil
}

func ptr[T any](v T) *T { return &v }

func checkIndex(rec *ec2types.Snapshot, index int32) error {
	n := int64(aws.ToInt32(rec.VolumeSize)) * (1 << 30) / BlockSize
	if index < 0 || int64(index) >= n {
		return awsproto.ValidationError("INVALID_BLOCK", "The block index %d is out of range: the snapshot's %d GiB volume has blocks 0 to %d.", index, aws.ToInt32(rec.VolumeSize), n-1)
	}
	return nil
}

// PutSnapshotBlock writes one 512 KiB block after checking its length and
// its SHA-256 against the checksum sent with it.
func (s *Service) PutSnapshotBlock(ctx context.Context, in *ebs.PutSnapshotBlockInput) (*ebs.PutSnapshotBlockOutput, error) {
	id := aws.ToString(in.SnapshotId)
	if in.ChecksumAlgorithm != types.ChecksumAlgorithmChecksumAlgorithmSha256 {
		return nil, awsproto.ValidationError("INVALID_PARAMETER_VALUE", "The checksum algorithm %q is not supported; use SHA256.", in.ChecksumAlgorithm)
	}
	var data []byte
	if p, ok := in.BlockData.(interface{ Bytes() []byte }); ok {
		data = p.Bytes() // the body the server read, without a copy
	} else {
		var err error
		if data, err = io.ReadAll(in.BlockData); err != nil {
			return nil, err
		}
	}
	if n := aws.ToInt32(in.DataLength); n != BlockSize || len(data) != int(n) {
		return nil, awsproto.ValidationError("INVALID_BLOCK", "A block must hold %d bytes: DataLength is %d and %d bytes were sent.", BlockSize, n, len(data))
	}
	rec, err := s.snapshot(ctx, id, true)
	if err != nil {
		return nil, err
	}
	index := aws.ToInt32(in.BlockIndex)
	if err := checkIndex(rec, index); err != nil {
		return nil, err
	}
	checksum := aws.ToString(in.Checksum)
	if raw, err := base64.StdEncoding.DecodeString(checksum); err != nil || len(raw) != sha256.Size {
		return nil, awsproto.ValidationError("INVALID_PARAMETER_VALUE", "The checksum %q is not a base64 SHA-256.", checksum)
	}
	// ebsd hashes the block to address it and refuses a mismatch.
	if err := s.storage.PutBlock(ctx, id, uint64(index), data, checksum); err != nil {
		return nil, storageErr(err, id, "INVALID_BLOCK")
	}
	return &ebs.PutSnapshotBlockOutput{Checksum: ptr(checksum), ChecksumAlgorithm: types.ChecksumAlgorithmChecksumAlgorithmSha256}, nil
}

// CompleteSnapshot seals a snapshot once the count of blocks written (and
// the aggregated checksum, when given) agree.
func (s *Service) CompleteSnapshot(ctx context.Context, in *ebs.CompleteSnapshotInput) (*ebs.CompleteSnapshotOutput, error) {
	id := aws.ToString(in.SnapshotId)
	rec, direct, err := s.records.DirectSnapshot(ctx, id)
	if err != nil {
		if ec2.IsSnapshotNotFound(err) {
			return nil, notFound(id)
		}
		return nil, err
	}
	if !direct {
		return nil, awsproto.ValidationError("INVALID_SNAPSHOT_ID", "The snapshot '%s' was not started with StartSnapshot.", id)
	}
	if rec.State == ec2types.SnapshotStateCompleted {
		return &ebs.CompleteSnapshotOutput{Status: types.StatusCompleted}, nil
	}
	if rec.State != ec2types.SnapshotStatePending {
		return nil, awsproto.ValidationError("INVALID_SNAPSHOT_ID", "The snapshot '%s' is %s.", id, rec.State)
	}
	a := api.CompleteSnapshotArgs{SnapshotID: id, ChangedBlocks: uint32(aws.ToInt32(in.ChangedBlocksCount))}
	if in.Checksum != nil {
		if in.ChecksumAlgorithm != types.ChecksumAlgorithmChecksumAlgorithmSha256 || in.ChecksumAggregationMethod != types.ChecksumAggregationMethodChecksumAggregationLinear {
			return nil, awsproto.ValidationError("INVALID_PARAMETER_VALUE", "An aggregated checksum needs ChecksumAlgorithm SHA256 and ChecksumAggregationMethod LINEAR.")
		}
		a.Checksum, a.ChecksumAlgorithm, a.AggregationMethod = *in.Checksum, string(in.ChecksumAlgorithm), string(in.ChecksumAggregationMethod)
	}
	if _, err := s.storage.CompleteSnapshot(ctx, a); err != nil {
		return nil, storageErr(err, id, "INVALID_PARAMETER_VALUE")
	}
	if err := s.records.FinishDirectSnapshot(ctx, id, ec2types.SnapshotStateCompleted); err != nil {
		return nil, err
	}
	return &ebs.CompleteSnapshotOutput{Status: types.StatusCompleted}, nil
}

// GetSnapshotBlock returns one block's bytes with their checksum.
func (s *Service) GetSnapshotBlock(ctx context.Context, in *ebs.GetSnapshotBlockInput) (*ebs.GetSnapshotBlockOutput, error) {
	id := aws.ToString(in.SnapshotId)
	rec, err := s.snapshot(ctx, id, false)
	if err != nil {
		return nil, err
	}
	index := aws.ToInt32(in.BlockIndex)
	if err := checkIndex(rec, index); err != nil {
		return nil, err
	}
	data, sum, err := s.storage.GetBlock(ctx, id, uint64(index), aws.ToString(in.BlockToken))
	if err != nil {
		return nil, storageErr(err, id, "INVALID_BLOCK_TOKEN")
	}
	return &ebs.GetSnapshotBlockOutput{BlockData: io.NopCloser(strings.NewReader(string(data))), DataLength: ptr(int32(len(data))),
		Checksum: ptr(sum), ChecksumAlgorithm: types.ChecksumAlgorithmChecksumAlgorithmSha256}, nil
}

const pageTokenPrefix = "hangar-ebs1:"

func pageStart(next *string, starting *int32) (uint64, error) {
	if t := aws.ToString(next); t != "" {
		raw, err := base64.StdEncoding.DecodeString(t)
		rest, ok := strings.CutPrefix(string(raw), pageTokenPrefix)
		if err != nil || !ok {
			return 0, awsproto.ValidationError("INVALID_PAGE_TOKEN", "The pagination token is not valid.")
		}
		n, err := strconv.ParseUint(rest, 10, 64)
		if err != nil {
			return 0, awsproto.ValidationError("INVALID_PAGE_TOKEN", "The pagination token is not valid.")
		}
		return n, nil
	}
	return uint64(aws.ToInt32(starting)), nil
}

func pageToken(next uint64, more bool) *string {
	if !more {
		return nil
	}
	return ptr(base64.StdEncoding.EncodeToString([]byte(pageTokenPrefix + strconv.FormatUint(next, 10))))
}

func maxResults(m *int32) uint32 {
	if m == nil {
		return 10000
	}
	return uint32(*m)
}

// ListSnapshotBlocks lists the blocks a snapshot holds with their tokens.
func (s *Service) ListSnapshotBlocks(ctx context.Context, in *ebs.ListSnapshotBlocksInput) (*ebs.ListSnapshotBlocksOutput, error) {
	id := aws.ToString(in.SnapshotId)
	rec, err := s.snapshot(ctx, id, false)
	if err != nil {
		return nil, err
	}
	start, err := pageStart(in.NextToken, in.StartingBlockIndex)
	if err != nil {
		return nil, err
	}
	page, err := s.storage.ListBlocks(ctx, id, start, maxResults(in.MaxResults))
	if err != nil {
		return nil, storageErr(err, id, "INVALID_PARAMETER_VALUE")
	}
	out := &ebs.ListSnapshotBlocksOutput{Blocks: []types.Block{}, BlockSize: ptr(int32(BlockSize)),
		VolumeSize: ptr(int64(aws.ToInt32(rec.VolumeSize))), ExpiryTime: ptr(s.now().Add(7 * 24 * time.Hour).UTC()),
		NextToken: pageToken(page.NextIndex, page.More)}
	for _, b := range page.Blocks {
		out.Blocks = append(out.Blocks, types.Block{BlockIndex: ptr(int32(b.Index)), BlockToken: ptr(b.Token)})
	}
	return out, nil
}

// ListChangedBlocks lists the blocks that differ between two snapshots of
// one lineage (or every block of the second, without a first).
func (s *Service) ListChangedBlocks(ctx context.Context, in *ebs.ListChangedBlocksInput) (*ebs.ListChangedBlocksOutput, error) {
	second := aws.ToString(in.SecondSnapshotId)
	rec, err := s.snapshot(ctx, second, false)
	if err != nil {
		return nil, err
	}
	first := aws.ToString(in.FirstSnapshotId)
	if first != "" {
		if _, err := s.snapshot(ctx, first, false); err != nil {
			return nil, err
		}
	}
	start, err := pageStart(in.NextToken, in.StartingBlockIndex)
	if err != nil {
		return nil, err
	}
	page, err := s.storage.ListChangedBlocks(ctx, first, second, start, maxResults(in.MaxResults))
	if err != nil {
		return nil, storageErr(err, second, "UNRELATED_SNAPSHOTS")
	}
	out := &ebs.ListChangedBlocksOutput{ChangedBlocks: []types.ChangedBlock{}, BlockSize: ptr(int32(BlockSize)),
		VolumeSize: ptr(int64(aws.ToInt32(rec.VolumeSize))), ExpiryTime: ptr(s.now().Add(7 * 24 * time.Hour).UTC()),
		NextToken: pageToken(page.NextIndex, page.More)}
	for _, b := range page.Blocks {
		cb := types.ChangedBlock{BlockIndex: ptr(int32(b.Index))}
		if b.FirstToken != "" {
			cb.FirstBlockToken = ptr(b.FirstToken)
		}
		if b.SecondToken != "" {
			cb.SecondBlockToken = ptr(b.SecondToken)
		}
		out.ChangedBlocks = append(out.ChangedBlocks, cb)
	}
	return out, nil
}
