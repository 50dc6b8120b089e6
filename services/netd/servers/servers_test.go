package servers

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/insomniacslk/dhcp/dhcpv4"
	"github.com/miekg/dns"

	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/netd/core"
)

func testLease(mac string) (core.Lease, bool) {
	if mac != "02:00:00:00:00:01" {
		return core.Lease{}, false
	}
	return core.Lease{EniID: "eni-1", IP: netip.MustParseAddr("10.0.1.5"), Subnet: netip.MustParsePrefix("10.0.1.0/24"),
		Router: netip.MustParseAddr("10.0.1.1"), DNS: []netip.Addr{netip.MustParseAddr("10.0.0.2")},
		Domain: "ec2.internal", Hostname: "ip-10-0-1-5", LeaseTime: time.Hour, MTU: 1500}, true
}

func TestDHCPAnswer(t *testing.T) {
	server := netip.MustParseAddr("10.0.1.1")
	known, _ := net.ParseMAC("02:00:00:00:00:01")
	unknown, _ := net.ParseMAC("02:00:00:00:00:99")
	disc, _ := dhcpv4.NewDiscovery(known)
	offer, _, ok := Answer(disc, server, testLease)
	if !ok || offer.MessageType() != dhcpv4.MessageTypeOffer || !offer.YourIPAddr.Equal(net.ParseIP("10.0.1.5")) {
		t.Fatalf("offer = %v", offer)
	}
	if offer.DomainName() != "ec2.internal" || offer.HostName() != "ip-10-0-1-5" || !offer.Router()[0].Equal(net.ParseIP("10.0.1.1")) ||
		offer.IPAddressLeaseTime(0) != time.Hour || offer.SubnetMask().String() != "ffffff00" {
		t.Errorf("offer options: %s", offer.Summary())
	}
	if mtu := offer.Options.Get(dhcpv4.OptionInterfaceMTU); len(mtu) != 2 || int(mtu[0])<<8|int(mtu[1]) != 1500 {
		t.Errorf("MTU option %v", mtu)
	}
	req, _ := dhcpv4.NewRequestFromOffer(offer)
	ack, _, ok := Answer(req, server, testLease)
	if !ok || ack.MessageType() != dhcpv4.MessageTypeAck {
		t.Fatalf("ack = %v", ack)
	}
	wrong, _ := dhcpv4.NewRequestFromOffer(offer, dhcpv4.WithOption(dhcpv4.OptRequestedIPAddress(net.ParseIP("10.0.1.99"))))
	if nak, _, ok := Answer(wrong, server, testLease); !ok || nak.MessageType() != dhcpv4.MessageTypeNak {
		t.Errorf("a request for another address got %v", nak)
	}
	other, _ := dhcpv4.NewRequestFromOffer(offer, dhcpv4.WithOption(dhcpv4.OptServerIdentifier(net.ParseIP("10.0.1.254"))))
	if _, _, ok := Answer(other, server, testLease); ok {
		t.Error("a request for another server was answered")
	}
	discU, _ := dhcpv4.NewDiscovery(unknown)
	if _, _, ok := Answer(discU, server, testLease); ok {
		t.Error("an unknown MAC got an offer")
	}
}

func TestResolve(t *testing.T) {
	z := &core.Zone{Enabled: true, Domain: "ec2.internal", CIDR: netip.MustParsePrefix("10.0.0.0/16"),
		A: map[string]netip.Addr{"ip-10-0-1-5.ec2.internal.": netip.MustParseAddr("10.0.1.5")}, PTR: map[string]string{}}
	ask := func(name string, qt uint16, ups []string) *dns.Msg {
		m := new(dns.Msg)
		m.SetQuestion(name, qt)
		return Resolve(context.Background(), z, m, ups)
	}
	if r := ask("ip-10-0-1-5.ec2.internal.", dns.TypeA, nil); len(r.Answer) != 1 || !r.Authoritative {
		t.Errorf("A: %v", r)
	}
	if r := ask("ip-10-0-1-5.ec2.internal.", dns.TypeAAAA, nil); len(r.Answer) != 0 || r.Rcode != dns.RcodeSuccess {
		t.Errorf("AAAA of a known name should be NODATA: %v", r)
	}
	if r := ask("example.com.", dns.TypeA, nil); r.Rcode != dns.RcodeRefused {
		t.Errorf("no upstreams: rcode %s", dns.RcodeToString[r.Rcode])
	}
	// An upstream that never answers: SERVFAIL within the timeout, no hang.
	pc, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Close()
	start := time.Now()
	if r := ask("example.com.", dns.TypeA, []string{pc.LocalAddr().String()}); r.Rcode != dns.RcodeServerFailure {
		t.Errorf("silent upstream: rcode %s", dns.RcodeToString[r.Rcode])
	}
	if d := time.Since(start); d > 3*ForwardTimeout {
		t.Errorf("a silent upstream held the answer for %v", d)
	}
	z.Enabled = false
	if r := ask("ip-10-0-1-5.ec2.internal.", dns.TypeA, nil); r.Rcode != dns.RcodeRefused {
		t.Errorf("DNS support off: rcode %s", dns.RcodeToString[r.Rcode])
	}
}

func TestIMDSHandler(t *testing.T) {
	md := api.InstanceMetadata{InstanceID: "i-1", HttpTokens: "optional"}
	now := time.Unix(1000, 0)
	h := NewIMDSHandler(func(ip netip.Addr) (Instance, bool) {
		if ip.String() != "10.0.1.5" {
			return Instance{}, false
		}
		return Instance{Metadata: md, Net: core.NetInfo{IP: ip, MAC: "02:00:00:00:00:01", Domain: "ec2.internal"}}, true
	}, func() time.Time { return now })
	do := func(method, path string, hdr map[string]string, from string) *httptest.ResponseRecorder {
		r := httptest.NewRequest(method, path, nil)
		r.RemoteAddr = from + ":40000"
		for k, v := range hdr {
			r.Header.Set(k, v)
		}
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		return w
	}
	if w := do("GET", "/latest/meta-data/instance-id", nil, "10.0.1.5"); w.Code != 200 || w.Body.String() != "i-1" {
		t.Errorf("v1: %d %q", w.Code, w.Body.String())
	}
	// cloud-init's Ec2 datasource asks for dated versions, never "latest".
	for _, path := range []string{"/2021-03-23/meta-data/instance-id", "/2009-04-04/meta-data/instance-id"} {
		if w := do("GET", path, nil, "10.0.1.5"); w.Code != 200 || w.Body.String() != "i-1" {
			t.Errorf("%s: %d %q", path, w.Code, w.Body.String())
		}
	}
	if w := do("GET", "/2009-04-04/meta-data/", nil, "10.0.1.5"); w.Code != 200 || !strings.Contains(w.Body.String(), "instance-id") {
		t.Errorf("dated listing: %d %q", w.Code, w.Body.String())
	}
	if w := do("GET", "/", nil, "10.0.1.5"); w.Code != 200 || !strings.Contains(w.Body.String(), "2009-04-04\n") || !strings.HasSuffix(w.Body.String(), "\nlatest") {
		t.Errorf("versions: %d %q", w.Code, w.Body.String())
	}
	if w := do("GET", "/1999-01-01/meta-data/instance-id", nil, "10.0.1.5"); w.Code != 404 {
		t.Errorf("unknown version: %d", w.Code)
	}
	if w := do("GET", "/latest/meta-data/instance-id", nil, "10.0.1.6"); w.Code != 404 {
		t.Errorf("unknown caller: %d", w.Code)
	}
	if w := do("PUT", "/latest/api/token", nil, "10.0.1.5"); w.Code != 400 {
		t.Errorf("token without TTL: %d", w.Code)
	}
	if w := do("PUT", "/latest/api/token", map[string]string{"X-aws-ec2-metadata-token-ttl-seconds": "60", "X-Forwarded-For": "1.2.3.4"}, "10.0.1.5"); w.Code != 403 {
		t.Errorf("token through a proxy: %d", w.Code)
	}
	w := do("PUT", "/latest/api/token", map[string]string{"X-aws-ec2-metadata-token-ttl-seconds": "60"}, "10.0.1.5")
	tok := w.Body.String()
	if w.Code != 200 || tok == "" || w.Header().Get("X-aws-ec2-metadata-token-ttl-seconds") != "60" {
		t.Fatalf("token: %d %q", w.Code, tok)
	}
	md.HttpTokens = "required"
	if w := do("GET", "/latest/meta-data/instance-id", nil, "10.0.1.5"); w.Code != 401 {
		t.Errorf("v1 with tokens required: %d", w.Code)
	}
	if w := do("GET", "/latest/meta-data/", map[string]string{"X-aws-ec2-metadata-token": tok}, "10.0.1.5"); w.Code != 200 || !strings.Contains(w.Body.String(), "instance-id") {
		t.Errorf("v2 listing: %d %q", w.Code, w.Body.String())
	}
	now = now.Add(61 * time.Second)
	if w := do("GET", "/latest/meta-data/instance-id", map[string]string{"X-aws-ec2-metadata-token": tok}, "10.0.1.5"); w.Code != http.StatusUnauthorized {
		t.Errorf("expired token: %d", w.Code)
	}
}
