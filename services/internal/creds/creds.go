// Package creds reads and writes the host's credentials: an AWS
// shared-credentials file (the INI format the aws CLI reads), so the same
// file serves the gateway, which verifies signatures against it, and the
// operator, who points AWS_SHARED_CREDENTIALS_FILE at it.
//
// Each profile is one access key of the host's account. The profile named
// "default" is the account's root key. A profile may carry
// `hangar_access = read-only`, which the aws CLI ignores and the gateway
// enforces. Secrets never appear in errors.
package creds

import (
	"bufio"
	"crypto/rand"
	"fmt"
	"io"
	"math/big"
	"os"
	"sort"
	"strings"

	"hangar.dev/hangar/services/internal/atomicfile"
)

// Access is what a key may do.
type Access string

const (
	FullAccess     Access = "full"
	ReadOnlyAccess Access = "read-only"
)

// Key is one access key.
type Key struct {
	Profile         string
	AccessKeyID     string
	SecretAccessKey string
	SessionToken    string // set only for temporary credentials
	Access          Access
}

// Root reports whether the key is the account's root key.
func (k Key) Root() bool { return k.Profile == "default" }

// Parse reads a shared-credentials file.
func Parse(r io.Reader) ([]Key, error) {
	var (
		keys    []Key
		cur     *Key
		lineNo  int
		scanner = bufio.NewScanner(r)
	)
	flush := func() error {
		if cur == nil {
			return nil
		}
		if cur.AccessKeyID == "" || cur.SecretAccessKey == "" {
			return fmt.Errorf("profile %q: needs both aws_access_key_id and aws_secret_access_key", cur.Profile)
		}
		keys = append(keys, *cur)
		return nil
	}
	for scanner.Scan() {
		lineNo++
		line := strings.TrimSpace(strings.TrimSuffix(scanner.Text(), "\r"))
		if line == "" || line[0] == '#' || line[0] == ';' {
			continue
		}
		if strings.HasPrefix(line, "[") {
			if !strings.HasSuffix(line, "]") {
				return nil, fmt.Errorf("line %d: unterminated profile header", lineNo)
			}
			if err := flush(); err != nil {
				return nil, err
			}
			name := strings.TrimSpace(line[1 : len(line)-1])
			name = strings.TrimSpace(strings.TrimPrefix(name, "profile "))
			if name == "" {
				return nil, fmt.Errorf("line %d: empty profile name", lineNo)
			}
			cur = &Key{Profile: name, Access: FullAccess}
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if !ok {
			return nil, fmt.Errorf("line %d: expected key = value", lineNo)
		}
		if cur == nil {
			return nil, fmt.Errorf("line %d: setting outside any [profile]", lineNo)
		}
		k, v = strings.TrimSpace(k), strings.TrimSpace(v)
		switch strings.ToLower(k) {
		case "aws_access_key_id":
			cur.AccessKeyID = v
		case "aws_secret_access_key":
			cur.SecretAccessKey = v
		case "aws_session_token":
			cur.SessionToken = v
		case "hangar_access":
			switch Access(v) {
			case FullAccess, ReadOnlyAccess:
				cur.Access = Access(v)
			default:
				return nil, fmt.Errorf("line %d: hangar_access must be %q or %q", lineNo, FullAccess, ReadOnlyAccess)
			}
		}
	}
	if err := scanner.Err(); err != nil {
		return nil, err
	}
	if err := flush(); err != nil {
		return nil, err
	}
	return keys, nil
}

// Load reads the credentials file at path. A file readable by group or
// others is refused: the secrets in it are the host's root keys.
func Load(path string) ([]Key, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("reading credentials: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if st.Mode().Perm()&0o077 != 0 {
		return nil, fmt.Errorf("credentials file %s is readable by others (mode %v); it must be 0600", path, st.Mode().Perm())
	}
	keys, err := Parse(f)
	if err != nil {
		return nil, fmt.Errorf("parsing %s: %w", path, err)
	}
	if len(keys) == 0 {
		return nil, fmt.Errorf("credentials file %s holds no keys", path)
	}
	return keys, nil
}

// Format writes keys in shared-credentials form, profiles sorted with
// "default" first.
func Format(keys []Key) string {
	sorted := append([]Key(nil), keys...)
	sort.SliceStable(sorted, func(i, j int) bool {
		if sorted[i].Root() != sorted[j].Root() {
			return sorted[i].Root()
		}
		return sorted[i].Profile < sorted[j].Profile
	})
	var b strings.Builder
	for i, k := range sorted {
		if i > 0 {
			b.WriteString("\n")
		}
		fmt.Fprintf(&b, "[%s]\naws_access_key_id = %s\naws_secret_access_key = %s\n", k.Profile, k.AccessKeyID, k.SecretAccessKey)
		if k.SessionToken != "" {
			fmt.Fprintf(&b, "aws_session_token = %s\n", k.SessionToken)
		}
		if k.Access == ReadOnlyAccess {
			fmt.Fprintf(&b, "hangar_access = %s\n", k.Access)
		}
	}
	return b.String()
}

// Write atomically replaces path with keys, mode 0600.
func Write(path string, keys []Key) error {
	if err := atomicfile.Write(path, []byte(Format(keys)), 0o600, 0o755); err != nil {
		return fmt.Errorf("writing credentials: %w", err)
	}
	return nil
}

const (
	idAlphabet     = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"
	secretAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
)

func randomString(alphabet string, n int) string {
	var b strings.Builder
	max := big.NewInt(int64(len(alphabet)))
	for range n {
		i, err := rand.Int(rand.Reader, max)
		if err != nil {
			panic(fmt.Sprintf("creds: reading random bytes: %v", err))
		}
		b.WriteByte(alphabet[i.Int64()])
	}
	return b.String()
}

// Generate makes a new long-term key in AWS's shapes: an "AKIA" id of 20
// characters and a 40-character secret.
func Generate(profile string) Key {
	return Key{
		Profile:         profile,
		AccessKeyID:     "AKIA" + randomString(idAlphabet, 16),
		SecretAccessKey: randomString(secretAlphabet, 40),
		Access:          FullAccess,
	}
}

// ValidAccessKeyID reports whether id has the shape of an AWS access key id.
func ValidAccessKeyID(id string) bool {
	if len(id) < 16 || len(id) > 128 {
		return false
	}
	for _, c := range id {
		if !(c >= 'A' && c <= 'Z' || c >= '0' && c <= '9') {
			return false
		}
	}
	return true
}
