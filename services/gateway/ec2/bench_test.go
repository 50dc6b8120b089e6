package ec2

import (
	"fmt"
	"os"
	"sort"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"

	"hangar.dev/hangar/services/gateway/awsmodel"
	"hangar.dev/hangar/services/gateway/awsproto"
)

// TestBenchDescribeInstances measures how DescribeInstances (handler and
// XML encoding, as the server runs them; no HTTP) grows with 10, 100 and
// 1,000 instances: each row as a multiple of the 10-instance row and of a
// one-record call (DescribeVpcs of the default VPC) measured alongside. Instances are launched through RunInstances with fake netd, ebsd
// and vmd (booting 1,000 guests is not the point): the records, joins and
// encoding are the real ones. make bench runs it.
func TestBenchDescribeInstances(t *testing.T) {
	if os.Getenv("HANGAR_BENCH") == "" {
		t.Skip("skipping: a benchmark (make bench sets HANGAR_BENCH=1)")
	}
	h := newInstanceHost(t, 1<<20)
	m := awsmodel.MustLoad("ec2")
	measure := func(n int, call func() (any, string)) (p50, p99 time.Duration) {
		var d []time.Duration
		for i := 0; i < n; i++ {
			start := time.Now()
			out, op := call()
			if _, err := awsproto.EncodeXML(m, op, "bench", out); err != nil {
				t.Fatal(err)
			}
			d = append(d, time.Since(start))
		}
		sort.Slice(d, func(a, b int) bool { return d[a] < d[b] })
		return d[len(d)/2], d[len(d)*99/100]
	}
	oneVPC := func() (any, string) {
		out, err := h.s.DescribeVpcs(bg, &ec2.DescribeVpcsInput{})
		if err != nil {
			t.Fatal(err)
		}
		return out, "DescribeVpcs"
	}
	describe := func() (any, string) {
		out, err := h.s.DescribeInstances(bg, &ec2.DescribeInstancesInput{})
		if err != nil {
			t.Fatal(err)
		}
		return out, "DescribeInstances"
	}
	filtered := func() (any, string) {
		out, err := h.s.DescribeInstances(bg, &ec2.DescribeInstancesInput{Filters: []types.Filter{{Name: ptr("instance-state-name"), Values: []string{"running"}}}})
		if err != nil {
			t.Fatal(err)
		}
		return out, "DescribeInstances"
	}
	fmt.Println("| instances | one-record call p50 | DescribeInstances p50 / p99 | × one record | × 10 instances | per instance | state filter, no match, p50 |")
	fmt.Println("|---:|---:|---:|---:|---:|---:|---:|")
	have := 0
	var first time.Duration
	for _, n := range []int{10, 100, 1000} {
		for have < n {
			batch := min(n-have, maxPerLaunch)
			h.run(t, &ec2.RunInstancesInput{MinCount: ptr(int32(batch)), MaxCount: ptr(int32(batch)), InstanceType: "t3.nano"})
			have += batch
		}
		reps := 200
		if n == 1000 {
			reps = 40
		}
		base, _ := measure(reps, oneVPC)
		p50, p99 := measure(reps, describe)
		f50, _ := measure(reps, filtered)
		if first == 0 {
			first = p50
		}
		fmt.Printf("| %d | %v | %v / %v | %.1f× | %.1f× | %v | %v |\n", n, base.Round(time.Microsecond), p50.Round(time.Microsecond), p99.Round(time.Microsecond),
			float64(p50)/float64(base), float64(p50)/float64(first), (p50 / time.Duration(n)).Round(time.Microsecond), f50.Round(time.Microsecond))
	}
}
