package ec2

import (
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"

	"hangar.dev/hangar/services/internal/store"
)

var kindInternetGateway = register(&kind{Prefix: "igw", ResourceType: types.ResourceTypeInternetGateway, NotFound: "InvalidInternetGatewayID.NotFound", Malformed: "InvalidInternetGatewayID.Malformed", Noun: "internetGateway ID"})

// internetGatewayRecord is an internet gateway as stored.
type internetGatewayRecord struct {
	types.InternetGateway
}

// createDefaultInternetGateway gives the default VPC what AWS gives it: an
// attached internet gateway and a 0.0.0.0/0 route to it in the main table.
func (s *Service) createDefaultInternetGateway(tx *store.Tx, v *vpcRecord) error {
	id, err := newID(tx, kindInternetGateway.Prefix)
	if err != nil {
		return err
	}
	igw := &internetGatewayRecord{InternetGateway: types.InternetGateway{
		InternetGatewayId: ptr(id),
		OwnerId:           ptr(s.account()),
		Attachments:       []types.InternetGatewayAttachment{{VpcId: v.VpcId, State: types.AttachmentStatusAttached}},
	}}
	if err := put(tx, kindInternetGateway, id, igw); err != nil {
		return err
	}
	rt, err := get[routeTableRecord](tx, kindRouteTable, v.MainRouteTableID)
	if err != nil {
		return err
	}
	rt.Routes = append(rt.Routes, types.Route{
		DestinationCidrBlock: ptr("0.0.0.0/0"),
		GatewayId:            ptr(id),
		Origin:               types.RouteOriginCreateRoute,
		State:                types.RouteStateActive,
	})
	return put(tx, kindRouteTable, v.MainRouteTableID, rt)
}

func init() {
	vpcDependents = append(vpcDependents, func(tx *store.Tx, v *vpcRecord) (string, error) {
		found := ""
		_, err := exists(tx, kindInternetGateway, func(id string, g *internetGatewayRecord) bool {
			for _, a := range g.Attachments {
				if deref(a.VpcId) == *v.VpcId {
					found = id
					return true
				}
			}
			return false
		})
		return found, err
	})
}
