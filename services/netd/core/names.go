// Package core is hangar-netd's pure model: the desired state of every VPC
// (subnets, interfaces, security groups, route tables, public addresses),
// the checks that keep it consistent, the names netd gives kernel objects,
// the DHCP lease, DNS and instance-metadata tables derived from it, and the
// compilation of security groups into filter rules.
//
// It never touches the kernel, the bus or the network: adapters do, from
// what this package decides. Everything here is a plain function of its
// inputs, so it is table-tested without privileges.
package core

import (
	"crypto/sha256"
	"encoding/hex"
	"strings"
)

// Names fit IFNAMSIZ (15 characters and a NUL) and are derived from the AWS
// id alone, so a restarted netd finds its objects without a lookup table;
// each link also carries the full id in its alias (IFLA_IFALIAS), so an
// operator (ip -d link) and netd can tell them apart from anyone else's.
const (
	// NamespacePrefix starts every VPC namespace: hangar-vpc-0abc….
	NamespacePrefix = "hangar-vpc-"
	// AliasPrefix starts the alias of every link netd makes.
	AliasPrefix = "hangar-netd "
	// UplinkName is the VPC side of the veth to the host namespace. It
	// lives inside the VPC namespace, so one name serves every VPC.
	UplinkName = "hangar-uplink"
)

// NamespaceName returns the network namespace of a VPC.
func NamespaceName(vpcID string) string {
	return NamespacePrefix + strings.TrimPrefix(vpcID, "vpc-")
}

// VPCFromNamespace returns the VPC id a namespace name belongs to.
func VPCFromNamespace(name string) (string, bool) {
	rest, ok := strings.CutPrefix(name, NamespacePrefix)
	if !ok || rest == "" {
		return "", false
	}
	return "vpc-" + rest, true
}

func shortHash(id string) string {
	sum := sha256.Sum256([]byte(id))
	return hex.EncodeToString(sum[:6])
}

// BridgeName returns a subnet's bridge (inside its VPC namespace).
func BridgeName(subnetID string) string { return "hb-" + shortHash(subnetID) }

// TapName returns an interface's tap (inside its VPC namespace).
func TapName(eniID string) string { return "ht-" + shortHash(eniID) }

// HostVethName returns the host-namespace end of a VPC's uplink veth.
func HostVethName(vpcID string) string { return "hv-" + shortHash(vpcID) }

// HostVethPrefix starts every host-side veth netd makes.
const HostVethPrefix = "hv-"

// Alias is the IFLA_IFALIAS netd writes on a link it made for id.
func Alias(id string) string { return AliasPrefix + id }

// AliasID returns the id in a netd alias, or false for anyone else's link.
func AliasID(alias string) (string, bool) {
	id, ok := strings.CutPrefix(alias, AliasPrefix)
	return id, ok && id != ""
}
