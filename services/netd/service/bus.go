package service

import (
	"io"
	"log/slog"
	"net/netip"
	"strconv"
	"time"

	"github.com/godbus/dbus/v5"
	"github.com/godbus/dbus/v5/introspect"
	"github.com/godbus/dbus/v5/prop"

	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/internal/busutil"
	"hangar.dev/hangar/services/internal/version"
	"hangar.dev/hangar/services/netd/core"
	"hangar.dev/hangar/services/netd/servers"
)

// RealStarters run the real DHCP, DNS and IMDS servers.
func RealStarters(k servers.Netns, log *slog.Logger) Starters {
	return Starters{
		VPC: func(s *Service, vpcID, ns string, dns netip.Addr) (io.Closer, error) {
			l := log.With("vpc", vpcID)
			d, err := servers.StartDNS(k, ns, []netip.Addr{dns, core.DNSLinkLocal}, func() *core.Zone { return s.Zone(vpcID) }, s.cfg.DNSUpstreams, l)
			if err != nil {
				return nil, err
			}
			im, err := servers.StartIMDS(k, ns, func(ip netip.Addr) (servers.Instance, bool) {
				md, n, ok := s.Instance(vpcID, ip)
				if ok {
					s.guestActive(md.InstanceID, api.GuestActivityIMDS)
				}
				return servers.Instance{Metadata: md, Net: n}, ok
			}, l)
			if err != nil {
				d.Close()
				return nil, err
			}
			return closers{d.Close, im.Close}, nil
		},
		Subnet: func(s *Service, vpcID, subnetID, ns, bridge string, gw netip.Addr) (io.Closer, error) {
			d, err := servers.StartDHCP(k, ns, bridge, gw,
				func(mac string) (core.Lease, bool) { return s.Lease(vpcID, subnetID, mac) },
				func(l core.Lease, mac string) {
					s.guestActive(mac, api.GuestActivityDHCP)
					if s.Leased != nil {
						s.Leased(l.EniID, mac, l.IP)
					}
				}, log.With("vpc", vpcID, "subnet", subnetID))
			if err != nil {
				return nil, err
			}
			return closers{d.Close}, nil
		},
	}
}

type closers []func()

func (c closers) Close() error {
	for _, f := range c {
		f()
	}
	return nil
}

// busError names an error for the bus.
func busError(err error) *dbus.Error {
	if err == nil {
		return nil
	}
	name := api.ErrFailed
	switch core.KindOf(err) {
	case core.KindInvalid:
		name = api.ErrInvalidArgument
	case core.KindNotFound:
		name = api.ErrNotFound
	case core.KindConflict:
		name = api.ErrConflict
	case core.KindInUse:
		name = api.ErrInUse
	}
	return api.Errorf(name, "%s", err.Error())
}

// Bus exports dev.hangar.Network1 and one object per VPC.
type Bus struct {
	srv     *busutil.Server
	s       *Service
	started time.Time
	log     *slog.Logger
	changes chan string
}

// ExportBus exports the root object and every held VPC's object. Claim
// the name after this returns.
func ExportBus(srv *busutil.Server, s *Service, log *slog.Logger) (*Bus, error) {
	b := &Bus{srv: srv, s: s, started: time.Now(), log: log, changes: make(chan string, 1024)}
	s.Changed = func(id string) {
		select {
		case b.changes <- id:
		default:
			log.Warn("dropping a VPC property update; the bus is behind", "vpc", id)
		}
	}
	s.Leased = func(eni, mac string, ip netip.Addr) {
		_ = srv.Emit(api.Network.Path, api.Network.Interface, api.NetworkSignalLeaseGranted, eni, mac, ip.String())
	}
	methods := map[string]any{
		api.MethodStatus:        func() (api.ServiceStatus, *dbus.Error) { return b.status(), nil },
		api.NetEnsureVPC:        func(v api.VPCSpec) *dbus.Error { return busError(s.EnsureVPC(v)) },
		api.NetDeleteVPC:        func(id string) *dbus.Error { return busError(s.DeleteVPC(id)) },
		api.NetSyncVPC:          func(st api.VPCState) *dbus.Error { return busError(s.SyncVPC(st)) },
		api.NetListVPCs:         func() ([]string, *dbus.Error) { return s.ListVPCs(), nil },
		api.NetEnsureSubnet:     func(vpc string, sn api.SubnetSpec) *dbus.Error { return busError(s.EnsureSubnet(vpc, sn)) },
		api.NetDeleteSubnet:     func(vpc, sn string) *dbus.Error { return busError(s.DeleteSubnet(vpc, sn)) },
		api.NetSetSecurityGroup: func(vpc string, g api.SecurityGroupSpec) *dbus.Error { return busError(s.SetSecurityGroup(vpc, g)) },
		api.NetDeleteSecurityGroup: func(vpc, g string) *dbus.Error {
			return busError(s.DeleteSecurityGroup(vpc, g))
		},
		api.NetSetInternetGateway: func(vpc, igw string) *dbus.Error { return busError(s.SetInternetGateway(vpc, igw)) },
		api.NetSetRouteTable:      func(vpc string, t api.RouteTableSpec) *dbus.Error { return busError(s.SetRouteTable(vpc, t)) },
		api.NetDeleteRouteTable:   func(vpc, t string) *dbus.Error { return busError(s.DeleteRouteTable(vpc, t)) },
		api.NetAllocateInterface: func(spec api.InterfaceSpec) (api.InterfaceInfo, *dbus.Error) {
			info, err := s.AllocateInterface(spec)
			return info, busError(err)
		},
		api.NetDescribeInterface: func(eni string) (api.InterfaceInfo, *dbus.Error) {
			info, err := s.DescribeInterface(eni)
			return info, busError(err)
		},
		api.NetReleaseInterface:   func(eni string) *dbus.Error { return busError(s.ReleaseInterface(eni)) },
		api.NetSetInterfaceGroups: func(eni string, g []string) *dbus.Error { return busError(s.SetInterfaceGroups(eni, g)) },
		api.NetOpenTap: func(eni string) (dbus.UnixFD, *dbus.Error) {
			f, err := s.OpenTap(eni)
			if err != nil {
				return -1, busError(err)
			}
			// The reply carries a duplicate; ours is closed once the
			// reply has surely been written (godbus writes it right after
			// this returns, on this goroutine). Not much later: while our
			// copy is open the tap stays attached, so its carrier stays up
			// after the guest is gone and the next start of the instance
			// gets EBUSY (a single-queue tap takes one opener).
			time.AfterFunc(2*time.Second, func() { _ = f.Close() })
			return dbus.UnixFD(f.Fd()), nil
		},
		api.NetSetInstanceMetadata: func(eni string, md api.InstanceMetadata) *dbus.Error {
			return busError(s.SetInstanceMetadata(eni, md))
		},
		api.NetClearInstanceMetadata: func(eni string) *dbus.Error { return busError(s.ClearInstanceMetadata(eni)) },
		api.NetAssociateAddress:      func(a api.AddressSpec) *dbus.Error { return busError(s.AssociateAddress(a)) },
		api.NetDisassociateAddress:   func(ip string) *dbus.Error { return busError(s.DisassociateAddress(ip)) },
	}
	root := &busutil.Object{
		Path:      api.Network.Path,
		Interface: api.Network.Interface,
		Methods:   methods,
		Props: map[string]*prop.Prop{
			api.PropVersion: {Value: version.String(), Emit: prop.EmitConst},
			api.PropStarted: {Value: b.started.Unix(), Emit: prop.EmitConst},
			api.PropState:   {Value: "running", Emit: prop.EmitTrue},
			"VPCs":          {Value: s.ListVPCs(), Emit: prop.EmitTrue},
		},
		Signals: []introspect.Signal{{Name: api.NetworkSignalLeaseGranted, Args: []introspect.Arg{
			{Name: "eni", Type: "s"}, {Name: "mac", Type: "s"}, {Name: "ip", Type: "s"}}}},
	}
	if err := srv.Export(root); err != nil {
		return nil, err
	}
	for _, id := range s.ListVPCs() {
		b.sync(id)
	}
	return b, nil
}

// Run applies property updates until done closes.
func (b *Bus) Run(done <-chan struct{}) {
	for {
		select {
		case <-done:
			return
		case id := <-b.changes:
			b.sync(id)
			_ = b.srv.Set(api.Network.Path, "VPCs", b.s.ListVPCs())
		}
	}
}

// sync exports, updates or removes a VPC's object.
func (b *Bus) sync(id string) {
	path := api.VPCObjectPath(id)
	v, ok := b.s.View(id)
	if !ok {
		b.srv.Unexport(path)
		return
	}
	if !b.srv.Exported(path) {
		obj := &busutil.Object{
			Path: path, Interface: api.NetworkVPCInterface, Methods: map[string]any{},
			Props: map[string]*prop.Prop{
				api.NetPropNamespace:       {Value: v.Namespace, Emit: prop.EmitConst},
				api.NetPropCIDR:            {Value: v.CIDR, Emit: prop.EmitConst},
				api.NetPropSubnets:         {Value: v.Subnets, Emit: prop.EmitTrue},
				api.NetPropInterfaces:      {Value: v.Interfaces, Emit: prop.EmitTrue},
				api.NetPropInternetGateway: {Value: v.IGW, Emit: prop.EmitTrue},
				api.NetPropAddresses:       {Value: v.Addresses, Emit: prop.EmitTrue},
			},
		}
		if err := b.srv.Export(obj); err != nil {
			b.log.Warn("exporting VPC object", "vpc", id, "err", err)
		}
		return
	}
	for name, val := range map[string]any{
		api.NetPropSubnets: v.Subnets, api.NetPropInterfaces: v.Interfaces,
		api.NetPropInternetGateway: v.IGW, api.NetPropAddresses: v.Addresses,
	} {
		if err := b.srv.Set(path, name, val); err != nil {
			b.log.Warn("updating VPC property", "vpc", id, "property", name, "err", err)
		}
	}
}

func (b *Bus) status() api.ServiceStatus {
	problems := b.s.Problems()
	state := "running"
	if len(problems) > 0 {
		state = "degraded"
	}
	return api.ServiceStatus{State: state, Detail: "serving " + itoa(len(b.s.ListVPCs())) + " VPCs", Version: version.String(),
		Started: b.started.Unix(), Counts: b.s.Counts(), Problems: problems}
}

func itoa(n int) string { return strconv.Itoa(n) }
