package ec2

import (
	"context"
	"fmt"
	"net/netip"
	"strconv"

	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"

	"hangar.dev/hangar/services/gateway/awserr"
	"hangar.dev/hangar/services/internal/store"
)

var kindSubnet = register(&kind{Prefix: "subnet", ResourceType: types.ResourceTypeSubnet, NotFound: "InvalidSubnetID.NotFound", Malformed: "InvalidSubnetID.Malformed", Noun: "subnet ID"})

// reservedPerSubnet is what AWS keeps of every subnet: the network address,
// the router (.1), DNS (.2), one for future use (.3) and the broadcast
// address.
const reservedPerSubnet = 5

// subnetRecord is a subnet as stored.
type subnetRecord struct {
	types.Subnet
	// Used counts addresses handed to interfaces; AvailableIpAddressCount
	// is the subnet's size less the reserved five and these.
	Used int
}

func subnetSize(p netip.Prefix) int { return 1 << (32 - p.Bits()) }

// view renders a subnet as the API shows it.
func (sn *subnetRecord) view(tags []types.Tag) types.Subnet {
	out := sn.Subnet
	out.AvailableIpAddressCount = ptr(int32(subnetSize(netip.MustParsePrefix(*sn.CidrBlock)) - reservedPerSubnet - sn.Used))
	out.Tags = tags
	return out
}

// parseCIDR4 reads an IPv4 CIDR block given as parameter param. EC2 wants
// it canonical: 10.0.1.5/24 is not a CIDR block, 10.0.1.0/24 is.
func parseCIDR4(raw, param string) (netip.Prefix, error) {
	p, err := netip.ParsePrefix(raw)
	if err != nil || !p.Addr().Is4() || p.Masked() != p {
		return netip.Prefix{}, awserr.InvalidParameterValue("Value (%s) for parameter %s is invalid. This is not a valid CIDR block.", clip(raw), param)
	}
	return p, nil
}

// subnetZone resolves the AvailabilityZone / AvailabilityZoneId of a create
// call to the host's one zone, which is also the default.
func (s *Service) subnetZone(name, id *string) (string, error) {
	zone := s.cfg.AvailabilityZone
	wantID := zoneID(s.cfg.Region, zone)
	if name != nil {
		if err := s.validZone(*name); err != nil {
			return "", err
		}
	}
	if id != nil && *id != wantID {
		return "", awserr.InvalidParameterValue("Value (%s) for parameter availabilityZoneId is invalid. Subnets can currently only be created in the following availability zone ids: %s.", clip(*id), wantID)
	}
	return zone, nil
}

// createSubnet validates cidr against the VPC and its other subnets, then
// writes the subnet.
func (s *Service) createSubnet(tx *store.Tx, v *vpcRecord, cidr netip.Prefix, zone string, defaultForAZ bool, tags []types.Tag) (*subnetRecord, error) {
	if !cidr.Addr().Is4() || cidr.Masked() != cidr {
		return nil, awserr.InvalidParameterValue("Value (%s) for parameter cidrBlock is invalid. This is not a valid CIDR block.", cidr)
	}
	if cidr.Bits() < 16 || cidr.Bits() > 28 {
		return nil, awserr.New(400, "InvalidSubnet.Range", "The CIDR '%s' is invalid. Subnet CIDR blocks must be between a /16 and a /28 netmask.", cidr)
	}
	vpcCIDR := netip.MustParsePrefix(*v.CidrBlock)
	if !(vpcCIDR.Contains(cidr.Addr()) && vpcCIDR.Bits() <= cidr.Bits()) {
		return nil, awserr.New(400, "InvalidSubnet.Range", "The CIDR '%s' is invalid. It is not inside the VPC's CIDR %s.", cidr, vpcCIDR)
	}
	clash, err := all(tx, kindSubnet, func(_ string, sn *subnetRecord) bool {
		return *sn.VpcId == *v.VpcId && netip.MustParsePrefix(*sn.CidrBlock).Overlaps(cidr)
	})
	if err != nil {
		return nil, err
	}
	for id, sn := range clash {
		return nil, awserr.New(400, "InvalidSubnet.Conflict", "The CIDR '%s' conflicts with another subnet (%s, %s)", cidr, id, *sn.CidrBlock)
	}
	if zone == "" {
		zone = s.cfg.AvailabilityZone
	}
	if err := s.validZone(zone); err != nil {
		return nil, err
	}
	id, err := newID(tx, kindSubnet.Prefix)
	if err != nil {
		return nil, err
	}
	sn := &subnetRecord{Subnet: types.Subnet{
		SubnetId:                    ptr(id),
		VpcId:                       v.VpcId,
		CidrBlock:                   ptr(cidr.String()),
		AvailabilityZone:            ptr(zone),
		AvailabilityZoneId:          ptr(zoneID(s.cfg.Region, zone)),
		AvailableIpAddressCount:     ptr(int32(subnetSize(cidr) - reservedPerSubnet)),
		DefaultForAz:                ptr(defaultForAZ),
		MapPublicIpOnLaunch:         ptr(defaultForAZ),
		MapCustomerOwnedIpOnLaunch:  ptr(false),
		AssignIpv6AddressOnCreation: ptr(false),
		EnableDns64:                 ptr(false),
		Ipv6Native:                  ptr(false),
		State:                       s.initialSubnetState(),
		OwnerId:                     ptr(s.account()),
		SubnetArn:                   ptr(fmt.Sprintf("arn:aws:ec2:%s:%s:subnet/%s", s.cfg.Region, s.account(), id)),
		Ipv6CidrBlockAssociationSet: []types.SubnetIpv6CidrBlockAssociation{},
		PrivateDnsNameOptionsOnLaunch: &types.PrivateDnsNameOptionsOnLaunch{
			HostnameType:                    types.HostnameTypeIpName,
			EnableResourceNameDnsARecord:    ptr(false),
			EnableResourceNameDnsAAAARecord: ptr(false),
		},
	}}
	if err := put(tx, kindSubnet, id, sn); err != nil {
		return nil, err
	}
	if len(tags) > 0 {
		if err := addTags(tx, id, tags); err != nil {
			return nil, err
		}
	}
	return sn, nil
}

func init() {
	vpcDependents = append(vpcDependents, func(tx *store.Tx, v *vpcRecord) (string, error) {
		found := ""
		_, err := exists(tx, kindSubnet, func(id string, sn *subnetRecord) bool {
			if *sn.VpcId == *v.VpcId {
				found = id
				return true
			}
			return false
		})
		return found, err
	})
}

// subnetDependents are the checks DeleteSubnet runs: each kind of record
// that lives in a subnet (network interfaces, instances) adds its own,
// returning the id of one that does.
var subnetDependents []func(tx *store.Tx, sn *subnetRecord) (string, error)

// CreateSubnet creates a subnet in a VPC.
func (s *Service) CreateSubnet(ctx context.Context, in *ec2.CreateSubnetInput) (*ec2.CreateSubnetOutput, error) {
	if in.VpcId == nil {
		return nil, awserr.MissingParameter("VpcId")
	}
	if in.Ipv6CidrBlock != nil || deref(in.Ipv6Native) || in.Ipv6IpamPoolId != nil || in.Ipv6NetmaskLength != nil {
		return nil, awserr.InvalidParameterValue("IPv6 subnets are not supported by hangar")
	}
	if in.Ipv4IpamPoolId != nil || in.Ipv4NetmaskLength != nil {
		return nil, awserr.InvalidParameterValue("IPAM pools are not supported by hangar; give CidrBlock")
	}
	if in.OutpostArn != nil {
		return nil, awserr.UnsupportedOperation("Outposts are not supported by hangar")
	}
	if in.CidrBlock == nil {
		return nil, awserr.MissingParameter("CidrBlock")
	}
	cidr, err := parseCIDR4(*in.CidrBlock, "cidrBlock")
	if err != nil {
		return nil, err
	}
	zone, err := s.subnetZone(in.AvailabilityZone, in.AvailabilityZoneId)
	if err != nil {
		return nil, err
	}
	tags, err := tagSpecs(in.TagSpecifications, types.ResourceTypeSubnet)
	if err != nil {
		return nil, err
	}
	var out types.Subnet
	err = s.db.Update(func(tx *store.Tx) error {
		v, err := get[vpcRecord](tx, kindVPC, *in.VpcId)
		if err != nil {
			return err
		}
		sn, err := s.createSubnet(tx, v, cidr, zone, false, tags)
		if err != nil {
			return err
		}
		out = sn.view(tagsOf(tx, *sn.SubnetId))
		return nil
	})
	if err != nil {
		return nil, err
	}
	return &ec2.CreateSubnetOutput{Subnet: &out}, nil
}

func subnetCIDR(sn *subnetRecord) []string { return []string{deref(sn.CidrBlock)} }
func subnetDefault(sn *subnetRecord) []string {
	return []string{boolString(deref(sn.DefaultForAz))}
}

// subnetFilters are DescribeSubnets' documented filters (with the legacy
// aliases cidr, cidrBlock and defaultForAz that EC2 still accepts).
var subnetFilters = filterSet[subnetRecord]{
	"availability-zone":    func(sn *subnetRecord) []string { return []string{deref(sn.AvailabilityZone)} },
	"availability-zone-id": func(sn *subnetRecord) []string { return []string{deref(sn.AvailabilityZoneId)} },
	"available-ip-address-count": func(sn *subnetRecord) []string {
		return []string{strconv.Itoa(int(deref(sn.view(nil).AvailableIpAddressCount)))}
	},
	"cidr-block":                      subnetCIDR,
	"cidr":                            subnetCIDR,
	"cidrBlock":                       subnetCIDR,
	"default-for-az":                  subnetDefault,
	"defaultForAz":                    subnetDefault,
	"enable-dns64":                    func(sn *subnetRecord) []string { return []string{boolString(deref(sn.EnableDns64))} },
	"ipv6-native":                     func(sn *subnetRecord) []string { return []string{boolString(deref(sn.Ipv6Native))} },
	"map-customer-owned-ip-on-launch": func(sn *subnetRecord) []string { return []string{boolString(deref(sn.MapCustomerOwnedIpOnLaunch))} },
	"map-public-ip-on-launch":         func(sn *subnetRecord) []string { return []string{boolString(deref(sn.MapPublicIpOnLaunch))} },
	"owner-id":                        func(sn *subnetRecord) []string { return []string{deref(sn.OwnerId)} },
	"private-dns-name-options-on-launch.hostname-type": func(sn *subnetRecord) []string {
		return []string{string(sn.PrivateDnsNameOptionsOnLaunch.HostnameType)}
	},
	"private-dns-name-options-on-launch.enable-resource-name-dns-a-record": func(sn *subnetRecord) []string {
		return []string{boolString(deref(sn.PrivateDnsNameOptionsOnLaunch.EnableResourceNameDnsARecord))}
	},
	"private-dns-name-options-on-launch.enable-resource-name-dns-aaaa-record": func(sn *subnetRecord) []string {
		return []string{boolString(deref(sn.PrivateDnsNameOptionsOnLaunch.EnableResourceNameDnsAAAARecord))}
	},
	"state":      func(sn *subnetRecord) []string { return []string{string(sn.State)} },
	"subnet-arn": func(sn *subnetRecord) []string { return []string{deref(sn.SubnetArn)} },
	"subnet-id":  func(sn *subnetRecord) []string { return []string{deref(sn.SubnetId)} },
	"vpc-id":     func(sn *subnetRecord) []string { return []string{deref(sn.VpcId)} },
	// hangar subnets have no IPv6 blocks; the filters exist and match nothing.
	"ipv6-cidr-block-association.ipv6-cidr-block": func(*subnetRecord) []string { return nil },
	"ipv6-cidr-block-association.association-id":  func(*subnetRecord) []string { return nil },
	"ipv6-cidr-block-association.state":           func(*subnetRecord) []string { return nil },
	"outpost-arn":                                 func(*subnetRecord) []string { return nil },
}

// DescribeSubnets lists subnets.
func (s *Service) DescribeSubnets(ctx context.Context, in *ec2.DescribeSubnetsInput) (*ec2.DescribeSubnetsOutput, error) {
	match, err := subnetFilters.compile(in.Filters)
	if err != nil {
		return nil, err
	}
	p, err := newPager(in.MaxResults, in.NextToken, 5, 1000)
	if err != nil {
		return nil, err
	}
	out := &ec2.DescribeSubnetsOutput{Subnets: []types.Subnet{}}
	err = s.db.View(func(tx *store.Tx) error {
		next, err := list(tx, kindSubnet, in.SubnetIds, match, p, func(_ string, sn *subnetRecord, tags []types.Tag) {
			out.Subnets = append(out.Subnets, sn.view(tags))
		})
		out.NextToken = next
		return err
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// DeleteSubnet deletes a subnet that nothing uses. Its explicit route table
// association goes with it, as in AWS.
func (s *Service) DeleteSubnet(ctx context.Context, in *ec2.DeleteSubnetInput) (*ec2.DeleteSubnetOutput, error) {
	if in.SubnetId == nil {
		return nil, awserr.MissingParameter("SubnetId")
	}
	id := *in.SubnetId
	err := s.db.Update(func(tx *store.Tx) error {
		sn, err := get[subnetRecord](tx, kindSubnet, id)
		if err != nil {
			return err
		}
		for _, dep := range subnetDependents {
			used, err := dep(tx, sn)
			if err != nil {
				return err
			}
			if used != "" {
				return awserr.DependencyViolation("The subnet '%s' has dependencies and cannot be deleted. (%s)", id, used)
			}
		}
		if err := dropSubnetAssociation(tx, id); err != nil {
			return err
		}
		return remove(tx, kindSubnet, id)
	})
	if err != nil {
		return nil, err
	}
	return &ec2.DeleteSubnetOutput{}, nil
}

// ModifySubnetAttribute sets one attribute of a subnet.
func (s *Service) ModifySubnetAttribute(ctx context.Context, in *ec2.ModifySubnetAttributeInput) (*ec2.ModifySubnetAttributeOutput, error) {
	if in.SubnetId == nil {
		return nil, awserr.MissingParameter("SubnetId")
	}
	set := 0
	for _, a := range []*types.AttributeBooleanValue{in.MapPublicIpOnLaunch, in.AssignIpv6AddressOnCreation, in.MapCustomerOwnedIpOnLaunch,
		in.EnableDns64, in.EnableResourceNameDnsARecordOnLaunch, in.EnableResourceNameDnsAAAARecordOnLaunch, in.DisableLniAtDeviceIndex} {
		if a != nil {
			set++
			if a.Value == nil {
				return nil, awserr.MissingParameter("Value")
			}
		}
	}
	if in.PrivateDnsHostnameTypeOnLaunch != "" {
		set++
	}
	if in.EnableLniAtDeviceIndex != nil {
		set++
	}
	// CustomerOwnedIpv4Pool travels with MapCustomerOwnedIpOnLaunch.
	if set == 0 {
		return nil, awserr.MissingParameter("MapPublicIpOnLaunch, EnableDns64, PrivateDnsHostnameTypeOnLaunch or another subnet attribute")
	}
	if set > 1 {
		return nil, awserr.InvalidParameterCombination("Fields for multiple attribute types specified: only one attribute can be modified at a time")
	}
	err := s.db.Update(func(tx *store.Tx) error {
		sn, err := get[subnetRecord](tx, kindSubnet, *in.SubnetId)
		if err != nil {
			return err
		}
		opts := sn.PrivateDnsNameOptionsOnLaunch
		switch {
		case in.MapPublicIpOnLaunch != nil:
			sn.MapPublicIpOnLaunch = in.MapPublicIpOnLaunch.Value
		case in.EnableDns64 != nil:
			// DNS64 synthesises addresses for IPv6-only clients; with no
			// IPv6 in hangar's VPCs it can be recorded but changes nothing.
			sn.EnableDns64 = in.EnableDns64.Value
		case in.EnableResourceNameDnsARecordOnLaunch != nil:
			opts.EnableResourceNameDnsARecord = in.EnableResourceNameDnsARecordOnLaunch.Value
		case in.EnableResourceNameDnsAAAARecordOnLaunch != nil:
			if *in.EnableResourceNameDnsAAAARecordOnLaunch.Value {
				return awserr.InvalidParameterValue("Cannot enable AAAA records for resource names on subnet %s: it has no IPv6 CIDR block", *in.SubnetId)
			}
			opts.EnableResourceNameDnsAAAARecord = ptr(false)
		case in.PrivateDnsHostnameTypeOnLaunch != "":
			switch in.PrivateDnsHostnameTypeOnLaunch {
			case types.HostnameTypeIpName, types.HostnameTypeResourceName:
				opts.HostnameType = in.PrivateDnsHostnameTypeOnLaunch
			default:
				return awserr.InvalidParameterValue("Value (%s) for parameter privateDnsHostnameTypeOnLaunch is invalid. Expected ip-name or resource-name.", clip(string(in.PrivateDnsHostnameTypeOnLaunch)))
			}
		case in.AssignIpv6AddressOnCreation != nil:
			if *in.AssignIpv6AddressOnCreation.Value {
				return awserr.InvalidParameterValue("Cannot assign IPv6 addresses on creation in subnet %s: it has no IPv6 CIDR block", *in.SubnetId)
			}
			sn.AssignIpv6AddressOnCreation = ptr(false)
		case in.MapCustomerOwnedIpOnLaunch != nil:
			if *in.MapCustomerOwnedIpOnLaunch.Value {
				return awserr.UnsupportedOperation("Customer-owned IP pools (Outposts) are not supported by hangar")
			}
			sn.MapCustomerOwnedIpOnLaunch = ptr(false)
		default: // EnableLniAtDeviceIndex, DisableLniAtDeviceIndex
			return awserr.UnsupportedOperation("Local network interfaces (Outposts) are not supported by hangar")
		}
		return put(tx, kindSubnet, *in.SubnetId, sn)
	})
	if err != nil {
		return nil, err
	}
	return &ec2.ModifySubnetAttributeOutput{}, nil
}

// initialSubnetState is pending until hangar-netd has made the subnet's
// bridge, as AWS answers create-subnet; without netd it is available.
func (s *Service) initialSubnetState() types.SubnetState {
	if s.networked() {
		return types.SubnetStatePending
	}
	return types.SubnetStateAvailable
}
