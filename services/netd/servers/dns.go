package servers

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"sync"
	"time"

	"github.com/miekg/dns"

	"hangar.dev/hangar/services/netd/core"
)

// ZoneFunc returns the VPC's current zone.
type ZoneFunc func() *core.Zone

// DNS is one VPC's resolver.
type DNS struct {
	servers []*dns.Server
	wg      sync.WaitGroup
}

// ForwardTimeout bounds a forwarded question, so a guest gets SERVFAIL
// rather than a hang when the upstreams are silent.
const ForwardTimeout = 2 * time.Second

// StartDNS serves the VPC zone on UDP and TCP port 53 of addrs inside ns.
// Questions outside the zone go to upstreams (from the host namespace),
// or are REFUSED when there are none.
func StartDNS(k Netns, ns string, addrs []netip.Addr, zone ZoneFunc, upstreams []string, log *slog.Logger) (*DNS, error) {
	d := &DNS{}
	h := &dnsHandler{zone: zone, upstreams: upstreams, log: log}
	err := k.In(ns, func() error {
		for _, a := range addrs {
			ap := netip.AddrPortFrom(a, 53).String()
			pc, err := net.ListenPacket("udp4", ap)
			if err != nil {
				return fmt.Errorf("listening on udp %s: %w", ap, err)
			}
			d.servers = append(d.servers, &dns.Server{PacketConn: pc, Handler: h})
			ln, err := net.Listen("tcp4", ap)
			if err != nil {
				return fmt.Errorf("listening on tcp %s: %w", ap, err)
			}
			d.servers = append(d.servers, &dns.Server{Listener: ln, Handler: h})
		}
		return nil
	})
	if err != nil {
		d.Close()
		return nil, fmt.Errorf("starting DNS in %s: %w", ns, err)
	}
	for _, s := range d.servers {
		d.wg.Add(1)
		go func() {
			defer d.wg.Done()
			_ = s.ActivateAndServe()
		}()
	}
	return d, nil
}

// Close stops every listener and waits.
func (d *DNS) Close() {
	for _, s := range d.servers {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		err := s.ShutdownContext(ctx)
		cancel()
		if err != nil {
			// Never started, or stuck: close the sockets regardless.
			if s.PacketConn != nil {
				_ = s.PacketConn.Close()
			}
			if s.Listener != nil {
				_ = s.Listener.Close()
			}
		}
	}
	d.wg.Wait()
}

type dnsHandler struct {
	zone      ZoneFunc
	upstreams []string
	log       *slog.Logger
}

func (h *dnsHandler) ServeDNS(w dns.ResponseWriter, r *dns.Msg) {
	_ = w.WriteMsg(Resolve(context.Background(), h.zone(), r, h.upstreams))
}

// Resolve answers r from zone, forwarding what is not the zone's.
func Resolve(ctx context.Context, zone *core.Zone, r *dns.Msg, upstreams []string) *dns.Msg {
	m := new(dns.Msg)
	m.SetReply(r)
	m.RecursionAvailable = true
	if len(r.Question) != 1 {
		m.Rcode = dns.RcodeFormatError
		return m
	}
	q := r.Question[0]
	out, a, ptr := zone.Lookup(q.Name, q.Qtype)
	switch out {
	case core.Refused:
		m.Rcode = dns.RcodeRefused
	case core.Answer:
		m.Authoritative = true
		hdr := dns.RR_Header{Name: q.Name, Class: dns.ClassINET, Ttl: 60}
		if q.Qtype == dns.TypeA {
			hdr.Rrtype = dns.TypeA
			m.Answer = append(m.Answer, &dns.A{Hdr: hdr, A: a.AsSlice()})
		} else {
			hdr.Rrtype = dns.TypePTR
			m.Answer = append(m.Answer, &dns.PTR{Hdr: hdr, Ptr: ptr})
		}
	case core.NoData:
		m.Authoritative = true
	case core.NXDomain:
		m.Authoritative = true
		m.Rcode = dns.RcodeNameError
	case core.Forward:
		if len(upstreams) == 0 {
			m.Rcode = dns.RcodeRefused
			return m
		}
		c := &dns.Client{Timeout: ForwardTimeout}
		for _, up := range upstreams {
			ctx, cancel := context.WithTimeout(ctx, ForwardTimeout)
			resp, _, err := c.ExchangeContext(ctx, r, up)
			cancel()
			if err == nil && resp != nil {
				resp.Id = r.Id
				return resp
			}
		}
		m.Rcode = dns.RcodeServerFailure
	}
	return m
}
