package core

import (
	"fmt"
	"net/netip"
	"sort"

	"hangar.dev/hangar/services/internal/api"
)

// Match is one compiled security group rule: traffic of Proto (0: any) on
// a port range (tcp, udp) or ICMP type/code, from (ingress) or to (egress)
// a peer CIDR or the members of a peer group (PeerSet).
type Match struct {
	Proto    uint8
	PortFrom uint16 // PortFrom == PortTo == 0: any port
	PortTo   uint16
	ICMPType int16 // -1: any
	ICMPCode int16 // -1: any
	Peer     netip.Prefix
	PeerSet  string // a group id; its members' addresses are a set
}

func compileRule(r api.SGRule) (Match, error) {
	m := Match{ICMPType: -1, ICMPCode: -1}
	proto, err := protoNumber(r.Protocol)
	if err != nil {
		return m, err
	}
	m.Proto = proto
	switch proto {
	case 6, 17:
		from, to := r.FromPort, r.ToPort
		if from == -1 && to == -1 || from == 0 && to == 65535 {
			break
		}
		if from < 0 || to > 65535 || from > to {
			return m, fmt.Errorf("port range %d-%d is not within 0-65535", from, to)
		}
		m.PortFrom, m.PortTo = uint16(from), uint16(to)
	case 1:
		if r.FromPort < -1 || r.FromPort > 255 || r.ToPort < -1 || r.ToPort > 255 {
			return m, fmt.Errorf("ICMP type %d and code %d must be -1 or 0-255", r.FromPort, r.ToPort)
		}
		m.ICMPType, m.ICMPCode = int16(r.FromPort), int16(r.ToPort)
		if m.ICMPType == -1 {
			m.ICMPCode = -1
		}
	}
	switch {
	case r.CIDR != "" && r.GroupID != "":
		return m, fmt.Errorf("a rule names a CIDR or a group, not both")
	case r.CIDR != "":
		p, err := netip.ParsePrefix(r.CIDR)
		if err != nil || !p.Addr().Is4() {
			return m, fmt.Errorf("%q is not an IPv4 CIDR", r.CIDR)
		}
		m.Peer = p.Masked()
	case r.GroupID != "":
		m.PeerSet = r.GroupID
	default:
		return m, fmt.Errorf("a rule needs a CIDR or a group")
	}
	return m, nil
}

// ENIFilter is what one interface may send and receive.
type ENIFilter struct {
	EniID   string
	Tap     string
	MAC     string
	IP      netip.Addr
	Ingress []Match
	Egress  []Match
}

// NAT is a public IP mapped 1:1 to a private one.
type NAT struct {
	Public, Private netip.Addr
}

// FilterPlan is everything the VPC namespace's nftables tables hold.
type FilterPlan struct {
	// Sets are the members' addresses of every security group, by id.
	Sets map[string][]netip.Addr
	// ENIs are filtered per interface: default deny in, and out only
	// what their groups' egress rules allow.
	ENIs []ENIFilter
	// Protected are never reachable from a guest, whatever a group says.
	Protected []netip.Prefix
	// Services are the VPC's own DNS and IMDS addresses and Gateways the
	// subnet routers: always reachable, as in AWS.
	Services []netip.Addr
	Gateways []netip.Addr
	// Uplink is set when an internet gateway is attached: what leaves by
	// the uplink is masqueraded to the transit address, or SNATed to the
	// interface's public IP (NATs).
	Uplink bool
	NATs   []NAT
}

// Filter compiles v's security groups, interfaces and addresses.
func (v *VPC) Filter(protected []netip.Prefix) FilterPlan {
	plan := FilterPlan{
		Sets:      map[string][]netip.Addr{},
		Protected: append([]netip.Prefix(nil), protected...),
		Services:  []netip.Addr{v.DNS(), DNSLinkLocal, IMDSAddr},
		Uplink:    v.IGW != "",
	}
	for _, id := range SortedIDs(v.Groups) {
		plan.Sets[id] = nil
	}
	for _, sid := range SortedIDs(v.Subnets) {
		plan.Gateways = append(plan.Gateways, v.Subnets[sid].Gateway())
	}
	for _, id := range SortedIDs(v.Interfaces) {
		i := v.Interfaces[id]
		f := ENIFilter{EniID: id, Tap: TapName(id), MAC: i.MAC, IP: i.IP}
		for _, gid := range i.Groups {
			if _, ok := plan.Sets[gid]; ok {
				plan.Sets[gid] = append(plan.Sets[gid], i.IP)
			}
			g := v.Groups[gid]
			if g == nil {
				continue
			}
			for _, r := range g.Rules {
				m, err := compileRule(r)
				if err != nil {
					continue // CheckGroup refused it; nothing stored is bad
				}
				if r.Egress {
					f.Egress = append(f.Egress, m)
				} else {
					f.Ingress = append(f.Ingress, m)
				}
			}
		}
		f.Ingress, f.Egress = dedupe(f.Ingress), dedupe(f.Egress)
		plan.ENIs = append(plan.ENIs, f)
	}
	for _, ip := range SortedIDs(v.Addresses) {
		a := v.Addresses[ip]
		plan.NATs = append(plan.NATs, NAT{Public: a.PublicIP, Private: a.PrivateIP})
	}
	for id := range plan.Sets {
		sort.Slice(plan.Sets[id], func(i, j int) bool { return plan.Sets[id][i].Less(plan.Sets[id][j]) })
	}
	return plan
}

func dedupe(ms []Match) []Match {
	seen := map[Match]bool{}
	var out []Match
	for _, m := range ms {
		if !seen[m] {
			seen[m] = true
			out = append(out, m)
		}
	}
	return out
}
