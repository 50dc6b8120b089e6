package ec2

import (
	"context"
	"net/netip"
	"sort"

	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"

	"hangar.dev/hangar/services/gateway/awserr"
	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/internal/store"
)

// Elastic IPs are addresses of PUBLIC_IP_POOL (LAN addresses) held by the
// account. Associated with a network interface, hangar-netd answers ARP
// for the address on the host's uplink and NATs it 1:1 to the interface's
// private address; the association reaches netd with the VPC's state
// (vpcStateHooks below), since every change to an eipalloc record marks
// its VPC for a push.

var kindAddress = register(&kind{Prefix: "eipalloc", ResourceType: types.ResourceTypeElasticIp, NotFound: "InvalidAllocationID.NotFound", Malformed: "InvalidAllocationID.Malformed", Noun: "allocation ID"})

// addressRecord is an Elastic IP as stored: the API's view plus the VPC
// of its association, which tells the push which VPC it belongs to.
type addressRecord struct {
	types.Address
	NetworkVpcID string
}

// networkInterfaceRef is what an association needs of a network interface
// record (stored in the "eni" bucket in the SDK's NetworkInterface shape).
type networkInterfaceRef struct {
	NetworkInterfaceId *string
	PrivateIpAddress   *string
	VpcId              *string
	OwnerId            *string
	Attachment         *struct {
		InstanceId  *string
		DeviceIndex *int32
	}
	PrivateIpAddresses []struct {
		PrivateIpAddress *string
	}
}

const bucketInterfaces = "eni"

func init() {
	vpcStateHooks = append(vpcStateHooks, func(tx *store.Tx, vpcID string, st *api.VPCState) error {
		addrs, err := all(tx, kindAddress, func(_ string, a *addressRecord) bool {
			return a.NetworkVpcID == vpcID && a.NetworkInterfaceId != nil
		})
		if err != nil {
			return err
		}
		for _, id := range sortedKeys(addrs) {
			a := addrs[id]
			// Only an association whose interface still exists: netd
			// refuses a VPC whose addresses name unknown interfaces.
			if !tx.Has(bucketInterfaces, *a.NetworkInterfaceId) {
				continue
			}
			st.Addresses = append(st.Addresses, api.AddressSpec{PublicIP: deref(a.PublicIp), EniID: *a.NetworkInterfaceId, PrivateIP: deref(a.PrivateIpAddress)})
		}
		return nil
	})
}

// view renders a record as DescribeAddresses shows it.
func (a *addressRecord) view(tags []types.Tag) types.Address {
	out := a.Address
	out.Tags = tags
	return out
}

// poolContains reports whether ip is in PUBLIC_IP_POOL. Every address
// of each CIDR is usable: the pool is a range of the LAN, not a subnet of
// its own.
func (s *Service) poolContains(ip netip.Addr) bool {
	for _, p := range s.cfg.PublicIPPool {
		if p.Contains(ip) {
			return true
		}
	}
	return false
}

// freeAddress returns the lowest pool address no Elastic IP holds.
func (s *Service) freeAddress(tx *store.Tx) (netip.Addr, error) {
	used, err := s.usedAddresses(tx)
	if err != nil {
		return netip.Addr{}, err
	}
	pools := append([]netip.Prefix(nil), s.cfg.PublicIPPool...)
	sort.Slice(pools, func(i, j int) bool { return pools[i].Addr().Less(pools[j].Addr()) })
	for _, p := range pools {
		for a := p.Masked().Addr(); a.IsValid() && p.Contains(a); a = a.Next() {
			if !used[a] {
				return a, nil
			}
		}
	}
	if len(pools) == 0 {
		return netip.Addr{}, awserr.New(400, "AddressLimitExceeded", "The maximum number of addresses has been reached. (This host has no PUBLIC_IP_POOL.)")
	}
	return netip.Addr{}, awserr.New(400, "AddressLimitExceeded", "The maximum number of addresses has been reached. (PUBLIC_IP_POOL %s is all allocated.)", prefixes(s.cfg.PublicIPPool))
}

func (s *Service) usedAddresses(tx *store.Tx) (map[netip.Addr]bool, error) {
	recs, err := all[addressRecord](tx, kindAddress, nil)
	if err != nil {
		return nil, err
	}
	used := map[netip.Addr]bool{}
	for _, r := range recs {
		if a, err := netip.ParseAddr(deref(r.PublicIp)); err == nil {
			used[a] = true
		}
	}
	return used, nil
}

// AllocateAddress takes an address of PUBLIC_IP_POOL for the account: the
// one asked for (Address), or the lowest free one.
func (s *Service) AllocateAddress(ctx context.Context, in *ec2.AllocateAddressInput) (*ec2.AllocateAddressOutput, error) {
	if in.Domain != "" && in.Domain != types.DomainTypeVpc {
		return nil, awserr.InvalidParameterValue("Value (%s) for parameter domain is invalid. EC2-Classic addresses do not exist; use vpc.", in.Domain)
	}
	if p := deref(in.PublicIpv4Pool); p != "" && p != "amazon" {
		return nil, awserr.New(400, "InvalidPublicIpv4PoolID.NotFound", "The public IPv4 pool '%s' does not exist", clip(p))
	}
	if in.CustomerOwnedIpv4Pool != nil || in.IpamPoolId != nil {
		return nil, awserr.InvalidParameterValue("Customer-owned and IPAM pools are not supported by hangar; addresses come from PUBLIC_IP_POOL")
	}
	if nbg := deref(in.NetworkBorderGroup); nbg != "" && nbg != s.cfg.Region {
		return nil, awserr.InvalidParameterValue("The network border group %s is not valid in %s", clip(nbg), s.cfg.Region)
	}
	tags, err := tagSpecs(in.TagSpecifications, types.ResourceTypeElasticIp)
	if err != nil {
		return nil, err
	}
	var out *addressRecord
	err = s.db.Update(func(tx *store.Tx) error {
		var ip netip.Addr
		if want := deref(in.Address); want != "" {
			a, err := netip.ParseAddr(want)
			if err != nil || !a.Is4() {
				return awserr.InvalidParameterValue("Value (%s) for parameter address is invalid.", clip(want))
			}
			if !s.poolContains(a) {
				return awserr.New(400, "InvalidAddress.NotFound", "Address %s is not in this host's PUBLIC_IP_POOL (%s)", a, prefixes(s.cfg.PublicIPPool))
			}
			used, err := s.usedAddresses(tx)
			if err != nil {
				return err
			}
			if used[a] {
				return awserr.New(400, "InvalidAddress.InUse", "Address %s is already allocated", a)
			}
			ip = a
		} else {
			a, err := s.freeAddress(tx)
			if err != nil {
				return err
			}
			ip = a
		}
		id, err := newID(tx, kindAddress.Prefix)
		if err != nil {
			return err
		}
		out = &addressRecord{Address: types.Address{
			AllocationId:       ptr(id),
			PublicIp:           ptr(ip.String()),
			Domain:             types.DomainTypeVpc,
			PublicIpv4Pool:     ptr("amazon"),
			NetworkBorderGroup: ptr(s.cfg.Region),
		}}
		if err := put(tx, kindAddress, id, out); err != nil {
			return err
		}
		if len(tags) > 0 {
			return addTags(tx, id, tags)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return &ec2.AllocateAddressOutput{
		AllocationId:       out.AllocationId,
		PublicIp:           out.PublicIp,
		Domain:             out.Domain,
		PublicIpv4Pool:     out.PublicIpv4Pool,
		NetworkBorderGroup: out.NetworkBorderGroup,
	}, nil
}

// addressBy finds an Elastic IP by allocation id or public IP.
func addressBy(tx *store.Tx, allocationID, publicIP *string) (string, *addressRecord, error) {
	if id := deref(allocationID); id != "" {
		a, err := get[addressRecord](tx, kindAddress, id)
		return id, a, err
	}
	ip := deref(publicIP)
	if ip == "" {
		return "", nil, awserr.MissingParameter("AllocationId")
	}
	recs, err := all(tx, kindAddress, func(_ string, a *addressRecord) bool { return deref(a.PublicIp) == ip })
	if err != nil {
		return "", nil, err
	}
	for id, a := range recs {
		return id, a, nil
	}
	return "", nil, awserr.New(400, "InvalidAddress.NotFound", "Address '%s' not found.", clip(ip))
}

// interfaceFor resolves an association's target: a network interface, or
// an instance's primary interface (device index 0).
func interfaceFor(tx *store.Tx, instanceID, eniID string) (*networkInterfaceRef, error) {
	if eniID != "" {
		var ref networkInterfaceRef
		if err := tx.Get(bucketInterfaces, eniID, &ref); err != nil {
			return nil, awserr.New(400, "InvalidNetworkInterfaceID.NotFound", "The networkInterface ID '%s' does not exist", clip(eniID))
		}
		if ref.NetworkInterfaceId == nil {
			ref.NetworkInterfaceId = ptr(eniID)
		}
		return &ref, nil
	}
	var found *networkInterfaceRef
	err := tx.Each(bucketInterfaces, "", func(id string, decode func(any) error) (bool, error) {
		var ref networkInterfaceRef
		if err := decode(&ref); err != nil {
			return false, err
		}
		if ref.Attachment != nil && deref(ref.Attachment.InstanceId) == instanceID && deref(ref.Attachment.DeviceIndex) == 0 {
			if ref.NetworkInterfaceId == nil {
				ref.NetworkInterfaceId = ptr(id)
			}
			found = &ref
			return false, nil
		}
		return true, nil
	})
	if err != nil {
		return nil, err
	}
	if found == nil {
		return nil, awserr.New(400, "InvalidInstanceID.NotFound", "The instance ID '%s' does not exist", clip(instanceID))
	}
	return found, nil
}

// AssociateAddress maps an Elastic IP to an instance's primary interface
// or to a network interface (and one of its private addresses).
func (s *Service) AssociateAddress(ctx context.Context, in *ec2.AssociateAddressInput) (*ec2.AssociateAddressOutput, error) {
	instanceID, eniID := deref(in.InstanceId), deref(in.NetworkInterfaceId)
	if instanceID == "" && eniID == "" {
		return nil, awserr.MissingParameter("InstanceId or NetworkInterfaceId")
	}
	if instanceID != "" && eniID != "" {
		return nil, awserr.InvalidParameterCombination("Specify InstanceId or NetworkInterfaceId, not both")
	}
	var assoc string
	err := s.db.Update(func(tx *store.Tx) error {
		id, a, err := addressBy(tx, in.AllocationId, in.PublicIp)
		if err != nil {
			return err
		}
		ni, err := interfaceFor(tx, instanceID, eniID)
		if err != nil {
			return err
		}
		priv := deref(ni.PrivateIpAddress)
		if want := deref(in.PrivateIpAddress); want != "" {
			ok := want == priv
			for _, p := range ni.PrivateIpAddresses {
				ok = ok || deref(p.PrivateIpAddress) == want
			}
			if !ok {
				return awserr.InvalidParameterValue("The private IP address %s is not assigned to %s", clip(want), *ni.NetworkInterfaceId)
			}
			priv = want
		}
		same := deref(a.NetworkInterfaceId) == *ni.NetworkInterfaceId && deref(a.PrivateIpAddress) == priv
		if a.AssociationId != nil && !same && !deref(in.AllowReassociation) {
			return awserr.New(400, "Resource.AlreadyAssociated", "resource %s is already associated with associate-id %s", id, *a.AssociationId)
		}
		// One Elastic IP per private address: another one there moves off.
		others, err := all(tx, kindAddress, func(oid string, o *addressRecord) bool {
			return oid != id && deref(o.NetworkInterfaceId) == *ni.NetworkInterfaceId && deref(o.PrivateIpAddress) == priv
		})
		if err != nil {
			return err
		}
		for oid, o := range others {
			if !deref(in.AllowReassociation) {
				return awserr.New(400, "Resource.AlreadyAssociated", "the private IP address %s already has Elastic IP %s", priv, deref(o.PublicIp))
			}
			o.disassociate()
			if err := put(tx, kindAddress, oid, o); err != nil {
				return err
			}
		}
		if same && a.AssociationId != nil {
			assoc = *a.AssociationId
			return nil
		}
		if assoc, err = newID(tx, "eipassoc"); err != nil {
			return err
		}
		a.AssociationId = ptr(assoc)
		a.NetworkInterfaceId = ni.NetworkInterfaceId
		a.NetworkInterfaceOwnerId = ni.OwnerId
		if a.NetworkInterfaceOwnerId == nil {
			a.NetworkInterfaceOwnerId = ptr(s.account())
		}
		a.PrivateIpAddress = ptr(priv)
		a.InstanceId = nil
		if ni.Attachment != nil && ni.Attachment.InstanceId != nil {
			a.InstanceId = ni.Attachment.InstanceId
		}
		a.NetworkVpcID = deref(ni.VpcId)
		return put(tx, kindAddress, id, a)
	})
	if err != nil {
		return nil, err
	}
	return &ec2.AssociateAddressOutput{AssociationId: ptr(assoc)}, nil
}

func (a *addressRecord) disassociate() {
	a.AssociationId, a.InstanceId, a.NetworkInterfaceId, a.NetworkInterfaceOwnerId, a.PrivateIpAddress = nil, nil, nil, nil, nil
	a.NetworkVpcID = ""
}

// DisassociateAddress removes an Elastic IP's association (by association
// id, or by public IP).
func (s *Service) DisassociateAddress(ctx context.Context, in *ec2.DisassociateAddressInput) (*ec2.DisassociateAddressOutput, error) {
	assoc, ip := deref(in.AssociationId), deref(in.PublicIp)
	if assoc == "" && ip == "" {
		return nil, awserr.MissingParameter("AssociationId")
	}
	err := s.db.Update(func(tx *store.Tx) error {
		recs, err := all(tx, kindAddress, func(_ string, a *addressRecord) bool {
			if assoc != "" {
				return deref(a.AssociationId) == assoc
			}
			return deref(a.PublicIp) == ip
		})
		if err != nil {
			return err
		}
		for id, a := range recs {
			if a.AssociationId == nil {
				// AWS treats disassociating an unassociated address as done.
				return nil
			}
			a.disassociate()
			return put(tx, kindAddress, id, a)
		}
		if assoc != "" {
			return awserr.New(400, "InvalidAssociationID.NotFound", "The association ID '%s' does not exist", clip(assoc))
		}
		return awserr.New(400, "InvalidAddress.NotFound", "Address '%s' not found.", clip(ip))
	})
	if err != nil {
		return nil, err
	}
	return &ec2.DisassociateAddressOutput{}, nil
}

// ReleaseAddress gives an unassociated Elastic IP back to the pool.
func (s *Service) ReleaseAddress(ctx context.Context, in *ec2.ReleaseAddressInput) (*ec2.ReleaseAddressOutput, error) {
	if nbg := deref(in.NetworkBorderGroup); nbg != "" && nbg != s.cfg.Region {
		return nil, awserr.InvalidParameterValue("The network border group %s is not valid in %s", clip(nbg), s.cfg.Region)
	}
	err := s.db.Update(func(tx *store.Tx) error {
		id, a, err := addressBy(tx, in.AllocationId, in.PublicIp)
		if err != nil {
			return err
		}
		if a.AssociationId != nil {
			return awserr.New(400, "InvalidIPAddress.InUse", "Address %s (%s) is in use by %s; disassociate it first", deref(a.PublicIp), id, *a.AssociationId)
		}
		return remove(tx, kindAddress, id)
	})
	if err != nil {
		return nil, err
	}
	return &ec2.ReleaseAddressOutput{}, nil
}

var addressFilters = filterSet[addressRecord]{
	"allocation-id":              func(a *addressRecord) []string { return []string{deref(a.AllocationId)} },
	"association-id":             func(a *addressRecord) []string { return []string{deref(a.AssociationId)} },
	"domain":                     func(a *addressRecord) []string { return []string{string(a.Domain)} },
	"instance-id":                func(a *addressRecord) []string { return []string{deref(a.InstanceId)} },
	"network-border-group":       func(a *addressRecord) []string { return []string{deref(a.NetworkBorderGroup)} },
	"network-interface-id":       func(a *addressRecord) []string { return []string{deref(a.NetworkInterfaceId)} },
	"network-interface-owner-id": func(a *addressRecord) []string { return []string{deref(a.NetworkInterfaceOwnerId)} },
	"private-ip-address":         func(a *addressRecord) []string { return []string{deref(a.PrivateIpAddress)} },
	"public-ip":                  func(a *addressRecord) []string { return []string{deref(a.PublicIp)} },
	"public-ipv4-pool":           func(a *addressRecord) []string { return []string{deref(a.PublicIpv4Pool)} },
}

// DescribeAddresses lists the account's Elastic IPs. DescribeAddresses
// has no paging in EC2.
func (s *Service) DescribeAddresses(ctx context.Context, in *ec2.DescribeAddressesInput) (*ec2.DescribeAddressesOutput, error) {
	match, err := addressFilters.compile(in.Filters)
	if err != nil {
		return nil, err
	}
	out := &ec2.DescribeAddressesOutput{Addresses: []types.Address{}}
	err = s.db.View(func(tx *store.Tx) error {
		byIP := map[string]bool{}
		for _, ip := range in.PublicIps {
			byIP[ip] = true
		}
		if len(byIP) > 0 {
			found := map[string]bool{}
			err := tx.Each(kindAddress.Prefix, "", func(id string, decode func(any) error) (bool, error) {
				var a addressRecord
				if err := decode(&a); err != nil {
					return false, err
				}
				found[deref(a.PublicIp)] = true
				return true, nil
			})
			if err != nil {
				return err
			}
			for _, ip := range in.PublicIps {
				if !found[ip] {
					return awserr.New(400, "InvalidAddress.NotFound", "Address '%s' not found.", clip(ip))
				}
			}
		}
		_, err := list(tx, kindAddress, in.AllocationIds, match, pager{}, func(_ string, a *addressRecord, tags []types.Tag) {
			if len(byIP) == 0 || byIP[deref(a.PublicIp)] {
				out.Addresses = append(out.Addresses, a.view(tags))
			}
		})
		return err
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}
