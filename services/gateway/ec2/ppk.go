package ec2

import (
	"crypto/ed25519"
	"crypto/hmac"
	"crypto/rsa"
	"crypto/sha1"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"math/big"
	"strings"

	"golang.org/x/crypto/ssh"
)

// ppk renders an unencrypted private key in PuTTY's key file format,
// version 2 (PuTTY-User-Key-File-2), which every PuTTY since 0.52 reads and
// which is what EC2 hands out for KeyFormat=ppk.
//
// The format (PuTTY's sshpubk.c): the algorithm, "Encryption: none", the
// comment, the SSH public key blob and the private blob, each base64 in
// lines of 64 characters, and an HMAC-SHA-1 over all of them keyed with
// SHA-1("putty-private-key-file-mac-key") (no passphrase).
func ppk(key any, comment string) (string, error) {
	signer, err := ssh.NewSignerFromKey(key)
	if err != nil {
		return "", fmt.Errorf("deriving the public key for PPK: %w", err)
	}
	pub := signer.PublicKey()
	var priv []byte
	switch k := key.(type) {
	case *rsa.PrivateKey:
		// d, p, q, and iqmp = q⁻¹ mod p (PuTTY's order).
		iqmp := new(big.Int).ModInverse(k.Primes[1], k.Primes[0])
		for _, n := range []*big.Int{k.D, k.Primes[0], k.Primes[1], iqmp} {
			priv = appendMPInt(priv, n)
		}
	case ed25519.PrivateKey:
		// PuTTY keeps the 32-byte seed as a little-endian integer and
		// writes it back as the same 32 bytes.
		priv = appendString(priv, k.Seed())
	default:
		return "", fmt.Errorf("no PPK encoding for %T", key)
	}
	algo := pub.Type()
	const encryption = "none"
	pubBlob := pub.Marshal()

	var macData []byte
	for _, f := range [][]byte{[]byte(algo), []byte(encryption), []byte(comment), pubBlob, priv} {
		macData = appendString(macData, f)
	}
	macKey := sha1.Sum([]byte("putty-private-key-file-mac-key"))
	mac := hmac.New(sha1.New, macKey[:])
	mac.Write(macData)

	var b strings.Builder
	fmt.Fprintf(&b, "PuTTY-User-Key-File-2: %s\n", algo)
	fmt.Fprintf(&b, "Encryption: %s\n", encryption)
	fmt.Fprintf(&b, "Comment: %s\n", comment)
	writeLines(&b, "Public-Lines", pubBlob)
	writeLines(&b, "Private-Lines", priv)
	fmt.Fprintf(&b, "Private-MAC: %s\n", hex.EncodeToString(mac.Sum(nil)))
	return b.String(), nil
}

func writeLines(b *strings.Builder, header string, blob []byte) {
	enc := base64.StdEncoding.EncodeToString(blob)
	n := (len(enc) + 63) / 64
	fmt.Fprintf(b, "%s: %d\n", header, n)
	for i := 0; i < len(enc); i += 64 {
		end := min(i+64, len(enc))
		b.WriteString(enc[i:end])
		b.WriteByte('\n')
	}
}

// appendString appends an SSH string: a uint32 length, then the bytes.
func appendString(b, s []byte) []byte {
	b = binary.BigEndian.AppendUint32(b, uint32(len(s)))
	return append(b, s...)
}

// appendMPInt appends an SSH mpint (RFC 4251): big-endian two's complement
// with a leading zero byte when the top bit is set. Only non-negative
// values occur here.
func appendMPInt(b []byte, n *big.Int) []byte {
	raw := n.Bytes()
	if len(raw) > 0 && raw[0]&0x80 != 0 {
		raw = append([]byte{0}, raw...)
	}
	return appendString(b, raw)
}
