package ec2

import (
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"

	"hangar.dev/hangar/services/internal/store"
)

var kindRouteTable = register(&kind{Prefix: "rtb", ResourceType: types.ResourceTypeRouteTable, NotFound: "InvalidRouteTableID.NotFound", Malformed: "InvalidRouteTableID.Malformed", Noun: "routeTable ID"})

// routeTableRecord is a route table as stored. Routes and associations are
// kept in the SDK's shapes; the main association's id is AWS-shaped too.
type routeTableRecord struct {
	types.RouteTable
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
