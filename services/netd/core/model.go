package core

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sort"
	"strconv"
	"strings"

	"hangar.dev/hangar/services/internal/api"
)

// Kind classifies an Error; the service maps each to a named D-Bus error.
type Kind int

const (
	KindInvalid Kind = iota + 1
	KindNotFound
	KindConflict
	KindInUse
)

// Error is a refusal with a reason in words.
type Error struct {
	Kind Kind
	Msg  string
}

func (e *Error) Error() string { return e.Msg }

func errf(k Kind, format string, args ...any) *Error {
	return &Error{Kind: k, Msg: fmt.Sprintf(format, args...)}
}

// KindOf returns the kind of a core error, or 0.
func KindOf(err error) Kind {
	var e *Error
	if errors.As(err, &e) {
		return e.Kind
	}
	return 0
}

// State is every VPC netd holds.
type State struct {
	VPCs map[string]*VPC
}

// NewState returns an empty state.
func NewState() *State { return &State{VPCs: map[string]*VPC{}} }

// VPC is one VPC's desired state.
type VPC struct {
	ID           string
	CIDR         netip.Prefix
	DNSSupport   bool
	DNSHostnames bool
	IGW          string
	// Index numbers the VPC's transit link to the host (see Transit); it
	// is chosen once and kept.
	Index       int
	Subnets     map[string]*Subnet
	Groups      map[string]*Group
	RouteTables map[string]*RouteTable
	Interfaces  map[string]*Interface
	Addresses   map[string]*Address // by public IP
}

// Subnet is a subnet of a VPC.
type Subnet struct {
	ID   string
	CIDR netip.Prefix
}

// Group is a security group.
type Group struct {
	ID    string
	Rules []api.SGRule
}

// RouteTable is a route table with its associations.
type RouteTable struct {
	ID      string
	Main    bool
	Subnets []string
	Routes  []api.RouteSpec
}

// Interface is an ENI with a tap.
type Interface struct {
	ID       string
	SubnetID string
	MAC      string // lower-case, colon-separated
	IP       netip.Addr
	Groups   []string
}

// Address is a public IP mapped 1:1 to an interface's private IP.
type Address struct {
	PublicIP  netip.Addr
	EniID     string
	PrivateIP netip.Addr
}

// Well-known addresses every VPC has, as in AWS.
var (
	DNSLinkLocal  = netip.MustParseAddr("169.254.169.253")
	IMDSAddr      = netip.MustParseAddr("169.254.169.254")
	transitPool   = netip.MustParsePrefix("169.254.0.0/17")
	maxTransitIdx = 1<<(32-17)/2 - 1
)

// MTU is what DHCP tells guests: the bridge's, so frames are never
// dropped for size between guests.
const MTU = 1500

// LeaseSeconds is the DHCP lease time.
const LeaseSeconds = 3600

func parsePrefix(what, s string) (netip.Prefix, error) {
	p, err := netip.ParsePrefix(s)
	if err != nil || !p.Addr().Is4() {
		return p, errf(KindInvalid, "%s %q is not an IPv4 CIDR", what, s)
	}
	if p.Masked() != p {
		return p, errf(KindInvalid, "%s %q has host bits set (did you mean %s?)", what, s, p.Masked())
	}
	if p.Bits() < 16 || p.Bits() > 28 {
		return p, errf(KindInvalid, "%s %q must be between /16 and /28", what, s)
	}
	return p, nil
}

// nth returns the address n after p's network address.
func nth(p netip.Prefix, n int) netip.Addr {
	a := p.Addr().As4()
	v := uint32(a[0])<<24 | uint32(a[1])<<16 | uint32(a[2])<<8 | uint32(a[3])
	v += uint32(n)
	return netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)})
}

func size(p netip.Prefix) int { return 1 << (32 - p.Bits()) }

// Gateway is a subnet's router address: its first usable address (.1).
func (s *Subnet) Gateway() netip.Addr { return nth(s.CIDR, 1) }

// DNS is the VPC resolver's address: the VPC CIDR's base plus two.
func (v *VPC) DNS() netip.Addr { return nth(v.CIDR, 2) }

// Namespace is the VPC's network namespace.
func (v *VPC) Namespace() string { return NamespaceName(v.ID) }

// Transit returns the host and VPC ends of the VPC's /31 uplink, from
// 169.254.0.0/17: link-local, so never a guest's or the LAN's address.
func Transit(index int) (host, vpc netip.Addr) {
	return nth(transitPool, 2*index), nth(transitPool, 2*index+1)
}

// TransitPool is the range every transit address lies in.
func TransitPool() netip.Prefix { return transitPool }

// Reserved reports whether ip is one of the five addresses AWS keeps in
// every subnet: the network, the router (.1), DNS (.2), future use (.3) and
// broadcast.
func Reserved(p netip.Prefix, ip netip.Addr) bool {
	a, b := ip.As4(), p.Addr().As4()
	off := int(uint32(a[0])<<24|uint32(a[1])<<16|uint32(a[2])<<8|uint32(a[3])) -
		int(uint32(b[0])<<24|uint32(b[1])<<16|uint32(b[2])<<8|uint32(b[3]))
	return off <= 3 || off == size(p)-1
}

// Domain is the DNS domain of private names in region, as AWS names them.
func Domain(region string) string {
	if region == "us-east-1" {
		return "ec2.internal"
	}
	return region + ".compute.internal"
}

// Hostname is the private host name AWS gives an IP: ip-10-0-1-5.
func Hostname(ip netip.Addr) string {
	return "ip-" + strings.ReplaceAll(ip.String(), ".", "-")
}

// PublicName is the public DNS name AWS gives a public IP.
func PublicName(ip netip.Addr, region string) string {
	host := "ec2-" + strings.ReplaceAll(ip.String(), ".", "-")
	if region == "us-east-1" {
		return host + ".compute-1.amazonaws.com"
	}
	return host + "." + region + ".compute.amazonaws.com"
}

// CheckVPC validates spec and returns the VPC it describes, merged with
// what is already held (an existing VPC keeps its contents and index).
func (s *State) CheckVPC(spec api.VPCSpec) (*VPC, error) {
	if !strings.HasPrefix(spec.VpcID, "vpc-") {
		return nil, errf(KindInvalid, "%q is not a VPC id", spec.VpcID)
	}
	cidr, err := parsePrefix("VPC CIDR", spec.CIDR)
	if err != nil {
		return nil, err
	}
	if old := s.VPCs[spec.VpcID]; old != nil {
		if old.CIDR != cidr {
			return nil, errf(KindConflict, "%s exists with CIDR %s, not %s", spec.VpcID, old.CIDR, cidr)
		}
		v := *old
		v.DNSSupport, v.DNSHostnames = spec.DNSSupport, spec.DNSHostnames
		return &v, nil
	}
	return &VPC{
		ID: spec.VpcID, CIDR: cidr, DNSSupport: spec.DNSSupport, DNSHostnames: spec.DNSHostnames,
		Index:   s.freeIndex(),
		Subnets: map[string]*Subnet{}, Groups: map[string]*Group{}, RouteTables: map[string]*RouteTable{},
		Interfaces: map[string]*Interface{}, Addresses: map[string]*Address{},
	}, nil
}

func (s *State) freeIndex() int {
	used := map[int]bool{}
	for _, v := range s.VPCs {
		used[v.Index] = true
	}
	for i := 0; i <= maxTransitIdx; i++ {
		if !used[i] {
			return i
		}
	}
	return -1
}

// VPC returns a held VPC or NotFound.
func (s *State) VPC(id string) (*VPC, error) {
	v := s.VPCs[id]
	if v == nil {
		return nil, errf(KindNotFound, "VPC %s is not known to netd", id)
	}
	return v, nil
}

// CheckSubnet validates a subnet of v.
func (v *VPC) CheckSubnet(spec api.SubnetSpec) (*Subnet, error) {
	if !strings.HasPrefix(spec.SubnetID, "subnet-") {
		return nil, errf(KindInvalid, "%q is not a subnet id", spec.SubnetID)
	}
	cidr, err := parsePrefix("subnet CIDR", spec.CIDR)
	if err != nil {
		return nil, err
	}
	if !v.CIDR.Contains(cidr.Addr()) || cidr.Bits() < v.CIDR.Bits() {
		return nil, errf(KindInvalid, "subnet CIDR %s is not inside %s's CIDR %s", cidr, v.ID, v.CIDR)
	}
	if old := v.Subnets[spec.SubnetID]; old != nil && old.CIDR != cidr {
		return nil, errf(KindConflict, "%s exists with CIDR %s, not %s", spec.SubnetID, old.CIDR, cidr)
	}
	for _, other := range v.sortedSubnets() {
		if other.ID != spec.SubnetID && other.CIDR.Overlaps(cidr) {
			return nil, errf(KindConflict, "subnet CIDR %s overlaps %s (%s)", cidr, other.ID, other.CIDR)
		}
	}
	return &Subnet{ID: spec.SubnetID, CIDR: cidr}, nil
}

func (v *VPC) sortedSubnets() []*Subnet {
	out := make([]*Subnet, 0, len(v.Subnets))
	for _, s := range v.Subnets {
		out = append(out, s)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// SubnetInterfaces returns the ids of the interfaces in subnetID.
func (v *VPC) SubnetInterfaces(subnetID string) []string {
	var out []string
	for id, i := range v.Interfaces {
		if i.SubnetID == subnetID {
			out = append(out, id)
		}
	}
	sort.Strings(out)
	return out
}

// CheckGroup validates a security group.
func (v *VPC) CheckGroup(spec api.SecurityGroupSpec) (*Group, error) {
	if !strings.HasPrefix(spec.GroupID, "sg-") {
		return nil, errf(KindInvalid, "%q is not a security group id", spec.GroupID)
	}
	for i, r := range spec.Rules {
		if _, err := compileRule(r); err != nil {
			return nil, errf(KindInvalid, "%s rule %d: %v", spec.GroupID, i, err)
		}
	}
	return &Group{ID: spec.GroupID, Rules: append([]api.SGRule(nil), spec.Rules...)}, nil
}

// GroupUsers names what uses a group: an interface or another group's rule.
func (v *VPC) GroupUsers(groupID string) []string {
	var out []string
	for _, i := range v.Interfaces {
		for _, g := range i.Groups {
			if g == groupID {
				out = append(out, i.ID)
			}
		}
	}
	for _, g := range v.Groups {
		if g.ID == groupID {
			continue
		}
		for _, r := range g.Rules {
			if r.GroupID == groupID {
				out = append(out, g.ID)
				break
			}
		}
	}
	sort.Strings(out)
	return out
}

// CheckRouteTable validates a route table.
func (v *VPC) CheckRouteTable(spec api.RouteTableSpec) (*RouteTable, error) {
	if !strings.HasPrefix(spec.RouteTableID, "rtb-") {
		return nil, errf(KindInvalid, "%q is not a route table id", spec.RouteTableID)
	}
	for _, r := range spec.Routes {
		p, err := netip.ParsePrefix(r.Destination)
		if err != nil || !p.Addr().Is4() || p.Masked() != p {
			return nil, errf(KindInvalid, "route destination %q is not an IPv4 CIDR", r.Destination)
		}
		if r.Target != "local" && !strings.HasPrefix(r.Target, "igw-") {
			return nil, errf(KindInvalid, "route target %q: netd routes only to local and internet gateways", r.Target)
		}
	}
	for _, sn := range spec.SubnetIDs {
		if v.Subnets[sn] == nil {
			return nil, errf(KindNotFound, "route table %s names subnet %s, which %s does not have", spec.RouteTableID, sn, v.ID)
		}
	}
	if spec.Main {
		for _, t := range v.RouteTables {
			if t.Main && t.ID != spec.RouteTableID {
				return nil, errf(KindConflict, "%s already has a main route table (%s)", v.ID, t.ID)
			}
		}
	}
	return &RouteTable{ID: spec.RouteTableID, Main: spec.Main, Subnets: append([]string(nil), spec.SubnetIDs...), Routes: append([]api.RouteSpec(nil), spec.Routes...)}, nil
}

// IGWRoutes returns the destinations that a subnet routes to the VPC's
// attached internet gateway, from its associated route table, else the
// main one. Without an attached gateway there are none.
func (v *VPC) IGWRoutes(subnetID string) []netip.Prefix {
	if v.IGW == "" {
		return nil
	}
	var table *RouteTable
	for _, t := range v.RouteTables {
		for _, sn := range t.Subnets {
			if sn == subnetID {
				table = t
			}
		}
	}
	if table == nil {
		for _, t := range v.RouteTables {
			if t.Main {
				table = t
			}
		}
	}
	if table == nil {
		return nil
	}
	var out []netip.Prefix
	for _, r := range table.Routes {
		if r.Target == v.IGW {
			out = append(out, netip.MustParsePrefix(r.Destination))
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].String() < out[j].String() })
	return out
}

// NormalMAC parses a MAC and returns it lower-case and colon-separated.
func NormalMAC(s string) (string, error) {
	hw, err := net.ParseMAC(s)
	if err != nil || len(hw) != 6 {
		return "", errf(KindInvalid, "%q is not a MAC address", s)
	}
	if hw[0]&1 == 1 {
		return "", errf(KindInvalid, "MAC %s is multicast; an interface needs a unicast address", s)
	}
	if hw.String() == "00:00:00:00:00:00" {
		return "", errf(KindInvalid, "MAC %s is all zeros", s)
	}
	return hw.String(), nil
}

// CheckInterface validates an interface against every VPC (MACs are
// unique host-wide, as in AWS) and returns it with the VPC it belongs to.
func (s *State) CheckInterface(spec api.InterfaceSpec) (*VPC, *Interface, error) {
	if !strings.HasPrefix(spec.EniID, "eni-") {
		return nil, nil, errf(KindInvalid, "%q is not a network interface id", spec.EniID)
	}
	var vpc *VPC
	var sn *Subnet
	for _, v := range s.VPCs {
		if x := v.Subnets[spec.SubnetID]; x != nil && (spec.VpcID == "" || spec.VpcID == v.ID) {
			vpc, sn = v, x
		}
	}
	if sn == nil {
		return nil, nil, errf(KindNotFound, "subnet %s is not known to netd", spec.SubnetID)
	}
	mac, err := NormalMAC(spec.MAC)
	if err != nil {
		return nil, nil, err
	}
	ip, err := netip.ParseAddr(spec.PrivateIP)
	if err != nil || !ip.Is4() {
		return nil, nil, errf(KindInvalid, "private IP %q is not an IPv4 address", spec.PrivateIP)
	}
	if !sn.CIDR.Contains(ip) {
		return nil, nil, errf(KindInvalid, "private IP %s is not in subnet %s (%s)", ip, sn.ID, sn.CIDR)
	}
	if Reserved(sn.CIDR, ip) {
		return nil, nil, errf(KindInvalid, "private IP %s is reserved in %s (AWS keeps the first four addresses and the last)", ip, sn.CIDR)
	}
	for _, v := range s.VPCs {
		for _, other := range v.Interfaces {
			if other.ID == spec.EniID {
				if v != vpc || other.SubnetID != sn.ID || other.MAC != mac || other.IP != ip {
					return nil, nil, errf(KindConflict, "%s exists with subnet %s, MAC %s, IP %s", other.ID, other.SubnetID, other.MAC, other.IP)
				}
				continue
			}
			if other.MAC == mac {
				return nil, nil, errf(KindConflict, "MAC %s is already used by %s", mac, other.ID)
			}
			if v == vpc && other.IP == ip {
				return nil, nil, errf(KindConflict, "private IP %s is already used by %s", ip, other.ID)
			}
		}
	}
	groups, err := vpc.checkGroupIDs(spec.SecurityGroupIDs)
	if err != nil {
		return nil, nil, err
	}
	return vpc, &Interface{ID: spec.EniID, SubnetID: sn.ID, MAC: mac, IP: ip, Groups: groups}, nil
}

func (v *VPC) checkGroupIDs(ids []string) ([]string, error) {
	seen := map[string]bool{}
	var out []string
	for _, g := range ids {
		if v.Groups[g] == nil {
			return nil, errf(KindNotFound, "security group %s is not known in %s", g, v.ID)
		}
		if !seen[g] {
			seen[g] = true
			out = append(out, g)
		}
	}
	sort.Strings(out)
	return out, nil
}

// CheckInterfaceGroups validates a new group list for an interface.
func (v *VPC) CheckInterfaceGroups(ids []string) ([]string, error) { return v.checkGroupIDs(ids) }

// FindInterface returns the VPC and interface of an ENI id.
func (s *State) FindInterface(eniID string) (*VPC, *Interface, error) {
	for _, v := range s.VPCs {
		if i := v.Interfaces[eniID]; i != nil {
			return v, i, nil
		}
	}
	return nil, nil, errf(KindNotFound, "network interface %s is not known to netd", eniID)
}

// InterfaceByIP returns the interface with a private IP in v.
func (v *VPC) InterfaceByIP(ip netip.Addr) *Interface {
	for _, i := range v.Interfaces {
		if i.IP == ip {
			return i
		}
	}
	return nil
}

// CheckAddress validates a public IP association against pool (empty pool:
// none allowed) and every VPC.
func (s *State) CheckAddress(spec api.AddressSpec, pool []netip.Prefix) (*VPC, *Address, error) {
	pub, err := netip.ParseAddr(spec.PublicIP)
	if err != nil || !pub.Is4() {
		return nil, nil, errf(KindInvalid, "public IP %q is not an IPv4 address", spec.PublicIP)
	}
	inPool := false
	for _, p := range pool {
		inPool = inPool || p.Contains(pub)
	}
	if !inPool {
		return nil, nil, errf(KindInvalid, "public IP %s is not in PUBLIC_IP_POOL", pub)
	}
	v, iface, err := s.FindInterface(spec.EniID)
	if err != nil {
		return nil, nil, err
	}
	priv := iface.IP
	if spec.PrivateIP != "" {
		p, err := netip.ParseAddr(spec.PrivateIP)
		if err != nil || p != iface.IP {
			return nil, nil, errf(KindInvalid, "private IP %q is not an address of %s (%s)", spec.PrivateIP, iface.ID, iface.IP)
		}
	}
	for _, a := range v.Addresses {
		if a.PrivateIP == priv && a.PublicIP != pub {
			return nil, nil, errf(KindConflict, "%s (%s) already has public IP %s", iface.ID, priv, a.PublicIP)
		}
	}
	return v, &Address{PublicIP: pub, EniID: iface.ID, PrivateIP: priv}, nil
}

// FindAddress returns the VPC holding a public IP.
func (s *State) FindAddress(pub string) (*VPC, *Address) {
	for _, v := range s.VPCs {
		if a := v.Addresses[pub]; a != nil {
			return v, a
		}
	}
	return nil, nil
}

// SortedIDs returns a map's keys in order.
func SortedIDs[T any](m map[string]T) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// protoNumber maps an EC2 protocol to an IP protocol number; 0 is "all".
func protoNumber(p string) (uint8, error) {
	switch strings.ToLower(p) {
	case "-1", "all", "":
		return 0, nil
	case "tcp":
		return 6, nil
	case "udp":
		return 17, nil
	case "icmp":
		return 1, nil
	}
	n, err := strconv.Atoi(p)
	if err != nil || n < 0 || n > 255 {
		return 0, fmt.Errorf("protocol %q is not tcp, udp, icmp, -1 or a number", p)
	}
	return uint8(n), nil
}

// Clone returns a deep copy of v, for a change to be tried before it is
// kept.
func (v *VPC) Clone() *VPC {
	c := *v
	c.Subnets = map[string]*Subnet{}
	for k, x := range v.Subnets {
		y := *x
		c.Subnets[k] = &y
	}
	c.Groups = map[string]*Group{}
	for k, x := range v.Groups {
		y := *x
		y.Rules = append([]api.SGRule(nil), x.Rules...)
		c.Groups[k] = &y
	}
	c.RouteTables = map[string]*RouteTable{}
	for k, x := range v.RouteTables {
		y := *x
		y.Subnets = append([]string(nil), x.Subnets...)
		y.Routes = append([]api.RouteSpec(nil), x.Routes...)
		c.RouteTables[k] = &y
	}
	c.Interfaces = map[string]*Interface{}
	for k, x := range v.Interfaces {
		y := *x
		y.Groups = append([]string(nil), x.Groups...)
		c.Interfaces[k] = &y
	}
	c.Addresses = map[string]*Address{}
	for k, x := range v.Addresses {
		y := *x
		c.Addresses[k] = &y
	}
	return &c
}

// Normalize gives a VPC decoded from storage the maps it may lack.
func (v *VPC) Normalize() {
	if v.Subnets == nil {
		v.Subnets = map[string]*Subnet{}
	}
	if v.Groups == nil {
		v.Groups = map[string]*Group{}
	}
	if v.RouteTables == nil {
		v.RouteTables = map[string]*RouteTable{}
	}
	if v.Interfaces == nil {
		v.Interfaces = map[string]*Interface{}
	}
	if v.Addresses == nil {
		v.Addresses = map[string]*Address{}
	}
}
