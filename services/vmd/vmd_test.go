package main

// Integration tests: hangar-vmd as a process on a private D-Bus, running
// real QEMU (TCG) guests with a busybox initramfs, a tap the test creates
// and a disk qemu-nbd serves, driven through api.ComputeClient exactly as
// the gateway will drive it.

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/godbus/dbus/v5"

	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/internal/hostconf"
	"hangar.dev/hangar/services/vmd/testguest"
	"hangar.dev/hangar/tests/harness"
)

var (
	buildOnce sync.Once
	vmdBin    string
	buildErr  error
)

// binary returns hangar-vmd from HANGAR_BIN_DIR (make test) or a fresh
// build.
func binary(t *testing.T) string {
	t.Helper()
	if d := os.Getenv("HANGAR_BIN_DIR"); d != "" {
		if p := filepath.Join(d, "hangar-vmd"); fileExists(p) {
			return p
		}
	}
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "hangar-vmd-bin-")
		if err != nil {
			buildErr = err
			return
		}
		vmdBin = filepath.Join(dir, "hangar-vmd")
		out, err := exec.Command("go", "build", "-o", vmdBin, ".").CombinedOutput()
		if err != nil {
			buildErr = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return vmdBin
}

func fileExists(p string) bool { _, err := os.Stat(p); return err == nil }

// vmdEnv is one hangar-vmd with its bus, config and directories.
type vmdEnv struct {
	t          *testing.T
	bin        string
	bus        string
	dir        string
	stateDir   string
	runtimeDir string
	config     string
	extraArgs  []string
	runnerArgs []string
	cmd        *exec.Cmd
	done       chan struct{}
	log        *os.File
	conn       *dbus.Conn
	client     *api.ComputeClient
}

func newVMDEnv(t *testing.T, cfg hostconf.Config, extra ...string) *vmdEnv {
	t.Helper()
	// Short paths: QMP sockets must fit in sun_path.
	dir, err := os.MkdirTemp("", "vmdt-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return newVMDEnvIn(t, dir, cfg, nil, extra...)
}

// newVMDEnvIn starts vmd with its directories under dir and the given
// runner flags (nil: the process runner).
func newVMDEnvIn(t *testing.T, dir string, cfg hostconf.Config, runnerArgs []string, extra ...string) *vmdEnv {
	t.Helper()
	e := &vmdEnv{t: t, bin: binary(t), bus: harness.StartBus(t), dir: dir,
		stateDir: filepath.Join(dir, "state"), runtimeDir: filepath.Join(dir, "run"),
		config: filepath.Join(dir, "host.json"), extraArgs: extra, runnerArgs: runnerArgs}
	if err := hostconf.Save(e.config, cfg); err != nil {
		t.Fatal(err)
	}
	log, err := os.Create(filepath.Join(dir, "vmd.log"))
	if err != nil {
		t.Fatal(err)
	}
	e.log = log
	t.Cleanup(func() {
		if t.Failed() {
			b, _ := os.ReadFile(log.Name())
			t.Logf("hangar-vmd log:\n%s", tail(string(b), 6000))
		}
	})
	conn, err := dbus.Connect(e.bus)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	e.conn = conn
	e.client = api.NewComputeClient(conn)
	e.start()
	t.Cleanup(e.stop)
	return e
}

func devConfig() hostconf.Config {
	return hostconf.Config{AccountID: "123456789012", Region: "us-east-1", AvailabilityZone: "us-east-1a", AllowSoftwareEmulation: true, CPUOvercommit: 8}
}

func (e *vmdEnv) start() {
	e.t.Helper()
	runnerArgs := e.runnerArgs
	if runnerArgs == nil {
		runnerArgs = []string{"--runner", "process"}
	}
	args := append([]string{"--config", e.config, "--state-dir", e.stateDir, "--runtime-dir", e.runtimeDir}, runnerArgs...)
	args = append(args, e.extraArgs...)
	cmd := exec.Command(e.bin, args...)
	cmd.Env = append(os.Environ(), "DBUS_SYSTEM_BUS_ADDRESS="+e.bus, "HANGAR_LOG_LEVEL=debug")
	cmd.Stdout, cmd.Stderr = e.log, e.log
	if err := cmd.Start(); err != nil {
		e.t.Fatal(err)
	}
	e.cmd = cmd
	e.done = make(chan struct{})
	go func() { _ = cmd.Wait(); close(e.done) }()
	waitFor(e.t, 30*time.Second, "hangar-vmd to own dev.hangar.Compute1 and answer Status", func() bool {
		select {
		case <-e.done:
			e.t.Fatalf("hangar-vmd exited: %v", cmd.ProcessState)
		default:
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_, err := api.Status(ctx, e.conn, api.Compute)
		return err == nil
	})
}

func (e *vmdEnv) kill9() {
	_ = e.cmd.Process.Signal(syscall.SIGKILL)
	<-e.done
}

func (e *vmdEnv) stop() {
	if e.cmd == nil {
		return
	}
	select {
	case <-e.done:
		return
	default:
	}
	_ = e.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-e.done:
	case <-time.After(10 * time.Second):
		e.kill9()
	}
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return c
}

func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", d, what)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

func randomID(prefix string, n int) string {
	b := make([]byte, (n+1)/2)
	_, _ = rand.Read(b)
	return prefix + hex.EncodeToString(b)[:n]
}

func (e *vmdEnv) waitState(id, state string, d time.Duration) api.InstanceInfo {
	e.t.Helper()
	var info api.InstanceInfo
	waitFor(e.t, d, fmt.Sprintf("instance %s to be %s", id, state), func() bool {
		var err error
		info, err = e.client.DescribeInstance(context.Background(), id)
		return err == nil && info.State == state
	})
	return info
}

func (e *vmdEnv) console(id string) string {
	out, _, err := e.client.GetConsoleOutput(context.Background(), id, true)
	if err != nil {
		e.t.Fatalf("get console output: %v", err)
	}
	return out
}

func (e *vmdEnv) waitConsole(id string, d time.Duration, what string, cond func(string) bool) string {
	e.t.Helper()
	var out string
	deadline := time.Now().Add(d)
	for {
		out = e.console(id)
		if cond(out) {
			return out
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("timed out after %s waiting for %s on the console of %s; console:\n%s", d, what, id, tail(out, 3000))
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func requireGuestPrereqs(t *testing.T) {
	t.Helper()
	harness.RequireRoot(t)
	harness.Require(t, "qemu-system-x86_64", "dbus-daemon", "ip")
	if !fileExists("/usr/share/seabios/bios-256k.bin") {
		t.Skip("skipping: /usr/share/seabios/bios-256k.bin missing (apt-get install seabios)")
	}
}

// makeTap creates a persistent tap, as netd will, and removes it at the end.
func makeTap(t *testing.T) string {
	t.Helper()
	name := randomID("vmdt", 8)
	if out, err := exec.Command("ip", "tuntap", "add", "dev", name, "mode", "tap").CombinedOutput(); err != nil {
		t.Skipf("skipping: cannot create a tap (%v: %s)", err, out)
	}
	t.Cleanup(func() { _ = exec.Command("ip", "link", "del", name).Run() })
	if out, err := exec.Command("ip", "link", "set", name, "up").CombinedOutput(); err != nil {
		t.Fatalf("ip link set up: %v: %s", err, out)
	}
	return name
}

// tapInUse reports whether a process holds the tap (tun sets carrier on
// attach and drops it on detach).
func tapInUse(t *testing.T, tap string) bool {
	b, err := os.ReadFile("/sys/class/net/" + tap + "/carrier")
	if err != nil {
		t.Fatalf("reading carrier of %s: %v", tap, err)
	}
	return strings.TrimSpace(string(b)) == "1"
}

// qemuProcesses lists pids whose command line mentions id.
func qemuProcesses(id string) []int {
	var pids []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cmdline, err := os.ReadFile("/proc/" + e.Name() + "/cmdline")
		if err != nil || !strings.Contains(string(cmdline), "guest="+id) {
			continue
		}
		stat, _ := os.ReadFile("/proc/" + e.Name() + "/stat")
		if i := strings.LastIndexByte(string(stat), ')'); i > 0 && i+2 < len(stat) && stat[i+2] == 'Z' {
			continue
		}
		pids = append(pids, pid)
	}
	return pids
}

// killLeftovers makes sure no guest of the test survives it.
func killLeftovers(t *testing.T, id string) {
	t.Cleanup(func() {
		for _, pid := range qemuProcesses(id) {
			t.Logf("killing leftover qemu %d of %s", pid, id)
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	})
}

type guest struct {
	kernel, initrd string
}

func testGuest(t *testing.T) guest {
	t.Helper()
	k, mods := testguest.Kernel(t)
	return guest{kernel: k, initrd: testguest.Initramfs(t, t.TempDir(), mods)}
}

func (g guest) spec(id, tap, mac string) api.InstanceSpec {
	s := api.InstanceSpec{
		ID: id, InstanceType: "t3.nano", VCPUs: 1, MemoryMiB: 256,
		Kernel: g.kernel, Initrd: g.initrd, KernelCmdline: testguest.Cmdline,
	}
	if tap != "" {
		s.NICs = []api.InstanceNIC{{ID: "eni-0123456789abcdef0", Tap: tap, MAC: mac}}
	}
	return s
}

// nbdDisk serves a small raw file with qemu-nbd on a unix socket.
func nbdDisk(t *testing.T, dir string) string {
	t.Helper()
	harness.Require(t, "qemu-nbd")
	img := filepath.Join(dir, "disk.raw")
	if err := os.WriteFile(img, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 16<<20); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "vol.sock")
	cmd := exec.Command("qemu-nbd", "--socket="+sock, "--format=raw", "--persistent", "--shared=4", img)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	waitFor(t, 10*time.Second, "qemu-nbd to listen", func() bool { return fileExists(sock) })
	return sock
}

func TestInstanceLifecycle(t *testing.T) {
	requireGuestPrereqs(t)
	g := testGuest(t)
	e := newVMDEnv(t, devConfig())
	id := randomID("i-", 17)
	killLeftovers(t, id)
	tap := makeTap(t)
	mac := "02:16:3e:12:34:56"

	states, err := e.client.WatchInstanceStates(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	var (
		seenMu sync.Mutex
		seen   []string
	)
	go func() {
		for c := range states {
			if c.ID == id {
				seenMu.Lock()
				seen = append(seen, c.State+"|"+c.Reason)
				seenMu.Unlock()
			}
		}
	}()

	spec := g.spec(id, tap, mac)
	info, err := e.client.CreateInstance(ctx(t), spec)
	if err != nil {
		t.Fatalf("CreateInstance: %v", err)
	}
	if info.State != api.InstanceStateRunning || info.Accelerator != "tcg" || info.PID == 0 || info.Runner != "process" {
		t.Fatalf("after create: %+v", info)
	}
	// Idempotent: the same spec again returns the same instance; another
	// spec under the same id is a conflict.
	again, err := e.client.CreateInstance(ctx(t), spec)
	if err != nil || again.PID != info.PID {
		t.Fatalf("repeated CreateInstance: %+v, %v", again, err)
	}
	other := spec
	other.MemoryMiB = 512
	if _, err := e.client.CreateInstance(ctx(t), other); !api.IsName(err, api.ErrConflict) {
		t.Fatalf("CreateInstance with other settings: %v, want Conflict", err)
	}

	out := e.waitConsole(id, 90*time.Second, "the guest's init", func(s string) bool { return booted(s) })
	// cloud-init's EC2 detection: uuid starts with ec2 and equals the serial.
	dmi := lineWith(out, testguest.MarkerDMI)
	fields := map[string]string{}
	for _, f := range strings.Fields(strings.TrimPrefix(dmi, testguest.MarkerDMI)) {
		k, v, _ := strings.Cut(f, "=")
		fields[k] = v
	}
	if !strings.Contains(dmi, "vendor=Amazon EC2") || fields["product"] != "t3.nano" || !strings.HasPrefix(fields["uuid"], "ec2") ||
		!strings.EqualFold(fields["uuid"], fields["serial"]) || fields["asset"] != id {
		t.Errorf("guest DMI does not look like EC2: %q", dmi)
	}
	if !strings.Contains(lineWith(out, "HANGAR-NET:"), "eth0") {
		t.Errorf("guest has no eth0 on the tap: %q", lineWith(out, "HANGAR-NET:"))
	}
	if !tapInUse(t, tap) {
		t.Errorf("tap %s has no carrier while the guest runs", tap)
	}

	// The per-instance object, as busctl introspect shows it.
	obj := e.conn.Object(api.Compute.Name, api.InstancePath(id))
	for prop, want := range map[string]any{api.PropInstanceState: "running", api.PropInstanceAccelerator: "tcg", api.PropInstanceVCPUs: uint32(1), api.PropInstanceMemoryMiB: uint32(256), api.PropInstanceQMPSocket: filepath.Join(e.runtimeDir, id, "qmp.sock")} {
		v, err := obj.GetProperty(api.ComputeInstanceInterface + "." + prop)
		if err != nil || v.Value() != want {
			t.Errorf("property %s = %v (%v), want %v", prop, v.Value(), err, want)
		}
	}
	if err := e.client.ReportGuestActivity(ctx(t), mac, api.GuestActivityDHCP); err != nil {
		t.Fatal(err)
	}
	if info, _ := e.client.DescribeInstance(ctx(t), id); info.InstanceStatus != api.StatusCheckOK || info.SystemStatus != api.StatusCheckOK {
		t.Errorf("status checks after guest activity: system %s instance %s", info.SystemStatus, info.InstanceStatus)
	}

	// Hot-plug an NBD disk: the guest sees an NVMe disk with the volume id
	// as its serial.
	vol := api.InstanceDisk{ID: "vol-0aa00000000000001", Socket: nbdDisk(t, e.dir), DeviceName: "/dev/sdf"}
	if _, err := e.client.AttachVolume(ctx(t), id, vol); err != nil {
		t.Fatalf("AttachVolume: %v", err)
	}
	e.waitConsole(id, 60*time.Second, "the hot-plugged NVMe disk", func(s string) bool {
		return strings.Contains(lastLineWith(s, testguest.MarkerBlock), "=vol0aa00000000000001")
	})
	info, err = e.client.DetachVolume(ctx(t), id, vol.ID, false)
	if err != nil {
		t.Fatalf("DetachVolume: %v", err)
	}
	waitFor(t, 60*time.Second, "the volume to detach", func() bool {
		info, _ = e.client.DescribeInstance(context.Background(), id)
		return len(info.Volumes) == 0
	})
	e.waitConsole(id, 30*time.Second, "the NVMe disk to go", func(s string) bool {
		return !strings.Contains(lastLineWith(s, testguest.MarkerBlock), "vol0aa")
	})

	// Reboot: Ctrl-Alt-Del reaches init, which reboots; the instance stays
	// running and boots again.
	ups := strings.Count(e.console(id), testguest.MarkerUp)
	if _, err := e.client.RebootInstance(ctx(t), id); err != nil {
		t.Fatalf("RebootInstance: %v", err)
	}
	e.waitConsole(id, 90*time.Second, "the guest to boot again", func(s string) bool { return strings.Count(s, testguest.MarkerUp) > ups && booted(s) })
	if info, _ := e.client.DescribeInstance(ctx(t), id); info.State != api.InstanceStateRunning {
		t.Fatalf("after reboot: %s", info.State)
	}
	if !strings.Contains(e.console(id), testguest.MarkerCAD) {
		t.Errorf("the guest's init did not see Ctrl-Alt-Del")
	}

	// kill -9 vmd: the guest keeps running and is controllable after a
	// restart.
	pid := info.PID
	e.kill9()
	if !alive(int(pid)) {
		t.Fatalf("qemu %d died with vmd", pid)
	}
	e.start()
	info, err = e.client.DescribeInstance(ctx(t), id)
	if err != nil || info.State != api.InstanceStateRunning || info.PID != pid || info.SystemStatus != api.StatusCheckOK {
		t.Fatalf("after vmd restart: %+v, %v", info, err)
	}

	// Stop through ACPI: the guest's init powers off on the button.
	if info, err = e.client.StopInstance(ctx(t), id, false, 60); err != nil || info.State != api.InstanceStateStopping {
		t.Fatalf("StopInstance: %+v, %v", info, err)
	}
	info = e.waitState(id, api.InstanceStateStopped, 60*time.Second)
	if !strings.Contains(e.console(id), testguest.MarkerPoweroff) {
		t.Errorf("the guest did not see the ACPI power button")
	}
	if info.StateReason != "Client.UserInitiatedShutdown: User initiated shutdown" {
		t.Errorf("stop reason %q", info.StateReason)
	}
	if len(qemuProcesses(id)) != 0 || tapInUse(t, tap) || fileExists(filepath.Join(e.runtimeDir, id)) {
		t.Errorf("after stop: qemu %v, tap in use %v, runtime dir kept %v", qemuProcesses(id), tapInUse(t, tap), fileExists(filepath.Join(e.runtimeDir, id)))
	}

	// Start again.
	ups = strings.Count(e.console(id), testguest.MarkerUp)
	if info, err = e.client.StartInstance(ctx(t), id); err != nil || info.State != api.InstanceStateRunning {
		t.Fatalf("StartInstance: %+v, %v", info, err)
	}
	e.waitConsole(id, 90*time.Second, "the guest to boot after start", func(s string) bool { return strings.Count(s, testguest.MarkerUp) > ups && booted(s) })

	// Terminate: everything but the record and console goes.
	if info, err = e.client.TerminateInstance(ctx(t), id); err != nil {
		t.Fatalf("TerminateInstance: %v", err)
	}
	e.waitState(id, api.InstanceStateTerminated, 60*time.Second)
	if len(qemuProcesses(id)) != 0 || tapInUse(t, tap) || fileExists(filepath.Join(e.runtimeDir, id)) {
		t.Errorf("after terminate: qemu %v, tap in use %v, runtime dir kept %v", qemuProcesses(id), tapInUse(t, tap), fileExists(filepath.Join(e.runtimeDir, id)))
	}
	if _, err := e.client.StartInstance(ctx(t), id); !api.IsName(err, api.ErrConflict) {
		t.Errorf("starting a terminated instance: %v, want Conflict", err)
	}
	if !strings.Contains(e.console(id), testguest.MarkerUp) {
		t.Errorf("console of a terminated instance is gone")
	}
	if err := e.client.DeleteInstance(ctx(t), id); err != nil {
		t.Fatal(err)
	}
	if _, err := e.client.DescribeInstance(ctx(t), id); !api.IsName(err, api.ErrNotFound) {
		t.Errorf("describe after delete: %v, want NotFound", err)
	}
	if fileExists(filepath.Join(e.stateDir, "instances", id)) {
		t.Errorf("instance directory kept after delete")
	}

	seenMu.Lock()
	defer seenMu.Unlock()
	joined := strings.Join(seen, "\n")
	for _, want := range []string{"running|", "stopping|Client.UserInitiatedShutdown", "stopped|", "shutting-down|", "terminated|"} {
		if !strings.Contains(joined, want) {
			t.Errorf("no InstanceStateChanged %q among:\n%s", want, joined)
		}
	}
}

// A guest that powers itself off follows its shutdown behaviour, and the
// capacity it held is free again.
func TestGuestInitiatedShutdownAndCapacity(t *testing.T) {
	requireGuestPrereqs(t)
	g := testGuest(t)
	e := newVMDEnv(t, devConfig())

	// Capacity: more memory than the host has is refused, and nothing is
	// left of the refused instance.
	big := randomID("i-", 17)
	killLeftovers(t, big)
	spec := g.spec(big, "", "")
	spec.MemoryMiB = 4 << 20
	if _, err := e.client.CreateInstance(ctx(t), spec); !api.IsName(err, api.ErrInsufficientCapacity) {
		t.Fatalf("oversized CreateInstance: %v, want InsufficientCapacity", err)
	}
	if _, err := e.client.DescribeInstance(ctx(t), big); !api.IsName(err, api.ErrNotFound) {
		t.Errorf("refused instance is known: %v", err)
	}
	list, _ := e.client.ListInstances(ctx(t))
	if len(list) != 0 || len(qemuProcesses(big)) != 0 || fileExists(filepath.Join(e.runtimeDir, big)) || fileExists(filepath.Join(e.stateDir, "instances", big)) {
		t.Errorf("refused instance left something: list %v, qemu %v", list, qemuProcesses(big))
	}
	if _, err := e.client.CreateInstance(ctx(t), api.InstanceSpec{ID: "i-nope"}); !api.IsName(err, api.ErrInvalidArgument) {
		t.Errorf("bad spec: %v, want InvalidArgument", err)
	}

	// Instance a powers itself off with shutdown behaviour terminate;
	// instance b is stopped with force.
	a, b := randomID("i-", 17), randomID("i-", 17)
	killLeftovers(t, a)
	killLeftovers(t, b)
	sa := g.spec(a, "", "")
	sa.ShutdownBehavior = api.ShutdownTerminate
	sa.KernelCmdline += " " + testguest.SelfPoweroff
	if _, err := e.client.CreateInstance(ctx(t), sa); err != nil {
		t.Fatal(err)
	}
	if _, err := e.client.CreateInstance(ctx(t), g.spec(b, "", "")); err != nil {
		t.Fatal(err)
	}
	used := rootProp(t, e, "UsedVCPUs")
	if used != uint32(2) {
		t.Errorf("UsedVCPUs with two guests = %v", used)
	}
	info := e.waitState(a, api.InstanceStateTerminated, 120*time.Second)
	if info.StateReason != "Client.InstanceInitiatedShutdown: Instance initiated shutdown" {
		t.Errorf("guest shutdown reason %q", info.StateReason)
	}
	if !strings.Contains(e.console(a), testguest.MarkerSelfOff) || len(qemuProcesses(a)) != 0 {
		t.Errorf("self power-off: console or process wrong")
	}

	e.waitConsole(b, 90*time.Second, "the guest's init", func(s string) bool { return booted(s) })
	if _, err := e.client.StopInstance(ctx(t), b, true, 0); err != nil {
		t.Fatal(err)
	}
	e.waitState(b, api.InstanceStateStopped, 30*time.Second)
	if len(qemuProcesses(b)) != 0 {
		t.Fatalf("forced stop left qemu running")
	}
	waitFor(t, 10*time.Second, "capacity to be free again", func() bool { return rootProp(t, e, "UsedVCPUs") == uint32(0) })
}

func rootProp(t *testing.T, e *vmdEnv, name string) any {
	v, err := e.conn.Object(api.Compute.Name, api.Compute.Path).GetProperty(api.Compute.Interface + "." + name)
	if err != nil {
		t.Fatalf("reading %s: %v", name, err)
	}
	return v.Value()
}

// booted reports whether the guest's last boot got to its main loop (its
// power-button watcher is set up by then).
func booted(console string) bool {
	i := strings.LastIndex(console, testguest.MarkerUp)
	return i >= 0 && strings.Contains(console[i:], testguest.MarkerBlock)
}

func lineWith(s, marker string) string {
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, marker) {
			return strings.TrimSpace(l)
		}
	}
	return ""
}

func lastLineWith(s, marker string) string {
	ls := strings.Split(s, "\n")
	for i := len(ls) - 1; i >= 0; i-- {
		if strings.Contains(ls[i], marker) {
			return strings.TrimSpace(ls[i])
		}
	}
	return ""
}

func alive(pid int) bool {
	return pid > 0 && syscall.Kill(pid, 0) == nil && len(qemuProcessesPid(pid)) > 0
}

func qemuProcessesPid(pid int) []byte {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return nil
	}
	if i := strings.LastIndexByte(string(stat), ')'); i > 0 && i+2 < len(stat) && stat[i+2] == 'Z' {
		return nil
	}
	return stat
}
