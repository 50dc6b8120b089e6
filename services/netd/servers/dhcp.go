// Package servers runs what every VPC serves from its router namespace:
// DHCP on each subnet bridge (static leases by MAC), the VPC resolver
// (DNS at base+2 and 169.254.169.253) and instance metadata at
// 169.254.169.254. Each server opens its sockets inside the VPC's
// namespace and asks the service for the current tables on every request,
// so a change is served at once and nothing here keeps state of its own
// beyond IMDSv2 tokens.
package servers

import (
	"encoding/binary"
	"fmt"
	"log/slog"
	"net"
	"net/netip"

	"github.com/insomniacslk/dhcp/dhcpv4"
	"github.com/insomniacslk/dhcp/dhcpv4/server4"

	"hangar.dev/hangar/services/netd/core"
)

// Netns runs a function inside a named network namespace; sockets opened
// there stay there.
type Netns interface {
	In(ns string, fn func() error) error
}

// LeaseFunc returns the static lease of a MAC on this subnet.
type LeaseFunc func(mac string) (core.Lease, bool)

// DHCP is one subnet's DHCP server.
type DHCP struct {
	srv  *server4.Server
	done chan struct{}
}

// StartDHCP serves DHCP on bridge inside ns, answering only MACs that
// lease knows, from server (the subnet's router address). onAck is told
// of every ACK.
func StartDHCP(k Netns, ns, bridge string, server netip.Addr, lease LeaseFunc, onAck func(core.Lease, string), log *slog.Logger) (*DHCP, error) {
	var conn *net.UDPConn
	err := k.In(ns, func() error {
		var err error
		conn, err = server4.NewIPv4UDPConn(bridge, &net.UDPAddr{Port: dhcpv4.ServerPort})
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("opening DHCP socket on %s in %s: %w", bridge, ns, err)
	}
	h := func(c net.PacketConn, peer net.Addr, m *dhcpv4.DHCPv4) {
		reply, l, ok := Answer(m, server, lease)
		if !ok {
			return
		}
		if _, err := c.WriteTo(reply.ToBytes(), peer); err != nil {
			log.Warn("sending DHCP reply", "bridge", bridge, "mac", m.ClientHWAddr.String(), "err", err)
			return
		}
		if reply.MessageType() == dhcpv4.MessageTypeAck && onAck != nil {
			onAck(l, m.ClientHWAddr.String())
		}
	}
	srv, err := server4.NewServer("", nil, h, server4.WithConn(conn))
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("starting DHCP server on %s: %w", bridge, err)
	}
	d := &DHCP{srv: srv, done: make(chan struct{})}
	go func() {
		defer close(d.done)
		_ = srv.Serve()
	}()
	return d, nil
}

// Close stops the server and waits for it.
func (d *DHCP) Close() {
	_ = d.srv.Close()
	<-d.done
}

// Answer builds the reply to a DHCP message: OFFER for DISCOVER; ACK for a
// REQUEST of the leased address (or none), NAK for any other address;
// nothing for unknown MACs, for requests meant for another server, and
// for everything else.
func Answer(m *dhcpv4.DHCPv4, server netip.Addr, lease LeaseFunc) (*dhcpv4.DHCPv4, core.Lease, bool) {
	l, ok := lease(m.ClientHWAddr.String())
	if !ok {
		return nil, l, false
	}
	var typ dhcpv4.MessageType
	switch m.MessageType() {
	case dhcpv4.MessageTypeDiscover:
		typ = dhcpv4.MessageTypeOffer
	case dhcpv4.MessageTypeRequest:
		if sid := m.ServerIdentifier(); sid != nil && !sid.Equal(server.AsSlice()) {
			return nil, l, false
		}
		want := m.RequestedIPAddress()
		if want == nil || want.IsUnspecified() {
			want = m.ClientIPAddr
		}
		typ = dhcpv4.MessageTypeAck
		if want != nil && !want.IsUnspecified() && !want.Equal(l.IP.AsSlice()) {
			typ = dhcpv4.MessageTypeNak
		}
	default:
		return nil, l, false
	}
	mods := []dhcpv4.Modifier{
		dhcpv4.WithMessageType(typ),
		dhcpv4.WithOption(dhcpv4.OptServerIdentifier(server.AsSlice())),
	}
	if typ != dhcpv4.MessageTypeNak {
		mask := net.CIDRMask(l.Subnet.Bits(), 32)
		bcast := make(net.IP, 4)
		for i, b := range l.Subnet.Addr().As4() {
			bcast[i] = b | ^mask[i]
		}
		mtu := make([]byte, 2)
		binary.BigEndian.PutUint16(mtu, uint16(l.MTU))
		var dns []net.IP
		for _, d := range l.DNS {
			dns = append(dns, d.AsSlice())
		}
		mods = append(mods,
			dhcpv4.WithYourIP(l.IP.AsSlice()),
			dhcpv4.WithNetmask(mask),
			dhcpv4.WithRouter(l.Router.AsSlice()),
			dhcpv4.WithDNS(dns...),
			dhcpv4.WithOption(dhcpv4.OptDomainName(l.Domain)),
			dhcpv4.WithOption(dhcpv4.OptHostName(l.Hostname)),
			dhcpv4.WithOption(dhcpv4.OptBroadcastAddress(bcast)),
			dhcpv4.WithLeaseTime(uint32(l.LeaseTime.Seconds())),
			dhcpv4.WithGeneric(dhcpv4.OptionInterfaceMTU, mtu),
		)
	}
	reply, err := dhcpv4.NewReplyFromRequest(m, mods...)
	if err != nil {
		return nil, l, false
	}
	return reply, l, true
}
