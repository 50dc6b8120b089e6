package hostinit

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"time"

	"hangar.dev/hangar/services/internal/atomicfile"
	"hangar.dev/hangar/services/internal/hostconf"
)

// The files of TLSDir. The CA's key never leaves root; the server key is
// given to the gateway's user.
const (
	CACertFile     = "ca.crt"
	CAKeyFile      = "ca.key"
	ServerCertFile = "server.crt"
	ServerKeyFile  = "server.key"
)

const (
	caLifetime     = 10 * 365 * 24 * time.Hour
	serverLifetime = 397 * 24 * time.Hour // the longest browsers accept
	renewBefore    = 30 * 24 * time.Hour
)

// ensureTLS keeps a CA (made once) and a server certificate signed by it
// whose SANs are the host's names and addresses. The server certificate is
// re-issued when those change, when it nears expiry, or when the CA
// changed; otherwise nothing is touched. It is made whether or not API_TLS
// is on, so turning HTTPS on needs nothing but the key.
func ensureTLS(dir string, cfg hostconf.Config, o Options, r *hostconf.Readiness, act func(string, ...any)) {
	fail := func(err error) {
		// Without API_TLS nothing uses the certificate yet: a warning.
		r.Add(hostconf.ReasonTLSUnavailable, cfg.APITLS, "%v", err)
	}
	now := o.Now()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		fail(fmt.Errorf("creating %s: %w", dir, err))
		return
	}
	ca, caKey, err := loadPair(filepath.Join(dir, CACertFile), filepath.Join(dir, CAKeyFile))
	if err != nil || !ca.IsCA || now.Add(renewBefore).After(ca.NotAfter) {
		ca, caKey, err = newCA(dir, hostnameOf(o), now)
		if err != nil {
			fail(err)
			return
		}
		act("made a new CA %q in %s", ca.Subject.CommonName, dir)
	}

	dns, ips := sans(cfg, o)
	cert, _, err := loadPair(filepath.Join(dir, ServerCertFile), filepath.Join(dir, ServerKeyFile))
	if err == nil && cert.CheckSignatureFrom(ca) == nil && !now.Add(renewBefore).After(cert.NotAfter) &&
		slices.Equal(sortedStrings(cert.DNSNames), dns) && slices.Equal(sortedIPs(cert.IPAddresses), ips) {
		if err := chownTo(filepath.Join(dir, ServerKeyFile), o.Owner, act); err != nil {
			fail(err)
		}
		return
	}
	if err := newServerCert(dir, ca, caKey, dns, ips, now); err != nil {
		fail(err)
		return
	}
	if err := chownTo(filepath.Join(dir, ServerKeyFile), o.Owner, act); err != nil {
		fail(err)
		return
	}
	act("issued the API certificate for %s", strings.Join(append(append([]string{}, dns...), ips...), ", "))
}

// sans are the names and addresses a client may use to reach the API:
// the host name, localhost, API_TLS_NAMES, loopback, every address of the
// host except link-local ones, and API_LISTEN's address when it is one.
func sans(cfg hostconf.Config, o Options) (dns, ips []string) {
	dnsSet := map[string]bool{"localhost": true}
	if h := hostnameOf(o); h != "" {
		dnsSet[h] = true
	}
	for _, n := range cfg.APITLSNames {
		dnsSet[n] = true
	}
	ipSet := map[string]bool{"127.0.0.1": true, "::1": true}
	addrs := o.Addresses
	if addrs == nil {
		addrs = hostAddresses()
	}
	for _, a := range addrs {
		if !a.IsLinkLocalUnicast() && !a.IsUnspecified() {
			ipSet[a.Unmap().String()] = true
		}
	}
	if host, _, err := net.SplitHostPort(cfg.APIListen); err == nil {
		if a, err := netip.ParseAddr(host); err == nil && !a.IsUnspecified() {
			ipSet[a.String()] = true
		}
	}
	for n := range dnsSet {
		dns = append(dns, n)
	}
	for a := range ipSet {
		ips = append(ips, a)
	}
	sort.Strings(dns)
	sort.Strings(ips)
	return dns, ips
}

func hostnameOf(o Options) string {
	if o.Hostname != "" {
		return o.Hostname
	}
	h, _ := os.Hostname()
	return h
}

func hostAddresses() []netip.Addr {
	var out []netip.Addr
	ifaces, err := net.Interfaces()
	if err != nil {
		return nil
	}
	for _, ifc := range ifaces {
		addrs, err := ifc.Addrs()
		if err != nil {
			continue
		}
		for _, a := range addrs {
			if n, ok := a.(*net.IPNet); ok {
				if ip, ok := netip.AddrFromSlice(n.IP); ok {
					out = append(out, ip.Unmap())
				}
			}
		}
	}
	return out
}

func sortedStrings(s []string) []string {
	out := append([]string(nil), s...)
	sort.Strings(out)
	return out
}

func sortedIPs(ips []net.IP) []string {
	out := make([]string, len(ips))
	for i, ip := range ips {
		a, _ := netip.AddrFromSlice(ip)
		out[i] = a.Unmap().String()
	}
	sort.Strings(out)
	return out
}

func loadPair(certPath, keyPath string) (*x509.Certificate, *ecdsa.PrivateKey, error) {
	certPEM, err := os.ReadFile(certPath)
	if err != nil {
		return nil, nil, err
	}
	keyPEM, err := os.ReadFile(keyPath)
	if err != nil {
		return nil, nil, err
	}
	cb, _ := pem.Decode(certPEM)
	kb, _ := pem.Decode(keyPEM)
	if cb == nil || kb == nil {
		return nil, nil, errors.New("not PEM")
	}
	cert, err := x509.ParseCertificate(cb.Bytes)
	if err != nil {
		return nil, nil, err
	}
	key, err := x509.ParseECPrivateKey(kb.Bytes)
	if err != nil {
		return nil, nil, err
	}
	if !key.PublicKey.Equal(cert.PublicKey) {
		return nil, nil, errors.New("key does not match certificate")
	}
	return cert, key, nil
}

func serial() (*big.Int, error) {
	return rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
}

func newCA(dir, host string, now time.Time) (*x509.Certificate, *ecdsa.PrivateKey, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("making the CA key: %w", err)
	}
	sn, err := serial()
	if err != nil {
		return nil, nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          sn,
		Subject:               pkix.Name{CommonName: "hangar host CA " + host, Organization: []string{"hangar"}},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(caLifetime),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, nil, fmt.Errorf("making the CA certificate: %w", err)
	}
	if err := writePair(dir, CACertFile, CAKeyFile, der, key); err != nil {
		return nil, nil, err
	}
	cert, err := x509.ParseCertificate(der)
	return cert, key, err
}

func newServerCert(dir string, ca *x509.Certificate, caKey *ecdsa.PrivateKey, dns, ips []string, now time.Time) error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return fmt.Errorf("making the server key: %w", err)
	}
	sn, err := serial()
	if err != nil {
		return err
	}
	tmpl := &x509.Certificate{
		SerialNumber: sn,
		Subject:      pkix.Name{CommonName: dns[0], Organization: []string{"hangar"}},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.Add(serverLifetime),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		DNSNames:     dns,
	}
	for _, s := range ips {
		tmpl.IPAddresses = append(tmpl.IPAddresses, net.ParseIP(s))
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		return fmt.Errorf("signing the server certificate: %w", err)
	}
	return writePair(dir, ServerCertFile, ServerKeyFile, der, key)
}

// writePair writes the key first (0600) and the certificate second, so a
// reader never finds a certificate without its key.
func writePair(dir, certName, keyName string, der []byte, key *ecdsa.PrivateKey) error {
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return err
	}
	if err := atomicfile.Write(filepath.Join(dir, keyName), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}), 0o600, 0o755); err != nil {
		return fmt.Errorf("writing %s: %w", keyName, err)
	}
	if err := atomicfile.Write(filepath.Join(dir, certName), pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644, 0o755); err != nil {
		return fmt.Errorf("writing %s: %w", certName, err)
	}
	return nil
}
