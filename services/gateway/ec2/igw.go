package ec2

import (
	"context"

	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"

	"hangar.dev/hangar/services/gateway/awserr"
	"hangar.dev/hangar/services/internal/store"
)

var kindInternetGateway = register(&kind{Prefix: "igw", ResourceType: types.ResourceTypeInternetGateway, NotFound: "InvalidInternetGatewayID.NotFound", Malformed: "InvalidInternetGatewayID.Malformed", Noun: "internetGateway ID"})

// igwAttached is the attachment state EC2 reports for an internet gateway
// attached to a VPC: "available", not the "attached" of the enum the SDK
// offers (DescribeInternetGateways' attachment.state filter documents it).
const igwAttached = types.AttachmentStatus("available")

// internetGatewayRecord is an internet gateway as stored.
type internetGatewayRecord struct {
	types.InternetGateway
}

// vpc returns the VPC the gateway is attached to, or "".
func (g *internetGatewayRecord) vpc() string {
	for _, a := range g.Attachments {
		return deref(a.VpcId)
	}
	return ""
}

func (g *internetGatewayRecord) view(tags []types.Tag) types.InternetGateway {
	out := g.InternetGateway
	if out.Attachments == nil {
		out.Attachments = []types.InternetGatewayAttachment{}
	}
	out.Tags = tags
	return out
}

func (s *Service) newInternetGateway(tx *store.Tx, tags []types.Tag) (*internetGatewayRecord, error) {
	id, err := newID(tx, kindInternetGateway.Prefix)
	if err != nil {
		return nil, err
	}
	igw := &internetGatewayRecord{InternetGateway: types.InternetGateway{
		InternetGatewayId: ptr(id),
		OwnerId:           ptr(s.account()),
		Attachments:       []types.InternetGatewayAttachment{},
	}}
	if err := put(tx, kindInternetGateway, id, igw); err != nil {
		return nil, err
	}
	if len(tags) > 0 {
		if err := addTags(tx, id, tags); err != nil {
			return nil, err
		}
	}
	return igw, nil
}

// createDefaultInternetGateway gives the default VPC what AWS gives it: an
// attached internet gateway and a 0.0.0.0/0 route to it in the main table.
func (s *Service) createDefaultInternetGateway(tx *store.Tx, v *vpcRecord) error {
	igw, err := s.newInternetGateway(tx, nil)
	if err != nil {
		return err
	}
	id := *igw.InternetGatewayId
	igw.Attachments = []types.InternetGatewayAttachment{{VpcId: v.VpcId, State: igwAttached}}
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
			if g.vpc() == *v.VpcId {
				found = id
				return true
			}
			return false
		})
		return found, err
	})
}

// igwDetachDependents are the checks DetachInternetGateway runs: the
// public addresses mapped in the VPC (instances with public IPs, Elastic
// IPs) add theirs, returning what still needs the gateway.
var igwDetachDependents []func(tx *store.Tx, g *internetGatewayRecord, vpcID string) (string, error)

// CreateInternetGateway creates a detached internet gateway.
func (s *Service) CreateInternetGateway(ctx context.Context, in *ec2.CreateInternetGatewayInput) (*ec2.CreateInternetGatewayOutput, error) {
	tags, err := tagSpecs(in.TagSpecifications, types.ResourceTypeInternetGateway)
	if err != nil {
		return nil, err
	}
	var out types.InternetGateway
	err = s.db.Update(func(tx *store.Tx) error {
		igw, err := s.newInternetGateway(tx, tags)
		if err != nil {
			return err
		}
		out = igw.view(tagsOf(tx, *igw.InternetGatewayId))
		return nil
	})
	if err != nil {
		return nil, err
	}
	return &ec2.CreateInternetGatewayOutput{InternetGateway: &out}, nil
}

// AttachInternetGateway attaches a gateway to a VPC. A gateway serves one
// VPC, and a VPC has at most one gateway. Routes in the VPC that already
// point at the gateway come back from blackhole to active.
func (s *Service) AttachInternetGateway(ctx context.Context, in *ec2.AttachInternetGatewayInput) (*ec2.AttachInternetGatewayOutput, error) {
	if in.InternetGatewayId == nil {
		return nil, awserr.MissingParameter("InternetGatewayId")
	}
	if in.VpcId == nil {
		return nil, awserr.MissingParameter("VpcId")
	}
	igwID, vpcID := *in.InternetGatewayId, *in.VpcId
	err := s.db.Update(func(tx *store.Tx) error {
		igw, err := get[internetGatewayRecord](tx, kindInternetGateway, igwID)
		if err != nil {
			return err
		}
		if _, err := get[vpcRecord](tx, kindVPC, vpcID); err != nil {
			return err
		}
		if cur := igw.vpc(); cur != "" {
			return awserr.New(400, "Resource.AlreadyAssociated", "resource %s is already attached to network %s", igwID, cur)
		}
		other := ""
		if _, err := exists(tx, kindInternetGateway, func(id string, g *internetGatewayRecord) bool {
			if g.vpc() == vpcID {
				other = id
				return true
			}
			return false
		}); err != nil {
			return err
		}
		if other != "" {
			return awserr.New(400, "Resource.AlreadyAssociated", "Network %s already has an internet gateway attached (%s)", vpcID, other)
		}
		igw.Attachments = []types.InternetGatewayAttachment{{VpcId: ptr(vpcID), State: igwAttached}}
		if err := put(tx, kindInternetGateway, igwID, igw); err != nil {
			return err
		}
		return setGatewayRouteState(tx, vpcID, igwID, types.RouteStateActive)
	})
	if err != nil {
		return nil, err
	}
	return &ec2.AttachInternetGatewayOutput{}, nil
}

// DetachInternetGateway detaches a gateway from its VPC. Routes to it stay,
// as blackholes, as in AWS.
func (s *Service) DetachInternetGateway(ctx context.Context, in *ec2.DetachInternetGatewayInput) (*ec2.DetachInternetGatewayOutput, error) {
	if in.InternetGatewayId == nil {
		return nil, awserr.MissingParameter("InternetGatewayId")
	}
	if in.VpcId == nil {
		return nil, awserr.MissingParameter("VpcId")
	}
	igwID, vpcID := *in.InternetGatewayId, *in.VpcId
	err := s.db.Update(func(tx *store.Tx) error {
		igw, err := get[internetGatewayRecord](tx, kindInternetGateway, igwID)
		if err != nil {
			return err
		}
		if _, err := get[vpcRecord](tx, kindVPC, vpcID); err != nil {
			return err
		}
		if igw.vpc() != vpcID {
			return awserr.New(400, "Gateway.NotAttached", "resource %s is not attached to network %s", igwID, vpcID)
		}
		for _, dep := range igwDetachDependents {
			what, err := dep(tx, igw, vpcID)
			if err != nil {
				return err
			}
			if what != "" {
				return awserr.DependencyViolation("Network %s has some mapped public address(es) (%s). Please unmap those public address(es) before detaching the gateway.", vpcID, what)
			}
		}
		igw.Attachments = []types.InternetGatewayAttachment{}
		if err := put(tx, kindInternetGateway, igwID, igw); err != nil {
			return err
		}
		return setGatewayRouteState(tx, vpcID, igwID, types.RouteStateBlackhole)
	})
	if err != nil {
		return nil, err
	}
	return &ec2.DetachInternetGatewayOutput{}, nil
}

// DeleteInternetGateway deletes a detached gateway.
func (s *Service) DeleteInternetGateway(ctx context.Context, in *ec2.DeleteInternetGatewayInput) (*ec2.DeleteInternetGatewayOutput, error) {
	if in.InternetGatewayId == nil {
		return nil, awserr.MissingParameter("InternetGatewayId")
	}
	id := *in.InternetGatewayId
	err := s.db.Update(func(tx *store.Tx) error {
		igw, err := get[internetGatewayRecord](tx, kindInternetGateway, id)
		if err != nil {
			return err
		}
		if igw.vpc() != "" {
			return awserr.DependencyViolation("The internetGateway '%s' has dependencies and cannot be deleted.", id)
		}
		return remove(tx, kindInternetGateway, id)
	})
	if err != nil {
		return nil, err
	}
	return &ec2.DeleteInternetGatewayOutput{}, nil
}

var igwFilters = filterSet[internetGatewayRecord]{
	"attachment.state": func(g *internetGatewayRecord) []string {
		var out []string
		for _, a := range g.Attachments {
			out = append(out, string(a.State))
		}
		return out
	},
	"attachment.vpc-id": func(g *internetGatewayRecord) []string {
		var out []string
		for _, a := range g.Attachments {
			out = append(out, deref(a.VpcId))
		}
		return out
	},
	"internet-gateway-id": func(g *internetGatewayRecord) []string { return []string{deref(g.InternetGatewayId)} },
	"owner-id":            func(g *internetGatewayRecord) []string { return []string{deref(g.OwnerId)} },
}

// DescribeInternetGateways lists internet gateways.
func (s *Service) DescribeInternetGateways(ctx context.Context, in *ec2.DescribeInternetGatewaysInput) (*ec2.DescribeInternetGatewaysOutput, error) {
	match, err := igwFilters.compile(in.Filters)
	if err != nil {
		return nil, err
	}
	p, err := newPager(in.MaxResults, in.NextToken, 5, 1000)
	if err != nil {
		return nil, err
	}
	out := &ec2.DescribeInternetGatewaysOutput{InternetGateways: []types.InternetGateway{}}
	err = s.db.View(func(tx *store.Tx) error {
		next, err := list(tx, kindInternetGateway, in.InternetGatewayIds, match, p, func(_ string, g *internetGatewayRecord, tags []types.Tag) {
			out.InternetGateways = append(out.InternetGateways, g.view(tags))
		})
		out.NextToken = next
		return err
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}
