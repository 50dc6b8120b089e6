package awsproto

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/ebs"
	"github.com/aws/aws-sdk-go-v2/service/ebs/types"

	"hangar.dev/hangar/services/gateway/awsmodel"
)

// restServer decodes every request with the codec and answers with reply.
type restServer struct {
	t     *testing.T
	m     *awsmodel.Model
	op    string
	in    any
	reply func(op string, in any) (any, error)
}

var ebsInputs = map[string]reflect.Type{
	"StartSnapshot":      reflect.TypeOf(ebs.StartSnapshotInput{}),
	"PutSnapshotBlock":   reflect.TypeOf(ebs.PutSnapshotBlockInput{}),
	"CompleteSnapshot":   reflect.TypeOf(ebs.CompleteSnapshotInput{}),
	"GetSnapshotBlock":   reflect.TypeOf(ebs.GetSnapshotBlockInput{}),
	"ListSnapshotBlocks": reflect.TypeOf(ebs.ListSnapshotBlocksInput{}),
	"ListChangedBlocks":  reflect.TypeOf(ebs.ListChangedBlocksInput{}),
}

func (s *restServer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	op, labels, ok := MatchREST(s.m, r.Method, r.URL.Path)
	if !ok {
		WriteRESTError(w, "req", ValidationError("INVALID_PARAMETER_VALUE", "no route for %s %s", r.Method, r.URL.Path))
		return
	}
	in := reflect.New(ebsInputs[op]).Interface()
	if err := DecodeREST(s.m, op, r, labels, body, in); err != nil {
		WriteRESTError(w, "req", err)
		return
	}
	s.op, s.in = op, in
	out, err := s.reply(op, in)
	if err != nil {
		WriteRESTError(w, "req", err)
		return
	}
	res, err := EncodeREST(s.m, op, out)
	if err != nil {
		s.t.Error(err)
		return
	}
	for k, v := range res.Header {
		w.Header()[k] = v
	}
	w.WriteHeader(res.Status)
	_, _ = io.Copy(w, res.Body)
}

func ebsClient(t *testing.T, h http.Handler) *ebs.Client {
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return ebs.New(ebs.Options{
		Region:           "us-east-1",
		BaseEndpoint:     aws.String(srv.URL),
		Credentials:      aws.NewCredentialsCache(aws.AnonymousCredentials{}),
		RetryMaxAttempts: 1,
	})
}

func TestRESTJSONRoundTripsTheEBSSDK(t *testing.T) {
	s := &restServer{t: t, m: awsmodel.MustLoad("ebs")}
	c := ebsClient(t, s)
	ctx := context.Background()
	started := time.Unix(1700000000, 250e6).UTC()

	// JSON body in, JSON body out, with a timestamp and a nested list.
	s.reply = func(op string, in any) (any, error) {
		i := in.(*ebs.StartSnapshotInput)
		return &ebs.StartSnapshotOutput{SnapshotId: aws.String("snap-0123456789abcdef0"), VolumeSize: i.VolumeSize,
			ParentSnapshotId: i.ParentSnapshotId, Status: types.StatusPending, BlockSize: aws.Int32(524288),
			StartTime: &started, Tags: i.Tags, OwnerId: aws.String("123456789012")}, nil
	}
	out, err := c.StartSnapshot(ctx, &ebs.StartSnapshotInput{VolumeSize: aws.Int64(8), ParentSnapshotId: aws.String("snap-00000000000000001"),
		Timeout: aws.Int32(60), ClientToken: aws.String("tok"), Tags: []types.Tag{{Key: aws.String("k"), Value: aws.String("v")}}})
	if err != nil {
		t.Fatal(err)
	}
	in := s.in.(*ebs.StartSnapshotInput)
	if s.op != "StartSnapshot" || *in.VolumeSize != 8 || *in.Timeout != 60 || *in.ClientToken != "tok" || *in.Tags[0].Key != "k" {
		t.Fatalf("decoded %s %+v", s.op, in)
	}
	if *out.SnapshotId != "snap-0123456789abcdef0" || !out.StartTime.Equal(started) || out.Status != types.StatusPending || *out.Tags[0].Value != "v" {
		t.Fatalf("SDK read %+v", out)
	}

	// A streamed blob payload with headers and URI labels in; headers out.
	block := bytes.Repeat([]byte("hangar!!"), 65536)
	s.reply = func(op string, in any) (any, error) {
		i := in.(*ebs.PutSnapshotBlockInput)
		got, _ := io.ReadAll(i.BlockData)
		if !bytes.Equal(got, block) {
			t.Errorf("payload of %d bytes differs", len(got))
		}
		return &ebs.PutSnapshotBlockOutput{Checksum: i.Checksum, ChecksumAlgorithm: i.ChecksumAlgorithm}, nil
	}
	put, err := c.PutSnapshotBlock(ctx, &ebs.PutSnapshotBlockInput{SnapshotId: aws.String("snap-0123456789abcdef0"), BlockIndex: aws.Int32(17),
		BlockData: bytes.NewReader(block), DataLength: aws.Int32(int32(len(block))), Checksum: aws.String("abc="),
		ChecksumAlgorithm: types.ChecksumAlgorithmChecksumAlgorithmSha256, Progress: aws.Int32(50)})
	if err != nil {
		t.Fatal(err)
	}
	pi := s.in.(*ebs.PutSnapshotBlockInput)
	if *pi.BlockIndex != 17 || *pi.DataLength != int32(len(block)) || *pi.Progress != 50 || *pi.SnapshotId != "snap-0123456789abcdef0" {
		t.Fatalf("decoded %+v", pi)
	}
	if *put.Checksum != "abc=" || put.ChecksumAlgorithm != types.ChecksumAlgorithmChecksumAlgorithmSha256 {
		t.Fatalf("SDK read %+v", put)
	}

	// A blob payload out.
	s.reply = func(op string, in any) (any, error) {
		return &ebs.GetSnapshotBlockOutput{BlockData: io.NopCloser(bytes.NewReader(block)), DataLength: aws.Int32(int32(len(block))),
			Checksum: aws.String("sum="), ChecksumAlgorithm: types.ChecksumAlgorithmChecksumAlgorithmSha256}, nil
	}
	get, err := c.GetSnapshotBlock(ctx, &ebs.GetSnapshotBlockInput{SnapshotId: aws.String("snap-0123456789abcdef0"), BlockIndex: aws.Int32(3), BlockToken: aws.String("tok+/=")})
	if err != nil {
		t.Fatal(err)
	}
	data, _ := io.ReadAll(get.BlockData)
	if !bytes.Equal(data, block) || *get.DataLength != int32(len(block)) || *get.Checksum != "sum=" {
		t.Fatalf("GetSnapshotBlock read %d bytes, %+v", len(data), get)
	}
	if gi := s.in.(*ebs.GetSnapshotBlockInput); *gi.BlockToken != "tok+/=" || *gi.BlockIndex != 3 {
		t.Fatalf("query string decoded as %+v", gi)
	}

	// Query string members and a path with a literal segment.
	s.reply = func(op string, in any) (any, error) {
		return &ebs.ListChangedBlocksOutput{ChangedBlocks: []types.ChangedBlock{{BlockIndex: aws.Int32(4), SecondBlockToken: aws.String("b")}},
			NextToken: aws.String("next"), BlockSize: aws.Int32(524288), VolumeSize: aws.Int64(8)}, nil
	}
	lc, err := c.ListChangedBlocks(ctx, &ebs.ListChangedBlocksInput{FirstSnapshotId: aws.String("snap-00000000000000001"),
		SecondSnapshotId: aws.String("snap-00000000000000002"), MaxResults: aws.Int32(100), StartingBlockIndex: aws.Int32(2)})
	if err != nil {
		t.Fatal(err)
	}
	if li := s.in.(*ebs.ListChangedBlocksInput); s.op != "ListChangedBlocks" || *li.FirstSnapshotId != "snap-00000000000000001" || *li.MaxResults != 100 || *li.StartingBlockIndex != 2 {
		t.Fatalf("decoded %s %+v", s.op, li)
	}
	if len(lc.ChangedBlocks) != 1 || lc.ChangedBlocks[0].FirstBlockToken != nil || *lc.NextToken != "next" {
		t.Fatalf("SDK read %+v", lc)
	}

	// The model's constraints: MaxResults below 100, a malformed id.
	_, err = c.ListSnapshotBlocks(ctx, &ebs.ListSnapshotBlocksInput{SnapshotId: aws.String("snap-0123456789abcdef0"), MaxResults: aws.Int32(5)})
	var ve *types.ValidationException
	if !errors.As(err, &ve) || ve.Reason != types.ValidationExceptionReasonInvalidParameterValue || !strings.Contains(*ve.Message, "greater than or equal to 100") {
		t.Fatalf("MaxResults 5: %v", err)
	}
	_, err = c.ListSnapshotBlocks(ctx, &ebs.ListSnapshotBlocksInput{SnapshotId: aws.String("vol-1")})
	if !errors.As(err, &ve) || !strings.Contains(*ve.Message, "pattern") {
		t.Fatalf("a malformed id: %v", err)
	}

	// Errors the handler returns reach the SDK typed, with their reason.
	s.reply = func(op string, in any) (any, error) {
		return nil, ValidationError("INVALID_BLOCK_TOKEN", "The block token is not valid")
	}
	_, err = c.ListSnapshotBlocks(ctx, &ebs.ListSnapshotBlocksInput{SnapshotId: aws.String("snap-0123456789abcdef0")})
	if !errors.As(err, &ve) || ve.Reason != types.ValidationExceptionReasonInvalidBlockToken || *ve.Message != "The block token is not valid" {
		t.Fatalf("handler error: %v", err)
	}
}

func TestMatchRESTPrefersLiteralSegments(t *testing.T) {
	m := awsmodel.MustLoad("ebs")
	for path, want := range map[string]string{
		"/snapshots":                      "StartSnapshot",
		"/snapshots/completion/snap-1":    "CompleteSnapshot",
		"/snapshots/snap-1/blocks/7":      "PutSnapshotBlock",
		"/snapshots/snap-1/changedblocks": "ListChangedBlocks",
		"/snapshots/snap-1/blocks":        "ListSnapshotBlocks",
	} {
		method := "POST"
		switch want {
		case "PutSnapshotBlock":
			method = "PUT"
		case "ListChangedBlocks", "ListSnapshotBlocks":
			method = "GET"
		}
		op, labels, ok := MatchREST(m, method, path)
		if !ok || op != want {
			t.Errorf("%s %s matched %q, want %s", method, path, op, want)
		}
		if want == "PutSnapshotBlock" && (labels["snapshotId"] != "snap-1" || labels["blockIndex"] != "7") {
			t.Errorf("labels %v", labels)
		}
	}
	if _, _, ok := MatchREST(m, "DELETE", "/snapshots"); ok {
		t.Error("DELETE /snapshots matched an operation")
	}
}
