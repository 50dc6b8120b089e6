package core

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"sort"
	"strconv"
	"strings"
	"time"

	"hangar.dev/hangar/services/internal/api"
)

// Lease is what DHCP hands one interface.
type Lease struct {
	EniID     string
	IP        netip.Addr
	Subnet    netip.Prefix
	Router    netip.Addr
	DNS       []netip.Addr
	Domain    string
	Hostname  string
	LeaseTime time.Duration
	MTU       int
}

// Lease returns the static lease of the interface with mac in subnetID.
// An unknown MAC gets none: DHCP answers only the interfaces AWS made.
func (v *VPC) Lease(subnetID, mac, region string) (Lease, bool) {
	sn := v.Subnets[subnetID]
	if sn == nil {
		return Lease{}, false
	}
	for _, i := range v.Interfaces {
		if i.SubnetID == subnetID && i.MAC == strings.ToLower(mac) {
			return Lease{
				EniID: i.ID, IP: i.IP, Subnet: sn.CIDR, Router: sn.Gateway(),
				DNS:    []netip.Addr{v.DNS()},
				Domain: Domain(region), Hostname: Hostname(i.IP),
				LeaseTime: LeaseSeconds * time.Second, MTU: MTU,
			}, true
		}
	}
	return Lease{}, false
}

// Zone is a VPC's private DNS: A and PTR records for every interface.
type Zone struct {
	Enabled bool // enableDnsSupport
	Domain  string
	CIDR    netip.Prefix
	A       map[string]netip.Addr // fqdn (lower case, trailing dot) → address
	PTR     map[string]string     // x.x.x.x.in-addr.arpa. → fqdn
}

// Zone builds v's DNS records: ip-a-b-c-d.<domain> for every interface,
// the reverse of each, instance-data.<domain> (IMDS), and with
// enableDnsHostnames the public ec2-… name of each public IP, which
// resolves to the private address inside the VPC as in AWS.
func (v *VPC) Zone(region string) *Zone {
	z := &Zone{Enabled: v.DNSSupport, Domain: Domain(region), CIDR: v.CIDR, A: map[string]netip.Addr{}, PTR: map[string]string{}}
	for _, i := range v.Interfaces {
		name := Hostname(i.IP) + "." + z.Domain + "."
		z.A[name] = i.IP
		z.PTR[ReverseName(i.IP)] = name
	}
	z.A["instance-data."+z.Domain+"."] = IMDSAddr
	if v.DNSHostnames {
		for _, a := range v.Addresses {
			z.A[PublicName(a.PublicIP, region)+"."] = a.PrivateIP
		}
	}
	return z
}

// ReverseName is the in-addr.arpa name of ip.
func ReverseName(ip netip.Addr) string {
	b := ip.As4()
	return fmt.Sprintf("%d.%d.%d.%d.in-addr.arpa.", b[3], b[2], b[1], b[0])
}

func reverseAddr(name string) (netip.Addr, bool) {
	rest, ok := strings.CutSuffix(name, ".in-addr.arpa.")
	if !ok {
		return netip.Addr{}, false
	}
	parts := strings.Split(rest, ".")
	if len(parts) != 4 {
		return netip.Addr{}, false
	}
	var b [4]byte
	for i, p := range parts {
		n, err := strconv.Atoi(p)
		if err != nil || n < 0 || n > 255 {
			return netip.Addr{}, false
		}
		b[3-i] = byte(n)
	}
	return netip.AddrFrom4(b), true
}

// Outcome is how the VPC resolver treats a question.
type Outcome int

const (
	Answer   Outcome = iota + 1 // the zone has the record
	NXDomain                    // the zone is authoritative and has no such name
	NoData                      // the name exists, not with that type
	Forward                     // not the zone's: ask DNS_UPSTREAMS
	Refused                     // DNS support is off for the VPC
)

// Lookup answers an A (1) or PTR (12) question about name; any other type
// for a name the zone owns is NoData.
func (z *Zone) Lookup(name string, qtype uint16) (Outcome, netip.Addr, string) {
	if !z.Enabled {
		return Refused, netip.Addr{}, ""
	}
	name = strings.ToLower(name)
	if !strings.HasSuffix(name, ".") {
		name += "."
	}
	if a, ok := z.A[name]; ok {
		if qtype == 1 {
			return Answer, a, ""
		}
		return NoData, netip.Addr{}, ""
	}
	if ptr, ok := z.PTR[name]; ok {
		if qtype == 12 {
			return Answer, netip.Addr{}, ptr
		}
		return NoData, netip.Addr{}, ""
	}
	if strings.HasSuffix(name, "."+z.Domain+".") {
		return NXDomain, netip.Addr{}, ""
	}
	if ip, ok := reverseAddr(name); ok && z.CIDR.Contains(ip) {
		return NXDomain, netip.Addr{}, ""
	}
	return Forward, netip.Addr{}, ""
}

// NetInfo is what IMDS knows of an interface from netd's own state.
type NetInfo struct {
	EniID      string
	MAC        string
	IP         netip.Addr
	SubnetID   string
	SubnetCIDR netip.Prefix
	VpcID      string
	VPCCIDR    netip.Prefix
	GroupIDs   []string
	Domain     string
	PublicIP   string
}

// MetadataTree lays out the instance metadata the way IMDS serves it:
// leaf paths under /latest/ (meta-data/…, user-data, dynamic/…) to their
// bodies. Directories are implied by the paths.
func MetadataTree(md api.InstanceMetadata, n NetInfo) map[string]string {
	t := map[string]string{}
	host := Hostname(n.IP) + "." + n.Domain
	m := "meta-data/"
	t[m+"ami-id"] = md.AmiID
	t[m+"ami-launch-index"] = "0"
	t[m+"ami-manifest-path"] = "(unknown)"
	t[m+"block-device-mapping/ami"] = "/dev/xvda"
	t[m+"block-device-mapping/root"] = "/dev/xvda"
	t[m+"hostname"] = host
	t[m+"instance-action"] = "none"
	t[m+"instance-id"] = md.InstanceID
	t[m+"instance-life-cycle"] = "on-demand"
	t[m+"instance-type"] = md.InstanceType
	t[m+"local-hostname"] = host
	t[m+"local-ipv4"] = n.IP.String()
	t[m+"mac"] = n.MAC
	t[m+"placement/availability-zone"] = md.AvailabilityZone
	t[m+"placement/region"] = md.Region
	t[m+"profile"] = "default-hvm"
	t[m+"reservation-id"] = md.ReservationID
	t[m+"security-groups"] = strings.Join(md.SecurityGroups, "\n")
	t[m+"services/domain"] = "amazonaws.com"
	t[m+"services/partition"] = "aws"
	pub := md.PublicIPv4
	if pub == "" {
		pub = n.PublicIP
	}
	if pub != "" {
		t[m+"public-ipv4"] = pub
		if a, err := netip.ParseAddr(pub); err == nil {
			t[m+"public-hostname"] = PublicName(a, md.Region)
		}
	}
	for i, k := range md.PublicKeys {
		t[fmt.Sprintf("%spublic-keys/%d/openssh-key", m, i)] = k.OpenSSH
	}
	mac := m + "network/interfaces/macs/" + n.MAC + "/"
	t[mac+"device-number"] = "0"
	t[mac+"interface-id"] = n.EniID
	t[mac+"local-hostname"] = host
	t[mac+"local-ipv4s"] = n.IP.String()
	t[mac+"mac"] = n.MAC
	t[mac+"owner-id"] = md.AccountID
	t[mac+"security-group-ids"] = strings.Join(n.GroupIDs, "\n")
	t[mac+"security-groups"] = strings.Join(md.SecurityGroups, "\n")
	t[mac+"subnet-id"] = n.SubnetID
	t[mac+"subnet-ipv4-cidr-block"] = n.SubnetCIDR.String()
	t[mac+"vpc-id"] = n.VpcID
	t[mac+"vpc-ipv4-cidr-block"] = n.VPCCIDR.String()
	t[mac+"vpc-ipv4-cidr-blocks"] = n.VPCCIDR.String()
	if pub != "" {
		t[mac+"public-ipv4s"] = pub
	}
	if md.IAMRole != "" {
		c := md.Credentials
		info, _ := json.MarshalIndent(map[string]string{
			"Code": "Success", "LastUpdated": unixISO(c.LastUpdated),
			"InstanceProfileArn": md.IAMProfileArn, "InstanceProfileId": md.IAMProfileID,
		}, "", "  ")
		t[m+"iam/info"] = string(info)
		cred, _ := json.MarshalIndent(map[string]string{
			"Code": "Success", "LastUpdated": unixISO(c.LastUpdated), "Type": "AWS-HMAC",
			"AccessKeyId": c.AccessKeyID, "SecretAccessKey": c.SecretAccessKey, "Token": c.Token,
			"Expiration": unixISO(c.Expiration),
		}, "", "  ")
		t[m+"iam/security-credentials/"+md.IAMRole] = string(cred)
	}
	if len(md.UserData) > 0 {
		t["user-data"] = string(md.UserData)
	}
	doc, _ := json.MarshalIndent(map[string]any{
		"accountId": md.AccountID, "architecture": "x86_64", "availabilityZone": md.AvailabilityZone,
		"billingProducts": nil, "devpayProductCodes": nil, "marketplaceProductCodes": nil,
		"imageId": md.AmiID, "instanceId": md.InstanceID, "instanceType": md.InstanceType,
		"kernelId": nil, "pendingTime": unixISO(md.LaunchTime), "privateIp": n.IP.String(),
		"ramdiskId": nil, "region": md.Region, "version": "2017-09-30",
	}, "", "  ")
	t["dynamic/instance-identity/document"] = string(doc)
	// The gateway's document is served byte for byte, so that its
	// signatures verify against what the guest fetched.
	if md.IdentityDocument != "" {
		t["dynamic/instance-identity/document"] = md.IdentityDocument
		if md.IdentitySignature != "" {
			t["dynamic/instance-identity/signature"] = md.IdentitySignature
		}
		if md.IdentityPKCS7 != "" {
			t["dynamic/instance-identity/pkcs7"] = md.IdentityPKCS7
			t["dynamic/instance-identity/rsa2048"] = md.IdentityPKCS7
		}
	}
	return t
}

func unixISO(s int64) string {
	if s == 0 {
		return ""
	}
	return time.Unix(s, 0).UTC().Format("2006-01-02T15:04:05Z")
}

// ResolveMetadata returns the body IMDS serves for path (relative to
// /latest/): a leaf's value, or a directory's listing (one entry a line,
// sub-directories with a trailing slash; public-keys/ as 0=name).
func ResolveMetadata(tree map[string]string, md api.InstanceMetadata, path string) (string, bool) {
	path = strings.TrimPrefix(path, "/")
	if v, ok := tree[path]; ok {
		return v, true
	}
	dir := path
	if dir != "" && !strings.HasSuffix(dir, "/") {
		dir += "/"
	}
	if dir == "meta-data/public-keys/" && len(md.PublicKeys) > 0 {
		var lines []string
		for i, k := range md.PublicKeys {
			lines = append(lines, fmt.Sprintf("%d=%s", i, k.Name))
		}
		return strings.Join(lines, "\n"), true
	}
	seen := map[string]bool{}
	for p := range tree {
		rest, ok := strings.CutPrefix(p, dir)
		if !ok || rest == "" {
			continue
		}
		if head, _, more := strings.Cut(rest, "/"); more {
			seen[head+"/"] = true
		} else {
			seen[head] = true
		}
	}
	if len(seen) == 0 {
		return "", false
	}
	out := make([]string, 0, len(seen))
	for k := range seen {
		out = append(out, k)
	}
	sort.Strings(out)
	return strings.Join(out, "\n"), true
}

// Tokens are IMDSv2 session tokens: each is bound to the address that
// asked for it and lives for the TTL it was asked with (1 to 21600 s).
type Tokens struct {
	byToken map[string]token
	now     func() time.Time
}

type token struct {
	ip      netip.Addr
	expires time.Time
}

// NewTokens makes an empty token table on a clock.
func NewTokens(now func() time.Time) *Tokens {
	return &Tokens{byToken: map[string]token{}, now: now}
}

// MaxTokenTTL is IMDS's limit, six hours.
const MaxTokenTTL = 21600

// Issue records tok for ip for ttl seconds, dropping expired tokens.
func (t *Tokens) Issue(tok string, ip netip.Addr, ttl int) error {
	if ttl < 1 || ttl > MaxTokenTTL {
		return fmt.Errorf("token TTL %d is not 1-%d seconds", ttl, MaxTokenTTL)
	}
	now := t.now()
	for k, v := range t.byToken {
		if now.After(v.expires) {
			delete(t.byToken, k)
		}
	}
	t.byToken[tok] = token{ip: ip, expires: now.Add(time.Duration(ttl) * time.Second)}
	return nil
}

// Valid reports whether tok was issued to ip and has not expired.
func (t *Tokens) Valid(tok string, ip netip.Addr) bool {
	v, ok := t.byToken[tok]
	return ok && v.ip == ip && !t.now().After(v.expires)
}
