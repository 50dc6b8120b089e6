package ec2

import (
	"context"
	"net/netip"
	"strings"

	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"

	"hangar.dev/hangar/services/gateway/awserr"
	"hangar.dev/hangar/services/internal/awsid"
	"hangar.dev/hangar/services/internal/store"
)

var kindRouteTable = register(&kind{Prefix: "rtb", ResourceType: types.ResourceTypeRouteTable, NotFound: "InvalidRouteTableID.NotFound", Malformed: "InvalidRouteTableID.Malformed", Noun: "routeTable ID"})

// routeTableRecord is a route table as stored. Routes and associations are
// kept in the SDK's shapes; the main association's id is AWS-shaped too.
// A route's State is kept current by Attach/DetachInternetGateway, so what
// is stored is what DescribeRouteTables shows and filters on.
type routeTableRecord struct {
	types.RouteTable
}

func (rt *routeTableRecord) view(tags []types.Tag) types.RouteTable {
	out := rt.RouteTable
	out.Routes = append([]types.Route{}, rt.Routes...)
	out.Associations = append([]types.RouteTableAssociation{}, rt.Associations...)
	if out.PropagatingVgws == nil {
		out.PropagatingVgws = []types.PropagatingVgw{}
	}
	out.Tags = tags
	return out
}

// isMain reports whether rt is its VPC's main route table.
func (rt *routeTableRecord) isMain() bool {
	for _, a := range rt.Associations {
		if deref(a.Main) {
			return true
		}
	}
	return false
}

// route returns the index of the route to dest, or -1.
func (rt *routeTableRecord) route(dest string) int {
	for i, r := range rt.Routes {
		if deref(r.DestinationCidrBlock) == dest {
			return i
		}
	}
	return -1
}

// createRouteTable makes a route table in v with the local route; main
// marks the VPC's main route table, which subnets without an explicit
// association use.
func (s *Service) createRouteTable(tx *store.Tx, v *vpcRecord, main bool) (*routeTableRecord, error) {
	id, err := newID(tx, kindRouteTable.Prefix)
	if err != nil {
		return nil, err
	}
	rt := &routeTableRecord{RouteTable: types.RouteTable{
		RouteTableId: ptr(id),
		VpcId:        v.VpcId,
		OwnerId:      ptr(s.account()),
		Routes: []types.Route{{
			DestinationCidrBlock: v.CidrBlock,
			GatewayId:            ptr("local"),
			Origin:               types.RouteOriginCreateRouteTable,
			State:                types.RouteStateActive,
		}},
		Associations:    []types.RouteTableAssociation{},
		PropagatingVgws: []types.PropagatingVgw{},
	}}
	if main {
		assoc, err := newID(tx, "rtbassoc")
		if err != nil {
			return nil, err
		}
		rt.Associations = append(rt.Associations, types.RouteTableAssociation{
			Main:                    ptr(true),
			RouteTableAssociationId: ptr(assoc),
			RouteTableId:            ptr(id),
			AssociationState:        &types.RouteTableAssociationState{State: types.RouteTableAssociationStateCodeAssociated},
		})
	}
	if err := put(tx, kindRouteTable, id, rt); err != nil {
		return nil, err
	}
	return rt, nil
}

func init() {
	vpcDependents = append(vpcDependents, func(tx *store.Tx, v *vpcRecord) (string, error) {
		found := ""
		_, err := exists(tx, kindRouteTable, func(id string, rt *routeTableRecord) bool {
			if deref(rt.VpcId) == *v.VpcId && id != v.MainRouteTableID {
				found = id
				return true
			}
			return false
		})
		return found, err
	})
}

// setGatewayRouteState marks every route in vpcID's tables that targets
// gateway as state: active when the gateway is attached, blackhole when not.
func setGatewayRouteState(tx *store.Tx, vpcID, gateway string, state types.RouteState) error {
	tables, err := all(tx, kindRouteTable, func(_ string, rt *routeTableRecord) bool { return deref(rt.VpcId) == vpcID })
	if err != nil {
		return err
	}
	for id, rt := range tables {
		changed := false
		for i := range rt.Routes {
			if deref(rt.Routes[i].GatewayId) == gateway && rt.Routes[i].State != state {
				rt.Routes[i].State = state
				changed = true
			}
		}
		if changed {
			if err := put(tx, kindRouteTable, id, rt); err != nil {
				return err
			}
		}
	}
	return nil
}

// findAssociation finds the route table holding association id.
func findAssociation(tx *store.Tx, id string) (*routeTableRecord, int, error) {
	if !awsid.Valid("rtbassoc", id) {
		return nil, -1, awserr.New(400, "InvalidAssociationID.NotFound", "The association ID '%s' does not exist", clip(id))
	}
	var (
		found *routeTableRecord
		index = -1
	)
	err := tx.Each(kindRouteTable.Prefix, "", func(_ string, decode func(any) error) (bool, error) {
		var rt routeTableRecord
		if err := decode(&rt); err != nil {
			return false, err
		}
		for i, a := range rt.Associations {
			if deref(a.RouteTableAssociationId) == id {
				found, index = &rt, i
				return false, nil
			}
		}
		return true, nil
	})
	if err != nil {
		return nil, -1, err
	}
	if found == nil {
		return nil, -1, awserr.New(400, "InvalidAssociationID.NotFound", "The association ID '%s' does not exist", id)
	}
	return found, index, nil
}

// subnetAssociation returns the route table explicitly associated with a
// subnet, or nil.
func subnetAssociation(tx *store.Tx, subnetID string) (*routeTableRecord, error) {
	var found *routeTableRecord
	err := tx.Each(kindRouteTable.Prefix, "", func(_ string, decode func(any) error) (bool, error) {
		var rt routeTableRecord
		if err := decode(&rt); err != nil {
			return false, err
		}
		for _, a := range rt.Associations {
			if deref(a.SubnetId) == subnetID {
				found = &rt
				return false, nil
			}
		}
		return true, nil
	})
	return found, err
}

// dropSubnetAssociation removes a subnet's explicit association, if any.
func dropSubnetAssociation(tx *store.Tx, subnetID string) error {
	rt, err := subnetAssociation(tx, subnetID)
	if err != nil || rt == nil {
		return err
	}
	kept := rt.Associations[:0]
	for _, a := range rt.Associations {
		if deref(a.SubnetId) != subnetID {
			kept = append(kept, a)
		}
	}
	rt.Associations = kept
	return put(tx, kindRouteTable, *rt.RouteTableId, rt)
}

// CreateRouteTable creates a route table with the local route.
func (s *Service) CreateRouteTable(ctx context.Context, in *ec2.CreateRouteTableInput) (*ec2.CreateRouteTableOutput, error) {
	if in.VpcId == nil {
		return nil, awserr.MissingParameter("VpcId")
	}
	tags, err := tagSpecs(in.TagSpecifications, types.ResourceTypeRouteTable)
	if err != nil {
		return nil, err
	}
	var out types.RouteTable
	err = s.db.Update(func(tx *store.Tx) error {
		v, err := get[vpcRecord](tx, kindVPC, *in.VpcId)
		if err != nil {
			return err
		}
		rt, err := s.createRouteTable(tx, v, false)
		if err != nil {
			return err
		}
		if len(tags) > 0 {
			if err := addTags(tx, *rt.RouteTableId, tags); err != nil {
				return err
			}
		}
		out = rt.view(tagsOf(tx, *rt.RouteTableId))
		return nil
	})
	if err != nil {
		return nil, err
	}
	return &ec2.CreateRouteTableOutput{RouteTable: &out, ClientToken: in.ClientToken}, nil
}

// DeleteRouteTable deletes a route table that is neither main nor
// associated with a subnet.
func (s *Service) DeleteRouteTable(ctx context.Context, in *ec2.DeleteRouteTableInput) (*ec2.DeleteRouteTableOutput, error) {
	if in.RouteTableId == nil {
		return nil, awserr.MissingParameter("RouteTableId")
	}
	id := *in.RouteTableId
	err := s.db.Update(func(tx *store.Tx) error {
		rt, err := get[routeTableRecord](tx, kindRouteTable, id)
		if err != nil {
			return err
		}
		if len(rt.Associations) > 0 {
			return awserr.DependencyViolation("The routeTable '%s' has dependencies and cannot be deleted.", id)
		}
		return remove(tx, kindRouteTable, id)
	})
	if err != nil {
		return nil, err
	}
	return &ec2.DeleteRouteTableOutput{}, nil
}

// routeTarget is the one target a CreateRoute/ReplaceRoute names.
type routeTarget struct {
	param, id string
}

// oneTarget checks that exactly one target is given and that hangar can
// route to it: internet gateways today; NAT gateways, instances and network
// interfaces when those records exist.
func oneTarget(targets []routeTarget) (routeTarget, error) {
	var given []routeTarget
	for _, t := range targets {
		if t.id != "" {
			given = append(given, t)
		}
	}
	if len(given) == 0 {
		return routeTarget{}, awserr.MissingParameter("gatewayId, natGatewayId, networkInterfaceId, vpcPeeringConnectionId or instanceId")
	}
	if len(given) > 1 {
		return routeTarget{}, awserr.InvalidParameterCombination("The parameter %s cannot be used with the parameter %s", given[1].param, given[0].param)
	}
	if given[0].param != "gatewayId" {
		return routeTarget{}, awserr.UnsupportedOperation("Routes to a %s are not supported by hangar yet; route to an internet gateway (gatewayId)", given[0].param)
	}
	return given[0], nil
}

// routeTargets lists the target parameters of CreateRoute and ReplaceRoute.
func routeTargets(gw, nat, inst, eni, pcx, tgw, lgw, cagw, eigw, vpce, core *string) []routeTarget {
	return []routeTarget{
		{"gatewayId", deref(gw)}, {"natGatewayId", deref(nat)}, {"instanceId", deref(inst)},
		{"networkInterfaceId", deref(eni)}, {"vpcPeeringConnectionId", deref(pcx)}, {"transitGatewayId", deref(tgw)},
		{"localGatewayId", deref(lgw)}, {"carrierGatewayId", deref(cagw)}, {"egressOnlyInternetGatewayId", deref(eigw)},
		{"vpcEndpointId", deref(vpce)}, {"coreNetworkArn", deref(core)},
	}
}

// checkRoute validates a route's destination and target against the table
// and returns the route to store.
func checkRoute(tx *store.Tx, rt *routeTableRecord, destRaw *string, ipv6, prefixList *string, t routeTarget) (types.Route, error) {
	if ipv6 != nil || prefixList != nil {
		return types.Route{}, awserr.InvalidParameterValue("IPv6 and prefix-list route destinations are not supported by hangar; give DestinationCidrBlock")
	}
	if destRaw == nil {
		return types.Route{}, awserr.MissingParameter("destinationCidrBlock")
	}
	dest, err := parseCIDR4(*destRaw, "destinationCidrBlock")
	if err != nil {
		return types.Route{}, err
	}
	vpc, err := get[vpcRecord](tx, kindVPC, *rt.VpcId)
	if err != nil {
		return types.Route{}, err
	}
	vpcCIDR := netip.MustParsePrefix(*vpc.CidrBlock)
	if vpcCIDR.Bits() <= dest.Bits() && vpcCIDR.Contains(dest.Addr()) {
		return types.Route{}, awserr.InvalidParameterValue("The destination CIDR block %s is equal to or more specific than one of this VPC's CIDR blocks. This route can target only an interface or an instance.", dest)
	}
	id := t.id
	switch awsid.Prefix(id) {
	case "igw":
		igw, err := get[internetGatewayRecord](tx, kindInternetGateway, id)
		if err != nil {
			return types.Route{}, err
		}
		if igw.vpc() != *rt.VpcId {
			return types.Route{}, awserr.InvalidParameterValue("route table %s and network gateway %s belong to different networks", *rt.RouteTableId, id)
		}
	case "vgw":
		return types.Route{}, awserr.UnsupportedOperation("Virtual private gateways are not supported by hangar")
	default:
		if strings.EqualFold(id, "local") {
			return types.Route{}, awserr.InvalidParameterValue("The local route cannot be created or replaced; it is part of every route table")
		}
		return types.Route{}, awserr.New(400, "InvalidGatewayID.NotFound", "The gateway ID '%s' does not exist", clip(id))
	}
	return types.Route{
		DestinationCidrBlock: ptr(dest.String()),
		GatewayId:            ptr(id),
		Origin:               types.RouteOriginCreateRoute,
		State:                types.RouteStateActive,
	}, nil
}

// CreateRoute adds a route to a route table.
func (s *Service) CreateRoute(ctx context.Context, in *ec2.CreateRouteInput) (*ec2.CreateRouteOutput, error) {
	if in.RouteTableId == nil {
		return nil, awserr.MissingParameter("RouteTableId")
	}
	t, err := oneTarget(routeTargets(in.GatewayId, in.NatGatewayId, in.InstanceId, in.NetworkInterfaceId, in.VpcPeeringConnectionId,
		in.TransitGatewayId, in.LocalGatewayId, in.CarrierGatewayId, in.EgressOnlyInternetGatewayId, in.VpcEndpointId, in.CoreNetworkArn))
	if err != nil {
		return nil, err
	}
	err = s.db.Update(func(tx *store.Tx) error {
		rt, err := get[routeTableRecord](tx, kindRouteTable, *in.RouteTableId)
		if err != nil {
			return err
		}
		r, err := checkRoute(tx, rt, in.DestinationCidrBlock, in.DestinationIpv6CidrBlock, in.DestinationPrefixListId, t)
		if err != nil {
			return err
		}
		if rt.route(*r.DestinationCidrBlock) >= 0 {
			return awserr.New(400, "RouteAlreadyExists", "The route identified by %s already exists.", *r.DestinationCidrBlock)
		}
		rt.Routes = append(rt.Routes, r)
		return put(tx, kindRouteTable, *rt.RouteTableId, rt)
	})
	if err != nil {
		return nil, err
	}
	return &ec2.CreateRouteOutput{Return: ptr(true)}, nil
}

// ReplaceRoute points an existing route at another target.
func (s *Service) ReplaceRoute(ctx context.Context, in *ec2.ReplaceRouteInput) (*ec2.ReplaceRouteOutput, error) {
	if in.RouteTableId == nil {
		return nil, awserr.MissingParameter("RouteTableId")
	}
	if deref(in.LocalTarget) {
		return nil, awserr.InvalidParameterValue("The local route cannot be created or replaced; it is part of every route table")
	}
	t, err := oneTarget(routeTargets(in.GatewayId, in.NatGatewayId, in.InstanceId, in.NetworkInterfaceId, in.VpcPeeringConnectionId,
		in.TransitGatewayId, in.LocalGatewayId, in.CarrierGatewayId, in.EgressOnlyInternetGatewayId, in.VpcEndpointId, in.CoreNetworkArn))
	if err != nil {
		return nil, err
	}
	err = s.db.Update(func(tx *store.Tx) error {
		rt, err := get[routeTableRecord](tx, kindRouteTable, *in.RouteTableId)
		if err != nil {
			return err
		}
		if in.DestinationCidrBlock != nil {
			if i := rt.route(*in.DestinationCidrBlock); i >= 0 && deref(rt.Routes[i].GatewayId) == "local" {
				return awserr.InvalidParameterValue("cannot replace local route %s in route table %s", *in.DestinationCidrBlock, *in.RouteTableId)
			}
		}
		r, err := checkRoute(tx, rt, in.DestinationCidrBlock, in.DestinationIpv6CidrBlock, in.DestinationPrefixListId, t)
		if err != nil {
			return err
		}
		i := rt.route(*r.DestinationCidrBlock)
		if i < 0 {
			return awserr.New(400, "InvalidRoute.NotFound", "no route with destination-cidr-block %s in route table %s", *r.DestinationCidrBlock, *in.RouteTableId)
		}
		rt.Routes[i] = r
		return put(tx, kindRouteTable, *rt.RouteTableId, rt)
	})
	if err != nil {
		return nil, err
	}
	return &ec2.ReplaceRouteOutput{}, nil
}

// DeleteRoute removes a route; the local route stays.
func (s *Service) DeleteRoute(ctx context.Context, in *ec2.DeleteRouteInput) (*ec2.DeleteRouteOutput, error) {
	if in.RouteTableId == nil {
		return nil, awserr.MissingParameter("RouteTableId")
	}
	if in.DestinationIpv6CidrBlock != nil || in.DestinationPrefixListId != nil {
		return nil, awserr.InvalidParameterValue("IPv6 and prefix-list route destinations are not supported by hangar; give DestinationCidrBlock")
	}
	if in.DestinationCidrBlock == nil {
		return nil, awserr.MissingParameter("destinationCidrBlock")
	}
	dest, err := parseCIDR4(*in.DestinationCidrBlock, "destinationCidrBlock")
	if err != nil {
		return nil, err
	}
	err = s.db.Update(func(tx *store.Tx) error {
		rt, err := get[routeTableRecord](tx, kindRouteTable, *in.RouteTableId)
		if err != nil {
			return err
		}
		i := rt.route(dest.String())
		if i < 0 {
			return awserr.New(400, "InvalidRoute.NotFound", "no route with destination-cidr-block %s in route table %s", dest, *in.RouteTableId)
		}
		if deref(rt.Routes[i].GatewayId) == "local" {
			return awserr.InvalidParameterValue("cannot remove local route %s in route table %s", dest, *in.RouteTableId)
		}
		rt.Routes = append(rt.Routes[:i], rt.Routes[i+1:]...)
		return put(tx, kindRouteTable, *rt.RouteTableId, rt)
	})
	if err != nil {
		return nil, err
	}
	return &ec2.DeleteRouteOutput{}, nil
}

// AssociateRouteTable associates a subnet with a route table. A subnet has
// at most one explicit association; without one it uses the main table.
func (s *Service) AssociateRouteTable(ctx context.Context, in *ec2.AssociateRouteTableInput) (*ec2.AssociateRouteTableOutput, error) {
	if in.RouteTableId == nil {
		return nil, awserr.MissingParameter("RouteTableId")
	}
	if in.GatewayId != nil || in.PublicIpv4Pool != nil {
		return nil, awserr.UnsupportedOperation("Gateway (edge) route table associations are not supported by hangar; give SubnetId")
	}
	if in.SubnetId == nil {
		return nil, awserr.MissingParameter("SubnetId")
	}
	var assocID string
	err := s.db.Update(func(tx *store.Tx) error {
		rt, err := get[routeTableRecord](tx, kindRouteTable, *in.RouteTableId)
		if err != nil {
			return err
		}
		sn, err := get[subnetRecord](tx, kindSubnet, *in.SubnetId)
		if err != nil {
			return err
		}
		if deref(sn.VpcId) != deref(rt.VpcId) {
			return awserr.InvalidParameterValue("Route table %s and subnet %s belong to different networks", *in.RouteTableId, *in.SubnetId)
		}
		cur, err := subnetAssociation(tx, *in.SubnetId)
		if err != nil {
			return err
		}
		if cur != nil {
			return awserr.New(400, "Resource.AlreadyAssociated", "the specified association for route table %s conflicts with an existing association", *in.RouteTableId)
		}
		assocID, err = newID(tx, "rtbassoc")
		if err != nil {
			return err
		}
		rt.Associations = append(rt.Associations, types.RouteTableAssociation{
			Main:                    ptr(false),
			RouteTableAssociationId: ptr(assocID),
			RouteTableId:            rt.RouteTableId,
			SubnetId:                in.SubnetId,
			AssociationState:        &types.RouteTableAssociationState{State: types.RouteTableAssociationStateCodeAssociated},
		})
		return put(tx, kindRouteTable, *rt.RouteTableId, rt)
	})
	if err != nil {
		return nil, err
	}
	return &ec2.AssociateRouteTableOutput{
		AssociationId:    ptr(assocID),
		AssociationState: &types.RouteTableAssociationState{State: types.RouteTableAssociationStateCodeAssociated},
	}, nil
}

// DisassociateRouteTable removes a subnet's explicit association; the
// subnet falls back to the main table. The main association cannot go.
func (s *Service) DisassociateRouteTable(ctx context.Context, in *ec2.DisassociateRouteTableInput) (*ec2.DisassociateRouteTableOutput, error) {
	if in.AssociationId == nil {
		return nil, awserr.MissingParameter("AssociationId")
	}
	err := s.db.Update(func(tx *store.Tx) error {
		rt, i, err := findAssociation(tx, *in.AssociationId)
		if err != nil {
			return err
		}
		if deref(rt.Associations[i].Main) {
			return awserr.InvalidParameterValue("cannot disassociate the main route table association %s", *in.AssociationId)
		}
		rt.Associations = append(rt.Associations[:i], rt.Associations[i+1:]...)
		return put(tx, kindRouteTable, *rt.RouteTableId, rt)
	})
	if err != nil {
		return nil, err
	}
	return &ec2.DisassociateRouteTableOutput{}, nil
}

// ReplaceRouteTableAssociation moves an association to another route table
// in the same VPC. Replacing the main association makes the new table the
// VPC's main route table. The association gets a new id, as in AWS.
func (s *Service) ReplaceRouteTableAssociation(ctx context.Context, in *ec2.ReplaceRouteTableAssociationInput) (*ec2.ReplaceRouteTableAssociationOutput, error) {
	if in.AssociationId == nil {
		return nil, awserr.MissingParameter("AssociationId")
	}
	if in.RouteTableId == nil {
		return nil, awserr.MissingParameter("RouteTableId")
	}
	var newAssoc string
	err := s.db.Update(func(tx *store.Tx) error {
		from, i, err := findAssociation(tx, *in.AssociationId)
		if err != nil {
			return err
		}
		to, err := get[routeTableRecord](tx, kindRouteTable, *in.RouteTableId)
		if err != nil {
			return err
		}
		if deref(to.VpcId) != deref(from.VpcId) {
			return awserr.InvalidParameterValue("Route table %s and association %s belong to different networks", *in.RouteTableId, *in.AssociationId)
		}
		a := from.Associations[i]
		newAssoc, err = newID(tx, "rtbassoc")
		if err != nil {
			return err
		}
		from.Associations = append(from.Associations[:i], from.Associations[i+1:]...)
		if *from.RouteTableId == *to.RouteTableId {
			to = from
		} else if err := put(tx, kindRouteTable, *from.RouteTableId, from); err != nil {
			return err
		}
		a.RouteTableAssociationId = ptr(newAssoc)
		a.RouteTableId = to.RouteTableId
		to.Associations = append(to.Associations, a)
		if err := put(tx, kindRouteTable, *to.RouteTableId, to); err != nil {
			return err
		}
		if deref(a.Main) {
			v, err := get[vpcRecord](tx, kindVPC, *to.VpcId)
			if err != nil {
				return err
			}
			v.MainRouteTableID = *to.RouteTableId
			return put(tx, kindVPC, *v.VpcId, v)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return &ec2.ReplaceRouteTableAssociationOutput{
		NewAssociationId: ptr(newAssoc),
		AssociationState: &types.RouteTableAssociationState{State: types.RouteTableAssociationStateCodeAssociated},
	}, nil
}

func routeValues(get func(r *types.Route) string) func(*routeTableRecord) []string {
	return func(rt *routeTableRecord) []string {
		var out []string
		for i := range rt.Routes {
			if v := get(&rt.Routes[i]); v != "" {
				out = append(out, v)
			}
		}
		return out
	}
}

func assocValues(get func(a *types.RouteTableAssociation) string) func(*routeTableRecord) []string {
	return func(rt *routeTableRecord) []string {
		var out []string
		for i := range rt.Associations {
			if v := get(&rt.Associations[i]); v != "" {
				out = append(out, v)
			}
		}
		return out
	}
}

var rtbFilters = filterSet[routeTableRecord]{
	"association.gateway-id":                 assocValues(func(a *types.RouteTableAssociation) string { return deref(a.GatewayId) }),
	"association.route-table-association-id": assocValues(func(a *types.RouteTableAssociation) string { return deref(a.RouteTableAssociationId) }),
	"association.route-table-id":             assocValues(func(a *types.RouteTableAssociation) string { return deref(a.RouteTableId) }),
	"association.subnet-id":                  assocValues(func(a *types.RouteTableAssociation) string { return deref(a.SubnetId) }),
	// Tables with no association have no value here, so they match neither
	// true nor false, as EC2 documents.
	"association.main":                      assocValues(func(a *types.RouteTableAssociation) string { return boolString(deref(a.Main)) }),
	"owner-id":                              func(rt *routeTableRecord) []string { return []string{deref(rt.OwnerId)} },
	"route-table-id":                        func(rt *routeTableRecord) []string { return []string{deref(rt.RouteTableId)} },
	"vpc-id":                                func(rt *routeTableRecord) []string { return []string{deref(rt.VpcId)} },
	"route.destination-cidr-block":          routeValues(func(r *types.Route) string { return deref(r.DestinationCidrBlock) }),
	"route.destination-ipv6-cidr-block":     routeValues(func(r *types.Route) string { return deref(r.DestinationIpv6CidrBlock) }),
	"route.destination-prefix-list-id":      routeValues(func(r *types.Route) string { return deref(r.DestinationPrefixListId) }),
	"route.egress-only-internet-gateway-id": routeValues(func(r *types.Route) string { return deref(r.EgressOnlyInternetGatewayId) }),
	"route.gateway-id":                      routeValues(func(r *types.Route) string { return deref(r.GatewayId) }),
	"route.instance-id":                     routeValues(func(r *types.Route) string { return deref(r.InstanceId) }),
	"route.nat-gateway-id":                  routeValues(func(r *types.Route) string { return deref(r.NatGatewayId) }),
	"route.transit-gateway-id":              routeValues(func(r *types.Route) string { return deref(r.TransitGatewayId) }),
	"route.origin":                          routeValues(func(r *types.Route) string { return string(r.Origin) }),
	"route.state":                           routeValues(func(r *types.Route) string { return string(r.State) }),
	"route.vpc-peering-connection-id":       routeValues(func(r *types.Route) string { return deref(r.VpcPeeringConnectionId) }),
}

// DescribeRouteTables lists route tables.
func (s *Service) DescribeRouteTables(ctx context.Context, in *ec2.DescribeRouteTablesInput) (*ec2.DescribeRouteTablesOutput, error) {
	match, err := rtbFilters.compile(in.Filters)
	if err != nil {
		return nil, err
	}
	p, err := newPager(in.MaxResults, in.NextToken, 5, 100)
	if err != nil {
		return nil, err
	}
	out := &ec2.DescribeRouteTablesOutput{RouteTables: []types.RouteTable{}}
	err = s.db.View(func(tx *store.Tx) error {
		next, err := list(tx, kindRouteTable, in.RouteTableIds, match, p, func(_ string, rt *routeTableRecord, tags []types.Tag) {
			out.RouteTables = append(out.RouteTables, rt.view(tags))
		})
		out.NextToken = next
		return err
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}
