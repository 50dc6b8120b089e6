package core

import (
	"net/netip"
	"strings"
	"testing"
	"time"

	"hangar.dev/hangar/services/internal/api"
)

func TestNamesFitAndRoundTrip(t *testing.T) {
	for _, id := range []string{"subnet-0123456789abcdef0", "eni-0123456789abcdef0", "vpc-0123456789abcdef0", "vpc-1234abcd"} {
		for _, n := range []string{BridgeName(id), TapName(id), HostVethName(id)} {
			if len(n) > 15 {
				t.Errorf("%s: name %q is longer than IFNAMSIZ-1", id, n)
			}
		}
		if BridgeName(id) != BridgeName(id) || TapName(id) == TapName(id+"x") {
			t.Errorf("%s: names are not a stable function of the id", id)
		}
		if got, ok := AliasID(Alias(id)); !ok || got != id {
			t.Errorf("alias of %s reads back as %q", id, got)
		}
	}
	if v, ok := VPCFromNamespace(NamespaceName("vpc-0abc")); !ok || v != "vpc-0abc" {
		t.Errorf("namespace round trip gave %q", v)
	}
	if _, ok := VPCFromNamespace("cni-1234"); ok {
		t.Error("a foreign namespace was taken for netd's")
	}
	if _, ok := AliasID("something else"); ok {
		t.Error("a foreign alias was taken for netd's")
	}
}

func testState(t *testing.T) (*State, *VPC) {
	t.Helper()
	s := NewState()
	v, err := s.CheckVPC(api.VPCSpec{VpcID: "vpc-1", CIDR: "10.0.0.0/16", DNSSupport: true})
	if err != nil {
		t.Fatal(err)
	}
	s.VPCs[v.ID] = v
	sn, err := v.CheckSubnet(api.SubnetSpec{SubnetID: "subnet-a", CIDR: "10.0.1.0/24"})
	if err != nil {
		t.Fatal(err)
	}
	v.Subnets[sn.ID] = sn
	g, err := v.CheckGroup(api.SecurityGroupSpec{GroupID: "sg-web", Rules: []api.SGRule{
		{Protocol: "tcp", FromPort: 22, ToPort: 22, GroupID: "sg-admin"},
		{Protocol: "icmp", FromPort: -1, ToPort: -1, CIDR: "0.0.0.0/0"},
		{Egress: true, Protocol: "-1", FromPort: -1, ToPort: -1, CIDR: "0.0.0.0/0"},
	}})
	if err != nil {
		t.Fatal(err)
	}
	v.Groups[g.ID] = g
	v.Groups["sg-admin"] = &Group{ID: "sg-admin"}
	return s, v
}

func TestChecks(t *testing.T) {
	s, v := testState(t)
	_, iface, err := s.CheckInterface(api.InterfaceSpec{SubnetID: "subnet-a", EniID: "eni-1", MAC: "02:00:00:00:00:01", PrivateIP: "10.0.1.10", SecurityGroupIDs: []string{"sg-web"}})
	if err != nil {
		t.Fatal(err)
	}
	v.Interfaces[iface.ID] = iface
	cases := []struct {
		name string
		err  func() error
		kind Kind
		msg  string
	}{
		{"vpc cidr too big", func() error { _, err := s.CheckVPC(api.VPCSpec{VpcID: "vpc-2", CIDR: "10.0.0.0/8"}); return err }, KindInvalid, "between /16 and /28"},
		{"vpc host bits", func() error { _, err := s.CheckVPC(api.VPCSpec{VpcID: "vpc-2", CIDR: "10.0.0.1/16"}); return err }, KindInvalid, "host bits"},
		{"vpc other cidr", func() error { _, err := s.CheckVPC(api.VPCSpec{VpcID: "vpc-1", CIDR: "10.1.0.0/16"}); return err }, KindConflict, "exists with CIDR"},
		{"subnet outside", func() error {
			_, err := v.CheckSubnet(api.SubnetSpec{SubnetID: "subnet-b", CIDR: "10.1.0.0/24"})
			return err
		}, KindInvalid, "not inside"},
		{"subnet overlap", func() error {
			_, err := v.CheckSubnet(api.SubnetSpec{SubnetID: "subnet-b", CIDR: "10.0.1.128/25"})
			return err
		}, KindConflict, "overlaps subnet-a"},
		{"mac collision", func() error {
			_, _, err := s.CheckInterface(api.InterfaceSpec{SubnetID: "subnet-a", EniID: "eni-2", MAC: "02:00:00:00:00:01", PrivateIP: "10.0.1.11"})
			return err
		}, KindConflict, "MAC 02:00:00:00:00:01 is already used by eni-1"},
		{"ip collision", func() error {
			_, _, err := s.CheckInterface(api.InterfaceSpec{SubnetID: "subnet-a", EniID: "eni-2", MAC: "02:00:00:00:00:02", PrivateIP: "10.0.1.10"})
			return err
		}, KindConflict, "already used by eni-1"},
		{"reserved ip", func() error {
			_, _, err := s.CheckInterface(api.InterfaceSpec{SubnetID: "subnet-a", EniID: "eni-2", MAC: "02:00:00:00:00:02", PrivateIP: "10.0.1.3"})
			return err
		}, KindInvalid, "reserved"},
		{"broadcast ip", func() error {
			_, _, err := s.CheckInterface(api.InterfaceSpec{SubnetID: "subnet-a", EniID: "eni-2", MAC: "02:00:00:00:00:02", PrivateIP: "10.0.1.255"})
			return err
		}, KindInvalid, "reserved"},
		{"multicast mac", func() error {
			_, _, err := s.CheckInterface(api.InterfaceSpec{SubnetID: "subnet-a", EniID: "eni-2", MAC: "01:00:5e:00:00:01", PrivateIP: "10.0.1.12"})
			return err
		}, KindInvalid, "multicast"},
		{"unknown subnet", func() error {
			_, _, err := s.CheckInterface(api.InterfaceSpec{SubnetID: "subnet-x", EniID: "eni-2", MAC: "02:00:00:00:00:02", PrivateIP: "10.0.1.12"})
			return err
		}, KindNotFound, "subnet-x"},
		{"unknown group", func() error {
			_, _, err := s.CheckInterface(api.InterfaceSpec{SubnetID: "subnet-a", EniID: "eni-2", MAC: "02:00:00:00:00:02", PrivateIP: "10.0.1.12", SecurityGroupIDs: []string{"sg-nope"}})
			return err
		}, KindNotFound, "sg-nope"},
		{"same eni other ip", func() error {
			_, _, err := s.CheckInterface(api.InterfaceSpec{SubnetID: "subnet-a", EniID: "eni-1", MAC: "02:00:00:00:00:01", PrivateIP: "10.0.1.99"})
			return err
		}, KindConflict, "exists with"},
		{"bad port range", func() error {
			_, err := v.CheckGroup(api.SecurityGroupSpec{GroupID: "sg-x", Rules: []api.SGRule{{Protocol: "tcp", FromPort: 90, ToPort: 80, CIDR: "0.0.0.0/0"}}})
			return err
		}, KindInvalid, "port range"},
		{"rule without peer", func() error {
			_, err := v.CheckGroup(api.SecurityGroupSpec{GroupID: "sg-x", Rules: []api.SGRule{{Protocol: "tcp", FromPort: 80, ToPort: 80}}})
			return err
		}, KindInvalid, "needs a CIDR or a group"},
		{"address outside pool", func() error {
			_, _, err := s.CheckAddress(api.AddressSpec{PublicIP: "198.51.100.7", EniID: "eni-1"}, []netip.Prefix{netip.MustParsePrefix("203.0.113.0/24")})
			return err
		}, KindInvalid, "PUBLIC_IP_POOL"},
	}
	for _, c := range cases {
		err := c.err()
		if err == nil {
			t.Errorf("%s: accepted", c.name)
			continue
		}
		if KindOf(err) != c.kind || !strings.Contains(err.Error(), c.msg) {
			t.Errorf("%s: got kind %d %q, want kind %d containing %q", c.name, KindOf(err), err, c.kind, c.msg)
		}
	}
	// The same interface again is idempotent.
	if _, _, err := s.CheckInterface(api.InterfaceSpec{SubnetID: "subnet-a", EniID: "eni-1", MAC: "02:00:00:00:00:01", PrivateIP: "10.0.1.10"}); err != nil {
		t.Errorf("repeating an interface: %v", err)
	}
	if users := v.GroupUsers("sg-admin"); len(users) != 1 || users[0] != "sg-web" {
		t.Errorf("sg-admin users = %v, want the rule in sg-web", users)
	}
}

func TestLeaseZoneAndFilter(t *testing.T) {
	s, v := testState(t)
	_, iface, err := s.CheckInterface(api.InterfaceSpec{SubnetID: "subnet-a", EniID: "eni-1", MAC: "02:AA:00:00:00:01", PrivateIP: "10.0.1.5", SecurityGroupIDs: []string{"sg-web"}})
	if err != nil {
		t.Fatal(err)
	}
	v.Interfaces[iface.ID] = iface
	l, ok := v.Lease("subnet-a", "02:aa:00:00:00:01", "us-east-1")
	if !ok || l.IP.String() != "10.0.1.5" || l.Router.String() != "10.0.1.1" || l.DNS[0].String() != "10.0.0.2" ||
		l.Hostname != "ip-10-0-1-5" || l.Domain != "ec2.internal" || l.Subnet.Bits() != 24 {
		t.Errorf("lease = %+v", l)
	}
	if _, ok := v.Lease("subnet-a", "02:aa:00:00:00:99", "us-east-1"); ok {
		t.Error("an unknown MAC got a lease")
	}
	if Domain("eu-west-1") != "eu-west-1.compute.internal" {
		t.Error("domain outside us-east-1")
	}
	z := v.Zone("us-east-1")
	if o, a, _ := z.Lookup("IP-10-0-1-5.ec2.internal", 1); o != Answer || a.String() != "10.0.1.5" {
		t.Errorf("A lookup: %v %v", o, a)
	}
	if o, _, ptr := z.Lookup("5.1.0.10.in-addr.arpa.", 12); o != Answer || ptr != "ip-10-0-1-5.ec2.internal." {
		t.Errorf("PTR lookup: %v %v", o, ptr)
	}
	if o, _, _ := z.Lookup("ip-10-0-1-6.ec2.internal.", 1); o != NXDomain {
		t.Errorf("missing name: %v", o)
	}
	if o, _, _ := z.Lookup("6.1.0.10.in-addr.arpa.", 12); o != NXDomain {
		t.Errorf("missing reverse in the VPC: %v", o)
	}
	if o, _, _ := z.Lookup("example.com.", 1); o != Forward {
		t.Errorf("outside name: %v", o)
	}
	v.DNSSupport = false
	if o, _, _ := v.Zone("us-east-1").Lookup("ip-10-0-1-5.ec2.internal.", 1); o != Refused {
		t.Errorf("DNS support off: %v", o)
	}
	plan := v.Filter([]netip.Prefix{netip.MustParsePrefix("192.0.2.0/24")})
	if len(plan.ENIs) != 1 {
		t.Fatalf("plan has %d interfaces", len(plan.ENIs))
	}
	e := plan.ENIs[0]
	want := []Match{
		{Proto: 6, PortFrom: 22, PortTo: 22, ICMPType: -1, ICMPCode: -1, PeerSet: "sg-admin"},
		{Proto: 1, ICMPType: -1, ICMPCode: -1, Peer: netip.MustParsePrefix("0.0.0.0/0")},
	}
	if len(e.Ingress) != 2 || e.Ingress[0] != want[0] || e.Ingress[1] != want[1] {
		t.Errorf("ingress = %+v", e.Ingress)
	}
	if len(e.Egress) != 1 || e.Egress[0].Proto != 0 {
		t.Errorf("egress = %+v", e.Egress)
	}
	if got := plan.Sets["sg-web"]; len(got) != 1 || got[0].String() != "10.0.1.5" {
		t.Errorf("sg-web members = %v", got)
	}
	if _, ok := plan.Sets["sg-admin"]; !ok || len(plan.Sets["sg-admin"]) != 0 {
		t.Errorf("sg-admin should be an empty set: %v", plan.Sets)
	}
}

func TestRoutesAndTransit(t *testing.T) {
	_, v := testState(t)
	v.RouteTables["rtb-main"] = &RouteTable{ID: "rtb-main", Main: true, Routes: []api.RouteSpec{{Destination: "0.0.0.0/0", Target: "igw-1"}}}
	if r := v.IGWRoutes("subnet-a"); r != nil {
		t.Errorf("routes without an attached gateway: %v", r)
	}
	v.IGW = "igw-1"
	if r := v.IGWRoutes("subnet-a"); len(r) != 1 || r[0].String() != "0.0.0.0/0" {
		t.Errorf("main table routes: %v", r)
	}
	v.RouteTables["rtb-private"] = &RouteTable{ID: "rtb-private", Subnets: []string{"subnet-a"}}
	if r := v.IGWRoutes("subnet-a"); len(r) != 0 {
		t.Errorf("an associated table without routes still routed: %v", r)
	}
	h, p := Transit(0)
	h2, _ := Transit(1)
	if h.String() != "169.254.0.0" || p.String() != "169.254.0.1" || h2.String() != "169.254.0.2" {
		t.Errorf("transit = %v %v %v", h, p, h2)
	}
}

func TestMetadataTreeAndTokens(t *testing.T) {
	md := api.InstanceMetadata{InstanceID: "i-1", AmiID: "ami-1", InstanceType: "t3.micro", Region: "us-east-1", AvailabilityZone: "us-east-1a",
		PublicKeys: []api.PublicKey{{Name: "k", OpenSSH: "ssh-ed25519 AAAA"}}, UserData: []byte("#!/bin/sh\n"), IAMRole: "web",
		Credentials: api.IAMCredentials{AccessKeyID: "ASIA1", Expiration: 1}}
	n := NetInfo{EniID: "eni-1", MAC: "02:00:00:00:00:01", IP: netip.MustParseAddr("10.0.1.5"), Domain: "ec2.internal",
		SubnetCIDR: netip.MustParsePrefix("10.0.1.0/24"), VPCCIDR: netip.MustParsePrefix("10.0.0.0/16")}
	tree := MetadataTree(md, n)
	for path, want := range map[string]string{
		"meta-data/instance-id":               "i-1",
		"meta-data/local-hostname":            "ip-10-0-1-5.ec2.internal",
		"meta-data/public-keys/":              "0=k",
		"meta-data/public-keys/0/openssh-key": "ssh-ed25519 AAAA",
		"meta-data/iam/security-credentials/": "web",
		"meta-data/placement/":                "availability-zone\nregion",
		"user-data":                           "#!/bin/sh\n",
		"meta-data/network/interfaces/macs/":  "02:00:00:00:00:01/",
		"meta-data/network/interfaces/macs/02:00:00:00:00:01/vpc-ipv4-cidr-block": "10.0.0.0/16",
	} {
		got, ok := ResolveMetadata(tree, md, path)
		if !ok || got != want {
			t.Errorf("%s = %q, %v; want %q", path, got, ok, want)
		}
	}
	if got, _ := ResolveMetadata(tree, md, "meta-data/"); !strings.Contains(got, "instance-id\n") || !strings.Contains(got, "iam/") {
		t.Errorf("meta-data/ listing = %q", got)
	}
	if _, ok := ResolveMetadata(tree, md, "meta-data/nothing"); ok {
		t.Error("a missing path resolved")
	}
	// Without the gateway's document netd renders its own, unsigned.
	if doc, _ := ResolveMetadata(tree, md, "dynamic/instance-identity/document"); !strings.Contains(doc, `"privateIp": "10.0.1.5"`) {
		t.Errorf("netd's own identity document = %q", doc)
	}
	if _, ok := ResolveMetadata(tree, md, "dynamic/instance-identity/signature"); ok {
		t.Error("a signature served for netd's own (unsigned) document")
	}
	// The gateway's signed document is served byte for byte.
	signed := md
	signed.IdentityDocument = "{\n  \"accountId\" : \"123456789012\"\n}"
	signed.IdentitySignature, signed.IdentityPKCS7 = "c2lnbmF0dXJl", "cGtjczc="
	stree := MetadataTree(signed, n)
	for path, want := range map[string]string{
		"dynamic/instance-identity/document":  signed.IdentityDocument,
		"dynamic/instance-identity/signature": "c2lnbmF0dXJl",
		"dynamic/instance-identity/pkcs7":     "cGtjczc=",
		"dynamic/instance-identity/rsa2048":   "cGtjczc=",
	} {
		if got, ok := ResolveMetadata(stree, signed, path); !ok || got != want {
			t.Errorf("%s = %q, %v; want %q", path, got, ok, want)
		}
	}
	now := time.Unix(1000, 0)
	tok := NewTokens(func() time.Time { return now })
	ip := netip.MustParseAddr("10.0.1.5")
	if err := tok.Issue("a", ip, 0); err == nil {
		t.Error("TTL 0 accepted")
	}
	if err := tok.Issue("a", ip, 10); err != nil {
		t.Fatal(err)
	}
	if !tok.Valid("a", ip) || tok.Valid("a", netip.MustParseAddr("10.0.1.6")) || tok.Valid("b", ip) {
		t.Error("token validity wrong")
	}
	now = now.Add(11 * time.Second)
	if tok.Valid("a", ip) {
		t.Error("expired token still valid")
	}
}
