package kernel

import (
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"testing"

	"hangar.dev/hangar/services/internal/awsid"
	"hangar.dev/hangar/services/netd/core"
)

// TestApplyFilterRendersRules applies a plan in a scratch namespace and
// reads it back with nft, so the expressions netd builds are the rules an
// operator would have written.
func TestApplyFilterRendersRules(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("skipping: needs root (network namespaces, nftables); CI runs as root")
	}
	if _, err := exec.LookPath("nft"); err != nil {
		t.Skip("skipping: nft is not installed (make test installs it)")
	}
	ns := core.NamespacePrefix + "ktest" + awsid.New("x")[2:10]
	k, err := New()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := k.EnsureNamespace(ns); err != nil {
		t.Fatal(err)
	}
	defer k.DeleteNamespace(ns)
	ip := netip.MustParseAddr("10.0.1.10")
	plan := core.FilterPlan{
		Sets:      map[string][]netip.Addr{"sg-a": {ip}},
		Protected: []netip.Prefix{netip.MustParsePrefix("192.0.2.0/24")},
		Services:  []netip.Addr{netip.MustParseAddr("10.0.0.2"), core.DNSLinkLocal, core.IMDSAddr},
		Uplink:    true,
		NATs:      []core.NAT{{Public: netip.MustParseAddr("203.0.113.5"), Private: ip}},
		ENIs: []core.ENIFilter{{EniID: "eni-1", Tap: "ht-1", MAC: "02:00:00:00:00:01", IP: ip,
			Ingress: []core.Match{
				{Proto: 6, PortFrom: 8080, PortTo: 8080, ICMPType: -1, ICMPCode: -1, Peer: netip.MustParsePrefix("0.0.0.0/0")},
				{Proto: 6, PortFrom: 20, PortTo: 30, ICMPType: -1, ICMPCode: -1, PeerSet: "sg-a"},
				{Proto: 1, ICMPType: 8, ICMPCode: -1, Peer: netip.MustParsePrefix("10.0.0.0/16")},
			},
			Egress: []core.Match{{ICMPType: -1, ICMPCode: -1, Peer: netip.MustParsePrefix("0.0.0.0/0")}},
		}},
	}
	if err := k.ApplyFilter(ns, plan); err != nil {
		t.Fatal(err)
	}
	// Applying twice replaces, never duplicates.
	if err := k.ApplyFilter(ns, plan); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("ip", "netns", "exec", ns, "nft", "-s", "list", "ruleset").CombinedOutput()
	if err != nil {
		t.Fatalf("nft: %v\n%s", err, out)
	}
	for _, want := range []string{
		"ip daddr 192.0.2.0/24 counter drop",
		"ip saddr 10.0.1.10 jump out-eni-1",
		"ip daddr 10.0.1.10 jump in-eni-1",
		"tcp dport 8080 counter accept",
		"ip saddr @sg-a tcp dport 20-30 counter accept",
		"ip saddr 10.0.0.0/16 icmp type echo-request counter accept",
		`iifname "hangar-uplink" ip daddr 203.0.113.5 dnat to 10.0.1.10`,
		`oifname "hangar-uplink" ip saddr 10.0.1.10 snat to 203.0.113.5`,
		`iifname "ht-1" ether saddr != 02:00:00:00:00:01 counter drop`,
		`iifname "hb-*" ip daddr 169.254.169.254 tcp dport 80 accept`,
	} {
		if !strings.Contains(string(out), want) {
			t.Errorf("ruleset lacks %q", want)
		}
	}
	if strings.Count(string(out), "table ip hangar") != 1 {
		t.Errorf("the table was not replaced:\n%s", out)
	}
	if t.Failed() {
		t.Logf("ruleset:\n%s", out)
		dbg, _ := exec.Command("ip", "netns", "exec", ns, "nft", "--debug=netlink", "list", "chain", "ip", "hangar", "in-eni-1").CombinedOutput()
		t.Logf("%s", dbg)
	}
}
