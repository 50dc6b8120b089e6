package hostinit

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"hangar.dev/hangar/services/internal/creds"
	"hangar.dev/hangar/services/internal/hostconf"
)

const (
	testKeyID  = "AKIAHANGARTEST000001"
	testSecret = "secretsecretsecretsecretsecretsecret0001"
)

// env is one first-boot run's world, in a temporary directory.
type env struct {
	t    *testing.T
	dir  string
	p    Paths
	o    Options
	kvm  string
	log  *slog.Logger
	last *Result
}

func newEnv(t *testing.T) *env {
	t.Helper()
	dir := t.TempDir()
	e := &env{t: t, dir: dir, log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	e.p = Paths{
		HostConf:      filepath.Join(dir, "etc/host.conf"),
		Defaults:      "",
		RuntimeConfig: filepath.Join(dir, "run/host.json"),
		Readiness:     filepath.Join(dir, "run/readiness.json"),
		Credentials:   filepath.Join(dir, "etc/credentials"),
		TLSDir:        filepath.Join(dir, "etc/tls"),
		StateDir:      filepath.Join(dir, "var"),
		KVMDevice:     filepath.Join(dir, "no-kvm"),
	}
	for _, d := range []string{"etc", "run", "var"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	e.o = Options{
		Machine:   hostconf.Machine{CPUs: 8, MemoryMB: 16384},
		Hostname:  "hangar-test",
		Addresses: []netip.Addr{netip.MustParseAddr("192.0.2.10"), netip.MustParseAddr("fe80::1"), netip.MustParseAddr("127.0.0.1")},
		Now:       func() time.Time { return time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC) },
	}
	return e
}

func (e *env) conf(s string) {
	e.t.Helper()
	if err := os.WriteFile(e.p.HostConf, []byte(s), 0o644); err != nil {
		e.t.Fatal(err)
	}
}

func (e *env) run() *Result {
	e.t.Helper()
	res, err := Run(context.Background(), e.log, e.p, e.o)
	if err != nil {
		e.t.Fatalf("Run: %v", err)
	}
	// What was written agrees with what was returned.
	saved, err := hostconf.LoadReadiness(e.p.Readiness)
	if err != nil {
		e.t.Fatal(err)
	}
	if saved.Ready != res.Readiness.Ready || len(saved.Reasons) != len(res.Readiness.Reasons) {
		e.t.Fatalf("saved readiness %+v, returned %+v", saved, res.Readiness)
	}
	if _, err := hostconf.Load(e.p.RuntimeConfig); err != nil {
		e.t.Fatalf("runtime config: %v", err)
	}
	e.last = res
	return res
}

func reasonLines(r hostconf.Readiness) []string {
	var out []string
	for _, x := range r.Reasons {
		out = append(out, x.String())
	}
	return out
}

// wantReasons checks that each wanted substring is in some reason line.
func wantReasons(t *testing.T, r hostconf.Readiness, want ...string) {
	t.Helper()
	lines := reasonLines(r)
	for _, w := range want {
		found := false
		for _, l := range lines {
			if strings.Contains(l, w) {
				found = true
			}
		}
		if !found {
			t.Errorf("no readiness line contains %q; lines:\n  %s", w, strings.Join(lines, "\n  "))
		}
	}
}

func TestBadInput(t *testing.T) {
	for _, tc := range []struct {
		name      string
		setup     func(e *env)
		wantReady bool
		want      []string // substrings of readiness lines
		check     func(t *testing.T, e *env, res *Result)
	}{
		{
			name:  "missing host.conf: defaults apply and the report says so",
			setup: func(e *env) {},
			want:  []string{"ConfigMissing: " + "", "does not exist; every key has its default", "KVMUnavailable"},
			check: func(t *testing.T, e *env, res *Result) {
				if res.Config.Region != "us-east-1" || res.Config.APIListen != "0.0.0.0:4566" {
					t.Errorf("defaults not applied: %+v", res.Config)
				}
			},
		},
		{
			name:  "unreadable host.conf",
			setup: func(e *env) { os.MkdirAll(e.p.HostConf, 0o755) },
			want:  []string{"ConfigMissing: cannot read", "is a directory", "every key has its default"},
		},
		{
			name:  "duplicate keys",
			setup: func(e *env) { e.conf("ALLOW_SOFTWARE_EMULATION=yes\nREGION=eu-west-1\nREGION=us-west-2\n") },
			want:  []string{"ConfigInvalid: REGION is set twice (first on line 2); remove one (line 3)"},
			check: func(t *testing.T, e *env, res *Result) {
				if res.Config.Region != "eu-west-1" {
					t.Errorf("the first REGION should stand, got %s", res.Config.Region)
				}
			},
		},
		{
			name:      "CRLF file is read, with a warning",
			setup:     func(e *env) { e.conf("ALLOW_SOFTWARE_EMULATION=yes\r\nREGION=ap-south-1\r\n") },
			wantReady: true,
			want:      []string{"ConfigWarning: has CRLF (Windows) line ends", "SoftwareEmulationOnly"},
			check: func(t *testing.T, e *env, res *Result) {
				if res.Config.Region != "ap-south-1" {
					t.Errorf("region %q", res.Config.Region)
				}
			},
		},
		{
			name:  "value with spaces",
			setup: func(e *env) { e.conf("ALLOW_SOFTWARE_EMULATION=yes\nAPI_TLS_NAMES=a.example b.example\n") },
			want:  []string{"ConfigInvalid: API_TLS_NAMES has a space in an unquoted value; quote it or use commas for lists (line 2)"},
		},
		{
			name:  "lower-case key",
			setup: func(e *env) { e.conf("ALLOW_SOFTWARE_EMULATION=yes\nregion=eu-west-1\n") },
			want:  []string{"ConfigInvalid: region keys are upper case: write REGION (line 2)"},
		},
		{
			name:  "unknown key is reported, never skipped",
			setup: func(e *env) { e.conf("ALLOW_SOFTWARE_EMULATION=yes\nAPI_LISTN=0.0.0.0:80\n") },
			want:  []string{"ConfigInvalid: API_LISTN is not a known key; did you mean API_LISTEN? (line 2)"},
		},
		{
			name:  "pool overlapping PROTECTED_CIDRS",
			setup: func(e *env) { e.conf("PUBLIC_IP_POOL=192.168.1.0/28\nPROTECTED_CIDRS=192.168.0.0/16\n") },
			want:  []string{"ConfigInvalid: PUBLIC_IP_POOL 192.168.1.0/28 overlaps PROTECTED_CIDRS entry 192.168.0.0/16 (line 1)"},
		},
		{
			name:  "reserve larger than the machine",
			setup: func(e *env) { e.conf("HOST_RESERVE_MEMORY_MB=65536\n") },
			want:  []string{"ConfigInvalid: HOST_RESERVE_MEMORY_MB reserves 65536 MiB but the machine has 16384 MiB"},
		},
		{
			name: "bad line in the shipped defaults names that file",
			setup: func(e *env) {
				e.p.Defaults = filepath.Join(e.dir, "defaults")
				os.WriteFile(e.p.Defaults, []byte(hostconf.DefaultsFile()+"REGOIN=x\n"), 0o644)
				e.conf("ALLOW_SOFTWARE_EMULATION=yes\n")
			},
			want: []string{"REGOIN is not a known key", "defaults line"},
		},
		{
			name: "unparseable credentials are kept and reported",
			setup: func(e *env) {
				e.conf("ALLOW_SOFTWARE_EMULATION=yes\n")
				os.WriteFile(e.p.Credentials, []byte("[default]\nnonsense\n"), 0o600)
			},
			want: []string{"CredentialsMissing: ", "cannot be parsed", "hangar-gateway refuses to serve"},
			check: func(t *testing.T, e *env, res *Result) {
				raw, _ := os.ReadFile(e.p.Credentials)
				if string(raw) != "[default]\nnonsense\n" {
					t.Errorf("first boot changed a file it could not parse: %q", raw)
				}
			},
		},
		{
			name: "invalid admin key writes no credentials",
			setup: func(e *env) {
				e.conf("ALLOW_SOFTWARE_EMULATION=yes\nADMIN_ACCESS_KEY_ID=short\nADMIN_SECRET_ACCESS_KEY=" + testSecret + "\n")
			},
			want: []string{"ConfigInvalid: ADMIN_ACCESS_KEY_ID must be at least 16", "CredentialsMissing: the admin key in host.conf is invalid"},
			check: func(t *testing.T, e *env, res *Result) {
				if _, err := os.Stat(e.p.Credentials); err == nil {
					t.Error("credentials were invented from an invalid admin key")
				}
			},
		},
		{
			name:  "storage too small",
			setup: func(e *env) { e.conf("ALLOW_SOFTWARE_EMULATION=yes\n"); e.o.MinFreeBytes = 1 << 62 },
			// A warning: the API still serves, volumes will not fit.
			wantReady: true,
			want:      []string{"StorageMissing: ", "MiB free"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			tc.setup(e)
			res := e.run()
			wantReasons(t, res.Readiness, tc.want...)
			if res.Readiness.Ready != tc.wantReady {
				t.Errorf("ready = %v, want %v; reasons:\n  %s", res.Readiness.Ready, tc.wantReady, strings.Join(reasonLines(res.Readiness), "\n  "))
			}
			if tc.check != nil {
				tc.check(t, e, res)
			}
		})
	}
}

func TestRerunChangesNothing(t *testing.T) {
	e := newEnv(t)
	e.conf("ALLOW_SOFTWARE_EMULATION=yes\nAPI_TLS=yes\n")
	first := e.run()
	if !first.Readiness.Ready {
		t.Fatalf("not ready: %v", reasonLines(first.Readiness))
	}
	if len(first.Actions) < 4 {
		t.Fatalf("first run did too little: %q", first.Actions)
	}
	before := snapshot(t, e.dir)
	second := e.run()
	if len(second.Actions) != 0 {
		t.Fatalf("a re-run with the same host.conf acted: %q", second.Actions)
	}
	after := snapshot(t, e.dir)
	for path, content := range before {
		if after[path] != content {
			t.Errorf("%s changed on a re-run", path)
		}
	}
	if second.Config.AccountID != first.Config.AccountID {
		t.Errorf("account id changed: %s then %s", first.Config.AccountID, second.Config.AccountID)
	}
}

// snapshot reads every regular file under dir except the readiness report.
func snapshot(t *testing.T, dir string) map[string]string {
	out := map[string]string{}
	filepath.Walk(dir, func(path string, info os.FileInfo, err error) error {
		if err == nil && info.Mode().IsRegular() && !strings.HasSuffix(path, "readiness.json") {
			raw, _ := os.ReadFile(path)
			out[path] = string(raw)
		}
		return nil
	})
	return out
}

func TestAccountID(t *testing.T) {
	e := newEnv(t)
	e.conf("ALLOW_SOFTWARE_EMULATION=yes\n")
	generated := e.run().Config.AccountID
	if len(generated) != 12 {
		t.Fatalf("account id %q", generated)
	}
	kept, _ := os.ReadFile(filepath.Join(e.p.StateDir, AccountIDFile))
	if strings.TrimSpace(string(kept)) != generated {
		t.Fatalf("kept %q, used %q", kept, generated)
	}
	e.conf("ALLOW_SOFTWARE_EMULATION=yes\nACCOUNT_ID=123456789012\n")
	if got := e.run().Config.AccountID; got != "123456789012" {
		t.Fatalf("host.conf ACCOUNT_ID ignored: %s", got)
	}
	e.conf("ALLOW_SOFTWARE_EMULATION=yes\n")
	if got := e.run().Config.AccountID; got != generated {
		t.Fatalf("after removing ACCOUNT_ID the generated id %s should return, got %s", generated, got)
	}
}

func TestCredentials(t *testing.T) {
	e := newEnv(t)
	e.conf("ALLOW_SOFTWARE_EMULATION=yes\n")
	e.run()
	keys := loadKeys(t, e.p.Credentials)
	generated := keys[0]
	if !generated.Root() || !creds.ValidAccessKeyID(generated.AccessKeyID) {
		t.Fatalf("generated %+v", generated)
	}
	// An operator's extra profile survives everything below.
	auditor := creds.Generate("auditor")
	auditor.Access = creds.ReadOnlyAccess
	if err := creds.Write(e.p.Credentials, []creds.Key{generated, auditor}); err != nil {
		t.Fatal(err)
	}

	e.conf("ALLOW_SOFTWARE_EMULATION=yes\nADMIN_ACCESS_KEY_ID=" + testKeyID + "\nADMIN_SECRET_ACCESS_KEY=" + testSecret + "\n")
	res := e.run()
	keys = loadKeys(t, e.p.Credentials)
	if len(keys) != 2 || keys[0].AccessKeyID != testKeyID || keys[0].SecretAccessKey != testSecret || keys[1] != auditor {
		t.Fatalf("after setting ADMIN_*: %+v", keys)
	}
	if !strings.Contains(strings.Join(res.Actions, "\n"), "replaced the admin key") {
		t.Fatalf("actions %q", res.Actions)
	}
	if again := e.run(); len(again.Actions) != 0 {
		t.Fatalf("re-run acted: %q", again.Actions)
	}

	// Removing ADMIN_* keeps the key in use: nothing is rotated behind the
	// operator's back.
	e.conf("ALLOW_SOFTWARE_EMULATION=yes\n")
	e.run()
	if keys = loadKeys(t, e.p.Credentials); keys[0].AccessKeyID != testKeyID {
		t.Fatalf("key rotated on its own: %+v", keys[0])
	}

	// A file others can read is tightened, and says so.
	os.Chmod(e.p.Credentials, 0o644)
	res = e.run()
	if st, _ := os.Stat(e.p.Credentials); st.Mode().Perm() != 0o600 {
		t.Fatalf("mode %v", st.Mode().Perm())
	}
	if !strings.Contains(strings.Join(res.Actions, "\n"), "mode 0600") {
		t.Fatalf("actions %q", res.Actions)
	}
}

func TestCredentialsOwnerMissing(t *testing.T) {
	e := newEnv(t)
	e.conf("ALLOW_SOFTWARE_EMULATION=yes\n")
	e.o.Owner = "hangar-no-such-user"
	res := e.run()
	wantReasons(t, res.Readiness, "CredentialsMissing: user hangar-no-such-user does not exist")
	if res.Readiness.Ready {
		t.Fatal("ready without a readable credentials file")
	}
}

func loadKeys(t *testing.T, path string) []creds.Key {
	t.Helper()
	keys, err := creds.Load(path)
	if err != nil {
		t.Fatal(err)
	}
	return keys
}

func TestTLS(t *testing.T) {
	e := newEnv(t)
	e.conf("ALLOW_SOFTWARE_EMULATION=yes\nAPI_TLS=yes\nAPI_LISTEN=198.51.100.7:443\n")
	e.run()
	ca, leaf := readCert(t, filepath.Join(e.p.TLSDir, CACertFile)), readCert(t, filepath.Join(e.p.TLSDir, ServerCertFile))
	pool := x509.NewCertPool()
	pool.AddCert(ca)
	for _, name := range []string{"hangar-test", "localhost", "192.0.2.10", "127.0.0.1", "198.51.100.7"} {
		if _, err := leaf.Verify(x509.VerifyOptions{DNSName: name, Roots: pool, CurrentTime: e.o.Now()}); err != nil {
			t.Errorf("certificate does not verify for %s: %v", name, err)
		}
	}
	for _, ip := range leaf.IPAddresses {
		if ip.IsLinkLocalUnicast() {
			t.Errorf("link-local %s in the SANs", ip)
		}
	}
	if st, _ := os.Stat(filepath.Join(e.p.TLSDir, ServerKeyFile)); st.Mode().Perm() != 0o600 {
		t.Errorf("server key mode %v", st.Mode().Perm())
	}

	// A new name re-issues the server certificate under the same CA.
	e.conf("ALLOW_SOFTWARE_EMULATION=yes\nAPI_TLS=yes\nAPI_LISTEN=198.51.100.7:443\nAPI_TLS_NAMES=api.lab.example\n")
	res := e.run()
	leaf2 := readCert(t, filepath.Join(e.p.TLSDir, ServerCertFile))
	if leaf2.SerialNumber.Cmp(leaf.SerialNumber) == 0 {
		t.Fatal("server certificate not re-issued for a new name")
	}
	if _, err := leaf2.Verify(x509.VerifyOptions{DNSName: "api.lab.example", Roots: pool, CurrentTime: e.o.Now()}); err != nil {
		t.Fatalf("new certificate: %v (actions %q)", err, res.Actions)
	}
	if ca2 := readCert(t, filepath.Join(e.p.TLSDir, CACertFile)); !ca2.Equal(ca) {
		t.Fatal("the CA changed")
	}

	// Near expiry, it is renewed.
	e.o.Now = func() time.Time { return leaf2.NotAfter.Add(-24 * time.Hour) }
	e.run()
	if leaf3 := readCert(t, filepath.Join(e.p.TLSDir, ServerCertFile)); leaf3.SerialNumber.Cmp(leaf2.SerialNumber) == 0 {
		t.Fatal("certificate a day from expiry was kept")
	}
}

func readCert(t *testing.T, path string) *x509.Certificate {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := pem.Decode(raw)
	if b == nil {
		t.Fatalf("%s is not PEM", path)
	}
	c, err := x509.ParseCertificate(b.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func TestListenOverride(t *testing.T) {
	e := newEnv(t)
	e.conf("ALLOW_SOFTWARE_EMULATION=yes\nAPI_LISTEN=0.0.0.0:4566\n")
	e.o.Listen = "127.0.0.1:14566"
	e.run()
	c, err := hostconf.Load(e.p.RuntimeConfig)
	if err != nil || c.APIListen != "127.0.0.1:14566" {
		t.Fatalf("runtime config %+v, %v", c, err)
	}
}

// The image carries a starter AMI the gateway imports when STARTER_AMI=yes;
// when it does not, the report says so, as a warning: the API still serves.
func TestStarterAMI(t *testing.T) {
	for _, tc := range []struct {
		name  string
		setup func(e *env)
		conf  string
		want  string // "" for no StarterAMIMissing line
	}{
		{name: "present", setup: func(e *env) {
			os.WriteFile(e.p.StarterAMI, []byte("name=hangar/debian-12-x86_64\ndisk=debian-12-x86_64.raw\nboot_mode=uefi\n"), 0o644)
			os.WriteFile(filepath.Join(filepath.Dir(e.p.StarterAMI), "debian-12-x86_64.raw"), []byte("disk"), 0o644)
		}},
		{name: "an ami.env from a build tree names an absolute path", setup: func(e *env) {
			os.WriteFile(e.p.StarterAMI, []byte("name=hangar/debian-12-x86_64\ndisk=/build/machine/out/debian-12-x86_64.raw\n"), 0o644)
			os.WriteFile(filepath.Join(filepath.Dir(e.p.StarterAMI), "debian-12-x86_64.raw"), []byte("disk"), 0o644)
		}},
		{name: "image without one", setup: func(e *env) {},
			want: "StarterAMIMissing: STARTER_AMI=yes but the image has no starter AMI (" + "%s: no such file or directory); no AMI hangar/debian-12-x86_64 will be imported"},
		{name: "disk missing", setup: func(e *env) {
			os.WriteFile(e.p.StarterAMI, []byte("name=hangar/debian-12-x86_64\ndisk=debian-12-x86_64.raw\n"), 0o644)
		}, want: "the disk of hangar/debian-12-x86_64 (%s/debian-12-x86_64.raw) is missing (no such file or directory)"},
		{name: "ami.env without a disk", setup: func(e *env) {
			os.WriteFile(e.p.StarterAMI, []byte("name=hangar/debian-12-x86_64\n"), 0o644)
		}, want: "%s names no image or disk"},
		{name: "not wanted", setup: func(e *env) {}, conf: "STARTER_AMI=no\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			dir := filepath.Join(e.dir, "usr/share/hangar/starter")
			os.MkdirAll(dir, 0o755)
			e.p.StarterAMI = filepath.Join(dir, "ami.env")
			e.conf("ALLOW_SOFTWARE_EMULATION=yes\n" + tc.conf)
			tc.setup(e)
			res := e.run()
			if !res.Readiness.Ready {
				t.Errorf("a missing starter AMI made the host not ready: %v", reasonLines(res.Readiness))
			}
			if tc.want == "" {
				if res.Readiness.Has(hostconf.ReasonStarterAMIMissing) {
					t.Errorf("unexpected: %v", reasonLines(res.Readiness))
				}
				return
			}
			want := tc.want
			if strings.Contains(want, "%s") {
				arg := dir
				if strings.Contains(want, "(%s:") || strings.HasPrefix(want, "%s") {
					arg = e.p.StarterAMI
				}
				want = strings.Replace(want, "%s", arg, 1)
			}
			wantReasons(t, res.Readiness, want)
		})
	}
}
