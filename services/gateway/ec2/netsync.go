package ec2

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/netip"
	"reflect"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/aws/aws-sdk-go-v2/service/ec2/types"

	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/internal/store"
)

// Network is what EC2 needs of hangar-netd; api.NetworkClient is the real
// one, and tests use a fake.
type Network interface {
	SyncVPC(ctx context.Context, s api.VPCState) error
	DeleteVPC(ctx context.Context, vpcID string) error
	ListVPCs(ctx context.Context) ([]string, error)
	AllocateInterface(ctx context.Context, s api.InterfaceSpec) (api.InterfaceInfo, error)
	ReleaseInterface(ctx context.Context, eniID string) error
	SetInstanceMetadata(ctx context.Context, eniID string, md api.InstanceMetadata) error
	ClearInstanceMetadata(ctx context.Context, eniID string) error
}

// SetNetwork connects EC2 to hangar-netd. From then on new VPCs and
// subnets start "pending" and become "available" once netd has built
// them, and every committed change to a VPC's records is pushed to netd
// whole (SyncVPC), so the kernel follows the records without each handler
// having to remember it.
func (s *Service) SetNetwork(n Network) {
	s.net = &netSync{
		s:        s,
		net:      n,
		log:      s.log.With("component", "netsync"),
		dirty:    map[string]bool{},
		locks:    map[string]*sync.Mutex{},
		kick:     make(chan struct{}, 1),
		appeared: make(chan struct{}, 1),
	}
	s.db.Watch(s.net.observe)
}

// netSync keeps netd's VPCs equal to the gateway's records.
type netSync struct {
	s   *Service
	net Network
	log *slog.Logger

	mu       sync.Mutex
	dirty    map[string]bool
	locks    map[string]*sync.Mutex
	kick     chan struct{}
	appeared chan struct{}
}

// networkKinds are the record kinds whose changes alter a VPC's network.
var networkKinds = map[string]bool{"vpc": true, "subnet": true, "sg": true, "rtb": true, "igw": true, "eni": true, "eipalloc": true}

// vpcRef decodes the VPC a record belongs to, whatever kind it is.
type vpcRef struct {
	VpcId       *string // SDK-shaped records
	VpcID       string  // securityGroupRecord
	Attachments []struct {
		VpcId *string
	} // internet gateways
	NetworkVpcID string // Elastic IP associations
}

func (r vpcRef) ids() []string {
	var out []string
	if r.VpcId != nil {
		out = append(out, *r.VpcId)
	}
	if r.VpcID != "" {
		out = append(out, r.VpcID)
	}
	if r.NetworkVpcID != "" {
		out = append(out, r.NetworkVpcID)
	}
	for _, a := range r.Attachments {
		if a.VpcId != nil {
			out = append(out, *a.VpcId)
		}
	}
	return out
}

// observe marks the VPCs of every changed network record.
func (n *netSync) observe(changes []store.Change) {
	var ids []string
	for _, c := range changes {
		if !networkKinds[c.Kind] || stateOnly(c) {
			continue
		}
		for _, raw := range [][]byte{c.Old, c.New} {
			if raw == nil {
				continue
			}
			var ref vpcRef
			if err := json.Unmarshal(raw, &ref); err == nil {
				ids = append(ids, ref.ids()...)
			}
		}
	}
	if len(ids) > 0 {
		n.mark(ids...)
	}
}

// stateOnly reports a change of nothing but a record's State: netSync's own
// pending → available flips, which must not trigger another push.
func stateOnly(c store.Change) bool {
	if c.Old == nil || c.New == nil {
		return false
	}
	var a, b map[string]any
	if json.Unmarshal(c.Old, &a) != nil || json.Unmarshal(c.New, &b) != nil {
		return false
	}
	delete(a, "State")
	delete(b, "State")
	return reflect.DeepEqual(a, b)
}

func (n *netSync) mark(ids ...string) {
	n.mu.Lock()
	for _, id := range ids {
		n.dirty[id] = true
	}
	n.mu.Unlock()
	select {
	case n.kick <- struct{}{}:
	default:
	}
}

func (n *netSync) lock(vpcID string) *sync.Mutex {
	n.mu.Lock()
	defer n.mu.Unlock()
	l := n.locks[vpcID]
	if l == nil {
		l = &sync.Mutex{}
		n.locks[vpcID] = l
	}
	return l
}

// run pushes dirty VPCs until ctx ends. After a failure it waits (with
// back-off up to 30 s) before the next attempt, however many commits mark
// VPCs meanwhile: while netd is away, a burst of creates must not become a
// burst of failing calls. NetworkAppeared cuts the wait short.
func (n *netSync) run(ctx context.Context) {
	var (
		backoff time.Duration
		next    time.Time // no attempt before this
	)
	for {
		var timer <-chan time.Time
		if wait := time.Until(next); wait > 0 {
			timer = time.After(wait)
		}
		select {
		case <-ctx.Done():
			return
		case <-n.kick:
			if time.Now().Before(next) {
				continue
			}
		case <-timer:
		case <-n.appeared:
			backoff, next = 0, time.Time{}
		}
		n.mu.Lock()
		batch := make([]string, 0, len(n.dirty))
		for id := range n.dirty {
			batch = append(batch, id)
		}
		n.dirty = map[string]bool{}
		n.mu.Unlock()
		if len(batch) == 0 {
			continue
		}
		sort.Strings(batch)
		var failed []string
		for i, id := range batch {
			err := n.syncOne(ctx, id)
			if err == nil {
				continue
			}
			failed = append(failed, id)
			if backoff == 0 {
				n.log.Warn("pushing a VPC to hangar-netd failed; retrying", "vpc", id, "err", err)
			}
			if absent(err) {
				// netd is not on the bus: the rest would fail the same way.
				failed = append(failed, batch[i+1:]...)
				break
			}
		}
		if len(failed) == 0 {
			backoff, next = 0, time.Time{}
			continue
		}
		n.mu.Lock()
		for _, id := range failed {
			n.dirty[id] = true
		}
		n.mu.Unlock()
		switch {
		case backoff == 0:
			backoff = 500 * time.Millisecond
		case backoff < 30*time.Second:
			backoff *= 2
		}
		next = time.Now().Add(backoff)
	}
}

// absent reports an error that means hangar-netd is not on the bus.
func absent(err error) bool {
	e, ok := api.AsError(err)
	if !ok {
		return false
	}
	switch e.Name {
	case "org.freedesktop.DBus.Error.ServiceUnknown", "org.freedesktop.DBus.Error.NameHasNoOwner", api.ErrUnavailable:
		return true
	}
	return false
}

// syncNow pushes one VPC before the caller goes on (RunInstances needs the
// subnet's bridge before it asks for a tap).
func (n *netSync) syncNow(ctx context.Context, vpcID string) error {
	return n.syncOne(ctx, vpcID)
}

func (n *netSync) syncOne(ctx context.Context, vpcID string) error {
	l := n.lock(vpcID)
	l.Lock()
	defer l.Unlock()
	var (
		state api.VPCState
		found bool
	)
	err := n.s.db.View(func(tx *store.Tx) error {
		var err error
		state, found, err = vpcState(tx, vpcID)
		return err
	})
	if err != nil {
		return err
	}
	cctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if !found {
		if err := n.net.DeleteVPC(cctx, vpcID); err != nil && !api.IsName(err, api.ErrNotFound) {
			return fmt.Errorf("deleting %s in hangar-netd: %w", vpcID, err)
		}
		return nil
	}
	if err := n.net.SyncVPC(cctx, state); err != nil {
		return fmt.Errorf("syncing %s to hangar-netd: %w", vpcID, err)
	}
	return n.s.markAvailable(vpcID)
}

// resyncAll pushes every VPC and deletes what netd holds that the records
// do not: at the gateway's start and whenever hangar-netd (re)appears.
func (n *netSync) resyncAll(ctx context.Context) error {
	var ids []string
	err := n.s.db.View(func(tx *store.Tx) error {
		return tx.Each(kindVPC.Prefix, "", func(id string, _ func(any) error) (bool, error) {
			ids = append(ids, id)
			return true, nil
		})
	})
	if err != nil {
		return err
	}
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	have, err := n.net.ListVPCs(cctx)
	if err != nil {
		return fmt.Errorf("listing hangar-netd's VPCs: %w", err)
	}
	known := map[string]bool{}
	for _, id := range ids {
		known[id] = true
	}
	for _, id := range have {
		if !known[id] {
			ids = append(ids, id) // syncOne deletes what has no record
		}
	}
	n.mark(ids...)
	return nil
}

// markAvailable flips a VPC and its subnets from pending to available once
// netd has built them.
func (s *Service) markAvailable(vpcID string) error {
	return s.db.Update(func(tx *store.Tx) error {
		v, err := get[vpcRecord](tx, kindVPC, vpcID)
		if err != nil {
			return nil // deleted meanwhile
		}
		if v.State == types.VpcStatePending {
			v.State = types.VpcStateAvailable
			if err := put(tx, kindVPC, vpcID, v); err != nil {
				return err
			}
		}
		subnets, err := all(tx, kindSubnet, func(_ string, sn *subnetRecord) bool {
			return deref(sn.VpcId) == vpcID && sn.State == types.SubnetStatePending
		})
		if err != nil {
			return err
		}
		for id, sn := range subnets {
			sn.State = types.SubnetStateAvailable
			if err := put(tx, kindSubnet, id, sn); err != nil {
				return err
			}
		}
		return nil
	})
}

// networked reports whether records wait for hangar-netd.
func (s *Service) networked() bool { return s.net != nil }

// vpcState renders a VPC's records as the state netd must hold.
func vpcState(tx *store.Tx, vpcID string) (api.VPCState, bool, error) {
	var st api.VPCState
	if !tx.Has(kindVPC.Prefix, vpcID) {
		return st, false, nil
	}
	v, err := get[vpcRecord](tx, kindVPC, vpcID)
	if err != nil {
		return st, false, err
	}
	st.VPC = api.VPCSpec{VpcID: vpcID, CIDR: deref(v.CidrBlock), DNSSupport: v.DNSSupport, DNSHostnames: v.DNSHostnames}
	igws, err := all(tx, kindInternetGateway, func(_ string, g *internetGatewayRecord) bool {
		for _, a := range g.Attachments {
			if deref(a.VpcId) == vpcID && (a.State == types.AttachmentStatusAttached || a.State == "available") {
				return true
			}
		}
		return false
	})
	if err != nil {
		return st, false, err
	}
	for id := range igws {
		st.InternetGateway = id
	}
	subnets, err := all(tx, kindSubnet, func(_ string, sn *subnetRecord) bool { return deref(sn.VpcId) == vpcID })
	if err != nil {
		return st, false, err
	}
	for _, id := range sortedKeys(subnets) {
		st.Subnets = append(st.Subnets, api.SubnetSpec{SubnetID: id, CIDR: deref(subnets[id].CidrBlock)})
	}
	groups, err := all(tx, kindSecurityGroup, func(_ string, g *securityGroupRecord) bool { return g.VpcID == vpcID })
	if err != nil {
		return st, false, err
	}
	for _, id := range sortedKeys(groups) {
		st.SecurityGroups = append(st.SecurityGroups, api.SecurityGroupSpec{GroupID: id, Rules: netRules(groups[id].Rules)})
	}
	tables, err := all(tx, kindRouteTable, func(_ string, rt *routeTableRecord) bool { return deref(rt.VpcId) == vpcID })
	if err != nil {
		return st, false, err
	}
	for _, id := range sortedKeys(tables) {
		rt := tables[id]
		spec := api.RouteTableSpec{RouteTableID: id}
		for _, a := range rt.Associations {
			if deref(a.Main) {
				spec.Main = true
			} else if a.SubnetId != nil {
				spec.SubnetIDs = append(spec.SubnetIDs, *a.SubnetId)
			}
		}
		for _, r := range rt.Routes {
			gw := deref(r.GatewayId)
			if !strings.HasPrefix(gw, "igw-") || r.State != types.RouteStateActive || r.DestinationCidrBlock == nil {
				continue
			}
			spec.Routes = append(spec.Routes, api.RouteSpec{Destination: *r.DestinationCidrBlock, Target: gw})
		}
		st.RouteTables = append(st.RouteTables, spec)
	}
	for _, hook := range vpcStateHooks {
		if err := hook(tx, vpcID, &st); err != nil {
			return st, false, err
		}
	}
	return st, true, nil
}

// vpcStateHooks add what other record kinds contribute to a VPC's network
// state (interfaces, Elastic IP associations).
var vpcStateHooks []func(tx *store.Tx, vpcID string, st *api.VPCState) error

// netRules converts stored rules to netd's. netd filters IPv4: IPv6 and
// prefix-list rules have no traffic to match there and are left out.
func netRules(rules []sgRule) []api.SGRule {
	var out []api.SGRule
	for _, r := range rules {
		if r.IPv6CIDR != "" || r.PrefixList != "" || r.Protocol == "icmpv6" || r.Protocol == "58" {
			continue
		}
		nr := api.SGRule{Egress: r.Egress, Protocol: r.Protocol, FromPort: r.FromPort, ToPort: r.ToPort, CIDR: r.CIDR, GroupID: r.GroupID}
		if nr.CIDR != "" {
			if p, err := netip.ParsePrefix(nr.CIDR); err != nil || !p.Addr().Is4() {
				continue
			}
		}
		out = append(out, nr)
	}
	return out
}

func sortedKeys[T any](m map[string]T) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// StartNetwork runs the push loop until ctx ends. Call NetworkAppeared
// whenever hangar-netd (re)claims its name, including at start.
func (s *Service) StartNetwork(ctx context.Context) {
	if s.net != nil {
		go s.net.run(ctx)
	}
}

// NetworkAppeared resyncs every VPC to a hangar-netd that has just started
// (or restarted: netd rebuilds its kernel state from what it is sent, and
// keeps instance metadata, which carries credentials, only in memory).
func (s *Service) NetworkAppeared(ctx context.Context) {
	if s.net == nil {
		return
	}
	if err := s.net.resyncAll(ctx); err != nil {
		s.log.Warn("resyncing hangar-netd", "err", err)
	}
	select {
	case s.net.appeared <- struct{}{}:
	default:
	}
	for _, hook := range networkAppearedHooks {
		hook(ctx, s)
	}
}

// networkAppearedHooks run after a resync (instances re-push metadata).
var networkAppearedHooks []func(ctx context.Context, s *Service)
