package main

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/godbus/dbus/v5"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/internal/awsid"
	"hangar.dev/hangar/services/internal/hostconf"
	"hangar.dev/hangar/tests/harness"
)

// A world is what the integration tests run netd in: a "host" namespace
// of its own (so netd's host table, forwarding and proxy ARP never touch
// the real machine) with an uplink to a "LAN" namespace that stands for
// the LAN and the internet, a private bus, and netd started as a process
// inside the host namespace, as systemd would start it on a host.
type world struct {
	t        *testing.T
	tag      string
	hostNS   string
	lanNS    string
	bus      string
	conn     *dbus.Conn
	net      api.NetworkClient
	dir      string
	bin      string
	cmd      *exec.Cmd
	done     chan error
	logs     *lockedBuf
	guests   []*guest
	cleanups []func()
}

type lockedBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuf) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// Addresses of the world's LAN.
const (
	hostLAN      = "192.0.2.1"
	lanPeer      = "192.0.2.254"
	publicPool   = "192.0.2.48/28"
	protectedNet = "198.51.100.0/24"
	protectedIP  = "198.51.100.10"
)

var (
	binOnce sync.Once
	binPath string
	binErr  error
)

// netdBinary is HANGAR_BIN_DIR/hangar-netd (make test) or a fresh build.
func netdBinary(t *testing.T) string {
	if d := os.Getenv("HANGAR_BIN_DIR"); d != "" {
		if p := filepath.Join(d, "hangar-netd"); fileExists(p) {
			return p
		}
	}
	binOnce.Do(func() {
		dir, err := os.MkdirTemp("", "hangar-netd-bin-")
		if err != nil {
			binErr = err
			return
		}
		binPath = filepath.Join(dir, "hangar-netd")
		out, err := exec.Command("go", "build", "-o", binPath, ".").CombinedOutput()
		if err != nil {
			binErr = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if binErr != nil {
		t.Fatal(binErr)
	}
	return binPath
}

func fileExists(p string) bool { _, err := os.Stat(p); return err == nil }

func sh(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

func inNS(t *testing.T, ns string, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "ip", append([]string{"netns", "exec", ns}, args...)...).CombinedOutput()
	return string(out), err
}

func mustNS(t *testing.T, ns string, args ...string) string {
	t.Helper()
	out, err := inNS(t, ns, args...)
	if err != nil {
		t.Fatalf("in %s: %s: %v\n%s", ns, strings.Join(args, " "), err, out)
	}
	return out
}

func requireWorld(t *testing.T) {
	t.Helper()
	harness.RequireRoot(t)
	harness.Require(t, "ip", "nft", "nsenter", "udhcpc", "dig", "nslookup", "curl", "dbus-daemon")
	if _, err := os.Stat("/dev/net/tun"); err != nil {
		t.Skip("skipping: /dev/net/tun is missing")
	}
}

// newWorld builds the host and LAN namespaces and starts netd.
func newWorld(t *testing.T, region string) *world {
	t.Helper()
	requireWorld(t)
	w := &world{t: t, tag: awsid.New("w")[2:10], logs: &lockedBuf{}}
	w.hostNS, w.lanNS = "hgt-host-"+w.tag, "hgt-lan-"+w.tag
	for _, ns := range []string{w.hostNS, w.lanNS} {
		sh(t, "ip", "netns", "add", ns)
		ns := ns
		t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", ns).Run() })
	}
	sh(t, "ip", "-n", w.hostNS, "link", "set", "lo", "up")
	sh(t, "ip", "-n", w.lanNS, "link", "set", "lo", "up")
	sh(t, "ip", "-n", w.hostNS, "link", "add", "uplink0", "type", "veth", "peer", "name", "lan0", "netns", w.lanNS)
	sh(t, "ip", "-n", w.hostNS, "addr", "add", hostLAN+"/24", "dev", "uplink0")
	sh(t, "ip", "-n", w.hostNS, "link", "set", "uplink0", "up")
	sh(t, "ip", "-n", w.hostNS, "route", "add", "default", "via", lanPeer)
	sh(t, "ip", "-n", w.lanNS, "addr", "add", lanPeer+"/24", "dev", "lan0")
	sh(t, "ip", "-n", w.lanNS, "addr", "add", protectedIP+"/32", "dev", "lo")
	sh(t, "ip", "-n", w.lanNS, "link", "set", "lan0", "up")
	w.dir = t.TempDir()
	cfg := hostconf.Defaults()
	cfg.AccountID = "123456789012"
	cfg.Region = region
	cfg.AvailabilityZone = region + "a"
	cfg.UplinkInterface = "uplink0"
	cfg.PublicIPPool = mustPrefixes(publicPool)
	cfg.ProtectedCIDRs = mustPrefixes(protectedNet)
	cfg.DNSUpstreams = []string{lanPeer + ":53"}
	if err := hostconf.Save(filepath.Join(w.dir, "host.json"), cfg); err != nil {
		t.Fatal(err)
	}
	w.bus = harness.StartBus(t)
	w.bin = netdBinary(t)
	w.start()
	conn, err := dbus.Connect(w.bus)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	w.conn = conn
	w.net = api.NetworkClient{Conn: conn}
	t.Cleanup(w.teardown)
	return w
}

// start runs netd in the host namespace and waits for its name.
func (w *world) start() {
	t := w.t
	t.Helper()
	// nsenter enters only the network namespace: "ip netns exec" would
	// also give netd a private mount namespace, hiding the /run/netns
	// mounts it makes from everyone else.
	w.cmd = exec.Command("nsenter", "--net=/run/netns/"+w.hostNS, w.bin,
		"--config", filepath.Join(w.dir, "host.json"), "--state-dir", filepath.Join(w.dir, "state"), "--runtime-dir", filepath.Join(w.dir, "run"))
	w.cmd.Env = append(os.Environ(), "DBUS_SYSTEM_BUS_ADDRESS="+w.bus)
	w.cmd.Stdout, w.cmd.Stderr = w.logs, w.logs
	w.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := w.cmd.Start(); err != nil {
		t.Fatalf("starting hangar-netd: %v", err)
	}
	done := make(chan error, 1)
	go func() { done <- w.cmd.Wait() }()
	w.done = done
	conn, err := dbus.Connect(w.bus)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	deadline := time.Now().Add(30 * time.Second)
	for {
		var owner string
		if conn.BusObject().Call("org.freedesktop.DBus.GetNameOwner", 0, api.Network.Name).Store(&owner) == nil {
			return
		}
		select {
		case err := <-done:
			t.Fatalf("hangar-netd exited before owning %s: %v\n%s", api.Network.Name, err, w.logs.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("hangar-netd did not own %s within 30s\n%s", api.Network.Name, w.logs.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// kill9 kills netd the hard way.
func (w *world) kill9() {
	_ = w.cmd.Process.Signal(syscall.SIGKILL)
	<-w.done
	w.cmd = nil
}

func (w *world) stop() {
	if w.cmd == nil {
		return
	}
	_ = w.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-w.done:
	case <-time.After(10 * time.Second):
		w.t.Errorf("hangar-netd did not stop within 10s of SIGTERM")
		_ = w.cmd.Process.Kill()
		select {
		case <-w.done:
		case <-time.After(10 * time.Second):
			w.t.Errorf("hangar-netd did not exit after SIGKILL")
		}
	}
	w.cmd = nil
}

// teardown deletes every VPC netd holds (so nothing is left in /run/netns)
// and stops netd.
func (w *world) teardown() {
	for _, g := range w.guests {
		g.close()
	}
	if w.cmd != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		ids, err := w.net.ListVPCs(ctx)
		if err == nil {
			for _, id := range ids {
				w.releaseAll(ctx, id)
				if err := w.net.DeleteVPC(ctx, id); err != nil {
					w.t.Logf("deleting %s: %v", id, err)
				}
			}
		}
		cancel()
		w.stop()
	}
	if w.t.Failed() {
		w.t.Logf("hangar-netd log:\n%s", w.logs.String())
	}
	for i := len(w.cleanups) - 1; i >= 0; i-- {
		w.cleanups[i]()
	}
}

func (w *world) releaseAll(ctx context.Context, vpcID string) {
	var ifaces map[string]string
	v, err := w.conn.Object(api.Network.Name, api.VPCObjectPath(vpcID)).GetProperty(api.NetworkVPCInterface + "." + api.NetPropInterfaces)
	if err == nil {
		_ = v.Store(&ifaces)
	}
	for eni := range ifaces {
		_ = w.net.ReleaseInterface(ctx, eni)
	}
}

func mustPrefixes(s ...string) []netip.Prefix {
	var out []netip.Prefix
	for _, x := range s {
		out = append(out, netip.MustParsePrefix(x))
	}
	return out
}

// guest is a network namespace whose eth0 is a tap wired, frame for frame,
// to the ENI's tap that netd made (opened through OpenTap, as vmd hands it
// to QEMU). It runs the same DHCP, DNS and HTTP clients a guest OS would.
type guest struct {
	name  string
	ns    string
	eni   string
	mac   string
	ip    string
	files []*os.File
	wg    sync.WaitGroup
	once  sync.Once
}

func (w *world) newGuest(ctx context.Context, name, eni, mac string) *guest {
	t := w.t
	t.Helper()
	g := &guest{name: name, ns: "hgt-g-" + w.tag + "-" + name, eni: eni, mac: mac}
	sh(t, "ip", "netns", "add", g.ns)
	w.cleanups = append(w.cleanups, func() { _ = exec.Command("ip", "netns", "del", g.ns).Run() })
	sh(t, "ip", "-n", g.ns, "link", "set", "lo", "up")
	inner := openTapIn(t, g.ns, "eth0")
	sh(t, "ip", "-n", g.ns, "link", "set", "eth0", "address", mac)
	sh(t, "ip", "-n", g.ns, "link", "set", "eth0", "up")
	outer, err := w.net.OpenTap(ctx, eni)
	if err != nil {
		t.Fatalf("OpenTap %s: %v", eni, err)
	}
	// A non-blocking duplicate, so Go's poller can wake the relay and
	// Close can stop it; the original (blocking) file is closed here.
	fd, err := unix.Dup(int(outer.Fd()))
	if err != nil {
		t.Fatal(err)
	}
	outer.Close()
	if err := unix.SetNonblock(fd, true); err != nil {
		t.Fatal(err)
	}
	outer = os.NewFile(uintptr(fd), "tap-"+eni)
	g.files = []*os.File{inner, outer}
	relay := func(dst, src *os.File) {
		defer g.wg.Done()
		buf := make([]byte, 65536)
		for {
			n, err := src.Read(buf)
			if err != nil {
				return
			}
			_, _ = dst.Write(buf[:n])
		}
	}
	g.wg.Add(2)
	go relay(outer, inner)
	go relay(inner, outer)
	w.guests = append(w.guests, g)
	return g
}

func (g *guest) close() {
	g.once.Do(func() {
		for _, f := range g.files {
			_ = f.Close()
		}
		g.wg.Wait()
	})
}

// openTapIn makes a tap in ns and returns its (non-blocking) file; the
// tap lives while the file is open.
func openTapIn(t *testing.T, ns, name string) *os.File {
	t.Helper()
	var f *os.File
	err := withNS(ns, func() error {
		fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
		if err != nil {
			return err
		}
		ifr, err := unix.NewIfreq(name)
		if err != nil {
			return err
		}
		ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI)
		if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
			unix.Close(fd)
			return err
		}
		f = os.NewFile(uintptr(fd), name)
		return nil
	})
	if err != nil {
		t.Fatalf("making tap %s in %s: %v", name, ns, err)
	}
	return f
}

// withNS runs fn on a thread inside ns.
func withNS(ns string, fn func() error) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	orig, err := netns.Get()
	if err != nil {
		return err
	}
	defer orig.Close()
	target, err := netns.GetFromName(ns)
	if err != nil {
		return err
	}
	defer target.Close()
	if err := netns.Set(target); err != nil {
		return err
	}
	defer netns.Set(orig)
	return fn()
}

// dhcp runs udhcpc in the guest and returns what the lease said.
func (g *guest) dhcp(t *testing.T, dir string) map[string]string {
	t.Helper()
	script := filepath.Join(dir, "udhcpc-"+g.name+".sh")
	out := filepath.Join(dir, "lease-"+g.name)
	_ = os.Remove(out)
	body := `#!/bin/sh
case "$1" in
bound|renew)
  ip addr flush dev "$interface"
  ip addr add "$ip/$mask" dev "$interface"
  ip link set "$interface" mtu "${mtu:-1500}"
  ip route replace default via "$router" dev "$interface"
  { echo "ip=$ip"; echo "mask=$mask"; echo "router=$router"; echo "dns=$dns"; echo "domain=$domain"; echo "hostname=$hostname"; echo "mtu=$mtu"; echo "lease=$lease"; echo "serverid=$serverid"; } > ` + out + `
  ;;
deconfig)
  ip link set "$interface" up
  ;;
esac
exit 0
`
	if err := os.WriteFile(script, []byte(body), 0o755); err != nil {
		t.Fatal(err)
	}
	o, err := inNS(t, g.ns, "udhcpc", "-i", "eth0", "-f", "-q", "-n", "-t", "6", "-T", "2", "-s", script)
	if err != nil {
		t.Fatalf("udhcpc in %s: %v\n%s", g.name, err, o)
	}
	raw, err := os.ReadFile(out)
	if err != nil {
		t.Fatalf("udhcpc in %s left no lease: %v\n%s", g.name, err, o)
	}
	lease := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(raw)), "\n") {
		k, v, _ := strings.Cut(line, "=")
		lease[k] = v
	}
	g.ip = lease["ip"]
	return lease
}

// dial connects from inside ns to addr within timeout.
func dial(ns, addr string, timeout time.Duration) error {
	var conn net.Conn
	err := withNS(ns, func() error {
		var err error
		conn, err = net.DialTimeout("tcp4", addr, timeout)
		return err
	})
	if err != nil {
		return err
	}
	// Read the greeting: a connection the filter drops after the
	// handshake would not deliver it.
	_ = conn.SetReadDeadline(time.Now().Add(timeout))
	buf := make([]byte, 64)
	_, err = conn.Read(buf)
	conn.Close()
	return err
}

// listen serves a greeting naming the peer on addr inside ns until the
// test ends. The peers seen are sent to the returned channel.
func listen(t *testing.T, ns, addr string) <-chan string {
	t.Helper()
	var ln net.Listener
	if err := withNS(ns, func() error {
		var err error
		ln, err = net.Listen("tcp4", addr)
		return err
	}); err != nil {
		t.Fatalf("listening on %s in %s: %v", addr, ns, err)
	}
	t.Cleanup(func() { ln.Close() })
	peers := make(chan string, 100)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			host, _, _ := net.SplitHostPort(c.RemoteAddr().String())
			select {
			case peers <- host:
			default:
			}
			_, _ = c.Write([]byte("hello " + host + "\n"))
			c.Close()
		}
	}()
	return peers
}
