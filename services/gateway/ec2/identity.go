package ec2

import (
	"crypto"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"time"

	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/internal/atomicfile"
)

// The files of the key that signs instance identity documents, in the
// gateway's state directory. The certificate is what users verify
// documents against (docs/iam.md); the key never leaves the host.
const (
	IdentityKeyFile  = "instance-identity.key"
	IdentityCertFile = "instance-identity.crt"
)

// IdentitySigner signs instance identity documents with the host's
// RSA-2048 key, as AWS signs them with its regional keys.
type IdentitySigner struct {
	key  *rsa.PrivateKey
	cert *x509.Certificate
	// CertPath is where the certificate is, for users to fetch.
	CertPath string
}

// LoadIdentitySigner loads the signing key and certificate from dir,
// making what is missing: the key once (RSA-2048, mode 0600), the
// self-signed certificate whenever it is missing or is not the key's.
func LoadIdentitySigner(dir, account string) (*IdentitySigner, error) {
	keyPath, certPath := filepath.Join(dir, IdentityKeyFile), filepath.Join(dir, IdentityCertFile)
	key, err := loadOrMakeKey(keyPath)
	if err != nil {
		return nil, err
	}
	cert, err := loadCert(certPath)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, err
	}
	if cert == nil || !key.PublicKey.Equal(cert.PublicKey) {
		if cert, err = makeCert(certPath, key, account); err != nil {
			return nil, err
		}
	}
	return &IdentitySigner{key: key, cert: cert, CertPath: certPath}, nil
}

func loadOrMakeKey(path string) (*rsa.PrivateKey, error) {
	raw, err := os.ReadFile(path)
	if err == nil {
		b, _ := pem.Decode(raw)
		if b == nil || b.Type != "PRIVATE KEY" {
			return nil, fmt.Errorf("reading the identity document key %s: not a PEM PRIVATE KEY", path)
		}
		k, err := x509.ParsePKCS8PrivateKey(b.Bytes)
		if err != nil {
			return nil, fmt.Errorf("reading the identity document key %s: %w", path, err)
		}
		rk, ok := k.(*rsa.PrivateKey)
		if !ok {
			return nil, fmt.Errorf("the identity document key %s is not an RSA key", path)
		}
		return rk, nil
	}
	if !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("reading the identity document key: %w", err)
	}
	k, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return nil, fmt.Errorf("making the identity document key: %w", err)
	}
	der, err := x509.MarshalPKCS8PrivateKey(k)
	if err != nil {
		return nil, err
	}
	if err := atomicfile.Write(path, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), 0o600, 0o750); err != nil {
		return nil, fmt.Errorf("writing the identity document key: %w", err)
	}
	return k, nil
}

func loadCert(path string) (*x509.Certificate, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	b, _ := pem.Decode(raw)
	if b == nil || b.Type != "CERTIFICATE" {
		return nil, nil // replaced below
	}
	c, err := x509.ParseCertificate(b.Bytes)
	if err != nil {
		return nil, nil
	}
	return c, nil
}

func makeCert(path string, key *rsa.PrivateKey, account string) (*x509.Certificate, error) {
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{Organization: []string{"hangar"}, CommonName: "hangar instance identity " + account},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.AddDate(20, 0, 0),
		KeyUsage:     x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, fmt.Errorf("making the identity document certificate: %w", err)
	}
	if err := atomicfile.Write(path, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644, 0o750); err != nil {
		return nil, fmt.Errorf("writing the identity document certificate: %w", err)
	}
	return x509.ParseCertificate(der)
}

// CertificatePEM is the certificate documents verify against.
func (s *IdentitySigner) CertificatePEM() []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: s.cert.Raw})
}

// Sign signs doc: the base64 RSA-SHA256 signature IMDS serves at
// dynamic/instance-identity/signature, and the same signature as a
// detached PKCS#7 SignedData (base64, 64-character lines) for .../pkcs7,
// which `openssl smime -verify -content document -certfile <cert>`
// checks. The PKCS#7 carries no certificate: a verifier must bring the
// host's, or anyone could sign with their own.
func (s *IdentitySigner) Sign(doc []byte) (signature, pkcs7 string, err error) {
	sum := sha256.Sum256(doc)
	sig, err := rsa.SignPKCS1v15(rand.Reader, s.key, crypto.SHA256, sum[:])
	if err != nil {
		return "", "", fmt.Errorf("signing the identity document: %w", err)
	}
	der, err := detachedSignedData(s.cert, sig)
	if err != nil {
		return "", "", err
	}
	return base64.StdEncoding.EncodeToString(sig), wrap64(base64.StdEncoding.EncodeToString(der)), nil
}

var (
	oidData          = asn1.ObjectIdentifier{1, 2, 840, 113549, 1, 7, 1}
	oidSignedData    = asn1.ObjectIdentifier{1, 2, 840, 113549, 1, 7, 2}
	oidSHA256        = asn1.ObjectIdentifier{2, 16, 840, 1, 101, 3, 4, 2, 1}
	oidRSAEncryption = asn1.ObjectIdentifier{1, 2, 840, 113549, 1, 1, 1}
	asn1Null         = asn1.RawValue{Tag: asn1.TagNull}
)

// The ASN.1 of RFC 2315 that a detached signature with no authenticated
// attributes needs.
type algorithmIdentifier struct {
	Algorithm  asn1.ObjectIdentifier
	Parameters asn1.RawValue
}

type issuerAndSerial struct {
	Issuer       asn1.RawValue
	SerialNumber *big.Int
}

type signerInfo struct {
	Version                   int
	IssuerAndSerialNumber     issuerAndSerial
	DigestAlgorithm           algorithmIdentifier
	DigestEncryptionAlgorithm algorithmIdentifier
	EncryptedDigest           []byte
}

type dataContentInfo struct {
	ContentType asn1.ObjectIdentifier
}

type signedData struct {
	Version          int
	DigestAlgorithms []algorithmIdentifier `asn1:"set"`
	ContentInfo      dataContentInfo
	SignerInfos      []signerInfo `asn1:"set"`
}

type contentInfo struct {
	ContentType asn1.ObjectIdentifier
	Content     asn1.RawValue
}

func detachedSignedData(cert *x509.Certificate, sig []byte) ([]byte, error) {
	sha := algorithmIdentifier{Algorithm: oidSHA256, Parameters: asn1Null}
	sd, err := asn1.Marshal(signedData{
		Version:          1,
		DigestAlgorithms: []algorithmIdentifier{sha},
		ContentInfo:      dataContentInfo{ContentType: oidData},
		SignerInfos: []signerInfo{{
			Version:                   1,
			IssuerAndSerialNumber:     issuerAndSerial{Issuer: asn1.RawValue{FullBytes: cert.RawIssuer}, SerialNumber: cert.SerialNumber},
			DigestAlgorithm:           sha,
			DigestEncryptionAlgorithm: algorithmIdentifier{Algorithm: oidRSAEncryption, Parameters: asn1Null},
			EncryptedDigest:           sig,
		}},
	})
	if err != nil {
		return nil, fmt.Errorf("encoding the PKCS#7 signature: %w", err)
	}
	der, err := asn1.Marshal(contentInfo{ContentType: oidSignedData,
		Content: asn1.RawValue{Class: asn1.ClassContextSpecific, Tag: 0, IsCompound: true, Bytes: sd}})
	if err != nil {
		return nil, fmt.Errorf("encoding the PKCS#7 signature: %w", err)
	}
	return der, nil
}

func wrap64(s string) string {
	var b strings.Builder
	for len(s) > 64 {
		b.WriteString(s[:64])
		b.WriteByte('\n')
		s = s[64:]
	}
	b.WriteString(s)
	return b.String()
}

// IdentityDocument renders the instance identity document of md as AWS
// writes it: its fields in AWS's order, `"key" : value`, nulls where AWS
// has them.
func IdentityDocument(md api.InstanceMetadata, privateIP, architecture string) string {
	if architecture == "" {
		architecture = "x86_64"
	}
	pending := ""
	if md.LaunchTime != 0 {
		pending = time.Unix(md.LaunchTime, 0).UTC().Format("2006-01-02T15:04:05Z")
	}
	fields := []struct {
		k string
		v any // string, or nil for null
	}{
		{"accountId", md.AccountID}, {"architecture", architecture}, {"availabilityZone", md.AvailabilityZone},
		{"billingProducts", nil}, {"devpayProductCodes", nil}, {"marketplaceProductCodes", nil},
		{"imageId", md.AmiID}, {"instanceId", md.InstanceID}, {"instanceType", md.InstanceType},
		{"kernelId", nil}, {"pendingTime", pending}, {"privateIp", privateIP}, {"ramdiskId", nil},
		{"region", md.Region}, {"version", "2017-09-30"},
	}
	var b strings.Builder
	b.WriteString("{\n")
	for i, f := range fields {
		v := "null"
		if f.v != nil {
			raw, _ := json.Marshal(f.v)
			v = string(raw)
		}
		fmt.Fprintf(&b, "  %q : %s", f.k, v)
		if i < len(fields)-1 {
			b.WriteByte(',')
		}
		b.WriteByte('\n')
	}
	b.WriteString("}")
	return b.String()
}
