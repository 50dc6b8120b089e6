package ec2

import (
	"fmt"
	"strings"
	"testing"

	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"
)

func TestInstanceTypeInfo(t *testing.T) {
	for _, tc := range []struct {
		name         string
		vcpus, cores int32
		mib          int64
		network      string
		burst, metal bool
	}{
		{"t3.nano", 2, 1, 512, "Up to 5 Gigabit", true, false},
		{"t3.micro", 2, 1, 1024, "Up to 5 Gigabit", true, false},
		{"t3.2xlarge", 8, 4, 32768, "Up to 5 Gigabit", true, false},
		{"m5.large", 2, 1, 8192, "Up to 10 Gigabit", false, false},
		{"m5.24xlarge", 96, 48, 393216, "25 Gigabit", false, false},
		{"c5.large", 2, 1, 4096, "Up to 10 Gigabit", false, false},
		{"c5.9xlarge", 36, 18, 73728, "12 Gigabit", false, false},
		{"c5.metal", 96, 48, 196608, "25 Gigabit", false, true},
		{"r5.large", 2, 1, 16384, "Up to 10 Gigabit", false, false},
		{"r5.metal", 96, 48, 786432, "25 Gigabit", false, true},
	} {
		it, ok := InstanceTypeInfo(tc.name)
		if !ok {
			t.Fatalf("%s unknown", tc.name)
		}
		if it.VCPUs != tc.vcpus || it.Cores != tc.cores || it.ThreadsPerCore != 2 || it.MemoryMiB != tc.mib || it.NetworkPerformance != tc.network || it.Burstable != tc.burst || it.BareMetal != tc.metal {
			t.Errorf("%s = %+v", tc.name, it)
		}
		if it.Cores*it.ThreadsPerCore != it.VCPUs {
			t.Errorf("%s: %d cores × %d threads ≠ %d vCPUs", tc.name, it.Cores, it.ThreadsPerCore, it.VCPUs)
		}
	}
	if _, ok := InstanceTypeInfo("m5.huge"); ok {
		t.Fatal("m5.huge known")
	}
	if n := len(InstanceTypeNames()); n != 7+9+9+9 {
		t.Fatalf("%d types", n)
	}
	for _, n := range InstanceTypeNames() {
		it, _ := InstanceTypeInfo(n)
		if it.FreeTier != (n == "t3.micro") {
			t.Errorf("%s free tier %v", n, it.FreeTier)
		}
	}
}

func TestDescribeInstanceTypes(t *testing.T) {
	s := newSvc(t)
	out := must[*ec2.DescribeInstanceTypesOutput](t)(s.DescribeInstanceTypes(bg, &ec2.DescribeInstanceTypesInput{InstanceTypes: []types.InstanceType{"t3.micro", "m5.metal"}}))
	encodes(t, "DescribeInstanceTypes", out)
	if len(out.InstanceTypes) != 2 {
		t.Fatalf("got %d", len(out.InstanceTypes))
	}
	micro, metal := out.InstanceTypes[0], out.InstanceTypes[1]
	if micro.InstanceType != "t3.micro" || !*micro.FreeTierEligible || !*micro.BurstablePerformanceSupported || micro.Hypervisor != types.InstanceTypeHypervisorNitro ||
		*micro.VCpuInfo.DefaultVCpus != 2 || *micro.MemoryInfo.SizeInMiB != 1024 || *micro.ProcessorInfo.SustainedClockSpeedInGhz != 2.5 ||
		micro.ProcessorInfo.SupportedArchitectures[0] != types.ArchitectureTypeX8664 || micro.SupportedVirtualizationTypes[0] != types.VirtualizationTypeHvm ||
		len(micro.SupportedBootModes) != 2 || *micro.EbsInfo.EbsOptimizedInfo.BaselineBandwidthInMbps != 87 || micro.EbsInfo.NvmeSupport != types.EbsNvmeSupportRequired {
		t.Fatalf("t3.micro = %+v", micro)
	}
	if !*metal.BareMetal || metal.Hypervisor != "" || *metal.FreeTierEligible || *metal.VCpuInfo.DefaultCores != 48 {
		t.Fatalf("m5.metal = %+v", metal)
	}
	_, err := s.DescribeInstanceTypes(bg, &ec2.DescribeInstanceTypesInput{InstanceTypes: []types.InstanceType{"m5.large", "x9.huge", "t3.giant"}})
	wantCode(t, err, "InvalidInstanceType")
	if !strings.Contains(err.Error(), "[x9.huge, t3.giant]") {
		t.Fatalf("message %q does not list the unknown types", err)
	}

	names := func(fs ...types.Filter) string {
		out, err := s.DescribeInstanceTypes(bg, &ec2.DescribeInstanceTypesInput{Filters: fs})
		if err != nil {
			t.Fatal(err)
		}
		var n []string
		for _, it := range out.InstanceTypes {
			n = append(n, string(it.InstanceType))
		}
		return strings.Join(n, " ")
	}
	for _, tc := range []struct {
		filters []types.Filter
		want    string
	}{
		{[]types.Filter{filter("vcpu-info.default-vcpus", "2"), filter("memory-info.size-in-mib", "8192")}, "t3.large m5.large"},
		{[]types.Filter{filter("instance-type", "c5.*xlarge"), filter("vcpu-info.default-vcpus", "96")}, "c5.24xlarge"},
		{[]types.Filter{filter("burstable-performance-supported", "true"), filter("memory-info.size-in-mib", "512", "1024")}, "t3.nano t3.micro"},
		{[]types.Filter{filter("free-tier-eligible", "true")}, "t3.micro"},
		{[]types.Filter{filter("bare-metal", "true")}, "m5.metal c5.metal r5.metal"},
		{[]types.Filter{filter("instance-type", "r5.*"), filter("network-info.network-performance", "25 Gigabit")}, "r5.24xlarge r5.metal"},
		{[]types.Filter{filter("processor-info.supported-architecture", "arm64")}, ""},
		{[]types.Filter{filter("current-generation", "true"), filter("processor-info.sustained-clock-speed-in-ghz", "3.6")}, "c5.12xlarge c5.24xlarge c5.metal"},
		{[]types.Filter{filter("hypervisor", "nitro"), filter("instance-type", "m5.2*")}, "m5.2xlarge m5.24xlarge"},
	} {
		if got := names(tc.filters...); got != tc.want {
			t.Errorf("filters %v: %q, want %q", tc.filters, got, tc.want)
		}
	}
	_, err = s.DescribeInstanceTypes(bg, &ec2.DescribeInstanceTypesInput{Filters: []types.Filter{filter("gpu-info.gpus.count", "1")}})
	wantCode(t, err, "InvalidParameterValue")

	// Every type over pages of 5; MaxResults is 5 to 100 here.
	ids, pages := pageAll(t, func(tok *string) ([]string, *string, error) {
		out, err := s.DescribeInstanceTypes(bg, &ec2.DescribeInstanceTypesInput{MaxResults: ptr(int32(5)), NextToken: tok})
		if err != nil {
			return nil, nil, err
		}
		var ids []string
		for _, it := range out.InstanceTypes {
			ids = append(ids, string(it.InstanceType))
		}
		return ids, out.NextToken, nil
	})
	if fmt.Sprint(ids) != fmt.Sprint(InstanceTypeNames()) || pages != 7 {
		t.Fatalf("%d types over %d pages", len(ids), pages)
	}
	_, err = s.DescribeInstanceTypes(bg, &ec2.DescribeInstanceTypesInput{MaxResults: ptr(int32(101))})
	wantCode(t, err, "InvalidParameterValue")
	_, err = s.DescribeInstanceTypes(bg, &ec2.DescribeInstanceTypesInput{NextToken: token("z9.none")})
	wantCode(t, err, "InvalidParameterValue")
}

func TestDescribeInstanceTypeOfferings(t *testing.T) {
	s := newSvc(t)
	for _, tc := range []struct {
		lt       types.LocationType
		location string
	}{
		{"", "us-east-1"},
		{types.LocationTypeRegion, "us-east-1"},
		{types.LocationTypeAvailabilityZone, "us-east-1a"},
		{types.LocationTypeAvailabilityZoneId, "use1-az1"},
	} {
		out := must[*ec2.DescribeInstanceTypeOfferingsOutput](t)(s.DescribeInstanceTypeOfferings(bg, &ec2.DescribeInstanceTypeOfferingsInput{LocationType: tc.lt}))
		encodes(t, "DescribeInstanceTypeOfferings", out)
		if len(out.InstanceTypeOfferings) != len(InstanceTypeNames()) {
			t.Fatalf("%s: %d offerings", tc.lt, len(out.InstanceTypeOfferings))
		}
		o := out.InstanceTypeOfferings[0]
		want := tc.lt
		if want == "" {
			want = types.LocationTypeRegion
		}
		if *o.Location != tc.location || o.LocationType != want {
			t.Fatalf("%s: %+v", tc.lt, o)
		}
	}
	out := must[*ec2.DescribeInstanceTypeOfferingsOutput](t)(s.DescribeInstanceTypeOfferings(bg, &ec2.DescribeInstanceTypeOfferingsInput{
		LocationType: types.LocationTypeAvailabilityZone,
		Filters:      []types.Filter{filter("location", "us-east-1a"), filter("instance-type", "t3.*")},
	}))
	if len(out.InstanceTypeOfferings) != 7 {
		t.Fatalf("t3 offerings in the zone: %d", len(out.InstanceTypeOfferings))
	}
	out = must[*ec2.DescribeInstanceTypeOfferingsOutput](t)(s.DescribeInstanceTypeOfferings(bg, &ec2.DescribeInstanceTypeOfferingsInput{
		LocationType: types.LocationTypeAvailabilityZone, Filters: []types.Filter{filter("location", "us-east-1b")},
	}))
	if len(out.InstanceTypeOfferings) != 0 {
		t.Fatalf("offerings in a zone this host is not: %d", len(out.InstanceTypeOfferings))
	}
	_, err := s.DescribeInstanceTypeOfferings(bg, &ec2.DescribeInstanceTypeOfferingsInput{LocationType: types.LocationTypeOutpost})
	wantCode(t, err, "InvalidParameterValue")
	_, err = s.DescribeInstanceTypeOfferings(bg, &ec2.DescribeInstanceTypeOfferingsInput{Filters: []types.Filter{filter("vcpus", "2")}})
	wantCode(t, err, "InvalidParameterValue")
	ids, pages := pageAll(t, func(tok *string) ([]string, *string, error) {
		out, err := s.DescribeInstanceTypeOfferings(bg, &ec2.DescribeInstanceTypeOfferingsInput{MaxResults: ptr(int32(10)), NextToken: tok})
		if err != nil {
			return nil, nil, err
		}
		var ids []string
		for _, o := range out.InstanceTypeOfferings {
			ids = append(ids, string(o.InstanceType))
		}
		return ids, out.NextToken, nil
	})
	if len(ids) != 34 || pages != 4 {
		t.Fatalf("%d offerings over %d pages", len(ids), pages)
	}
}
