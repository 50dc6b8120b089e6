package ec2

import (
	"context"
	"crypto/rand"
	"fmt"
	"net/netip"
	"strings"

	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"

	"hangar.dev/hangar/services/gateway/awserr"
	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/internal/store"
)

var kindENI = register(&kind{Prefix: bucketInterfaces, ResourceType: types.ResourceTypeNetworkInterface, NotFound: "InvalidNetworkInterfaceID.NotFound", Malformed: "InvalidNetworkInterfaceId.Malformed", Noun: "networkInterface ID"})

// eniRecord is a network interface as stored, in the SDK's shape (eip.go
// reads the same record through networkInterfaceRef). hangar makes one per
// instance, at launch, and deletes it at termination, as EC2 does for the
// primary interface.
type eniRecord struct {
	types.NetworkInterface
}

// privateDNSName is EC2's name for a private address: ip-10-0-1-5.ec2.internal
// in us-east-1, ip-10-0-1-5.<region>.compute.internal elsewhere.
func privateDNSName(ip, region string) string {
	host := "ip-" + strings.ReplaceAll(ip, ".", "-")
	if region == "us-east-1" {
		return host + ".ec2.internal"
	}
	return host + "." + region + ".compute.internal"
}

// newMAC makes a locally administered unicast MAC no interface has. EC2's
// look like 0e:…, 12:…; hangar's start with 02.
func newMAC(tx *store.Tx) (string, error) {
	used := map[string]bool{}
	err := tx.Each(kindENI.Prefix, "", func(_ string, decode func(any) error) (bool, error) {
		var r eniRecord
		if err := decode(&r); err != nil {
			return false, err
		}
		used[deref(r.MacAddress)] = true
		return true, nil
	})
	if err != nil {
		return "", err
	}
	for {
		var b [5]byte
		if _, err := rand.Read(b[:]); err != nil {
			return "", err
		}
		mac := fmt.Sprintf("02:%02x:%02x:%02x:%02x:%02x", b[0], b[1], b[2], b[3], b[4])
		if !used[mac] {
			return mac, nil
		}
	}
}

// usedAddresses are the private addresses interfaces hold in a subnet.
func usedAddresses(tx *store.Tx, subnetID string) (map[netip.Addr]bool, error) {
	used := map[netip.Addr]bool{}
	err := tx.Each(kindENI.Prefix, "", func(_ string, decode func(any) error) (bool, error) {
		var r eniRecord
		if err := decode(&r); err != nil {
			return false, err
		}
		if deref(r.SubnetId) != subnetID {
			return true, nil
		}
		for _, a := range r.PrivateIpAddresses {
			if ip, err := netip.ParseAddr(deref(a.PrivateIpAddress)); err == nil {
				used[ip] = true
			}
		}
		return true, nil
	})
	return used, err
}

// reserved reports AWS's five reserved addresses of a subnet: the network
// address, the router (.1), DNS (.2), future use (.3) and broadcast.
func reserved(p netip.Prefix, ip netip.Addr) bool {
	base := p.Masked().Addr()
	for i := 0; i < 4; i++ {
		if ip == base {
			return true
		}
		base = base.Next()
	}
	return ip == lastAddr(p)
}

func lastAddr(p netip.Prefix) netip.Addr {
	a := p.Masked().Addr().As4()
	n := uint32(a[0])<<24 | uint32(a[1])<<16 | uint32(a[2])<<8 | uint32(a[3])
	n |= (1 << (32 - p.Bits())) - 1
	return netip.AddrFrom4([4]byte{byte(n >> 24), byte(n >> 16), byte(n >> 8), byte(n)})
}

// allocateAddress picks want (checked) or the lowest free address of the
// subnet, as EC2 assigns a private address at launch.
func allocateAddress(tx *store.Tx, sn *subnetRecord, want string) (netip.Addr, error) {
	p := netip.MustParsePrefix(*sn.CidrBlock)
	used, err := usedAddresses(tx, *sn.SubnetId)
	if err != nil {
		return netip.Addr{}, err
	}
	if want != "" {
		ip, err := netip.ParseAddr(want)
		if err != nil || !ip.Is4() {
			return ip, awserr.InvalidParameterValue("Invalid value '%s' for IP address", clip(want))
		}
		if !p.Contains(ip) {
			return ip, awserr.InvalidParameterValue("Address %s does not fall within the subnet's address range", ip)
		}
		if reserved(p, ip) {
			return ip, awserr.InvalidParameterValue("Address %s is in subnet's reserved address range", ip)
		}
		if used[ip] {
			return ip, awserr.New(400, "InvalidIPAddress.InUse", "Address %s is in use.", ip)
		}
		return ip, nil
	}
	for ip := p.Masked().Addr(); p.Contains(ip); ip = ip.Next() {
		if !reserved(p, ip) && !used[ip] {
			return ip, nil
		}
	}
	return netip.Addr{}, awserr.New(400, "InsufficientFreeAddressesInSubnet", "There are not enough free addresses in subnet '%s' to satisfy the requested number of instances.", *sn.SubnetId)
}

// createENI writes an instance's primary interface and counts its address
// against the subnet.
func (s *Service) createENI(tx *store.Tx, sn *subnetRecord, instanceID string, groups []types.GroupIdentifier, ip netip.Addr, deleteOnTermination bool) (*eniRecord, error) {
	id, err := newID(tx, kindENI.Prefix)
	if err != nil {
		return nil, err
	}
	attach, err := newID(tx, "eni-attach")
	if err != nil {
		return nil, err
	}
	mac, err := newMAC(tx)
	if err != nil {
		return nil, err
	}
	now := s.now().UTC()
	dns := privateDNSName(ip.String(), s.cfg.Region)
	r := &eniRecord{types.NetworkInterface{
		NetworkInterfaceId: ptr(id),
		SubnetId:           sn.SubnetId,
		VpcId:              sn.VpcId,
		AvailabilityZone:   sn.AvailabilityZone,
		Description:        ptr(""),
		Groups:             groups,
		InterfaceType:      types.NetworkInterfaceTypeInterface,
		MacAddress:         ptr(mac),
		OwnerId:            ptr(s.account()),
		PrivateDnsName:     ptr(dns),
		PrivateIpAddress:   ptr(ip.String()),
		PrivateIpAddresses: []types.NetworkInterfacePrivateIpAddress{{Primary: ptr(true), PrivateIpAddress: ptr(ip.String()), PrivateDnsName: ptr(dns)}},
		RequesterManaged:   ptr(false),
		SourceDestCheck:    ptr(true),
		Status:             types.NetworkInterfaceStatusInUse,
		Ipv6Addresses:      []types.NetworkInterfaceIpv6Address{},
		Attachment: &types.NetworkInterfaceAttachment{
			AttachmentId:        ptr(attach),
			AttachTime:          &now,
			DeleteOnTermination: ptr(deleteOnTermination),
			DeviceIndex:         ptr(int32(0)),
			NetworkCardIndex:    ptr(int32(0)),
			InstanceId:          ptr(instanceID),
			InstanceOwnerId:     ptr(s.account()),
			Status:              types.AttachmentStatusAttached,
		},
	}}
	if err := put(tx, kindENI, id, r); err != nil {
		return nil, err
	}
	sn.Used++
	return r, put(tx, kindSubnet, *sn.SubnetId, sn)
}

// deleteENI removes an interface and gives its address back to the subnet.
func deleteENI(tx *store.Tx, id string) error {
	r, err := get[eniRecord](tx, kindENI, id)
	if err != nil {
		return nil // gone already
	}
	if sn, err := get[subnetRecord](tx, kindSubnet, deref(r.SubnetId)); err == nil && sn.Used > 0 {
		sn.Used--
		if err := put(tx, kindSubnet, *sn.SubnetId, sn); err != nil {
			return err
		}
	}
	return remove(tx, kindENI, id)
}

// instanceENIs returns an instance's interfaces, primary first.
func instanceENIs(tx *store.Tx, instanceID string) ([]*eniRecord, error) {
	m, err := all(tx, kindENI, func(_ string, r *eniRecord) bool {
		return r.Attachment != nil && deref(r.Attachment.InstanceId) == instanceID
	})
	if err != nil {
		return nil, err
	}
	out := make([]*eniRecord, 0, len(m))
	for _, id := range sortedKeys(m) {
		out = append(out, m[id])
	}
	for i := range out {
		if deref(out[i].Attachment.DeviceIndex) == 0 && i != 0 {
			out[0], out[i] = out[i], out[0]
		}
	}
	return out, nil
}

func groupIDs(gs []types.GroupIdentifier) []string {
	out := make([]string, len(gs))
	for i, g := range gs {
		out[i] = deref(g.GroupId)
	}
	return out
}

func (r *eniRecord) spec() api.InterfaceSpec {
	return api.InterfaceSpec{
		VpcID:            deref(r.VpcId),
		SubnetID:         deref(r.SubnetId),
		EniID:            deref(r.NetworkInterfaceId),
		MAC:              deref(r.MacAddress),
		PrivateIP:        deref(r.PrivateIpAddress),
		SecurityGroupIDs: groupIDs(r.Groups),
	}
}

func init() {
	// Interfaces are part of their VPC's network state.
	vpcStateHooks = append(vpcStateHooks, func(tx *store.Tx, vpcID string, st *api.VPCState) error {
		enis, err := all(tx, kindENI, func(_ string, r *eniRecord) bool { return deref(r.VpcId) == vpcID })
		if err != nil {
			return err
		}
		for _, id := range sortedKeys(enis) {
			st.Interfaces = append(st.Interfaces, enis[id].spec())
		}
		return nil
	})
	// A subnet, or a group, with interfaces cannot go.
	subnetDependents = append(subnetDependents, func(tx *store.Tx, sn *subnetRecord) (string, error) {
		found := ""
		_, err := exists(tx, kindENI, func(id string, r *eniRecord) bool {
			if deref(r.SubnetId) == *sn.SubnetId {
				found = id
				return true
			}
			return false
		})
		return found, err
	})
	sgDependents = append(sgDependents, func(tx *store.Tx, g *securityGroupRecord) (string, error) {
		found := ""
		_, err := exists(tx, kindENI, func(id string, r *eniRecord) bool {
			for _, gi := range r.Groups {
				if deref(gi.GroupId) == g.GroupID {
					found = id
					return true
				}
			}
			return false
		})
		return found, err
	})
}

var eniFilters = filterSet[eniRecord]{
	"addresses.private-ip-address": func(r *eniRecord) []string {
		var out []string
		for _, a := range r.PrivateIpAddresses {
			out = append(out, deref(a.PrivateIpAddress))
		}
		return out
	},
	"attachment.attachment-id": func(r *eniRecord) []string {
		return attachValue(r, func(a *types.NetworkInterfaceAttachment) string { return deref(a.AttachmentId) })
	},
	"attachment.instance-id": func(r *eniRecord) []string {
		return attachValue(r, func(a *types.NetworkInterfaceAttachment) string { return deref(a.InstanceId) })
	},
	"attachment.instance-owner-id": func(r *eniRecord) []string {
		return attachValue(r, func(a *types.NetworkInterfaceAttachment) string { return deref(a.InstanceOwnerId) })
	},
	"attachment.device-index": func(r *eniRecord) []string {
		return attachValue(r, func(a *types.NetworkInterfaceAttachment) string { return fmt.Sprint(deref(a.DeviceIndex)) })
	},
	"attachment.status": func(r *eniRecord) []string {
		return attachValue(r, func(a *types.NetworkInterfaceAttachment) string { return string(a.Status) })
	},
	"attachment.delete-on-termination": func(r *eniRecord) []string {
		return attachValue(r, func(a *types.NetworkInterfaceAttachment) string { return boolString(deref(a.DeleteOnTermination)) })
	},
	"availability-zone": func(r *eniRecord) []string { return []string{deref(r.AvailabilityZone)} },
	"description":       func(r *eniRecord) []string { return []string{deref(r.Description)} },
	"group-id":          func(r *eniRecord) []string { return groupIDs(r.Groups) },
	"group-name": func(r *eniRecord) []string {
		var out []string
		for _, g := range r.Groups {
			out = append(out, deref(g.GroupName))
		}
		return out
	},
	"interface-type":       func(r *eniRecord) []string { return []string{string(r.InterfaceType)} },
	"mac-address":          func(r *eniRecord) []string { return []string{deref(r.MacAddress)} },
	"network-interface-id": func(r *eniRecord) []string { return []string{deref(r.NetworkInterfaceId)} },
	"owner-id":             func(r *eniRecord) []string { return []string{deref(r.OwnerId)} },
	"private-dns-name":     func(r *eniRecord) []string { return []string{deref(r.PrivateDnsName)} },
	"private-ip-address":   func(r *eniRecord) []string { return []string{deref(r.PrivateIpAddress)} },
	"requester-managed":    func(r *eniRecord) []string { return []string{boolString(deref(r.RequesterManaged))} },
	"source-dest-check":    func(r *eniRecord) []string { return []string{boolString(deref(r.SourceDestCheck))} },
	"status":               func(r *eniRecord) []string { return []string{string(r.Status)} },
	"subnet-id":            func(r *eniRecord) []string { return []string{deref(r.SubnetId)} },
	"vpc-id":               func(r *eniRecord) []string { return []string{deref(r.VpcId)} },
}

func attachValue(r *eniRecord, get func(*types.NetworkInterfaceAttachment) string) []string {
	if r.Attachment == nil {
		return nil
	}
	return []string{get(r.Attachment)}
}

// DescribeNetworkInterfaces lists interfaces, with their public address
// when an Elastic IP is associated.
func (s *Service) DescribeNetworkInterfaces(ctx context.Context, in *ec2.DescribeNetworkInterfacesInput) (*ec2.DescribeNetworkInterfacesOutput, error) {
	match, err := eniFilters.compile(in.Filters)
	if err != nil {
		return nil, err
	}
	p, err := newPager(in.MaxResults, in.NextToken, 5, 1000)
	if err != nil {
		return nil, err
	}
	out := &ec2.DescribeNetworkInterfacesOutput{NetworkInterfaces: []types.NetworkInterface{}}
	err = s.db.View(func(tx *store.Tx) error {
		addrs, err := addressesByENI(tx)
		if err != nil {
			return err
		}
		next, err := list(tx, kindENI, in.NetworkInterfaceIds, match, p, func(_ string, r *eniRecord, tags []types.Tag) {
			v := r.NetworkInterface
			v.TagSet = tags
			if a, ok := addrs[deref(r.NetworkInterfaceId)]; ok {
				assoc := &types.NetworkInterfaceAssociation{PublicIp: a.PublicIp, AllocationId: a.AllocationId, AssociationId: a.AssociationId, IpOwnerId: ptr(s.account()), PublicDnsName: ptr("")}
				v.Association = assoc
				for i := range v.PrivateIpAddresses {
					if deref(v.PrivateIpAddresses[i].PrivateIpAddress) == deref(a.PrivateIpAddress) {
						v.PrivateIpAddresses[i].Association = assoc
					}
				}
			}
			out.NetworkInterfaces = append(out.NetworkInterfaces, v)
		})
		out.NextToken = next
		return err
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// addressesByENI maps interface ids to the Elastic IPs associated with them.
func addressesByENI(tx *store.Tx) (map[string]*addressRecord, error) {
	recs, err := all(tx, kindAddress, func(_ string, a *addressRecord) bool { return a.NetworkInterfaceId != nil })
	if err != nil {
		return nil, err
	}
	out := map[string]*addressRecord{}
	for _, a := range recs {
		out[*a.NetworkInterfaceId] = a
	}
	return out, nil
}
