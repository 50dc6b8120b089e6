package api

import (
	"context"
	"fmt"
	"os"
	"strings"

	"github.com/godbus/dbus/v5"
)

// dev.hangar.Network1: hangar-netd turns the gateway's VPC records into
// kernel state (a network namespace per VPC, a bridge per subnet, a tap per
// interface, nftables rules per security group) and serves DHCP, DNS and
// instance metadata inside each VPC.
//
// Every method is idempotent and keyed by the AWS id the gateway chose: a
// retried call converges, it never duplicates. The gateway is the source of
// truth; after netd's NameOwnerChanged (or its own start) it pushes each VPC
// whole with SyncVPC and removes the VPCs ListVPCs names that it no longer
// has.

// Network methods, on api.Network's root object.
const (
	NetEnsureVPC              = "EnsureVPC"             // (VPCSpec) → ()
	NetDeleteVPC              = "DeleteVPC"             // (vpcID) → (); InUse while interfaces exist
	NetSyncVPC                = "SyncVPC"               // (VPCState) → (); makes the VPC exactly this
	NetListVPCs               = "ListVPCs"              // () → ([]vpcID)
	NetEnsureSubnet           = "EnsureSubnet"          // (vpcID, SubnetSpec) → ()
	NetDeleteSubnet           = "DeleteSubnet"          // (vpcID, subnetID) → (); InUse while interfaces exist
	NetSetSecurityGroup       = "SetSecurityGroup"      // (vpcID, SecurityGroupSpec) → ()
	NetDeleteSecurityGroup    = "DeleteSecurityGroup"   // (vpcID, sgID) → (); InUse while an interface or rule uses it
	NetSetInternetGateway     = "SetInternetGateway"    // (vpcID, igwID) → (); "" detaches
	NetSetRouteTable          = "SetRouteTable"         // (vpcID, RouteTableSpec) → ()
	NetDeleteRouteTable       = "DeleteRouteTable"      // (vpcID, rtbID) → ()
	NetAllocateInterface      = "AllocateInterface"     // (InterfaceSpec) → (InterfaceInfo)
	NetReleaseInterface       = "ReleaseInterface"      // (eniID) → ()
	NetSetInterfaceGroups     = "SetInterfaceGroups"    // (eniID, []sgID) → ()
	NetOpenTap                = "OpenTap"               // (eniID) → (fd): the tap opened in its namespace
	NetSetInstanceMetadata    = "SetInstanceMetadata"   // (eniID, InstanceMetadata) → ()
	NetClearInstanceMetadata  = "ClearInstanceMetadata" // (eniID) → ()
	NetAssociateAddress       = "AssociateAddress"      // (AddressSpec) → ()
	NetDisassociateAddress    = "DisassociateAddress"   // (publicIP) → ()
	NetDescribeInterface      = "DescribeInterface"     // (eniID) → (InterfaceInfo)
	NetworkVPCPathPrefix      = "/dev/hangar/Network1/vpc/"
	NetworkVPCInterface       = "dev.hangar.Network1.VPC"
	NetworkSignalLeaseGranted = "LeaseGranted" // (eniID, mac, ip): a DHCP ACK was sent
)

// Properties of a per-VPC object (NetworkVPCInterface).
const (
	NetPropNamespace       = "Namespace"       // s: netns name (ip netns exec NAME …)
	NetPropCIDR            = "CIDR"            // s
	NetPropSubnets         = "Subnets"         // a{ss}: subnet id → bridge
	NetPropInterfaces      = "Interfaces"      // a{ss}: eni id → tap
	NetPropInternetGateway = "InternetGateway" // s: attached igw id or ""
	NetPropAddresses       = "Addresses"       // a{ss}: public IP → private IP
)

// VPCSpec is a VPC as netd needs it.
type VPCSpec struct {
	VpcID        string
	CIDR         string // IPv4 prefix, /16 to /28
	DNSSupport   bool   // enableDnsSupport: the VPC resolver answers at all
	DNSHostnames bool   // enableDnsHostnames: public ec2-… names resolve too
}

// SubnetSpec is a subnet of a VPC.
type SubnetSpec struct {
	SubnetID string
	CIDR     string
}

// SGRule is one security group rule, as EC2 stores it.
type SGRule struct {
	Egress   bool
	Protocol string // "-1" (all), "tcp", "udp", "icmp" or a protocol number
	FromPort int32  // port range for tcp/udp; ICMP type for icmp (-1 any)
	ToPort   int32  // ICMP code for icmp (-1 any)
	CIDR     string // exactly one of CIDR and GroupID
	GroupID  string // members of this group (in the same VPC)
}

// SecurityGroupSpec is a security group with every rule it has. AWS's
// default egress rule (all traffic to 0.0.0.0/0) is a rule like any other:
// the gateway sends it; a group without egress rules allows nothing out.
type SecurityGroupSpec struct {
	GroupID string
	Rules   []SGRule
}

// RouteSpec is one route of a route table. Only routes to the VPC's
// internet gateway ("igw-…") take effect; "local" is implied.
type RouteSpec struct {
	Destination string // IPv4 prefix
	Target      string // igw-… or local
}

// RouteTableSpec is a route table and the subnets it is associated with.
// The main table (Main) applies to every subnet no other table names.
type RouteTableSpec struct {
	RouteTableID string
	Main         bool
	SubnetIDs    []string
	Routes       []RouteSpec
}

// InterfaceSpec is an ENI to give a tap to.
type InterfaceSpec struct {
	VpcID            string
	SubnetID         string
	EniID            string
	MAC              string // unicast, as the gateway chose it (02:…)
	PrivateIP        string // inside the subnet, not one of AWS's reserved five
	SecurityGroupIDs []string
}

// InterfaceInfo is what AllocateInterface returns: the tap vmd attaches the
// guest to. The tap lives in the VPC's namespace; open it with OpenTap, or
// enter the namespace (/run/netns/<Namespace>) and open /dev/net/tun with
// TUNSETIFF Tap (IFF_TAP|IFF_NO_PI, not multi-queue). Its owner is TapUID
// and group TapGID (netd's --tap-user/--tap-group), so a non-root vmd may
// open it.
type InterfaceInfo struct {
	EniID     string
	VpcID     string
	SubnetID  string
	Tap       string
	Namespace string
	MAC       string
	PrivateIP string
	TapUID    uint32
	TapGID    uint32
}

// AddressSpec associates a public (Elastic) IP from PUBLIC_IP_POOL with an
// interface's private IP: netd answers ARP for it on the uplink and NATs it
// 1:1.
type AddressSpec struct {
	PublicIP  string
	EniID     string
	PrivateIP string // "" means the interface's primary private IP
}

// PublicKey is one key pair's public half, for meta-data/public-keys.
type PublicKey struct {
	Name    string
	OpenSSH string
}

// IAMCredentials are an instance profile's role credentials, as the
// gateway's STS will accept them.
type IAMCredentials struct {
	AccessKeyID     string
	SecretAccessKey string
	Token           string
	Expiration      int64 // unix seconds
	LastUpdated     int64 // unix seconds
}

// InstanceMetadata is what IMDS serves to the instance whose primary
// interface is the ENI it is set on. netd keeps it in memory only (it
// carries credentials): the gateway sets it again after netd restarts.
type InstanceMetadata struct {
	InstanceID       string
	AmiID            string
	InstanceType     string
	AccountID        string
	Region           string
	AvailabilityZone string
	ReservationID    string
	LaunchTime       int64 // unix seconds
	PublicIPv4       string
	SecurityGroups   []string // group names, as meta-data/security-groups lists them
	PublicKeys       []PublicKey
	UserData         []byte
	// HttpTokens is "optional" (IMDSv1 and v2) or "required" (v2 only).
	HttpTokens string
	// HttpPutResponseHopLimit is the IP TTL of IMDS replies (1 to 64; 0
	// means AWS's default, 1 for instances outside EKS).
	HttpPutResponseHopLimit uint32
	// HttpEndpoint "disabled" turns IMDS off for the instance.
	HttpEndpoint  string
	IAMRole       string // role name; "" when no profile is attached
	IAMProfileArn string
	IAMProfileID  string
	Credentials   IAMCredentials
	// IdentityDocument is dynamic/instance-identity/document exactly as
	// the gateway signed it; "" lets netd render an unsigned one.
	IdentityDocument string
	// IdentitySignature is .../signature: base64 RSA-SHA256 of the
	// document's bytes.
	IdentitySignature string
	// IdentityPKCS7 is .../pkcs7 (and .../rsa2048): a detached PKCS#7
	// SignedData of the document, base64 in 64-character lines.
	IdentityPKCS7 string
}

// VPCState is one VPC whole, for SyncVPC: netd makes its kernel state
// exactly this, creating what is missing and removing what is not listed
// (subnets, groups, route tables, interfaces, addresses).
type VPCState struct {
	VPC             VPCSpec
	InternetGateway string // attached igw id, "" for none
	Subnets         []SubnetSpec
	SecurityGroups  []SecurityGroupSpec
	RouteTables     []RouteTableSpec
	Interfaces      []InterfaceSpec
	Addresses       []AddressSpec
}

// VPCObjectPath returns the bus path of a VPC's object:
// /dev/hangar/Network1/vpc/vpc_0abc….
func VPCObjectPath(vpcID string) dbus.ObjectPath {
	return dbus.ObjectPath(NetworkVPCPathPrefix + strings.ReplaceAll(vpcID, "-", "_"))
}

// NetworkClient calls hangar-netd. Every call takes ctx, so a caller gives
// up instead of hanging when netd is restarting.
type NetworkClient struct {
	Conn *dbus.Conn
}

func (c NetworkClient) call(ctx context.Context, method string, out []any, args ...any) error {
	return Call(ctx, c.Conn, Network, method, out, args...)
}

// EnsureVPC creates the VPC's namespace, or updates its DNS attributes.
func (c NetworkClient) EnsureVPC(ctx context.Context, v VPCSpec) error {
	return c.call(ctx, NetEnsureVPC, nil, v)
}

// DeleteVPC removes the VPC's namespace and everything in it.
func (c NetworkClient) DeleteVPC(ctx context.Context, vpcID string) error {
	return c.call(ctx, NetDeleteVPC, nil, vpcID)
}

// SyncVPC makes the VPC exactly s.
func (c NetworkClient) SyncVPC(ctx context.Context, s VPCState) error {
	return c.call(ctx, NetSyncVPC, nil, s)
}

// ListVPCs returns the ids of every VPC netd holds.
func (c NetworkClient) ListVPCs(ctx context.Context) ([]string, error) {
	var ids []string
	err := c.call(ctx, NetListVPCs, []any{&ids})
	return ids, err
}

// EnsureSubnet creates the subnet's bridge.
func (c NetworkClient) EnsureSubnet(ctx context.Context, vpcID string, s SubnetSpec) error {
	return c.call(ctx, NetEnsureSubnet, nil, vpcID, s)
}

// DeleteSubnet removes the subnet's bridge; InUse while interfaces exist.
func (c NetworkClient) DeleteSubnet(ctx context.Context, vpcID, subnetID string) error {
	return c.call(ctx, NetDeleteSubnet, nil, vpcID, subnetID)
}

// SetSecurityGroup replaces a group's rules; live traffic follows at once.
func (c NetworkClient) SetSecurityGroup(ctx context.Context, vpcID string, g SecurityGroupSpec) error {
	return c.call(ctx, NetSetSecurityGroup, nil, vpcID, g)
}

// DeleteSecurityGroup forgets a group.
func (c NetworkClient) DeleteSecurityGroup(ctx context.Context, vpcID, groupID string) error {
	return c.call(ctx, NetDeleteSecurityGroup, nil, vpcID, groupID)
}

// SetInternetGateway attaches igwID to the VPC ("" detaches).
func (c NetworkClient) SetInternetGateway(ctx context.Context, vpcID, igwID string) error {
	return c.call(ctx, NetSetInternetGateway, nil, vpcID, igwID)
}

// SetRouteTable replaces a route table and its associations.
func (c NetworkClient) SetRouteTable(ctx context.Context, vpcID string, t RouteTableSpec) error {
	return c.call(ctx, NetSetRouteTable, nil, vpcID, t)
}

// DeleteRouteTable removes a route table.
func (c NetworkClient) DeleteRouteTable(ctx context.Context, vpcID, rtbID string) error {
	return c.call(ctx, NetDeleteRouteTable, nil, vpcID, rtbID)
}

// AllocateInterface creates the ENI's tap and returns where it is.
func (c NetworkClient) AllocateInterface(ctx context.Context, s InterfaceSpec) (InterfaceInfo, error) {
	var info InterfaceInfo
	err := c.call(ctx, NetAllocateInterface, []any{&info}, s)
	return info, err
}

// DescribeInterface returns where an ENI's tap is.
func (c NetworkClient) DescribeInterface(ctx context.Context, eniID string) (InterfaceInfo, error) {
	var info InterfaceInfo
	err := c.call(ctx, NetDescribeInterface, []any{&info}, eniID)
	return info, err
}

// ReleaseInterface removes the ENI's tap, lease and rules.
func (c NetworkClient) ReleaseInterface(ctx context.Context, eniID string) error {
	return c.call(ctx, NetReleaseInterface, nil, eniID)
}

// SetInterfaceGroups replaces the security groups of an ENI.
func (c NetworkClient) SetInterfaceGroups(ctx context.Context, eniID string, groupIDs []string) error {
	return c.call(ctx, NetSetInterfaceGroups, nil, eniID, groupIDs)
}

// OpenTap returns the ENI's tap, opened (IFF_TAP|IFF_NO_PI, without
// IFF_VNET_HDR, so QEMU runs virtio-net without offloads), for QEMU's
// -netdev tap,fd=N. The caller owns the file.
func (c NetworkClient) OpenTap(ctx context.Context, eniID string) (*os.File, error) {
	var fd dbus.UnixFD
	if err := c.call(ctx, NetOpenTap, []any{&fd}, eniID); err != nil {
		return nil, err
	}
	if fd < 0 {
		return nil, fmt.Errorf("netd returned no file descriptor for %s", eniID)
	}
	return os.NewFile(uintptr(fd), "tap-"+eniID), nil
}

// SetInstanceMetadata sets what IMDS serves to the instance on eniID.
func (c NetworkClient) SetInstanceMetadata(ctx context.Context, eniID string, md InstanceMetadata) error {
	return c.call(ctx, NetSetInstanceMetadata, nil, eniID, md)
}

// ClearInstanceMetadata stops IMDS answering for eniID.
func (c NetworkClient) ClearInstanceMetadata(ctx context.Context, eniID string) error {
	return c.call(ctx, NetClearInstanceMetadata, nil, eniID)
}

// AssociateAddress maps a public IP to an ENI's private IP.
func (c NetworkClient) AssociateAddress(ctx context.Context, a AddressSpec) error {
	return c.call(ctx, NetAssociateAddress, nil, a)
}

// DisassociateAddress removes a public IP's mapping.
func (c NetworkClient) DisassociateAddress(ctx context.Context, publicIP string) error {
	return c.call(ctx, NetDisassociateAddress, nil, publicIP)
}

// Status returns netd's ServiceStatus.
func (c NetworkClient) Status(ctx context.Context) (ServiceStatus, error) {
	return Status(ctx, c.Conn, Network)
}
