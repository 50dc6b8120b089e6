// Package awsid makes and checks identifiers shaped like AWS's.
//
// It owns only the format. Uniqueness across restarts ("ids are never
// reused") is the caller's job: the gateway records every id it has issued.
package awsid

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"strings"
)

// hexLen is the length of the hex part of a long-format AWS id, as in
// vpc-0a1b2c3d4e5f67890 (AWS moved every resource to 17 hex digits in 2018).
const hexLen = 17

// New returns prefix + "-" + 17 random lower-case hex digits.
func New(prefix string) string {
	var b [9]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(fmt.Sprintf("awsid: reading random bytes: %v", err))
	}
	return prefix + "-" + hex.EncodeToString(b[:])[:hexLen]
}

// Valid reports whether s is prefix + "-" + 8 or 17 lower-case hex digits,
// the two lengths AWS has issued.
func Valid(prefix, s string) bool {
	rest, ok := strings.CutPrefix(s, prefix+"-")
	if !ok || (len(rest) != 8 && len(rest) != hexLen) {
		return false
	}
	for _, c := range rest {
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return false
		}
	}
	return true
}

// Prefix returns the part of an id before its last dash ("vpc" for
// "vpc-0abc…"), or "" when s has no dash.
func Prefix(s string) string {
	i := strings.LastIndexByte(s, '-')
	if i <= 0 {
		return ""
	}
	return s[:i]
}

// RequestID returns a random request id in the UUID form AWS uses.
func RequestID() string {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(fmt.Sprintf("awsid: reading random bytes: %v", err))
	}
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	h := hex.EncodeToString(b[:])
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:32]
}

// BusPath turns an id into a D-Bus object path element: D-Bus allows only
// [A-Za-z0-9_], so "i-0abc" becomes "i_0abc".
func BusPath(id string) string {
	return strings.ReplaceAll(id, "-", "_")
}

// FromBusPath reverses BusPath.
func FromBusPath(elem string) string {
	return strings.ReplaceAll(elem, "_", "-")
}
