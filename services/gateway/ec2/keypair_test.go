package ec2

import (
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/md5"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha1"
	"crypto/x509"
	"encoding/base64"
	"encoding/pem"
	"math/big"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"
	"golang.org/x/crypto/ssh"

	"hangar.dev/hangar/services/internal/store"
)

// tool runs a command-line tool the test cross-checks against, skipping
// the test when it is not installed.
func tool(t *testing.T, stdin []byte, name string, args ...string) string {
	t.Helper()
	path, err := exec.LookPath(name)
	if err != nil {
		t.Skipf("%s is not installed (Debian: openssh-client, openssl, putty-tools)", name)
	}
	cmd := exec.Command(path, args...)
	if stdin != nil {
		cmd.Stdin = strings.NewReader(string(stdin))
	}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return strings.TrimSpace(string(out))
}

func writeFile(t *testing.T, name, data string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, []byte(data), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// opensslDigest extracts the colon hex of "(stdin)= ab:cd:…" or "SHA1(stdin)= …".
func opensslDigest(out string) string {
	_, after, _ := strings.Cut(out, "= ")
	return strings.TrimSpace(after)
}

func TestCreateKeyPairRSA(t *testing.T) {
	s := newSvc(t)
	out, err := s.CreateKeyPair(bg, &ec2.CreateKeyPairInput{KeyName: ptr("deploy"), TagSpecifications: tagSpec(types.ResourceTypeKeyPair, "team", "infra")})
	if err != nil {
		t.Fatal(err)
	}
	encodes(t, "CreateKeyPair", out)
	if !strings.HasPrefix(*out.KeyPairId, "key-") || *out.KeyName != "deploy" || len(out.Tags) != 1 {
		t.Fatalf("output = %+v", out)
	}
	block, _ := pem.Decode([]byte(*out.KeyMaterial))
	if block == nil || block.Type != "RSA PRIVATE KEY" {
		t.Fatalf("RSA key material is not PKCS#1 PEM: %.60q", *out.KeyMaterial)
	}
	k, err := x509.ParsePKCS1PrivateKey(block.Bytes)
	if err != nil || k.N.BitLen() != 2048 {
		t.Fatalf("private key: %v (%d bits)", err, k.N.BitLen())
	}
	der, _ := x509.MarshalPKCS8PrivateKey(k)
	sum := sha1.Sum(der)
	if *out.KeyFingerprint != colonHex(sum[:]) || len(*out.KeyFingerprint) != 59 {
		t.Fatalf("fingerprint %s, want SHA-1 of the PKCS#8 DER %s", *out.KeyFingerprint, colonHex(sum[:]))
	}

	// The private key is never stored: nothing in the state file holds it.
	for kind, recs := range snapshot(t, s) {
		for id, v := range recs {
			if strings.Contains(v, "PRIVATE") || strings.Contains(v, base64.StdEncoding.EncodeToString(k.D.Bytes())[:20]) {
				t.Fatalf("%s/%s holds private key material", kind, id)
			}
		}
	}

	// The public key kept matches the private key handed out.
	var rec *keyPairRecord
	must[any](t)(nil, s.db.View(func(tx *store.Tx) (err error) { rec, err = keyPairByName(tx, "deploy"); return err }))
	signer, _ := ssh.NewSignerFromKey(k)
	if !strings.HasPrefix(rec.PublicKey, strings.TrimSpace(string(ssh.MarshalAuthorizedKey(signer.PublicKey())))) {
		t.Fatalf("public key %q does not match the private key", rec.PublicKey)
	}

	t.Run("openssl agrees", func(t *testing.T) {
		path := writeFile(t, "deploy.pem", *out.KeyMaterial)
		der := tool(t, nil, "sh", "-c", "openssl pkcs8 -in "+path+" -inform PEM -outform DER -topk8 -nocrypt | openssl sha1 -c")
		if got := opensslDigest(der); got != *out.KeyFingerprint {
			t.Fatalf("openssl says %s, EC2 fingerprint %s", got, *out.KeyFingerprint)
		}
	})
}

func TestCreateKeyPairED25519(t *testing.T) {
	s := newSvc(t)
	out, err := s.CreateKeyPair(bg, &ec2.CreateKeyPairInput{KeyName: ptr("ed"), KeyType: types.KeyTypeEd25519})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(*out.KeyMaterial, "-----BEGIN OPENSSH PRIVATE KEY-----") {
		t.Fatalf("ED25519 material is not an OpenSSH key: %.60q", *out.KeyMaterial)
	}
	key, err := ssh.ParseRawPrivateKey([]byte(*out.KeyMaterial))
	if err != nil {
		t.Fatal(err)
	}
	signer, _ := ssh.NewSignerFromKey(key)
	fp := ssh.FingerprintSHA256(signer.PublicKey()) // "SHA256:" + unpadded base64
	if want := strings.TrimPrefix(fp, "SHA256:") + "="; *out.KeyFingerprint != want {
		t.Fatalf("fingerprint %s, want %s", *out.KeyFingerprint, want)
	}
	t.Run("ssh-keygen agrees", func(t *testing.T) {
		path := writeFile(t, "ed.pem", *out.KeyMaterial)
		line := tool(t, nil, "ssh-keygen", "-l", "-E", "sha256", "-f", path)
		fields := strings.Fields(line) // 256 SHA256:xxxx comment (ED25519)
		if len(fields) < 2 || strings.TrimPrefix(fields[1], "SHA256:")+"=" != *out.KeyFingerprint {
			t.Fatalf("ssh-keygen says %q, EC2 fingerprint %s", line, *out.KeyFingerprint)
		}
	})
}

func TestCreateKeyPairPPK(t *testing.T) {
	s := newSvc(t)
	for _, kt := range []types.KeyType{types.KeyTypeRsa, types.KeyTypeEd25519} {
		name := "putty-" + string(kt)
		out, err := s.CreateKeyPair(bg, &ec2.CreateKeyPairInput{KeyName: &name, KeyType: kt, KeyFormat: types.KeyFormatPpk})
		if err != nil {
			t.Fatal(err)
		}
		if !strings.HasPrefix(*out.KeyMaterial, "PuTTY-User-Key-File-2: ") || !strings.Contains(*out.KeyMaterial, "Private-MAC: ") {
			t.Fatalf("not a PPK: %.80q", *out.KeyMaterial)
		}
		var rec *keyPairRecord
		must[any](t)(nil, s.db.View(func(tx *store.Tx) (err error) { rec, err = keyPairByName(tx, name); return err }))
		t.Run(string(kt)+" puttygen reads it", func(t *testing.T) {
			// puttygen checks the MAC, so a wrong private blob fails here.
			path := writeFile(t, name+".ppk", *out.KeyMaterial)
			pub := tool(t, nil, "puttygen", path, "-O", "public-openssh")
			if strings.Fields(pub)[1] != strings.Fields(rec.PublicKey)[1] {
				t.Fatalf("puttygen public key %q, stored %q", pub, rec.PublicKey)
			}
			// The fingerprint is EC2's for the key's type.
			if kt == types.KeyTypeRsa && len(*out.KeyFingerprint) != 59 || kt == types.KeyTypeEd25519 && len(*out.KeyFingerprint) != 44 {
				t.Fatalf("fingerprint %q", *out.KeyFingerprint)
			}
		})
	}
}

func TestCreateKeyPairErrors(t *testing.T) {
	s := newSvc(t)
	must[*ec2.CreateKeyPairOutput](t)(s.CreateKeyPair(bg, &ec2.CreateKeyPairInput{KeyName: ptr("taken")}))
	for _, tc := range []struct {
		name string
		in   ec2.CreateKeyPairInput
		code string
	}{
		{"a taken name", ec2.CreateKeyPairInput{KeyName: ptr("taken")}, "InvalidKeyPair.Duplicate"},
		{"an empty name", ec2.CreateKeyPairInput{KeyName: ptr("")}, "InvalidParameterValue"},
		{"a name of 256 characters", ec2.CreateKeyPairInput{KeyName: ptr(strings.Repeat("k", 256))}, "InvalidParameterValue"},
		{"a leading space", ec2.CreateKeyPairInput{KeyName: ptr(" k")}, "InvalidParameterValue"},
		{"a non-ASCII name", ec2.CreateKeyPairInput{KeyName: ptr("clé")}, "InvalidParameterValue"},
		{"a DSA key", ec2.CreateKeyPairInput{KeyName: ptr("d"), KeyType: "dsa"}, "InvalidParameterValue"},
		{"a JKS key", ec2.CreateKeyPairInput{KeyName: ptr("d"), KeyFormat: "jks"}, "InvalidParameterValue"},
		{"tags for an instance", ec2.CreateKeyPairInput{KeyName: ptr("d"), TagSpecifications: tagSpec(types.ResourceTypeInstance, "a", "b")}, "InvalidParameterValue"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := snapshot(t, s)
			_, err := s.CreateKeyPair(bg, &tc.in)
			wantCode(t, err, tc.code)
			sameState(t, before, snapshot(t, s), "a failed CreateKeyPair")
		})
	}
}

// publicKeys makes one public key of each kind ImportKeyPair takes, with
// the fingerprint EC2 gives each.
func publicKeys(t *testing.T) map[string]struct {
	pub ssh.PublicKey
	fp  string
} {
	t.Helper()
	out := map[string]struct {
		pub ssh.PublicKey
		fp  string
	}{}
	rsaKey, _ := rsa.GenerateKey(rand.Reader, 3072)
	edPub, _, _ := ed25519.GenerateKey(rand.Reader)
	ecKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	for name, k := range map[string]any{"rsa": &rsaKey.PublicKey, "ed25519": edPub, "ecdsa": &ecKey.PublicKey} {
		pub, err := ssh.NewPublicKey(k)
		if err != nil {
			t.Fatal(err)
		}
		var fp string
		if name == "ed25519" {
			fp = strings.TrimPrefix(ssh.FingerprintSHA256(pub), "SHA256:") + "="
		} else {
			der, _ := x509.MarshalPKIXPublicKey(k)
			sum := md5.Sum(der)
			fp = colonHex(sum[:])
		}
		out[name] = struct {
			pub ssh.PublicKey
			fp  string
		}{pub, fp}
	}
	return out
}

func TestImportKeyPair(t *testing.T) {
	s := newSvc(t)
	keys := publicKeys(t)
	rsaPub := keys["rsa"].pub
	rsaDER, _ := x509.MarshalPKIXPublicKey(rsaPub.(ssh.CryptoPublicKey).CryptoPublicKey())
	authorized := func(p ssh.PublicKey, comment string) []byte {
		return []byte(strings.TrimSpace(string(ssh.MarshalAuthorizedKey(p))) + " " + comment + "\n")
	}
	rfc4716 := "---- BEGIN SSH2 PUBLIC KEY ----\nComment: \"3072-bit RSA, converted by me@host from OpenSSH\"\n" +
		wrap(base64.StdEncoding.EncodeToString(rsaPub.Marshal()), 70) + "\n---- END SSH2 PUBLIC KEY ----\n"
	for _, tc := range []struct {
		name     string
		material []byte
		keyType  types.KeyType
		fp       string
	}{
		{"an OpenSSH RSA line", authorized(rsaPub, "me@laptop"), types.KeyTypeRsa, keys["rsa"].fp},
		{"an OpenSSH ED25519 line", authorized(keys["ed25519"].pub, "me@laptop"), types.KeyTypeEd25519, keys["ed25519"].fp},
		{"an OpenSSH ECDSA line", authorized(keys["ecdsa"].pub, "me@laptop"), keyTypeECDSA, keys["ecdsa"].fp},
		{"an RFC 4716 file", []byte(rfc4716), types.KeyTypeRsa, keys["rsa"].fp},
		{"a PEM public key", pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: rsaDER}), types.KeyTypeRsa, keys["rsa"].fp},
		{"base64 DER", []byte(base64.StdEncoding.EncodeToString(rsaDER)), types.KeyTypeRsa, keys["rsa"].fp},
		{"an OpenSSH line base64-encoded once more", []byte(base64.StdEncoding.EncodeToString(authorized(keys["ed25519"].pub, "x"))), types.KeyTypeEd25519, keys["ed25519"].fp},
	} {
		t.Run(tc.name, func(t *testing.T) {
			name := strings.ReplaceAll(tc.name, " ", "-")
			out, err := s.ImportKeyPair(bg, &ec2.ImportKeyPairInput{KeyName: &name, PublicKeyMaterial: tc.material, TagSpecifications: tagSpec(types.ResourceTypeKeyPair, "src", "import")})
			if err != nil {
				t.Fatal(err)
			}
			encodes(t, "ImportKeyPair", out)
			if *out.KeyFingerprint != tc.fp || len(out.Tags) != 1 {
				t.Fatalf("fingerprint %s, want %s (%+v)", *out.KeyFingerprint, tc.fp, out)
			}
			d := must[*ec2.DescribeKeyPairsOutput](t)(s.DescribeKeyPairs(bg, &ec2.DescribeKeyPairsInput{KeyNames: []string{name}, IncludePublicKey: ptr(true)}))
			k := d.KeyPairs[0]
			if k.KeyType != tc.keyType || *k.KeyFingerprint != tc.fp || *k.KeyPairId != *out.KeyPairId {
				t.Fatalf("described = %+v", k)
			}
			pub, _, _, _, err := ssh.ParseAuthorizedKey([]byte(*k.PublicKey))
			if err != nil {
				t.Fatalf("PublicKey %q is not an authorized_keys line: %v", *k.PublicKey, err)
			}
			if string(pub.Marshal()) == "" {
				t.Fatal("empty key")
			}
		})
	}

	// An ssh-dss key, written by hand: x/crypto/ssh no longer makes them.
	var dsaWire []byte
	dsaWire = appendString(dsaWire, []byte("ssh-dss"))
	for _, v := range []int64{23, 11, 4, 9} {
		dsaWire = appendMPInt(dsaWire, big.NewInt(v))
	}
	dsaLine := []byte("ssh-dss " + base64.StdEncoding.EncodeToString(dsaWire) + " old\n")
	// Go refuses to generate RSA keys under 1024 bits; a 768-bit modulus
	// is enough to be refused for its size.
	n768, _ := rand.Prime(rand.Reader, 768)
	smallPub, err := ssh.NewPublicKey(&rsa.PublicKey{N: n768, E: 65537})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, key string
		material  []byte
		code      string
	}{
		{"garbage", "g", []byte("not a key at all"), "InvalidKeyPair.Format"},
		{"a truncated key", "t", []byte("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAI"), "InvalidKeyPair.Format"},
		{"a DSA key", "d", dsaLine, "InvalidKeyPair.Format"},
		{"a 768-bit RSA key", "s", authorized(smallPub, "small"), "InvalidKeyPair.Format"},
		{"an empty key", "e", []byte("  \n"), "InvalidParameterValue"},
		{"a taken name", "an-OpenSSH-RSA-line", authorized(rsaPub, "x"), "InvalidKeyPair.Duplicate"},
		{"a bad name", "", authorized(rsaPub, "x"), "InvalidParameterValue"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := snapshot(t, s)
			_, err := s.ImportKeyPair(bg, &ec2.ImportKeyPairInput{KeyName: &tc.key, PublicKeyMaterial: tc.material})
			wantCode(t, err, tc.code)
			sameState(t, before, snapshot(t, s), "a failed ImportKeyPair")
		})
	}
}

func wrap(s string, n int) string {
	var b strings.Builder
	for i := 0; i < len(s); i += n {
		if i > 0 {
			b.WriteByte('\n')
		}
		b.WriteString(s[i:min(i+n, len(s))])
	}
	return b.String()
}

// TestImportKeyPairToolFingerprints imports keys ssh-keygen made and checks
// the fingerprints against the commands EC2's user guide gives.
func TestImportKeyPairToolFingerprints(t *testing.T) {
	s := newSvc(t)
	for _, kt := range []string{"rsa", "ed25519", "ecdsa"} {
		t.Run(kt, func(t *testing.T) {
			dir := t.TempDir()
			key := filepath.Join(dir, "id_"+kt)
			tool(t, nil, "ssh-keygen", "-q", "-t", kt, "-N", "", "-C", "me@host", "-f", key)
			pub, err := os.ReadFile(key + ".pub")
			if err != nil {
				t.Fatal(err)
			}
			out, err := s.ImportKeyPair(bg, &ec2.ImportKeyPairInput{KeyName: ptr("tool-" + kt), PublicKeyMaterial: pub})
			if err != nil {
				t.Fatal(err)
			}
			var want string
			if kt == "ed25519" {
				fields := strings.Fields(tool(t, nil, "ssh-keygen", "-l", "-E", "sha256", "-f", key+".pub"))
				want = strings.TrimPrefix(fields[1], "SHA256:") + "="
			} else {
				// ssh-keygen writes OpenSSH private keys; convert to PEM for openssl.
				pemKey := filepath.Join(dir, "pem")
				raw, _ := os.ReadFile(key)
				os.WriteFile(pemKey, raw, 0o600)
				tool(t, nil, "ssh-keygen", "-p", "-q", "-N", "", "-P", "", "-m", "PEM", "-f", pemKey)
				want = opensslDigest(tool(t, nil, "sh", "-c", "openssl pkey -in "+pemKey+" -pubout -outform DER | openssl md5 -c"))
			}
			if *out.KeyFingerprint != want {
				t.Fatalf("fingerprint %s, tools say %s", *out.KeyFingerprint, want)
			}
			// An RFC 4716 export of the same key imports with the same fingerprint.
			rfc := tool(t, nil, "ssh-keygen", "-e", "-f", key+".pub")
			again, err := s.ImportKeyPair(bg, &ec2.ImportKeyPairInput{KeyName: ptr("tool-rfc-" + kt), PublicKeyMaterial: []byte(rfc)})
			if err != nil || *again.KeyFingerprint != want {
				t.Fatalf("RFC 4716 import: %v %+v", err, again)
			}
		})
	}
}

func TestDescribeAndDeleteKeyPairs(t *testing.T) {
	s := newSvc(t)
	a := must[*ec2.CreateKeyPairOutput](t)(s.CreateKeyPair(bg, &ec2.CreateKeyPairInput{KeyName: ptr("alpha"), KeyType: types.KeyTypeEd25519, TagSpecifications: tagSpec(types.ResourceTypeKeyPair, "env", "prod")}))
	b := must[*ec2.CreateKeyPairOutput](t)(s.CreateKeyPair(bg, &ec2.CreateKeyPairInput{KeyName: ptr("beta"), KeyType: types.KeyTypeEd25519}))

	all := must[*ec2.DescribeKeyPairsOutput](t)(s.DescribeKeyPairs(bg, &ec2.DescribeKeyPairsInput{}))
	encodes(t, "DescribeKeyPairs", all)
	if len(all.KeyPairs) != 2 || *all.KeyPairs[0].KeyName != "alpha" || all.KeyPairs[0].PublicKey != nil || all.KeyPairs[0].CreateTime == nil {
		t.Fatalf("all = %+v", all.KeyPairs)
	}
	for _, tc := range []struct {
		in   ec2.DescribeKeyPairsInput
		want []string
		code string
	}{
		{in: ec2.DescribeKeyPairsInput{KeyNames: []string{"beta"}}, want: []string{"beta"}},
		{in: ec2.DescribeKeyPairsInput{KeyPairIds: []string{*a.KeyPairId}}, want: []string{"alpha"}},
		{in: ec2.DescribeKeyPairsInput{KeyNames: []string{"beta"}, KeyPairIds: []string{*a.KeyPairId}}, want: []string{"alpha", "beta"}},
		{in: ec2.DescribeKeyPairsInput{Filters: []types.Filter{filter("fingerprint", *b.KeyFingerprint)}}, want: []string{"beta"}},
		{in: ec2.DescribeKeyPairsInput{Filters: []types.Filter{filter("key-name", "al*")}}, want: []string{"alpha"}},
		{in: ec2.DescribeKeyPairsInput{Filters: []types.Filter{filter("key-pair-id", *b.KeyPairId)}}, want: []string{"beta"}},
		{in: ec2.DescribeKeyPairsInput{Filters: []types.Filter{filter("tag:env", "prod")}}, want: []string{"alpha"}},
		{in: ec2.DescribeKeyPairsInput{Filters: []types.Filter{filter("tag-key", "env")}}, want: []string{"alpha"}},
		{in: ec2.DescribeKeyPairsInput{KeyNames: []string{"gamma"}}, code: "InvalidKeyPair.NotFound"},
		{in: ec2.DescribeKeyPairsInput{KeyPairIds: []string{"key-0123456789abcdef0"}}, code: "InvalidKeyPair.NotFound"},
		{in: ec2.DescribeKeyPairsInput{Filters: []types.Filter{filter("owner", "x")}}, code: "InvalidParameterValue"},
	} {
		out, err := s.DescribeKeyPairs(bg, &tc.in)
		wantCode(t, err, tc.code)
		if err != nil {
			continue
		}
		var got []string
		for _, k := range out.KeyPairs {
			got = append(got, *k.KeyName)
		}
		if strings.Join(got, ",") != strings.Join(tc.want, ",") {
			t.Errorf("%+v: got %v, want %v", tc.in, got, tc.want)
		}
	}
	withKey := must[*ec2.DescribeKeyPairsOutput](t)(s.DescribeKeyPairs(bg, &ec2.DescribeKeyPairsInput{KeyNames: []string{"alpha"}, IncludePublicKey: ptr(true)}))
	if !strings.HasPrefix(*withKey.KeyPairs[0].PublicKey, "ssh-ed25519 AAAA") || !strings.HasSuffix(*withKey.KeyPairs[0].PublicKey, " alpha") {
		t.Fatalf("public key = %q", *withKey.KeyPairs[0].PublicKey)
	}

	// Key pairs are tagged by their key-… id.
	must[*ec2.CreateTagsOutput](t)(s.CreateTags(bg, &ec2.CreateTagsInput{Resources: []string{*b.KeyPairId}, Tags: []types.Tag{{Key: ptr("env"), Value: ptr("dev")}}}))
	tags := must[*ec2.DescribeTagsOutput](t)(s.DescribeTags(bg, &ec2.DescribeTagsInput{Filters: []types.Filter{filter("resource-type", "key-pair")}}))
	if len(tags.Tags) != 2 {
		t.Fatalf("key pair tags = %+v", tags.Tags)
	}

	_, err := s.DeleteKeyPair(bg, &ec2.DeleteKeyPairInput{})
	wantCode(t, err, "MissingParameter")
	_, err = s.DeleteKeyPair(bg, &ec2.DeleteKeyPairInput{KeyPairId: ptr("key-zz")})
	wantCode(t, err, "InvalidParameterValue")
	del := must[*ec2.DeleteKeyPairOutput](t)(s.DeleteKeyPair(bg, &ec2.DeleteKeyPairInput{KeyName: ptr("alpha")}))
	if *del.KeyPairId != *a.KeyPairId || !*del.Return {
		t.Fatalf("delete = %+v", del)
	}
	must[*ec2.DeleteKeyPairOutput](t)(s.DeleteKeyPair(bg, &ec2.DeleteKeyPairInput{KeyPairId: b.KeyPairId}))
	// Deleting again, or a name never seen, succeeds, as in EC2.
	before := snapshot(t, s)
	for _, in := range []ec2.DeleteKeyPairInput{{KeyName: ptr("alpha")}, {KeyPairId: b.KeyPairId}, {KeyName: ptr("never")}} {
		if _, err := s.DeleteKeyPair(bg, &in); err != nil {
			t.Fatalf("repeat delete %+v: %v", in, err)
		}
	}
	sameState(t, before, snapshot(t, s), "deleting what is gone")
	left := must[*ec2.DescribeKeyPairsOutput](t)(s.DescribeKeyPairs(bg, &ec2.DescribeKeyPairsInput{}))
	if len(left.KeyPairs) != 0 {
		t.Fatalf("left = %+v", left.KeyPairs)
	}
	// The name is free again, with a new id; the tags did not survive.
	again := must[*ec2.CreateKeyPairOutput](t)(s.CreateKeyPair(bg, &ec2.CreateKeyPairInput{KeyName: ptr("alpha")}))
	if *again.KeyPairId == *a.KeyPairId || len(again.Tags) != 0 {
		t.Fatalf("recreated = %+v", again)
	}
}
