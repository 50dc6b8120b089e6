package main

// The systemd runner for real: a container booted with systemd-nspawn
// (the host's own /usr on a volatile root, so QEMU and systemd are the
// host's, booting in about two seconds) runs each guest as a transient
// unit. hangar-vmd runs on the host and reaches the container's systemd
// through its bus socket, bound out of the container, exactly as it
// reaches the host's systemd on an image. The test's directory is bound at
// the same path inside, so QMP sockets and console logs are shared.

import (
	"bufio"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/vmd/core"
	"hangar.dev/hangar/services/vmd/testguest"
	"hangar.dev/hangar/tests/harness"
)

type container struct {
	cmd    *exec.Cmd
	leader int
	bus    string
}

// bootContainer boots systemd in a container and returns it once its
// system manager answers on the bus.
func bootContainer(t *testing.T, shared string) *container {
	t.Helper()
	harness.Require(t, "systemd-nspawn", "nsenter")
	if !fileExists("/usr/lib/systemd/systemd") || !fileExists("/usr/share/dbus-1/system.conf") {
		t.Skip("skipping: systemd or the dbus system bus configuration is not installed (apt-get install systemd dbus)")
	}
	busDir := filepath.Join(shared, "bus")
	if err := os.MkdirAll(busDir, 0o755); err != nil {
		t.Fatal(err)
	}
	name := randomID("vmdsd", 8)
	log, err := os.Create(filepath.Join(shared, "nspawn.log"))
	if err != nil {
		t.Fatal(err)
	}
	// --volatile=yes: a tmpfs root with the host's /usr, read-only; the
	// container's /etc starts empty, so first-boot prompts are off.
	cmd := exec.Command("systemd-nspawn", "-D", "/", "--volatile=yes", "-b", "--register=no", "--keep-unit",
		"--console=read-only", "-M", name,
		"--bind="+busDir+":/run/dbus", "--bind="+shared,
		"systemd.firstboot=off")
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	start := time.Now()
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting systemd-nspawn: %v", err)
	}
	c := &container{cmd: cmd, bus: "unix:path=" + filepath.Join(busDir, "system_bus_socket")}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		// SIGTERM asks nspawn to power the container off, which stops
		// every unit in it; SIGKILL if that hangs.
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(20 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
		if t.Failed() {
			b, _ := os.ReadFile(log.Name())
			t.Logf("container console:\n%s", tail(string(b), 3000))
		}
	})
	waitFor(t, 60*time.Second, "the container's systemd to be running", func() bool {
		select {
		case <-exited:
			b, _ := os.ReadFile(log.Name())
			t.Fatalf("systemd-nspawn exited: %s", tail(string(b), 2000))
		default:
		}
		if c.leader == 0 {
			c.leader = findInit(cmd.Process.Pid)
			return false
		}
		out, _ := exec.Command("nsenter", "-t", itoa(c.leader), "-a", "systemctl", "is-system-running").Output()
		s := strings.TrimSpace(string(out))
		return s == "running" || s == "degraded"
	})
	t.Logf("container %s booted in %s", name, time.Since(start).Round(10*time.Millisecond))
	return c
}

// findInit walks down from nspawn to the container's systemd.
func findInit(pid int) int {
	for i := 0; i < 4; i++ {
		kids, _ := filepath.Glob("/proc/" + itoa(pid) + "/task/*/children")
		next := 0
		for _, k := range kids {
			b, _ := os.ReadFile(k)
			if f := strings.Fields(string(b)); len(f) > 0 {
				next = atoi(f[0])
				break
			}
		}
		if next == 0 {
			return 0
		}
		pid = next
		comm, _ := os.ReadFile("/proc/" + itoa(pid) + "/comm")
		if strings.TrimSpace(string(comm)) == "systemd" {
			return pid
		}
	}
	return 0
}

func (c *container) systemctlShow(t *testing.T, unit string, props ...string) map[string]string {
	t.Helper()
	out, err := exec.Command("nsenter", "-t", itoa(c.leader), "-a", "systemctl", "show", unit, "-p", strings.Join(props, ",")).Output()
	if err != nil {
		t.Fatalf("systemctl show %s: %v", unit, err)
	}
	m := map[string]string{}
	s := bufio.NewScanner(strings.NewReader(string(out)))
	for s.Scan() {
		k, v, _ := strings.Cut(s.Text(), "=")
		m[k] = v
	}
	return m
}

func TestSystemdTransientUnits(t *testing.T) {
	requireGuestPrereqs(t)
	if testing.Short() {
		t.Skip("skipping: boots a systemd container (-short)")
	}
	g := testGuest(t)
	shared, err := os.MkdirTemp("", "vmdsd-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(shared) })
	// the guest's kernel and initramfs must be visible inside too
	for _, f := range []*string{&g.kernel, &g.initrd} {
		dst := filepath.Join(shared, filepath.Base(*f))
		b, err := os.ReadFile(*f)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(dst, b, 0o644); err != nil {
			t.Fatal(err)
		}
		*f = dst
	}
	c := bootContainer(t, shared)
	e := newVMDEnvIn(t, shared, devConfig(), []string{"--runner", "systemd", "--systemd-bus", c.bus})

	id := randomID("i-", 17)
	unit := "hangar-vm-" + id + ".service"
	spec := g.spec(id, "", "")
	spec.VCPUs, spec.MemoryMiB = 2, 384
	// The NIC is a tap in a VPC-like namespace: a transient unit inherits
	// no descriptor from vmd, so the tap reaches its QEMU over QMP.
	n := makeNetnsTap(t)
	netd := startFakeNetd(t, e.bus, n)
	spec.NICs = []api.InstanceNIC{n.nic()}
	info, err := e.client.CreateInstance(ctx(t), spec)
	if err != nil {
		t.Fatalf("CreateInstance: %v", err)
	}
	if info.Runner != "systemd" || info.Unit != unit || info.State != api.InstanceStateRunning {
		t.Fatalf("after create: %+v", info)
	}
	show := c.systemctlShow(t, unit, "ActiveState", "Slice", "CPUQuotaPerSecUSec", "MemoryMax", "KillMode", "Type", "MainPID", "ControlGroup", "Description")
	want := map[string]string{
		"ActiveState": "active", "Slice": "hangar-vms.slice", "CPUQuotaPerSecUSec": "2s",
		"MemoryMax": itoa((384 + core.OverheadFor(core.AccelTCG).Headroom) << 20), "KillMode": "mixed", "Type": "exec",
		"Description": "hangar EC2 instance " + id,
	}
	for k, v := range want {
		if show[k] != v {
			t.Errorf("systemctl show %s: %s=%q, want %q", unit, k, show[k], v)
		}
	}
	t.Logf("systemctl show %s: %v", unit, show)
	out := e.waitConsole(id, 90*time.Second, "the guest to boot in its unit", booted)
	if !strings.Contains(lineWith(out, "HANGAR-NET:"), "eth0") || n.stat(t, "carrier") != 1 || netd.count(n.eni) != 1 {
		t.Errorf("the unit's guest and its tap: %q, carrier %d, OpenTap called %d times", lineWith(out, "HANGAR-NET:"), n.stat(t, "carrier"), netd.count(n.eni))
	}
	waitFor(t, 60*time.Second, "frames from the unit's guest on the tap", func() bool { return n.stat(t, "statistics/rx_packets") > 0 })

	// vmd dies; the unit and its guest do not. The new vmd finds the unit
	// and reattaches.
	e.kill9()
	if s := c.systemctlShow(t, unit, "ActiveState"); s["ActiveState"] != "active" {
		t.Fatalf("unit %s is %s after vmd was killed", unit, s["ActiveState"])
	}
	e.start()
	if info, err := e.client.DescribeInstance(ctx(t), id); err != nil || info.State != api.InstanceStateRunning || info.SystemStatus != api.StatusCheckOK {
		t.Fatalf("after vmd restart: %+v, %v", info, err)
	}

	// Stop through ACPI; the unit goes away (CollectMode=inactive-or-failed).
	if _, err := e.client.StopInstance(ctx(t), id, false, 60); err != nil {
		t.Fatal(err)
	}
	e.waitState(id, api.InstanceStateStopped, 60*time.Second)
	if s := c.systemctlShow(t, unit, "LoadState", "ActiveState"); s["ActiveState"] == "active" || s["ActiveState"] == "activating" {
		t.Errorf("unit %s still %v after stop", unit, s)
	}
	if !strings.Contains(e.console(id), testguest.MarkerPoweroff) {
		t.Errorf("the guest did not power off through ACPI")
	}
	waitFor(t, 10*time.Second, "the tap to lose its carrier after stop", func() bool { return n.stat(t, "carrier") == 0 })
	// Start again in a new unit of the same name, then terminate.
	if _, err := e.client.StartInstance(ctx(t), id); err != nil {
		t.Fatalf("StartInstance: %v", err)
	}
	if s := c.systemctlShow(t, unit, "ActiveState"); s["ActiveState"] != "active" {
		t.Fatalf("unit %s is %s after start", unit, s["ActiveState"])
	}
	if netd.count(n.eni) != 2 || n.stat(t, "carrier") != 1 {
		t.Errorf("after start: OpenTap called %d times in all, carrier %d", netd.count(n.eni), n.stat(t, "carrier"))
	}
	// An operator's `systemctl stop` is a shutdown vmd did not ask for:
	// the instance ends stopped, saying so.
	e.waitConsole(id, 90*time.Second, "the guest to boot in its new unit", func(s string) bool {
		return strings.Count(s, testguest.MarkerUp) >= 2 && booted(s)
	})
	if out, err := exec.Command("nsenter", "-t", itoa(c.leader), "-a", "systemctl", "stop", unit).CombinedOutput(); err != nil {
		t.Fatalf("systemctl stop %s: %v: %s", unit, err, out)
	}
	if info := e.waitState(id, api.InstanceStateStopped, 60*time.Second); info.StateReason != core.ReasonOutsideShutdown {
		t.Errorf("after systemctl stop: reason %q", info.StateReason)
	}
	if _, err := e.client.TerminateInstance(context.Background(), id); err != nil {
		t.Fatal(err)
	}
	e.waitState(id, api.InstanceStateTerminated, 60*time.Second)
	if s := c.systemctlShow(t, unit, "ActiveState"); s["ActiveState"] == "active" {
		t.Errorf("unit %s still active after terminate", unit)
	}
}

func itoa(n int) string { return strconv.Itoa(n) }

func atoi(s string) int { n, _ := strconv.Atoi(strings.TrimSpace(s)); return n }
