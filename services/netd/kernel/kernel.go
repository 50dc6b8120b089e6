// Package kernel is hangar-netd's adapter to the Linux network stack:
// named network namespaces, bridges, taps, veths, addresses, policy routes
// and sysctls through netlink, and nftables tables through nf_tables
// netlink messages. It does what it is told by the service, measuring
// first so that every Ensure converges from whatever partial state it
// finds, and it touches only objects that carry netd's names and aliases.
package kernel

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strings"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"hangar.dev/hangar/services/netd/core"
)

// netnsDir is where iproute2 (and netns.NewNamed) bind-mount named
// namespaces.
const netnsDir = "/run/netns"

// ErrForeign is wrapped by errors about an object that has netd's name but
// is not netd's.
var ErrForeign = errors.New("not made by hangar-netd")

// Link is a link as found.
type Link struct {
	Name   string
	Alias  string
	Kind   string // bridge, tuntap, veth, …
	Master string
}

// Owner is who may open a tap.
type Owner struct {
	UID, GID uint32
}

// Linux is the real kernel.
type Linux struct {
	host netns.NsHandle // the namespace netd started in: the "host"
	// HostTable names netd's nftables table in the host namespace.
	HostTable string
}

// New remembers the calling thread's namespace as the host namespace.
func New() (*Linux, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	h, err := netns.Get()
	if err != nil {
		return nil, fmt.Errorf("opening netd's own network namespace: %w", err)
	}
	return &Linux{host: h, HostTable: DefaultHostTable}, nil
}

// In runs fn on a thread that is inside the named namespace. Sockets fn
// opens belong to that namespace and stay there after fn returns.
func (k *Linux) In(ns string, fn func() error) error {
	target, err := netns.GetFromName(ns)
	if err != nil {
		return fmt.Errorf("opening namespace %s: %w", ns, err)
	}
	defer target.Close()
	return k.inHandle(target, fn)
}

func (k *Linux) inHandle(target netns.NsHandle, fn func() error) error {
	runtime.LockOSThread()
	if err := netns.Set(target); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("entering namespace: %w", err)
	}
	ferr := fn()
	if err := netns.Set(k.host); err != nil {
		// Leave the thread locked: it dies with this goroutine instead of
		// carrying the wrong namespace into other work.
		return fmt.Errorf("returning to the host namespace: %w", err)
	}
	runtime.UnlockOSThread()
	return ferr
}

// Namespaces lists the hangar-vpc-… namespaces that exist.
func (k *Linux) Namespaces() ([]string, error) {
	ents, err := os.ReadDir(netnsDir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("listing %s: %w", netnsDir, err)
	}
	var out []string
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), core.NamespacePrefix) {
			out = append(out, e.Name())
		}
	}
	sort.Strings(out)
	return out, nil
}

func nsExists(ns string) bool {
	h, err := netns.GetFromName(ns)
	if err != nil {
		return false
	}
	h.Close()
	return true
}

// EnsureNamespace creates the named namespace unless it exists.
func (k *Linux) EnsureNamespace(ns string) (bool, error) {
	if nsExists(ns) {
		return false, nil
	}
	// A mount point left by a namespace whose bind mount is gone (an
	// interrupted delete) blocks NewNamed; remove the empty file.
	_ = os.Remove(filepath.Join(netnsDir, ns))
	runtime.LockOSThread()
	h, err := netns.NewNamed(ns) // switches this thread into it
	if err != nil {
		_ = netns.Set(k.host)
		runtime.UnlockOSThread()
		return false, fmt.Errorf("creating namespace %s: %w", ns, err)
	}
	h.Close()
	if err := netns.Set(k.host); err != nil {
		return true, fmt.Errorf("returning to the host namespace: %w", err)
	}
	runtime.UnlockOSThread()
	return true, nil
}

// DeleteNamespace removes the named namespace; its links go with it (and
// the host end of its uplink veth, whose peer dies with the namespace).
func (k *Linux) DeleteNamespace(ns string) error {
	if !strings.HasPrefix(ns, core.NamespacePrefix) {
		return fmt.Errorf("refusing to delete namespace %s: %w", ns, ErrForeign)
	}
	if _, err := os.Stat(filepath.Join(netnsDir, ns)); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err := netns.DeleteNamed(ns); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("deleting namespace %s: %w", ns, err)
	}
	return nil
}

func sysctl(path, value string) error {
	p := filepath.Join("/proc/sys", strings.ReplaceAll(path, ".", "/"))
	if cur, err := os.ReadFile(p); err == nil && strings.TrimSpace(string(cur)) == value {
		return nil
	}
	if err := os.WriteFile(p, []byte(value), 0o644); err != nil {
		return fmt.Errorf("setting %s=%s: %w", path, value, err)
	}
	return nil
}

// EnsureVPCBase readies a VPC namespace as a router: loopback up with the
// VPC's service addresses (DNS at base+2 and 169.254.169.253, IMDS at
// 169.254.169.254), forwarding on, redirects off (guests talk through
// the router by design), and the rule that lets the main table win over
// per-subnet tables for everything but the default route.
func (k *Linux) EnsureVPCBase(ns string, dns netip.Addr) error {
	return k.In(ns, func() error {
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return fmt.Errorf("finding lo: %w", err)
		}
		if err := netlink.LinkSetUp(lo); err != nil {
			return fmt.Errorf("setting lo up: %w", err)
		}
		for _, a := range []netip.Addr{dns, core.DNSLinkLocal, core.IMDSAddr} {
			if err := ensureAddr(lo, netip.PrefixFrom(a, 32)); err != nil {
				return err
			}
		}
		for _, kv := range [][2]string{
			{"net.ipv4.ip_forward", "1"},
			{"net.ipv4.conf.all.send_redirects", "0"},
			{"net.ipv4.conf.default.send_redirects", "0"},
			{"net.ipv4.conf.all.rp_filter", "0"},
			{"net.ipv4.conf.default.rp_filter", "0"},
		} {
			if err := sysctl(kv[0], kv[1]); err != nil {
				return err
			}
		}
		r := netlink.NewRule()
		r.Priority, r.Table, r.SuppressPrefixlen = rulePrioMain, unix.RT_TABLE_MAIN, 0
		return ensureRule(r)
	})
}

func ensureAddr(link netlink.Link, p netip.Prefix) error {
	addrs, err := netlink.AddrList(link, unix.AF_INET)
	if err != nil {
		return fmt.Errorf("listing addresses of %s: %w", link.Attrs().Name, err)
	}
	for _, a := range addrs {
		if a.IPNet.String() == p.String() {
			return nil
		}
	}
	if err := netlink.AddrAdd(link, &netlink.Addr{IPNet: ipnet(p)}); err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("adding %s to %s: %w", p, link.Attrs().Name, err)
	}
	return nil
}

func ipnet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), 32)}
}

// Links lists the links of a namespace ("" for the host).
func (k *Linux) Links(ns string) ([]Link, error) {
	var out []Link
	list := func() error {
		links, err := netlink.LinkList()
		if err != nil {
			return fmt.Errorf("listing links: %w", err)
		}
		byIndex := map[int]string{}
		for _, l := range links {
			byIndex[l.Attrs().Index] = l.Attrs().Name
		}
		for _, l := range links {
			out = append(out, Link{Name: l.Attrs().Name, Alias: l.Attrs().Alias, Kind: l.Type(), Master: byIndex[l.Attrs().MasterIndex]})
		}
		return nil
	}
	if ns == "" {
		return out, list()
	}
	return out, k.In(ns, list)
}

// checkOurs returns the link named name, nil when there is none, or an
// ErrForeign error when it exists without netd's alias for id.
func checkOurs(name, id, kind string) (netlink.Link, error) {
	l, err := netlink.LinkByName(name)
	if err != nil {
		var nf netlink.LinkNotFoundError
		if errors.As(err, &nf) {
			return nil, nil
		}
		return nil, fmt.Errorf("looking up %s: %w", name, err)
	}
	if l.Attrs().Alias != core.Alias(id) || l.Type() != kind {
		return nil, fmt.Errorf("a %s named %s exists with alias %q: %w", l.Type(), name, l.Attrs().Alias, ErrForeign)
	}
	return l, nil
}

// EnsureBridge makes a subnet's bridge with the router address gw on it,
// proxy ARP within the bridge (its ports are isolated, so guests reach
// each other only through the router and its filter).
func (k *Linux) EnsureBridge(ns, name, id string, gw netip.Prefix) (created bool, err error) {
	err = k.In(ns, func() error {
		l, err := checkOurs(name, id, "bridge")
		if err != nil {
			return err
		}
		if l == nil {
			br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: name, MTU: core.MTU}}
			if err := netlink.LinkAdd(br); err != nil {
				return fmt.Errorf("creating bridge %s: %w", name, err)
			}
			created = true
			if l, err = netlink.LinkByName(name); err != nil {
				return fmt.Errorf("finding new bridge %s: %w", name, err)
			}
			if err := netlink.LinkSetAlias(l, core.Alias(id)); err != nil {
				return fmt.Errorf("naming bridge %s: %w", name, err)
			}
		}
		if err := ensureAddr(l, gw); err != nil {
			return err
		}
		for _, kv := range [][2]string{
			{"net.ipv4.conf." + name + ".proxy_arp", "1"},
			{"net.ipv4.conf." + name + ".proxy_arp_pvlan", "1"},
			{"net.ipv4.conf." + name + ".send_redirects", "0"},
		} {
			if err := sysctl(kv[0], kv[1]); err != nil {
				return err
			}
		}
		if err := netlink.LinkSetUp(l); err != nil {
			return fmt.Errorf("setting %s up: %w", name, err)
		}
		return nil
	})
	return created, err
}

// EnsureTap makes a persistent tap owned by owner, attached to bridge as an
// isolated port.
func (k *Linux) EnsureTap(ns, name, id, bridge string, owner Owner) (created bool, err error) {
	err = k.In(ns, func() error {
		l, err := checkOurs(name, id, "tuntap")
		if err != nil {
			return err
		}
		if l == nil {
			tap := &netlink.Tuntap{
				LinkAttrs: netlink.LinkAttrs{Name: name, MTU: core.MTU},
				Mode:      netlink.TUNTAP_MODE_TAP,
				Flags:     netlink.TUNTAP_NO_PI | netlink.TUNTAP_ONE_QUEUE,
				Owner:     owner.UID,
				Group:     owner.GID,
			}
			if err := netlink.LinkAdd(tap); err != nil {
				return fmt.Errorf("creating tap %s: %w", name, err)
			}
			created = true
			if l, err = netlink.LinkByName(name); err != nil {
				return fmt.Errorf("finding new tap %s: %w", name, err)
			}
			if err := netlink.LinkSetAlias(l, core.Alias(id)); err != nil {
				return fmt.Errorf("naming tap %s: %w", name, err)
			}
		}
		br, err := netlink.LinkByName(bridge)
		if err != nil {
			return fmt.Errorf("finding bridge %s for tap %s: %w", bridge, name, err)
		}
		if l.Attrs().MasterIndex != br.Attrs().Index {
			if err := netlink.LinkSetMaster(l, br); err != nil {
				return fmt.Errorf("attaching tap %s to %s: %w", name, bridge, err)
			}
		}
		if err := netlink.LinkSetIsolated(l, true); err != nil {
			return fmt.Errorf("isolating bridge port %s: %w", name, err)
		}
		if err := netlink.LinkSetUp(l); err != nil {
			return fmt.Errorf("setting %s up: %w", name, err)
		}
		return nil
	})
	return created, err
}

// DeleteLink deletes a link of ns ("" for the host) if it exists and is
// netd's.
func (k *Linux) DeleteLink(ns, name string) error {
	del := func() error {
		l, err := netlink.LinkByName(name)
		if err != nil {
			var nf netlink.LinkNotFoundError
			if errors.As(err, &nf) {
				return nil
			}
			return fmt.Errorf("looking up %s: %w", name, err)
		}
		if !strings.HasPrefix(l.Attrs().Alias, core.AliasPrefix) {
			return fmt.Errorf("refusing to delete %s: %w", name, ErrForeign)
		}
		if err := netlink.LinkDel(l); err != nil {
			return fmt.Errorf("deleting %s: %w", name, err)
		}
		return nil
	}
	if ns == "" {
		return del()
	}
	return k.In(ns, del)
}

// EnsureUplink makes the veth between the host (hostName, address host/31)
// and the VPC namespace (core.UplinkName, vpc/31).
func (k *Linux) EnsureUplink(ns, hostName, vpcID string, host, vpc netip.Addr) error {
	l, err := checkOurs(hostName, vpcID, "veth")
	if err != nil {
		return err
	}
	if l == nil {
		target, err := netns.GetFromName(ns)
		if err != nil {
			return fmt.Errorf("opening namespace %s: %w", ns, err)
		}
		defer target.Close()
		// A VPC end left without its host end cannot be: veths die in
		// pairs. But an old one from a namespace re-created is gone with
		// it, so creating the pair is always safe here.
		veth := &netlink.Veth{
			LinkAttrs:     netlink.LinkAttrs{Name: hostName, Alias: core.Alias(vpcID)},
			PeerName:      core.UplinkName,
			PeerNamespace: netlink.NsFd(int(target)),
		}
		if err := netlink.LinkAdd(veth); err != nil {
			return fmt.Errorf("creating uplink veth %s: %w", hostName, err)
		}
		if l, err = netlink.LinkByName(hostName); err != nil {
			return fmt.Errorf("finding new veth %s: %w", hostName, err)
		}
		if l.Attrs().Alias != core.Alias(vpcID) {
			if err := netlink.LinkSetAlias(l, core.Alias(vpcID)); err != nil {
				return fmt.Errorf("naming %s: %w", hostName, err)
			}
		}
	}
	if err := ensureAddr(l, netip.PrefixFrom(host, 31)); err != nil {
		return err
	}
	if err := netlink.LinkSetUp(l); err != nil {
		return fmt.Errorf("setting %s up: %w", hostName, err)
	}
	return k.In(ns, func() error {
		p, err := netlink.LinkByName(core.UplinkName)
		if err != nil {
			return fmt.Errorf("finding %s in %s: %w", core.UplinkName, ns, err)
		}
		if p.Attrs().Alias != core.Alias(vpcID) {
			if err := netlink.LinkSetAlias(p, core.Alias(vpcID)); err != nil {
				return fmt.Errorf("naming %s: %w", core.UplinkName, err)
			}
		}
		if err := ensureAddr(p, netip.PrefixFrom(vpc, 31)); err != nil {
			return err
		}
		return netlink.LinkSetUp(p)
	})
}

// Policy routing in a VPC namespace: the main table (connected subnets,
// service addresses) is consulted first for everything but a default
// route; then each subnet's own table, which holds its routes to the
// internet gateway (via the uplink).
const (
	rulePrioMain   = 100
	rulePrioSubnet = 1000
	tableBase      = 1000
)

func ensureRule(r *netlink.Rule) error {
	rules, err := netlink.RuleList(unix.AF_INET)
	if err != nil {
		return fmt.Errorf("listing rules: %w", err)
	}
	for _, x := range rules {
		if x.Priority == r.Priority && x.Table == r.Table && x.SuppressPrefixlen == r.SuppressPrefixlen && prefixEq(x.Src, r.Src) {
			return nil
		}
	}
	r.Family = unix.AF_INET
	if err := netlink.RuleAdd(r); err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("adding rule priority %d table %d: %w", r.Priority, r.Table, err)
	}
	return nil
}

func prefixEq(a, b *net.IPNet) bool {
	if a == nil || b == nil {
		return a == nil && b == nil
	}
	return a.String() == b.String()
}

// SubnetRoutes is one subnet's routes to the internet gateway.
type SubnetRoutes struct {
	CIDR   netip.Prefix
	Bridge string
	Dests  []netip.Prefix
}

// SetRoutes makes the VPC namespace's per-subnet tables exactly routes,
// via the host end of the uplink.
func (k *Linux) SetRoutes(ns string, via netip.Addr, routes []SubnetRoutes) error {
	return k.In(ns, func() error {
		uplink, err := netlink.LinkByName(core.UplinkName)
		if err != nil {
			return fmt.Errorf("finding %s: %w", core.UplinkName, err)
		}
		wantRules := map[string]int{} // src → table
		wantRoutes := map[int]map[string]bool{}
		for _, sr := range routes {
			br, err := netlink.LinkByName(sr.Bridge)
			if err != nil {
				return fmt.Errorf("finding bridge %s: %w", sr.Bridge, err)
			}
			table := tableBase + br.Attrs().Index
			if len(sr.Dests) > 0 {
				wantRules[sr.CIDR.String()] = table
			}
			wantRoutes[table] = map[string]bool{}
			for _, d := range sr.Dests {
				wantRoutes[table][d.String()] = true
			}
		}
		rules, err := netlink.RuleList(unix.AF_INET)
		if err != nil {
			return fmt.Errorf("listing rules: %w", err)
		}
		have := map[string]bool{}
		for _, r := range rules {
			if r.Priority != rulePrioSubnet {
				continue
			}
			key := ""
			if r.Src != nil {
				key = r.Src.String()
			}
			if t, ok := wantRules[key]; ok && t == r.Table {
				have[key] = true
				continue
			}
			r := r
			if err := netlink.RuleDel(&r); err != nil {
				return fmt.Errorf("deleting stale rule from %s: %w", key, err)
			}
		}
		for src, table := range wantRules {
			if have[src] {
				continue
			}
			r := netlink.NewRule()
			r.Priority, r.Table, r.Src = rulePrioSubnet, table, ipnet(netip.MustParsePrefix(src))
			if err := ensureRule(r); err != nil {
				return err
			}
		}
		all, err := netlink.RouteListFiltered(unix.AF_INET, &netlink.Route{Table: unix.RT_TABLE_UNSPEC}, netlink.RT_FILTER_TABLE)
		if err != nil {
			return fmt.Errorf("listing routes: %w", err)
		}
		haveRoute := map[int]map[string]bool{}
		for _, r := range all {
			if r.Table < tableBase {
				continue
			}
			dst := "0.0.0.0/0"
			if r.Dst != nil {
				dst = r.Dst.String()
			}
			if wantRoutes[r.Table][dst] {
				if haveRoute[r.Table] == nil {
					haveRoute[r.Table] = map[string]bool{}
				}
				haveRoute[r.Table][dst] = true
				continue
			}
			r := r
			if err := netlink.RouteDel(&r); err != nil {
				return fmt.Errorf("deleting stale route %s table %d: %w", dst, r.Table, err)
			}
		}
		for table, dests := range wantRoutes {
			for d := range dests {
				if haveRoute[table][d] {
					continue
				}
				rt := &netlink.Route{LinkIndex: uplink.Attrs().Index, Dst: ipnet(netip.MustParsePrefix(d)), Gw: via.AsSlice(), Table: table}
				if err := netlink.RouteReplace(rt); err != nil {
					return fmt.Errorf("adding route %s via %s table %d: %w", d, via, table, err)
				}
			}
		}
		return nil
	})
}

// OpenTap opens a tap of ns (IFF_TAP|IFF_NO_PI) and returns the file, as
// QEMU's -netdev tap,fd=N wants it.
func (k *Linux) OpenTap(ns, name string) (*os.File, error) {
	var f *os.File
	err := k.In(ns, func() error {
		fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("opening /dev/net/tun: %w", err)
		}
		ifr, err := unix.NewIfreq(name)
		if err != nil {
			unix.Close(fd)
			return err
		}
		ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI)
		if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
			unix.Close(fd)
			return fmt.Errorf("attaching to tap %s: %w", name, err)
		}
		f = os.NewFile(uintptr(fd), name)
		return nil
	})
	return f, err
}
