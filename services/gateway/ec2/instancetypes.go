package ec2

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"

	"hangar.dev/hangar/services/gateway/awserr"
)

// InstanceType is one instance type as AWS publishes it: the figures a host
// needs to place and size a guest (vCPUs, memory) and the ones
// DescribeInstanceTypes shows.
type InstanceType struct {
	Name           string
	VCPUs          int32
	Cores          int32
	ThreadsPerCore int32
	MemoryMiB      int64
	// NetworkPerformance is AWS's wording ("Up to 10 Gigabit").
	NetworkPerformance string
	MaxENIs            int32
	IPv4PerENI         int32
	// EBS-optimized bandwidth (Mbps) and IOPS, baseline and burst maximum.
	EBSBaselineMbps, EBSMaxMbps int32
	EBSBaselineIOPS, EBSMaxIOPS int32
	ClockGHz                    float64
	Burstable                   bool
	BareMetal                   bool
	FreeTier                    bool
}

// size is one row of a family's table.
type size struct {
	suffix            string
	vcpus             int32
	memGiB            float64
	network           string
	enis, ips         int32
	ebsBase, ebsMax   int32
	iopsBase, iopsMax int32
	clock             float64 // 0: the family's
	cores             int32   // 0: vcpus / 2
}

// family is a row group: the t3, m5, c5 and r5 families as AWS publishes
// them (vCPUs, memory, network performance, network interface and address
// limits, EBS-optimized bandwidth and IOPS, sustained all-core clock), on
// Intel Xeon under the Nitro hypervisor.
type family struct {
	name      string
	clock     float64
	burstable bool
	sizes     []size
}

var families = []family{
	{name: "t3", clock: 2.5, burstable: true, sizes: []size{
		{"nano", 2, 0.5, "Up to 5 Gigabit", 2, 2, 43, 2085, 250, 11800, 0, 1},
		{"micro", 2, 1, "Up to 5 Gigabit", 2, 2, 87, 2085, 500, 11800, 0, 1},
		{"small", 2, 2, "Up to 5 Gigabit", 3, 4, 174, 2085, 1000, 11800, 0, 1},
		{"medium", 2, 4, "Up to 5 Gigabit", 3, 6, 347, 2085, 2000, 11800, 0, 1},
		{"large", 2, 8, "Up to 5 Gigabit", 3, 12, 695, 2780, 4000, 15700, 0, 1},
		{"xlarge", 4, 16, "Up to 5 Gigabit", 4, 15, 695, 2780, 4000, 15700, 0, 2},
		{"2xlarge", 8, 32, "Up to 5 Gigabit", 4, 15, 695, 2780, 4000, 15700, 0, 4},
	}},
	{name: "m5", clock: 3.1, sizes: []size{
		{"large", 2, 8, "Up to 10 Gigabit", 3, 10, 650, 4750, 3600, 18750, 0, 0},
		{"xlarge", 4, 16, "Up to 10 Gigabit", 4, 15, 1150, 4750, 6000, 18750, 0, 0},
		{"2xlarge", 8, 32, "Up to 10 Gigabit", 4, 15, 2300, 4750, 12000, 18750, 0, 0},
		{"4xlarge", 16, 64, "Up to 10 Gigabit", 8, 30, 4750, 4750, 18750, 18750, 0, 0},
		{"8xlarge", 32, 128, "10 Gigabit", 8, 30, 6800, 6800, 30000, 30000, 0, 0},
		{"12xlarge", 48, 192, "12 Gigabit", 8, 30, 9500, 9500, 40000, 40000, 0, 0},
		{"16xlarge", 64, 256, "20 Gigabit", 15, 50, 13600, 13600, 60000, 60000, 0, 0},
		{"24xlarge", 96, 384, "25 Gigabit", 15, 50, 19000, 19000, 80000, 80000, 0, 0},
		{"metal", 96, 384, "25 Gigabit", 15, 50, 19000, 19000, 80000, 80000, 0, 0},
	}},
	{name: "c5", clock: 3.4, sizes: []size{
		{"large", 2, 4, "Up to 10 Gigabit", 3, 10, 650, 4750, 4000, 20000, 0, 0},
		{"xlarge", 4, 8, "Up to 10 Gigabit", 4, 15, 1150, 4750, 6000, 20000, 0, 0},
		{"2xlarge", 8, 16, "Up to 10 Gigabit", 4, 15, 2300, 4750, 10000, 20000, 0, 0},
		{"4xlarge", 16, 32, "Up to 10 Gigabit", 8, 30, 4750, 4750, 20000, 20000, 0, 0},
		{"9xlarge", 36, 72, "12 Gigabit", 8, 30, 9500, 9500, 40000, 40000, 0, 0},
		{"12xlarge", 48, 96, "12 Gigabit", 8, 30, 9500, 9500, 40000, 40000, 3.6, 0},
		{"18xlarge", 72, 144, "25 Gigabit", 15, 50, 19000, 19000, 80000, 80000, 0, 0},
		{"24xlarge", 96, 192, "25 Gigabit", 15, 50, 19000, 19000, 80000, 80000, 3.6, 0},
		{"metal", 96, 192, "25 Gigabit", 15, 50, 19000, 19000, 80000, 80000, 3.6, 0},
	}},
	{name: "r5", clock: 3.1, sizes: []size{
		{"large", 2, 16, "Up to 10 Gigabit", 3, 10, 650, 4750, 3600, 18750, 0, 0},
		{"xlarge", 4, 32, "Up to 10 Gigabit", 4, 15, 1150, 4750, 6000, 18750, 0, 0},
		{"2xlarge", 8, 64, "Up to 10 Gigabit", 4, 15, 2300, 4750, 12000, 18750, 0, 0},
		{"4xlarge", 16, 128, "Up to 10 Gigabit", 8, 30, 4750, 4750, 18750, 18750, 0, 0},
		{"8xlarge", 32, 256, "10 Gigabit", 8, 30, 6800, 6800, 30000, 30000, 0, 0},
		{"12xlarge", 48, 384, "12 Gigabit", 8, 30, 9500, 9500, 40000, 40000, 0, 0},
		{"16xlarge", 64, 512, "20 Gigabit", 15, 50, 13600, 13600, 60000, 60000, 0, 0},
		{"24xlarge", 96, 768, "25 Gigabit", 15, 50, 19000, 19000, 80000, 80000, 0, 0},
		{"metal", 96, 768, "25 Gigabit", 15, 50, 19000, 19000, 80000, 80000, 0, 0},
	}},
}

// instanceTypes is the table in family and size order; byName indexes it.
var (
	instanceTypes []InstanceType
	byName        = map[string]int{}
)

func init() {
	for _, f := range families {
		for _, s := range f.sizes {
			t := InstanceType{
				Name:               f.name + "." + s.suffix,
				VCPUs:              s.vcpus,
				Cores:              s.cores,
				ThreadsPerCore:     2,
				MemoryMiB:          int64(s.memGiB * 1024),
				NetworkPerformance: s.network,
				MaxENIs:            s.enis,
				IPv4PerENI:         s.ips,
				EBSBaselineMbps:    s.ebsBase,
				EBSMaxMbps:         s.ebsMax,
				EBSBaselineIOPS:    s.iopsBase,
				EBSMaxIOPS:         s.iopsMax,
				ClockGHz:           f.clock,
				Burstable:          f.burstable,
				BareMetal:          s.suffix == "metal",
				FreeTier:           f.name+"."+s.suffix == "t3.micro",
			}
			if t.Cores == 0 {
				t.Cores = s.vcpus / 2
			}
			if s.clock != 0 {
				t.ClockGHz = s.clock
			}
			byName[t.Name] = len(instanceTypes)
			instanceTypes = append(instanceTypes, t)
		}
	}
}

// InstanceTypeInfo returns the instance type called name (as "m5.large")
// and whether hangar knows it.
func InstanceTypeInfo(name string) (InstanceType, bool) {
	i, ok := byName[name]
	if !ok {
		return InstanceType{}, false
	}
	return instanceTypes[i], true
}

// InstanceTypeNames lists every known instance type, in family and size
// order.
func InstanceTypeNames() []string {
	out := make([]string, len(instanceTypes))
	for i, t := range instanceTypes {
		out[i] = t.Name
	}
	return out
}

// info renders t as DescribeInstanceTypes shows it.
func (t InstanceType) info() types.InstanceTypeInfo {
	hypervisor := types.InstanceTypeHypervisorNitro
	if t.BareMetal {
		hypervisor = "" // AWS reports no hypervisor for metal types
	}
	strategies := []types.PlacementGroupStrategy{types.PlacementGroupStrategyCluster, types.PlacementGroupStrategyPartition, types.PlacementGroupStrategySpread}
	if t.Burstable {
		strategies = strategies[1:] // no cluster placement for burstable types
	}
	vcpu := &types.VCpuInfo{DefaultVCpus: ptr(t.VCPUs), DefaultCores: ptr(t.Cores), DefaultThreadsPerCore: ptr(t.ThreadsPerCore)}
	if !t.Burstable && !t.BareMetal {
		vcpu.ValidThreadsPerCore = []int32{1, 2}
	}
	return types.InstanceTypeInfo{
		InstanceType:                  types.InstanceType(t.Name),
		CurrentGeneration:             ptr(true),
		FreeTierEligible:              ptr(t.FreeTier),
		SupportedUsageClasses:         []types.UsageClassType{types.UsageClassTypeOnDemand, types.UsageClassTypeSpot},
		SupportedRootDeviceTypes:      []types.RootDeviceType{types.RootDeviceTypeEbs},
		SupportedVirtualizationTypes:  []types.VirtualizationType{types.VirtualizationTypeHvm},
		SupportedBootModes:            []types.BootModeType{types.BootModeTypeLegacyBios, types.BootModeTypeUefi},
		BareMetal:                     ptr(t.BareMetal),
		Hypervisor:                    hypervisor,
		BurstablePerformanceSupported: ptr(t.Burstable),
		HibernationSupported:          ptr(!t.BareMetal),
		DedicatedHostsSupported:       ptr(true),
		AutoRecoverySupported:         ptr(true),
		InstanceStorageSupported:      ptr(false),
		ProcessorInfo: &types.ProcessorInfo{
			SupportedArchitectures:   []types.ArchitectureType{types.ArchitectureTypeX8664},
			SustainedClockSpeedInGhz: ptr(t.ClockGHz),
			Manufacturer:             ptr("Intel"),
		},
		VCpuInfo:   vcpu,
		MemoryInfo: &types.MemoryInfo{SizeInMiB: ptr(t.MemoryMiB)},
		EbsInfo: &types.EbsInfo{
			EbsOptimizedSupport: types.EbsOptimizedSupportDefault,
			EncryptionSupport:   types.EbsEncryptionSupportSupported,
			NvmeSupport:         types.EbsNvmeSupportRequired,
			EbsOptimizedInfo: &types.EbsOptimizedInfo{
				BaselineBandwidthInMbps:  ptr(t.EBSBaselineMbps),
				BaselineThroughputInMBps: ptr(float64(t.EBSBaselineMbps) / 8),
				BaselineIops:             ptr(t.EBSBaselineIOPS),
				MaximumBandwidthInMbps:   ptr(t.EBSMaxMbps),
				MaximumThroughputInMBps:  ptr(float64(t.EBSMaxMbps) / 8),
				MaximumIops:              ptr(t.EBSMaxIOPS),
			},
		},
		NetworkInfo: &types.NetworkInfo{
			NetworkPerformance:           ptr(t.NetworkPerformance),
			MaximumNetworkInterfaces:     ptr(t.MaxENIs),
			MaximumNetworkCards:          ptr(int32(1)),
			DefaultNetworkCardIndex:      ptr(int32(0)),
			NetworkCards:                 []types.NetworkCardInfo{{NetworkCardIndex: ptr(int32(0)), MaximumNetworkInterfaces: ptr(t.MaxENIs), NetworkPerformance: ptr(t.NetworkPerformance)}},
			Ipv4AddressesPerInterface:    ptr(t.IPv4PerENI),
			Ipv6AddressesPerInterface:    ptr(t.IPv4PerENI),
			Ipv6Supported:                ptr(true),
			EnaSupport:                   types.EnaSupportRequired,
			EfaSupported:                 ptr(false),
			EncryptionInTransitSupported: ptr(false),
			EnaSrdSupported:              ptr(false),
		},
		PlacementGroupInfo: &types.PlacementGroupInfo{SupportedStrategies: strategies},
	}
}

func itoa32(n int32) []string { return []string{strconv.Itoa(int(n))} }
func ftoa(f float64) []string { return []string{strconv.FormatFloat(f, 'f', -1, 64)} }
func bools(b bool) []string   { return []string{boolString(b)} }

// instanceTypeFilters are DescribeInstanceTypes' documented filters that
// apply to these families (GPU, FPGA, accelerator and instance-storage
// filters exist and match nothing, as none of these types has them).
var instanceTypeFilters = filterSet[InstanceType]{
	"auto-recovery-supported":         func(t *InstanceType) []string { return bools(true) },
	"bare-metal":                      func(t *InstanceType) []string { return bools(t.BareMetal) },
	"burstable-performance-supported": func(t *InstanceType) []string { return bools(t.Burstable) },
	"current-generation":              func(t *InstanceType) []string { return bools(true) },
	"dedicated-hosts-supported":       func(t *InstanceType) []string { return bools(true) },
	"ebs-info.ebs-optimized-info.baseline-bandwidth-in-mbps":  func(t *InstanceType) []string { return itoa32(t.EBSBaselineMbps) },
	"ebs-info.ebs-optimized-info.baseline-iops":               func(t *InstanceType) []string { return itoa32(t.EBSBaselineIOPS) },
	"ebs-info.ebs-optimized-info.baseline-throughput-in-mbps": func(t *InstanceType) []string { return ftoa(float64(t.EBSBaselineMbps) / 8) },
	"ebs-info.ebs-optimized-info.maximum-bandwidth-in-mbps":   func(t *InstanceType) []string { return itoa32(t.EBSMaxMbps) },
	"ebs-info.ebs-optimized-info.maximum-iops":                func(t *InstanceType) []string { return itoa32(t.EBSMaxIOPS) },
	"ebs-info.ebs-optimized-info.maximum-throughput-in-mbps":  func(t *InstanceType) []string { return ftoa(float64(t.EBSMaxMbps) / 8) },
	"ebs-info.ebs-optimized-support":                          func(t *InstanceType) []string { return []string{"default"} },
	"ebs-info.encryption-support":                             func(t *InstanceType) []string { return []string{"supported"} },
	"ebs-info.nvme-support":                                   func(t *InstanceType) []string { return []string{"required"} },
	"free-tier-eligible":                                      func(t *InstanceType) []string { return bools(t.FreeTier) },
	"hibernation-supported":                                   func(t *InstanceType) []string { return bools(!t.BareMetal) },
	"hypervisor": func(t *InstanceType) []string {
		if t.BareMetal {
			return nil
		}
		return []string{"nitro"}
	},
	"instance-storage-supported":                   func(t *InstanceType) []string { return bools(false) },
	"instance-storage-info.disk.count":             func(t *InstanceType) []string { return nil },
	"instance-storage-info.disk.size-in-gb":        func(t *InstanceType) []string { return nil },
	"instance-storage-info.disk.type":              func(t *InstanceType) []string { return nil },
	"instance-storage-info.encryption-support":     func(t *InstanceType) []string { return nil },
	"instance-storage-info.nvme-support":           func(t *InstanceType) []string { return nil },
	"instance-storage-info.total-size-in-gb":       func(t *InstanceType) []string { return nil },
	"instance-type":                                func(t *InstanceType) []string { return []string{t.Name} },
	"memory-info.size-in-mib":                      func(t *InstanceType) []string { return []string{strconv.FormatInt(t.MemoryMiB, 10)} },
	"network-info.efa-supported":                   func(t *InstanceType) []string { return bools(false) },
	"network-info.ena-support":                     func(t *InstanceType) []string { return []string{"required"} },
	"network-info.encryption-in-transit-supported": func(t *InstanceType) []string { return bools(false) },
	"network-info.ipv4-addresses-per-interface":    func(t *InstanceType) []string { return itoa32(t.IPv4PerENI) },
	"network-info.ipv6-addresses-per-interface":    func(t *InstanceType) []string { return itoa32(t.IPv4PerENI) },
	"network-info.ipv6-supported":                  func(t *InstanceType) []string { return bools(true) },
	"network-info.maximum-network-cards":           func(t *InstanceType) []string { return itoa32(1) },
	"network-info.maximum-network-interfaces":      func(t *InstanceType) []string { return itoa32(t.MaxENIs) },
	"network-info.network-performance":             func(t *InstanceType) []string { return []string{t.NetworkPerformance} },
	"placement-group-info.supported-strategies": func(t *InstanceType) []string {
		if t.Burstable {
			return []string{"partition", "spread"}
		}
		return []string{"cluster", "partition", "spread"}
	},
	"processor-info.supported-architecture":       func(t *InstanceType) []string { return []string{"x86_64"} },
	"processor-info.sustained-clock-speed-in-ghz": func(t *InstanceType) []string { return ftoa(t.ClockGHz) },
	"processor-info.manufacturer":                 func(t *InstanceType) []string { return []string{"Intel"} },
	"supported-boot-mode":                         func(t *InstanceType) []string { return []string{"legacy-bios", "uefi"} },
	"supported-root-device-type":                  func(t *InstanceType) []string { return []string{"ebs"} },
	"supported-usage-class":                       func(t *InstanceType) []string { return []string{"on-demand", "spot"} },
	"supported-virtualization-type":               func(t *InstanceType) []string { return []string{"hvm"} },
	"vcpu-info.default-cores":                     func(t *InstanceType) []string { return itoa32(t.Cores) },
	"vcpu-info.default-threads-per-core":          func(t *InstanceType) []string { return itoa32(t.ThreadsPerCore) },
	"vcpu-info.default-vcpus":                     func(t *InstanceType) []string { return itoa32(t.VCPUs) },
	"vcpu-info.valid-threads-per-core": func(t *InstanceType) []string {
		if t.Burstable || t.BareMetal {
			return nil
		}
		return []string{"1", "2"}
	},
}

// unknownTypes returns the names that are not instance types hangar knows.
func unknownTypes(names []types.InstanceType) []string {
	var out []string
	for _, n := range names {
		if _, ok := byName[string(n)]; !ok {
			out = append(out, string(n))
		}
	}
	return out
}

// page walks the table in order after the token's type, up to p.max rows.
func typePage(p pager, keep func(t *InstanceType) bool, visit func(t *InstanceType)) (*string, error) {
	start := 0
	if p.after != "" {
		i, ok := byName[p.after]
		if !ok {
			return nil, awserr.InvalidParameterValue("The token '%s' is invalid.", clip(p.after))
		}
		start = i + 1
	}
	n := 0
	var last string
	for i := start; i < len(instanceTypes); i++ {
		t := &instanceTypes[i]
		if !keep(t) {
			continue
		}
		if p.max > 0 && n == p.max {
			return token(last), nil
		}
		visit(t)
		last = t.Name
		n++
	}
	return nil, nil
}

// DescribeInstanceTypes lists the instance types this host offers.
func (s *Service) DescribeInstanceTypes(ctx context.Context, in *ec2.DescribeInstanceTypesInput) (*ec2.DescribeInstanceTypesOutput, error) {
	match, err := instanceTypeFilters.compile(in.Filters)
	if err != nil {
		return nil, err
	}
	p, err := newPager(in.MaxResults, in.NextToken, 5, 100)
	if err != nil {
		return nil, err
	}
	if bad := unknownTypes(in.InstanceTypes); len(bad) > 0 {
		return nil, awserr.New(400, "InvalidInstanceType", "The following supplied instance types do not exist: [%s]", strings.Join(bad, ", "))
	}
	want := map[string]bool{}
	for _, n := range in.InstanceTypes {
		want[string(n)] = true
	}
	out := &ec2.DescribeInstanceTypesOutput{InstanceTypes: []types.InstanceTypeInfo{}}
	out.NextToken, err = typePage(p, func(t *InstanceType) bool {
		return (len(want) == 0 || want[t.Name]) && match(t, nil)
	}, func(t *InstanceType) {
		out.InstanceTypes = append(out.InstanceTypes, t.info())
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

type offeringRow struct {
	t        *InstanceType
	location string
}

var offeringFilters = filterSet[offeringRow]{
	"instance-type": func(r *offeringRow) []string { return []string{r.t.Name} },
	"location":      func(r *offeringRow) []string { return []string{r.location} },
}

// DescribeInstanceTypeOfferings lists where each type is offered: the
// host's region, zone or zone id, by LocationType.
func (s *Service) DescribeInstanceTypeOfferings(ctx context.Context, in *ec2.DescribeInstanceTypeOfferingsInput) (*ec2.DescribeInstanceTypeOfferingsOutput, error) {
	match, err := offeringFilters.compile(in.Filters)
	if err != nil {
		return nil, err
	}
	p, err := newPager(in.MaxResults, in.NextToken, 5, 1000)
	if err != nil {
		return nil, err
	}
	lt := in.LocationType
	var location string
	switch lt {
	case "", types.LocationTypeRegion:
		lt, location = types.LocationTypeRegion, s.cfg.Region
	case types.LocationTypeAvailabilityZone:
		location = s.cfg.AvailabilityZone
	case types.LocationTypeAvailabilityZoneId:
		location = zoneID(s.cfg.Region, s.cfg.AvailabilityZone)
	default:
		return nil, awserr.InvalidParameterValue("Value (%s) for parameter locationType is invalid. hangar offers region, availability-zone and availability-zone-id.", clip(string(lt)))
	}
	out := &ec2.DescribeInstanceTypeOfferingsOutput{InstanceTypeOfferings: []types.InstanceTypeOffering{}}
	out.NextToken, err = typePage(p, func(t *InstanceType) bool {
		return match(&offeringRow{t, location}, nil)
	}, func(t *InstanceType) {
		out.InstanceTypeOfferings = append(out.InstanceTypeOfferings, types.InstanceTypeOffering{
			InstanceType: types.InstanceType(t.Name), LocationType: lt, Location: ptr(location),
		})
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// String names the type with its size, for logs.
func (t InstanceType) String() string {
	return fmt.Sprintf("%s (%d vCPU, %d MiB)", t.Name, t.VCPUs, t.MemoryMiB)
}
