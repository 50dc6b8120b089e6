package ec2

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/md5"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha1"
	"crypto/sha256"
	"crypto/x509"
	"encoding/base64"
	"encoding/pem"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"
	"golang.org/x/crypto/ssh"

	"hangar.dev/hangar/services/gateway/awserr"
	"hangar.dev/hangar/services/internal/store"
)

// Key pairs are stored by their key-… id, so they can be tagged by id as
// in EC2; the key-names bucket maps each name (how most calls address a
// key pair) to its id.
var kindKeyPair = register(&kind{Prefix: "key", ResourceType: types.ResourceTypeKeyPair, NotFound: "InvalidKeyPair.NotFound", Malformed: "InvalidParameterValue", Noun: "key pair"})

const bucketKeyNames = "key-names"

// keyTypeECDSA is what hangar reports for an imported ECDSA key. EC2's
// KeyType enum has only rsa and ed25519 (EC2 refuses ECDSA keys); hangar
// accepts them because every sshd a guest runs does.
const keyTypeECDSA = types.KeyType("ecdsa")

// keyPairRecord is a key pair as stored: the public half only. The private
// key of a created pair is returned once and never written anywhere.
type keyPairRecord struct {
	KeyPairID   string
	KeyName     string
	KeyType     types.KeyType
	Fingerprint string
	// PublicKey is the OpenSSH authorized_keys line ("ssh-ed25519 AAAA…
	// comment"), what IMDS serves as public-keys/0/openssh-key.
	PublicKey string
	Imported  bool
	Created   time.Time
}

func (k *keyPairRecord) view(tags []types.Tag, withPublic bool) types.KeyPairInfo {
	out := types.KeyPairInfo{
		KeyPairId:      ptr(k.KeyPairID),
		KeyName:        ptr(k.KeyName),
		KeyType:        k.KeyType,
		KeyFingerprint: ptr(k.Fingerprint),
		CreateTime:     ptr(k.Created),
		Tags:           tags,
	}
	if out.Tags == nil {
		out.Tags = []types.Tag{}
	}
	if withPublic {
		out.PublicKey = ptr(k.PublicKey)
	}
	return out
}

// keyPairByName returns the key pair called name, or InvalidKeyPair.NotFound.
// RunInstances uses it to put the public key on the instance.
func keyPairByName(tx *store.Tx, name string) (*keyPairRecord, error) {
	var id string
	if err := tx.Get(bucketKeyNames, name, &id); err != nil {
		return nil, awserr.New(400, "InvalidKeyPair.NotFound", "The key pair '%s' does not exist", clip(name))
	}
	return get[keyPairRecord](tx, kindKeyPair, id)
}

// checkKeyName applies EC2's rules for key names: 1 to 255 ASCII
// characters, no leading or trailing spaces.
func checkKeyName(name string) error {
	switch {
	case name == "":
		return awserr.InvalidParameterValue("Value () for parameter keyName is invalid. Empty key name not allowed.")
	case len(name) > 255:
		return awserr.InvalidParameterValue("Value (%s) for parameter keyName is invalid. Length exceeds maximum of 255.", clip(name))
	case strings.TrimSpace(name) != name:
		return awserr.InvalidParameterValue("Value (%s) for parameter keyName is invalid. The key name cannot have leading or trailing spaces.", clip(name))
	}
	for _, c := range name {
		if c > 127 || c < 32 {
			return awserr.InvalidParameterValue("Value (%s) for parameter keyName is invalid. Character sets beyond ASCII are not supported.", clip(name))
		}
	}
	return nil
}

// colonHex writes a digest as EC2 writes MD5 and SHA-1 fingerprints.
func colonHex(sum []byte) string {
	var b strings.Builder
	for i, c := range sum {
		if i > 0 {
			b.WriteByte(':')
		}
		fmt.Fprintf(&b, "%02x", c)
	}
	return b.String()
}

// sha256Fingerprint is EC2's ED25519 fingerprint: the base64 SHA-256 of the
// SSH wire-format public key, as ssh-keygen -l -E sha256 prints it but with
// the base64 padding EC2 keeps (its user guide: "Amazon EC2 might append
// padding to the fingerprint with = characters. Other tools, such as
// ssh-keygen, might omit this padding.").
func sha256Fingerprint(pub ssh.PublicKey) string {
	sum := sha256.Sum256(pub.Marshal())
	return base64.StdEncoding.EncodeToString(sum[:])
}

// createdRSAFingerprint is EC2's fingerprint of an RSA key it created: the
// SHA-1 of the private key's PKCS#8 DER encoding, colon hex (what
// `openssl pkcs8 -topk8 -nocrypt -outform DER | openssl sha1 -c` prints).
func createdRSAFingerprint(k *rsa.PrivateKey) (string, error) {
	der, err := x509.MarshalPKCS8PrivateKey(k)
	if err != nil {
		return "", fmt.Errorf("encoding the private key as PKCS#8: %w", err)
	}
	sum := sha1.Sum(der)
	return colonHex(sum[:]), nil
}

// importedFingerprint is EC2's fingerprint of an imported public key: for
// ED25519 the SHA-256 form; for RSA (and the ECDSA keys hangar also takes)
// the MD5 of the DER public key (PKIX), colon hex, what `openssl pkey
// -pubout -outform DER | openssl md5 -c` prints.
func importedFingerprint(pub ssh.PublicKey) (string, error) {
	if pub.Type() == ssh.KeyAlgoED25519 {
		return sha256Fingerprint(pub), nil
	}
	cp, ok := pub.(ssh.CryptoPublicKey)
	if !ok {
		return "", fmt.Errorf("public key of type %s has no crypto form", pub.Type())
	}
	der, err := x509.MarshalPKIXPublicKey(cp.CryptoPublicKey())
	if err != nil {
		return "", fmt.Errorf("encoding the public key as PKIX: %w", err)
	}
	sum := md5.Sum(der)
	return colonHex(sum[:]), nil
}

// authorizedLine is the OpenSSH authorized_keys form of pub.
func authorizedLine(pub ssh.PublicKey, comment string) string {
	line := strings.TrimSpace(string(ssh.MarshalAuthorizedKey(pub)))
	if comment != "" {
		line += " " + comment
	}
	return line
}

// generated is a key pair CreateKeyPair made.
type generated struct {
	keyType     types.KeyType
	material    string // the private key, in the format asked for
	fingerprint string
	public      ssh.PublicKey
}

// generateKey makes an RSA (2048-bit, as EC2) or ED25519 key and renders
// the private key as EC2 does: PEM (PKCS#1 for RSA, OpenSSH for ED25519)
// or PuTTY's PPK.
func generateKey(keyType types.KeyType, format types.KeyFormat, name string) (*generated, error) {
	g := &generated{keyType: keyType}
	var signer any
	switch keyType {
	case types.KeyTypeRsa:
		k, err := rsa.GenerateKey(rand.Reader, 2048)
		if err != nil {
			return nil, fmt.Errorf("generating an RSA key: %w", err)
		}
		if g.fingerprint, err = createdRSAFingerprint(k); err != nil {
			return nil, err
		}
		signer = k
		if format == types.KeyFormatPem {
			g.material = string(pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(k)}))
		}
	case types.KeyTypeEd25519:
		_, k, err := ed25519.GenerateKey(rand.Reader)
		if err != nil {
			return nil, fmt.Errorf("generating an ED25519 key: %w", err)
		}
		signer = k
		if format == types.KeyFormatPem {
			block, err := ssh.MarshalPrivateKey(k, "")
			if err != nil {
				return nil, fmt.Errorf("encoding the ED25519 key: %w", err)
			}
			g.material = string(pem.EncodeToMemory(block))
		}
	default:
		return nil, awserr.InvalidParameterValue("Value (%s) for parameter keyType is invalid. Expected one of: rsa, ed25519.", clip(string(keyType)))
	}
	s, err := ssh.NewSignerFromKey(signer)
	if err != nil {
		return nil, fmt.Errorf("deriving the public key: %w", err)
	}
	g.public = s.PublicKey()
	if keyType == types.KeyTypeEd25519 {
		g.fingerprint = sha256Fingerprint(g.public)
	}
	if format == types.KeyFormatPpk {
		if g.material, err = ppk(signer, name); err != nil {
			return nil, err
		}
	}
	return g, nil
}

// CreateKeyPair makes a key pair and returns its private key, once.
func (s *Service) CreateKeyPair(ctx context.Context, in *ec2.CreateKeyPairInput) (*ec2.CreateKeyPairOutput, error) {
	name := deref(in.KeyName)
	if err := checkKeyName(name); err != nil {
		return nil, err
	}
	keyType := in.KeyType
	if keyType == "" {
		keyType = types.KeyTypeRsa
	}
	format := in.KeyFormat
	switch format {
	case "":
		format = types.KeyFormatPem
	case types.KeyFormatPem, types.KeyFormatPpk:
	default:
		return nil, awserr.InvalidParameterValue("Value (%s) for parameter keyFormat is invalid. Expected one of: pem, ppk.", clip(string(format)))
	}
	tags, err := tagSpecs(in.TagSpecifications, types.ResourceTypeKeyPair)
	if err != nil {
		return nil, err
	}
	// The name is checked before the (slow) key generation and again in the
	// transaction that claims it.
	if err := s.db.View(func(tx *store.Tx) error { return keyNameFree(tx, name) }); err != nil {
		return nil, err
	}
	g, err := generateKey(keyType, format, name)
	if err != nil {
		return nil, err
	}
	rec := &keyPairRecord{KeyName: name, KeyType: keyType, Fingerprint: g.fingerprint, PublicKey: authorizedLine(g.public, name), Created: s.now().UTC().Truncate(time.Millisecond)}
	out := &ec2.CreateKeyPairOutput{KeyName: ptr(name), KeyFingerprint: ptr(g.fingerprint), KeyMaterial: ptr(g.material)}
	err = s.db.Update(func(tx *store.Tx) error {
		if err := s.putKeyPair(tx, rec, tags); err != nil {
			return err
		}
		out.KeyPairId, out.Tags = ptr(rec.KeyPairID), tagsOf(tx, rec.KeyPairID)
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

func keyNameFree(tx *store.Tx, name string) error {
	if tx.Has(bucketKeyNames, name) {
		return awserr.New(400, "InvalidKeyPair.Duplicate", "The keypair '%s' already exists.", name)
	}
	return nil
}

// putKeyPair claims rec's name, gives it an id and stores it with its tags.
func (s *Service) putKeyPair(tx *store.Tx, rec *keyPairRecord, tags []types.Tag) error {
	if err := keyNameFree(tx, rec.KeyName); err != nil {
		return err
	}
	id, err := newID(tx, kindKeyPair.Prefix)
	if err != nil {
		return err
	}
	rec.KeyPairID = id
	if err := put(tx, kindKeyPair, id, rec); err != nil {
		return err
	}
	if err := tx.Put(bucketKeyNames, rec.KeyName, id); err != nil {
		return err
	}
	if len(tags) > 0 {
		return addTags(tx, id, tags)
	}
	return nil
}

var errKeyFormat = awserr.New(400, "InvalidKeyPair.Format", "Key is not in valid OpenSSH public key format")

// parsePublicKey reads public key material in the forms EC2 accepts: an
// OpenSSH authorized_keys line, an RFC 4716 SSH2 public key file, or a
// DER public key (PKIX or PKCS#1), base64 or PEM. The material may arrive
// base64-encoded once more than the protocol needs (some tools encode it
// before the SDK does); that is undone too.
func parsePublicKey(raw []byte) (ssh.PublicKey, string, error) {
	return parsePublicKeyDepth(raw, 0)
}

func parsePublicKeyDepth(raw []byte, depth int) (ssh.PublicKey, string, error) {
	text := bytes.TrimSpace(raw)
	if len(text) == 0 {
		return nil, "", awserr.InvalidParameterValue("Value () for parameter publicKeyMaterial is invalid. The public key is empty.")
	}
	switch {
	case bytes.HasPrefix(text, []byte("---- BEGIN SSH2 PUBLIC KEY ----")):
		return parseRFC4716(text)
	case bytes.HasPrefix(text, []byte("-----BEGIN")):
		block, _ := pem.Decode(text)
		if block == nil {
			return nil, "", errKeyFormat
		}
		pub, err := parseDER(block.Bytes)
		return pub, "", err
	}
	if pub, comment, _, _, err := ssh.ParseAuthorizedKey(text); err == nil {
		return pub, comment, nil
	}
	if depth == 0 {
		if dec, err := base64.StdEncoding.DecodeString(string(text)); err == nil {
			if pub, err := parseDER(dec); err == nil {
				return pub, "", nil
			}
			return parsePublicKeyDepth(dec, depth+1)
		}
	}
	return nil, "", errKeyFormat
}

func parseDER(der []byte) (ssh.PublicKey, error) {
	var key any
	if k, err := x509.ParsePKIXPublicKey(der); err == nil {
		key = k
	} else if k, err := x509.ParsePKCS1PublicKey(der); err == nil {
		key = k
	} else {
		return nil, errKeyFormat
	}
	pub, err := ssh.NewPublicKey(key)
	if err != nil {
		return nil, errKeyFormat
	}
	return pub, nil
}

// parseRFC4716 reads "---- BEGIN SSH2 PUBLIC KEY ----" files: header lines
// ("Comment: …", continued with a trailing backslash), then base64.
func parseRFC4716(text []byte) (ssh.PublicKey, string, error) {
	lines := strings.Split(strings.ReplaceAll(string(text), "\r\n", "\n"), "\n")
	var (
		body     strings.Builder
		comment  string
		inHeader = true
		cont     bool
		ended    bool
	)
	for _, line := range lines[1:] {
		line = strings.TrimSpace(line)
		if line == "---- END SSH2 PUBLIC KEY ----" {
			ended = true
			break
		}
		if cont {
			cont = strings.HasSuffix(line, `\`)
			continue
		}
		if inHeader && strings.Contains(line, ":") {
			k, v, _ := strings.Cut(line, ":")
			if strings.EqualFold(strings.TrimSpace(k), "Comment") {
				comment = strings.Trim(strings.TrimSpace(v), `"`)
			}
			cont = strings.HasSuffix(line, `\`)
			continue
		}
		inHeader = false
		body.WriteString(line)
	}
	if !ended {
		return nil, "", errKeyFormat
	}
	wire, err := base64.StdEncoding.DecodeString(body.String())
	if err != nil {
		return nil, "", errKeyFormat
	}
	pub, err := ssh.ParsePublicKey(wire)
	if err != nil {
		return nil, "", errKeyFormat
	}
	return pub, comment, nil
}

// importedKeyType checks an imported key is one hangar takes and names it.
func importedKeyType(pub ssh.PublicKey) (types.KeyType, error) {
	switch pub.Type() {
	case ssh.KeyAlgoRSA:
		n := pub.(ssh.CryptoPublicKey).CryptoPublicKey().(*rsa.PublicKey).N.BitLen()
		if n < 1024 || n > 16384 {
			return "", awserr.New(400, "InvalidKeyPair.Format", "RSA keys must be 1024 to 16384 bits long; this one has %d", n)
		}
		return types.KeyTypeRsa, nil
	case ssh.KeyAlgoED25519:
		return types.KeyTypeEd25519, nil
	case ssh.KeyAlgoECDSA256, ssh.KeyAlgoECDSA384, ssh.KeyAlgoECDSA521:
		if _, ok := pub.(ssh.CryptoPublicKey).CryptoPublicKey().(*ecdsa.PublicKey); ok {
			return keyTypeECDSA, nil
		}
	case ssh.KeyAlgoDSA:
		return "", awserr.New(400, "InvalidKeyPair.Format", "DSA keys are not supported. Import an RSA or ED25519 key.")
	}
	return "", awserr.New(400, "InvalidKeyPair.Format", "Key type %s is not supported. Import an RSA, ED25519 or ECDSA key.", clip(pub.Type()))
}

// ImportKeyPair stores the public half of a key pair made elsewhere.
func (s *Service) ImportKeyPair(ctx context.Context, in *ec2.ImportKeyPairInput) (*ec2.ImportKeyPairOutput, error) {
	name := deref(in.KeyName)
	if err := checkKeyName(name); err != nil {
		return nil, err
	}
	if in.PublicKeyMaterial == nil {
		return nil, awserr.MissingParameter("PublicKeyMaterial")
	}
	pub, comment, err := parsePublicKey(in.PublicKeyMaterial)
	if err != nil {
		return nil, err
	}
	keyType, err := importedKeyType(pub)
	if err != nil {
		return nil, err
	}
	fp, err := importedFingerprint(pub)
	if err != nil {
		return nil, err
	}
	tags, err := tagSpecs(in.TagSpecifications, types.ResourceTypeKeyPair)
	if err != nil {
		return nil, err
	}
	rec := &keyPairRecord{KeyName: name, KeyType: keyType, Fingerprint: fp, PublicKey: authorizedLine(pub, comment), Imported: true, Created: s.now().UTC().Truncate(time.Millisecond)}
	out := &ec2.ImportKeyPairOutput{KeyName: ptr(name), KeyFingerprint: ptr(fp)}
	err = s.db.Update(func(tx *store.Tx) error {
		if err := s.putKeyPair(tx, rec, tags); err != nil {
			return err
		}
		out.KeyPairId, out.Tags = ptr(rec.KeyPairID), tagsOf(tx, rec.KeyPairID)
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

var keyPairFilters = filterSet[keyPairRecord]{
	"key-pair-id": func(k *keyPairRecord) []string { return []string{k.KeyPairID} },
	"fingerprint": func(k *keyPairRecord) []string { return []string{k.Fingerprint} },
	"key-name":    func(k *keyPairRecord) []string { return []string{k.KeyName} },
	"key-type":    func(k *keyPairRecord) []string { return []string{string(k.KeyType)} },
}

// DescribeKeyPairs lists key pairs by name or id, sorted by name.
func (s *Service) DescribeKeyPairs(ctx context.Context, in *ec2.DescribeKeyPairsInput) (*ec2.DescribeKeyPairsOutput, error) {
	match, err := keyPairFilters.compile(in.Filters)
	if err != nil {
		return nil, err
	}
	out := &ec2.DescribeKeyPairsOutput{KeyPairs: []types.KeyPairInfo{}}
	withPublic := deref(in.IncludePublicKey)
	err = s.db.View(func(tx *store.Tx) error {
		var recs []*keyPairRecord
		if len(in.KeyNames) == 0 && len(in.KeyPairIds) == 0 {
			all, err := all[keyPairRecord](tx, kindKeyPair, nil)
			if err != nil {
				return err
			}
			for _, k := range all {
				recs = append(recs, k)
			}
		} else {
			seen := map[string]bool{}
			var missing []string
			for _, name := range in.KeyNames {
				var id string
				if err := tx.Get(bucketKeyNames, name, &id); err != nil {
					missing = append(missing, name)
					continue
				}
				if k, err := get[keyPairRecord](tx, kindKeyPair, id); err == nil && !seen[id] {
					seen[id] = true
					recs = append(recs, k)
				}
			}
			if len(missing) > 0 {
				return kindKeyPair.notFound(missing...)
			}
			for _, id := range in.KeyPairIds {
				if err := kindKeyPair.check(id); err != nil {
					return err
				}
				k, err := get[keyPairRecord](tx, kindKeyPair, id)
				if err != nil {
					missing = append(missing, id)
					continue
				}
				if !seen[id] {
					seen[id] = true
					recs = append(recs, k)
				}
			}
			if len(missing) > 0 {
				return kindKeyPair.notFound(missing...)
			}
		}
		sort.Slice(recs, func(i, j int) bool { return recs[i].KeyName < recs[j].KeyName })
		for _, k := range recs {
			tags := tagsOf(tx, k.KeyPairID)
			if match(k, tags) {
				out.KeyPairs = append(out.KeyPairs, k.view(tags, withPublic))
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// DeleteKeyPair deletes a key pair by name or id. Deleting one that does
// not exist succeeds, as in EC2.
func (s *Service) DeleteKeyPair(ctx context.Context, in *ec2.DeleteKeyPairInput) (*ec2.DeleteKeyPairOutput, error) {
	name, id := deref(in.KeyName), deref(in.KeyPairId)
	if name == "" && id == "" {
		return nil, awserr.MissingParameter("KeyName or KeyPairId")
	}
	if id != "" {
		if err := kindKeyPair.check(id); err != nil {
			return nil, err
		}
	}
	out := &ec2.DeleteKeyPairOutput{Return: ptr(true)}
	err := s.db.Update(func(tx *store.Tx) error {
		if id == "" {
			if err := tx.Get(bucketKeyNames, name, &id); err != nil {
				return nil
			}
		}
		if !tx.Has(kindKeyPair.Prefix, id) {
			return nil
		}
		k, err := get[keyPairRecord](tx, kindKeyPair, id)
		if err != nil {
			return err
		}
		if name != "" && k.KeyName != name {
			return awserr.InvalidParameterCombination("The key pair %s is called '%s', not '%s'", id, k.KeyName, clip(name))
		}
		out.KeyPairId = ptr(id)
		if err := tx.Delete(bucketKeyNames, k.KeyName); err != nil {
			return err
		}
		return remove(tx, kindKeyPair, id)
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}
