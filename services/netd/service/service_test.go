package service

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/internal/store"
	"hangar.dev/hangar/services/netd/core"
	"hangar.dev/hangar/services/netd/kernel"
)

// fakeKernel keeps namespaces and links in maps; fail makes the named
// method fail once.
type fakeKernel struct {
	ns      map[string]map[string]kernel.Link // "" is the host
	filters map[string]core.FilterPlan
	host    *kernel.HostPlan
	fail    string
	calls   []string
}

func newFake() *fakeKernel {
	return &fakeKernel{ns: map[string]map[string]kernel.Link{"": {}}, filters: map[string]core.FilterPlan{}}
}

func (f *fakeKernel) step(name string) error {
	f.calls = append(f.calls, name)
	if f.fail == name {
		f.fail = ""
		return fmt.Errorf("injected failure in %s", name)
	}
	return nil
}

func (f *fakeKernel) In(ns string, fn func() error) error { return fn() }
func (f *fakeKernel) Namespaces() ([]string, error) {
	var out []string
	for n := range f.ns {
		if strings.HasPrefix(n, core.NamespacePrefix) {
			out = append(out, n)
		}
	}
	sort.Strings(out)
	return out, nil
}
func (f *fakeKernel) EnsureNamespace(ns string) (bool, error) {
	if err := f.step("EnsureNamespace"); err != nil {
		return false, err
	}
	if f.ns[ns] != nil {
		return false, nil
	}
	f.ns[ns] = map[string]kernel.Link{}
	return true, nil
}
func (f *fakeKernel) DeleteNamespace(ns string) error {
	delete(f.ns, ns)
	delete(f.filters, ns)
	return nil
}
func (f *fakeKernel) EnsureVPCBase(ns string, dns netip.Addr) error { return f.step("EnsureVPCBase") }
func (f *fakeKernel) Links(ns string) ([]kernel.Link, error) {
	var out []kernel.Link
	for _, l := range f.ns[ns] {
		out = append(out, l)
	}
	return out, nil
}
func (f *fakeKernel) ensure(op, ns, name, id, kind, master string) (bool, error) {
	if err := f.step(op); err != nil {
		return false, err
	}
	links := f.ns[ns]
	if links == nil {
		return false, fmt.Errorf("no namespace %s", ns)
	}
	if l, ok := links[name]; ok {
		if l.Alias != core.Alias(id) {
			return false, fmt.Errorf("%s: %w", name, kernel.ErrForeign)
		}
		return false, nil
	}
	links[name] = kernel.Link{Name: name, Alias: core.Alias(id), Kind: kind, Master: master}
	return true, nil
}
func (f *fakeKernel) EnsureBridge(ns, name, id string, gw netip.Prefix) (bool, error) {
	return f.ensure("EnsureBridge", ns, name, id, "bridge", "")
}
func (f *fakeKernel) EnsureTap(ns, name, id, bridge string, owner kernel.Owner) (bool, error) {
	return f.ensure("EnsureTap", ns, name, id, "tuntap", bridge)
}
func (f *fakeKernel) DeleteLink(ns, name string) error {
	if l, ok := f.ns[ns][name]; ok && !strings.HasPrefix(l.Alias, core.AliasPrefix) {
		return kernel.ErrForeign
	}
	delete(f.ns[ns], name)
	return nil
}
func (f *fakeKernel) EnsureUplink(ns, hostName, vpcID string, host, vpc netip.Addr) error {
	if err := f.step("EnsureUplink"); err != nil {
		return err
	}
	f.ns[""][hostName] = kernel.Link{Name: hostName, Alias: core.Alias(vpcID), Kind: "veth"}
	f.ns[ns][core.UplinkName] = kernel.Link{Name: core.UplinkName, Alias: core.Alias(vpcID), Kind: "veth"}
	return nil
}
func (f *fakeKernel) SetRoutes(ns string, via netip.Addr, routes []kernel.SubnetRoutes) error {
	return f.step("SetRoutes")
}
func (f *fakeKernel) ApplyFilter(ns string, plan core.FilterPlan) error {
	if err := f.step("ApplyFilter"); err != nil {
		return err
	}
	f.filters[ns] = plan
	return nil
}
func (f *fakeKernel) ApplyHost(plan kernel.HostPlan) error {
	f.host = &plan
	return f.step("ApplyHost")
}
func (f *fakeKernel) DeleteHost() error { f.host = nil; return nil }
func (f *fakeKernel) OpenTap(ns, name string) (*os.File, error) {
	return nil, errors.New("the fake has no taps to open")
}

type nopCloser struct{ closed *int }

func (n nopCloser) Close() error { *n.closed++; return nil }

func newTestService(t *testing.T, k *fakeKernel, dir string) (*Service, *int) {
	t.Helper()
	db, err := store.Open(filepath.Join(dir, "state.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	closed := new(int)
	st := Starters{
		VPC: func(*Service, string, string, netip.Addr) (io.Closer, error) { return nopCloser{closed}, nil },
		Subnet: func(*Service, string, string, string, string, netip.Addr) (io.Closer, error) {
			return nopCloser{closed}, nil
		},
	}
	s, err := New(Config{Region: "us-east-1", PublicPool: []netip.Prefix{netip.MustParsePrefix("203.0.113.0/24")}}, k, db, st, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	return s, closed
}

func linkNames(k *fakeKernel, ns string) string {
	var out []string
	for n := range k.ns[ns] {
		out = append(out, n)
	}
	sort.Strings(out)
	return strings.Join(out, " ")
}

const (
	vpc = "vpc-0123456789abcdef0"
	sn  = "subnet-0123456789abcdef0"
	sg  = "sg-0123456789abcdef0"
	eni = "eni-0123456789abcdef0"
)

func setup(t *testing.T, s *Service) {
	t.Helper()
	if err := s.EnsureVPC(api.VPCSpec{VpcID: vpc, CIDR: "10.0.0.0/16", DNSSupport: true}); err != nil {
		t.Fatal(err)
	}
	if err := s.EnsureSubnet(vpc, api.SubnetSpec{SubnetID: sn, CIDR: "10.0.1.0/24"}); err != nil {
		t.Fatal(err)
	}
	if err := s.SetSecurityGroup(vpc, api.SecurityGroupSpec{GroupID: sg}); err != nil {
		t.Fatal(err)
	}
}

func TestFailedStepsRollBack(t *testing.T) {
	k := newFake()
	s, _ := newTestService(t, k, t.TempDir())
	ns := core.NamespaceName(vpc)

	k.fail = "EnsureUplink"
	if err := s.EnsureVPC(api.VPCSpec{VpcID: vpc, CIDR: "10.0.0.0/16"}); err == nil {
		t.Fatal("EnsureVPC succeeded through a failed uplink")
	}
	if k.ns[ns] != nil || len(s.ListVPCs()) != 0 {
		t.Fatalf("a failed EnsureVPC left namespace %v, VPCs %v", k.ns[ns], s.ListVPCs())
	}
	setup(t, s)
	before := linkNames(k, ns)
	spec := api.InterfaceSpec{SubnetID: sn, EniID: eni, MAC: "02:00:00:00:00:01", PrivateIP: "10.0.1.10", SecurityGroupIDs: []string{sg}}
	k.fail = "ApplyFilter"
	if _, err := s.AllocateInterface(spec); err == nil {
		t.Fatal("AllocateInterface succeeded through a failed filter")
	}
	if got := linkNames(k, ns); got != before {
		t.Fatalf("a failed AllocateInterface left links %q, had %q", got, before)
	}
	if _, _, err := s.st.FindInterface(eni); err == nil {
		t.Fatal("a failed AllocateInterface was kept in the state")
	}
	if len(k.filters[ns].ENIs) != 0 {
		t.Fatalf("the old rules were not put back: %+v", k.filters[ns].ENIs)
	}
	info, err := s.AllocateInterface(spec)
	if err != nil {
		t.Fatal(err)
	}
	if info.Tap != core.TapName(eni) || k.ns[ns][info.Tap].Master != core.BridgeName(sn) {
		t.Fatalf("tap %+v not on its bridge: %+v", info, k.ns[ns][info.Tap])
	}
	if err := s.DeleteSubnet(vpc, sn); core.KindOf(err) != core.KindInUse {
		t.Fatalf("DeleteSubnet with an interface: %v", err)
	}
	if err := s.DeleteSecurityGroup(vpc, sg); core.KindOf(err) != core.KindInUse {
		t.Fatalf("DeleteSecurityGroup in use: %v", err)
	}
	// A foreign link with the tap's name is a conflict, and stays.
	other := "eni-0fedcba9876543210"
	k.ns[ns][core.TapName(other)] = kernel.Link{Name: core.TapName(other), Kind: "tuntap"}
	_, err = s.AllocateInterface(api.InterfaceSpec{SubnetID: sn, EniID: other, MAC: "02:00:00:00:00:02", PrivateIP: "10.0.1.11"})
	if core.KindOf(err) != core.KindConflict {
		t.Fatalf("foreign tap: %v", err)
	}
	if _, ok := k.ns[ns][core.TapName(other)]; !ok {
		t.Fatal("the foreign tap was removed")
	}
}

func TestRestartConverges(t *testing.T) {
	dir := t.TempDir()
	k := newFake()
	s, _ := newTestService(t, k, dir)
	setup(t, s)
	if _, err := s.AllocateInterface(api.InterfaceSpec{SubnetID: sn, EniID: eni, MAC: "02:00:00:00:00:01", PrivateIP: "10.0.1.10"}); err != nil {
		t.Fatal(err)
	}
	ns := core.NamespaceName(vpc)
	want := linkNames(k, ns)
	// While netd was down: someone deleted the bridge (and so the tap),
	// a tap of netd's whose ENI is gone survived, a foreign link appeared,
	// and a namespace of a VPC netd does not hold is there.
	delete(k.ns[ns], core.BridgeName(sn))
	delete(k.ns[ns], core.TapName(eni))
	k.ns[ns]["ht-stale"] = kernel.Link{Name: "ht-stale", Alias: core.Alias("eni-0000000000000dead"), Kind: "tuntap"}
	k.ns[ns]["operator0"] = kernel.Link{Name: "operator0", Kind: "dummy"}
	// Another netd's namespace (not recorded as ours) is left alone; one
	// netd made for a VPC whose record is gone (a crash between creating
	// and saving) is removed with its host veth.
	k.ns[core.NamespaceName("vpc-0000000000000dead")] = map[string]kernel.Link{}
	stale := "vpc-0000000000000beef"
	if err := s.own(stale); err != nil {
		t.Fatal(err)
	}
	k.ns[core.NamespaceName(stale)] = map[string]kernel.Link{}
	k.ns[""][core.HostVethName(stale)] = kernel.Link{Name: core.HostVethName(stale), Alias: core.Alias(stale), Kind: "veth"}

	s.db.Close()
	s2, closed := newTestService(t, k, dir)
	if err := s2.Start(); err != nil {
		t.Fatal(err)
	}
	if got, wantAll := linkNames(k, ns), strings.Join(sortedFields(want+" operator0"), " "); got != wantAll {
		t.Fatalf("after restart links are %q, want %q", got, wantAll)
	}
	if k.ns[core.NamespaceName("vpc-0000000000000dead")] == nil {
		t.Error("another netd's namespace was removed")
	}
	if k.ns[core.NamespaceName(stale)] != nil {
		t.Error("a namespace netd made for a VPC it no longer holds survived the restart")
	}
	if _, ok := k.ns[""][core.HostVethName(stale)]; ok {
		t.Error("a host veth netd made for a VPC it no longer holds survived the restart")
	}
	if l, ok := s2.Lease(vpc, sn, "02:00:00:00:00:01"); !ok || l.IP.String() != "10.0.1.10" {
		t.Errorf("lease after restart: %+v %v", l, ok)
	}
	s2.Close()
	if *closed != 2 {
		t.Errorf("Close stopped %d servers, want 2 (the VPC's and one DHCP)", *closed)
	}
}

func sortedFields(s string) []string {
	f := strings.Fields(s)
	sort.Strings(f)
	return f
}

func TestSyncVPC(t *testing.T) {
	k := newFake()
	s, _ := newTestService(t, k, t.TempDir())
	setup(t, s)
	if _, err := s.AllocateInterface(api.InterfaceSpec{SubnetID: sn, EniID: eni, MAC: "02:00:00:00:00:01", PrivateIP: "10.0.1.10"}); err != nil {
		t.Fatal(err)
	}
	sn2 := "subnet-0fedcba9876543210"
	eni2 := "eni-0fedcba9876543210"
	st := api.VPCState{
		VPC:             api.VPCSpec{VpcID: vpc, CIDR: "10.0.0.0/16", DNSSupport: true},
		InternetGateway: "igw-0123456789abcdef0",
		Subnets:         []api.SubnetSpec{{SubnetID: sn2, CIDR: "10.0.2.0/24"}},
		SecurityGroups:  []api.SecurityGroupSpec{{GroupID: sg, Rules: []api.SGRule{{Egress: true, Protocol: "-1", CIDR: "0.0.0.0/0"}}}},
		RouteTables:     []api.RouteTableSpec{{RouteTableID: "rtb-0123456789abcdef0", Main: true, Routes: []api.RouteSpec{{Destination: "0.0.0.0/0", Target: "igw-0123456789abcdef0"}}}},
		Interfaces:      []api.InterfaceSpec{{SubnetID: sn2, EniID: eni2, MAC: "02:00:00:00:00:02", PrivateIP: "10.0.2.10", SecurityGroupIDs: []string{sg}}},
		Addresses:       []api.AddressSpec{{PublicIP: "203.0.113.9", EniID: eni2}},
	}
	bad := st
	bad.Interfaces = append([]api.InterfaceSpec{}, st.Interfaces...)
	bad.Interfaces = append(bad.Interfaces, api.InterfaceSpec{SubnetID: sn2, EniID: "eni-0aaaaaaaaaaaaaaaa", MAC: "02:00:00:00:00:02", PrivateIP: "10.0.2.11"})
	before := linkNames(k, core.NamespaceName(vpc))
	if err := s.SyncVPC(bad); core.KindOf(err) != core.KindConflict {
		t.Fatalf("SyncVPC with a duplicate MAC: %v", err)
	}
	if got := linkNames(k, core.NamespaceName(vpc)); got != before {
		t.Fatalf("a refused SyncVPC changed links: %q → %q", before, got)
	}
	if err := s.SyncVPC(st); err != nil {
		t.Fatal(err)
	}
	ns := core.NamespaceName(vpc)
	want := strings.Join(sortedFields(core.BridgeName(sn2)+" "+core.TapName(eni2)+" "+core.UplinkName), " ")
	if got := linkNames(k, ns); got != want {
		t.Fatalf("after SyncVPC links are %q, want %q", got, want)
	}
	v, _ := s.View(vpc)
	if v.IGW != st.InternetGateway || v.Addresses["203.0.113.9"] != "10.0.2.10" {
		t.Fatalf("view after SyncVPC: %+v", v)
	}
	if k.host == nil || len(k.host.PublicIPs) != 1 {
		t.Fatalf("host plan after SyncVPC: %+v", k.host)
	}
	if err := s.ReleaseInterface(eni2); err != nil {
		t.Fatal(err)
	}
	if err := s.DeleteVPC(vpc); err != nil {
		t.Fatal(err)
	}
	if k.ns[ns] != nil || k.host != nil {
		t.Fatalf("DeleteVPC left namespace %v or host table %+v", k.ns[ns], k.host)
	}
}
