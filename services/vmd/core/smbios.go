package core

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"

	"hangar.dev/hangar/services/internal/api"
)

// EC2's SMBIOS identity. cloud-init decides it runs on EC2 when the DMI
// product UUID starts with "ec2" and equals the product serial, case
// insensitively (ds-identify ec2_identify_platform; DataSourceEc2
// identify_aws in cloud-init 22.4, Debian 12's). The system manufacturer
// is "Amazon EC2" and the product name the instance type, as on Nitro, and
// the board asset tag holds the instance id as Nitro's does.
const SMBIOSManufacturer = "Amazon EC2"

// InstanceUUID derives a stable UUID for an instance id: "ec2" followed by
// hex of SHA-256(id), shaped 8-4-4-4-12 and marked as a version 4 /
// RFC 4122 variant UUID so guest tools that parse it accept it.
func InstanceUUID(id string) string {
	sum := sha256.Sum256([]byte("hangar-instance-uuid:" + id))
	h := []byte("ec2" + hex.EncodeToString(sum[:])[:29])
	h[12] = '4'                             // version nibble
	h[16] = "89ab"[int(sum[31])%4:][0:1][0] // variant nibble
	s := string(h)
	return fmt.Sprintf("%s-%s-%s-%s-%s", s[0:8], s[8:12], s[12:16], s[16:20], s[20:32])
}

// ResolveSMBIOS fills the fields the spec left empty.
func ResolveSMBIOS(spec api.InstanceSpec) api.InstanceSMBIOS {
	s := spec.SMBIOS
	if s.Manufacturer == "" {
		s.Manufacturer = SMBIOSManufacturer
	}
	if s.Product == "" {
		s.Product = spec.InstanceType
	}
	if s.UUID == "" {
		s.UUID = InstanceUUID(spec.ID)
	}
	if s.Serial == "" {
		s.Serial = s.UUID
	}
	if s.AssetTag == "" {
		s.AssetTag = spec.ID
	}
	return s
}
