// Package service is hangar-netd's engine: it holds the desired state of
// every VPC (as the gateway last pushed it), converges the kernel to it
// through the Kernel adapter, runs each VPC's DHCP, DNS and IMDS servers,
// and keeps in its state file only what it needs to find, serve and clean
// its own objects after a restart.
//
// Every change is tried on a copy of the VPC: the kernel is converged to
// the copy, and only when that and the state file succeed does the copy
// become the state. A failed step rolls back what the change created.
package service

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"sort"
	"sync"
	"time"

	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/internal/store"
	"hangar.dev/hangar/services/netd/core"
	"hangar.dev/hangar/services/netd/kernel"
	"hangar.dev/hangar/services/netd/servers"
)

// Kernel is what the service needs of the network stack; kernel.Linux is
// the real one, and tests use a fake.
type Kernel interface {
	servers.Netns
	Namespaces() ([]string, error)
	EnsureNamespace(ns string) (bool, error)
	DeleteNamespace(ns string) error
	EnsureVPCBase(ns string, dns netip.Addr) error
	Links(ns string) ([]kernel.Link, error)
	EnsureBridge(ns, name, id string, gw netip.Prefix) (bool, error)
	EnsureTap(ns, name, id, bridge string, owner kernel.Owner) (bool, error)
	DeleteLink(ns, name string) error
	EnsureUplink(ns, hostName, vpcID string, host, vpc netip.Addr) error
	SetRoutes(ns string, via netip.Addr, routes []kernel.SubnetRoutes) error
	ApplyFilter(ns string, plan core.FilterPlan) error
	ApplyHost(plan kernel.HostPlan) error
	DeleteHost() error
	OpenTap(ns, name string) (*os.File, error)
}

// Config is what netd takes from the host config and its flags.
type Config struct {
	Region       string
	Protected    []netip.Prefix
	PublicPool   []netip.Prefix
	Uplink       string // host interface that answers ARP for public IPs
	DNSUpstreams []string
	TapOwner     kernel.Owner
}

// Starters open the per-VPC and per-subnet servers; tests replace them.
type Starters struct {
	VPC    func(s *Service, vpcID, ns string, dns netip.Addr) (io.Closer, error)
	Subnet func(s *Service, vpcID, subnetID, ns, bridge string, gw netip.Addr) (io.Closer, error)
}

// Service is netd.
type Service struct {
	cfg   Config
	k     Kernel
	db    *store.DB
	log   *slog.Logger
	start Starters

	mu    sync.RWMutex
	st    *core.State
	rt    map[string]*runtime // by VPC id
	md    map[string]api.InstanceMetadata
	zones map[string]*core.Zone

	// Changed is told the id of every VPC whose state changed (or went).
	Changed func(vpcID string)
	// Leased is told of every DHCP ACK.
	Leased func(eniID, mac string, ip netip.Addr)
	// Activity is told, at most once a minute per key, that a guest used
	// DHCP (key: its MAC) or IMDS (key: its instance id); main reports it
	// to vmd (ReportGuestActivity), whose instance status check waits
	// for it.
	Activity func(key, kind string)

	actMu   sync.Mutex
	actLast map[string]time.Time
}

// guestActive reports guest activity, throttled per key and kind.
func (s *Service) guestActive(key, kind string) {
	if s.Activity == nil || key == "" {
		return
	}
	s.actMu.Lock()
	if s.actLast == nil {
		s.actLast = map[string]time.Time{}
	}
	k := kind + " " + key
	if t, ok := s.actLast[k]; ok && time.Since(t) < time.Minute {
		s.actMu.Unlock()
		return
	}
	s.actLast[k] = time.Now()
	s.actMu.Unlock()
	go s.Activity(key, kind)
}

type runtime struct {
	servers io.Closer
	dhcp    map[string]io.Closer // by subnet id
}

const bucketVPC = "vpc"

// New loads the state file's VPCs; Start converges the kernel to them.
func New(cfg Config, k Kernel, db *store.DB, start Starters, log *slog.Logger) (*Service, error) {
	s := &Service{cfg: cfg, k: k, db: db, log: log, start: start, st: core.NewState(),
		rt: map[string]*runtime{}, md: map[string]api.InstanceMetadata{}, zones: map[string]*core.Zone{}}
	err := db.View(func(tx *store.Tx) error {
		vpcs, err := store.All[core.VPC](tx, bucketVPC)
		if err != nil {
			return err
		}
		for i := range vpcs {
			v := vpcs[i]
			v.Normalize()
			s.st.VPCs[v.ID] = &v
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("loading netd state: %w", err)
	}
	return s, nil
}

// Start converges every held VPC (finding what survived a restart,
// re-creating what did not, removing what no VPC accounts for) and starts
// its servers. A VPC that fails is logged and reported by Problems; the
// others still run.
//
// Only objects netd recorded as its own before creating them are ever
// removed: another netd on the same machine (a second `hangar dev`, a
// test) keeps its namespaces.
func (s *Service) Start() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	var owned []string
	err := s.db.View(func(tx *store.Tx) error {
		return tx.Each(bucketOwned, "", func(id string, _ func(any) error) (bool, error) {
			owned = append(owned, id)
			return true, nil
		})
	})
	if err != nil {
		return fmt.Errorf("reading owned namespaces: %w", err)
	}
	for _, id := range owned {
		if s.st.VPCs[id] != nil {
			continue
		}
		s.log.Info("removing what netd made for a VPC it no longer holds", "vpc", id, "namespace", core.NamespaceName(id))
		if err := s.removeKernel(id); err != nil {
			s.log.Warn("removing stale VPC objects", "vpc", id, "err", err)
		}
	}
	if len(s.st.VPCs) == 0 {
		return nil
	}
	for _, id := range core.SortedIDs(s.st.VPCs) {
		v := s.st.VPCs[id]
		if err := s.converge(nil, v, true); err != nil {
			s.log.Error("restoring VPC", "vpc", id, "err", err)
			continue
		}
		s.log.Info("restored VPC", "vpc", id, "namespace", v.Namespace(), "subnets", len(v.Subnets), "interfaces", len(v.Interfaces))
	}
	return s.applyHost()
}

// bucketOwned records, before they are created, the VPCs whose namespace
// and host veth netd makes, so it removes only its own objects.
const bucketOwned = "owned"

func (s *Service) own(vpcID string) error {
	return s.db.Update(func(tx *store.Tx) error {
		return tx.Put(bucketOwned, vpcID, map[string]string{"namespace": core.NamespaceName(vpcID), "host_veth": core.HostVethName(vpcID)})
	})
}

// removeKernel deletes a VPC's namespace and host veth, then forgets them.
func (s *Service) removeKernel(vpcID string) error {
	s.stopRuntime(vpcID)
	if err := s.k.DeleteNamespace(core.NamespaceName(vpcID)); err != nil {
		return err
	}
	// The host end of the uplink dies with its peer; make sure.
	if err := s.k.DeleteLink("", core.HostVethName(vpcID)); err != nil {
		return err
	}
	return s.db.Update(func(tx *store.Tx) error { return tx.Delete(bucketOwned, vpcID) })
}

// Teardown removes every namespace, link and rule netd made, keeping its
// state file: the next start builds them again. `hangar dev` stops netd
// this way, so a development host leaves nothing in the machine.
func (s *Service) Teardown() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	var errs []error
	for _, id := range core.SortedIDs(s.st.VPCs) {
		if err := s.removeKernel(id); err != nil {
			errs = append(errs, err)
		}
	}
	if err := s.k.ApplyHost(kernel.HostPlan{Pool: s.cfg.PublicPool}); err != nil {
		errs = append(errs, err)
	}
	if err := s.k.DeleteHost(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// Close stops every server. Kernel state stays: guests keep their network
// while netd restarts.
func (s *Service) Close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for id := range s.rt {
		s.stopRuntime(id)
	}
}

func (s *Service) stopRuntime(vpcID string) {
	r := s.rt[vpcID]
	if r == nil {
		return
	}
	for _, c := range r.dhcp {
		_ = c.Close()
	}
	if r.servers != nil {
		_ = r.servers.Close()
	}
	delete(s.rt, vpcID)
}

// converge makes the kernel hold nv. old is what it held before (nil: not
// known, so measure everything); full also removes netd links in the
// namespace that nv does not account for. On failure what this call
// created is removed and old's rules are put back.
func (s *Service) converge(old, nv *core.VPC, full bool) (err error) {
	ns := nv.Namespace()
	var undo []func()
	defer func() {
		if err == nil {
			return
		}
		for i := len(undo) - 1; i >= 0; i-- {
			undo[i]()
		}
		if old != nil {
			if rerr := s.applyRules(old); rerr != nil {
				s.log.Warn("restoring rules after a failed change", "vpc", nv.ID, "err", rerr)
			}
		}
	}()
	if old == nil {
		if err := s.own(nv.ID); err != nil {
			return err
		}
	}
	created, err := s.k.EnsureNamespace(ns)
	if err != nil {
		return err
	}
	if created {
		undo = append(undo, func() {
			s.stopRuntime(nv.ID)
			_ = s.k.DeleteNamespace(ns)
		})
	}
	if old == nil || created {
		full = true
		if err := s.k.EnsureVPCBase(ns, nv.DNS()); err != nil {
			return err
		}
		host, vpc := core.Transit(nv.Index)
		if err := s.k.EnsureUplink(ns, core.HostVethName(nv.ID), nv.ID, host, vpc); err != nil {
			return err
		}
	}
	r := s.rt[nv.ID]
	if r == nil {
		r = &runtime{dhcp: map[string]io.Closer{}}
		s.rt[nv.ID] = r
	}
	for _, id := range core.SortedIDs(nv.Subnets) {
		sn := nv.Subnets[id]
		if !full && old.Subnets[id] != nil && r.dhcp[id] != nil {
			continue
		}
		br := core.BridgeName(id)
		made, err := s.k.EnsureBridge(ns, br, id, netip.PrefixFrom(sn.Gateway(), sn.CIDR.Bits()))
		if err != nil {
			return mapForeign(err)
		}
		if made {
			undo = append(undo, func() {
				if c := r.dhcp[id]; c != nil {
					_ = c.Close()
					delete(r.dhcp, id)
				}
				_ = s.k.DeleteLink(ns, br)
			})
		}
		if r.dhcp[id] == nil && s.start.Subnet != nil {
			c, err := s.start.Subnet(s, nv.ID, id, ns, br, sn.Gateway())
			if err != nil {
				return err
			}
			r.dhcp[id] = c
		}
	}
	for _, id := range core.SortedIDs(nv.Interfaces) {
		i := nv.Interfaces[id]
		if !full && old.Interfaces[id] != nil && old.Interfaces[id].SubnetID == i.SubnetID {
			continue
		}
		tap := core.TapName(id)
		made, err := s.k.EnsureTap(ns, tap, id, core.BridgeName(i.SubnetID), s.cfg.TapOwner)
		if err != nil {
			return mapForeign(err)
		}
		if made {
			undo = append(undo, func() { _ = s.k.DeleteLink(ns, tap) })
		}
	}
	// Removals: what old had and nv has not (or, in full mode, any netd
	// link in the namespace that nv does not name).
	stale := map[string]bool{}
	if old != nil {
		for id := range old.Interfaces {
			if nv.Interfaces[id] == nil {
				stale[core.TapName(id)] = true
			}
		}
		for id := range old.Subnets {
			if nv.Subnets[id] == nil {
				stale[core.BridgeName(id)] = true
			}
		}
	}
	if full {
		links, err := s.k.Links(ns)
		if err != nil {
			return err
		}
		want := map[string]bool{core.UplinkName: true}
		for id := range nv.Interfaces {
			want[core.TapName(id)] = true
		}
		for id := range nv.Subnets {
			want[core.BridgeName(id)] = true
		}
		for _, l := range links {
			if _, ours := core.AliasID(l.Alias); ours && !want[l.Name] {
				stale[l.Name] = true
			}
		}
	}
	// Rules first, so nothing is allowed to a tap about to go.
	if err := s.applyRules(nv); err != nil {
		return err
	}
	for id, c := range r.dhcp {
		if nv.Subnets[id] == nil {
			_ = c.Close()
			delete(r.dhcp, id)
		}
	}
	names := make([]string, 0, len(stale))
	for n := range stale {
		names = append(names, n)
	}
	sort.Strings(names) // taps (ht-) before bridges (hb-) would be nicer, but either order works
	for _, n := range names {
		if err := s.k.DeleteLink(ns, n); err != nil {
			return err
		}
	}
	if r.servers == nil && s.start.VPC != nil {
		c, err := s.start.VPC(s, nv.ID, ns, nv.DNS())
		if err != nil {
			return err
		}
		r.servers = c
	}
	return nil
}

// applyRules sets a VPC's routes and nftables tables from v.
func (s *Service) applyRules(v *core.VPC) error {
	host, _ := core.Transit(v.Index)
	var routes []kernel.SubnetRoutes
	for _, id := range core.SortedIDs(v.Subnets) {
		routes = append(routes, kernel.SubnetRoutes{CIDR: v.Subnets[id].CIDR, Bridge: core.BridgeName(id), Dests: v.IGWRoutes(id)})
	}
	if err := s.k.SetRoutes(v.Namespace(), host, routes); err != nil {
		return err
	}
	return s.k.ApplyFilter(v.Namespace(), v.Filter(s.cfg.Protected))
}

// applyHost sets the host namespace's table and public IP routes from
// every VPC.
func (s *Service) applyHost() error {
	plan := kernel.HostPlan{Protected: s.cfg.Protected, Pool: s.cfg.PublicPool}
	for _, id := range core.SortedIDs(s.st.VPCs) {
		v := s.st.VPCs[id]
		plan.Veths = append(plan.Veths, core.HostVethName(id))
		if v.IGW == "" {
			continue
		}
		_, via := core.Transit(v.Index)
		for _, a := range core.SortedIDs(v.Addresses) {
			plan.PublicIPs = append(plan.PublicIPs, kernel.PublicIP{IP: v.Addresses[a].PublicIP, Veth: core.HostVethName(id), Via: via, Uplink: s.cfg.Uplink, Present: true})
		}
	}
	return s.k.ApplyHost(plan)
}

func mapForeign(err error) error {
	if errors.Is(err, kernel.ErrForeign) {
		return &core.Error{Kind: core.KindConflict, Msg: err.Error()}
	}
	return err
}

// commit keeps nv as the state of its VPC, in memory and in the state
// file; a failed write converges back to old.
func (s *Service) commit(old, nv *core.VPC) error {
	if err := s.db.Update(func(tx *store.Tx) error { return tx.Put(bucketVPC, nv.ID, nv) }); err != nil {
		if old != nil {
			_ = s.converge(nv, old, false)
		}
		return fmt.Errorf("saving %s: %w", nv.ID, err)
	}
	s.st.VPCs[nv.ID] = nv
	delete(s.zones, nv.ID)
	if herr := s.applyHost(); herr != nil {
		s.log.Warn("applying host rules", "err", herr)
	}
	if s.Changed != nil {
		s.Changed(nv.ID)
	}
	return nil
}

// change runs the common shape of every method: copy the VPC, let fn
// modify the copy (validating as it goes), converge, commit.
func (s *Service) change(vpcID string, fn func(v *core.VPC) error) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	old, err := s.st.VPC(vpcID)
	if err != nil {
		return err
	}
	nv := old.Clone()
	if err := fn(nv); err != nil {
		return err
	}
	if err := s.converge(old, nv, false); err != nil {
		return err
	}
	return s.commit(old, nv)
}

// applyHostOrClear applies the host plan while any VPC exists, and removes
// netd's host table once none does, so a host without VPCs holds nothing
// of netd's.
func (s *Service) applyHostOrClear() error {
	if len(s.st.VPCs) == 0 {
		if err := s.k.ApplyHost(kernel.HostPlan{Pool: s.cfg.PublicPool}); err != nil {
			return err
		}
		return s.k.DeleteHost()
	}
	return s.applyHost()
}
