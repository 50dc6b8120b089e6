package main

import (
	"context"
	"fmt"
	"net"
	"os/exec"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/miekg/dns"

	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/internal/awsid"
	"hangar.dev/hangar/services/netd/core"
)

func allOut(proto string) api.SGRule {
	return api.SGRule{Egress: true, Protocol: proto, FromPort: -1, ToPort: -1, CIDR: "0.0.0.0/0"}
}

func must(t *testing.T, what string, err error) {
	t.Helper()
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

func wantError(t *testing.T, what string, err error, name string) {
	t.Helper()
	if err == nil {
		t.Fatalf("%s: accepted, want %s", what, name)
	}
	if !api.IsName(err, name) {
		t.Fatalf("%s: got %v, want %s", what, err, name)
	}
	t.Logf("%s: %v", what, err)
}

// curl runs curl in a guest and returns the body and HTTP status.
func curl(t *testing.T, g *guest, args ...string) (string, string) {
	t.Helper()
	out, err := inNS(t, g.ns, append([]string{"curl", "-s", "-m", "5", "-w", "\n%{http_code}"}, args...)...)
	if err != nil {
		t.Fatalf("curl in %s %v: %v\n%s", g.name, args, err, out)
	}
	i := strings.LastIndexByte(out, '\n')
	return out[:i], strings.TrimSpace(out[i+1:])
}

func dig(t *testing.T, g *guest, args ...string) string {
	t.Helper()
	out, err := inNS(t, g.ns, append([]string{"dig", "+short", "+time=2", "+tries=2"}, args...)...)
	if err != nil {
		t.Fatalf("dig in %s %v: %v\n%s", g.name, args, err, out)
	}
	return strings.TrimSpace(out)
}

func digStatus(t *testing.T, g *guest, args ...string) string {
	t.Helper()
	out, _ := inNS(t, g.ns, append([]string{"dig", "+time=2", "+tries=1"}, args...)...)
	for _, line := range strings.Split(out, "\n") {
		if i := strings.Index(line, "status: "); i >= 0 {
			s := line[i+len("status: "):]
			s, _, _ = strings.Cut(s, ",")
			return s
		}
	}
	return "no answer: " + out
}

// snapshot is what netd holds in the kernel for some VPCs, as iproute2
// and nft show it, to compare across a restart.
func (w *world) snapshot(vpcs ...string) string {
	t := w.t
	var b strings.Builder
	var nss []string
	for _, line := range strings.Split(sh(t, "ip", "netns", "list"), "\n") {
		name, _, _ := strings.Cut(line, " ")
		for _, v := range vpcs {
			if name == core.NamespaceName(v) {
				nss = append(nss, name)
			}
		}
	}
	sort.Strings(nss)
	fmt.Fprintf(&b, "namespaces: %v\n", nss)
	fmt.Fprintf(&b, "host links:\n%s", links(t, w.hostNS))
	fmt.Fprintf(&b, "host routes:\n%s", sh(t, "ip", "-n", w.hostNS, "route"))
	fmt.Fprintf(&b, "host proxy:\n%s", sh(t, "ip", "-n", w.hostNS, "neigh", "show", "proxy"))
	fmt.Fprintf(&b, "host nft:\n%s", strings.TrimSpace(mustNS(t, w.hostNS, "nft", "-s", "list", "ruleset"))+"\n")
	for _, ns := range nss {
		fmt.Fprintf(&b, "%s links:\n%s", ns, links(t, ns))
		fmt.Fprintf(&b, "%s addrs:\n%s", ns, sh(t, "ip", "-n", ns, "-o", "-4", "addr"))
		fmt.Fprintf(&b, "%s rules:\n%s", ns, sh(t, "ip", "-n", ns, "rule"))
		fmt.Fprintf(&b, "%s routes:\n%s", ns, sh(t, "ip", "-n", ns, "route", "show", "table", "all"))
		fmt.Fprintf(&b, "%s nft:\n%s", ns, strings.TrimSpace(mustNS(t, ns, "nft", "-s", "list", "ruleset"))+"\n")
	}
	return b.String()
}

// links lists a namespace's links by name, kind, master and alias (not
// index, which a re-created link would change).
func links(t *testing.T, ns string) string {
	out := sh(t, "ip", "-n", ns, "-d", "-o", "link")
	var lines []string
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 {
			continue
		}
		name := strings.TrimSuffix(f[1], ":")
		name, _, _ = strings.Cut(name, "@")
		desc := name
		for i, x := range f {
			if x == "master" && i+1 < len(f) {
				desc += " master=" + f[i+1]
			}
			if x == "alias" && i+1 < len(f) {
				desc += " alias=" + strings.Join(f[i+1:i+3], " ")
			}
		}
		lines = append(lines, desc)
	}
	sort.Strings(lines)
	return strings.Join(lines, "\n") + "\n"
}

// serveLANDNS answers upstream.example on the LAN peer, as DNS_UPSTREAMS.
func serveLANDNS(t *testing.T, w *world) {
	var pc net.PacketConn
	if err := withNS(w.lanNS, func() error {
		var err error
		pc, err = net.ListenPacket("udp4", lanPeer+":53")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	srv := &dns.Server{PacketConn: pc, Handler: dns.HandlerFunc(func(rw dns.ResponseWriter, r *dns.Msg) {
		m := new(dns.Msg)
		m.SetReply(r)
		if r.Question[0].Name == "upstream.example." {
			m.Answer = append(m.Answer, &dns.A{Hdr: dns.RR_Header{Name: "upstream.example.", Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 5}, A: net.ParseIP("203.0.113.7")})
		} else {
			m.Rcode = dns.RcodeNameError
		}
		_ = rw.WriteMsg(m)
	})}
	go func() { _ = srv.ActivateAndServe() }()
	t.Cleanup(func() { _ = srv.Shutdown() })
}

// TestNetd drives hangar-netd over D-Bus as the gateway will, with
// namespace guests that reach it only through their taps.
func TestNetd(t *testing.T) {
	w := newWorld(t, "us-east-1")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	n := w.net
	serveLANDNS(t, w)

	vpc1, vpc2 := awsid.New("vpc"), awsid.New("vpc")
	sub1a, sub1b, sub2 := awsid.New("subnet"), awsid.New("subnet"), awsid.New("subnet")
	sgBase, sgAdmin, sgOther, sgSSH := awsid.New("sg"), awsid.New("sg"), awsid.New("sg"), awsid.New("sg")
	eniA, eniB := awsid.New("eni"), awsid.New("eni")
	must(t, "EnsureVPC", n.EnsureVPC(ctx, api.VPCSpec{VpcID: vpc1, CIDR: "10.0.0.0/16", DNSSupport: true}))
	must(t, "EnsureVPC again", n.EnsureVPC(ctx, api.VPCSpec{VpcID: vpc1, CIDR: "10.0.0.0/16", DNSSupport: true}))
	must(t, "EnsureSubnet", n.EnsureSubnet(ctx, vpc1, api.SubnetSpec{SubnetID: sub1a, CIDR: "10.0.1.0/24"}))
	must(t, "EnsureSubnet", n.EnsureSubnet(ctx, vpc1, api.SubnetSpec{SubnetID: sub1b, CIDR: "10.0.2.0/24"}))
	base := api.SecurityGroupSpec{GroupID: sgBase, Rules: []api.SGRule{allOut("-1"),
		{Protocol: "icmp", FromPort: -1, ToPort: -1, CIDR: "10.0.0.0/16"},
		{Protocol: "tcp", FromPort: 8080, ToPort: 8080, CIDR: "0.0.0.0/0"}}}
	must(t, "SetSecurityGroup base", n.SetSecurityGroup(ctx, vpc1, base))
	infoA, err := n.AllocateInterface(ctx, api.InterfaceSpec{SubnetID: sub1a, EniID: eniA, MAC: "02:00:0a:00:01:0a", PrivateIP: "10.0.1.10", SecurityGroupIDs: []string{sgBase}})
	must(t, "AllocateInterface A", err)
	if infoA.Tap != core.TapName(eniA) || infoA.Namespace != core.NamespaceName(vpc1) {
		t.Fatalf("AllocateInterface returned %+v", infoA)
	}
	if out := sh(t, "ip", "-n", infoA.Namespace, "-d", "link", "show", infoA.Tap); !strings.Contains(out, "alias hangar-netd "+eniA) || !strings.Contains(out, "master "+core.BridgeName(sub1a)) {
		t.Fatalf("tap %s is not netd's on the subnet bridge:\n%s", infoA.Tap, out)
	}
	_, err = n.AllocateInterface(ctx, api.InterfaceSpec{SubnetID: sub1b, EniID: eniB, MAC: "02:00:0a:00:02:14", PrivateIP: "10.0.2.20", SecurityGroupIDs: []string{sgBase}})
	must(t, "AllocateInterface B", err)
	md := api.InstanceMetadata{InstanceID: "i-0aaaaaaaaaaaaaaaa", AmiID: "ami-1", InstanceType: "t3.micro", AccountID: "123456789012",
		Region: "us-east-1", AvailabilityZone: "us-east-1a", HttpTokens: "required", HttpPutResponseHopLimit: 1,
		UserData: []byte("#cloud-config\n"), PublicKeys: []api.PublicKey{{Name: "k1", OpenSSH: "ssh-ed25519 AAAAC3 k1"}}}
	must(t, "SetInstanceMetadata", n.SetInstanceMetadata(ctx, eniA, md))

	a := w.newGuest(ctx, "a", eniA, "02:00:0a:00:01:0a")
	b := w.newGuest(ctx, "b", eniB, "02:00:0a:00:02:14")

	t.Run("dhcp dns imds", func(t *testing.T) {
		lease := a.dhcp(t, w.dir)
		want := map[string]string{"ip": "10.0.1.10", "mask": "24", "router": "10.0.1.1", "dns": "10.0.0.2",
			"domain": "ec2.internal", "hostname": "ip-10-0-1-10", "mtu": "1500", "lease": "3600"}
		for k, v := range want {
			if lease[k] != v {
				t.Errorf("lease %s = %q, want %q (lease %v)", k, lease[k], v, lease)
			}
		}
		if l := b.dhcp(t, w.dir); l["ip"] != "10.0.2.20" || l["router"] != "10.0.2.1" {
			t.Errorf("guest b lease %v", l)
		}
		if got := dig(t, a, "@10.0.0.2", "ip-10-0-1-10.ec2.internal"); got != "10.0.1.10" {
			t.Errorf("own name resolved to %q", got)
		}
		if got := dig(t, a, "@169.254.169.253", "ip-10-0-2-20.ec2.internal"); got != "10.0.2.20" {
			t.Errorf("neighbour's name at 169.254.169.253 resolved to %q", got)
		}
		if got := dig(t, a, "@10.0.0.2", "-x", "10.0.2.20"); got != "ip-10-0-2-20.ec2.internal." {
			t.Errorf("reverse of the neighbour = %q", got)
		}
		if got := digStatus(t, a, "@10.0.0.2", "ip-10-0-9-9.ec2.internal"); got != "NXDOMAIN" {
			t.Errorf("unknown private name status %s", got)
		}
		if got := dig(t, a, "@10.0.0.2", "upstream.example"); got != "203.0.113.7" {
			t.Errorf("forwarded name resolved to %q", got)
		}
		out, err := inNS(t, a.ns, "nslookup", "ip-10-0-2-20.ec2.internal", "10.0.0.2")
		if err != nil || !strings.Contains(out, "10.0.2.20") {
			t.Errorf("nslookup: %v\n%s", err, out)
		}
		// IMDS: v1 is refused with HttpTokens=required; v2 works.
		if _, code := curl(t, a, "http://169.254.169.254/latest/meta-data/instance-id"); code != "401" {
			t.Errorf("IMDSv1 with tokens required: HTTP %s", code)
		}
		tok, code := curl(t, a, "-X", "PUT", "-H", "X-aws-ec2-metadata-token-ttl-seconds: 60", "http://169.254.169.254/latest/api/token")
		if code != "200" || tok == "" {
			t.Fatalf("token PUT: HTTP %s %q", code, tok)
		}
		for path, want := range map[string]string{
			"meta-data/instance-id":               md.InstanceID,
			"meta-data/local-ipv4":                "10.0.1.10",
			"meta-data/local-hostname":            "ip-10-0-1-10.ec2.internal",
			"meta-data/mac":                       "02:00:0a:00:01:0a",
			"meta-data/public-keys/0/openssh-key": "ssh-ed25519 AAAAC3 k1",
			"user-data":                           "#cloud-config\n",
			"meta-data/network/interfaces/macs/02:00:0a:00:01:0a/subnet-id": sub1a,
		} {
			body, code := curl(t, a, "-H", "X-aws-ec2-metadata-token: "+tok, "http://169.254.169.254/latest/"+path)
			if code != "200" || body != want {
				t.Errorf("IMDS %s: HTTP %s %q, want %q", path, code, body, want)
			}
		}
		if _, code := curl(t, a, "-H", "X-aws-ec2-metadata-token: forged", "http://169.254.169.254/latest/meta-data/instance-id"); code != "401" {
			t.Errorf("forged token: HTTP %s", code)
		}
		// b has no metadata set: IMDS does not answer for it.
		if _, code := curl(t, b, "http://169.254.169.254/latest/meta-data/instance-id"); code != "404" {
			t.Errorf("IMDS for an instance without metadata: HTTP %s", code)
		}
	})

	t.Run("imds hop limit", func(t *testing.T) {
		// A container one hop behind guest a (its own namespace, NATed by
		// the guest, as Docker does) must not get a token with hop limit 1:
		// the PUT reply leaves IMDS with TTL 1 and dies at the guest's
		// forwarding. With 2 it arrives.
		c := "hgt-c-" + w.tag
		sh(t, "ip", "netns", "add", c)
		defer func() { _ = exec.Command("ip", "netns", "del", c).Run() }()
		sh(t, "ip", "link", "add", "hgtc"+w.tag[:4], "netns", a.ns, "type", "veth", "peer", "name", "eth0", "netns", c)
		mustNS(t, a.ns, "ip", "addr", "add", "192.168.77.1/24", "dev", "hgtc"+w.tag[:4])
		mustNS(t, a.ns, "ip", "link", "set", "hgtc"+w.tag[:4], "up")
		mustNS(t, a.ns, "sysctl", "-qw", "net.ipv4.ip_forward=1")
		mustNS(t, a.ns, "nft", "add table ip hgtnat; add chain ip hgtnat post { type nat hook postrouting priority 100; }; add rule ip hgtnat post oifname eth0 masquerade")
		mustNS(t, c, "ip", "link", "set", "lo", "up")
		mustNS(t, c, "ip", "addr", "add", "192.168.77.2/24", "dev", "eth0")
		mustNS(t, c, "ip", "link", "set", "eth0", "up")
		mustNS(t, c, "ip", "route", "add", "default", "via", "192.168.77.1")
		container := &guest{name: "container", ns: c}
		put := func() string {
			out, _ := inNS(t, c, "curl", "-s", "-m", "3", "-o", "/dev/null", "-w", "%{http_code}", "-X", "PUT",
				"-H", "X-aws-ec2-metadata-token-ttl-seconds: 60", "http://169.254.169.254/latest/api/token")
			return strings.TrimSpace(out)
		}
		// The container reaches the VPC at all (DNS answers it), so a
		// missing token is the hop limit, not a broken path.
		if got := dig(t, container, "@10.0.0.2", "ip-10-0-1-10.ec2.internal"); got != "10.0.1.10" {
			t.Fatalf("the container cannot reach the VPC's DNS: %q", got)
		}
		if code := put(); code == "200" {
			t.Fatalf("a token reached a container one hop behind the instance with hop limit 1")
		}
		if _, code := curl(t, a, "-X", "PUT", "-H", "X-aws-ec2-metadata-token-ttl-seconds: 60", "http://169.254.169.254/latest/api/token"); code != "200" {
			t.Fatalf("the instance itself lost its token: HTTP %s", code)
		}
		md2 := md
		md2.HttpPutResponseHopLimit = 2
		must(t, "SetInstanceMetadata hop limit 2", n.SetInstanceMetadata(ctx, eniA, md2))
		if code := put(); code != "200" {
			t.Fatalf("hop limit 2: the container got HTTP %s, want 200", code)
		}
		must(t, "SetInstanceMetadata", n.SetInstanceMetadata(ctx, eniA, md))
	})

	t.Run("security groups", func(t *testing.T) {
		for _, g := range []api.SecurityGroupSpec{
			{GroupID: sgAdmin, Rules: []api.SGRule{allOut("-1")}},
			{GroupID: sgOther, Rules: []api.SGRule{allOut("-1")}},
			{GroupID: sgSSH, Rules: []api.SGRule{allOut("-1"), {Protocol: "tcp", FromPort: 22, ToPort: 22, GroupID: sgAdmin}}},
		} {
			must(t, "SetSecurityGroup", n.SetSecurityGroup(ctx, vpc1, g))
		}
		eniS, eniP, eniQ := awsid.New("eni"), awsid.New("eni"), awsid.New("eni")
		for _, spec := range []api.InterfaceSpec{
			{SubnetID: sub1a, EniID: eniS, MAC: "02:00:0a:00:01:1e", PrivateIP: "10.0.1.30", SecurityGroupIDs: []string{sgSSH}},
			{SubnetID: sub1a, EniID: eniP, MAC: "02:00:0a:00:01:1f", PrivateIP: "10.0.1.31", SecurityGroupIDs: []string{sgAdmin}},
			{SubnetID: sub1b, EniID: eniQ, MAC: "02:00:0a:00:02:20", PrivateIP: "10.0.2.32", SecurityGroupIDs: []string{sgOther}},
		} {
			_, err := n.AllocateInterface(ctx, spec)
			must(t, "AllocateInterface "+spec.PrivateIP, err)
		}
		s := w.newGuest(ctx, "s", eniS, "02:00:0a:00:01:1e")
		p := w.newGuest(ctx, "p", eniP, "02:00:0a:00:01:1f")
		q := w.newGuest(ctx, "q", eniQ, "02:00:0a:00:02:20")
		for _, g := range []*guest{s, p, q} {
			g.dhcp(t, w.dir)
		}
		listen(t, s.ns, "0.0.0.0:22")
		if err := dial(p.ns, "10.0.1.30:22", 3*time.Second); err != nil {
			t.Fatalf("a member of the allowed group could not connect: %v", err)
		}
		if err := dial(q.ns, "10.0.1.30:22", time.Second); err == nil {
			t.Fatal("a member of another group connected")
		}
		start := time.Now()
		must(t, "revoke", n.SetSecurityGroup(ctx, vpc1, api.SecurityGroupSpec{GroupID: sgSSH, Rules: []api.SGRule{allOut("-1")}}))
		applied := time.Since(start)
		if err := dial(p.ns, "10.0.1.30:22", time.Second); err == nil {
			t.Fatal("a new connection succeeded after the rule was revoked")
		}
		if applied > time.Second {
			t.Errorf("revoking took %v", applied)
		}
		t.Logf("revoke applied in %v; a new connection was refused right after", applied)
		// A CIDR rule lets the other subnet in.
		must(t, "authorize cidr", n.SetSecurityGroup(ctx, vpc1, api.SecurityGroupSpec{GroupID: sgSSH, Rules: []api.SGRule{allOut("-1"),
			{Protocol: "tcp", FromPort: 20, ToPort: 30, CIDR: "10.0.2.0/24"}}}))
		if err := dial(q.ns, "10.0.1.30:22", 3*time.Second); err != nil {
			t.Fatalf("a CIDR rule did not let 10.0.2.32 in: %v", err)
		}
		if err := dial(p.ns, "10.0.1.30:22", time.Second); err == nil {
			t.Fatal("10.0.1.31 connected though only 10.0.2.0/24 is allowed")
		}
		// Egress: a group without egress rules sends nothing.
		must(t, "no egress", n.SetSecurityGroup(ctx, vpc1, api.SecurityGroupSpec{GroupID: sgOther}))
		if err := dial(q.ns, "10.0.1.30:22", time.Second); err == nil {
			t.Fatal("a group without egress rules still connected out")
		}
		must(t, "egress back", n.SetSecurityGroup(ctx, vpc1, api.SecurityGroupSpec{GroupID: sgOther, Rules: []api.SGRule{allOut("-1")}}))
	})

	t.Run("two VPCs with the same CIDR", func(t *testing.T) {
		must(t, "EnsureVPC 2", n.EnsureVPC(ctx, api.VPCSpec{VpcID: vpc2, CIDR: "10.0.0.0/16", DNSSupport: true}))
		must(t, "EnsureSubnet 2", n.EnsureSubnet(ctx, vpc2, api.SubnetSpec{SubnetID: sub2, CIDR: "10.0.1.0/24"}))
		sg2 := awsid.New("sg")
		must(t, "sg 2", n.SetSecurityGroup(ctx, vpc2, api.SecurityGroupSpec{GroupID: sg2, Rules: []api.SGRule{allOut("-1"), {Protocol: "-1", CIDR: "10.0.0.0/16"}}}))
		eniX, eniY := awsid.New("eni"), awsid.New("eni")
		_, err := n.AllocateInterface(ctx, api.InterfaceSpec{SubnetID: sub2, EniID: eniX, MAC: "02:00:0b:00:01:0a", PrivateIP: "10.0.1.10", SecurityGroupIDs: []string{sg2}})
		must(t, "AllocateInterface X (same IP as A)", err)
		_, err = n.AllocateInterface(ctx, api.InterfaceSpec{SubnetID: sub2, EniID: eniY, MAC: "02:00:0b:00:01:0b", PrivateIP: "10.0.1.11", SecurityGroupIDs: []string{sg2}})
		must(t, "AllocateInterface Y", err)
		mdX := md
		mdX.InstanceID, mdX.HttpTokens = "i-0bbbbbbbbbbbbbbbb", "optional"
		must(t, "metadata X", n.SetInstanceMetadata(ctx, eniX, mdX))
		x := w.newGuest(ctx, "x", eniX, "02:00:0b:00:01:0a")
		y := w.newGuest(ctx, "y", eniY, "02:00:0b:00:01:0b")
		if l := x.dhcp(t, w.dir); l["ip"] != "10.0.1.10" {
			t.Fatalf("x lease %v", l)
		}
		y.dhcp(t, w.dir)
		if body, code := curl(t, x, "http://169.254.169.254/latest/meta-data/instance-id"); code != "200" || body != mdX.InstanceID {
			t.Errorf("IMDSv1 in the second VPC: HTTP %s %q", code, body)
		}
		listen(t, y.ns, "0.0.0.0:80")
		if err := dial(x.ns, "10.0.1.11:80", 3*time.Second); err != nil {
			t.Fatalf("a guest could not reach its neighbour in its own VPC: %v", err)
		}
		if err := dial(a.ns, "10.0.1.11:80", time.Second); err == nil {
			t.Fatal("a guest in the other VPC reached 10.0.1.11")
		}
		if got := dig(t, x, "@10.0.0.2", "ip-10-0-2-20.ec2.internal"); got != "" {
			t.Errorf("the second VPC resolves the first's names: %q", got)
		}
	})

	t.Run("internet gateway, protected CIDRs, host API, elastic IP", func(t *testing.T) {
		lanPeers := listen(t, w.lanNS, "0.0.0.0:8080")
		listen(t, w.hostNS, "0.0.0.0:4566")
		if err := dial(a.ns, lanPeer+":8080", time.Second); err == nil {
			t.Fatal("a guest reached the LAN without an internet gateway")
		}
		igw := awsid.New("igw")
		must(t, "SetInternetGateway", n.SetInternetGateway(ctx, vpc1, igw))
		must(t, "SetRouteTable", n.SetRouteTable(ctx, vpc1, api.RouteTableSpec{RouteTableID: awsid.New("rtb"), Main: true,
			Routes: []api.RouteSpec{{Destination: "10.0.0.0/16", Target: "local"}, {Destination: "0.0.0.0/0", Target: igw}}}))
		drain(lanPeers)
		if err := dial(a.ns, lanPeer+":8080", 3*time.Second); err != nil {
			t.Fatalf("a guest behind an internet gateway could not reach the LAN: %v", err)
		}
		if got := <-lanPeers; got != hostLAN {
			t.Errorf("the LAN saw the guest as %s, want the host's %s (NAT)", got, hostLAN)
		}
		if err := dial(w.hostNS, protectedIP+":8080", 3*time.Second); err != nil {
			t.Fatalf("the host itself cannot reach %s, so the next check proves nothing: %v", protectedIP, err)
		}
		if err := dial(a.ns, protectedIP+":8080", time.Second); err == nil {
			t.Fatal("a guest reached a PROTECTED_CIDRS address")
		}
		if err := dial(w.lanNS, hostLAN+":4566", 3*time.Second); err != nil {
			t.Fatalf("the LAN cannot reach the host API, so the next check proves nothing: %v", err)
		}
		host, _ := core.Transit(0)
		for _, addr := range []string{hostLAN + ":4566", host.String() + ":4566"} {
			if err := dial(a.ns, addr, time.Second); err == nil {
				t.Fatalf("a guest reached the host's API at %s", addr)
			}
		}
		// Elastic IP: the LAN reaches the guest at the public address, and
		// the guest's connections out come from it.
		aPeers := listen(t, a.ns, "0.0.0.0:8080")
		must(t, "AssociateAddress", n.AssociateAddress(ctx, api.AddressSpec{PublicIP: "192.0.2.50", EniID: eniA}))
		if err := dial(w.lanNS, "192.0.2.50:8080", 3*time.Second); err != nil {
			lanNeigh, _ := inNS(t, w.lanNS, "ip", "neigh")
			counters, _ := inNS(t, core.NamespaceName(vpc1), "nft", "list", "ruleset")
			hostCounters, _ := inNS(t, w.hostNS, "nft", "list", "ruleset")
			fwd, _ := inNS(t, w.hostNS, "sysctl", "net.ipv4.conf.uplink0.forwarding", "net.ipv4.conf.uplink0.proxy_arp", "net.ipv4.ip_forward")
			t.Fatalf("the LAN could not reach the elastic IP: %v\nLAN neigh:\n%s\nVPC:\n%s\nhost:\n%s\n%s", err, lanNeigh, counters, hostCounters, fwd)
		}
		if got := <-aPeers; got != lanPeer {
			t.Errorf("the guest saw the LAN as %s, want %s", got, lanPeer)
		}
		drain(lanPeers)
		if err := dial(a.ns, lanPeer+":8080", 3*time.Second); err != nil {
			t.Fatal(err)
		}
		if got := <-lanPeers; got != "192.0.2.50" {
			t.Errorf("the LAN saw a guest with an elastic IP as %s", got)
		}
		if _, err := n.AllocateInterface(ctx, api.InterfaceSpec{}); err == nil {
			t.Error("an empty interface was accepted")
		}
		wantError(t, "AssociateAddress outside the pool", n.AssociateAddress(ctx, api.AddressSpec{PublicIP: "192.0.2.200", EniID: eniA}), api.ErrInvalidArgument)
		must(t, "DisassociateAddress", n.DisassociateAddress(ctx, "192.0.2.50"))
		if err := dial(w.lanNS, "192.0.2.50:8080", time.Second); err == nil {
			t.Fatal("the elastic IP still answered after disassociation")
		}
		must(t, "AssociateAddress again", n.AssociateAddress(ctx, api.AddressSpec{PublicIP: "192.0.2.50", EniID: eniA}))
	})

	t.Run("bad input leaves no kernel state", func(t *testing.T) {
		before := w.snapshot(vpc1, vpc2)
		wantError(t, "overlapping subnet", n.EnsureSubnet(ctx, vpc1, api.SubnetSpec{SubnetID: awsid.New("subnet"), CIDR: "10.0.1.128/25"}), api.ErrConflict)
		wantError(t, "subnet outside the VPC", n.EnsureSubnet(ctx, vpc1, api.SubnetSpec{SubnetID: awsid.New("subnet"), CIDR: "10.9.0.0/24"}), api.ErrInvalidArgument)
		wantError(t, "DeleteSubnet with live interfaces", n.DeleteSubnet(ctx, vpc1, sub1a), api.ErrInUse)
		wantError(t, "DeleteVPC with live interfaces", n.DeleteVPC(ctx, vpc1), api.ErrInUse)
		_, err := n.AllocateInterface(ctx, api.InterfaceSpec{SubnetID: sub1a, EniID: awsid.New("eni"), MAC: "02:00:0a:00:01:0a", PrivateIP: "10.0.1.77"})
		wantError(t, "MAC collision", err, api.ErrConflict)
		_, err = n.AllocateInterface(ctx, api.InterfaceSpec{SubnetID: sub1a, EniID: awsid.New("eni"), MAC: "02:00:0a:00:01:77", PrivateIP: "10.0.1.10"})
		wantError(t, "IP collision", err, api.ErrConflict)
		_, err = n.AllocateInterface(ctx, api.InterfaceSpec{SubnetID: awsid.New("subnet"), EniID: awsid.New("eni"), MAC: "02:00:0a:00:01:78", PrivateIP: "10.0.1.78"})
		wantError(t, "unknown subnet", err, api.ErrNotFound)
		wantError(t, "VPC CIDR /8", n.EnsureVPC(ctx, api.VPCSpec{VpcID: awsid.New("vpc"), CIDR: "10.0.0.0/8"}), api.ErrInvalidArgument)
		if got := w.snapshot(vpc1, vpc2); got != before {
			t.Fatalf("a refused call changed kernel state:\n--- before\n%s\n--- after\n%s", before, got)
		}
		// A tap with the name netd would give an ENI, but not netd's.
		eniF := awsid.New("eni")
		ns := core.NamespaceName(vpc1)
		sh(t, "ip", "-n", ns, "tuntap", "add", "dev", core.TapName(eniF), "mode", "tap")
		defer exec.Command("ip", "-n", ns, "link", "del", core.TapName(eniF)).Run()
		withForeign := w.snapshot(vpc1, vpc2)
		_, err = n.AllocateInterface(ctx, api.InterfaceSpec{SubnetID: sub1a, EniID: eniF, MAC: "02:00:0a:00:01:79", PrivateIP: "10.0.1.79"})
		wantError(t, "foreign tap", err, api.ErrConflict)
		if got := w.snapshot(vpc1, vpc2); got != withForeign {
			t.Fatalf("a refused AllocateInterface changed kernel state:\n--- before\n%s\n--- after\n%s", withForeign, got)
		}
	})

	t.Run("kill -9 and restart", func(t *testing.T) {
		before := w.snapshot(vpc1, vpc2)
		listen(t, w.lanNS, "0.0.0.0:8081")
		w.kill9()
		// Guests keep their network while netd is down.
		if err := dial(a.ns, lanPeer+":8081", 3*time.Second); err != nil {
			t.Errorf("a guest lost the LAN while netd was down: %v", err)
		}
		w.start()
		if got := w.snapshot(vpc1, vpc2); got != before {
			t.Fatalf("kernel state differs after a restart:\n--- before\n%s\n--- after\n%s", before, got)
		}
		if l := a.dhcp(t, w.dir); l["ip"] != "10.0.1.10" {
			t.Fatalf("lease after restart: %v", l)
		}
		if got := dig(t, b, "@10.0.0.2", "ip-10-0-1-10.ec2.internal"); got != "10.0.1.10" {
			t.Errorf("DNS after restart: %q", got)
		}
		// Metadata is memory only (it carries credentials): the gateway
		// pushes it again when netd's name reappears.
		must(t, "SetInstanceMetadata after restart", n.SetInstanceMetadata(ctx, eniA, md))
		tok, _ := curl(t, a, "-X", "PUT", "-H", "X-aws-ec2-metadata-token-ttl-seconds: 60", "http://169.254.169.254/latest/api/token")
		if body, code := curl(t, a, "-H", "X-aws-ec2-metadata-token: "+tok, "http://169.254.169.254/latest/meta-data/instance-id"); code != "200" || body != md.InstanceID {
			t.Errorf("IMDS after restart: HTTP %s %q", code, body)
		}
	})

	t.Run("deleting leaves nothing", func(t *testing.T) {
		for _, g := range w.guests {
			g.close()
		}
		for _, v := range []string{vpc1, vpc2} {
			w.releaseAll(ctx, v)
			must(t, "DeleteVPC "+v, n.DeleteVPC(ctx, v))
			must(t, "DeleteVPC again "+v, n.DeleteVPC(ctx, v))
		}
		if out := sh(t, "ip", "netns", "list"); strings.Contains(out, core.NamespaceName(vpc1)) || strings.Contains(out, core.NamespaceName(vpc2)) {
			t.Errorf("namespaces left:\n%s", out)
		}
		if out := links(t, w.hostNS); strings.Contains(out, core.HostVethPrefix) {
			t.Errorf("host links left:\n%s", out)
		}
		if out := sh(t, "ip", "-n", w.hostNS, "neigh", "show", "proxy"); strings.TrimSpace(out) != "" {
			t.Errorf("proxy ARP left: %s", out)
		}
		if out := sh(t, "ip", "-n", w.hostNS, "route"); strings.Contains(out, "192.0.2.50") {
			t.Errorf("public IP route left:\n%s", out)
		}
		if out := mustNS(t, w.hostNS, "nft", "list", "tables"); strings.Contains(out, "hangar-netd") {
			t.Errorf("netd's host table is left with no VPC:\n%s", out)
		}
	})
}

func drain(c <-chan string) {
	for {
		select {
		case <-c:
		default:
			return
		}
	}
}
