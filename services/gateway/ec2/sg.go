package ec2

import (
	"context"
	"fmt"
	"strings"

	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"

	"hangar.dev/hangar/services/gateway/awserr"
	"hangar.dev/hangar/services/internal/store"
)

var kindSecurityGroup = register(&kind{Prefix: "sg", ResourceType: types.ResourceTypeSecurityGroup, NotFound: "InvalidGroup.NotFound", Malformed: "InvalidGroupId.Malformed", Noun: "security group"})

// kindSecurityGroupRule indexes rule ids: the "sgr" bucket maps each rule id
// to its group, so rules can be tagged and found by id. The rules
// themselves live in their group's record.
var kindSecurityGroupRule = register(&kind{Prefix: "sgr", ResourceType: types.ResourceTypeSecurityGroupRule, NotFound: "InvalidSecurityGroupRuleId.NotFound", Malformed: "InvalidSecurityGroupRuleId.Malformed", Noun: "security group rule ID"})

// sgRule is one security group rule as stored; the API's IpPermissions and
// SecurityGroupRules views are both rendered from these.
type sgRule struct {
	ID          string // sgr-…
	Egress      bool
	Protocol    string // "-1", "tcp", "udp", "icmp", "icmpv6" or a protocol number
	FromPort    int32  // -1 where the protocol has no ports
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

// maxRulesPerDirection is EC2's default quota of inbound (and, separately,
// outbound) rules per security group.
const maxRulesPerDirection = 60

// createDefaultSecurityGroup makes a VPC's "default" group with AWS's
// default rules: all traffic in from members of the group itself, all
// traffic out.
func (s *Service) createDefaultSecurityGroup(tx *store.Tx, v *vpcRecord) (*types.SecurityGroup, error) {
	id, err := newID(tx, kindSecurityGroup.Prefix)
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
	}
	rules := []sgRule{
		{Protocol: "-1", FromPort: -1, ToPort: -1, GroupID: id},
		{Egress: true, Protocol: "-1", FromPort: -1, ToPort: -1, CIDR: "0.0.0.0/0"},
	}
	if _, err := addRules(tx, rec, rules, nil); err != nil {
		return nil, err
	}
	if err := put(tx, kindSecurityGroup, id, rec); err != nil {
		return nil, err
	}
	return &types.SecurityGroup{GroupId: ptr(id), GroupName: ptr(rec.GroupName), VpcId: v.VpcId}, nil
}

// deleteVPCDefaults removes what a VPC brought with it: its main route
// table and its default security group (with its rules' ids and tags).
func (s *Service) deleteVPCDefaults(tx *store.Tx, v *vpcRecord) error {
	if err := remove(tx, kindRouteTable, v.MainRouteTableID); err != nil {
		return err
	}
	g, err := get[securityGroupRecord](tx, kindSecurityGroup, v.DefaultSecurityGroup)
	if err != nil {
		return err
	}
	return deleteGroup(tx, g)
}

func deleteGroup(tx *store.Tx, g *securityGroupRecord) error {
	for _, r := range g.Rules {
		if err := remove(tx, kindSecurityGroupRule, r.ID); err != nil {
			return err
		}
	}
	return remove(tx, kindSecurityGroup, g.GroupID)
}

func init() {
	vpcDependents = append(vpcDependents, func(tx *store.Tx, v *vpcRecord) (string, error) {
		found := ""
		_, err := exists(tx, kindSecurityGroup, func(id string, g *securityGroupRecord) bool {
			if g.VpcID == *v.VpcId && !g.Default {
				found = id
				return true
			}
			return false
		})
		return found, err
	})
}

// sgDependents are the checks DeleteSecurityGroup runs besides rule
// references: network interfaces and instances add theirs, returning the
// id of a record that uses the group.
var sgDependents []func(tx *store.Tx, g *securityGroupRecord) (string, error)

// addRules gives each rule an id, indexes it, tags it and appends it to g.
// g is not written; the caller puts it.
func addRules(tx *store.Tx, g *securityGroupRecord, rules []sgRule, tags []types.Tag) ([]sgRule, error) {
	out := make([]sgRule, 0, len(rules))
	for _, r := range rules {
		id, err := newID(tx, kindSecurityGroupRule.Prefix)
		if err != nil {
			return nil, err
		}
		r.ID = id
		if err := tx.Put(kindSecurityGroupRule.Prefix, id, g.GroupID); err != nil {
			return nil, err
		}
		if len(tags) > 0 {
			if err := addTags(tx, id, tags); err != nil {
				return nil, err
			}
		}
		g.Rules = append(g.Rules, r)
		out = append(out, r)
	}
	return out, nil
}

func (s *Service) groupARN(id string) string {
	return fmt.Sprintf("arn:aws:ec2:%s:%s:security-group/%s", s.cfg.Region, s.account(), id)
}

func (s *Service) ruleARN(id string) string {
	return fmt.Sprintf("arn:aws:ec2:%s:%s:security-group-rule/%s", s.cfg.Region, s.account(), id)
}

// view renders a group as DescribeSecurityGroups shows it.
func (s *Service) sgView(g *securityGroupRecord, tags []types.Tag) types.SecurityGroup {
	return types.SecurityGroup{
		GroupId:             ptr(g.GroupID),
		GroupName:           ptr(g.GroupName),
		Description:         ptr(g.Description),
		VpcId:               ptr(g.VpcID),
		OwnerId:             ptr(g.OwnerID),
		SecurityGroupArn:    ptr(s.groupARN(g.GroupID)),
		IpPermissions:       ipPermissions(g.Rules, false, g.OwnerID),
		IpPermissionsEgress: ipPermissions(g.Rules, true, g.OwnerID),
		Tags:                tags,
	}
}

// hasPorts reports whether a protocol's rules carry FromPort/ToPort.
func hasPorts(proto string) bool {
	switch proto {
	case "tcp", "udp", "icmp", "icmpv6":
		return true
	}
	return false
}

// ipPermissions renders the rules of one direction the way EC2 groups them:
// one IpPermission per protocol and port range, holding every peer.
func ipPermissions(rules []sgRule, egress bool, owner string) []types.IpPermission {
	out := []types.IpPermission{}
	index := map[string]int{}
	for _, r := range rules {
		if r.Egress != egress {
			continue
		}
		key := fmt.Sprintf("%s|%d|%d", r.Protocol, r.FromPort, r.ToPort)
		i, ok := index[key]
		if !ok {
			p := types.IpPermission{
				IpProtocol:       ptr(r.Protocol),
				IpRanges:         []types.IpRange{},
				Ipv6Ranges:       []types.Ipv6Range{},
				PrefixListIds:    []types.PrefixListId{},
				UserIdGroupPairs: []types.UserIdGroupPair{},
			}
			if hasPorts(r.Protocol) {
				p.FromPort, p.ToPort = ptr(r.FromPort), ptr(r.ToPort)
			}
			out = append(out, p)
			i = len(out) - 1
			index[key] = i
		}
		p := &out[i]
		desc := optional(r.Description)
		switch {
		case r.CIDR != "":
			p.IpRanges = append(p.IpRanges, types.IpRange{CidrIp: ptr(r.CIDR), Description: desc})
		case r.IPv6CIDR != "":
			p.Ipv6Ranges = append(p.Ipv6Ranges, types.Ipv6Range{CidrIpv6: ptr(r.IPv6CIDR), Description: desc})
		case r.PrefixList != "":
			p.PrefixListIds = append(p.PrefixListIds, types.PrefixListId{PrefixListId: ptr(r.PrefixList), Description: desc})
		case r.GroupID != "":
			p.UserIdGroupPairs = append(p.UserIdGroupPairs, types.UserIdGroupPair{GroupId: ptr(r.GroupID), UserId: ptr(owner), Description: desc})
		}
	}
	return out
}

func optional(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

// ruleView renders one rule as DescribeSecurityGroupRules shows it.
func (s *Service) ruleView(g *securityGroupRecord, r sgRule, tags []types.Tag) types.SecurityGroupRule {
	out := types.SecurityGroupRule{
		SecurityGroupRuleId:  ptr(r.ID),
		SecurityGroupRuleArn: ptr(s.ruleARN(r.ID)),
		GroupId:              ptr(g.GroupID),
		GroupOwnerId:         ptr(g.OwnerID),
		IsEgress:             ptr(r.Egress),
		IpProtocol:           ptr(r.Protocol),
		FromPort:             ptr(r.FromPort),
		ToPort:               ptr(r.ToPort),
		Description:          optional(r.Description),
		Tags:                 tags,
	}
	if out.Tags == nil {
		out.Tags = []types.Tag{}
	}
	switch {
	case r.CIDR != "":
		out.CidrIpv4 = ptr(r.CIDR)
	case r.IPv6CIDR != "":
		out.CidrIpv6 = ptr(r.IPv6CIDR)
	case r.PrefixList != "":
		out.PrefixListId = ptr(r.PrefixList)
	case r.GroupID != "":
		out.ReferencedGroupInfo = &types.ReferencedSecurityGroup{GroupId: ptr(r.GroupID), UserId: ptr(g.OwnerID)}
	}
	return out
}

// validSGText is the character set EC2 allows in VPC security group names,
// group descriptions and rule descriptions.
func validSGText(s string) bool {
	for _, c := range s {
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		case strings.ContainsRune(" ._-:/()#,@[]+=&;{}!$*", c):
		default:
			return false
		}
	}
	return true
}

const sgCharset = "a-z, A-Z, 0-9, spaces, and ._-:/()#,@[]+=&;{}!$*"

func checkGroupText(param, v string) error {
	if len(v) > 255 {
		return awserr.InvalidParameterValue("Value (%s) for parameter %s is invalid. Length exceeds maximum of 255 characters.", clip(v), param)
	}
	for _, c := range v {
		if c > 127 {
			return awserr.InvalidParameterValue("Value (%s) for parameter %s is invalid. Character sets beyond ASCII are not supported.", clip(v), param)
		}
	}
	if !validSGText(v) {
		return awserr.InvalidParameterValue("Value (%s) for parameter %s is invalid. Valid characters: %s", clip(v), param, sgCharset)
	}
	return nil
}

func checkRuleDescription(d string) error {
	if len(d) > 255 || !validSGText(d) {
		return awserr.InvalidParameterValue("Invalid rule description. Valid descriptions are strings less than 256 characters from the following set:  a-zA-Z0-9. _-:/()#,@[]+=&;{}!$*")
	}
	return nil
}

// defaultVPC returns the default VPC's id, or "" when it was deleted.
func defaultVPC(tx *store.Tx) string {
	var id string
	if err := tx.Get(bucketMeta, metaDefaultVPC, &id); err != nil || id == "deleted" {
		return ""
	}
	return id
}

// groupInVPC finds the group called name in vpcID, or nil.
func groupInVPC(tx *store.Tx, vpcID, name string) (*securityGroupRecord, error) {
	var found *securityGroupRecord
	err := tx.Each(kindSecurityGroup.Prefix, "", func(_ string, decode func(any) error) (bool, error) {
		var g securityGroupRecord
		if err := decode(&g); err != nil {
			return false, err
		}
		if g.VpcID == vpcID && g.GroupName == name {
			found = &g
			return false, nil
		}
		return true, nil
	})
	return found, err
}

// groupByName resolves a GroupName parameter: EC2 looks names up in the
// default VPC only; groups elsewhere are addressed by id.
func groupByName(tx *store.Tx, name string) (*securityGroupRecord, error) {
	vpc := defaultVPC(tx)
	if vpc == "" {
		return nil, awserr.New(400, "VPCIdNotSpecified", "No default VPC for this user. GroupName is only supported for EC2-Classic and default VPC.")
	}
	g, err := groupInVPC(tx, vpc, name)
	if err != nil {
		return nil, err
	}
	if g == nil {
		return nil, awserr.New(400, "InvalidGroup.NotFound", "The security group '%s' does not exist in default VPC '%s'", clip(name), vpc)
	}
	return g, nil
}

// resolveGroup finds the group a request names by GroupId or GroupName.
func resolveGroup(tx *store.Tx, id, name *string) (*securityGroupRecord, error) {
	switch {
	case id != nil && *id != "":
		return get[securityGroupRecord](tx, kindSecurityGroup, *id)
	case name != nil && *name != "":
		return groupByName(tx, *name)
	}
	return nil, awserr.MissingParameter("groupId or groupName")
}

// CreateSecurityGroup creates a security group in a VPC (the default VPC
// when none is given) with EC2's default outbound rule: all traffic to
// 0.0.0.0/0.
func (s *Service) CreateSecurityGroup(ctx context.Context, in *ec2.CreateSecurityGroupInput) (*ec2.CreateSecurityGroupOutput, error) {
	name, desc := deref(in.GroupName), deref(in.Description)
	if name == "" {
		return nil, awserr.MissingParameter("GroupName")
	}
	if desc == "" {
		return nil, awserr.MissingParameter("GroupDescription")
	}
	if err := checkGroupText("GroupName", name); err != nil {
		return nil, err
	}
	if err := checkGroupText("GroupDescription", desc); err != nil {
		return nil, err
	}
	if strings.HasPrefix(strings.ToLower(name), "sg-") {
		return nil, awserr.InvalidParameterValue("Group names may not be in the format sg-*")
	}
	if name == "default" {
		return nil, awserr.New(400, "InvalidGroup.Reserved", "Specified group name is a reserved name.")
	}
	tags, err := tagSpecs(in.TagSpecifications, types.ResourceTypeSecurityGroup)
	if err != nil {
		return nil, err
	}
	var out *ec2.CreateSecurityGroupOutput
	err = s.db.Update(func(tx *store.Tx) error {
		vpcID := deref(in.VpcId)
		if vpcID == "" {
			vpcID = defaultVPC(tx)
			if vpcID == "" {
				return awserr.New(400, "VPCIdNotSpecified", "No default VPC for this user")
			}
		}
		if _, err := get[vpcRecord](tx, kindVPC, vpcID); err != nil {
			return err
		}
		dup, err := groupInVPC(tx, vpcID, name)
		if err != nil {
			return err
		}
		if dup != nil {
			return awserr.New(400, "InvalidGroup.Duplicate", "The security group '%s' already exists for VPC '%s'", name, vpcID)
		}
		id, err := newID(tx, kindSecurityGroup.Prefix)
		if err != nil {
			return err
		}
		g := &securityGroupRecord{GroupID: id, GroupName: name, Description: desc, VpcID: vpcID, OwnerID: s.account()}
		if _, err := addRules(tx, g, []sgRule{{Egress: true, Protocol: "-1", FromPort: -1, ToPort: -1, CIDR: "0.0.0.0/0"}}, nil); err != nil {
			return err
		}
		if err := put(tx, kindSecurityGroup, id, g); err != nil {
			return err
		}
		if len(tags) > 0 {
			if err := addTags(tx, id, tags); err != nil {
				return err
			}
		}
		out = &ec2.CreateSecurityGroupOutput{GroupId: ptr(id), SecurityGroupArn: ptr(s.groupARN(id)), Tags: tagsOf(tx, id)}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// DeleteSecurityGroup deletes a group no other group's rules reference and
// nothing uses. A VPC's default group goes only with its VPC.
func (s *Service) DeleteSecurityGroup(ctx context.Context, in *ec2.DeleteSecurityGroupInput) (*ec2.DeleteSecurityGroupOutput, error) {
	var id string
	err := s.db.Update(func(tx *store.Tx) error {
		g, err := resolveGroup(tx, in.GroupId, in.GroupName)
		if err != nil {
			return err
		}
		id = g.GroupID
		if g.Default {
			return awserr.New(400, "CannotDelete", "the specified group: \"%s\" name: \"%s\" cannot be deleted by a user", g.GroupID, g.GroupName)
		}
		ref := ""
		if _, err := exists(tx, kindSecurityGroup, func(other string, o *securityGroupRecord) bool {
			if other == g.GroupID {
				return false
			}
			for _, r := range o.Rules {
				if r.GroupID == g.GroupID {
					ref = other
					return true
				}
			}
			return false
		}); err != nil {
			return err
		}
		if ref != "" {
			return awserr.DependencyViolation("resource %s has a dependent object (a rule of %s references it)", g.GroupID, ref)
		}
		for _, dep := range sgDependents {
			used, err := dep(tx, g)
			if err != nil {
				return err
			}
			if used != "" {
				return awserr.DependencyViolation("resource %s has a dependent object (%s)", g.GroupID, used)
			}
		}
		return deleteGroup(tx, g)
	})
	if err != nil {
		return nil, err
	}
	return &ec2.DeleteSecurityGroupOutput{Return: ptr(true), GroupId: ptr(id)}, nil
}

// sgFilters are DescribeSecurityGroups' documented filters. names resolves
// a group id to its name for the *.group-name filters.
func sgFilters(names func(id string) string) filterSet[securityGroupRecord] {
	ruleValues := func(egress bool, get func(r *sgRule) string) func(*securityGroupRecord) []string {
		return func(g *securityGroupRecord) []string {
			var out []string
			for i := range g.Rules {
				if g.Rules[i].Egress != egress {
					continue
				}
				if v := get(&g.Rules[i]); v != "" {
					out = append(out, v)
				}
			}
			return out
		}
	}
	fs := filterSet[securityGroupRecord]{
		"description": func(g *securityGroupRecord) []string { return []string{g.Description} },
		"group-id":    func(g *securityGroupRecord) []string { return []string{g.GroupID} },
		"group-name":  func(g *securityGroupRecord) []string { return []string{g.GroupName} },
		"owner-id":    func(g *securityGroupRecord) []string { return []string{g.OwnerID} },
		"vpc-id":      func(g *securityGroupRecord) []string { return []string{g.VpcID} },
	}
	for _, dir := range []struct {
		prefix string
		egress bool
	}{{"ip-permission.", false}, {"egress.ip-permission.", true}} {
		e := dir.egress
		fs[dir.prefix+"cidr"] = ruleValues(e, func(r *sgRule) string { return r.CIDR })
		fs[dir.prefix+"ipv6-cidr"] = ruleValues(e, func(r *sgRule) string { return r.IPv6CIDR })
		fs[dir.prefix+"prefix-list-id"] = ruleValues(e, func(r *sgRule) string { return r.PrefixList })
		fs[dir.prefix+"group-id"] = ruleValues(e, func(r *sgRule) string { return r.GroupID })
		fs[dir.prefix+"group-name"] = ruleValues(e, func(r *sgRule) string {
			if r.GroupID == "" {
				return ""
			}
			return names(r.GroupID)
		})
		fs[dir.prefix+"protocol"] = ruleValues(e, func(r *sgRule) string { return r.Protocol })
		fs[dir.prefix+"from-port"] = ruleValues(e, func(r *sgRule) string { return fmt.Sprint(r.FromPort) })
		fs[dir.prefix+"to-port"] = ruleValues(e, func(r *sgRule) string { return fmt.Sprint(r.ToPort) })
		fs[dir.prefix+"user-id"] = func(g *securityGroupRecord) []string {
			for _, r := range g.Rules {
				if r.Egress == e && r.GroupID != "" {
					return []string{g.OwnerID}
				}
			}
			return nil
		}
	}
	return fs
}

// DescribeSecurityGroups lists security groups.
func (s *Service) DescribeSecurityGroups(ctx context.Context, in *ec2.DescribeSecurityGroupsInput) (*ec2.DescribeSecurityGroupsOutput, error) {
	names := map[string]string{}
	match, err := sgFilters(func(id string) string { return names[id] }).compile(in.Filters)
	if err != nil {
		return nil, err
	}
	p, err := newPager(in.MaxResults, in.NextToken, 5, 1000)
	if err != nil {
		return nil, err
	}
	out := &ec2.DescribeSecurityGroupsOutput{SecurityGroups: []types.SecurityGroup{}}
	err = s.db.View(func(tx *store.Tx) error {
		if needsNames(in.Filters) {
			if err := tx.Each(kindSecurityGroup.Prefix, "", func(id string, decode func(any) error) (bool, error) {
				var g securityGroupRecord
				if err := decode(&g); err != nil {
					return false, err
				}
				names[id] = g.GroupName
				return true, nil
			}); err != nil {
				return err
			}
		}
		ids := in.GroupIds
		for _, name := range in.GroupNames {
			g, err := groupByName(tx, name)
			if err != nil {
				return err
			}
			ids = append(ids, g.GroupID)
		}
		next, err := list(tx, kindSecurityGroup, ids, match, p, func(_ string, g *securityGroupRecord, tags []types.Tag) {
			out.SecurityGroups = append(out.SecurityGroups, s.sgView(g, tags))
		})
		out.NextToken = next
		return err
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

func needsNames(fs []types.Filter) bool {
	for _, f := range fs {
		if strings.HasSuffix(deref(f.Name), "group-name") {
			return true
		}
	}
	return false
}
