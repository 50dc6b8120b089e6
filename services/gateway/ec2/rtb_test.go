package ec2

import (
	"fmt"
	"sort"
	"testing"

	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"

	"hangar.dev/hangar/services/gateway/awsmodel"
	"hangar.dev/hangar/services/gateway/server"
)

func describeRTB(t *testing.T, s *Service, id string) types.RouteTable {
	t.Helper()
	out, err := s.DescribeRouteTables(bg, &ec2.DescribeRouteTablesInput{RouteTableIds: []string{id}})
	if err != nil {
		t.Fatal(err)
	}
	encodes(t, "DescribeRouteTables", out)
	return out.RouteTables[0]
}

func routeTo(rt types.RouteTable, dest string) *types.Route {
	for i := range rt.Routes {
		if deref(rt.Routes[i].DestinationCidrBlock) == dest {
			return &rt.Routes[i]
		}
	}
	return nil
}

func TestInternetGateways(t *testing.T) {
	s := newSvc(t)
	vpc := mkVPC(t, s, "10.0.0.0/16")
	other := mkVPC(t, s, "10.1.0.0/16")
	out := must[*ec2.CreateInternetGatewayOutput](t)(s.CreateInternetGateway(bg, &ec2.CreateInternetGatewayInput{TagSpecifications: tagSpec(types.ResourceTypeInternetGateway, "Name", "gw")}))
	encodes(t, "CreateInternetGateway", out)
	igw := *out.InternetGateway.InternetGatewayId
	if len(out.InternetGateway.Attachments) != 0 || len(out.InternetGateway.Tags) != 1 || *out.InternetGateway.OwnerId != testAccount {
		t.Fatalf("new gateway = %+v", out.InternetGateway)
	}
	spare := mkIGW(t, s)

	steps := []struct {
		name string
		call func() error
		code string
	}{
		{"detach before attach", func() error {
			_, err := s.DetachInternetGateway(bg, &ec2.DetachInternetGatewayInput{InternetGatewayId: &igw, VpcId: &vpc})
			return err
		}, "Gateway.NotAttached"},
		{"attach to a VPC that does not exist", func() error {
			_, err := s.AttachInternetGateway(bg, &ec2.AttachInternetGatewayInput{InternetGatewayId: &igw, VpcId: ptr("vpc-0123456789abcdef0")})
			return err
		}, "InvalidVpcID.NotFound"},
		{"attach a gateway that does not exist", func() error {
			_, err := s.AttachInternetGateway(bg, &ec2.AttachInternetGatewayInput{InternetGatewayId: ptr("igw-0123456789abcdef0"), VpcId: &vpc})
			return err
		}, "InvalidInternetGatewayID.NotFound"},
		{"attach a malformed id", func() error {
			_, err := s.AttachInternetGateway(bg, &ec2.AttachInternetGatewayInput{InternetGatewayId: ptr("igw-x"), VpcId: &vpc})
			return err
		}, "InvalidInternetGatewayID.Malformed"},
		{"attach", func() error {
			_, err := s.AttachInternetGateway(bg, &ec2.AttachInternetGatewayInput{InternetGatewayId: &igw, VpcId: &vpc})
			return err
		}, ""},
		{"attach again", func() error {
			_, err := s.AttachInternetGateway(bg, &ec2.AttachInternetGatewayInput{InternetGatewayId: &igw, VpcId: &vpc})
			return err
		}, "Resource.AlreadyAssociated"},
		{"attach to a second VPC", func() error {
			_, err := s.AttachInternetGateway(bg, &ec2.AttachInternetGatewayInput{InternetGatewayId: &igw, VpcId: &other})
			return err
		}, "Resource.AlreadyAssociated"},
		{"a second gateway on the VPC", func() error {
			_, err := s.AttachInternetGateway(bg, &ec2.AttachInternetGatewayInput{InternetGatewayId: &spare, VpcId: &vpc})
			return err
		}, "Resource.AlreadyAssociated"},
		{"delete while attached", func() error {
			_, err := s.DeleteInternetGateway(bg, &ec2.DeleteInternetGatewayInput{InternetGatewayId: &igw})
			return err
		}, "DependencyViolation"},
		{"detach from the wrong VPC", func() error {
			_, err := s.DetachInternetGateway(bg, &ec2.DetachInternetGatewayInput{InternetGatewayId: &igw, VpcId: &other})
			return err
		}, "Gateway.NotAttached"},
	}
	for _, st := range steps {
		before := snapshot(t, s)
		err := st.call()
		if code(err) != st.code {
			t.Fatalf("%s: %v, want %q", st.name, err, st.code)
		}
		if err != nil {
			sameState(t, before, snapshot(t, s), st.name)
		}
	}
	for _, tc := range []struct {
		filters []types.Filter
		want    []string
	}{
		{[]types.Filter{filter("attachment.vpc-id", vpc)}, []string{igw}},
		{[]types.Filter{filter("attachment.state", "available"), filter("internet-gateway-id", igw, spare)}, []string{igw}},
		{[]types.Filter{filter("tag:Name", "gw")}, []string{igw}},
		{[]types.Filter{filter("owner-id", testAccount), filter("internet-gateway-id", spare)}, []string{spare}},
	} {
		out := must[*ec2.DescribeInternetGatewaysOutput](t)(s.DescribeInternetGateways(bg, &ec2.DescribeInternetGatewaysInput{Filters: tc.filters}))
		encodes(t, "DescribeInternetGateways", out)
		var got []string
		for _, g := range out.InternetGateways {
			got = append(got, *g.InternetGatewayId)
		}
		if fmt.Sprint(got) != fmt.Sprint(tc.want) {
			t.Errorf("filters %v: %v, want %v", tc.filters, got, tc.want)
		}
	}

	// A route to the gateway is a blackhole while it is detached.
	rtb := mkRTB(t, s, vpc)
	must[*ec2.CreateRouteOutput](t)(s.CreateRoute(bg, &ec2.CreateRouteInput{RouteTableId: &rtb, DestinationCidrBlock: ptr("0.0.0.0/0"), GatewayId: &igw}))
	_, err := s.DeleteVpc(bg, &ec2.DeleteVpcInput{VpcId: &vpc})
	wantCode(t, err, "DependencyViolation")
	must[*ec2.DetachInternetGatewayOutput](t)(s.DetachInternetGateway(bg, &ec2.DetachInternetGatewayInput{InternetGatewayId: &igw, VpcId: &vpc}))
	if r := routeTo(describeRTB(t, s, rtb), "0.0.0.0/0"); r.State != types.RouteStateBlackhole {
		t.Fatalf("route after detach = %+v", r)
	}
	bh := must[*ec2.DescribeRouteTablesOutput](t)(s.DescribeRouteTables(bg, &ec2.DescribeRouteTablesInput{Filters: []types.Filter{filter("route.state", "blackhole")}}))
	if len(bh.RouteTables) != 1 {
		t.Fatalf("route.state=blackhole: %d tables", len(bh.RouteTables))
	}
	must[*ec2.AttachInternetGatewayOutput](t)(s.AttachInternetGateway(bg, &ec2.AttachInternetGatewayInput{InternetGatewayId: &igw, VpcId: &vpc}))
	if r := routeTo(describeRTB(t, s, rtb), "0.0.0.0/0"); r.State != types.RouteStateActive {
		t.Fatalf("route after reattach = %+v", r)
	}
	must[*ec2.DetachInternetGatewayOutput](t)(s.DetachInternetGateway(bg, &ec2.DetachInternetGatewayInput{InternetGatewayId: &igw, VpcId: &vpc}))
	must[*ec2.DeleteInternetGatewayOutput](t)(s.DeleteInternetGateway(bg, &ec2.DeleteInternetGatewayInput{InternetGatewayId: &igw}))
	_, err = s.DeleteInternetGateway(bg, &ec2.DeleteInternetGatewayInput{InternetGatewayId: &igw})
	wantCode(t, err, "InvalidInternetGatewayID.NotFound")

	ids, pages := pageAll(t, func(tok *string) ([]string, *string, error) {
		out, err := s.DescribeInternetGateways(bg, &ec2.DescribeInternetGatewaysInput{MaxResults: ptr(int32(5)), NextToken: tok})
		if err != nil {
			return nil, nil, err
		}
		var ids []string
		for _, g := range out.InternetGateways {
			ids = append(ids, *g.InternetGatewayId)
		}
		return ids, out.NextToken, nil
	})
	if len(ids) != 2 || pages != 1 { // the default VPC's and the spare
		t.Fatalf("%v over %d pages", ids, pages)
	}
}

func TestRoutes(t *testing.T) {
	s := newSvc(t)
	vpc := mkVPC(t, s, "10.0.0.0/16")
	other := mkVPC(t, s, "10.1.0.0/16")
	igw := mkIGW(t, s)
	foreign := mkIGW(t, s)
	must[*ec2.AttachInternetGatewayOutput](t)(s.AttachInternetGateway(bg, &ec2.AttachInternetGatewayInput{InternetGatewayId: &igw, VpcId: &vpc}))
	must[*ec2.AttachInternetGatewayOutput](t)(s.AttachInternetGateway(bg, &ec2.AttachInternetGatewayInput{InternetGatewayId: &foreign, VpcId: &other}))
	created := must[*ec2.CreateRouteTableOutput](t)(s.CreateRouteTable(bg, &ec2.CreateRouteTableInput{VpcId: &vpc, TagSpecifications: tagSpec(types.ResourceTypeRouteTable, "Name", "public")}))
	encodes(t, "CreateRouteTable", created)
	rtb := *created.RouteTable.RouteTableId
	if rt := created.RouteTable; len(rt.Routes) != 1 || *rt.Routes[0].GatewayId != "local" || *rt.Routes[0].DestinationCidrBlock != "10.0.0.0/16" || len(rt.Associations) != 0 || len(rt.Tags) != 1 {
		t.Fatalf("new route table = %+v", rt)
	}
	for _, tc := range []struct {
		name string
		in   ec2.CreateRouteInput
		code string
	}{
		{"a default route", ec2.CreateRouteInput{RouteTableId: &rtb, DestinationCidrBlock: ptr("0.0.0.0/0"), GatewayId: &igw}, ""},
		{"a narrower route", ec2.CreateRouteInput{RouteTableId: &rtb, DestinationCidrBlock: ptr("192.0.2.0/24"), GatewayId: &igw}, ""},
		{"the same destination", ec2.CreateRouteInput{RouteTableId: &rtb, DestinationCidrBlock: ptr("0.0.0.0/0"), GatewayId: &igw}, "RouteAlreadyExists"},
		{"inside the VPC", ec2.CreateRouteInput{RouteTableId: &rtb, DestinationCidrBlock: ptr("10.0.5.0/24"), GatewayId: &igw}, "InvalidParameterValue"},
		{"a gateway of another VPC", ec2.CreateRouteInput{RouteTableId: &rtb, DestinationCidrBlock: ptr("198.51.100.0/24"), GatewayId: &foreign}, "InvalidParameterValue"},
		{"a gateway that does not exist", ec2.CreateRouteInput{RouteTableId: &rtb, DestinationCidrBlock: ptr("198.51.100.0/24"), GatewayId: ptr("igw-0123456789abcdef0")}, "InvalidInternetGatewayID.NotFound"},
		{"an unknown gateway kind", ec2.CreateRouteInput{RouteTableId: &rtb, DestinationCidrBlock: ptr("198.51.100.0/24"), GatewayId: ptr("gw-1")}, "InvalidGatewayID.NotFound"},
		{"a bad CIDR", ec2.CreateRouteInput{RouteTableId: &rtb, DestinationCidrBlock: ptr("198.51.100.7/24"), GatewayId: &igw}, "InvalidParameterValue"},
		{"no destination", ec2.CreateRouteInput{RouteTableId: &rtb, GatewayId: &igw}, "MissingParameter"},
		{"no target", ec2.CreateRouteInput{RouteTableId: &rtb, DestinationCidrBlock: ptr("198.51.100.0/24")}, "MissingParameter"},
		{"two targets", ec2.CreateRouteInput{RouteTableId: &rtb, DestinationCidrBlock: ptr("198.51.100.0/24"), GatewayId: &igw, NatGatewayId: ptr("nat-0123456789abcdef0")}, "InvalidParameterCombination"},
		{"a NAT gateway", ec2.CreateRouteInput{RouteTableId: &rtb, DestinationCidrBlock: ptr("198.51.100.0/24"), NatGatewayId: ptr("nat-0123456789abcdef0")}, "UnsupportedOperation"},
		{"a route table that does not exist", ec2.CreateRouteInput{RouteTableId: ptr("rtb-0123456789abcdef0"), DestinationCidrBlock: ptr("198.51.100.0/24"), GatewayId: &igw}, "InvalidRouteTableID.NotFound"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := snapshot(t, s)
			out, err := s.CreateRoute(bg, &tc.in)
			wantCode(t, err, tc.code)
			if err != nil {
				sameState(t, before, snapshot(t, s), "a failed CreateRoute")
				return
			}
			if !*out.Return {
				t.Fatal("Return false")
			}
			if r := routeTo(describeRTB(t, s, rtb), *tc.in.DestinationCidrBlock); r == nil || *r.GatewayId != igw || r.State != types.RouteStateActive || r.Origin != types.RouteOriginCreateRoute {
				t.Fatalf("route = %+v", r)
			}
		})
	}

	// Replace and delete.
	second := mkIGW(t, s)
	_, err := s.ReplaceRoute(bg, &ec2.ReplaceRouteInput{RouteTableId: &rtb, DestinationCidrBlock: ptr("203.0.113.0/24"), GatewayId: &igw})
	wantCode(t, err, "InvalidRoute.NotFound")
	_, err = s.ReplaceRoute(bg, &ec2.ReplaceRouteInput{RouteTableId: &rtb, DestinationCidrBlock: ptr("192.0.2.0/24"), GatewayId: &second})
	wantCode(t, err, "InvalidParameterValue") // not attached to this VPC
	_, err = s.ReplaceRoute(bg, &ec2.ReplaceRouteInput{RouteTableId: &rtb, DestinationCidrBlock: ptr("10.0.0.0/16"), GatewayId: &igw})
	wantCode(t, err, "InvalidParameterValue") // the local route
	must[*ec2.DeleteRouteOutput](t)(s.DeleteRoute(bg, &ec2.DeleteRouteInput{RouteTableId: &rtb, DestinationCidrBlock: ptr("192.0.2.0/24")}))
	_, err = s.DeleteRoute(bg, &ec2.DeleteRouteInput{RouteTableId: &rtb, DestinationCidrBlock: ptr("192.0.2.0/24")})
	wantCode(t, err, "InvalidRoute.NotFound")
	_, err = s.DeleteRoute(bg, &ec2.DeleteRouteInput{RouteTableId: &rtb, DestinationCidrBlock: ptr("10.0.0.0/16")})
	wantCode(t, err, "InvalidParameterValue")
	must[*ec2.ReplaceRouteOutput](t)(s.ReplaceRoute(bg, &ec2.ReplaceRouteInput{RouteTableId: &rtb, DestinationCidrBlock: ptr("0.0.0.0/0"), GatewayId: &igw}))
	rt := describeRTB(t, s, rtb)
	if len(rt.Routes) != 2 || *routeTo(rt, "0.0.0.0/0").GatewayId != igw {
		t.Fatalf("routes = %+v", rt.Routes)
	}
}

func TestRouteTableAssociations(t *testing.T) {
	s := newSvc(t)
	vpc := mkVPC(t, s, "10.0.0.0/16")
	other := mkVPC(t, s, "10.1.0.0/16")
	sn := mkSubnet(t, s, vpc, "10.0.1.0/24")
	sn2 := mkSubnet(t, s, vpc, "10.0.2.0/24")
	foreignSubnet := mkSubnet(t, s, other, "10.1.1.0/24")
	a := mkRTB(t, s, vpc)
	b := mkRTB(t, s, vpc)

	assoc := must[*ec2.AssociateRouteTableOutput](t)(s.AssociateRouteTable(bg, &ec2.AssociateRouteTableInput{RouteTableId: &a, SubnetId: &sn}))
	encodes(t, "AssociateRouteTable", assoc)
	if assoc.AssociationState.State != types.RouteTableAssociationStateCodeAssociated {
		t.Fatalf("association = %+v", assoc)
	}
	for _, tc := range []struct {
		name string
		in   ec2.AssociateRouteTableInput
		code string
	}{
		{"a subnet that has one", ec2.AssociateRouteTableInput{RouteTableId: &b, SubnetId: &sn}, "Resource.AlreadyAssociated"},
		{"the same again", ec2.AssociateRouteTableInput{RouteTableId: &a, SubnetId: &sn}, "Resource.AlreadyAssociated"},
		{"a subnet of another VPC", ec2.AssociateRouteTableInput{RouteTableId: &a, SubnetId: &foreignSubnet}, "InvalidParameterValue"},
		{"a subnet that does not exist", ec2.AssociateRouteTableInput{RouteTableId: &a, SubnetId: ptr("subnet-0123456789abcdef0")}, "InvalidSubnetID.NotFound"},
		{"no subnet", ec2.AssociateRouteTableInput{RouteTableId: &a}, "MissingParameter"},
		{"a gateway", ec2.AssociateRouteTableInput{RouteTableId: &a, GatewayId: ptr("igw-0123456789abcdef0")}, "UnsupportedOperation"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := snapshot(t, s)
			_, err := s.AssociateRouteTable(bg, &tc.in)
			wantCode(t, err, tc.code)
			sameState(t, before, snapshot(t, s), "a failed AssociateRouteTable")
		})
	}
	// An associated table cannot go; neither can the main table.
	_, err := s.DeleteRouteTable(bg, &ec2.DeleteRouteTableInput{RouteTableId: &a})
	wantCode(t, err, "DependencyViolation")
	main := must[*ec2.DescribeRouteTablesOutput](t)(s.DescribeRouteTables(bg, &ec2.DescribeRouteTablesInput{Filters: []types.Filter{filter("vpc-id", vpc), filter("association.main", "true")}}))
	mainID := *main.RouteTables[0].RouteTableId
	mainAssoc := *main.RouteTables[0].Associations[0].RouteTableAssociationId
	_, err = s.DeleteRouteTable(bg, &ec2.DeleteRouteTableInput{RouteTableId: &mainID})
	wantCode(t, err, "DependencyViolation")
	_, err = s.DisassociateRouteTable(bg, &ec2.DisassociateRouteTableInput{AssociationId: &mainAssoc})
	wantCode(t, err, "InvalidParameterValue")
	_, err = s.DisassociateRouteTable(bg, &ec2.DisassociateRouteTableInput{AssociationId: ptr("rtbassoc-0123456789abcdef0")})
	wantCode(t, err, "InvalidAssociationID.NotFound")

	// Filters.
	for _, tc := range []struct {
		filters []types.Filter
		want    []string
	}{
		{[]types.Filter{filter("association.subnet-id", sn)}, []string{a}},
		{[]types.Filter{filter("vpc-id", vpc), filter("association.main", "false")}, []string{a}},
		{[]types.Filter{filter("vpc-id", vpc), filter("association.main", "true")}, []string{mainID}},
		{[]types.Filter{filter("association.route-table-association-id", *assoc.AssociationId)}, []string{a}},
		{[]types.Filter{filter("vpc-id", vpc), filter("route.destination-cidr-block", "10.0.0.0/16")}, []string{a, b, mainID}},
		{[]types.Filter{filter("vpc-id", vpc), filter("route.gateway-id", "local"), filter("route.origin", "CreateRouteTable")}, []string{a, b, mainID}},
		{[]types.Filter{filter("route-table-id", b)}, []string{b}},
	} {
		out := must[*ec2.DescribeRouteTablesOutput](t)(s.DescribeRouteTables(bg, &ec2.DescribeRouteTablesInput{Filters: tc.filters}))
		var got []string
		for _, rt := range out.RouteTables {
			got = append(got, *rt.RouteTableId)
		}
		sort.Strings(got)
		want := append([]string{}, tc.want...)
		sort.Strings(want)
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("filters %v: %v, want %v", tc.filters, got, want)
		}
	}

	// Move the subnet to b: a new association id, and a is free to go.
	rep := must[*ec2.ReplaceRouteTableAssociationOutput](t)(s.ReplaceRouteTableAssociation(bg, &ec2.ReplaceRouteTableAssociationInput{AssociationId: assoc.AssociationId, RouteTableId: &b}))
	if *rep.NewAssociationId == *assoc.AssociationId {
		t.Fatal("ReplaceRouteTableAssociation kept the association id")
	}
	if got := describeRTB(t, s, b).Associations; len(got) != 1 || *got[0].SubnetId != sn {
		t.Fatalf("b associations = %+v", got)
	}
	must[*ec2.DeleteRouteTableOutput](t)(s.DeleteRouteTable(bg, &ec2.DeleteRouteTableInput{RouteTableId: &a}))
	_, err = s.ReplaceRouteTableAssociation(bg, &ec2.ReplaceRouteTableAssociationInput{AssociationId: assoc.AssociationId, RouteTableId: &b})
	wantCode(t, err, "InvalidAssociationID.NotFound")

	// Make b the main table: the VPC's main table is b from now on.
	mainRep := must[*ec2.ReplaceRouteTableAssociationOutput](t)(s.ReplaceRouteTableAssociation(bg, &ec2.ReplaceRouteTableAssociationInput{AssociationId: &mainAssoc, RouteTableId: &b}))
	nowMain := must[*ec2.DescribeRouteTablesOutput](t)(s.DescribeRouteTables(bg, &ec2.DescribeRouteTablesInput{Filters: []types.Filter{filter("vpc-id", vpc), filter("association.main", "true")}}))
	if len(nowMain.RouteTables) != 1 || *nowMain.RouteTables[0].RouteTableId != b {
		t.Fatalf("main after replace: %+v", nowMain.RouteTables)
	}
	// The old main table is an ordinary table now, and can be deleted.
	must[*ec2.DeleteRouteTableOutput](t)(s.DeleteRouteTable(bg, &ec2.DeleteRouteTableInput{RouteTableId: &mainID}))

	// Disassociate the subnet; then tear the VPC down.
	var subnetAssoc string
	for _, as := range describeRTB(t, s, b).Associations {
		if deref(as.SubnetId) == sn {
			subnetAssoc = *as.RouteTableAssociationId
		}
	}
	must[*ec2.DisassociateRouteTableOutput](t)(s.DisassociateRouteTable(bg, &ec2.DisassociateRouteTableInput{AssociationId: &subnetAssoc}))
	_ = mainRep
	for _, id := range []string{sn, sn2} {
		must[*ec2.DeleteSubnetOutput](t)(s.DeleteSubnet(bg, &ec2.DeleteSubnetInput{SubnetId: &id}))
	}
	must[*ec2.DeleteVpcOutput](t)(s.DeleteVpc(bg, &ec2.DeleteVpcInput{VpcId: &vpc}))
	_, err = s.DescribeRouteTables(bg, &ec2.DescribeRouteTablesInput{RouteTableIds: []string{b}})
	wantCode(t, err, "InvalidRouteTableID.NotFound")
}

// TestDeleteVpcDependencies checks each kind of dependent stops DeleteVpc,
// and that removing them in turn lets it through.
func TestDeleteVpcDependencies(t *testing.T) {
	s := newSvc(t)
	vpc := mkVPC(t, s, "10.0.0.0/16")
	sn := mkSubnet(t, s, vpc, "10.0.1.0/24")
	sg := mkSG(t, s, vpc, "app")
	igw := mkIGW(t, s)
	must[*ec2.AttachInternetGatewayOutput](t)(s.AttachInternetGateway(bg, &ec2.AttachInternetGatewayInput{InternetGatewayId: &igw, VpcId: &vpc}))
	rtb := mkRTB(t, s, vpc)

	teardown := []struct {
		name string
		do   func()
	}{
		{"subnet", func() { must[*ec2.DeleteSubnetOutput](t)(s.DeleteSubnet(bg, &ec2.DeleteSubnetInput{SubnetId: &sn})) }},
		{"security group", func() {
			must[*ec2.DeleteSecurityGroupOutput](t)(s.DeleteSecurityGroup(bg, &ec2.DeleteSecurityGroupInput{GroupId: &sg}))
		}},
		{"internet gateway", func() {
			must[*ec2.DetachInternetGatewayOutput](t)(s.DetachInternetGateway(bg, &ec2.DetachInternetGatewayInput{InternetGatewayId: &igw, VpcId: &vpc}))
		}},
		{"route table", func() {
			must[*ec2.DeleteRouteTableOutput](t)(s.DeleteRouteTable(bg, &ec2.DeleteRouteTableInput{RouteTableId: &rtb}))
		}},
	}
	for _, step := range teardown {
		before := snapshot(t, s)
		_, err := s.DeleteVpc(bg, &ec2.DeleteVpcInput{VpcId: &vpc})
		wantCode(t, err, "DependencyViolation")
		sameState(t, before, snapshot(t, s), "DeleteVpc with a "+step.name)
		step.do()
	}
	must[*ec2.DeleteVpcOutput](t)(s.DeleteVpc(bg, &ec2.DeleteVpcInput{VpcId: &vpc}))
	// The VPC's main route table and default group went with it.
	out := must[*ec2.DescribeRouteTablesOutput](t)(s.DescribeRouteTables(bg, &ec2.DescribeRouteTablesInput{Filters: []types.Filter{filter("vpc-id", vpc)}}))
	groups := must[*ec2.DescribeSecurityGroupsOutput](t)(s.DescribeSecurityGroups(bg, &ec2.DescribeSecurityGroupsInput{Filters: []types.Filter{filter("vpc-id", vpc)}}))
	if len(out.RouteTables) != 0 || len(groups.SecurityGroups) != 0 {
		t.Fatalf("left behind: %d route tables, %d groups", len(out.RouteTables), len(groups.SecurityGroups))
	}
	// The detached gateway outlives the VPC.
	must[*ec2.DeleteInternetGatewayOutput](t)(s.DeleteInternetGateway(bg, &ec2.DeleteInternetGatewayInput{InternetGatewayId: &igw}))
}

// TestCreateRouteTableClientToken drives CreateRouteTable through the
// Idempotency middleware, as the server does: a retry with the same token
// gets the first table; the same token with other parameters is refused.
func TestCreateRouteTableClientToken(t *testing.T) {
	s := newSvc(t)
	vpc := mkVPC(t, s, "10.0.0.0/16")
	other := mkVPC(t, s, "10.1.0.0/16")
	h := server.HandlersOf(s, awsmodel.MustLoad("ec2"))["CreateRouteTable"]
	call := func(in *ec2.CreateRouteTableInput) (*ec2.CreateRouteTableOutput, error) {
		out, err := s.Idempotency(bg, h, in, h.Call)
		if err != nil {
			return nil, err
		}
		return out.(*ec2.CreateRouteTableOutput), nil
	}
	first := must[*ec2.CreateRouteTableOutput](t)(call(&ec2.CreateRouteTableInput{VpcId: &vpc, ClientToken: ptr("tok-1")}))
	again := must[*ec2.CreateRouteTableOutput](t)(call(&ec2.CreateRouteTableInput{VpcId: &vpc, ClientToken: ptr("tok-1")}))
	if *first.RouteTable.RouteTableId != *again.RouteTable.RouteTableId || *again.ClientToken != "tok-1" {
		t.Fatalf("replay made %s, first %s", *again.RouteTable.RouteTableId, *first.RouteTable.RouteTableId)
	}
	before := snapshot(t, s)
	_, err := call(&ec2.CreateRouteTableInput{VpcId: &other, ClientToken: ptr("tok-1")})
	wantCode(t, err, "IdempotentParameterMismatch")
	sameState(t, before, snapshot(t, s), "a mismatched client token")
	tables := must[*ec2.DescribeRouteTablesOutput](t)(s.DescribeRouteTables(bg, &ec2.DescribeRouteTablesInput{Filters: []types.Filter{filter("vpc-id", vpc)}}))
	if len(tables.RouteTables) != 2 { // main + one
		t.Fatalf("%d route tables after a replay", len(tables.RouteTables))
	}
	third := must[*ec2.CreateRouteTableOutput](t)(call(&ec2.CreateRouteTableInput{VpcId: &vpc, ClientToken: ptr("tok-2")}))
	if *third.RouteTable.RouteTableId == *first.RouteTable.RouteTableId {
		t.Fatal("a new token replayed the old table")
	}
}
