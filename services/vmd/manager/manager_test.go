package manager

// The manager against a fake runner and a fake QMP: what happens after a
// host reboot, after QEMU died while vmd was away, on a guest power-off,
// and when two creates race for the last capacity. The real QEMU path is
// tested in services/vmd.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/internal/store"
	"hangar.dev/hangar/services/vmd/core"
	"hangar.dev/hangar/services/vmd/qmp"
	"hangar.dev/hangar/services/vmd/runner"
)

// fakeQEMU is one pretend QEMU process with its monitor. It starts held,
// as -S holds a real one, until cont.
type fakeQEMU struct {
	pid    int
	events chan qmp.Event
	once   sync.Once

	mu      sync.Mutex
	running bool
	fds     map[string]*os.File // getfd'd, not yet taken by a netdev
	netdevs map[string]*os.File // netdev id -> its tap
	devices map[string]map[string]any
}

type fakeRunner struct {
	mu      sync.Mutex
	nextPID int
	procs   map[string]*fakeQEMU // by instance id
	starts  map[string]int
}

func newFakeRunner() *fakeRunner {
	return &fakeRunner{nextPID: 1000, procs: map[string]*fakeQEMU{}, starts: map[string]int{}}
}

func (r *fakeRunner) Name() string          { return "fake" }
func (r *fakeRunner) Unit(id string) string { return "" }

func (r *fakeRunner) Start(_ context.Context, s runner.Spec) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(s.Argv) < 2 {
		return 0, errors.New("no argv")
	}
	r.nextPID++
	r.procs[s.ID] = &fakeQEMU{pid: r.nextPID, events: make(chan qmp.Event, 16),
		fds: map[string]*os.File{}, netdevs: map[string]*os.File{}, devices: map[string]map[string]any{}}
	r.starts[s.ID]++
	return r.nextPID, nil
}

func (r *fakeRunner) Find(_ context.Context, s runner.Spec) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if p := r.procs[s.ID]; p != nil {
		return p.pid, nil
	}
	return 0, nil
}

// exit ends the pretend process: its monitor's events close.
func (r *fakeRunner) exit(id string, events ...qmp.Event) {
	r.mu.Lock()
	p := r.procs[id]
	delete(r.procs, id)
	r.mu.Unlock()
	if p == nil {
		return
	}
	for _, e := range events {
		p.events <- e
	}
	p.once.Do(func() {
		close(p.events)
		p.mu.Lock()
		defer p.mu.Unlock()
		for _, f := range p.fds {
			f.Close()
		}
		for _, f := range p.netdevs {
			f.Close()
		}
	})
}

func (r *fakeRunner) Kill(_ context.Context, s runner.Spec) error { r.exit(s.ID); return nil }
func (r *fakeRunner) Cleanup(context.Context, runner.Spec) error  { return nil }

func (r *fakeRunner) startsOf(id string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.starts[id]
}

type fakeMonitor struct {
	r  *fakeRunner
	id string
	p  *fakeQEMU
}

func (r *fakeRunner) dial(_ context.Context, socket string) (qmp.Monitor, error) {
	id := filepath.Base(filepath.Dir(socket))
	r.mu.Lock()
	defer r.mu.Unlock()
	p := r.procs[id]
	if p == nil {
		return nil, fmt.Errorf("connect %s: no such file", socket)
	}
	return &fakeMonitor{r: r, id: id, p: p}, nil
}

func (m *fakeMonitor) Events() <-chan qmp.Event { return m.p.events }
func (m *fakeMonitor) Close() error             { return nil }
func (m *fakeMonitor) Execute(ctx context.Context, cmd string, args any, out any) error {
	return m.ExecuteWithFile(ctx, cmd, args, nil, out)
}

func (m *fakeMonitor) ExecuteWithFile(_ context.Context, cmd string, args any, file *os.File, out any) error {
	p := m.p
	p.mu.Lock()
	defer p.mu.Unlock()
	arg := func(k string) any { return args.(map[string]any)[k] }
	switch cmd {
	case "query-status":
		if st, ok := out.(*struct {
			Running bool   `json:"running"`
			Status  string `json:"status"`
		}); ok {
			st.Running, st.Status = p.running, "running"
			if !p.running {
				st.Status = "prelaunch"
			}
		}
	case "cont":
		p.running = true
	case "qom-list":
		l := out.(*[]struct {
			Name string `json:"name"`
		})
		for id := range p.devices {
			*l = append(*l, struct {
				Name string `json:"name"`
			}{id})
		}
	case "getfd":
		if file == nil {
			return errors.New("getfd: no file descriptor supplied via SCM_RIGHTS")
		}
		dup, err := syscall.Dup(int(file.Fd())) // QEMU keeps its own copy
		if err != nil {
			return err
		}
		p.fds[arg("fdname").(string)] = os.NewFile(uintptr(dup), "fd")
	case "netdev_add":
		id, fdname := arg("id").(string), arg("fd").(string)
		if p.netdevs[id] != nil {
			return fmt.Errorf("duplicate ID '%s' for netdev", id)
		}
		f := p.fds[fdname]
		if f == nil {
			return fmt.Errorf("file descriptor named '%s' has not been found", fdname)
		}
		delete(p.fds, fdname)
		p.netdevs[id] = f
	case "netdev_del":
		id := arg("id").(string)
		if p.netdevs[id] == nil {
			return fmt.Errorf("device '%s' not found", id)
		}
		p.netdevs[id].Close()
		delete(p.netdevs, id)
	case "device_add":
		d := args.(map[string]any)
		if d["netdev"] != nil && p.netdevs[d["netdev"].(string)] == nil {
			return fmt.Errorf("property 'netdev' can't find value '%v'", d["netdev"])
		}
		p.devices[d["id"].(string)] = d
	case "system_powerdown":
		// a well-behaved guest: POWERDOWN, then it powers off
		go m.r.exit(m.id, qmp.Event{Name: "POWERDOWN"}, qmp.Event{Name: "SHUTDOWN", Data: map[string]any{"guest": true}})
	case "quit":
		go m.r.exit(m.id, qmp.Event{Name: "SHUTDOWN", Data: map[string]any{"guest": false}})
	}
	return nil
}

type env struct {
	t   *testing.T
	dir string
	db  *store.DB
	r   *fakeRunner
}

func newEnv(t *testing.T) *env {
	dir := t.TempDir()
	db, err := store.Open(filepath.Join(dir, "state.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return &env{t: t, dir: dir, db: db, r: newFakeRunner()}
}

func (e *env) manager(bootID string, capacity core.Capacity) *Manager {
	e.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	e.t.Cleanup(cancel)
	m, err := New(ctx, Config{
		StateDir: filepath.Join(e.dir, "state"), RuntimeDir: filepath.Join(e.dir, "run"), QEMU: "/usr/bin/qemu-system-x86_64",
		Firmware: core.Firmware{SeaBIOS: "/bios.bin"}, Accel: core.AccelTCG, Capacity: capacity,
		Runner: e.r, Dial: e.r.dial, DB: e.db, Log: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
		BootID: bootID,
	})
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(m.Close)
	return m
}

var roomy = core.Capacity{HostCPUs: 8, HostMemoryMiB: 16384, CPUOvercommit: 1}

func spec(id string) api.InstanceSpec {
	return api.InstanceSpec{ID: id, InstanceType: "t3.micro", VCPUs: 2, MemoryMiB: 1024, Kernel: "/vmlinuz"}
}

func waitState(t *testing.T, m *Manager, id, state string) api.InstanceInfo {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		info, err := m.Describe(id)
		if err == nil && info.State == state {
			return info
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: state %s (%v), want %s", id, info.State, err, state)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

const (
	a = "i-0aaaaaaaaaaaaaaa1"
	b = "i-0bbbbbbbbbbbbbbb2"
	c = "i-0ccccccccccccccc3"
)

func TestHostRebootRestartsRunningKeepsStopped(t *testing.T) {
	e := newEnv(t)
	m := e.manager("boot-1", roomy)
	ctx := context.Background()
	for _, id := range []string{a, b} {
		if _, err := m.Create(ctx, spec(id)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := m.Stop(ctx, b, false, time.Minute); err != nil {
		t.Fatal(err)
	}
	waitState(t, m, b, api.InstanceStateStopped)
	m.Close()

	// The host reboots: every process is gone, the boot id changed.
	e.r.exit(a)
	m2 := e.manager("boot-2", roomy)
	m2.Recover(ctx)
	info := waitState(t, m2, a, api.InstanceStateRunning)
	if e.r.startsOf(a) != 2 || info.PID == 0 {
		t.Errorf("running instance was not started again: %d starts, %+v", e.r.startsOf(a), info)
	}
	if info, _ := m2.Describe(b); info.State != api.InstanceStateStopped || e.r.startsOf(b) != 1 {
		t.Errorf("stopped instance: %s after %d starts, want stopped after 1", info.State, e.r.startsOf(b))
	}
}

func TestQEMUGoneWhileVMDWasDown(t *testing.T) {
	e := newEnv(t)
	m := e.manager("boot-1", roomy)
	ctx := context.Background()
	if _, err := m.Create(ctx, spec(a)); err != nil {
		t.Fatal(err)
	}
	if _, err := m.Create(ctx, spec(b)); err != nil {
		t.Fatal(err)
	}
	m.Close()
	e.r.exit(a) // died while vmd was down; b still runs

	m2 := e.manager("boot-1", roomy)
	m2.Recover(ctx)
	info := waitState(t, m2, a, api.InstanceStateStopped)
	if info.StateReason != core.ReasonUnexpectedExit || e.r.startsOf(a) != 1 {
		t.Errorf("crashed instance: %+v, %d starts", info, e.r.startsOf(a))
	}
	info = waitState(t, m2, b, api.InstanceStateRunning)
	if info.SystemStatus != api.StatusCheckOK {
		t.Errorf("reattached instance: system status %s", info.SystemStatus)
	}
	// and it is controllable: a stop completes through the reattached monitor
	if _, err := m2.Stop(ctx, b, false, time.Minute); err != nil {
		t.Fatal(err)
	}
	waitState(t, m2, b, api.InstanceStateStopped)
}

func TestGuestPowerOffFollowsShutdownBehavior(t *testing.T) {
	e := newEnv(t)
	m := e.manager("boot-1", roomy)
	ctx := context.Background()
	sa := spec(a)
	sa.ShutdownBehavior = api.ShutdownTerminate
	for _, s := range []api.InstanceSpec{sa, spec(b)} {
		if _, err := m.Create(ctx, s); err != nil {
			t.Fatal(err)
		}
	}
	shutdown := qmp.Event{Name: "SHUTDOWN", Data: map[string]any{"guest": true, "reason": "guest-shutdown"}}
	e.r.exit(a, shutdown)
	e.r.exit(b, shutdown)
	if info := waitState(t, m, a, api.InstanceStateTerminated); info.StateReason != core.ReasonInstanceShutdown {
		t.Errorf("a: reason %q", info.StateReason)
	}
	if info := waitState(t, m, b, api.InstanceStateStopped); info.StateReason != core.ReasonInstanceShutdown {
		t.Errorf("b: reason %q", info.StateReason)
	}
	if used, _ := m.Usage(); used.VCPUs != 0 {
		t.Errorf("capacity still held: %+v", used)
	}
}

func TestCapacityRace(t *testing.T) {
	e := newEnv(t)
	// room for exactly one 2-vCPU instance
	m := e.manager("boot-1", core.Capacity{HostCPUs: 3, HostMemoryMiB: 16384, CPUOvercommit: 1})
	var wg sync.WaitGroup
	errs := make([]error, 3)
	for i, id := range []string{a, b, c} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = m.Create(context.Background(), spec(id))
		}()
	}
	wg.Wait()
	ok, refused := 0, 0
	for _, err := range errs {
		var me *Error
		switch {
		case err == nil:
			ok++
		case errors.As(err, &me) && me.Name == api.ErrInsufficientCapacity:
			refused++
		default:
			t.Errorf("unexpected error %v", err)
		}
	}
	if ok != 1 || refused != 2 || len(m.Instances()) != 1 {
		t.Fatalf("%d created, %d refused, %d known; want 1, 2, 1", ok, refused, len(m.Instances()))
	}
	// a stopped instance frees its capacity; starting it again competes
	id := m.Instances()[0]
	if _, err := m.Stop(context.Background(), id, true, 0); err != nil {
		t.Fatal(err)
	}
	waitState(t, m, id, api.InstanceStateStopped)
	other := a
	if id == a {
		other = b
	}
	if _, err := m.Create(context.Background(), spec(other)); err != nil {
		t.Fatalf("create after stop: %v", err)
	}
	var me *Error
	if _, err := m.Start(context.Background(), id); !errors.As(err, &me) || me.Name != api.ErrInsufficientCapacity {
		t.Fatalf("start without capacity: %v", err)
	}
}

// fakeTaps stands in for hangar-netd's OpenTap: each call hands over a new
// descriptor (a pipe, which is as good as a tap to the fake QEMU).
type fakeTaps struct {
	mu     sync.Mutex
	opened map[string]int
	fail   error
}

func (f *fakeTaps) OpenTap(_ context.Context, eni string) (*os.File, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fail != nil {
		return nil, f.fail
	}
	r, w, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	w.Close()
	if f.opened == nil {
		f.opened = map[string]int{}
	}
	f.opened[eni]++
	return r, nil
}

func (f *fakeTaps) count(eni string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.opened[eni]
}

func (r *fakeRunner) proc(id string) *fakeQEMU {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.procs[id]
}

// A NIC whose tap is in a VPC's namespace gets its tap from netd at every
// start of QEMU, over QMP before the guest runs; a reattach needs nothing
// from netd; a launch vmd left half-done is finished when it comes back.
func TestNamespaceNICsComeFromNetd(t *testing.T) {
	e := newEnv(t)
	taps := &fakeTaps{}
	mk := func() *Manager {
		m := e.manager("boot-1", roomy)
		m.cfg.Taps = taps
		return m
	}
	m := mk()
	ctx := context.Background()
	const eni = "eni-0123456789abcdef0"
	sa := spec(a)
	sa.NICs = []api.InstanceNIC{{ID: eni, Tap: "ht-0123456789ab", MAC: "02:00:00:00:00:0A", Namespace: "hangar-vpc-0123456789abcdef0"}}
	info, err := m.Create(ctx, sa)
	if err != nil {
		t.Fatal(err)
	}
	p := e.r.proc(a)
	if info.State != api.InstanceStateRunning || taps.count(eni) != 1 || !p.running {
		t.Fatalf("after create: %s, %d taps opened, guest running %v", info.State, taps.count(eni), p.running)
	}
	if d := p.devices["nic0"]; d == nil || d["bus"] != "rp0" || d["mac"] != "02:00:00:00:00:0a" || p.netdevs["net0"] == nil || len(p.fds) != 0 {
		t.Fatalf("qemu's devices %v, netdevs %v, loose fds %v", p.devices, p.netdevs, p.fds)
	}

	// vmd restarts: the guest keeps its netdev; netd is not asked again.
	m.Close()
	m = mk()
	m.Recover(ctx)
	if info := waitState(t, m, a, api.InstanceStateRunning); info.SystemStatus != api.StatusCheckOK || taps.count(eni) != 1 {
		t.Fatalf("after reattach: %+v, %d taps opened", info, taps.count(eni))
	}

	// Stop and start: a new QEMU, a new descriptor.
	if _, err := m.Stop(ctx, a, false, time.Minute); err != nil {
		t.Fatal(err)
	}
	waitState(t, m, a, api.InstanceStateStopped)
	if _, err := m.Start(ctx, a); err != nil {
		t.Fatal(err)
	}
	if taps.count(eni) != 2 || e.r.proc(a).devices["nic0"] == nil {
		t.Fatalf("after start: %d taps opened, devices %v", taps.count(eni), e.r.proc(a).devices)
	}

	// vmd stopped between netdev_add and device_add, before cont: the
	// next vmd finishes the launch instead of leaving the guest held.
	m.Close()
	p = e.r.proc(a)
	p.mu.Lock()
	p.running = false
	delete(p.devices, "nic0")
	p.mu.Unlock()
	m = mk()
	m.Recover(ctx)
	waitState(t, m, a, api.InstanceStateRunning)
	if !p.running || p.devices["nic0"] == nil || taps.count(eni) != 3 {
		t.Fatalf("held guest not finished: running %v, devices %v, %d taps opened", p.running, p.devices, taps.count(eni))
	}

	// netd cannot give the tap: the launch fails and leaves nothing.
	taps.fail = &api.Error{Name: api.ErrNotFound, Message: "interface eni-0123456789abcdef0 does not exist"}
	sb := spec(b)
	sb.NICs = []api.InstanceNIC{{ID: "eni-0bbbbbbbbbbbbbbb2", Tap: "ht-0bbbbbbbbbbb", MAC: "02:00:00:00:00:0b", Namespace: "hangar-vpc-0123456789abcdef0"}}
	if _, err := m.Create(ctx, sb); err == nil {
		t.Fatal("create without a tap succeeded")
	}
	if _, err := m.Describe(b); err == nil || e.r.proc(b) != nil {
		t.Fatalf("failed launch left the instance (%v) or its qemu (%v)", err, e.r.proc(b))
	}
}
