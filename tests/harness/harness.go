// Package harness starts hangar for integration tests: it builds the
// binaries (or uses HANGAR_BIN_DIR), runs `hangar dev` on a free port with
// a fresh state directory, and hands the test the endpoint, the aws CLI and
// an aws-sdk-go-v2 config. Everything it starts stops when the test ends.
//
// A missing prerequisite (dbus-daemon, /usr/bin/aws, root) is a t.Skip
// with one line naming it, never a silent pass.
package harness

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/config"
)

// AWSCLI is Debian's aws CLI v2; the first aws on PATH may be another.
const AWSCLI = "/usr/bin/aws"

var (
	buildOnce sync.Once
	binDir    string
	buildErr  error
)

// RepoRoot returns the module root.
func RepoRoot(t testing.TB) string {
	t.Helper()
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		t.Fatalf("finding the module root: %v", err)
	}
	return filepath.Dir(strings.TrimSpace(string(out)))
}

// Binaries returns a directory holding every hangar binary: HANGAR_BIN_DIR
// when set (make test sets it to bin/), otherwise a fresh build, once per
// test process.
func Binaries(t testing.TB) string {
	t.Helper()
	if d := os.Getenv("HANGAR_BIN_DIR"); d != "" {
		abs, err := filepath.Abs(d)
		if err != nil {
			t.Fatal(err)
		}
		return abs
	}
	buildOnce.Do(func() {
		root := RepoRoot(t)
		binDir, buildErr = os.MkdirTemp("", "hangar-bin-")
		if buildErr != nil {
			return
		}
		cmd := exec.Command("make", "-s", "build", "BIN="+binDir)
		cmd.Dir = root
		out, err := cmd.CombinedOutput()
		if err != nil {
			buildErr = fmt.Errorf("make build: %v\n%s", err, out)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return binDir
}

// Require skips the test unless every named program is installed.
func Require(t testing.TB, programs ...string) {
	t.Helper()
	for _, p := range programs {
		if _, err := exec.LookPath(p); err != nil {
			t.Skipf("skipping: %s is not installed (make test installs it)", p)
		}
	}
}

// RequireRoot skips the test unless it runs as root.
func RequireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("skipping: needs root (network namespaces, nftables); CI runs as root")
	}
}

// FreePort returns a TCP port free on 127.0.0.1 at the time of asking.
func FreePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// Dev is a running `hangar dev`.
type Dev struct {
	Dir         string // state directory
	Endpoint    string // http://127.0.0.1:PORT
	Listen      string
	Credentials string // shared-credentials file
	Config      string // aws CLI config file
	BinDir      string

	t      testing.TB
	args   []string
	cmd    *exec.Cmd
	stderr *lockedBuffer
	done   chan error
}

// Options adjust StartDev.
type Options struct {
	// HostConf, when set, is written as DIR/host.conf before the first
	// start (it must set ACCOUNT_ID).
	HostConf string
	// Dir reuses a state directory (for restart tests).
	Dir string
	// Args are more `hangar dev` flags (--starter-ami, say).
	Args []string
}

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// StartDev runs `hangar dev` and waits for its ready line.
func StartDev(t testing.TB, opts Options) *Dev {
	t.Helper()
	Require(t, "dbus-daemon")
	bin := Binaries(t)
	dir := opts.Dir
	if dir == "" {
		dir = t.TempDir()
	}
	if opts.HostConf != "" {
		if err := os.WriteFile(filepath.Join(dir, "host.conf"), []byte(opts.HostConf), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	d := &Dev{Dir: dir, BinDir: bin, t: t, args: opts.Args}
	d.start()
	t.Cleanup(d.Stop)
	return d
}

func (d *Dev) start() {
	t := d.t
	t.Helper()
	d.Listen = fmt.Sprintf("127.0.0.1:%d", FreePort(t))
	d.cmd = exec.Command(filepath.Join(d.BinDir, "hangar"), append([]string{"dev", "--state-dir", d.Dir, "--listen", d.Listen}, d.args...)...)
	d.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	d.stderr = &lockedBuffer{}
	d.cmd.Stderr = d.stderr
	stdout, err := d.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := d.cmd.Start(); err != nil {
		t.Fatalf("starting hangar dev: %v", err)
	}
	d.done = make(chan error, 1)
	readyc := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if ep, ok := strings.CutPrefix(sc.Text(), "ready "); ok {
				readyc <- ep
			}
		}
		_, _ = io.Copy(io.Discard, stdout)
	}()
	go func() { d.done <- d.cmd.Wait() }()
	select {
	case ep := <-readyc:
		d.Endpoint = ep
	case err := <-d.done:
		t.Fatalf("hangar dev exited before it was ready: %v\n%s", err, d.stderr.String())
	case <-time.After(90 * time.Second):
		_ = syscall.Kill(-d.cmd.Process.Pid, syscall.SIGKILL)
		t.Fatalf("hangar dev was not ready within 90s\n%s", d.stderr.String())
	}
	d.Credentials = filepath.Join(d.Dir, "credentials")
	d.Config = filepath.Join(d.Dir, "config")
}

// Stop stops hangar dev (SIGTERM, then SIGKILL after 20 s) and, when the
// test failed, prints what the services logged.
func (d *Dev) Stop() {
	if d.cmd == nil || d.cmd.Process == nil {
		return
	}
	_ = d.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-d.done:
	case <-time.After(20 * time.Second):
		_ = syscall.Kill(-d.cmd.Process.Pid, syscall.SIGKILL)
		<-d.done
	}
	if d.t.Failed() {
		d.t.Logf("hangar dev log:\n%s", d.stderr.String())
	}
	d.cmd = nil
}

// Restart stops and starts hangar dev on the same state directory.
func (d *Dev) Restart() {
	d.t.Helper()
	d.Stop()
	d.start()
}

// Log returns what hangar dev and its services have logged so far.
func (d *Dev) Log() string { return d.stderr.String() }

// PID is the process id of `hangar dev`; the services are its children.
func (d *Dev) PID() int { return d.cmd.Process.Pid }

// Env is the environment for the aws CLI against this host.
func (d *Dev) Env() []string {
	return append(os.Environ(),
		"AWS_SHARED_CREDENTIALS_FILE="+d.Credentials,
		"AWS_CONFIG_FILE="+d.Config,
		"AWS_PAGER=",
		"AWS_PROFILE=default",
		"AWS_ACCESS_KEY_ID=", "AWS_SECRET_ACCESS_KEY=", "AWS_SESSION_TOKEN=",
	)
}

// AWS runs /usr/bin/aws with --endpoint-url and returns stdout, or an
// error carrying stderr (the CLI's "An error occurred (Code) ..." line).
func (d *Dev) AWS(args ...string) (string, error) {
	d.t.Helper()
	Require(d.t, AWSCLI)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, AWSCLI, append([]string{"--endpoint-url", d.Endpoint}, args...)...)
	cmd.Env = d.Env()
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return stdout.String(), fmt.Errorf("aws %s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return stdout.String(), nil
}

// MustAWS is AWS that fails the test on error.
func (d *Dev) MustAWS(args ...string) string {
	d.t.Helper()
	out, err := d.AWS(args...)
	if err != nil {
		d.t.Fatal(err)
	}
	return out
}

// Key is an access key from the host's credentials file.
type Key struct {
	AccessKeyID, SecretAccessKey string
}

// Key returns the host's root key (profile default). The harness reads the
// file as the aws CLI does, not through hangar's own code, so a change in
// hangar's writer that the CLI cannot read fails here too.
func (d *Dev) Key() Key {
	d.t.Helper()
	raw, err := os.ReadFile(d.Credentials)
	if err != nil {
		d.t.Fatal(err)
	}
	var k Key
	inDefault := false
	for _, line := range strings.Split(string(raw), "\n") {
		line = strings.TrimSpace(line)
		if strings.HasPrefix(line, "[") {
			inDefault = line == "[default]"
			continue
		}
		key, val, ok := strings.Cut(line, "=")
		if !ok || !inDefault {
			continue
		}
		switch strings.TrimSpace(key) {
		case "aws_access_key_id":
			k.AccessKeyID = strings.TrimSpace(val)
		case "aws_secret_access_key":
			k.SecretAccessKey = strings.TrimSpace(val)
		}
	}
	if k.AccessKeyID == "" || k.SecretAccessKey == "" {
		d.t.Fatalf("%s has no [default] key", d.Credentials)
	}
	return k
}

// SDK returns an aws-sdk-go-v2 config for this host, with the root key.
func (d *Dev) SDK() aws.Config {
	d.t.Helper()
	k := d.Key()
	cfg, err := config.LoadDefaultConfig(context.Background(),
		config.WithRegion("us-east-1"),
		config.WithCredentialsProvider(aws.CredentialsProviderFunc(func(context.Context) (aws.Credentials, error) {
			return aws.Credentials{AccessKeyID: k.AccessKeyID, SecretAccessKey: k.SecretAccessKey, Source: "hangar"}, nil
		})),
		config.WithBaseEndpoint(d.Endpoint),
		config.WithSharedConfigFiles([]string{}),
		config.WithSharedCredentialsFiles([]string{}),
	)
	if err != nil {
		d.t.Fatal(err)
	}
	return cfg
}

// BusAddress is the address of the dev host's private system bus.
func (d *Dev) BusAddress() string {
	conf, err := os.ReadFile(filepath.Join(d.Dir, "run", "bus.conf"))
	if err != nil {
		d.t.Fatal(err)
	}
	s := string(conf)
	i := strings.Index(s, "<listen>")
	j := strings.Index(s, "</listen>")
	return s[i+len("<listen>") : j]
}

// Median is the median of benchmark timings (the mean of the middle two
// for an even count).
func Median(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	if len(s)%2 == 0 {
		return (s[len(s)/2-1] + s[len(s)/2]) / 2
	}
	return s[len(s)/2]
}
