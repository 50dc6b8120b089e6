package ec2

import (
	"fmt"
	"net/netip"

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
		State:                       types.SubnetStateAvailable,
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
