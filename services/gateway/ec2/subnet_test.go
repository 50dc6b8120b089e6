package ec2

import (
	"fmt"
	"sort"
	"testing"

	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"
)

func TestDefaultVPCHasSubnetAndRouting(t *testing.T) {
	s := newSvc(t)
	vpcs := must[*ec2.DescribeVpcsOutput](t)(s.DescribeVpcs(bg, &ec2.DescribeVpcsInput{Filters: []types.Filter{filter("is-default", "true")}}))
	if len(vpcs.Vpcs) != 1 {
		t.Fatalf("default VPCs: %d", len(vpcs.Vpcs))
	}
	vpc := *vpcs.Vpcs[0].VpcId
	sn := must[*ec2.DescribeSubnetsOutput](t)(s.DescribeSubnets(bg, &ec2.DescribeSubnetsInput{Filters: []types.Filter{filter("vpc-id", vpc)}}))
	if len(sn.Subnets) != 1 {
		t.Fatalf("default subnets: %+v", sn.Subnets)
	}
	d := sn.Subnets[0]
	if *d.CidrBlock != "172.31.0.0/20" || !*d.DefaultForAz || !*d.MapPublicIpOnLaunch || *d.AvailableIpAddressCount != 4096-5 || *d.AvailabilityZone != "us-east-1a" || *d.AvailabilityZoneId != "use1-az1" {
		t.Fatalf("default subnet = %+v", d)
	}
	rt := must[*ec2.DescribeRouteTablesOutput](t)(s.DescribeRouteTables(bg, &ec2.DescribeRouteTablesInput{Filters: []types.Filter{filter("vpc-id", vpc), filter("association.main", "true")}}))
	if len(rt.RouteTables) != 1 || len(rt.RouteTables[0].Routes) != 2 {
		t.Fatalf("main route table = %+v", rt.RouteTables)
	}
	r := rt.RouteTables[0].Routes
	if *r[0].GatewayId != "local" || *r[0].DestinationCidrBlock != "172.31.0.0/16" || *r[1].DestinationCidrBlock != "0.0.0.0/0" || r[1].State != types.RouteStateActive {
		t.Fatalf("routes = %+v", r)
	}
	igw := must[*ec2.DescribeInternetGatewaysOutput](t)(s.DescribeInternetGateways(bg, &ec2.DescribeInternetGatewaysInput{Filters: []types.Filter{filter("attachment.vpc-id", vpc)}}))
	if len(igw.InternetGateways) != 1 || *igw.InternetGateways[0].InternetGatewayId != *r[1].GatewayId || igw.InternetGateways[0].Attachments[0].State != "available" {
		t.Fatalf("default gateway = %+v", igw.InternetGateways)
	}
}

func TestCreateSubnet(t *testing.T) {
	s := newSvc(t)
	vpc := mkVPC(t, s, "10.0.0.0/16")
	other := mkVPC(t, s, "10.1.0.0/16")
	mkSubnet(t, s, vpc, "10.0.0.0/24")

	for _, tc := range []struct {
		name string
		in   ec2.CreateSubnetInput
		code string
		free int32
	}{
		{name: "a /24", in: ec2.CreateSubnetInput{VpcId: &vpc, CidrBlock: ptr("10.0.1.0/24")}, free: 251},
		{name: "a /28, the smallest", in: ec2.CreateSubnetInput{VpcId: &vpc, CidrBlock: ptr("10.0.2.0/28")}, free: 11},
		{name: "the zone by name", in: ec2.CreateSubnetInput{VpcId: &vpc, CidrBlock: ptr("10.0.3.0/24"), AvailabilityZone: ptr("us-east-1a")}, free: 251},
		{name: "the zone by id", in: ec2.CreateSubnetInput{VpcId: &vpc, CidrBlock: ptr("10.0.4.0/24"), AvailabilityZoneId: ptr("use1-az1")}, free: 251},
		{name: "the whole VPC in another VPC", in: ec2.CreateSubnetInput{VpcId: &other, CidrBlock: ptr("10.1.0.0/16")}, free: 65536 - 5},
		{name: "overlapping a sibling", in: ec2.CreateSubnetInput{VpcId: &vpc, CidrBlock: ptr("10.0.0.128/25")}, code: "InvalidSubnet.Conflict"},
		{name: "containing a sibling", in: ec2.CreateSubnetInput{VpcId: &vpc, CidrBlock: ptr("10.0.0.0/22")}, code: "InvalidSubnet.Conflict"},
		{name: "outside the VPC", in: ec2.CreateSubnetInput{VpcId: &vpc, CidrBlock: ptr("10.2.0.0/24")}, code: "InvalidSubnet.Range"},
		{name: "larger than the VPC", in: ec2.CreateSubnetInput{VpcId: &vpc, CidrBlock: ptr("10.0.0.0/15")}, code: "InvalidSubnet.Range"},
		{name: "a /29", in: ec2.CreateSubnetInput{VpcId: &vpc, CidrBlock: ptr("10.0.9.0/29")}, code: "InvalidSubnet.Range"},
		{name: "host bits set", in: ec2.CreateSubnetInput{VpcId: &vpc, CidrBlock: ptr("10.0.9.5/24")}, code: "InvalidParameterValue"},
		{name: "not a CIDR", in: ec2.CreateSubnetInput{VpcId: &vpc, CidrBlock: ptr("banana")}, code: "InvalidParameterValue"},
		{name: "IPv6", in: ec2.CreateSubnetInput{VpcId: &vpc, CidrBlock: ptr("10.0.9.0/24"), Ipv6CidrBlock: ptr("2001:db8::/64")}, code: "InvalidParameterValue"},
		{name: "no CIDR", in: ec2.CreateSubnetInput{VpcId: &vpc}, code: "MissingParameter"},
		{name: "another zone", in: ec2.CreateSubnetInput{VpcId: &vpc, CidrBlock: ptr("10.0.9.0/24"), AvailabilityZone: ptr("us-east-1b")}, code: "InvalidParameterValue"},
		{name: "another zone id", in: ec2.CreateSubnetInput{VpcId: &vpc, CidrBlock: ptr("10.0.9.0/24"), AvailabilityZoneId: ptr("use1-az4")}, code: "InvalidParameterValue"},
		{name: "a VPC that does not exist", in: ec2.CreateSubnetInput{VpcId: ptr("vpc-0123456789abcdef0"), CidrBlock: ptr("10.0.9.0/24")}, code: "InvalidVpcID.NotFound"},
		{name: "a malformed VPC id", in: ec2.CreateSubnetInput{VpcId: ptr("vpc-xyz"), CidrBlock: ptr("10.0.9.0/24")}, code: "InvalidVpcID.Malformed"},
		{name: "tags for another resource type", in: ec2.CreateSubnetInput{VpcId: &vpc, CidrBlock: ptr("10.0.9.0/24"), TagSpecifications: tagSpec(types.ResourceTypeVpc, "a", "b")}, code: "InvalidParameterValue"},
		{name: "a reserved tag key", in: ec2.CreateSubnetInput{VpcId: &vpc, CidrBlock: ptr("10.0.9.0/24"), TagSpecifications: tagSpec(types.ResourceTypeSubnet, "aws:x", "b")}, code: "InvalidParameterValue"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := snapshot(t, s)
			out, err := s.CreateSubnet(bg, &tc.in)
			wantCode(t, err, tc.code)
			if tc.code != "" {
				sameState(t, before, snapshot(t, s), "a failed CreateSubnet")
				return
			}
			encodes(t, "CreateSubnet", out)
			sn := out.Subnet
			if *sn.AvailableIpAddressCount != tc.free || *sn.VpcId != *tc.in.VpcId || *sn.CidrBlock != *tc.in.CidrBlock || sn.State != types.SubnetStateAvailable || *sn.DefaultForAz || *sn.MapPublicIpOnLaunch {
				t.Fatalf("subnet = %+v", sn)
			}
			if *sn.SubnetArn != "arn:aws:ec2:us-east-1:"+testAccount+":subnet/"+*sn.SubnetId || *sn.OwnerId != testAccount {
				t.Fatalf("arn/owner = %s %s", *sn.SubnetArn, *sn.OwnerId)
			}
		})
	}
}

func TestSubnetTagsAndFilters(t *testing.T) {
	s := newSvc(t)
	vpc := mkVPC(t, s, "10.0.0.0/16")
	web := must[*ec2.CreateSubnetOutput](t)(s.CreateSubnet(bg, &ec2.CreateSubnetInput{VpcId: &vpc, CidrBlock: ptr("10.0.1.0/24"),
		TagSpecifications: tagSpec(types.ResourceTypeSubnet, "Name", "web", "tier", "public")}))
	if len(web.Subnet.Tags) != 2 {
		t.Fatalf("tags on create: %+v", web.Subnet.Tags)
	}
	db := mustSubnetTagged(t, s, vpc, "10.0.2.0/24", "Name", "db")
	webID := *web.Subnet.SubnetId

	for _, tc := range []struct {
		filters []types.Filter
		want    []string
		code    string
	}{
		{filters: []types.Filter{filter("vpc-id", vpc)}, want: []string{webID, db}},
		{filters: []types.Filter{filter("tag:Name", "web")}, want: []string{webID}},
		{filters: []types.Filter{filter("tag:Name", "web", "db")}, want: []string{webID, db}},
		{filters: []types.Filter{filter("tag:Name", "w*")}, want: []string{webID}},
		{filters: []types.Filter{filter("tag-key", "tier")}, want: []string{webID}},
		{filters: []types.Filter{filter("tag-value", "public")}, want: []string{webID}},
		{filters: []types.Filter{filter("cidr-block", "10.0.2.0/24")}, want: []string{db}},
		{filters: []types.Filter{filter("cidrBlock", "10.0.1.*")}, want: []string{webID}},
		{filters: []types.Filter{filter("vpc-id", vpc), filter("available-ip-address-count", "251")}, want: []string{webID, db}},
		{filters: []types.Filter{filter("vpc-id", vpc), filter("default-for-az", "true")}, want: nil},
		{filters: []types.Filter{filter("vpc-id", vpc), filter("availability-zone", "us-east-1a"), filter("state", "available")}, want: []string{webID, db}},
		{filters: []types.Filter{filter("vpc-id", vpc), filter("map-public-ip-on-launch", "false")}, want: []string{webID, db}},
		{filters: []types.Filter{filter("subnet-id", db)}, want: []string{db}},
		{filters: []types.Filter{filter("no-such-filter", "x")}, code: "InvalidParameterValue"},
	} {
		out, err := s.DescribeSubnets(bg, &ec2.DescribeSubnetsInput{Filters: tc.filters})
		wantCode(t, err, tc.code)
		if err != nil {
			continue
		}
		var got []string
		for _, sn := range out.Subnets {
			got = append(got, *sn.SubnetId)
		}
		sort.Strings(got)
		want := append([]string(nil), tc.want...)
		sort.Strings(want)
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("filters %v: got %v, want %v", tc.filters, got, want)
		}
	}

	// By id, and an id that does not exist.
	out := must[*ec2.DescribeSubnetsOutput](t)(s.DescribeSubnets(bg, &ec2.DescribeSubnetsInput{SubnetIds: []string{db}}))
	if len(out.Subnets) != 1 || len(out.Subnets[0].Tags) != 1 {
		t.Fatalf("by id: %+v", out.Subnets)
	}
	_, err := s.DescribeSubnets(bg, &ec2.DescribeSubnetsInput{SubnetIds: []string{db, "subnet-0123456789abcdef0"}})
	wantCode(t, err, "InvalidSubnetID.NotFound")
	_, err = s.DescribeSubnets(bg, &ec2.DescribeSubnetsInput{SubnetIds: []string{"subnet-nope"}})
	wantCode(t, err, "InvalidSubnetID.Malformed")
}

func mustSubnetTagged(t *testing.T, s *Service, vpc, cidr string, kv ...string) string {
	t.Helper()
	out, err := s.CreateSubnet(bg, &ec2.CreateSubnetInput{VpcId: &vpc, CidrBlock: &cidr, TagSpecifications: tagSpec(types.ResourceTypeSubnet, kv...)})
	if err != nil {
		t.Fatal(err)
	}
	return *out.Subnet.SubnetId
}

func TestDescribeSubnetsPages(t *testing.T) {
	s := newSvc(t)
	vpc := mkVPC(t, s, "10.0.0.0/16")
	want := map[string]bool{}
	for i := range 12 {
		want[mkSubnet(t, s, vpc, fmt.Sprintf("10.0.%d.0/24", i))] = true
	}
	ids, pages := pageAll(t, func(tok *string) ([]string, *string, error) {
		out, err := s.DescribeSubnets(bg, &ec2.DescribeSubnetsInput{MaxResults: ptr(int32(5)), NextToken: tok, Filters: []types.Filter{filter("vpc-id", vpc)}})
		if err != nil {
			return nil, nil, err
		}
		if len(out.Subnets) > 5 {
			t.Fatalf("page of %d", len(out.Subnets))
		}
		var ids []string
		for _, sn := range out.Subnets {
			ids = append(ids, *sn.SubnetId)
		}
		return ids, out.NextToken, nil
	})
	if len(ids) != 12 || pages != 3 {
		t.Fatalf("%d subnets over %d pages", len(ids), pages)
	}
	for _, id := range ids {
		if !want[id] {
			t.Fatalf("unexpected %s", id)
		}
	}
	_, err := s.DescribeSubnets(bg, &ec2.DescribeSubnetsInput{MaxResults: ptr(int32(4))})
	wantCode(t, err, "InvalidParameterValue")
	_, err = s.DescribeSubnets(bg, &ec2.DescribeSubnetsInput{NextToken: ptr("garbage!")})
	wantCode(t, err, "InvalidParameterValue")
}

func TestDeleteSubnet(t *testing.T) {
	s := newSvc(t)
	vpc := mkVPC(t, s, "10.0.0.0/16")
	sn := mkSubnet(t, s, vpc, "10.0.1.0/24")
	rtb := mkRTB(t, s, vpc)
	must[*ec2.AssociateRouteTableOutput](t)(s.AssociateRouteTable(bg, &ec2.AssociateRouteTableInput{RouteTableId: &rtb, SubnetId: &sn}))

	_, err := s.DeleteVpc(bg, &ec2.DeleteVpcInput{VpcId: &vpc})
	wantCode(t, err, "DependencyViolation")

	must[*ec2.DeleteSubnetOutput](t)(s.DeleteSubnet(bg, &ec2.DeleteSubnetInput{SubnetId: &sn}))
	// Its association went with it, so the route table can go too.
	rt := must[*ec2.DescribeRouteTablesOutput](t)(s.DescribeRouteTables(bg, &ec2.DescribeRouteTablesInput{RouteTableIds: []string{rtb}}))
	if len(rt.RouteTables[0].Associations) != 0 {
		t.Fatalf("association survived the subnet: %+v", rt.RouteTables[0].Associations)
	}
	_, err = s.DeleteSubnet(bg, &ec2.DeleteSubnetInput{SubnetId: &sn})
	wantCode(t, err, "InvalidSubnetID.NotFound")
	_, err = s.DeleteSubnet(bg, &ec2.DeleteSubnetInput{SubnetId: ptr("subnet-1")})
	wantCode(t, err, "InvalidSubnetID.Malformed")

	// A new subnet never gets the deleted one's id back.
	again := mkSubnet(t, s, vpc, "10.0.1.0/24")
	if again == sn {
		t.Fatal("subnet id reused")
	}
}

func TestModifySubnetAttribute(t *testing.T) {
	s := newSvc(t)
	vpc := mkVPC(t, s, "10.0.0.0/16")
	sn := mkSubnet(t, s, vpc, "10.0.1.0/24")
	on := &types.AttributeBooleanValue{Value: ptr(true)}
	for _, tc := range []struct {
		name string
		in   ec2.ModifySubnetAttributeInput
		code string
	}{
		{name: "public IPs on launch", in: ec2.ModifySubnetAttributeInput{SubnetId: &sn, MapPublicIpOnLaunch: on}},
		{name: "hostname type", in: ec2.ModifySubnetAttributeInput{SubnetId: &sn, PrivateDnsHostnameTypeOnLaunch: types.HostnameTypeResourceName}},
		{name: "A records", in: ec2.ModifySubnetAttributeInput{SubnetId: &sn, EnableResourceNameDnsARecordOnLaunch: on}},
		{name: "two at once", in: ec2.ModifySubnetAttributeInput{SubnetId: &sn, MapPublicIpOnLaunch: on, EnableDns64: on}, code: "InvalidParameterCombination"},
		{name: "none", in: ec2.ModifySubnetAttributeInput{SubnetId: &sn}, code: "MissingParameter"},
		{name: "IPv6 on a subnet without IPv6", in: ec2.ModifySubnetAttributeInput{SubnetId: &sn, AssignIpv6AddressOnCreation: on}, code: "InvalidParameterValue"},
		{name: "a subnet that does not exist", in: ec2.ModifySubnetAttributeInput{SubnetId: ptr("subnet-0123456789abcdef0"), MapPublicIpOnLaunch: on}, code: "InvalidSubnetID.NotFound"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := snapshot(t, s)
			_, err := s.ModifySubnetAttribute(bg, &tc.in)
			wantCode(t, err, tc.code)
			if err != nil {
				sameState(t, before, snapshot(t, s), "a failed ModifySubnetAttribute")
			}
		})
	}
	out := must[*ec2.DescribeSubnetsOutput](t)(s.DescribeSubnets(bg, &ec2.DescribeSubnetsInput{Filters: []types.Filter{filter("map-public-ip-on-launch", "true"), filter("vpc-id", vpc)}}))
	if len(out.Subnets) != 1 {
		t.Fatalf("map-public-ip-on-launch did not stick: %+v", out.Subnets)
	}
	o := out.Subnets[0].PrivateDnsNameOptionsOnLaunch
	if o.HostnameType != types.HostnameTypeResourceName || !*o.EnableResourceNameDnsARecord {
		t.Fatalf("dns options = %+v", o)
	}
}
