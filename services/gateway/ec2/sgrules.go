package ec2

import (
	"context"
	"fmt"
	"net/netip"
	"sort"
	"strconv"
	"strings"

	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"

	"hangar.dev/hangar/services/gateway/awserr"
	"hangar.dev/hangar/services/internal/store"
)

// normalizeProtocol reads an IpProtocol as EC2 does: the names tcp, udp,
// icmp and icmpv6 (any case) or their numbers become the names, -1 means
// every protocol, and any other protocol number 0–255 stays a number.
func normalizeProtocol(raw string) (string, error) {
	p := strings.ToLower(strings.TrimSpace(raw))
	switch p {
	case "tcp", "6":
		return "tcp", nil
	case "udp", "17":
		return "udp", nil
	case "icmp", "1":
		return "icmp", nil
	case "icmpv6", "58":
		return "icmpv6", nil
	case "-1":
		return "-1", nil
	}
	if n, err := strconv.Atoi(p); err == nil && n >= 0 && n <= 255 && strconv.Itoa(n) == p {
		return p, nil
	}
	return "", awserr.InvalidParameterValue("Invalid value '%s' for IP protocol. Unknown protocol.", clip(raw))
}

// portRange checks FromPort/ToPort for a protocol. TCP and UDP take a port
// range 0–65535; ICMP takes a type and a code (each -1 for all, and all
// types means all codes); other protocols have no ports.
func portRange(proto string, from, to *int32) (int32, int32, error) {
	switch proto {
	case "tcp", "udp":
		if from == nil || to == nil {
			return 0, 0, awserr.InvalidParameterValue("Invalid value 'Must specify both from and to ports with TCP/UDP.' for portRange.")
		}
		f, t := *from, *to
		if f < 0 || t < 0 || f > 65535 || t > 65535 {
			return 0, 0, awserr.InvalidParameterValue("Invalid value '%d-%d' for portRange. Ports must be between 0 and 65535.", f, t)
		}
		if f > t {
			return 0, 0, awserr.InvalidParameterValue("Invalid value '%d-%d' for portRange. The from port must not be greater than the to port.", f, t)
		}
		return f, t, nil
	case "icmp", "icmpv6":
		typ, code := int32(-1), int32(-1)
		if from != nil {
			typ = *from
		}
		if to != nil {
			code = *to
		}
		if typ < -1 || typ > 255 {
			return 0, 0, awserr.InvalidParameterValue("Invalid value '%d' for ICMP type. It must be -1 (all types) or 0 to 255.", typ)
		}
		if code < -1 || code > 255 {
			return 0, 0, awserr.InvalidParameterValue("Invalid value '%d' for ICMP code. It must be -1 (all codes) or 0 to 255.", code)
		}
		if typ == -1 && code != -1 {
			return 0, 0, awserr.InvalidParameterValue("Invalid value '%d' for ICMP code. If you specify all ICMP types, you must specify all codes (-1).", code)
		}
		return typ, code, nil
	}
	return -1, -1, nil
}

// ruleKey identifies a rule for duplicate and revoke matching: everything
// but the id and the description.
func ruleKey(r sgRule) string {
	return fmt.Sprintf("%t|%s|%d|%d|%s|%s|%s|%s", r.Egress, r.Protocol, r.FromPort, r.ToPort, r.CIDR, r.IPv6CIDR, r.GroupID, r.PrefixList)
}

// describeRule words a rule as EC2's InvalidPermission errors do.
func describeRule(r sgRule) string {
	peer := r.CIDR + r.IPv6CIDR + r.GroupID + r.PrefixList
	var what string
	switch r.Protocol {
	case "-1":
		what = "ALL"
	case "tcp", "udp":
		what = fmt.Sprintf("%s, from port: %d, to port: %d", strings.ToUpper(r.Protocol), r.FromPort, r.ToPort)
	case "icmp", "icmpv6":
		what = fmt.Sprintf("%s, type: %d, code: %d", strings.ToUpper(r.Protocol), r.FromPort, r.ToPort)
	default:
		what = r.Protocol
	}
	return fmt.Sprintf("peer: %s, %s, ALLOW", peer, what)
}

func parseRuleCIDR(raw string, v6 bool) (string, error) {
	p, err := netip.ParsePrefix(raw)
	if err != nil || p.Addr().Is4() == v6 || p.Masked() != p {
		return "", awserr.InvalidParameterValue("CIDR block %s is malformed", clip(raw))
	}
	return p.String(), nil
}

// peerGroup resolves a UserIdGroupPair to a group in g's VPC.
func peerGroup(tx *store.Tx, g *securityGroupRecord, pair types.UserIdGroupPair, account string) (string, error) {
	if pair.VpcPeeringConnectionId != nil || (pair.VpcId != nil && *pair.VpcId != g.VpcID) {
		return "", awserr.UnsupportedOperation("Security group references across VPC peering connections are not supported by hangar")
	}
	if u := deref(pair.UserId); u != "" && u != account {
		return "", awserr.New(400, "InvalidGroup.NotFound", "The security group of account %s does not exist on this host; only account %s exists here", clip(u), account)
	}
	var peer *securityGroupRecord
	switch {
	case deref(pair.GroupId) != "":
		p, err := get[securityGroupRecord](tx, kindSecurityGroup, *pair.GroupId)
		if err != nil {
			return "", err
		}
		peer = p
	case deref(pair.GroupName) != "":
		p, err := groupInVPC(tx, g.VpcID, *pair.GroupName)
		if err != nil {
			return "", err
		}
		if p == nil {
			return "", awserr.New(400, "InvalidGroup.NotFound", "The security group '%s' does not exist in VPC '%s'", clip(*pair.GroupName), g.VpcID)
		}
		peer = p
	default:
		return "", awserr.MissingParameter("groupId or groupName in a user/group pair")
	}
	if peer.VpcID != g.VpcID {
		return "", awserr.New(400, "InvalidGroup.NotFound", "You have specified two resources that belong to different networks.")
	}
	return peer.GroupID, nil
}

// expand turns IpPermissions into one rule per peer, validated and with
// group references resolved within g's VPC.
func (s *Service) expand(tx *store.Tx, g *securityGroupRecord, egress bool, perms []types.IpPermission) ([]sgRule, error) {
	var out []sgRule
	for _, p := range perms {
		if p.IpProtocol == nil {
			return nil, awserr.MissingParameter("ipProtocol")
		}
		proto, err := normalizeProtocol(*p.IpProtocol)
		if err != nil {
			return nil, err
		}
		from, to, err := portRange(proto, p.FromPort, p.ToPort)
		if err != nil {
			return nil, err
		}
		base := sgRule{Egress: egress, Protocol: proto, FromPort: from, ToPort: to}
		n := len(out)
		for _, r := range p.IpRanges {
			cidr, err := parseRuleCIDR(deref(r.CidrIp), false)
			if err != nil {
				return nil, err
			}
			rule := base
			rule.CIDR, rule.Description = cidr, deref(r.Description)
			out = append(out, rule)
		}
		for _, r := range p.Ipv6Ranges {
			cidr, err := parseRuleCIDR(deref(r.CidrIpv6), true)
			if err != nil {
				return nil, err
			}
			rule := base
			rule.IPv6CIDR, rule.Description = cidr, deref(r.Description)
			out = append(out, rule)
		}
		for _, r := range p.PrefixListIds {
			return nil, awserr.New(400, "InvalidPrefixListID.NotFound", "The prefix list ID '%s' does not exist", clip(deref(r.PrefixListId)))
		}
		for _, pair := range p.UserIdGroupPairs {
			id, err := peerGroup(tx, g, pair, s.account())
			if err != nil {
				return nil, err
			}
			rule := base
			rule.GroupID, rule.Description = id, deref(pair.Description)
			out = append(out, rule)
		}
		if len(out) == n {
			return nil, awserr.MissingParameter("Missing source specification")
		}
	}
	for _, r := range out {
		if err := checkRuleDescription(r.Description); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// legacyPermission turns the top-level CidrIp/IpProtocol/FromPort/ToPort/
// SourceSecurityGroupName form into IpPermissions. A source group name
// alone grants all of ICMP, TCP and UDP from that group, as EC2 documents.
func legacyPermission(cidr, proto *string, from, to *int32, srcName, srcOwner *string) ([]types.IpPermission, error) {
	if srcName != nil || srcOwner != nil {
		if cidr != nil || proto != nil || from != nil || to != nil {
			return nil, awserr.InvalidParameterCombination("SourceSecurityGroupName cannot be combined with CidrIp, IpProtocol, FromPort or ToPort; use IpPermissions")
		}
		if srcName == nil {
			return nil, awserr.MissingParameter("SourceSecurityGroupName")
		}
		pair := []types.UserIdGroupPair{{GroupName: srcName, UserId: srcOwner}}
		return []types.IpPermission{
			{IpProtocol: ptr("icmp"), FromPort: ptr(int32(-1)), ToPort: ptr(int32(-1)), UserIdGroupPairs: pair},
			{IpProtocol: ptr("tcp"), FromPort: ptr(int32(0)), ToPort: ptr(int32(65535)), UserIdGroupPairs: pair},
			{IpProtocol: ptr("udp"), FromPort: ptr(int32(0)), ToPort: ptr(int32(65535)), UserIdGroupPairs: pair},
		}, nil
	}
	if cidr == nil && proto == nil && from == nil && to == nil {
		return nil, nil
	}
	if proto == nil {
		return nil, awserr.MissingParameter("ipProtocol")
	}
	if cidr == nil {
		return nil, awserr.MissingParameter("Missing source specification")
	}
	return []types.IpPermission{{IpProtocol: proto, FromPort: from, ToPort: to, IpRanges: []types.IpRange{{CidrIp: cidr}}}}, nil
}

// permissionsOf returns the IpPermissions of an Authorize/Revoke request,
// from IpPermissions or the legacy form, never both.
func permissionsOf(perms []types.IpPermission, egress bool, cidr, proto *string, from, to *int32, srcName, srcOwner *string) ([]types.IpPermission, error) {
	legacy := cidr != nil || proto != nil || from != nil || to != nil || srcName != nil || srcOwner != nil
	if legacy && len(perms) > 0 {
		return nil, awserr.InvalidParameterCombination("The parameter IpPermissions cannot be used with CidrIp, IpProtocol, FromPort, ToPort or SourceSecurityGroupName")
	}
	if !legacy {
		return perms, nil
	}
	if egress {
		return nil, awserr.InvalidParameterValue("CidrIp, IpProtocol, FromPort, ToPort and SourceSecurityGroupName are not supported for egress rules; use IpPermissions")
	}
	return legacyPermission(cidr, proto, from, to, srcName, srcOwner)
}

// authorize adds rules to a group in one transaction.
func (s *Service) authorize(groupID, groupName *string, egress bool, perms []types.IpPermission, specs []types.TagSpecification) ([]types.SecurityGroupRule, error) {
	tags, err := tagSpecs(specs, types.ResourceTypeSecurityGroupRule)
	if err != nil {
		return nil, err
	}
	if len(perms) == 0 {
		return nil, awserr.MissingParameter("IpPermissions")
	}
	var out []types.SecurityGroupRule
	err = s.db.Update(func(tx *store.Tx) error {
		g, err := resolveGroup(tx, groupID, groupName)
		if err != nil {
			return err
		}
		rules, err := s.expand(tx, g, egress, perms)
		if err != nil {
			return err
		}
		have := map[string]bool{}
		count := 0
		for _, r := range g.Rules {
			have[ruleKey(r)] = true
			if r.Egress == egress {
				count++
			}
		}
		for _, r := range rules {
			k := ruleKey(r)
			if have[k] {
				return awserr.New(400, "InvalidPermission.Duplicate", "the specified rule \"%s\" already exists", describeRule(r))
			}
			have[k] = true
		}
		if count+len(rules) > maxRulesPerDirection {
			return awserr.New(400, "RulesPerSecurityGroupLimitExceeded", "The maximum number of rules per security group has been reached.")
		}
		added, err := addRules(tx, g, rules, tags)
		if err != nil {
			return err
		}
		if err := put(tx, kindSecurityGroup, g.GroupID, g); err != nil {
			return err
		}
		for _, r := range added {
			out = append(out, s.ruleView(g, r, tagsOf(tx, r.ID)))
		}
		return nil
	})
	return out, err
}

// AuthorizeSecurityGroupIngress adds inbound rules.
func (s *Service) AuthorizeSecurityGroupIngress(ctx context.Context, in *ec2.AuthorizeSecurityGroupIngressInput) (*ec2.AuthorizeSecurityGroupIngressOutput, error) {
	perms, err := permissionsOf(in.IpPermissions, false, in.CidrIp, in.IpProtocol, in.FromPort, in.ToPort, in.SourceSecurityGroupName, in.SourceSecurityGroupOwnerId)
	if err != nil {
		return nil, err
	}
	rules, err := s.authorize(in.GroupId, in.GroupName, false, perms, in.TagSpecifications)
	if err != nil {
		return nil, err
	}
	return &ec2.AuthorizeSecurityGroupIngressOutput{Return: ptr(true), SecurityGroupRules: rules}, nil
}

// AuthorizeSecurityGroupEgress adds outbound rules.
func (s *Service) AuthorizeSecurityGroupEgress(ctx context.Context, in *ec2.AuthorizeSecurityGroupEgressInput) (*ec2.AuthorizeSecurityGroupEgressOutput, error) {
	if in.GroupId == nil {
		return nil, awserr.MissingParameter("GroupId")
	}
	perms, err := permissionsOf(in.IpPermissions, true, in.CidrIp, in.IpProtocol, in.FromPort, in.ToPort, in.SourceSecurityGroupName, in.SourceSecurityGroupOwnerId)
	if err != nil {
		return nil, err
	}
	rules, err := s.authorize(in.GroupId, nil, true, perms, in.TagSpecifications)
	if err != nil {
		return nil, err
	}
	return &ec2.AuthorizeSecurityGroupEgressOutput{Return: ptr(true), SecurityGroupRules: rules}, nil
}

// revoke removes rules named by IpPermissions or by rule id. Permissions
// that match no rule are reported back as UnknownIpPermissions; when none
// matches at all the request fails, as EC2's does.
func (s *Service) revoke(groupID, groupName *string, egress bool, perms []types.IpPermission, ruleIDs []string) (revoked []types.RevokedSecurityGroupRule, unknown []types.IpPermission, err error) {
	if len(perms) > 0 && len(ruleIDs) > 0 {
		return nil, nil, awserr.InvalidParameterCombination("The parameter SecurityGroupRuleIds cannot be used with IpPermissions")
	}
	if len(perms) == 0 && len(ruleIDs) == 0 {
		return nil, nil, awserr.MissingParameter("IpPermissions or SecurityGroupRuleIds")
	}
	err = s.db.Update(func(tx *store.Tx) error {
		g, err := resolveGroup(tx, groupID, groupName)
		if err != nil {
			return err
		}
		drop := map[string]bool{}
		if len(ruleIDs) > 0 {
			byID := map[string]sgRule{}
			for _, r := range g.Rules {
				byID[r.ID] = r
			}
			for _, id := range ruleIDs {
				if err := kindSecurityGroupRule.check(id); err != nil {
					return err
				}
				if r, ok := byID[id]; !ok || r.Egress != egress {
					return kindSecurityGroupRule.notFound(id)
				}
				drop[id] = true
			}
		} else {
			want, err := s.expand(tx, g, egress, perms)
			if err != nil {
				return err
			}
			byKey := map[string]string{}
			for _, r := range g.Rules {
				byKey[ruleKey(r)] = r.ID
			}
			var missing []sgRule
			for _, r := range want {
				if id, ok := byKey[ruleKey(r)]; ok {
					drop[id] = true
				} else {
					missing = append(missing, r)
				}
			}
			if len(drop) == 0 {
				return awserr.New(400, "InvalidPermission.NotFound", "The specified rule does not exist in this security group")
			}
			unknown = ipPermissions(missing, egress, g.OwnerID)
		}
		kept := g.Rules[:0]
		for _, r := range g.Rules {
			if !drop[r.ID] {
				kept = append(kept, r)
				continue
			}
			rr := types.RevokedSecurityGroupRule{
				SecurityGroupRuleId: ptr(r.ID), GroupId: ptr(g.GroupID), IsEgress: ptr(r.Egress), IpProtocol: ptr(r.Protocol),
				FromPort: ptr(r.FromPort), ToPort: ptr(r.ToPort), Description: optional(r.Description),
				CidrIpv4: optional(r.CIDR), CidrIpv6: optional(r.IPv6CIDR), PrefixListId: optional(r.PrefixList), ReferencedGroupId: optional(r.GroupID),
			}
			revoked = append(revoked, rr)
			if err := remove(tx, kindSecurityGroupRule, r.ID); err != nil {
				return err
			}
		}
		g.Rules = kept
		return put(tx, kindSecurityGroup, g.GroupID, g)
	})
	return revoked, unknown, err
}

// RevokeSecurityGroupIngress removes inbound rules.
func (s *Service) RevokeSecurityGroupIngress(ctx context.Context, in *ec2.RevokeSecurityGroupIngressInput) (*ec2.RevokeSecurityGroupIngressOutput, error) {
	perms, err := permissionsOf(in.IpPermissions, false, in.CidrIp, in.IpProtocol, in.FromPort, in.ToPort, in.SourceSecurityGroupName, in.SourceSecurityGroupOwnerId)
	if err != nil {
		return nil, err
	}
	revoked, unknown, err := s.revoke(in.GroupId, in.GroupName, false, perms, in.SecurityGroupRuleIds)
	if err != nil {
		return nil, err
	}
	return &ec2.RevokeSecurityGroupIngressOutput{Return: ptr(true), RevokedSecurityGroupRules: revoked, UnknownIpPermissions: unknown}, nil
}

// RevokeSecurityGroupEgress removes outbound rules.
func (s *Service) RevokeSecurityGroupEgress(ctx context.Context, in *ec2.RevokeSecurityGroupEgressInput) (*ec2.RevokeSecurityGroupEgressOutput, error) {
	if in.GroupId == nil {
		return nil, awserr.MissingParameter("GroupId")
	}
	perms, err := permissionsOf(in.IpPermissions, true, in.CidrIp, in.IpProtocol, in.FromPort, in.ToPort, in.SourceSecurityGroupName, in.SourceSecurityGroupOwnerId)
	if err != nil {
		return nil, err
	}
	revoked, unknown, err := s.revoke(in.GroupId, nil, true, perms, in.SecurityGroupRuleIds)
	if err != nil {
		return nil, err
	}
	return &ec2.RevokeSecurityGroupEgressOutput{Return: ptr(true), RevokedSecurityGroupRules: revoked, UnknownIpPermissions: unknown}, nil
}

// ruleRow is one rule with its group, for DescribeSecurityGroupRules.
type ruleRow struct {
	group *securityGroupRecord
	rule  sgRule
}

var sgRuleFilters = filterSet[ruleRow]{
	"group-id":               func(r *ruleRow) []string { return []string{r.group.GroupID} },
	"security-group-rule-id": func(r *ruleRow) []string { return []string{r.rule.ID} },
}

// DescribeSecurityGroupRules lists rules, in rule id order.
func (s *Service) DescribeSecurityGroupRules(ctx context.Context, in *ec2.DescribeSecurityGroupRulesInput) (*ec2.DescribeSecurityGroupRulesOutput, error) {
	match, err := sgRuleFilters.compile(in.Filters)
	if err != nil {
		return nil, err
	}
	p, err := newPager(in.MaxResults, in.NextToken, 5, 1000)
	if err != nil {
		return nil, err
	}
	out := &ec2.DescribeSecurityGroupRulesOutput{SecurityGroupRules: []types.SecurityGroupRule{}}
	err = s.db.View(func(tx *store.Tx) error {
		want := map[string]bool{}
		for _, id := range in.SecurityGroupRuleIds {
			if err := kindSecurityGroupRule.check(id); err != nil {
				return err
			}
			want[id] = true
		}
		var rows []ruleRow
		seen := map[string]bool{}
		err := tx.Each(kindSecurityGroup.Prefix, "", func(_ string, decode func(any) error) (bool, error) {
			g := &securityGroupRecord{}
			if err := decode(g); err != nil {
				return false, err
			}
			for _, r := range g.Rules {
				if len(want) > 0 && !want[r.ID] {
					continue
				}
				seen[r.ID] = true
				row := ruleRow{group: g, rule: r}
				if match(&row, tagsOf(tx, r.ID)) {
					rows = append(rows, row)
				}
			}
			return true, nil
		})
		if err != nil {
			return err
		}
		var missing []string
		for _, id := range in.SecurityGroupRuleIds {
			if !seen[id] {
				missing = append(missing, id)
			}
		}
		if len(missing) > 0 {
			return kindSecurityGroupRule.notFound(missing...)
		}
		sort.Slice(rows, func(i, j int) bool { return rows[i].rule.ID < rows[j].rule.ID })
		n := 0
		for _, row := range rows {
			if len(want) == 0 && p.after != "" && row.rule.ID <= p.after {
				continue
			}
			if len(want) == 0 && p.max > 0 && n == p.max {
				out.NextToken = token(*out.SecurityGroupRules[n-1].SecurityGroupRuleId)
				break
			}
			out.SecurityGroupRules = append(out.SecurityGroupRules, s.ruleView(row.group, row.rule, tagsOf(tx, row.rule.ID)))
			n++
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// ruleFromRequest validates a SecurityGroupRuleRequest (ModifySecurityGroupRules).
func (s *Service) ruleFromRequest(tx *store.Tx, g *securityGroupRecord, egress bool, req *types.SecurityGroupRuleRequest) (sgRule, error) {
	if req == nil {
		return sgRule{}, awserr.MissingParameter("SecurityGroupRule")
	}
	p := types.IpPermission{IpProtocol: req.IpProtocol, FromPort: req.FromPort, ToPort: req.ToPort}
	peers := 0
	if req.CidrIpv4 != nil {
		p.IpRanges = []types.IpRange{{CidrIp: req.CidrIpv4, Description: req.Description}}
		peers++
	}
	if req.CidrIpv6 != nil {
		p.Ipv6Ranges = []types.Ipv6Range{{CidrIpv6: req.CidrIpv6, Description: req.Description}}
		peers++
	}
	if req.PrefixListId != nil {
		p.PrefixListIds = []types.PrefixListId{{PrefixListId: req.PrefixListId, Description: req.Description}}
		peers++
	}
	if req.ReferencedGroupId != nil {
		p.UserIdGroupPairs = []types.UserIdGroupPair{{GroupId: req.ReferencedGroupId, Description: req.Description}}
		peers++
	}
	if peers > 1 {
		return sgRule{}, awserr.InvalidParameterCombination("A security group rule has one of CidrIpv4, CidrIpv6, PrefixListId or ReferencedGroupId")
	}
	rules, err := s.expand(tx, g, egress, []types.IpPermission{p})
	if err != nil {
		return sgRule{}, err
	}
	return rules[0], nil
}

// ModifySecurityGroupRules replaces rules in place, keeping their ids.
func (s *Service) ModifySecurityGroupRules(ctx context.Context, in *ec2.ModifySecurityGroupRulesInput) (*ec2.ModifySecurityGroupRulesOutput, error) {
	if in.GroupId == nil {
		return nil, awserr.MissingParameter("GroupId")
	}
	if len(in.SecurityGroupRules) == 0 {
		return nil, awserr.MissingParameter("SecurityGroupRule")
	}
	err := s.db.Update(func(tx *store.Tx) error {
		g, err := get[securityGroupRecord](tx, kindSecurityGroup, *in.GroupId)
		if err != nil {
			return err
		}
		index := map[string]int{}
		for i, r := range g.Rules {
			index[r.ID] = i
		}
		for _, u := range in.SecurityGroupRules {
			id := deref(u.SecurityGroupRuleId)
			if err := kindSecurityGroupRule.check(id); err != nil {
				return err
			}
			i, ok := index[id]
			if !ok {
				return kindSecurityGroupRule.notFound(id)
			}
			r, err := s.ruleFromRequest(tx, g, g.Rules[i].Egress, u.SecurityGroupRule)
			if err != nil {
				return err
			}
			r.ID = id
			for j, other := range g.Rules {
				if j != i && ruleKey(other) == ruleKey(r) {
					return awserr.New(400, "InvalidPermission.Duplicate", "the specified rule \"%s\" already exists", describeRule(r))
				}
			}
			g.Rules[i] = r
		}
		return put(tx, kindSecurityGroup, g.GroupID, g)
	})
	if err != nil {
		return nil, err
	}
	return &ec2.ModifySecurityGroupRulesOutput{Return: ptr(true)}, nil
}

// updateDescriptions sets rule descriptions, by IpPermissions (matched as
// Revoke matches) or by rule id.
func (s *Service) updateDescriptions(groupID, groupName *string, egress bool, perms []types.IpPermission, byID []types.SecurityGroupRuleDescription) error {
	if len(perms) == 0 && len(byID) == 0 {
		return awserr.MissingParameter("IpPermissions or SecurityGroupRuleDescriptions")
	}
	return s.db.Update(func(tx *store.Tx) error {
		g, err := resolveGroup(tx, groupID, groupName)
		if err != nil {
			return err
		}
		for _, d := range byID {
			id := deref(d.SecurityGroupRuleId)
			if err := checkRuleDescription(deref(d.Description)); err != nil {
				return err
			}
			found := false
			for i := range g.Rules {
				if g.Rules[i].ID == id && g.Rules[i].Egress == egress {
					g.Rules[i].Description = deref(d.Description)
					found = true
				}
			}
			if !found {
				if err := kindSecurityGroupRule.check(id); err != nil {
					return err
				}
				return kindSecurityGroupRule.notFound(id)
			}
		}
		if len(perms) > 0 {
			want, err := s.expand(tx, g, egress, perms)
			if err != nil {
				return err
			}
			for _, w := range want {
				found := false
				for i := range g.Rules {
					if ruleKey(g.Rules[i]) == ruleKey(w) {
						g.Rules[i].Description = w.Description
						found = true
					}
				}
				if !found {
					return awserr.New(400, "InvalidPermission.NotFound", "The specified rule does not exist in this security group")
				}
			}
		}
		return put(tx, kindSecurityGroup, g.GroupID, g)
	})
}

// UpdateSecurityGroupRuleDescriptionsIngress sets inbound rule descriptions.
func (s *Service) UpdateSecurityGroupRuleDescriptionsIngress(ctx context.Context, in *ec2.UpdateSecurityGroupRuleDescriptionsIngressInput) (*ec2.UpdateSecurityGroupRuleDescriptionsIngressOutput, error) {
	if err := s.updateDescriptions(in.GroupId, in.GroupName, false, in.IpPermissions, in.SecurityGroupRuleDescriptions); err != nil {
		return nil, err
	}
	return &ec2.UpdateSecurityGroupRuleDescriptionsIngressOutput{Return: ptr(true)}, nil
}

// UpdateSecurityGroupRuleDescriptionsEgress sets outbound rule descriptions.
func (s *Service) UpdateSecurityGroupRuleDescriptionsEgress(ctx context.Context, in *ec2.UpdateSecurityGroupRuleDescriptionsEgressInput) (*ec2.UpdateSecurityGroupRuleDescriptionsEgressOutput, error) {
	if in.GroupId == nil && in.GroupName == nil {
		return nil, awserr.MissingParameter("GroupId")
	}
	if err := s.updateDescriptions(in.GroupId, in.GroupName, true, in.IpPermissions, in.SecurityGroupRuleDescriptions); err != nil {
		return nil, err
	}
	return &ec2.UpdateSecurityGroupRuleDescriptionsEgressOutput{Return: ptr(true)}, nil
}
