package ec2

import (
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"

	"hangar.dev/hangar/services/internal/store"
)

var kindSecurityGroup = register(&kind{Prefix: "sg", ResourceType: types.ResourceTypeSecurityGroup, NotFound: "InvalidGroup.NotFound", Malformed: "InvalidGroupId.Malformed", Noun: "security group"})

// sgRule is one security group rule as stored; the API's IpPermissions and
// SecurityGroupRules views are both rendered from these.
type sgRule struct {
	ID          string // sgr-…
	Egress      bool
	Protocol    string // "-1", "tcp", "udp", "icmp", "icmpv6" or a protocol number
	FromPort    int32
	ToPort      int32
	CIDR        string // one of CIDR, IPv6CIDR, GroupID, PrefixListID
	IPv6CIDR    string
	GroupID     string
	PrefixList  string
	Description string
}

// securityGroupRecord is a security group as stored.
type securityGroupRecord struct {
	GroupID     string
	GroupName   string
	Description string
	VpcID       string
	OwnerID     string
	Default     bool // the VPC's "default" group, deleted only with the VPC
	Rules       []sgRule
}

// createDefaultSecurityGroup makes a VPC's "default" group with AWS's
// default rules: all traffic in from members of the group itself, all
// traffic out.
func (s *Service) createDefaultSecurityGroup(tx *store.Tx, v *vpcRecord) (*types.SecurityGroup, error) {
	id, err := newID(tx, kindSecurityGroup.Prefix)
	if err != nil {
		return nil, err
	}
	in, err := newID(tx, "sgr")
	if err != nil {
		return nil, err
	}
	out, err := newID(tx, "sgr")
	if err != nil {
		return nil, err
	}
	rec := &securityGroupRecord{
		GroupID:     id,
		GroupName:   "default",
		Description: "default VPC security group",
		VpcID:       *v.VpcId,
		OwnerID:     s.account(),
		Default:     true,
		Rules: []sgRule{
			{ID: in, Protocol: "-1", FromPort: -1, ToPort: -1, GroupID: id},
			{ID: out, Egress: true, Protocol: "-1", FromPort: -1, ToPort: -1, CIDR: "0.0.0.0/0"},
		},
	}
	if err := put(tx, kindSecurityGroup, id, rec); err != nil {
		return nil, err
	}
	return &types.SecurityGroup{GroupId: ptr(id), GroupName: ptr(rec.GroupName), VpcId: v.VpcId}, nil
}

// deleteVPCDefaults removes what a VPC brought with it: its main route
// table and its default security group.
func (s *Service) deleteVPCDefaults(tx *store.Tx, v *vpcRecord) error {
	if err := remove(tx, kindRouteTable, v.MainRouteTableID); err != nil {
		return err
	}
	return remove(tx, kindSecurityGroup, v.DefaultSecurityGroup)
}
