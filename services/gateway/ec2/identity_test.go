package ec2

import (
	"crypto"
	"crypto/rsa"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/aws/aws-sdk-go-v2/service/ec2"

	"hangar.dev/hangar/services/internal/api"
)

func TestIdentityDocumentShape(t *testing.T) {
	md := api.InstanceMetadata{AccountID: testAccount, AvailabilityZone: "us-east-1a", AmiID: "ami-0123456789abcdef0",
		InstanceID: "i-0123456789abcdef0", InstanceType: "t3.micro", LaunchTime: 1700000000, Region: "us-east-1"}
	got := IdentityDocument(md, "10.0.1.5", "")
	want := `{
  "accountId" : "123456789012",
  "architecture" : "x86_64",
  "availabilityZone" : "us-east-1a",
  "billingProducts" : null,
  "devpayProductCodes" : null,
  "marketplaceProductCodes" : null,
  "imageId" : "ami-0123456789abcdef0",
  "instanceId" : "i-0123456789abcdef0",
  "instanceType" : "t3.micro",
  "kernelId" : null,
  "pendingTime" : "2023-11-14T22:13:20Z",
  "privateIp" : "10.0.1.5",
  "ramdiskId" : null,
  "region" : "us-east-1",
  "version" : "2017-09-30"
}`
	if got != want {
		t.Fatalf("document:\n%s\nwant:\n%s", got, want)
	}
	var v map[string]any
	if err := json.Unmarshal([]byte(got), &v); err != nil {
		t.Fatalf("the document is not JSON: %v", err)
	}
}

func TestIdentitySignerKeepsItsKey(t *testing.T) {
	dir := t.TempDir()
	s1, err := LoadIdentitySigner(dir, testAccount)
	if err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(filepath.Join(dir, IdentityKeyFile))
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("key file: %v %v", st, err)
	}
	cert1, _ := os.ReadFile(s1.CertPath)
	s2, err := LoadIdentitySigner(dir, testAccount)
	if err != nil {
		t.Fatal(err)
	}
	cert2, _ := os.ReadFile(s2.CertPath)
	if !s1.key.Equal(s2.key) || string(cert1) != string(cert2) || string(cert1) != string(s1.CertificatePEM()) {
		t.Fatal("a restart made a new key or certificate")
	}
	// A lost certificate is made again for the same key.
	if err := os.Remove(s1.CertPath); err != nil {
		t.Fatal(err)
	}
	s3, err := LoadIdentitySigner(dir, testAccount)
	if err != nil {
		t.Fatal(err)
	}
	if !s3.key.Equal(s1.key) || !s3.cert.PublicKey.(*rsa.PublicKey).Equal(&s1.key.PublicKey) {
		t.Fatal("the remade certificate is not the key's")
	}
	if s1.key.N.BitLen() != 2048 {
		t.Fatalf("key of %d bits, want 2048", s1.key.N.BitLen())
	}
	// A key file that is not a key is an error, not a new key.
	if err := os.WriteFile(filepath.Join(dir, IdentityKeyFile), []byte("junk"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadIdentitySigner(dir, testAccount); err == nil {
		t.Fatal("a corrupt key file was accepted")
	}
}

// TestIdentityDocumentVerifies signs a launched instance's document and
// checks it as a user in the guest would: Go's verifier, and the openssl
// commands docs/iam.md gives.
func TestIdentityDocumentVerifies(t *testing.T) {
	h := newProfileHost(t)
	id := *h.run(t, &ec2.RunInstancesInput{}).Instances[0].InstanceId
	md := h.served(t, id)
	var doc map[string]any
	if err := json.Unmarshal([]byte(md.IdentityDocument), &doc); err != nil {
		t.Fatalf("document %q: %v", md.IdentityDocument, err)
	}
	v := h.describe(t, id)
	if doc["instanceId"] != id || doc["privateIp"] != *v.PrivateIpAddress || doc["accountId"] != testAccount || doc["imageId"] != *v.ImageId {
		t.Fatalf("document %v for %s at %s", doc, id, *v.PrivateIpAddress)
	}
	sig, err := base64.StdEncoding.DecodeString(md.IdentitySignature)
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256([]byte(md.IdentityDocument))
	if err := rsa.VerifyPKCS1v15(h.s.signer.cert.PublicKey.(*rsa.PublicKey), crypto.SHA256, sum[:], sig); err != nil {
		t.Fatalf("signature does not verify: %v", err)
	}
	for _, line := range strings.Split(md.IdentityPKCS7, "\n") {
		if len(line) > 64 {
			t.Fatalf("pkcs7 line of %d characters", len(line))
		}
	}

	if _, err := exec.LookPath("openssl"); err != nil {
		t.Skip("openssl is not installed; the openssl verification of docs/iam.md is not exercised")
	}
	dir := t.TempDir()
	write := func(name, body string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	docPath := write("document", md.IdentityDocument)
	certPath := h.s.signer.CertPath
	p7 := write("pkcs7", "-----BEGIN PKCS7-----\n"+md.IdentityPKCS7+"\n-----END PKCS7-----\n")
	sigPath := write("signature.bin", string(sig))
	var lastOut []byte
	openssl := func(args ...string) error {
		var err error
		lastOut, err = exec.Command("openssl", args...).CombinedOutput()
		return err
	}
	if err := openssl("smime", "-verify", "-in", p7, "-inform", "PEM", "-content", docPath, "-certfile", certPath, "-noverify", "-out", os.DevNull); err != nil {
		t.Fatalf("openssl smime -verify rejects the pkcs7 signature: %s", lastOut)
	}
	pub := filepath.Join(dir, "pub.pem")
	if err := openssl("x509", "-in", certPath, "-pubkey", "-noout", "-out", pub); err != nil {
		t.Fatalf("openssl x509 -pubkey: %v: %s", err, lastOut)
	}
	if err := openssl("dgst", "-sha256", "-verify", pub, "-signature", sigPath, docPath); err != nil {
		t.Fatalf("openssl dgst -verify rejects the signature: %s", lastOut)
	}
	// A document changed by one byte does not verify.
	forged := write("forged", strings.Replace(md.IdentityDocument, id, "i-0fffffffffffffff0", 1))
	if openssl("smime", "-verify", "-in", p7, "-inform", "PEM", "-content", forged, "-certfile", certPath, "-noverify", "-out", os.DevNull) == nil {
		t.Fatal("a forged document verifies")
	}
	if openssl("dgst", "-sha256", "-verify", pub, "-signature", sigPath, forged) == nil {
		t.Fatal("a forged document verifies with dgst")
	}
}
