package ec2

import (
	"context"
	"fmt"
	"net/netip"

	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"

	"hangar.dev/hangar/services/gateway/awserr"
	"hangar.dev/hangar/services/internal/store"
)

var kindVPC = register(&kind{Prefix: "vpc", ResourceType: types.ResourceTypeVpc, NotFound: "InvalidVpcID.NotFound", Malformed: "InvalidVpcID.Malformed", Noun: "vpc ID"})

// vpcRecord is a VPC as stored: the API's view plus what EC2 keeps beside
// it. Tags live in the tags bucket, not here.
type vpcRecord struct {
	types.Vpc
	DNSSupport           bool
	DNSHostnames         bool
	MainRouteTableID     string
	DefaultSecurityGroup string
}

// The default VPC's shape is AWS's: 172.31.0.0/16, with a /20 default
// subnet per zone starting at 172.31.0.0.
const (
	defaultVPCCIDR    = "172.31.0.0/16"
	defaultSubnetCIDR = "172.31.0.0/20"
)

// parseVPCCIDR checks a VPC CIDR block as EC2 does (IPv4, /16 to /28, no
// host bits) and as this host must (inside GUEST_SUBNET_POOL, clear of
// PROTECTED_CIDRS).
func (s *Service) parseVPCCIDR(raw string) (netip.Prefix, error) {
	p, err := netip.ParsePrefix(raw)
	if err != nil || !p.Addr().Is4() || p.Masked() != p {
		return p, awserr.InvalidParameterValue("Value (%s) for parameter cidrBlock is invalid. This is not a valid CIDR block.", clip(raw))
	}
	if p.Bits() < 16 || p.Bits() > 28 {
		return p, awserr.New(400, "InvalidVpc.Range", "The CIDR '%s' is invalid. VPC CIDR blocks must be between a /16 and a /28 netmask.", raw)
	}
	inPool := len(s.cfg.GuestSubnetPool) == 0
	for _, pool := range s.cfg.GuestSubnetPool {
		if pool.Bits() <= p.Bits() && pool.Contains(p.Addr()) {
			inPool = true
		}
	}
	if !inPool {
		return p, awserr.New(400, "InvalidVpc.Range", "The CIDR '%s' is invalid. This host only allows VPC CIDRs inside GUEST_SUBNET_POOL (%s).", raw, prefixes(s.cfg.GuestSubnetPool))
	}
	for _, prot := range s.cfg.ProtectedCIDRs {
		if prot.Overlaps(p) {
			return p, awserr.New(400, "InvalidVpc.Range", "The CIDR '%s' is invalid. It overlaps %s, which this host protects (PROTECTED_CIDRS).", raw, prot)
		}
	}
	return p, nil
}

func prefixes(ps []netip.Prefix) string {
	out := ""
	for i, p := range ps {
		if i > 0 {
			out += ", "
		}
		out += p.String()
	}
	return out
}

// createVPC writes a VPC with what every VPC has: its main route table
// with the local route and its default security group.
func (s *Service) createVPC(tx *store.Tx, cidr netip.Prefix, isDefault bool, tenancy types.Tenancy, tags []types.Tag) (*vpcRecord, error) {
	id, err := newID(tx, kindVPC.Prefix)
	if err != nil {
		return nil, err
	}
	assoc, err := newID(tx, "vpc-cidr-assoc")
	if err != nil {
		return nil, err
	}
	if tenancy == "" {
		tenancy = types.TenancyDefault
	}
	v := &vpcRecord{
		Vpc: types.Vpc{
			VpcId:           ptr(id),
			CidrBlock:       ptr(cidr.String()),
			State:           s.initialVPCState(),
			OwnerId:         ptr(s.account()),
			InstanceTenancy: tenancy,
			IsDefault:       ptr(isDefault),
			DhcpOptionsId:   ptr(s.dhcpOptionsID(tx)),
			CidrBlockAssociationSet: []types.VpcCidrBlockAssociation{{
				AssociationId:  ptr(assoc),
				CidrBlock:      ptr(cidr.String()),
				CidrBlockState: &types.VpcCidrBlockState{State: types.VpcCidrBlockStateCodeAssociated},
			}},
		},
		DNSSupport:   true,
		DNSHostnames: isDefault, // AWS turns hostnames on only in default VPCs
	}
	rtb, err := s.createRouteTable(tx, v, true)
	if err != nil {
		return nil, err
	}
	v.MainRouteTableID = *rtb.RouteTableId
	sg, err := s.createDefaultSecurityGroup(tx, v)
	if err != nil {
		return nil, err
	}
	v.DefaultSecurityGroup = *sg.GroupId
	if err := put(tx, kindVPC, id, v); err != nil {
		return nil, err
	}
	if len(tags) > 0 {
		if err := addTags(tx, id, tags); err != nil {
			return nil, err
		}
	}
	return v, nil
}

// dhcpOptionsID returns the account's default DHCP options set id, made
// once: every VPC starts with it, as in AWS.
func (s *Service) dhcpOptionsID(tx *store.Tx) string {
	var id string
	if err := tx.Get(bucketMeta, "dhcp-options", &id); err == nil {
		return id
	}
	id, err := newID(tx, "dopt")
	if err != nil {
		return "default"
	}
	_ = tx.Put(bucketMeta, "dhcp-options", id)
	return id
}

func (s *Service) createDefaultVPC(ctx context.Context, tx *store.Tx) error {
	cidr := netip.MustParsePrefix(defaultVPCCIDR)
	v, err := s.createVPC(tx, cidr, true, types.TenancyDefault, nil)
	if err != nil {
		return fmt.Errorf("creating the default VPC: %w", err)
	}
	if _, err := s.createSubnet(tx, v, netip.MustParsePrefix(defaultSubnetCIDR), s.cfg.AvailabilityZone, true, nil); err != nil {
		return fmt.Errorf("creating the default subnet: %w", err)
	}
	if err := s.createDefaultInternetGateway(tx, v); err != nil {
		return fmt.Errorf("creating the default internet gateway: %w", err)
	}
	s.log.Info("created the default VPC", "vpc", *v.VpcId, "cidr", defaultVPCCIDR)
	return tx.Put(bucketMeta, metaDefaultVPC, *v.VpcId)
}

// view renders a record as the API shows it.
func (v *vpcRecord) view(tags []types.Tag) types.Vpc {
	out := v.Vpc
	out.Tags = tags
	return out
}

// CreateVpc creates a VPC.
func (s *Service) CreateVpc(ctx context.Context, in *ec2.CreateVpcInput) (*ec2.CreateVpcOutput, error) {
	if in.AmazonProvidedIpv6CidrBlock != nil && *in.AmazonProvidedIpv6CidrBlock || in.Ipv6CidrBlock != nil || in.Ipv6Pool != nil || in.Ipv6IpamPoolId != nil {
		return nil, awserr.InvalidParameterValue("IPv6 CIDR blocks are not supported by hangar")
	}
	if in.Ipv4IpamPoolId != nil {
		return nil, awserr.InvalidParameterValue("IPAM pools are not supported by hangar; give CidrBlock")
	}
	if in.CidrBlock == nil {
		return nil, awserr.MissingParameter("CidrBlock")
	}
	cidr, err := s.parseVPCCIDR(*in.CidrBlock)
	if err != nil {
		return nil, err
	}
	tags, err := tagSpecs(in.TagSpecifications, types.ResourceTypeVpc)
	if err != nil {
		return nil, err
	}
	var out types.Vpc
	err = s.db.Update(func(tx *store.Tx) error {
		v, err := s.createVPC(tx, cidr, false, in.InstanceTenancy, tags)
		if err != nil {
			return err
		}
		out = v.view(tagsOf(tx, *v.VpcId))
		return nil
	})
	if err != nil {
		return nil, err
	}
	return &ec2.CreateVpcOutput{Vpc: &out}, nil
}

var vpcFilters = filterSet[vpcRecord]{
	"cidr": func(v *vpcRecord) []string { return []string{deref(v.CidrBlock)} },
	"cidr-block-association.cidr-block": func(v *vpcRecord) []string {
		var out []string
		for _, a := range v.CidrBlockAssociationSet {
			out = append(out, deref(a.CidrBlock))
		}
		return out
	},
	"cidr-block-association.association-id": func(v *vpcRecord) []string {
		var out []string
		for _, a := range v.CidrBlockAssociationSet {
			out = append(out, deref(a.AssociationId))
		}
		return out
	},
	"cidr-block-association.state": func(v *vpcRecord) []string {
		var out []string
		for _, a := range v.CidrBlockAssociationSet {
			if a.CidrBlockState != nil {
				out = append(out, string(a.CidrBlockState.State))
			}
		}
		return out
	},
	"dhcp-options-id":  func(v *vpcRecord) []string { return []string{deref(v.DhcpOptionsId)} },
	"is-default":       func(v *vpcRecord) []string { return []string{boolString(deref(v.IsDefault))} },
	"owner-id":         func(v *vpcRecord) []string { return []string{deref(v.OwnerId)} },
	"state":            func(v *vpcRecord) []string { return []string{string(v.State)} },
	"vpc-id":           func(v *vpcRecord) []string { return []string{deref(v.VpcId)} },
	"instance-tenancy": func(v *vpcRecord) []string { return []string{string(v.InstanceTenancy)} },
}

// DescribeVpcs lists VPCs.
func (s *Service) DescribeVpcs(ctx context.Context, in *ec2.DescribeVpcsInput) (*ec2.DescribeVpcsOutput, error) {
	match, err := vpcFilters.compile(in.Filters)
	if err != nil {
		return nil, err
	}
	p, err := newPager(in.MaxResults, in.NextToken, 5, 1000)
	if err != nil {
		return nil, err
	}
	out := &ec2.DescribeVpcsOutput{Vpcs: []types.Vpc{}}
	err = s.db.View(func(tx *store.Tx) error {
		next, err := list(tx, kindVPC, in.VpcIds, match, p, func(_ string, v *vpcRecord, tags []types.Tag) {
			out.Vpcs = append(out.Vpcs, v.view(tags))
		})
		out.NextToken = next
		return err
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// DeleteVpc deletes a VPC that nothing else uses. Its main route table and
// default security group go with it, as in AWS.
func (s *Service) DeleteVpc(ctx context.Context, in *ec2.DeleteVpcInput) (*ec2.DeleteVpcOutput, error) {
	if in.VpcId == nil {
		return nil, awserr.MissingParameter("VpcId")
	}
	id := *in.VpcId
	err := s.db.Update(func(tx *store.Tx) error {
		v, err := get[vpcRecord](tx, kindVPC, id)
		if err != nil {
			return err
		}
		if dep, err := s.vpcDependency(tx, v); err != nil {
			return err
		} else if dep != "" {
			return awserr.DependencyViolation("The vpc '%s' has dependencies and cannot be deleted. (%s)", id, dep)
		}
		if err := s.deleteVPCDefaults(tx, v); err != nil {
			return err
		}
		if err := remove(tx, kindVPC, id); err != nil {
			return err
		}
		if deref(v.IsDefault) {
			// Deleting the default VPC is allowed, as in AWS; it is not
			// recreated behind the operator's back.
			return tx.Put(bucketMeta, metaDefaultVPC, "deleted")
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return &ec2.DeleteVpcOutput{}, nil
}

// vpcDependency names the first thing that keeps a VPC from being deleted,
// or "" when nothing does.
func (s *Service) vpcDependency(tx *store.Tx, v *vpcRecord) (string, error) {
	vpcID := *v.VpcId
	for _, dep := range vpcDependents {
		id, err := dep(tx, v)
		if err != nil {
			return "", err
		}
		if id != "" {
			return id, nil
		}
	}
	_ = vpcID
	return "", nil
}

// vpcDependents are the checks DeleteVpc runs; each kind of record that can
// live in a VPC adds its own, returning the id of a record that does.
var vpcDependents []func(tx *store.Tx, v *vpcRecord) (string, error)

// ModifyVpcAttribute sets one DNS attribute of a VPC.
func (s *Service) ModifyVpcAttribute(ctx context.Context, in *ec2.ModifyVpcAttributeInput) (*ec2.ModifyVpcAttributeOutput, error) {
	if in.VpcId == nil {
		return nil, awserr.MissingParameter("VpcId")
	}
	set := 0
	for _, a := range []*types.AttributeBooleanValue{in.EnableDnsSupport, in.EnableDnsHostnames, in.EnableNetworkAddressUsageMetrics} {
		if a != nil {
			set++
			if a.Value == nil {
				return nil, awserr.MissingParameter("Value")
			}
		}
	}
	if set == 0 {
		return nil, awserr.MissingParameter("EnableDnsSupport or EnableDnsHostnames")
	}
	if set > 1 {
		return nil, awserr.InvalidParameterCombination("Fields for multiple attribute types specified: only one attribute can be modified at a time")
	}
	err := s.db.Update(func(tx *store.Tx) error {
		v, err := get[vpcRecord](tx, kindVPC, *in.VpcId)
		if err != nil {
			return err
		}
		switch {
		case in.EnableDnsSupport != nil:
			if !*in.EnableDnsSupport.Value && v.DNSHostnames {
				return awserr.InvalidParameterValue("Cannot disable DNS support while DNS hostnames are enabled for %s; disable enableDnsHostnames first", *in.VpcId)
			}
			v.DNSSupport = *in.EnableDnsSupport.Value
		case in.EnableDnsHostnames != nil:
			if *in.EnableDnsHostnames.Value && !v.DNSSupport {
				return awserr.InvalidParameterValue("Cannot enable DNS hostnames for %s while DNS support is disabled", *in.VpcId)
			}
			v.DNSHostnames = *in.EnableDnsHostnames.Value
		case in.EnableNetworkAddressUsageMetrics != nil:
			return awserr.UnsupportedOperation("enableNetworkAddressUsageMetrics is not supported by hangar")
		}
		return put(tx, kindVPC, *in.VpcId, v)
	})
	if err != nil {
		return nil, err
	}
	return &ec2.ModifyVpcAttributeOutput{}, nil
}

// DescribeVpcAttribute reports one attribute of a VPC.
func (s *Service) DescribeVpcAttribute(ctx context.Context, in *ec2.DescribeVpcAttributeInput) (*ec2.DescribeVpcAttributeOutput, error) {
	if in.VpcId == nil {
		return nil, awserr.MissingParameter("VpcId")
	}
	if in.Attribute == "" {
		return nil, awserr.MissingParameter("Attribute")
	}
	var v *vpcRecord
	err := s.db.View(func(tx *store.Tx) (err error) {
		v, err = get[vpcRecord](tx, kindVPC, *in.VpcId)
		return err
	})
	if err != nil {
		return nil, err
	}
	out := &ec2.DescribeVpcAttributeOutput{VpcId: in.VpcId}
	switch in.Attribute {
	case types.VpcAttributeNameEnableDnsSupport:
		out.EnableDnsSupport = &types.AttributeBooleanValue{Value: ptr(v.DNSSupport)}
	case types.VpcAttributeNameEnableDnsHostnames:
		out.EnableDnsHostnames = &types.AttributeBooleanValue{Value: ptr(v.DNSHostnames)}
	case types.VpcAttributeNameEnableNetworkAddressUsageMetrics:
		out.EnableNetworkAddressUsageMetrics = &types.AttributeBooleanValue{Value: ptr(false)}
	default:
		return nil, awserr.InvalidParameterValue("Value (%s) for parameter attribute is invalid.", in.Attribute)
	}
	return out, nil
}

// initialVPCState is pending while hangar-netd has yet to build the VPC, as
// AWS answers create-vpc; without netd (records only) it is available.
func (s *Service) initialVPCState() types.VpcState {
	if s.networked() {
		return types.VpcStatePending
	}
	return types.VpcStateAvailable
}
