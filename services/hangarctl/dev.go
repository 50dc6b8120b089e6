package main

import (
	"bufio"
	"context"
	"crypto/rand"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"hangar.dev/hangar/services/firstboot/hostinit"
	"hangar.dev/hangar/services/internal/hostconf"
)

// devService is how `hangar dev` starts one service.
type devService struct {
	name   string // short name: state and runtime dirs are named after it
	binary string
	// args returns the service's flags in the dev layout.
	args func(e *devEnv) []string
	// root services need privileges (netns, nftables); without them dev
	// skips the service with a line saying so, and what depends on it
	// (VPCs becoming available, instances) waits for it.
	root bool
}

// devServices are started in this order (the gateway last, as it calls the
// others) and stopped in reverse. A service whose binary is missing from
// the bin directory is skipped with a line saying so.
var devServices = []devService{
	// netd makes network namespaces and nftables rules: it needs root.
	// --dev removes them when dev stops (and rebuilds them at the next
	// start from its state), so a development host leaves nothing behind.
	{name: "netd", binary: "hangar-netd", root: true, args: func(e *devEnv) []string {
		return []string{"--config", e.hostJSON, "--state-dir", e.stateDir("netd"), "--runtime-dir", e.runtimeDir("netd"), "--dev"}
	}},
	{name: "ebs", binary: "hangar-ebsd", args: func(e *devEnv) []string {
		return []string{"--config", e.hostJSON, "--state-dir", e.stateDir("ebs"), "--runtime-dir", e.runtimeDir("ebs")}
	}},
	// vmd runs QEMU itself in dev (no systemd), with TCG when KVM is not
	// usable (dev's host.conf allows software emulation).
	{name: "vmd", binary: "hangar-vmd", args: func(e *devEnv) []string {
		return []string{"--config", e.hostJSON, "--state-dir", e.stateDir("vmd"), "--runtime-dir", e.runtimeDir("vmd"), "--runner", "process"}
	}},
	{name: "gateway", binary: "hangar-gateway", args: func(e *devEnv) []string {
		args := []string{"--config", e.hostJSON, "--credentials", e.credentials, "--state-dir", e.stateDir("gateway"), "--listen", e.listen}
		if e.starterAMI != "" {
			args = append(args, "--starter-ami", e.starterAMI)
		}
		return args
	}},
}

type devEnv struct {
	dir         string
	runDir      string
	binDir      string
	listen      string
	hostJSON    string
	credentials string
	busAddress  string
	starterAMI  string
}

func (e *devEnv) stateDir(svc string) string   { return filepath.Join(e.dir, svc) }
func (e *devEnv) runtimeDir(svc string) string { return filepath.Join(e.runDir, svc) }

// devHostConf is written to DIR/host.conf on the first run. It is an
// ordinary host.conf: edit it and restart `hangar dev` to change the host.
const devHostConf = `# host.conf for 'hangar dev' (see docs/host.conf.md). Edit and restart.
ACCOUNT_ID=%s
REGION=us-east-1
# A development machine rarely has KVM for nested guests: allow TCG.
ALLOW_SOFTWARE_EMULATION=yes
# Keep nothing back and overcommit vCPUs, so a 2-core machine can run a
# 2-vCPU t3.nano; memory is never overcommitted.
HOST_RESERVE_VCPU=0
HOST_RESERVE_MEMORY_MB=0
CPU_OVERCOMMIT=8
`

func randomAccount() string {
	n, err := rand.Int(rand.Reader, big.NewInt(9e11))
	if err != nil {
		panic(err)
	}
	return fmt.Sprintf("%012d", n.Int64()+1e11)
}

func cmdDev(args []string) error {
	fs := flag.NewFlagSet("dev", flag.ExitOnError)
	dir := fs.String("state-dir", "", "directory for the host's state, config and credentials (required)")
	listen := fs.String("listen", "127.0.0.1:4566", "address:port for the API")
	binDir := fs.String("bin-dir", "", "directory holding the hangar-* binaries (default: next to this one)")
	starter := fs.String("starter-ami", "", "ami.env of a starter AMI disk (image/starter-ami/build.sh) to import as hangar/debian-12-x86_64")
	_ = fs.Parse(args)
	if *dir == "" {
		return fmt.Errorf("--state-dir is required")
	}
	// Children get SIGTERM when this thread dies (Pdeathsig), so the thread
	// that starts them must be the one that lives as long as we do.
	runtime.LockOSThread()

	abs, err := filepath.Abs(*dir)
	if err != nil {
		return err
	}
	e := &devEnv{dir: abs, listen: *listen, binDir: *binDir}
	if *starter != "" {
		if e.starterAMI, err = filepath.Abs(*starter); err != nil {
			return err
		}
	}
	if e.binDir == "" {
		self, err := os.Executable()
		if err != nil {
			return err
		}
		e.binDir = filepath.Dir(self)
	}
	if err := e.prepare(); err != nil {
		return err
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	// vmd's guests are its children and outlive it; once vmd is gone they
	// become ours (a subreaper), so stopGuests can reap what it ends.
	_ = unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
	// Guests end right after vmd stops, while ebsd still serves their
	// disks (QEMU flushes them as it exits; with ebsd gone it would wait
	// out its NBD reconnect delay), and once more, deferred first so it
	// runs last, for whatever a vmd that died early left.
	defer stopGuests(e.stateDir("vmd"))
	sup := &supervisor{exited: make(chan string, len(devServices)+1)}
	sup.stopped = func(name string) {
		if name == "hangar-vmd" {
			stopGuests(e.stateDir("vmd"))
		}
	}
	defer sup.stopAll()

	bus, err := sup.startBus(ctx, e)
	if err != nil {
		return err
	}
	e.busAddress = bus
	for _, svc := range devServices {
		bin := filepath.Join(e.binDir, svc.binary)
		if _, err := os.Stat(bin); err != nil {
			fmt.Fprintf(os.Stderr, "hangar dev: %s not built (%s missing); skipping it\n", svc.binary, bin)
			continue
		}
		if svc.root && os.Geteuid() != 0 {
			fmt.Fprintf(os.Stderr, "hangar dev: %s needs root (network namespaces, nftables); skipping it: VPCs stay pending and instances cannot launch\n", svc.binary)
			continue
		}
		if err := sup.startService(ctx, e, svc, bin); err != nil {
			return err
		}
	}
	endpoint := "http://" + e.listen
	if err := waitAPI(ctx, endpoint, sup.exited); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "hangar dev: credentials in %s, config in %s; try:\n  AWS_SHARED_CREDENTIALS_FILE=%s AWS_CONFIG_FILE=%s aws --endpoint-url %s sts get-caller-identity\n",
		e.credentials, filepath.Join(e.dir, "config"), e.credentials, filepath.Join(e.dir, "config"), endpoint)
	fmt.Printf("ready %s\n", endpoint)

	select {
	case <-ctx.Done():
		return nil
	case name := <-sup.exited:
		return fmt.Errorf("%s exited; stopping the host", name)
	}
}

// prepare writes the host.conf (first run), the validated host config, the
// credentials and the aws CLI config.
func (e *devEnv) prepare() error {
	e.runDir = filepath.Join(e.dir, "run")
	for _, d := range []string{e.dir, e.runDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	confPath := filepath.Join(e.dir, "host.conf")
	if _, err := os.Stat(confPath); errors.Is(err, os.ErrNotExist) {
		if err := os.WriteFile(confPath, []byte(fmt.Sprintf(devHostConf, randomAccount())), 0o644); err != nil {
			return err
		}
	}
	// The same first boot the image runs (hangar-firstboot), pointed at the
	// state directory, so a dev host and a booted host cannot drift apart.
	e.hostJSON = filepath.Join(e.runDir, "host.json")
	e.credentials = filepath.Join(e.dir, "credentials")
	res, err := hostinit.Run(context.Background(), slog.New(slog.NewTextHandler(io.Discard, nil)), hostinit.Paths{
		HostConf:      confPath,
		RuntimeConfig: e.hostJSON,
		Readiness:     filepath.Join(e.runDir, "readiness.json"),
		Credentials:   e.credentials,
		TLSDir:        filepath.Join(e.dir, "tls"),
		StateDir:      e.dir,
		KVMDevice:     "/dev/kvm",
	}, hostinit.Options{Listen: e.listen})
	if err != nil {
		return err
	}
	cfg, rep := res.Config, res.Report
	for _, p := range rep.Problems {
		fmt.Fprintf(os.Stderr, "hangar dev: %s: %s\n", confPath, p)
	}
	if !rep.OK() {
		return fmt.Errorf("%s is invalid; fix the lines above", confPath)
	}
	for _, r := range res.Readiness.Reasons {
		if r.Code == hostconf.ReasonCredentialsMissing {
			return fmt.Errorf("%s", r)
		}
	}
	awsConfig := fmt.Sprintf("[default]\nregion = %s\noutput = json\n", cfg.Region)
	return os.WriteFile(filepath.Join(e.dir, "config"), []byte(awsConfig), 0o644)
}

const devBusConfig = `<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<!-- The private system bus of 'hangar dev'. Unlike the image's policy
     (units/dev.hangar.conf) it lets the developer's user own and call
     everything: it is reachable only through its socket in the state dir. -->
<busconfig>
  <type>system</type>
  <listen>unix:path=%s</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="*"/>
    <allow own="*"/>
    <allow send_type="method_call"/>
    <allow send_type="signal"/>
    <allow send_requested_reply="true" send_type="method_return"/>
    <allow send_requested_reply="true" send_type="error"/>
    <allow receive_type="method_call"/>
    <allow receive_type="method_return"/>
    <allow receive_type="error"/>
    <allow receive_type="signal"/>
    <allow send_destination="org.freedesktop.DBus"/>
  </policy>
</busconfig>
`

type supervisor struct {
	mu     sync.Mutex
	procs  []*exec.Cmd
	names  []string
	exited chan string
	done   sync.WaitGroup
	// stopped, when set, is called by stopAll after each process ended.
	stopped func(name string)
}

func (s *supervisor) start(name string, cmd *exec.Cmd, watch bool) error {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM, Setpgid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("starting %s: %w", name, err)
	}
	s.mu.Lock()
	s.procs = append(s.procs, cmd)
	s.names = append(s.names, name)
	s.mu.Unlock()
	s.done.Add(1)
	go func() {
		defer s.done.Done()
		err := cmd.Wait()
		if watch {
			fmt.Fprintf(os.Stderr, "hangar dev: %s exited: %v\n", name, err)
			s.exited <- name
		}
	}()
	return nil
}

// stopAll sends SIGTERM to everything started, newest first, and waits;
// whatever is still there after ten seconds is killed.
func (s *supervisor) stopAll() {
	s.mu.Lock()
	procs := append([]*exec.Cmd(nil), s.procs...)
	names := append([]string(nil), s.names...)
	s.mu.Unlock()
	for i := len(procs) - 1; i >= 0; i-- {
		if p := procs[i].Process; p != nil {
			_ = p.Signal(syscall.SIGTERM)
		}
		waitExit(procs[i], 10*time.Second)
		if s.stopped != nil {
			s.stopped(names[i])
		}
	}
	s.done.Wait()
}

// stopGuests ends the QEMU guests of this development host once vmd has
// stopped. vmd's process-runner guests deliberately outlive
// vmd (a restart of vmd reattaches to them), but a development host that
// stops must leave nothing running. A guest of this host is a process whose
// serial console writes to a log under this host's vmd state directory
// (STATE/instances/<id>/console.log); that holds whatever runtime directory
// vmd used, and even when vmd died, and never matches another host's guest.
// Instances stay recorded: the next start finds them stopped.
func stopGuests(vmdState string) {
	marker := "path=" + filepath.Join(vmdState, "instances") + "/"
	find := func() []int {
		var pids []int
		ents, _ := os.ReadDir("/proc")
		for _, ent := range ents {
			pid, err := strconv.Atoi(ent.Name())
			if err != nil {
				continue
			}
			raw, err := os.ReadFile("/proc/" + ent.Name() + "/cmdline")
			if err != nil {
				continue
			}
			args := strings.Split(string(raw), "\x00")
			guest := false
			for i, a := range args {
				if a == "-chardev" && i+1 < len(args) && strings.Contains(args[i+1], marker) && strings.HasPrefix(args[i+1], "file,id=console,") {
					guest = true
				}
			}
			if guest && !zombie(pid) {
				pids = append(pids, pid)
			}
		}
		return pids
	}
	pids := find()
	if len(pids) == 0 {
		return
	}
	fmt.Fprintf(os.Stderr, "hangar dev: ending %d guest(s) left running (pids %v)\n", len(pids), pids)
	for _, pid := range pids {
		_ = syscall.Kill(pid, syscall.SIGTERM) // QEMU exits cleanly on SIGTERM
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		left := 0
		for _, pid := range pids {
			var ws syscall.WaitStatus
			_, _ = syscall.Wait4(pid, &ws, syscall.WNOHANG, nil) // reaps it once it is ours
			if syscall.Kill(pid, 0) == nil && !zombie(pid) {
				left++
			}
		}
		if left == 0 {
			return
		}
		if time.Now().After(deadline) {
			for _, pid := range pids {
				_ = syscall.Kill(pid, syscall.SIGKILL)
				var ws syscall.WaitStatus
				_, _ = syscall.Wait4(pid, &ws, 0, nil)
			}
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// zombie reports whether pid has exited and waits to be reaped.
func zombie(pid int) bool {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return true
	}
	i := strings.LastIndexByte(string(stat), ')')
	return i < 0 || i+2 >= len(stat) || stat[i+2] == 'Z' || stat[i+2] == 'X'
}

func waitExit(cmd *exec.Cmd, d time.Duration) {
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		if cmd.ProcessState != nil || cmd.Process.Signal(syscall.Signal(0)) != nil {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	_ = cmd.Process.Kill()
}

func (s *supervisor) startBus(ctx context.Context, e *devEnv) (string, error) {
	sock := filepath.Join(e.runDir, "bus.sock")
	if len(sock) > 100 {
		// sun_path holds 108 bytes; fall back to a short private directory.
		d, err := os.MkdirTemp("", "hangar-bus-")
		if err != nil {
			return "", err
		}
		sock = filepath.Join(d, "bus.sock")
	}
	_ = os.Remove(sock)
	conf := filepath.Join(e.runDir, "bus.conf")
	if err := os.WriteFile(conf, []byte(fmt.Sprintf(devBusConfig, sock)), 0o644); err != nil {
		return "", err
	}
	bin, err := exec.LookPath("dbus-daemon")
	if err != nil {
		return "", fmt.Errorf("dbus-daemon not found (apt-get install dbus-daemon): %w", err)
	}
	cmd := exec.Command(bin, "--config-file="+conf, "--nofork", "--nopidfile")
	cmd.Stderr = os.Stderr
	if err := s.start("dbus-daemon", cmd, true); err != nil {
		return "", err
	}
	if err := waitFor(ctx, 10*time.Second, "the private D-Bus daemon to listen", func() bool {
		c, err := net.Dial("unix", sock)
		if err == nil {
			c.Close()
		}
		return err == nil
	}); err != nil {
		return "", err
	}
	return "unix:path=" + sock, nil
}

// startService runs one service with its own NOTIFY_SOCKET, and waits for
// its READY=1, exactly as systemd would for a Type=notify unit.
func (s *supervisor) startService(ctx context.Context, e *devEnv, svc devService, bin string) error {
	notifyPath := filepath.Join(e.runDir, "notify-"+svc.name+".sock")
	if len(notifyPath) > 100 {
		d, err := os.MkdirTemp("", "hangar-notify-")
		if err != nil {
			return err
		}
		notifyPath = filepath.Join(d, "notify.sock")
	}
	_ = os.Remove(notifyPath)
	nconn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: notifyPath, Net: "unixgram"})
	if err != nil {
		return fmt.Errorf("notify socket for %s: %w", svc.name, err)
	}
	ready := make(chan struct{})
	go func() {
		defer nconn.Close()
		buf := make([]byte, 4096)
		once := sync.Once{}
		for {
			n, _, err := nconn.ReadFromUnix(buf)
			if err != nil {
				return
			}
			for _, line := range strings.Split(string(buf[:n]), "\n") {
				switch {
				case line == "READY=1":
					once.Do(func() { close(ready) })
				case strings.HasPrefix(line, "STATUS="):
					fmt.Fprintf(os.Stderr, "hangar dev: %s: %s\n", svc.binary, strings.TrimPrefix(line, "STATUS="))
				}
			}
		}
	}()
	for _, d := range []string{e.stateDir(svc.name), e.runtimeDir(svc.name)} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	cmd := exec.Command(bin, svc.args(e)...)
	cmd.Env = append(os.Environ(),
		"DBUS_SYSTEM_BUS_ADDRESS="+e.busAddress,
		"NOTIFY_SOCKET="+notifyPath,
		"HANGAR_DEV=1",
	)
	cmd.Stdout = os.Stderr
	cmd.Stderr = os.Stderr
	if err := s.start(svc.binary, cmd, true); err != nil {
		return err
	}
	select {
	case <-ready:
		return nil
	case name := <-s.exited:
		return fmt.Errorf("%s exited before it was ready", name)
	case <-time.After(60 * time.Second):
		return fmt.Errorf("%s did not report READY=1 within 60s", svc.binary)
	case <-ctx.Done():
		return ctx.Err()
	}
}

func waitFor(ctx context.Context, d time.Duration, what string, cond func() bool) error {
	deadline := time.Now().Add(d)
	for {
		if cond() {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("timed out after %s waiting for %s", d, what)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// waitAPI waits until the endpoint answers HTTP at all (an unsigned request
// gets AWS's MissingAuthenticationToken, which is an answer).
func waitAPI(ctx context.Context, endpoint string, exited <-chan string) error {
	client := &http.Client{Timeout: time.Second}
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := client.Get(endpoint + "/")
		if err == nil {
			_, _ = bufio.NewReader(resp.Body).Peek(1)
			resp.Body.Close()
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the API at %s did not answer within 30s: %w", endpoint, err)
		}
		select {
		case name := <-exited:
			return fmt.Errorf("%s exited before the API answered", name)
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}
