package kernel

import (
	"fmt"
	"net"
	"net/netip"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"github.com/mdlayher/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"hangar.dev/hangar/services/netd/core"
)

// Table names. A VPC namespace is netd's alone, so its tables are simply
// "hangar"; in the host namespace netd shares the stack with the operator's
// own rules and keeps to its one table.
const (
	vpcTable = "hangar"
	// DefaultHostTable is netd's table in the host namespace.
	DefaultHostTable = "hangar-netd"
)

// rb builds one rule's expressions.
type rb []expr.Any

func ifname(n string) []byte {
	b := make([]byte, 16)
	copy(b, n)
	return b
}

func (r rb) iif(name string) rb {
	return append(r, &expr.Meta{Key: expr.MetaKeyIIFNAME, Register: 1}, &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: ifname(name)})
}

func (r rb) oif(name string) rb {
	return append(r, &expr.Meta{Key: expr.MetaKeyOIFNAME, Register: 1}, &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: ifname(name)})
}

// iifPrefix matches interface names starting with p (nft's "p*").
func (r rb) iifPrefix(p string, eq bool) rb {
	op := expr.CmpOpEq
	if !eq {
		op = expr.CmpOpNeq
	}
	return append(r, &expr.Meta{Key: expr.MetaKeyIIFNAME, Register: 1}, &expr.Cmp{Op: op, Register: 1, Data: []byte(p)})
}

func (r rb) oifPrefix(p string, eq bool) rb {
	op := expr.CmpOpEq
	if !eq {
		op = expr.CmpOpNeq
	}
	return append(r, &expr.Meta{Key: expr.MetaKeyOIFNAME, Register: 1}, &expr.Cmp{Op: op, Register: 1, Data: []byte(p)})
}

func (r rb) ctState(bits uint32) rb {
	return append(r,
		&expr.Ct{Register: 1, Key: expr.CtKeySTATE},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: binaryutil.NativeEndian.PutUint32(bits), Xor: binaryutil.NativeEndian.PutUint32(0)},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: binaryutil.NativeEndian.PutUint32(0)})
}

// addr matches the IPv4 source (offset 12) or destination (16) against a
// prefix; /0 matches everything and adds nothing.
func (r rb) addr(offset uint32, p netip.Prefix, eq bool) rb {
	if p.Bits() == 0 && eq {
		return r
	}
	r = append(r, &expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: offset, Len: 4})
	if p.Bits() < 32 {
		mask := net.CIDRMask(p.Bits(), 32)
		r = append(r, &expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: mask, Xor: []byte{0, 0, 0, 0}})
	}
	op := expr.CmpOpEq
	if !eq {
		op = expr.CmpOpNeq
	}
	return append(r, &expr.Cmp{Op: op, Register: 1, Data: p.Masked().Addr().AsSlice()})
}

func (r rb) saddr(p netip.Prefix) rb { return r.addr(12, p, true) }
func (r rb) daddr(p netip.Prefix) rb { return r.addr(16, p, true) }

func host(a netip.Addr) netip.Prefix { return netip.PrefixFrom(a, 32) }

func (r rb) inSet(offset uint32, s *nftables.Set, invert bool) rb {
	return append(r,
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: offset, Len: 4},
		&expr.Lookup{SourceRegister: 1, SetName: s.Name, SetID: s.ID, Invert: invert})
}

func (r rb) l4(proto uint8) rb {
	return append(r, &expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1}, &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{proto}})
}

func (r rb) dport(from, to uint16) rb {
	r = append(r, &expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2})
	if from == to {
		return append(r, &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.BigEndian.PutUint16(from)})
	}
	return append(r, &expr.Range{Op: expr.CmpOpEq, Register: 1, FromData: binaryutil.BigEndian.PutUint16(from), ToData: binaryutil.BigEndian.PutUint16(to)})
}

func (r rb) match(m core.Match, peerOffset uint32, sets map[string]*nftables.Set) (rb, bool) {
	if m.PeerSet != "" {
		s := sets[m.PeerSet]
		if s == nil {
			return nil, false
		}
		r = r.inSet(peerOffset, s, false)
	} else {
		r = r.addr(peerOffset, m.Peer, true)
	}
	if m.Proto != 0 {
		r = r.l4(m.Proto)
	}
	switch m.Proto {
	case unix.IPPROTO_TCP, unix.IPPROTO_UDP:
		if m.PortFrom != 0 || m.PortTo != 0 {
			r = r.dport(m.PortFrom, m.PortTo)
		}
	case unix.IPPROTO_ICMP:
		if m.ICMPType >= 0 {
			r = append(r, &expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 0, Len: 1},
				&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{byte(m.ICMPType)}})
			if m.ICMPCode >= 0 {
				r = append(r, &expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 1, Len: 1},
					&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{byte(m.ICMPCode)}})
			}
		}
	}
	return r, true
}

func (r rb) counter() rb { return append(r, &expr.Counter{}) }

func (r rb) verdict(k expr.VerdictKind) rb { return append(r, &expr.Verdict{Kind: k}) }

func (r rb) jump(chain string) rb {
	return append(r, &expr.Verdict{Kind: expr.VerdictJump, Chain: chain})
}

func (r rb) snat(t expr.NATType, to netip.Addr) rb {
	return append(r,
		&expr.Immediate{Register: 1, Data: to.AsSlice()},
		&expr.NAT{Type: t, Family: unix.NFPROTO_IPV4, RegAddrMin: 1, RegAddrMax: 1})
}

func (r rb) masq() rb { return append(r, &expr.Masq{}) }

func add(c *nftables.Conn, t *nftables.Table, ch *nftables.Chain, r rb) {
	c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: r})
}

// replaceTable queues the atomic replacement of a table: creating it
// first makes the delete valid whether or not it existed, and the kernel
// applies the whole batch or none of it.
func replaceTable(c *nftables.Conn, t *nftables.Table) *nftables.Table {
	c.AddTable(t)
	c.DelTable(t)
	return c.AddTable(t)
}

func policy(p nftables.ChainPolicy) *nftables.ChainPolicy { return &p }

// bigReceiveBuffer lets one batch of a large VPC (thousands of rules, each
// acknowledged by the kernel) land in one go: the default receive buffer
// overflows (ENOBUFS) at a few hundred acknowledgements.
func bigReceiveBuffer(c *netlink.Conn) error {
	rc, err := c.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, 32<<20)
		if serr == nil {
			// The batch goes out in one sendmsg, which must fit too.
			serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_SNDBUFFORCE, 32<<20)
		}
	}); err != nil {
		return err
	}
	return serr
}

// ApplyFilter replaces the VPC namespace's tables with plan, atomically:
// in the ip table the security groups (forward), the router's own services
// (input) and the NAT of the uplink; in the bridge table the anti-spoofing
// of every tap (a guest sends only from its own MAC and IP).
func (k *Linux) ApplyFilter(ns string, plan core.FilterPlan) error {
	target, err := netns.GetFromName(ns)
	if err != nil {
		return fmt.Errorf("opening namespace %s: %w", ns, err)
	}
	defer target.Close()
	c, err := nftables.New(nftables.WithNetNSFd(int(target)), nftables.WithSockOptions(bigReceiveBuffer))
	if err != nil {
		return fmt.Errorf("opening nftables in %s: %w", ns, err)
	}
	t := replaceTable(c, &nftables.Table{Family: nftables.TableFamilyIPv4, Name: vpcTable})

	sets := map[string]*nftables.Set{}
	var setID uint32 = 1
	mkset := func(name string, addrs []netip.Addr) error {
		s := &nftables.Set{Table: t, Name: name, ID: setID, KeyType: nftables.TypeIPAddr}
		setID++
		var els []nftables.SetElement
		for _, a := range addrs {
			els = append(els, nftables.SetElement{Key: a.AsSlice()})
		}
		if err := c.AddSet(s, els); err != nil {
			return fmt.Errorf("queueing set %s: %w", name, err)
		}
		sets[name] = s
		return nil
	}
	for _, id := range core.SortedIDs(plan.Sets) {
		if err := mkset(id, plan.Sets[id]); err != nil {
			return err
		}
	}
	var eniIPs []netip.Addr
	for _, e := range plan.ENIs {
		eniIPs = append(eniIPs, e.IP)
	}
	if err := mkset("interfaces", eniIPs); err != nil {
		return err
	}

	fwd := c.AddChain(&nftables.Chain{Name: "forward", Table: t, Type: nftables.ChainTypeFilter, Hooknum: nftables.ChainHookForward, Priority: nftables.ChainPriorityFilter, Policy: policy(nftables.ChainPolicyDrop)})
	in := c.AddChain(&nftables.Chain{Name: "input", Table: t, Type: nftables.ChainTypeFilter, Hooknum: nftables.ChainHookInput, Priority: nftables.ChainPriorityFilter, Policy: policy(nftables.ChainPolicyDrop)})
	pre := c.AddChain(&nftables.Chain{Name: "prerouting", Table: t, Type: nftables.ChainTypeNAT, Hooknum: nftables.ChainHookPrerouting, Priority: nftables.ChainPriorityNATDest})
	post := c.AddChain(&nftables.Chain{Name: "postrouting", Table: t, Type: nftables.ChainTypeNAT, Hooknum: nftables.ChainHookPostrouting, Priority: nftables.ChainPriorityNATSource})

	// forward: replies, then PROTECTED_CIDRS (never, whatever a group
	// says), then the sender's egress rules, then the receiver's ingress.
	add(c, t, fwd, rb{}.ctState(expr.CtStateBitESTABLISHED|expr.CtStateBitRELATED).verdict(expr.VerdictAccept))
	add(c, t, fwd, rb{}.ctState(expr.CtStateBitINVALID).verdict(expr.VerdictDrop))
	for _, p := range plan.Protected {
		add(c, t, fwd, rb{}.daddr(p).counter().verdict(expr.VerdictDrop))
	}
	// A packet from a subnet whose source is no interface's is spoofed.
	add(c, t, fwd, rb{}.iifPrefix("hb-", true).inSet(12, sets["interfaces"], true).counter().verdict(expr.VerdictDrop))
	// Every sender's egress check comes before any receiver's ingress:
	// an ingress accept is final, so it must not skip the sender's check.
	outs, ins := map[string]*nftables.Chain{}, map[string]*nftables.Chain{}
	for _, e := range plan.ENIs {
		outs[e.EniID] = c.AddChain(&nftables.Chain{Name: "out-" + e.EniID, Table: t})
		ins[e.EniID] = c.AddChain(&nftables.Chain{Name: "in-" + e.EniID, Table: t})
	}
	for _, e := range plan.ENIs {
		add(c, t, fwd, rb{}.saddr(host(e.IP)).jump(outs[e.EniID].Name))
	}
	for _, e := range plan.ENIs {
		add(c, t, fwd, rb{}.daddr(host(e.IP)).jump(ins[e.EniID].Name))
	}
	for _, e := range plan.ENIs {
		out, inc := outs[e.EniID], ins[e.EniID]
		for _, m := range e.Egress {
			if r, ok := (rb{}).match(m, 16, sets); ok {
				add(c, t, out, r.verdict(expr.VerdictReturn))
			}
		}
		add(c, t, out, rb{}.counter().verdict(expr.VerdictDrop))
		for _, m := range e.Ingress {
			if r, ok := (rb{}).match(m, 12, sets); ok {
				add(c, t, inc, r.counter().verdict(expr.VerdictAccept))
			}
		}
		add(c, t, inc, rb{}.counter().verdict(expr.VerdictDrop))
	}
	if plan.Uplink {
		add(c, t, fwd, rb{}.iifPrefix("hb-", true).oif(core.UplinkName).verdict(expr.VerdictAccept))
	}

	// input: the router's own services, always allowed, as in AWS.
	add(c, t, in, rb{}.ctState(expr.CtStateBitESTABLISHED|expr.CtStateBitRELATED).verdict(expr.VerdictAccept))
	add(c, t, in, rb{}.iif("lo").verdict(expr.VerdictAccept))
	add(c, t, in, rb{}.iifPrefix("hb-", true).l4(unix.IPPROTO_UDP).dport(67, 67).verdict(expr.VerdictAccept))
	for _, a := range plan.Services {
		if a == core.IMDSAddr {
			add(c, t, in, rb{}.iifPrefix("hb-", true).daddr(host(a)).l4(unix.IPPROTO_TCP).dport(80, 80).verdict(expr.VerdictAccept))
			continue
		}
		add(c, t, in, rb{}.iifPrefix("hb-", true).daddr(host(a)).l4(unix.IPPROTO_UDP).dport(53, 53).verdict(expr.VerdictAccept))
		add(c, t, in, rb{}.iifPrefix("hb-", true).daddr(host(a)).l4(unix.IPPROTO_TCP).dport(53, 53).verdict(expr.VerdictAccept))
	}
	for _, gw := range plan.Gateways {
		add(c, t, in, rb{}.iifPrefix("hb-", true).daddr(host(gw)).l4(unix.IPPROTO_ICMP).verdict(expr.VerdictAccept))
	}

	// NAT at the uplink: a public IP is its interface's, both ways; the
	// rest leaves as the transit address (the host masquerades again).
	if plan.Uplink {
		for _, n := range plan.NATs {
			add(c, t, pre, rb{}.iif(core.UplinkName).daddr(host(n.Public)).snat(expr.NATTypeDestNAT, n.Private))
			add(c, t, post, rb{}.oif(core.UplinkName).saddr(host(n.Private)).snat(expr.NATTypeSourceNAT, n.Public))
		}
		add(c, t, post, rb{}.oif(core.UplinkName).masq())
	}

	// bridge table: a tap may send only from its MAC, and IPv4 and ARP
	// only from its IP (0.0.0.0 while it asks DHCP).
	bt := replaceTable(c, &nftables.Table{Family: nftables.TableFamilyBridge, Name: vpcTable})
	bpre := c.AddChain(&nftables.Chain{Name: "prerouting", Table: bt, Type: nftables.ChainTypeFilter, Hooknum: nftables.ChainHookPrerouting, Priority: nftables.ChainPriorityRef(-200)})
	for _, e := range plan.ENIs {
		hw, err := net.ParseMAC(e.MAC)
		if err != nil {
			return fmt.Errorf("interface %s: %w", e.EniID, err)
		}
		add(c, bt, bpre, rb{}.iif(e.Tap).append(
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseLLHeader, Offset: 6, Len: 6},
			&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: hw}).counter().verdict(expr.VerdictDrop))
		for _, pr := range []struct {
			etype  uint16
			offset uint32
		}{{unix.ETH_P_IP, 12}, {unix.ETH_P_ARP, 14}} {
			r := rb{}.iif(e.Tap).append(
				&expr.Meta{Key: expr.MetaKeyPROTOCOL, Register: 1},
				&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.BigEndian.PutUint16(pr.etype)}).
				addr(pr.offset, host(e.IP), false).
				addr(pr.offset, netip.MustParsePrefix("0.0.0.0/32"), false)
			add(c, bt, bpre, r.counter().verdict(expr.VerdictDrop))
		}
	}
	// A tap netd does not know (there should be none) sends nothing. The
	// known taps are a set: one comparison each would outgrow the kernel's
	// limit on a rule's size in a large VPC.
	taps := &nftables.Set{Table: bt, Name: "taps", ID: setID, KeyType: nftables.TypeIFName}
	var tapEls []nftables.SetElement
	for _, e := range plan.ENIs {
		tapEls = append(tapEls, nftables.SetElement{Key: ifname(e.Tap)})
	}
	if err := c.AddSet(taps, tapEls); err != nil {
		return fmt.Errorf("queueing set taps: %w", err)
	}
	add(c, bt, bpre, rb{}.iifPrefix("ht-", true).append(
		&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: 1},
		&expr.Lookup{SourceRegister: 1, SetName: taps.Name, SetID: taps.ID, Invert: true}).counter().verdict(expr.VerdictDrop))
	if err := c.Flush(); err != nil {
		return fmt.Errorf("applying nftables rules in %s: %w", ns, err)
	}
	return nil
}

func (r rb) append(e ...expr.Any) rb { return append(r, e...) }

// DeleteFilter removes netd's tables from a namespace.
func (k *Linux) DeleteFilter(ns string) error {
	target, err := netns.GetFromName(ns)
	if err != nil {
		return nil
	}
	defer target.Close()
	c, err := nftables.New(nftables.WithNetNSFd(int(target)))
	if err != nil {
		return err
	}
	for _, f := range []nftables.TableFamily{nftables.TableFamilyIPv4, nftables.TableFamilyBridge} {
		t := &nftables.Table{Family: f, Name: vpcTable}
		c.AddTable(t)
		c.DelTable(t)
	}
	return c.Flush()
}

// PublicIP is a public address routed to a VPC.
type PublicIP struct {
	IP      netip.Addr
	Veth    string     // host end of the VPC's uplink
	Via     netip.Addr // VPC end of the uplink
	Uplink  string     // host interface that answers ARP for it
	Present bool
}

// HostPlan is what netd holds in the host namespace.
type HostPlan struct {
	Protected []netip.Prefix
	PublicIPs []PublicIP
	// Pool is PUBLIC_IP_POOL: proxy ARP entries in it that no public IP
	// accounts for are stale and removed.
	Pool []netip.Prefix
	// Veths are the host ends of this netd's uplinks: only routes through
	// them are netd's to remove.
	Veths []string
}

// ApplyHost replaces netd's host table: what leaves a VPC is masqueraded
// to the host's address; guests never reach the host itself (its API, its
// SSH) nor PROTECTED_CIDRS nor another VPC's transit link. It also routes
// each public IP to its VPC and answers ARP for it on the uplink.
func (k *Linux) ApplyHost(plan HostPlan) error {
	if err := sysctl("net.ipv4.ip_forward", "1"); err != nil {
		return err
	}
	c, err := nftables.New()
	if err != nil {
		return fmt.Errorf("opening nftables: %w", err)
	}
	t := replaceTable(c, &nftables.Table{Family: nftables.TableFamilyIPv4, Name: k.HostTable})
	in := c.AddChain(&nftables.Chain{Name: "input", Table: t, Type: nftables.ChainTypeFilter, Hooknum: nftables.ChainHookInput, Priority: nftables.ChainPriorityFilter})
	fwd := c.AddChain(&nftables.Chain{Name: "forward", Table: t, Type: nftables.ChainTypeFilter, Hooknum: nftables.ChainHookForward, Priority: nftables.ChainPriorityFilter})
	post := c.AddChain(&nftables.Chain{Name: "postrouting", Table: t, Type: nftables.ChainTypeNAT, Hooknum: nftables.ChainHookPostrouting, Priority: nftables.ChainPriorityNATSource})
	vp := core.HostVethPrefix
	add(c, t, in, rb{}.iifPrefix(vp, true).ctState(expr.CtStateBitESTABLISHED|expr.CtStateBitRELATED).verdict(expr.VerdictAccept))
	add(c, t, in, rb{}.iifPrefix(vp, true).counter().verdict(expr.VerdictDrop))
	add(c, t, fwd, rb{}.iifPrefix(vp, true).ctState(expr.CtStateBitESTABLISHED|expr.CtStateBitRELATED).verdict(expr.VerdictAccept))
	for _, p := range plan.Protected {
		add(c, t, fwd, rb{}.iifPrefix(vp, true).daddr(p).counter().verdict(expr.VerdictDrop))
	}
	// One VPC never reaches another's transit address (and through it
	// that VPC's router).
	add(c, t, fwd, rb{}.iifPrefix(vp, true).daddr(core.TransitPool()).counter().verdict(expr.VerdictDrop))
	add(c, t, post, rb{}.saddr(core.TransitPool()).oifPrefix(vp, false).masq())
	if err := c.Flush(); err != nil {
		return fmt.Errorf("applying the host table %s: %w", k.HostTable, err)
	}
	return k.applyPublicIPs(plan)
}

// DeleteHost removes netd's host table.
func (k *Linux) DeleteHost() error {
	c, err := nftables.New()
	if err != nil {
		return err
	}
	t := &nftables.Table{Family: nftables.TableFamilyIPv4, Name: k.HostTable}
	c.AddTable(t)
	c.DelTable(t)
	return c.Flush()
}
