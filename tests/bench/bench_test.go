package bench

// The API benchmark: `make bench` (HANGAR_BENCH=1) starts `hangar dev`,
// fills it with records through the API and drives it with aws-sdk-go-v2
// clients from N concurrent workers. Every figure comes with a baseline
// measured in the same run, on the same machine, so the table reads as
// ratios rather than absolute numbers that depend on the machine.

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	v4 "github.com/aws/aws-sdk-go-v2/aws/signer/v4"
	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"
	"github.com/aws/aws-sdk-go-v2/service/sts"

	"hangar.dev/hangar/tests/harness"
)

func apiEnvInt(t *testing.T, name string, def int) int {
	t.Helper()
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 {
		t.Fatalf("%s=%q: want a positive whole number", name, v)
	}
	return n
}

// apiResult is one measured row.
type apiResult struct {
	name     string
	requests int
	elapsed  time.Duration
	p50, p99 time.Duration
	bytes    string
}

func (r apiResult) rate() float64 { return float64(r.requests) / r.elapsed.Seconds() }

// measure runs call from workers goroutines for about d (at least min
// calls in all) and returns the throughput and latency percentiles. Any
// error fails the benchmark: a fast wrong answer is not a result.
func apiMeasure(t *testing.T, name string, workers int, d time.Duration, min int, call func(ctx context.Context, r *rand.Rand) error) apiResult {
	t.Helper()
	ctx := context.Background()
	// Warm up connections and caches.
	warm := rand.New(rand.NewPCG(1, 2))
	for range 3 {
		if err := call(ctx, warm); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
	}
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		lat      []time.Duration
		count    atomic.Int64
		firstErr atomic.Value
	)
	start := time.Now()
	deadline := start.Add(d)
	for w := range workers {
		wg.Add(1)
		go func(seed uint64) {
			defer wg.Done()
			r := rand.New(rand.NewPCG(seed, seed*7+1))
			var mine []time.Duration
			for time.Now().Before(deadline) || count.Load() < int64(min) {
				t0 := time.Now()
				if err := call(ctx, r); err != nil {
					firstErr.CompareAndSwap(nil, err)
					return
				}
				mine = append(mine, time.Since(t0))
				count.Add(1)
			}
			mu.Lock()
			lat = append(lat, mine...)
			mu.Unlock()
		}(uint64(w) + 1)
	}
	wg.Wait()
	elapsed := time.Since(start)
	if err, _ := firstErr.Load().(error); err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	pct := func(p float64) time.Duration { return lat[apiMin(len(lat)-1, int(p*float64(len(lat))))] }
	res := apiResult{name: name, requests: len(lat), elapsed: elapsed, p50: pct(0.50), p99: pct(0.99)}
	t.Logf("%s: %d requests in %v, %.0f req/s, p50 %v, p99 %v", name, res.requests, elapsed.Round(time.Millisecond), res.rate(), res.p50, res.p99)
	return res
}

func apiMin(a, b int) int {
	if a < b {
		return a
	}
	return b
}

func apiMs(d time.Duration) string {
	return strconv.FormatFloat(float64(d.Microseconds())/1000, 'f', 2, 64)
}

func apiTable(rows []apiResult, baseline apiResult, note string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "\n%s\n\n", note)
	fmt.Fprintf(&b, "| request | requests | req/s | cost × baseline | p50 ms | p99 ms |\n")
	fmt.Fprintf(&b, "| --- | ---: | ---: | ---: | ---: | ---: |\n")
	for _, r := range rows {
		// cost: how many baseline requests the same workers serve in the
		// time of one of these.
		fmt.Fprintf(&b, "| %s | %d | %.1f | %.1f | %s | %s |\n", r.name, r.requests, r.rate(), baseline.rate()/r.rate(), apiMs(r.p50), apiMs(r.p99))
	}
	return b.String()
}

// gatewayOnly returns a bin directory holding only hangar and
// hangar-gateway (copies: hangar dev looks for services next to its own
// resolved path), so hangar dev starts the gateway alone.
func gatewayOnly(t *testing.T) string {
	t.Helper()
	from := harness.Binaries(t)
	dir := t.TempDir()
	for _, name := range []string{"hangar", "hangar-gateway"} {
		raw, err := os.ReadFile(filepath.Join(from, name))
		if err != nil {
			t.Fatalf("the benchmark needs %s: %v", name, err)
		}
		if err := os.WriteFile(filepath.Join(dir, name), raw, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// rawCall returns a call that sends form to service signed with the SDK's
// own signer and reads the whole response without parsing it: what the
// request costs hangar, without the SDK's XML decoding on the client side.
func rawCall(t *testing.T, d *harness.Dev, service, form string) func(context.Context, *rand.Rand) error {
	key := d.Key()
	creds := aws.Credentials{AccessKeyID: key.AccessKeyID, SecretAccessKey: key.SecretAccessKey}
	sum := sha256.Sum256([]byte(form))
	hash := hex.EncodeToString(sum[:])
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
	signer := v4.NewSigner()
	return func(ctx context.Context, _ *rand.Rand) error {
		r, err := http.NewRequestWithContext(ctx, http.MethodPost, d.Endpoint+"/", strings.NewReader(form))
		if err != nil {
			return err
		}
		r.Header.Set("Content-Type", "application/x-www-form-urlencoded; charset=utf-8")
		if err := signer.SignHTTP(ctx, creds, r, hash, service, "us-east-1", time.Now()); err != nil {
			return err
		}
		res, err := client.Do(r)
		if err != nil {
			return err
		}
		defer res.Body.Close()
		n, err := io.Copy(io.Discard, res.Body)
		if err == nil && (res.StatusCode != http.StatusOK || n == 0) {
			err = fmt.Errorf("%s: status %d, %d bytes", form, res.StatusCode, n)
		}
		return err
	}
}

// TestBenchDescribe fills a dev host with HANGAR_BENCH_RECORDS VPCs (each
// with its main route table and default security group, so as many
// security groups) and measures DescribeVpcs and DescribeSecurityGroups
// against two baselines from the same run: sts GetCallerIdentity, which
// touches no record, and DescribeVpcs on the fresh host's single VPC.
func TestBenchDescribe(t *testing.T) {
	if os.Getenv("HANGAR_BENCH") != "1" {
		t.Skip("skipping: benchmarks run with make bench (HANGAR_BENCH=1)")
	}
	var (
		records = apiEnvInt(t, "HANGAR_BENCH_RECORDS", 10000)
		workers = apiEnvInt(t, "HANGAR_BENCH_WORKERS", 8)
		dur     = time.Duration(apiEnvInt(t, "HANGAR_BENCH_SECONDS", 5)) * time.Second
	)
	// Only the gateway: with hangar-netd running every VPC would become a
	// network namespace with its bridge and nftables table, which is netd's
	// cost, not the API's, and 10,000 of them is no host's workload.
	t.Setenv("HANGAR_BIN_DIR", gatewayOnly(t))
	d := harness.StartDev(t, harness.Options{})
	cfg := d.SDK()
	cfg.RetryMaxAttempts = 1
	ec2c := ec2.NewFromConfig(cfg)
	stsc := sts.NewFromConfig(cfg)
	var rows []apiResult

	baseline := apiMeasure(t, "sts GetCallerIdentity (baseline, at the start)", workers, dur, 100, func(ctx context.Context, _ *rand.Rand) error {
		_, err := stsc.GetCallerIdentity(ctx, &sts.GetCallerIdentityInput{})
		return err
	})
	rows = append(rows, baseline)
	rows = append(rows, apiMeasure(t, "DescribeVpcs, fresh host (1 VPC)", workers, dur, 100, func(ctx context.Context, _ *rand.Rand) error {
		out, err := ec2c.DescribeVpcs(ctx, &ec2.DescribeVpcsInput{})
		if err == nil && len(out.Vpcs) != 1 {
			err = fmt.Errorf("a fresh host has %d VPCs", len(out.Vpcs))
		}
		return err
	}))

	// Fill the host through the API, as a user would.
	start := time.Now()
	vpcIDs := make([]string, records)
	var next atomic.Int64
	var wg sync.WaitGroup
	var createErr atomic.Value
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1)) - 1
				if i >= records {
					return
				}
				out, err := ec2c.CreateVpc(context.Background(), &ec2.CreateVpcInput{
					CidrBlock: aws.String(fmt.Sprintf("10.%d.0.0/16", i%256)),
					TagSpecifications: []types.TagSpecification{{ResourceType: types.ResourceTypeVpc,
						Tags: []types.Tag{{Key: aws.String("Name"), Value: aws.String(fmt.Sprintf("bench-%05d", i))}}}},
				})
				if err != nil {
					createErr.CompareAndSwap(nil, fmt.Errorf("CreateVpc %d: %w", i, err))
					return
				}
				vpcIDs[i] = *out.Vpc.VpcId
			}
		}()
	}
	wg.Wait()
	if err, _ := createErr.Load().(error); err != nil {
		t.Fatal(err)
	}
	created := time.Since(start)
	t.Logf("created %d VPCs (and as many route tables and security groups) in %v: %.0f/s", records, created.Round(time.Millisecond), float64(records)/created.Seconds())

	// Page through every security group: pagination over the whole set,
	// and the ids the measurements below pick from.
	var sgIDs []string
	sgOfVPC := map[string]string{}
	pager := ec2.NewDescribeSecurityGroupsPaginator(ec2c, &ec2.DescribeSecurityGroupsInput{MaxResults: aws.Int32(1000)})
	for pager.HasMorePages() {
		page, err := pager.NextPage(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		for _, g := range page.SecurityGroups {
			sgIDs = append(sgIDs, *g.GroupId)
			sgOfVPC[aws.ToString(g.VpcId)] = *g.GroupId
		}
	}
	if len(sgIDs) != records+1 {
		t.Fatalf("paging DescribeSecurityGroups found %d groups, want %d", len(sgIDs), records+1)
	}
	total := records + 1
	pick := func(r *rand.Rand) int { return r.IntN(records) }

	rows = append(rows,
		apiMeasure(t, "DescribeVpcs --vpc-ids (one of "+strconv.Itoa(total)+")", workers, dur, 100, func(ctx context.Context, r *rand.Rand) error {
			id := vpcIDs[pick(r)]
			out, err := ec2c.DescribeVpcs(ctx, &ec2.DescribeVpcsInput{VpcIds: []string{id}})
			if err == nil && (len(out.Vpcs) != 1 || *out.Vpcs[0].VpcId != id) {
				err = fmt.Errorf("DescribeVpcs %s returned %d VPCs", id, len(out.Vpcs))
			}
			return err
		}),
		apiMeasure(t, "DescribeVpcs --filters tag:Name=… (scans "+strconv.Itoa(total)+")", workers, dur, 20, func(ctx context.Context, r *rand.Rand) error {
			i := pick(r)
			out, err := ec2c.DescribeVpcs(ctx, &ec2.DescribeVpcsInput{Filters: []types.Filter{{Name: aws.String("tag:Name"), Values: []string{fmt.Sprintf("bench-%05d", i)}}}})
			if err == nil && (len(out.Vpcs) != 1 || *out.Vpcs[0].VpcId != vpcIDs[i]) {
				err = fmt.Errorf("tag filter for bench-%05d returned %d VPCs", i, len(out.Vpcs))
			}
			return err
		}),
		apiMeasure(t, "DescribeVpcs --max-results 1000 (first page)", workers, dur, 20, func(ctx context.Context, _ *rand.Rand) error {
			out, err := ec2c.DescribeVpcs(ctx, &ec2.DescribeVpcsInput{MaxResults: aws.Int32(1000)})
			if err == nil && (len(out.Vpcs) != 1000 || out.NextToken == nil) {
				err = fmt.Errorf("a page of %d VPCs, next token %v", len(out.Vpcs), out.NextToken)
			}
			return err
		}),
		apiMeasure(t, "DescribeVpcs, all "+strconv.Itoa(total)+" in one response (the CLI's default)", workers, dur, workers, func(ctx context.Context, _ *rand.Rand) error {
			out, err := ec2c.DescribeVpcs(ctx, &ec2.DescribeVpcsInput{})
			if err == nil && len(out.Vpcs) != total {
				err = fmt.Errorf("DescribeVpcs returned %d VPCs, want %d", len(out.Vpcs), total)
			}
			return err
		}),
		apiMeasure(t, "DescribeVpcs, all "+strconv.Itoa(total)+", response read but not parsed (hangar's share)", workers, dur, workers, rawCall(t, d, "ec2", "Action=DescribeVpcs&Version=2016-11-15")),
		apiMeasure(t, "DescribeSecurityGroups --group-ids (one of "+strconv.Itoa(total)+")", workers, dur, 100, func(ctx context.Context, r *rand.Rand) error {
			id := sgIDs[r.IntN(len(sgIDs))]
			out, err := ec2c.DescribeSecurityGroups(ctx, &ec2.DescribeSecurityGroupsInput{GroupIds: []string{id}})
			if err == nil && (len(out.SecurityGroups) != 1 || *out.SecurityGroups[0].GroupId != id) {
				err = fmt.Errorf("DescribeSecurityGroups %s returned %d groups", id, len(out.SecurityGroups))
			}
			return err
		}),
		apiMeasure(t, "DescribeSecurityGroups --filters vpc-id=… (scans "+strconv.Itoa(total)+")", workers, dur, 20, func(ctx context.Context, r *rand.Rand) error {
			vpc := vpcIDs[pick(r)]
			out, err := ec2c.DescribeSecurityGroups(ctx, &ec2.DescribeSecurityGroupsInput{Filters: []types.Filter{{Name: aws.String("vpc-id"), Values: []string{vpc}}}})
			if err == nil && (len(out.SecurityGroups) != 1 || *out.SecurityGroups[0].GroupId != sgOfVPC[vpc]) {
				err = fmt.Errorf("vpc-id filter for %s returned %d groups", vpc, len(out.SecurityGroups))
			}
			return err
		}),
		apiMeasure(t, "DescribeSecurityGroups --max-results 1000 (first page)", workers, dur, 20, func(ctx context.Context, _ *rand.Rand) error {
			out, err := ec2c.DescribeSecurityGroups(ctx, &ec2.DescribeSecurityGroupsInput{MaxResults: aws.Int32(1000)})
			if err == nil && (len(out.SecurityGroups) != 1000 || out.NextToken == nil) {
				err = fmt.Errorf("a page of %d groups, next token %v", len(out.SecurityGroups), out.NextToken)
			}
			return err
		}),
		apiMeasure(t, "DescribeSecurityGroups, all "+strconv.Itoa(total)+" in one response", workers, dur, workers, func(ctx context.Context, _ *rand.Rand) error {
			out, err := ec2c.DescribeSecurityGroups(ctx, &ec2.DescribeSecurityGroupsInput{})
			if err == nil && len(out.SecurityGroups) != total {
				err = fmt.Errorf("DescribeSecurityGroups returned %d groups, want %d", len(out.SecurityGroups), total)
			}
			return err
		}),
		apiMeasure(t, "DescribeSecurityGroups, all "+strconv.Itoa(total)+", response read but not parsed (hangar's share)", workers, dur, workers, rawCall(t, d, "ec2", "Action=DescribeSecurityGroups&Version=2016-11-15")),
	)
	// The baseline again: the machine is shared, so the ratio is taken
	// against the baseline pooled from both ends of the run.
	again := apiMeasure(t, "sts GetCallerIdentity (baseline, at the end)", workers, dur, 100, func(ctx context.Context, _ *rand.Rand) error {
		_, err := stsc.GetCallerIdentity(ctx, &sts.GetCallerIdentityInput{})
		return err
	})
	rows = append(rows, again)
	baseline.requests, baseline.elapsed = baseline.requests+again.requests, baseline.elapsed+again.elapsed
	note := fmt.Sprintf("hangar bench: %d VPCs + 1 default (and as many security groups), gateway only (no netd), %d workers, ~%v per row, %d CPUs shared by client and server; VPCs created through the API at %.0f/s.",
		records, workers, dur, runtime.NumCPU(), float64(records)/created.Seconds())
	fmt.Print(apiTable(rows, baseline, note))
}
