package ec2

import (
	"context"
	"strings"

	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"

	"hangar.dev/hangar/services/gateway/awserr"
	"hangar.dev/hangar/services/gateway/reqctx"
)

var regionFilters = filterSet[types.Region]{
	"endpoint":      func(r *types.Region) []string { return []string{deref(r.Endpoint)} },
	"opt-in-status": func(r *types.Region) []string { return []string{deref(r.OptInStatus)} },
	"region-name":   func(r *types.Region) []string { return []string{deref(r.RegionName)} },
}

// DescribeRegions lists the one region a host is: it answers for that
// region and no other.
func (s *Service) DescribeRegions(ctx context.Context, in *ec2.DescribeRegionsInput) (*ec2.DescribeRegionsOutput, error) {
	match, err := regionFilters.compile(in.Filters)
	if err != nil {
		return nil, err
	}
	endpoint := reqctx.From(ctx).Host
	if endpoint == "" {
		endpoint = s.cfg.APIListen
	}
	r := types.Region{RegionName: ptr(s.cfg.Region), Endpoint: ptr(endpoint), OptInStatus: ptr("opt-in-not-required")}
	for _, name := range in.RegionNames {
		if name != s.cfg.Region {
			return nil, awserr.InvalidParameterValue("Invalid region: %s (this host serves %s)", name, s.cfg.Region)
		}
	}
	out := &ec2.DescribeRegionsOutput{Regions: []types.Region{}}
	if match(&r, nil) {
		out.Regions = append(out.Regions, r)
	}
	return out, nil
}

// zoneID derives the zone id AWS would give, as use1-az1 for us-east-1a:
// AWS abbreviates the region (us-east-1 → use1) and numbers its zones.
func zoneID(region, zone string) string {
	abbrev := map[string]string{
		"east": "e", "west": "w", "north": "n", "south": "s", "central": "c",
		"northeast": "ne", "northwest": "nw", "southeast": "se", "southwest": "sw",
	}
	parts := strings.Split(region, "-")
	var b strings.Builder
	for i, p := range parts {
		if a, ok := abbrev[p]; ok && i > 0 {
			b.WriteString(a)
		} else if p == "gov" {
			b.WriteString("g")
		} else {
			b.WriteString(p)
		}
	}
	n := 1
	if len(zone) > len(region) {
		n = int(zone[len(region)]-'a') + 1
	}
	return b.String() + "-az" + string(rune('0'+n))
}

var zoneFilters = filterSet[types.AvailabilityZone]{
	"group-name":           func(z *types.AvailabilityZone) []string { return []string{deref(z.GroupName)} },
	"message":              func(z *types.AvailabilityZone) []string { return nil },
	"opt-in-status":        func(z *types.AvailabilityZone) []string { return []string{string(z.OptInStatus)} },
	"region-name":          func(z *types.AvailabilityZone) []string { return []string{deref(z.RegionName)} },
	"state":                func(z *types.AvailabilityZone) []string { return []string{string(z.State)} },
	"zone-id":              func(z *types.AvailabilityZone) []string { return []string{deref(z.ZoneId)} },
	"zone-name":            func(z *types.AvailabilityZone) []string { return []string{deref(z.ZoneName)} },
	"zone-type":            func(z *types.AvailabilityZone) []string { return []string{deref(z.ZoneType)} },
	"network-border-group": func(z *types.AvailabilityZone) []string { return []string{deref(z.NetworkBorderGroup)} },
}

func (s *Service) zone() types.AvailabilityZone {
	return types.AvailabilityZone{
		ZoneName:           ptr(s.cfg.AvailabilityZone),
		ZoneId:             ptr(zoneID(s.cfg.Region, s.cfg.AvailabilityZone)),
		RegionName:         ptr(s.cfg.Region),
		GroupName:          ptr(s.cfg.Region),
		NetworkBorderGroup: ptr(s.cfg.Region),
		State:              types.AvailabilityZoneStateAvailable,
		OptInStatus:        types.AvailabilityZoneOptInStatusOptInNotRequired,
		ZoneType:           ptr("availability-zone"),
		Messages:           []types.AvailabilityZoneMessage{},
	}
}

// DescribeAvailabilityZones lists the host's zone.
func (s *Service) DescribeAvailabilityZones(ctx context.Context, in *ec2.DescribeAvailabilityZonesInput) (*ec2.DescribeAvailabilityZonesOutput, error) {
	match, err := zoneFilters.compile(in.Filters)
	if err != nil {
		return nil, err
	}
	z := s.zone()
	for _, name := range in.ZoneNames {
		if name != *z.ZoneName {
			return nil, awserr.InvalidParameterValue("The zone '%s' does not exist. This host serves %s.", name, *z.ZoneName)
		}
	}
	for _, id := range in.ZoneIds {
		if id != *z.ZoneId {
			return nil, awserr.InvalidParameterValue("The zone ID '%s' does not exist. This host serves %s.", id, *z.ZoneId)
		}
	}
	out := &ec2.DescribeAvailabilityZonesOutput{AvailabilityZones: []types.AvailabilityZone{}}
	if match(&z, nil) {
		out.AvailabilityZones = append(out.AvailabilityZones, z)
	}
	return out, nil
}

// validZone checks a zone name given on a create call.
func (s *Service) validZone(name string) error {
	if name != "" && name != s.cfg.AvailabilityZone {
		return awserr.InvalidParameterValue("Value (%s) for parameter availabilityZone is invalid. Subnets can currently only be created in the following availability zones: %s.", name, s.cfg.AvailabilityZone)
	}
	return nil
}
