package kernel

import (
	"errors"
	"fmt"
	"net/netip"
	"strings"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"hangar.dev/hangar/services/netd/core"
)

// applyPublicIPs makes the host's /32 routes to VPC uplinks and the proxy
// ARP entries on the uplink exactly plan's public IPs.
func (k *Linux) applyPublicIPs(plan HostPlan) error {
	want := map[netip.Addr]PublicIP{}
	for _, p := range plan.PublicIPs {
		want[p.IP] = p
	}
	routes, err := netlink.RouteList(nil, unix.AF_INET)
	if err != nil {
		return fmt.Errorf("listing host routes: %w", err)
	}
	links, err := netlink.LinkList()
	if err != nil {
		return fmt.Errorf("listing host links: %w", err)
	}
	nameOf := map[int]string{}
	for _, l := range links {
		nameOf[l.Attrs().Index] = l.Attrs().Name
	}
	own := map[string]bool{}
	for _, v := range plan.Veths {
		own[v] = true
	}
	haveRoute := map[netip.Addr]bool{}
	for _, r := range routes {
		dev := nameOf[r.LinkIndex]
		if !strings.HasPrefix(dev, core.HostVethPrefix) || !own[dev] || r.Dst == nil {
			continue
		}
		ones, _ := r.Dst.Mask.Size()
		a, ok := netip.AddrFromSlice(r.Dst.IP.To4())
		if !ok || ones != 32 {
			continue
		}
		if w, ok := want[a]; ok && w.Veth == dev {
			haveRoute[a] = true
			continue
		}
		r := r
		if err := netlink.RouteDel(&r); err != nil {
			return fmt.Errorf("deleting stale public IP route %s: %w", a, err)
		}
	}
	for a, p := range want {
		if haveRoute[a] {
			continue
		}
		veth, err := netlink.LinkByName(p.Veth)
		if err != nil {
			return fmt.Errorf("finding %s for public IP %s: %w", p.Veth, a, err)
		}
		rt := &netlink.Route{LinkIndex: veth.Attrs().Index, Dst: ipnet(netip.PrefixFrom(a, 32)), Gw: p.Via.AsSlice()}
		if err := netlink.RouteReplace(rt); err != nil {
			return fmt.Errorf("routing public IP %s to %s: %w", a, p.Veth, err)
		}
	}
	// Proxy ARP: the uplink answers who-has for each public IP, so the
	// LAN sends it here (forwarding is on, which pneigh entries need).
	byUplink := map[string]map[netip.Addr]bool{}
	for _, p := range plan.PublicIPs {
		if p.Uplink == "" {
			continue
		}
		if byUplink[p.Uplink] == nil {
			byUplink[p.Uplink] = map[netip.Addr]bool{}
		}
		byUplink[p.Uplink][p.IP] = true
	}
	proxies, err := netlink.NeighProxyList(0, unix.AF_INET)
	if err != nil {
		return fmt.Errorf("listing proxy ARP entries: %w", err)
	}
	have := map[string]map[netip.Addr]bool{}
	for _, n := range proxies {
		a, ok := netip.AddrFromSlice(n.IP.To4())
		if !ok || !inPool(a, plan.Pool) {
			continue
		}
		dev := nameOf[n.LinkIndex]
		if byUplink[dev][a] {
			if have[dev] == nil {
				have[dev] = map[netip.Addr]bool{}
			}
			have[dev][a] = true
			continue
		}
		n := n
		if err := netlink.NeighDel(&n); err != nil && !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("deleting stale proxy ARP for %s: %w", a, err)
		}
	}
	for dev, ips := range byUplink {
		l, err := netlink.LinkByName(dev)
		if err != nil {
			return fmt.Errorf("finding uplink %s: %w", dev, err)
		}
		for a := range ips {
			if have[dev][a] {
				continue
			}
			n := &netlink.Neigh{LinkIndex: l.Attrs().Index, Family: unix.AF_INET, Flags: netlink.NTF_PROXY, IP: a.AsSlice()}
			if err := netlink.NeighSet(n); err != nil {
				return fmt.Errorf("answering ARP for %s on %s: %w", a, dev, err)
			}
		}
	}
	return nil
}

func inPool(a netip.Addr, pool []netip.Prefix) bool {
	for _, p := range pool {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

// DefaultRouteLink names the interface of the host's IPv4 default route.
func (k *Linux) DefaultRouteLink() (string, error) {
	routes, err := netlink.RouteList(nil, unix.AF_INET)
	if err != nil {
		return "", fmt.Errorf("listing routes: %w", err)
	}
	for _, r := range routes {
		if r.Dst == nil || r.Dst.String() == "0.0.0.0/0" {
			l, err := netlink.LinkByIndex(r.LinkIndex)
			if err != nil {
				return "", err
			}
			return l.Attrs().Name, nil
		}
	}
	return "", fmt.Errorf("the host has no IPv4 default route")
}
