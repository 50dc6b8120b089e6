package main

// NICs whose tap lives in another network namespace, as netd makes them
// (one namespace per VPC): vmd cannot name such a tap, so it asks netd
// (OpenTap over D-Bus) for it, opened, at every start of QEMU and passes the
// descriptor over QMP. Here a tap in a scratch namespace is served by a
// tiny stand-in for netd on the test's private bus, which opens it exactly
// as netd does.

import (
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/godbus/dbus/v5"
	"golang.org/x/sys/unix"

	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/internal/busutil"
)

// netnsTap is a tap in a network namespace of its own.
type netnsTap struct {
	ns, tap, eni, mac string
}

// makeNetnsTap creates a named namespace with a tap in it, both removed
// when the test ends.
func makeNetnsTap(t *testing.T) netnsTap {
	t.Helper()
	n := netnsTap{ns: randomID("vmdt-ns-", 8), tap: randomID("ht-", 8), eni: randomID("eni-", 17), mac: "02:16:3e:00:00:01"}
	if out, err := exec.Command("ip", "netns", "add", n.ns).CombinedOutput(); err != nil {
		t.Skipf("skipping: cannot create a network namespace (%v: %s)", err, out)
	}
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", n.ns).Run() })
	for _, args := range [][]string{
		{"-n", n.ns, "tuntap", "add", "dev", n.tap, "mode", "tap"},
		{"-n", n.ns, "link", "set", n.tap, "up"},
	} {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
	if _, err := os.Stat("/sys/class/net/" + n.tap); err == nil {
		t.Fatalf("tap %s is visible in the host namespace", n.tap)
	}
	return n
}

// stat reads a file under /sys/class/net/<tap>/ inside the namespace.
func (n netnsTap) stat(t *testing.T, file string) int {
	t.Helper()
	out, err := exec.Command("ip", "netns", "exec", n.ns, "cat", "/sys/class/net/"+n.tap+"/"+file).CombinedOutput()
	if err != nil {
		t.Fatalf("reading %s of %s in %s: %v: %s", file, n.tap, n.ns, err, out)
	}
	v, _ := strconv.Atoi(strings.TrimSpace(string(out)))
	return v
}

// fakeNetd owns dev.hangar.Network1 on the bus and answers OpenTap for
// the taps it was given, opening them in their namespace.
type fakeNetd struct {
	mu     sync.Mutex
	taps   map[string]netnsTap
	opened map[string]int
}

func startFakeNetd(t *testing.T, bus string, taps ...netnsTap) *fakeNetd {
	t.Helper()
	f := &fakeNetd{taps: map[string]netnsTap{}, opened: map[string]int{}}
	for _, n := range taps {
		f.taps[n.eni] = n
	}
	conn, err := dbus.Connect(bus)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	srv := busutil.NewServer(conn)
	err = srv.Export(&busutil.Object{
		Path: api.Network.Path, Interface: api.Network.Interface,
		Methods: map[string]any{api.NetOpenTap: func(eni string) (dbus.UnixFD, *dbus.Error) {
			f.mu.Lock()
			n, ok := f.taps[eni]
			f.mu.Unlock()
			if !ok {
				return -1, api.Errorf(api.ErrNotFound, "interface %s does not exist", eni)
			}
			file, err := openTapIn(n.ns, n.tap)
			if err != nil {
				return -1, api.Errorf(api.ErrFailed, "%v", err)
			}
			f.mu.Lock()
			f.opened[eni]++
			f.mu.Unlock()
			// as netd: the reply carries a duplicate; ours goes once sent
			time.AfterFunc(2*time.Second, func() { _ = file.Close() })
			return dbus.UnixFD(file.Fd()), nil
		}},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := srv.ClaimName(api.Network.Name); err != nil {
		t.Fatal(err)
	}
	return f
}

func (f *fakeNetd) count(eni string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.opened[eni]
}

// openTapIn attaches to tap in the named namespace (IFF_TAP|IFF_NO_PI),
// on a locked thread that returns to its own namespace after.
func openTapIn(ns, tap string) (*os.File, error) {
	runtime.LockOSThread()
	self, err := os.Open("/proc/thread-self/ns/net")
	if err != nil {
		runtime.UnlockOSThread()
		return nil, err
	}
	defer self.Close()
	target, err := os.Open("/run/netns/" + ns)
	if err != nil {
		runtime.UnlockOSThread()
		return nil, err
	}
	defer target.Close()
	if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWNET); err != nil {
		runtime.UnlockOSThread()
		return nil, fmt.Errorf("entering %s: %w", ns, err)
	}
	defer func() {
		// A thread that cannot go back stays locked and dies with its
		// goroutine, so no other code runs in the wrong namespace.
		if unix.Setns(int(self.Fd()), unix.CLONE_NEWNET) == nil {
			runtime.UnlockOSThread()
		}
	}()
	fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	ifr, err := unix.NewIfreq(tap)
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI)
	if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("attaching to tap %s in %s: %w", tap, ns, err)
	}
	return os.NewFile(uintptr(fd), tap), nil
}

func (n netnsTap) nic() api.InstanceNIC {
	return api.InstanceNIC{ID: n.eni, Tap: n.tap, MAC: n.mac, Namespace: n.ns}
}

// TestNamespaceTap: the guest's NIC is a tap in another namespace, handed
// over by netd at each start; frames flow; a restart of vmd needs nothing
// from netd; stop lets go of the tap and start takes it again.
func TestNamespaceTap(t *testing.T) {
	requireGuestPrereqs(t)
	g := testGuest(t)
	e := newVMDEnv(t, devConfig())
	n := makeNetnsTap(t)
	netd := startFakeNetd(t, e.bus, n)
	id := randomID("i-", 17)
	killLeftovers(t, id)

	spec := g.spec(id, "", "")
	spec.NICs = []api.InstanceNIC{n.nic()}
	info, err := e.client.CreateInstance(ctx(t), spec)
	if err != nil {
		t.Fatalf("CreateInstance: %v", err)
	}
	if info.State != api.InstanceStateRunning || netd.count(n.eni) != 1 {
		t.Fatalf("after create: %s, OpenTap called %d times", info.State, netd.count(n.eni))
	}
	out := e.waitConsole(id, 90*time.Second, "the guest's init", booted)
	if !strings.Contains(lineWith(out, "HANGAR-NET:"), "eth0") {
		t.Errorf("guest has no eth0: %q", lineWith(out, "HANGAR-NET:"))
	}
	if n.stat(t, "carrier") != 1 {
		t.Errorf("tap %s in %s has no carrier while the guest runs", n.tap, n.ns)
	}
	// The guest's init brings eth0 up; IPv6 duplicate address detection
	// and router solicitations come out of the tap.
	waitFor(t, 60*time.Second, "frames from the guest on the tap in the namespace", func() bool { return n.stat(t, "statistics/rx_packets") > 0 })

	// kill -9 vmd: the guest keeps its NIC, and the new vmd does not ask
	// netd again.
	e.kill9()
	e.start()
	if info, err := e.client.DescribeInstance(ctx(t), id); err != nil || info.State != api.InstanceStateRunning || info.SystemStatus != api.StatusCheckOK {
		t.Fatalf("after vmd restart: %+v, %v", info, err)
	}
	if netd.count(n.eni) != 1 || n.stat(t, "carrier") != 1 {
		t.Errorf("after vmd restart: OpenTap called %d times, carrier %d", netd.count(n.eni), n.stat(t, "carrier"))
	}

	// Stop: QEMU lets go of the tap. Start: a new descriptor.
	if _, err := e.client.StopInstance(ctx(t), id, false, 60); err != nil {
		t.Fatal(err)
	}
	e.waitState(id, api.InstanceStateStopped, 60*time.Second)
	waitFor(t, 10*time.Second, "the tap to lose its carrier after stop", func() bool { return n.stat(t, "carrier") == 0 })
	ups := strings.Count(e.console(id), "HANGAR-GUEST-UP")
	if info, err := e.client.StartInstance(ctx(t), id); err != nil || info.State != api.InstanceStateRunning {
		t.Fatalf("StartInstance: %+v, %v", info, err)
	}
	if netd.count(n.eni) != 2 {
		t.Errorf("start called OpenTap %d times in all, want 2", netd.count(n.eni))
	}
	e.waitConsole(id, 90*time.Second, "the guest to boot after start", func(s string) bool {
		return strings.Count(s, "HANGAR-GUEST-UP") > ups && booted(s)
	})
	if n.stat(t, "carrier") != 1 {
		t.Errorf("no carrier after start")
	}
	if _, err := e.client.TerminateInstance(ctx(t), id); err != nil {
		t.Fatal(err)
	}
	e.waitState(id, api.InstanceStateTerminated, 60*time.Second)
	waitFor(t, 10*time.Second, "the tap to lose its carrier after terminate", func() bool { return n.stat(t, "carrier") == 0 })

	// A tap netd does not know: the launch fails, nothing is kept.
	bad := randomID("i-", 17)
	killLeftovers(t, bad)
	spec = g.spec(bad, "", "")
	other := n.nic()
	other.ID = randomID("eni-", 17)
	spec.NICs = []api.InstanceNIC{other}
	if _, err := e.client.CreateInstance(ctx(t), spec); err == nil || !strings.Contains(err.Error(), "does not exist") {
		t.Fatalf("CreateInstance with a tap netd does not know: %v", err)
	}
	if _, err := e.client.DescribeInstance(ctx(t), bad); !api.IsName(err, api.ErrNotFound) || len(qemuProcesses(bad)) != 0 {
		t.Errorf("failed launch left the instance (%v) or qemu %v", err, qemuProcesses(bad))
	}
}
