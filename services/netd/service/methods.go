package service

import (
	"fmt"
	"net/netip"
	"os"
	"sort"

	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/internal/store"
	"hangar.dev/hangar/services/netd/core"
)

func invalid(format string, args ...any) error {
	return &core.Error{Kind: core.KindInvalid, Msg: fmt.Sprintf(format, args...)}
}

func inUse(format string, args ...any) error {
	return &core.Error{Kind: core.KindInUse, Msg: fmt.Sprintf(format, args...)}
}

// EnsureVPC creates the VPC's namespace and servers, or updates its DNS
// attributes.
func (s *Service) EnsureVPC(spec api.VPCSpec) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	nv, err := s.st.CheckVPC(spec)
	if err != nil {
		return err
	}
	if nv.Index < 0 {
		return invalid("no transit addresses left for another VPC")
	}
	old := s.st.VPCs[spec.VpcID]
	if err := s.converge(old, nv, false); err != nil {
		return err
	}
	return s.commit(old, nv)
}

// DeleteVPC removes a VPC's namespace with everything in it. It refuses
// while interfaces exist, as EC2 refuses while instances run.
func (s *Service) DeleteVPC(vpcID string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	v := s.st.VPCs[vpcID]
	if v == nil {
		// Idempotent: what an earlier failed delete left goes too, if
		// it is netd's.
		owned := false
		_ = s.db.View(func(tx *store.Tx) error { owned = tx.Has(bucketOwned, vpcID); return nil })
		if owned {
			return s.removeKernel(vpcID)
		}
		return nil
	}
	if ids := core.SortedIDs(v.Interfaces); len(ids) > 0 {
		return inUse("%s still has network interfaces (%s)", vpcID, ids[0])
	}
	return s.deleteVPCLocked(v)
}

func (s *Service) deleteVPCLocked(v *core.VPC) error {
	if err := s.removeKernel(v.ID); err != nil {
		return err
	}
	if err := s.db.Update(func(tx *store.Tx) error { return tx.Delete(bucketVPC, v.ID) }); err != nil {
		return fmt.Errorf("forgetting %s: %w", v.ID, err)
	}
	delete(s.st.VPCs, v.ID)
	delete(s.zones, v.ID)
	for eni := range v.Interfaces {
		delete(s.md, eni)
	}
	if err := s.applyHostOrClear(); err != nil {
		s.log.Warn("applying host rules", "err", err)
	}
	if s.Changed != nil {
		s.Changed(v.ID)
	}
	return nil
}

// ListVPCs returns the VPCs netd holds.
func (s *Service) ListVPCs() []string {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return core.SortedIDs(s.st.VPCs)
}

// SyncVPC makes a VPC exactly st: everything is validated first, then the
// kernel converges in one step (with a full sweep of the namespace).
func (s *Service) SyncVPC(st api.VPCState) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	nv, err := s.st.CheckVPC(st.VPC)
	if err != nil {
		return err
	}
	old := s.st.VPCs[st.VPC.VpcID]
	nv = nv.Clone()
	nv.Subnets, nv.Groups, nv.RouteTables = map[string]*core.Subnet{}, map[string]*core.Group{}, map[string]*core.RouteTable{}
	nv.Interfaces, nv.Addresses = map[string]*core.Interface{}, map[string]*core.Address{}
	nv.IGW = st.InternetGateway
	for _, sn := range st.Subnets {
		x, err := nv.CheckSubnet(sn)
		if err != nil {
			return err
		}
		nv.Subnets[x.ID] = x
	}
	for _, g := range st.SecurityGroups {
		x, err := nv.CheckGroup(g)
		if err != nil {
			return err
		}
		nv.Groups[x.ID] = x
	}
	for _, t := range st.RouteTables {
		x, err := nv.CheckRouteTable(t)
		if err != nil {
			return err
		}
		nv.RouteTables[x.ID] = x
	}
	// Interfaces are checked against a state where this VPC is nv, so
	// MACs are compared with every other VPC's and with each other.
	trial := &core.State{VPCs: map[string]*core.VPC{}}
	for id, v := range s.st.VPCs {
		trial.VPCs[id] = v
	}
	trial.VPCs[nv.ID] = nv
	for _, spec := range st.Interfaces {
		spec.VpcID = nv.ID
		_, x, err := trial.CheckInterface(spec)
		if err != nil {
			return err
		}
		nv.Interfaces[x.ID] = x
	}
	for _, a := range st.Addresses {
		_, x, err := trial.CheckAddress(a, s.cfg.PublicPool)
		if err != nil {
			return err
		}
		nv.Addresses[x.PublicIP.String()] = x
	}
	if err := s.converge(old, nv, true); err != nil {
		return err
	}
	return s.commit(old, nv)
}

// EnsureSubnet creates a subnet's bridge and DHCP server.
func (s *Service) EnsureSubnet(vpcID string, spec api.SubnetSpec) error {
	return s.change(vpcID, func(v *core.VPC) error {
		sn, err := v.CheckSubnet(spec)
		if err != nil {
			return err
		}
		v.Subnets[sn.ID] = sn
		return nil
	})
}

// DeleteSubnet removes a subnet's bridge; InUse while interfaces exist.
func (s *Service) DeleteSubnet(vpcID, subnetID string) error {
	return s.change(vpcID, func(v *core.VPC) error {
		if v.Subnets[subnetID] == nil {
			return nil
		}
		if ids := v.SubnetInterfaces(subnetID); len(ids) > 0 {
			return inUse("subnet %s still has network interfaces (%s)", subnetID, ids[0])
		}
		delete(v.Subnets, subnetID)
		for _, t := range v.RouteTables {
			kept := t.Subnets[:0]
			for _, sn := range t.Subnets {
				if sn != subnetID {
					kept = append(kept, sn)
				}
			}
			t.Subnets = kept
		}
		return nil
	})
}

// SetSecurityGroup replaces a group's rules.
func (s *Service) SetSecurityGroup(vpcID string, spec api.SecurityGroupSpec) error {
	return s.change(vpcID, func(v *core.VPC) error {
		g, err := v.CheckGroup(spec)
		if err != nil {
			return err
		}
		v.Groups[g.ID] = g
		return nil
	})
}

// DeleteSecurityGroup forgets a group no interface or rule uses.
func (s *Service) DeleteSecurityGroup(vpcID, groupID string) error {
	return s.change(vpcID, func(v *core.VPC) error {
		if users := v.GroupUsers(groupID); len(users) > 0 {
			return inUse("security group %s is used by %s", groupID, users[0])
		}
		delete(v.Groups, groupID)
		return nil
	})
}

// SetInternetGateway attaches (or with "" detaches) the VPC's gateway.
func (s *Service) SetInternetGateway(vpcID, igwID string) error {
	return s.change(vpcID, func(v *core.VPC) error {
		if igwID != "" && len(igwID) < 5 || igwID != "" && igwID[:4] != "igw-" {
			return invalid("%q is not an internet gateway id", igwID)
		}
		v.IGW = igwID
		return nil
	})
}

// SetRouteTable replaces a route table.
func (s *Service) SetRouteTable(vpcID string, spec api.RouteTableSpec) error {
	return s.change(vpcID, func(v *core.VPC) error {
		t, err := v.CheckRouteTable(spec)
		if err != nil {
			return err
		}
		// A subnet is associated with one table at a time.
		for _, other := range v.RouteTables {
			if other.ID == t.ID {
				continue
			}
			kept := other.Subnets[:0]
			for _, sn := range other.Subnets {
				if !contains(t.Subnets, sn) {
					kept = append(kept, sn)
				}
			}
			other.Subnets = kept
		}
		v.RouteTables[t.ID] = t
		return nil
	})
}

func contains(xs []string, x string) bool {
	for _, y := range xs {
		if y == x {
			return true
		}
	}
	return false
}

// DeleteRouteTable removes a route table.
func (s *Service) DeleteRouteTable(vpcID, rtbID string) error {
	return s.change(vpcID, func(v *core.VPC) error {
		delete(v.RouteTables, rtbID)
		return nil
	})
}

// AllocateInterface creates an ENI's tap on its subnet's bridge.
func (s *Service) AllocateInterface(spec api.InterfaceSpec) (api.InterfaceInfo, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	v, iface, err := s.st.CheckInterface(spec)
	if err != nil {
		return api.InterfaceInfo{}, err
	}
	nv := v.Clone()
	nv.Interfaces[iface.ID] = iface
	if err := s.converge(v, nv, false); err != nil {
		return api.InterfaceInfo{}, err
	}
	if err := s.commit(v, nv); err != nil {
		return api.InterfaceInfo{}, err
	}
	return s.info(nv, iface), nil
}

func (s *Service) info(v *core.VPC, i *core.Interface) api.InterfaceInfo {
	return api.InterfaceInfo{EniID: i.ID, VpcID: v.ID, SubnetID: i.SubnetID, Tap: core.TapName(i.ID), Namespace: v.Namespace(),
		MAC: i.MAC, PrivateIP: i.IP.String(), TapUID: s.cfg.TapOwner.UID, TapGID: s.cfg.TapOwner.GID}
}

// DescribeInterface returns where an ENI's tap is.
func (s *Service) DescribeInterface(eniID string) (api.InterfaceInfo, error) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	v, i, err := s.st.FindInterface(eniID)
	if err != nil {
		return api.InterfaceInfo{}, err
	}
	return s.info(v, i), nil
}

// ReleaseInterface removes an ENI's tap, lease, records, rules and public
// IP. Releasing an unknown ENI succeeds (it is already released).
func (s *Service) ReleaseInterface(eniID string) error {
	s.mu.Lock()
	v, _, err := s.st.FindInterface(eniID)
	s.mu.Unlock()
	if err != nil {
		return nil
	}
	err = s.change(v.ID, func(v *core.VPC) error {
		delete(v.Interfaces, eniID)
		for ip, a := range v.Addresses {
			if a.EniID == eniID {
				delete(v.Addresses, ip)
			}
		}
		return nil
	})
	if err == nil {
		s.mu.Lock()
		delete(s.md, eniID)
		s.mu.Unlock()
	}
	return err
}

// SetInterfaceGroups replaces an ENI's security groups.
func (s *Service) SetInterfaceGroups(eniID string, groups []string) error {
	s.mu.RLock()
	v, _, err := s.st.FindInterface(eniID)
	s.mu.RUnlock()
	if err != nil {
		return err
	}
	return s.change(v.ID, func(v *core.VPC) error {
		g, err := v.CheckInterfaceGroups(groups)
		if err != nil {
			return err
		}
		v.Interfaces[eniID].Groups = g
		return nil
	})
}

// OpenTap opens an ENI's tap for its guest.
func (s *Service) OpenTap(eniID string) (*os.File, error) {
	s.mu.RLock()
	v, _, err := s.st.FindInterface(eniID)
	s.mu.RUnlock()
	if err != nil {
		return nil, err
	}
	return s.k.OpenTap(v.Namespace(), core.TapName(eniID))
}

// SetInstanceMetadata sets what IMDS serves to the instance on an ENI.
func (s *Service) SetInstanceMetadata(eniID string, md api.InstanceMetadata) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, _, err := s.st.FindInterface(eniID); err != nil {
		return err
	}
	switch md.HttpTokens {
	case "", "optional", "required":
	default:
		return invalid("HttpTokens %q is not optional or required", md.HttpTokens)
	}
	if md.HttpPutResponseHopLimit > 64 {
		return invalid("HttpPutResponseHopLimit %d is not 1-64", md.HttpPutResponseHopLimit)
	}
	if md.InstanceID == "" {
		return invalid("instance metadata needs an InstanceID")
	}
	s.md[eniID] = md
	return nil
}

// ClearInstanceMetadata stops IMDS answering for an ENI.
func (s *Service) ClearInstanceMetadata(eniID string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.md, eniID)
	return nil
}

// AssociateAddress maps a public IP to an ENI; an earlier mapping of the
// same public IP (to any ENI) is replaced, as with AllowReassociation.
func (s *Service) AssociateAddress(spec api.AddressSpec) error {
	s.mu.Lock()
	v, a, err := s.st.CheckAddress(spec, s.cfg.PublicPool)
	if err != nil {
		s.mu.Unlock()
		return err
	}
	prev, _ := s.st.FindAddress(a.PublicIP.String())
	s.mu.Unlock()
	if prev != nil && prev.ID != v.ID {
		if err := s.change(prev.ID, func(p *core.VPC) error {
			delete(p.Addresses, a.PublicIP.String())
			return nil
		}); err != nil {
			return err
		}
	}
	return s.change(v.ID, func(v *core.VPC) error {
		v.Addresses[a.PublicIP.String()] = a
		return nil
	})
}

// DisassociateAddress removes a public IP's mapping (none is fine).
func (s *Service) DisassociateAddress(publicIP string) error {
	s.mu.RLock()
	v, _ := s.st.FindAddress(publicIP)
	s.mu.RUnlock()
	if v == nil {
		return nil
	}
	return s.change(v.ID, func(v *core.VPC) error {
		delete(v.Addresses, publicIP)
		return nil
	})
}

// Lease is the DHCP table lookup for one subnet's server.
func (s *Service) Lease(vpcID, subnetID, mac string) (core.Lease, bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	v := s.st.VPCs[vpcID]
	if v == nil {
		return core.Lease{}, false
	}
	return v.Lease(subnetID, mac, s.cfg.Region)
}

// Zone is the DNS table of a VPC, rebuilt after every change.
func (s *Service) Zone(vpcID string) *core.Zone {
	s.mu.RLock()
	z := s.zones[vpcID]
	s.mu.RUnlock()
	if z != nil {
		return z
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	v := s.st.VPCs[vpcID]
	if v == nil {
		return &core.Zone{}
	}
	z = v.Zone(s.cfg.Region)
	s.zones[vpcID] = z
	return z
}

// Instance identifies an IMDS caller by its address in a VPC.
func (s *Service) Instance(vpcID string, ip netip.Addr) (api.InstanceMetadata, core.NetInfo, bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	v := s.st.VPCs[vpcID]
	if v == nil {
		return api.InstanceMetadata{}, core.NetInfo{}, false
	}
	i := v.InterfaceByIP(ip)
	if i == nil {
		return api.InstanceMetadata{}, core.NetInfo{}, false
	}
	md, ok := s.md[i.ID]
	if !ok {
		return md, core.NetInfo{}, false
	}
	n := core.NetInfo{EniID: i.ID, MAC: i.MAC, IP: i.IP, SubnetID: i.SubnetID, SubnetCIDR: v.Subnets[i.SubnetID].CIDR,
		VpcID: v.ID, VPCCIDR: v.CIDR, GroupIDs: i.Groups, Domain: core.Domain(s.cfg.Region)}
	for _, a := range v.Addresses {
		if a.EniID == i.ID {
			n.PublicIP = a.PublicIP.String()
		}
	}
	return md, n, true
}

// VPCView is a VPC as its bus object shows it.
type VPCView struct {
	ID, Namespace, CIDR, IGW string
	Subnets, Interfaces      map[string]string
	Addresses                map[string]string
}

// View returns a VPC's bus view, or false when it is not held.
func (s *Service) View(vpcID string) (VPCView, bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	v := s.st.VPCs[vpcID]
	if v == nil {
		return VPCView{}, false
	}
	view := VPCView{ID: v.ID, Namespace: v.Namespace(), CIDR: v.CIDR.String(), IGW: v.IGW,
		Subnets: map[string]string{}, Interfaces: map[string]string{}, Addresses: map[string]string{}}
	for id := range v.Subnets {
		view.Subnets[id] = core.BridgeName(id)
	}
	for id := range v.Interfaces {
		view.Interfaces[id] = core.TapName(id)
	}
	for ip, a := range v.Addresses {
		view.Addresses[ip] = a.PrivateIP.String()
	}
	return view, true
}

// Counts is what Status reports.
func (s *Service) Counts() map[string]uint32 {
	s.mu.RLock()
	defer s.mu.RUnlock()
	c := map[string]uint32{"vpc": uint32(len(s.st.VPCs))}
	for _, v := range s.st.VPCs {
		c["subnet"] += uint32(len(v.Subnets))
		c["interface"] += uint32(len(v.Interfaces))
		c["sg"] += uint32(len(v.Groups))
		c["address"] += uint32(len(v.Addresses))
	}
	c["metadata"] = uint32(len(s.md))
	return c
}

// Problems lists VPCs whose servers are not running, in words.
func (s *Service) Problems() []string {
	s.mu.RLock()
	defer s.mu.RUnlock()
	var out []string
	for _, id := range core.SortedIDs(s.st.VPCs) {
		r := s.rt[id]
		if r == nil || r.servers == nil {
			out = append(out, fmt.Sprintf("%s: DNS and IMDS are not running", id))
		}
	}
	sort.Strings(out)
	return out
}
