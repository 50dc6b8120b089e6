package ec2

import (
	"fmt"
	"sort"
	"strings"
	"testing"

	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"

	"hangar.dev/hangar/services/internal/store"
)

func tcp(from, to int32, cidrs ...string) types.IpPermission {
	p := types.IpPermission{IpProtocol: ptr("tcp"), FromPort: ptr(from), ToPort: ptr(to)}
	for _, c := range cidrs {
		p.IpRanges = append(p.IpRanges, types.IpRange{CidrIp: ptr(c)})
	}
	return p
}

func fromGroup(proto string, from, to int32, groups ...string) types.IpPermission {
	p := types.IpPermission{IpProtocol: ptr(proto), FromPort: ptr(from), ToPort: ptr(to)}
	for _, g := range groups {
		p.UserIdGroupPairs = append(p.UserIdGroupPairs, types.UserIdGroupPair{GroupId: ptr(g)})
	}
	return p
}

func describeSG(t *testing.T, s *Service, id string) types.SecurityGroup {
	t.Helper()
	out, err := s.DescribeSecurityGroups(bg, &ec2.DescribeSecurityGroupsInput{GroupIds: []string{id}})
	if err != nil {
		t.Fatal(err)
	}
	if len(out.SecurityGroups) != 1 {
		t.Fatalf("describe %s: %d groups", id, len(out.SecurityGroups))
	}
	encodes(t, "DescribeSecurityGroups", out)
	return out.SecurityGroups[0]
}

func TestCreateSecurityGroup(t *testing.T) {
	s := newSvc(t)
	vpc := mkVPC(t, s, "10.0.0.0/16")
	mkSG(t, s, vpc, "web")
	long := strings.Repeat("a", 256)
	for _, tc := range []struct {
		name string
		in   ec2.CreateSecurityGroupInput
		code string
	}{
		{name: "in a VPC", in: ec2.CreateSecurityGroupInput{VpcId: &vpc, GroupName: ptr("app"), Description: ptr("app tier"), TagSpecifications: tagSpec(types.ResourceTypeSecurityGroup, "Name", "app")}},
		{name: "in the default VPC", in: ec2.CreateSecurityGroupInput{GroupName: ptr("web"), Description: ptr("same name, other VPC")}},
		{name: "every allowed character", in: ec2.CreateSecurityGroupInput{VpcId: &vpc, GroupName: ptr("a-Z 0._:/()#,@[]+=&;{}!$*"), Description: ptr("ok ._-:/()#,@[]+=&;{}!$*")}},
		{name: "a name the VPC has", in: ec2.CreateSecurityGroupInput{VpcId: &vpc, GroupName: ptr("web"), Description: ptr("x")}, code: "InvalidGroup.Duplicate"},
		{name: "the reserved name", in: ec2.CreateSecurityGroupInput{VpcId: &vpc, GroupName: ptr("default"), Description: ptr("x")}, code: "InvalidGroup.Reserved"},
		{name: "an sg- name", in: ec2.CreateSecurityGroupInput{VpcId: &vpc, GroupName: ptr("sg-123"), Description: ptr("x")}, code: "InvalidParameterValue"},
		{name: "a bad character", in: ec2.CreateSecurityGroupInput{VpcId: &vpc, GroupName: ptr("web|db"), Description: ptr("x")}, code: "InvalidParameterValue"},
		{name: "a long name", in: ec2.CreateSecurityGroupInput{VpcId: &vpc, GroupName: &long, Description: ptr("x")}, code: "InvalidParameterValue"},
		{name: "a non-ASCII description", in: ec2.CreateSecurityGroupInput{VpcId: &vpc, GroupName: ptr("n"), Description: ptr("café")}, code: "InvalidParameterValue"},
		{name: "no description", in: ec2.CreateSecurityGroupInput{VpcId: &vpc, GroupName: ptr("n"), Description: ptr("")}, code: "MissingParameter"},
		{name: "no name", in: ec2.CreateSecurityGroupInput{VpcId: &vpc, Description: ptr("x")}, code: "MissingParameter"},
		{name: "a VPC that does not exist", in: ec2.CreateSecurityGroupInput{VpcId: ptr("vpc-0123456789abcdef0"), GroupName: ptr("n"), Description: ptr("x")}, code: "InvalidVpcID.NotFound"},
		{name: "tags for a VPC", in: ec2.CreateSecurityGroupInput{VpcId: &vpc, GroupName: ptr("n"), Description: ptr("x"), TagSpecifications: tagSpec(types.ResourceTypeVpc, "a", "b")}, code: "InvalidParameterValue"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := snapshot(t, s)
			out, err := s.CreateSecurityGroup(bg, &tc.in)
			wantCode(t, err, tc.code)
			if err != nil {
				sameState(t, before, snapshot(t, s), "a failed CreateSecurityGroup")
				return
			}
			encodes(t, "CreateSecurityGroup", out)
			g := describeSG(t, s, *out.GroupId)
			if *g.GroupName != *tc.in.GroupName || *g.Description != *tc.in.Description || *g.OwnerId != testAccount {
				t.Fatalf("group = %+v", g)
			}
			if tc.in.VpcId == nil && *g.VpcId == vpc {
				t.Fatal("no VpcId did not mean the default VPC")
			}
			// A new group allows all traffic out and nothing in.
			if len(g.IpPermissions) != 0 || len(g.IpPermissionsEgress) != 1 || *g.IpPermissionsEgress[0].IpProtocol != "-1" ||
				*g.IpPermissionsEgress[0].IpRanges[0].CidrIp != "0.0.0.0/0" || g.IpPermissionsEgress[0].FromPort != nil {
				t.Fatalf("rules of a new group: in %+v out %+v", g.IpPermissions, g.IpPermissionsEgress)
			}
			if len(tc.in.TagSpecifications) > 0 && len(g.Tags) != 1 {
				t.Fatalf("tags = %+v", g.Tags)
			}
		})
	}
}

func TestAuthorizeIngress(t *testing.T) {
	s := newSvc(t)
	vpc := mkVPC(t, s, "10.0.0.0/16")
	web := mkSG(t, s, vpc, "web")
	db := mkSG(t, s, vpc, "db")
	elsewhere := mkSG(t, s, mkVPC(t, s, "10.1.0.0/16"), "elsewhere")

	for _, tc := range []struct {
		name  string
		perms []types.IpPermission
		code  string
		rules int
	}{
		{name: "ssh from anywhere", perms: []types.IpPermission{tcp(22, 22, "0.0.0.0/0")}, rules: 1},
		{name: "two CIDRs for https", perms: []types.IpPermission{tcp(443, 443, "10.0.0.0/8", "192.168.1.0/24")}, rules: 2},
		{name: "postgres from the web group", perms: []types.IpPermission{fromGroup("tcp", 5432, 5432, web)}, rules: 1},
		{name: "all traffic from itself", perms: []types.IpPermission{fromGroup("-1", 0, 0, db)}, rules: 1},
		{name: "icmp echo", perms: []types.IpPermission{{IpProtocol: ptr("icmp"), FromPort: ptr(int32(8)), ToPort: ptr(int32(-1)), IpRanges: []types.IpRange{{CidrIp: ptr("10.0.0.0/16")}}}}, rules: 1},
		{name: "protocol number 6 is tcp", perms: []types.IpPermission{{IpProtocol: ptr("6"), FromPort: ptr(int32(8080)), ToPort: ptr(int32(8090)), IpRanges: []types.IpRange{{CidrIp: ptr("10.9.0.0/16")}}}}, rules: 1},
		{name: "protocol 50 (ESP)", perms: []types.IpPermission{{IpProtocol: ptr("50"), IpRanges: []types.IpRange{{CidrIp: ptr("10.0.0.0/16")}}}}, rules: 1},
		{name: "udp dns with a description", perms: []types.IpPermission{{IpProtocol: ptr("UDP"), FromPort: ptr(int32(53)), ToPort: ptr(int32(53)), IpRanges: []types.IpRange{{CidrIp: ptr("10.0.0.2/32"), Description: ptr("VPC resolver")}}}}, rules: 1},
		{name: "an IPv6 range", perms: []types.IpPermission{{IpProtocol: ptr("tcp"), FromPort: ptr(int32(80)), ToPort: ptr(int32(80)), Ipv6Ranges: []types.Ipv6Range{{CidrIpv6: ptr("::/0")}}}}, rules: 1},
		{name: "the same rule again", perms: []types.IpPermission{tcp(22, 22, "0.0.0.0/0")}, code: "InvalidPermission.Duplicate"},
		{name: "a duplicate inside one request", perms: []types.IpPermission{tcp(23, 23, "1.2.3.0/24"), tcp(23, 23, "1.2.3.0/24")}, code: "InvalidPermission.Duplicate"},
		{name: "a port above 65535", perms: []types.IpPermission{tcp(70000, 70000, "0.0.0.0/0")}, code: "InvalidParameterValue"},
		{name: "a negative tcp port", perms: []types.IpPermission{tcp(-1, -1, "0.0.0.0/0")}, code: "InvalidParameterValue"},
		{name: "from above to", perms: []types.IpPermission{tcp(100, 99, "0.0.0.0/0")}, code: "InvalidParameterValue"},
		{name: "tcp without ports", perms: []types.IpPermission{{IpProtocol: ptr("tcp"), IpRanges: []types.IpRange{{CidrIp: ptr("0.0.0.0/0")}}}}, code: "InvalidParameterValue"},
		{name: "all icmp types but one code", perms: []types.IpPermission{{IpProtocol: ptr("icmp"), FromPort: ptr(int32(-1)), ToPort: ptr(int32(0)), IpRanges: []types.IpRange{{CidrIp: ptr("0.0.0.0/0")}}}}, code: "InvalidParameterValue"},
		{name: "icmp type 256", perms: []types.IpPermission{{IpProtocol: ptr("icmp"), FromPort: ptr(int32(256)), ToPort: ptr(int32(-1)), IpRanges: []types.IpRange{{CidrIp: ptr("0.0.0.0/0")}}}}, code: "InvalidParameterValue"},
		{name: "an unknown protocol", perms: []types.IpPermission{{IpProtocol: ptr("sctpx"), IpRanges: []types.IpRange{{CidrIp: ptr("0.0.0.0/0")}}}}, code: "InvalidParameterValue"},
		{name: "protocol 256", perms: []types.IpPermission{{IpProtocol: ptr("256"), IpRanges: []types.IpRange{{CidrIp: ptr("0.0.0.0/0")}}}}, code: "InvalidParameterValue"},
		{name: "no protocol", perms: []types.IpPermission{{IpRanges: []types.IpRange{{CidrIp: ptr("0.0.0.0/0")}}}}, code: "MissingParameter"},
		{name: "a bad CIDR", perms: []types.IpPermission{tcp(22, 22, "10.0.0.0/33")}, code: "InvalidParameterValue"},
		{name: "a CIDR with host bits", perms: []types.IpPermission{tcp(22, 22, "10.0.0.5/16")}, code: "InvalidParameterValue"},
		{name: "an IPv6 CIDR as IPv4", perms: []types.IpPermission{tcp(22, 22, "::/0")}, code: "InvalidParameterValue"},
		{name: "no source", perms: []types.IpPermission{tcp(22, 22)}, code: "MissingParameter"},
		{name: "a group in another VPC", perms: []types.IpPermission{fromGroup("tcp", 1, 1, elsewhere)}, code: "InvalidGroup.NotFound"},
		{name: "a group that does not exist", perms: []types.IpPermission{fromGroup("tcp", 1, 1, "sg-0123456789abcdef0")}, code: "InvalidGroup.NotFound"},
		{name: "a prefix list", perms: []types.IpPermission{{IpProtocol: ptr("tcp"), FromPort: ptr(int32(1)), ToPort: ptr(int32(1)), PrefixListIds: []types.PrefixListId{{PrefixListId: ptr("pl-12345678")}}}}, code: "InvalidPrefixListID.NotFound"},
		{name: "a bad rule description", perms: []types.IpPermission{{IpProtocol: ptr("tcp"), FromPort: ptr(int32(1)), ToPort: ptr(int32(1)), IpRanges: []types.IpRange{{CidrIp: ptr("1.1.1.1/32"), Description: ptr("naïve")}}}}, code: "InvalidParameterValue"},
		{name: "a good rule then a bad one", perms: []types.IpPermission{tcp(3000, 3000, "0.0.0.0/0"), tcp(3001, 3001, "bad")}, code: "InvalidParameterValue"},
		{name: "nothing", code: "MissingParameter"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := snapshot(t, s)
			n := len(describeSG(t, s, db).IpPermissions)
			out, err := s.AuthorizeSecurityGroupIngress(bg, &ec2.AuthorizeSecurityGroupIngressInput{GroupId: &db, IpPermissions: tc.perms})
			wantCode(t, err, tc.code)
			if err != nil {
				sameState(t, before, snapshot(t, s), "a failed AuthorizeSecurityGroupIngress")
				return
			}
			encodes(t, "AuthorizeSecurityGroupIngress", out)
			if !*out.Return || len(out.SecurityGroupRules) != tc.rules {
				t.Fatalf("output = %+v", out)
			}
			for _, r := range out.SecurityGroupRules {
				if !strings.HasPrefix(*r.SecurityGroupRuleId, "sgr-") || *r.GroupId != db || *r.IsEgress {
					t.Fatalf("rule = %+v", r)
				}
			}
			if got := len(describeSG(t, s, db).IpPermissions); got != n+1 {
				t.Fatalf("IpPermissions went from %d to %d; each request here adds one protocol/port group", n, got)
			}
		})
	}

	g := describeSG(t, s, db)
	byKey := map[string]types.IpPermission{}
	for _, p := range g.IpPermissions {
		byKey[fmt.Sprintf("%s/%d/%d", *p.IpProtocol, deref(p.FromPort), deref(p.ToPort))] = p
	}
	if p := byKey["tcp/443/443"]; len(p.IpRanges) != 2 {
		t.Fatalf("two CIDRs on one port are one IpPermission with two ranges: %+v", p)
	}
	if p := byKey["tcp/5432/5432"]; len(p.UserIdGroupPairs) != 1 || *p.UserIdGroupPairs[0].GroupId != web || *p.UserIdGroupPairs[0].UserId != testAccount {
		t.Fatalf("group reference: %+v", p)
	}
	if p := byKey["tcp/8080/8090"]; p.IpProtocol == nil {
		t.Fatalf("protocol 6 was not stored as tcp: %v", g.IpPermissions)
	}
	if p := byKey["icmp/8/-1"]; p.IpProtocol == nil {
		t.Fatalf("icmp type 8 all codes missing: %v", g.IpPermissions)
	}
	if p := byKey["-1/0/0"]; p.IpProtocol == nil || p.FromPort != nil {
		t.Fatalf("all-traffic rule shows ports or is missing: %+v", g.IpPermissions)
	}
	if p := byKey["50/0/0"]; p.IpProtocol == nil {
		t.Fatalf("protocol 50 missing: %+v", g.IpPermissions)
	}
	if p := byKey["udp/53/53"]; *p.IpRanges[0].Description != "VPC resolver" {
		t.Fatalf("description lost: %+v", p)
	}
}

func TestAuthorizeLegacyForm(t *testing.T) {
	s := newSvc(t)
	// The legacy top-level form names groups in the default VPC.
	web := must[*ec2.CreateSecurityGroupOutput](t)(s.CreateSecurityGroup(bg, &ec2.CreateSecurityGroupInput{GroupName: ptr("web"), Description: ptr("web")}))
	app := must[*ec2.CreateSecurityGroupOutput](t)(s.CreateSecurityGroup(bg, &ec2.CreateSecurityGroupInput{GroupName: ptr("app"), Description: ptr("app")}))

	out, err := s.AuthorizeSecurityGroupIngress(bg, &ec2.AuthorizeSecurityGroupIngressInput{GroupName: ptr("web"), IpProtocol: ptr("tcp"), FromPort: ptr(int32(80)), ToPort: ptr(int32(80)), CidrIp: ptr("0.0.0.0/0")})
	if err != nil || len(out.SecurityGroupRules) != 1 || *out.SecurityGroupRules[0].CidrIpv4 != "0.0.0.0/0" {
		t.Fatalf("legacy CIDR rule: %+v %v", out, err)
	}
	// A source group alone grants all of ICMP, TCP and UDP from it.
	out, err = s.AuthorizeSecurityGroupIngress(bg, &ec2.AuthorizeSecurityGroupIngressInput{GroupId: app.GroupId, SourceSecurityGroupName: ptr("web")})
	if err != nil || len(out.SecurityGroupRules) != 3 {
		t.Fatalf("legacy source group: %+v %v", out, err)
	}
	for _, r := range out.SecurityGroupRules {
		if *r.ReferencedGroupInfo.GroupId != *web.GroupId {
			t.Fatalf("rule = %+v", r)
		}
	}
	for _, tc := range []struct {
		name string
		in   ec2.AuthorizeSecurityGroupIngressInput
		code string
	}{
		{name: "both forms", in: ec2.AuthorizeSecurityGroupIngressInput{GroupId: app.GroupId, CidrIp: ptr("1.1.1.1/32"), IpProtocol: ptr("tcp"), FromPort: ptr(int32(1)), ToPort: ptr(int32(1)), IpPermissions: []types.IpPermission{tcp(2, 2, "1.1.1.1/32")}}, code: "InvalidParameterCombination"},
		{name: "a source group with ports", in: ec2.AuthorizeSecurityGroupIngressInput{GroupId: app.GroupId, SourceSecurityGroupName: ptr("web"), FromPort: ptr(int32(1))}, code: "InvalidParameterCombination"},
		{name: "a CIDR with no protocol", in: ec2.AuthorizeSecurityGroupIngressInput{GroupId: app.GroupId, CidrIp: ptr("1.1.1.1/32")}, code: "MissingParameter"},
		{name: "no group", in: ec2.AuthorizeSecurityGroupIngressInput{CidrIp: ptr("1.1.1.1/32"), IpProtocol: ptr("-1")}, code: "MissingParameter"},
		{name: "a name not in the default VPC", in: ec2.AuthorizeSecurityGroupIngressInput{GroupName: ptr("nope"), CidrIp: ptr("1.1.1.1/32"), IpProtocol: ptr("-1")}, code: "InvalidGroup.NotFound"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := snapshot(t, s)
			_, err := s.AuthorizeSecurityGroupIngress(bg, &tc.in)
			wantCode(t, err, tc.code)
			sameState(t, before, snapshot(t, s), "a failed legacy authorize")
		})
	}
	// Egress has no legacy form.
	_, err = s.AuthorizeSecurityGroupEgress(bg, &ec2.AuthorizeSecurityGroupEgressInput{GroupId: app.GroupId, CidrIp: ptr("1.1.1.1/32"), IpProtocol: ptr("-1")})
	wantCode(t, err, "InvalidParameterValue")
}

func TestEgressAndRevoke(t *testing.T) {
	s := newSvc(t)
	vpc := mkVPC(t, s, "10.0.0.0/16")
	g := mkSG(t, s, vpc, "locked")
	all := types.IpPermission{IpProtocol: ptr("-1"), IpRanges: []types.IpRange{{CidrIp: ptr("0.0.0.0/0")}}}
	// Replace "all out" with https out only.
	rev := must[*ec2.RevokeSecurityGroupEgressOutput](t)(s.RevokeSecurityGroupEgress(bg, &ec2.RevokeSecurityGroupEgressInput{GroupId: &g, IpPermissions: []types.IpPermission{all}}))
	encodes(t, "RevokeSecurityGroupEgress", rev)
	if len(rev.UnknownIpPermissions) != 0 || len(rev.RevokedSecurityGroupRules) != 1 {
		t.Fatalf("revoke egress = %+v", rev)
	}
	must[*ec2.AuthorizeSecurityGroupEgressOutput](t)(s.AuthorizeSecurityGroupEgress(bg, &ec2.AuthorizeSecurityGroupEgressInput{GroupId: &g, IpPermissions: []types.IpPermission{tcp(443, 443, "0.0.0.0/0")}}))
	sg := describeSG(t, s, g)
	if len(sg.IpPermissionsEgress) != 1 || *sg.IpPermissionsEgress[0].FromPort != 443 || len(sg.IpPermissions) != 0 {
		t.Fatalf("egress = %+v ingress = %+v", sg.IpPermissionsEgress, sg.IpPermissions)
	}

	must[*ec2.AuthorizeSecurityGroupIngressOutput](t)(s.AuthorizeSecurityGroupIngress(bg, &ec2.AuthorizeSecurityGroupIngressInput{GroupId: &g, IpPermissions: []types.IpPermission{tcp(22, 22, "10.0.0.0/8", "192.168.0.0/16")}}))

	// Revoking what is not there fails and changes nothing.
	before := snapshot(t, s)
	_, err := s.RevokeSecurityGroupIngress(bg, &ec2.RevokeSecurityGroupIngressInput{GroupId: &g, IpPermissions: []types.IpPermission{tcp(23, 23, "10.0.0.0/8")}})
	wantCode(t, err, "InvalidPermission.NotFound")
	// The egress rule is not an ingress rule.
	_, err = s.RevokeSecurityGroupIngress(bg, &ec2.RevokeSecurityGroupIngressInput{GroupId: &g, IpPermissions: []types.IpPermission{tcp(443, 443, "0.0.0.0/0")}})
	wantCode(t, err, "InvalidPermission.NotFound")
	sameState(t, before, snapshot(t, s), "a failed revoke")

	// One known and one unknown: the known goes, the unknown is reported.
	out := must[*ec2.RevokeSecurityGroupIngressOutput](t)(s.RevokeSecurityGroupIngress(bg, &ec2.RevokeSecurityGroupIngressInput{GroupId: &g,
		IpPermissions: []types.IpPermission{tcp(22, 22, "10.0.0.0/8", "172.16.0.0/12")}}))
	if len(out.UnknownIpPermissions) != 1 || *out.UnknownIpPermissions[0].IpRanges[0].CidrIp != "172.16.0.0/12" || len(out.RevokedSecurityGroupRules) != 1 {
		t.Fatalf("partial revoke = %+v", out)
	}
	sg = describeSG(t, s, g)
	if len(sg.IpPermissions) != 1 || len(sg.IpPermissions[0].IpRanges) != 1 || *sg.IpPermissions[0].IpRanges[0].CidrIp != "192.168.0.0/16" {
		t.Fatalf("after partial revoke: %+v", sg.IpPermissions)
	}

	// By rule id; the egress rule's id is not an ingress rule.
	rules := must[*ec2.DescribeSecurityGroupRulesOutput](t)(s.DescribeSecurityGroupRules(bg, &ec2.DescribeSecurityGroupRulesInput{Filters: []types.Filter{filter("group-id", g)}}))
	var in, eg string
	for _, r := range rules.SecurityGroupRules {
		if *r.IsEgress {
			eg = *r.SecurityGroupRuleId
		} else {
			in = *r.SecurityGroupRuleId
		}
	}
	_, err = s.RevokeSecurityGroupIngress(bg, &ec2.RevokeSecurityGroupIngressInput{GroupId: &g, SecurityGroupRuleIds: []string{eg}})
	wantCode(t, err, "InvalidSecurityGroupRuleId.NotFound")
	_, err = s.RevokeSecurityGroupIngress(bg, &ec2.RevokeSecurityGroupIngressInput{GroupId: &g, SecurityGroupRuleIds: []string{in}, IpPermissions: []types.IpPermission{tcp(1, 1, "1.1.1.1/32")}})
	wantCode(t, err, "InvalidParameterCombination")
	must[*ec2.RevokeSecurityGroupIngressOutput](t)(s.RevokeSecurityGroupIngress(bg, &ec2.RevokeSecurityGroupIngressInput{GroupId: &g, SecurityGroupRuleIds: []string{in}}))
	if sg := describeSG(t, s, g); len(sg.IpPermissions) != 0 {
		t.Fatalf("rule id revoke left %+v", sg.IpPermissions)
	}
	// The revoked rule's id is gone from the index: it cannot be tagged.
	_, err = s.CreateTags(bg, &ec2.CreateTagsInput{Resources: []string{in}, Tags: []types.Tag{{Key: ptr("k"), Value: ptr("v")}}})
	wantCode(t, err, "InvalidSecurityGroupRuleId.NotFound")
}

func TestDescribeSecurityGroupsFilters(t *testing.T) {
	s := newSvc(t)
	vpc := mkVPC(t, s, "10.0.0.0/16")
	web := mkSG(t, s, vpc, "web")
	db := mkSG(t, s, vpc, "db")
	must[*ec2.AuthorizeSecurityGroupIngressOutput](t)(s.AuthorizeSecurityGroupIngress(bg, &ec2.AuthorizeSecurityGroupIngressInput{GroupId: &web, IpPermissions: []types.IpPermission{tcp(443, 443, "0.0.0.0/0")}}))
	must[*ec2.AuthorizeSecurityGroupIngressOutput](t)(s.AuthorizeSecurityGroupIngress(bg, &ec2.AuthorizeSecurityGroupIngressInput{GroupId: &db, IpPermissions: []types.IpPermission{fromGroup("tcp", 5432, 5432, web)}}))
	must[*ec2.CreateTagsOutput](t)(s.CreateTags(bg, &ec2.CreateTagsInput{Resources: []string{db}, Tags: []types.Tag{{Key: ptr("tier"), Value: ptr("data")}}}))
	def := must[*ec2.DescribeVpcsOutput](t)(s.DescribeVpcs(bg, &ec2.DescribeVpcsInput{VpcIds: []string{vpc}}))
	_ = def
	for _, tc := range []struct {
		filters []types.Filter
		want    []string
		code    string
	}{
		{filters: []types.Filter{filter("vpc-id", vpc), filter("group-name", "web", "db")}, want: []string{"db", "web"}},
		{filters: []types.Filter{filter("vpc-id", vpc)}, want: []string{"db", "default", "web"}},
		{filters: []types.Filter{filter("vpc-id", vpc), filter("ip-permission.from-port", "443")}, want: []string{"web"}},
		{filters: []types.Filter{filter("vpc-id", vpc), filter("ip-permission.cidr", "0.0.0.0/0")}, want: []string{"web"}},
		{filters: []types.Filter{filter("vpc-id", vpc), filter("ip-permission.group-id", web)}, want: []string{"db"}},
		{filters: []types.Filter{filter("vpc-id", vpc), filter("ip-permission.group-name", "web")}, want: []string{"db"}},
		{filters: []types.Filter{filter("vpc-id", vpc), filter("ip-permission.protocol", "tcp")}, want: []string{"db", "web"}},
		{filters: []types.Filter{filter("vpc-id", vpc), filter("ip-permission.protocol", "-1")}, want: []string{"default"}},
		{filters: []types.Filter{filter("vpc-id", vpc), filter("ip-permission.user-id", testAccount)}, want: []string{"db", "default"}},
		{filters: []types.Filter{filter("vpc-id", vpc), filter("egress.ip-permission.cidr", "0.0.0.0/0")}, want: []string{"db", "default", "web"}},
		{filters: []types.Filter{filter("vpc-id", vpc), filter("egress.ip-permission.to-port", "443")}, want: nil},
		{filters: []types.Filter{filter("vpc-id", vpc), filter("description", "test group *")}, want: []string{"db", "web"}},
		{filters: []types.Filter{filter("tag:tier", "data")}, want: []string{"db"}},
		{filters: []types.Filter{filter("tag-key", "tier")}, want: []string{"db"}},
		{filters: []types.Filter{filter("ip-permission.nonsense", "x")}, code: "InvalidParameterValue"},
	} {
		out, err := s.DescribeSecurityGroups(bg, &ec2.DescribeSecurityGroupsInput{Filters: tc.filters})
		wantCode(t, err, tc.code)
		if err != nil {
			continue
		}
		var got []string
		for _, g := range out.SecurityGroups {
			got = append(got, *g.GroupName)
		}
		sort.Strings(got)
		if fmt.Sprint(got) != fmt.Sprint(tc.want) {
			t.Errorf("filters %v: got %v, want %v", tc.filters, got, tc.want)
		}
	}

	// GroupNames look in the default VPC only.
	out := must[*ec2.DescribeSecurityGroupsOutput](t)(s.DescribeSecurityGroups(bg, &ec2.DescribeSecurityGroupsInput{GroupNames: []string{"default"}}))
	if len(out.SecurityGroups) != 1 || *out.SecurityGroups[0].VpcId == vpc {
		t.Fatalf("GroupNames=default: %+v", out.SecurityGroups)
	}
	_, err := s.DescribeSecurityGroups(bg, &ec2.DescribeSecurityGroupsInput{GroupNames: []string{"web"}})
	wantCode(t, err, "InvalidGroup.NotFound")
	_, err = s.DescribeSecurityGroups(bg, &ec2.DescribeSecurityGroupsInput{GroupIds: []string{"sg-0123456789abcdef0"}})
	wantCode(t, err, "InvalidGroup.NotFound")
	_, err = s.DescribeSecurityGroups(bg, &ec2.DescribeSecurityGroupsInput{GroupIds: []string{"sg-bad"}})
	wantCode(t, err, "InvalidGroupId.Malformed")

	// Pages.
	for i := range 9 {
		mkSG(t, s, vpc, fmt.Sprintf("extra-%d", i))
	}
	ids, pages := pageAll(t, func(tok *string) ([]string, *string, error) {
		out, err := s.DescribeSecurityGroups(bg, &ec2.DescribeSecurityGroupsInput{MaxResults: ptr(int32(5)), NextToken: tok, Filters: []types.Filter{filter("vpc-id", vpc)}})
		if err != nil {
			return nil, nil, err
		}
		var ids []string
		for _, g := range out.SecurityGroups {
			ids = append(ids, *g.GroupId)
		}
		return ids, out.NextToken, nil
	})
	if len(ids) != 12 || pages != 3 {
		t.Fatalf("%d groups over %d pages", len(ids), pages)
	}
}

func TestDescribeSecurityGroupRules(t *testing.T) {
	s := newSvc(t)
	vpc := mkVPC(t, s, "10.0.0.0/16")
	g := mkSG(t, s, vpc, "g")
	auth := must[*ec2.AuthorizeSecurityGroupIngressOutput](t)(s.AuthorizeSecurityGroupIngress(bg, &ec2.AuthorizeSecurityGroupIngressInput{GroupId: &g,
		IpPermissions:     []types.IpPermission{tcp(1, 10, "10.0.0.0/24", "10.0.1.0/24", "10.0.2.0/24", "10.0.3.0/24", "10.0.4.0/24", "10.0.5.0/24")},
		TagSpecifications: tagSpec(types.ResourceTypeSecurityGroupRule, "purpose", "test")}))
	if len(auth.SecurityGroupRules) != 6 || len(auth.SecurityGroupRules[0].Tags) != 1 {
		t.Fatalf("authorize with tags = %+v", auth.SecurityGroupRules)
	}
	first := *auth.SecurityGroupRules[0].SecurityGroupRuleId

	out := must[*ec2.DescribeSecurityGroupRulesOutput](t)(s.DescribeSecurityGroupRules(bg, &ec2.DescribeSecurityGroupRulesInput{Filters: []types.Filter{filter("group-id", g)}}))
	encodes(t, "DescribeSecurityGroupRules", out)
	if len(out.SecurityGroupRules) != 7 {
		t.Fatalf("rules = %d, want 6 ingress + 1 egress", len(out.SecurityGroupRules))
	}
	for _, r := range out.SecurityGroupRules {
		if *r.GroupOwnerId != testAccount || r.FromPort == nil {
			t.Fatalf("rule = %+v", r)
		}
		if *r.IsEgress && (*r.IpProtocol != "-1" || *r.FromPort != -1 || *r.CidrIpv4 != "0.0.0.0/0") {
			t.Fatalf("default egress rule = %+v", r)
		}
	}
	out = must[*ec2.DescribeSecurityGroupRulesOutput](t)(s.DescribeSecurityGroupRules(bg, &ec2.DescribeSecurityGroupRulesInput{Filters: []types.Filter{filter("tag:purpose", "test")}}))
	if len(out.SecurityGroupRules) != 6 {
		t.Fatalf("tag filter: %d", len(out.SecurityGroupRules))
	}
	out = must[*ec2.DescribeSecurityGroupRulesOutput](t)(s.DescribeSecurityGroupRules(bg, &ec2.DescribeSecurityGroupRulesInput{Filters: []types.Filter{filter("security-group-rule-id", first)}}))
	if len(out.SecurityGroupRules) != 1 || *out.SecurityGroupRules[0].CidrIpv4 != "10.0.0.0/24" {
		t.Fatalf("rule id filter: %+v", out.SecurityGroupRules)
	}
	out = must[*ec2.DescribeSecurityGroupRulesOutput](t)(s.DescribeSecurityGroupRules(bg, &ec2.DescribeSecurityGroupRulesInput{SecurityGroupRuleIds: []string{first}}))
	if len(out.SecurityGroupRules) != 1 {
		t.Fatalf("by id: %+v", out.SecurityGroupRules)
	}
	_, err := s.DescribeSecurityGroupRules(bg, &ec2.DescribeSecurityGroupRulesInput{SecurityGroupRuleIds: []string{"sgr-0123456789abcdef0"}})
	wantCode(t, err, "InvalidSecurityGroupRuleId.NotFound")
	_, err = s.DescribeSecurityGroupRules(bg, &ec2.DescribeSecurityGroupRulesInput{SecurityGroupRuleIds: []string{"sgr-x"}})
	wantCode(t, err, "InvalidSecurityGroupRuleId.Malformed")
	_, err = s.DescribeSecurityGroupRules(bg, &ec2.DescribeSecurityGroupRulesInput{Filters: []types.Filter{filter("vpc-id", vpc)}})
	wantCode(t, err, "InvalidParameterValue")

	ids, pages := pageAll(t, func(tok *string) ([]string, *string, error) {
		out, err := s.DescribeSecurityGroupRules(bg, &ec2.DescribeSecurityGroupRulesInput{MaxResults: ptr(int32(5)), NextToken: tok, Filters: []types.Filter{filter("group-id", g)}})
		if err != nil {
			return nil, nil, err
		}
		var ids []string
		for _, r := range out.SecurityGroupRules {
			ids = append(ids, *r.SecurityGroupRuleId)
		}
		return ids, out.NextToken, nil
	})
	if len(ids) != 7 || pages != 2 || !sort.StringsAreSorted(ids) {
		t.Fatalf("%d rules over %d pages: %v", len(ids), pages, ids)
	}

	// Rule ids are taggable resources.
	must[*ec2.CreateTagsOutput](t)(s.CreateTags(bg, &ec2.CreateTagsInput{Resources: []string{first}, Tags: []types.Tag{{Key: ptr("Name"), Value: ptr("first")}}}))
	tags := must[*ec2.DescribeTagsOutput](t)(s.DescribeTags(bg, &ec2.DescribeTagsInput{Filters: []types.Filter{filter("resource-id", first)}}))
	if len(tags.Tags) != 2 || tags.Tags[0].ResourceType != types.ResourceTypeSecurityGroupRule {
		t.Fatalf("rule tags = %+v", tags.Tags)
	}
}

func TestModifySecurityGroupRules(t *testing.T) {
	s := newSvc(t)
	vpc := mkVPC(t, s, "10.0.0.0/16")
	g := mkSG(t, s, vpc, "g")
	other := mkSG(t, s, vpc, "other")
	auth := must[*ec2.AuthorizeSecurityGroupIngressOutput](t)(s.AuthorizeSecurityGroupIngress(bg, &ec2.AuthorizeSecurityGroupIngressInput{GroupId: &g, IpPermissions: []types.IpPermission{tcp(22, 22, "10.0.0.0/8"), tcp(80, 80, "10.0.0.0/8")}}))
	id := *auth.SecurityGroupRules[0].SecurityGroupRuleId
	must[*ec2.ModifySecurityGroupRulesOutput](t)(s.ModifySecurityGroupRules(bg, &ec2.ModifySecurityGroupRulesInput{GroupId: &g, SecurityGroupRules: []types.SecurityGroupRuleUpdate{{
		SecurityGroupRuleId: &id,
		SecurityGroupRule:   &types.SecurityGroupRuleRequest{IpProtocol: ptr("tcp"), FromPort: ptr(int32(2222)), ToPort: ptr(int32(2222)), ReferencedGroupId: &other, Description: ptr("ssh from other")},
	}}}))
	out := must[*ec2.DescribeSecurityGroupRulesOutput](t)(s.DescribeSecurityGroupRules(bg, &ec2.DescribeSecurityGroupRulesInput{SecurityGroupRuleIds: []string{id}}))
	r := out.SecurityGroupRules[0]
	if *r.FromPort != 2222 || *r.ReferencedGroupInfo.GroupId != other || r.CidrIpv4 != nil || *r.Description != "ssh from other" {
		t.Fatalf("modified rule = %+v", r)
	}
	before := snapshot(t, s)
	for _, tc := range []struct {
		name string
		req  types.SecurityGroupRuleUpdate
		code string
	}{
		{"a duplicate of a sibling", types.SecurityGroupRuleUpdate{SecurityGroupRuleId: &id, SecurityGroupRule: &types.SecurityGroupRuleRequest{IpProtocol: ptr("tcp"), FromPort: ptr(int32(80)), ToPort: ptr(int32(80)), CidrIpv4: ptr("10.0.0.0/8")}}, "InvalidPermission.Duplicate"},
		{"two peers", types.SecurityGroupRuleUpdate{SecurityGroupRuleId: &id, SecurityGroupRule: &types.SecurityGroupRuleRequest{IpProtocol: ptr("tcp"), FromPort: ptr(int32(1)), ToPort: ptr(int32(1)), CidrIpv4: ptr("10.0.0.0/8"), ReferencedGroupId: &other}}, "InvalidParameterCombination"},
		{"a bad port", types.SecurityGroupRuleUpdate{SecurityGroupRuleId: &id, SecurityGroupRule: &types.SecurityGroupRuleRequest{IpProtocol: ptr("tcp"), FromPort: ptr(int32(1)), ToPort: ptr(int32(99999)), CidrIpv4: ptr("10.0.0.0/8")}}, "InvalidParameterValue"},
		{"a rule of another group", types.SecurityGroupRuleUpdate{SecurityGroupRuleId: ptr("sgr-0123456789abcdef0"), SecurityGroupRule: &types.SecurityGroupRuleRequest{IpProtocol: ptr("-1"), CidrIpv4: ptr("10.0.0.0/8")}}, "InvalidSecurityGroupRuleId.NotFound"},
	} {
		_, err := s.ModifySecurityGroupRules(bg, &ec2.ModifySecurityGroupRulesInput{GroupId: &g, SecurityGroupRules: []types.SecurityGroupRuleUpdate{tc.req}})
		if code(err) != tc.code {
			t.Errorf("%s: %v, want %s", tc.name, err, tc.code)
		}
	}
	sameState(t, before, snapshot(t, s), "failed ModifySecurityGroupRules")

	// Descriptions alone.
	must[*ec2.UpdateSecurityGroupRuleDescriptionsIngressOutput](t)(s.UpdateSecurityGroupRuleDescriptionsIngress(bg, &ec2.UpdateSecurityGroupRuleDescriptionsIngressInput{GroupId: &g,
		IpPermissions: []types.IpPermission{{IpProtocol: ptr("tcp"), FromPort: ptr(int32(80)), ToPort: ptr(int32(80)), IpRanges: []types.IpRange{{CidrIp: ptr("10.0.0.0/8"), Description: ptr("http")}}}}}))
	sg := describeSG(t, s, g)
	for _, p := range sg.IpPermissions {
		if *p.FromPort == 80 && *p.IpRanges[0].Description != "http" {
			t.Fatalf("description = %+v", p)
		}
	}
}

func TestDeleteSecurityGroup(t *testing.T) {
	s := newSvc(t)
	vpc := mkVPC(t, s, "10.0.0.0/16")
	web := mkSG(t, s, vpc, "web")
	db := mkSG(t, s, vpc, "db")
	must[*ec2.AuthorizeSecurityGroupIngressOutput](t)(s.AuthorizeSecurityGroupIngress(bg, &ec2.AuthorizeSecurityGroupIngressInput{GroupId: &db, IpPermissions: []types.IpPermission{fromGroup("tcp", 5432, 5432, web)}}))
	// A group referencing itself does not stop its own deletion.
	must[*ec2.AuthorizeSecurityGroupIngressOutput](t)(s.AuthorizeSecurityGroupIngress(bg, &ec2.AuthorizeSecurityGroupIngressInput{GroupId: &web, IpPermissions: []types.IpPermission{fromGroup("-1", 0, 0, web)}}))

	before := snapshot(t, s)
	_, err := s.DeleteSecurityGroup(bg, &ec2.DeleteSecurityGroupInput{GroupId: &web})
	wantCode(t, err, "DependencyViolation")
	vpcRec := must[*ec2.DescribeVpcsOutput](t)(s.DescribeVpcs(bg, &ec2.DescribeVpcsInput{VpcIds: []string{vpc}}))
	_ = vpcRec
	def := must[*ec2.DescribeSecurityGroupsOutput](t)(s.DescribeSecurityGroups(bg, &ec2.DescribeSecurityGroupsInput{Filters: []types.Filter{filter("vpc-id", vpc), filter("group-name", "default")}}))
	_, err = s.DeleteSecurityGroup(bg, &ec2.DeleteSecurityGroupInput{GroupId: def.SecurityGroups[0].GroupId})
	wantCode(t, err, "CannotDelete")
	_, err = s.DeleteSecurityGroup(bg, &ec2.DeleteSecurityGroupInput{GroupName: ptr("default")})
	wantCode(t, err, "CannotDelete")
	_, err = s.DeleteSecurityGroup(bg, &ec2.DeleteSecurityGroupInput{})
	wantCode(t, err, "MissingParameter")
	_, err = s.DeleteSecurityGroup(bg, &ec2.DeleteSecurityGroupInput{GroupId: ptr("sg-0123456789abcdef0")})
	wantCode(t, err, "InvalidGroup.NotFound")
	_, err = s.DeleteVpc(bg, &ec2.DeleteVpcInput{VpcId: &vpc})
	wantCode(t, err, "DependencyViolation")
	sameState(t, before, snapshot(t, s), "failed deletes")

	out := must[*ec2.DeleteSecurityGroupOutput](t)(s.DeleteSecurityGroup(bg, &ec2.DeleteSecurityGroupInput{GroupId: &db}))
	if *out.GroupId != db {
		t.Fatalf("output = %+v", out)
	}
	must[*ec2.DeleteSecurityGroupOutput](t)(s.DeleteSecurityGroup(bg, &ec2.DeleteSecurityGroupInput{GroupId: &web}))
	// Their rule ids went with them.
	err = s.db.View(func(tx *store.Tx) error {
		if n := tx.Count(kindSecurityGroupRule.Prefix); n != 4 {
			return fmt.Errorf("%d rule ids indexed; want the two default groups' four", n)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	// A group in the default VPC by name.
	must[*ec2.CreateSecurityGroupOutput](t)(s.CreateSecurityGroup(bg, &ec2.CreateSecurityGroupInput{GroupName: ptr("named"), Description: ptr("x")}))
	must[*ec2.DeleteSecurityGroupOutput](t)(s.DeleteSecurityGroup(bg, &ec2.DeleteSecurityGroupInput{GroupName: ptr("named")}))
	// Now the VPC goes, with its default group.
	must[*ec2.DeleteVpcOutput](t)(s.DeleteVpc(bg, &ec2.DeleteVpcInput{VpcId: &vpc}))
	_, err = s.DescribeSecurityGroups(bg, &ec2.DescribeSecurityGroupsInput{GroupIds: []string{*def.SecurityGroups[0].GroupId}})
	wantCode(t, err, "InvalidGroup.NotFound")
}
