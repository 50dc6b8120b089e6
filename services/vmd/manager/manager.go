// Package manager runs hangar-vmd's instances: it keeps each instance's
// record (spec, lifecycle state, volumes) in vmd's state file, launches
// QEMU through a runner, holds one QMP connection per running guest and
// turns its events and the process's exit into state changes through the
// pure core. It reattaches to running guests when vmd starts again and
// restarts the ones that were running before a host reboot.
//
// It never decides AWS matters (ids, types, images): the gateway does, and
// hands it resolved specs.
package manager

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/internal/store"
	"hangar.dev/hangar/services/vmd/core"
	"hangar.dev/hangar/services/vmd/qmp"
	"hangar.dev/hangar/services/vmd/runner"
)

const bucket = "instances"

// TerminateGrace is how long a terminated guest gets to power off through
// ACPI before QEMU is ended.
const TerminateGrace = 15 * time.Second

// Error is a failure with the D-Bus error name the bus adapter returns.
type Error struct {
	Name string // api.Err*
	Msg  string
}

func (e *Error) Error() string { return e.Msg }

func errorf(name, format string, args ...any) error {
	return &Error{Name: name, Msg: fmt.Sprintf(format, args...)}
}

// Observer hears about changes, to publish them on the bus.
type Observer interface {
	// InstanceChanged is called after every change of an instance;
	// stateChanged is set when its lifecycle state moved.
	InstanceChanged(info api.InstanceInfo, stateChanged bool)
	// InstanceRemoved is called when an instance is forgotten.
	InstanceRemoved(id string)
	// VolumeChanged is called when a hot-plugged volume changes state.
	VolumeChanged(id, volumeID, state string)
}

// TapOpener hands over a NIC's tap, opened in the network namespace it
// lives in: hangar-netd's OpenTap (api.NetworkClient), or a fake.
type TapOpener interface {
	OpenTap(ctx context.Context, eniID string) (*os.File, error)
}

// Config is what a Manager needs.
type Config struct {
	StateDir   string // instances/<id>/{console.log,qemu.log,OVMF_VARS.fd}
	RuntimeDir string // <id>/{qmp.sock,qemu.pid}
	QEMU       string // qemu-system-x86_64
	Firmware   core.Firmware
	// Accel is the accelerator guests get; "" when none is usable, with
	// AccelProblem saying why (Create and Start then fail).
	Accel        string
	AccelProblem string
	Capacity     core.Capacity
	Runner       runner.Runner
	Dial         qmp.Dialer
	// Taps opens the taps of NICs that live in a VPC's namespace
	// (InstanceNIC.Namespace); nil when vmd has no netd to ask.
	Taps     TapOpener
	DB       *store.DB
	Log      *slog.Logger
	Observer Observer
	// BootID identifies this boot of the host
	// (/proc/sys/kernel/random/boot_id): a running instance whose QEMU is
	// gone and whose record names another boot was lost to a host reboot
	// and starts again.
	BootID string
	// MemoryOverheadMiB is added to the guest's memory for the unit's
	// MemoryMax.
	MemoryOverheadMiB int
}

// volume is one data volume of an instance.
type volume struct {
	Disk  api.InstanceDisk
	Port  string // PCIe root port while attached to a running guest
	State string // api.Disk*
}

// record is what vmd stores per instance.
type record struct {
	Spec          api.InstanceSpec
	Machine       core.Machine
	Volumes       []volume
	Ports         int    // root ports of the running QEMU
	RootPort      string // root port of the root volume
	Accel         string
	Runner        string
	BootID        string
	LaunchTime    int64
	GuestActivity int64
}

// instance is a record plus what lives only while vmd runs.
type instance struct {
	mu  sync.Mutex
	rec record
	mon qmp.Monitor
	pid int
	gen int // launch generation: events of an earlier QEMU are ignored
	// exitDone marks the generation whose exit was handled.
	exitDone int
	// resetSeen is closed on QMP RESET while a reboot waits for it.
	resetSeen chan struct{}
	// detached is signalled per volume on DEVICE_DELETED.
	detached map[string]chan struct{}
	// forceTimer ends QEMU when a stop outlasts its timeout.
	forceTimer *time.Timer
}

// Manager owns every instance of the host.
type Manager struct {
	cfg  Config
	log  *slog.Logger
	ctx  context.Context // ends when vmd shuts down; background work stops then
	mu   sync.Mutex      // guards inst and capacity admission
	inst map[string]*instance
	// closed is set by Close; checked under an instance's lock before
	// anything is written or published, so nothing touches the state file
	// or the bus after vmd closed them.
	closed atomic.Bool
}

// Close stops background work from writing: it waits for operations under
// way, then disarms the timers. Guests keep running.
func (m *Manager) Close() {
	m.closed.Store(true)
	m.mu.Lock()
	ins := make([]*instance, 0, len(m.inst))
	for _, in := range m.inst {
		ins = append(ins, in)
	}
	m.mu.Unlock()
	for _, in := range ins {
		in.mu.Lock()
		if in.forceTimer != nil {
			in.forceTimer.Stop()
			in.forceTimer = nil
		}
		if in.mon != nil {
			_ = in.mon.Close()
			in.mon = nil
		}
		in.mu.Unlock()
	}
}

// New loads the records; call Recover next.
func New(ctx context.Context, cfg Config) (*Manager, error) {
	if cfg.Observer == nil {
		cfg.Observer = nopObserver{}
	}
	if cfg.Dial == nil {
		cfg.Dial = qmp.Dial
	}
	m := &Manager{cfg: cfg, log: cfg.Log, ctx: ctx, inst: map[string]*instance{}}
	if p := m.qmpSocket("i-0123456789abcdef0"); len(p) > 107 {
		// sun_path holds 108 bytes. A deep development directory gets a
		// short stand-in named after it, so a restart finds it again.
		sum := sha256.Sum256([]byte(cfg.RuntimeDir))
		short := filepath.Join(os.TempDir(), "hangar-vm-"+hex.EncodeToString(sum[:])[:12])
		cfg.Log.Warn("runtime directory too long for QMP socket paths; using a short one", "runtime_dir", cfg.RuntimeDir, "instead", short)
		m.cfg.RuntimeDir = short
		if p := m.qmpSocket("i-0123456789abcdef0"); len(p) > 107 {
			return nil, fmt.Errorf("runtime directory %s is too long for a unix socket path (%s)", short, p)
		}
	}
	for _, d := range []string{filepath.Join(cfg.StateDir, "instances"), m.cfg.RuntimeDir} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			return nil, fmt.Errorf("creating %s: %w", d, err)
		}
	}
	err := cfg.DB.View(func(tx *store.Tx) error {
		recs, err := store.All[record](tx, bucket)
		for _, r := range recs {
			m.inst[r.Spec.ID] = &instance{rec: r, detached: map[string]chan struct{}{}}
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("loading instances: %w", err)
	}
	return m, nil
}

// observer returns the observer, or one that drops everything once the
// manager is closed.
func (m *Manager) observer() Observer {
	if m.closed.Load() {
		return nopObserver{}
	}
	return m.cfg.Observer
}

type nopObserver struct{}

func (nopObserver) InstanceChanged(api.InstanceInfo, bool) {}
func (nopObserver) InstanceRemoved(string)                 {}
func (nopObserver) VolumeChanged(string, string, string)   {}

// paths

func (m *Manager) instanceDir(id string) string {
	return filepath.Join(m.cfg.StateDir, "instances", id)
}
func (m *Manager) runDir(id string) string    { return filepath.Join(m.cfg.RuntimeDir, id) }
func (m *Manager) qmpSocket(id string) string { return filepath.Join(m.runDir(id), "qmp.sock") }
func (m *Manager) consoleLog(id string) string {
	return filepath.Join(m.instanceDir(id), "console.log")
}
func (m *Manager) varsFile(id string) string { return filepath.Join(m.instanceDir(id), "OVMF_VARS.fd") }

func (m *Manager) runSpec(r *record, argv []string) runner.Spec {
	id := r.Spec.ID
	return runner.Spec{
		ID:             id,
		Argv:           argv,
		VCPUs:          int(r.Spec.VCPUs),
		MemoryMaxBytes: uint64(int(r.Spec.MemoryMiB)+m.cfg.MemoryOverheadMiB) << 20,
		LogFile:        filepath.Join(m.instanceDir(id), "qemu.log"),
		PIDFile:        filepath.Join(m.runDir(id), "qemu.pid"),
		QMPSocket:      m.qmpSocket(id),
	}
}

// Instances returns the ids vmd knows, sorted.
func (m *Manager) Instances() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	ids := make([]string, 0, len(m.inst))
	for id := range m.inst {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	return ids
}

func (m *Manager) get(id string) (*instance, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	in := m.inst[id]
	if in == nil {
		return nil, errorf(api.ErrNotFound, "instance %s does not exist", id)
	}
	return in, nil
}

// usage sums what active instances other than skip hold. m.mu is held.
// Records are read without their lock: State is written under both locks.
func (m *Manager) usage(skip string) core.Usage {
	var u core.Usage
	for id, in := range m.inst {
		if id == skip || !core.HoldsCapacity(in.state()) {
			continue
		}
		c := m.cfg.Capacity.Charge(int(in.rec.Spec.VCPUs), int(in.rec.Spec.MemoryMiB))
		u.VCPUs += c.VCPUs
		u.MemoryMiB += c.MemoryMiB
	}
	return u
}

// Usage returns the capacity in use and the limits.
func (m *Manager) Usage() (used, limits core.Usage) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.usage(""), m.cfg.Capacity.Limits()
}

// stateMu guards the State field read by usage without the instance lock.
var stateMu sync.Mutex

func (in *instance) state() string {
	stateMu.Lock()
	defer stateMu.Unlock()
	return in.rec.Machine.State
}

func (in *instance) setMachine(mc core.Machine) {
	stateMu.Lock()
	in.rec.Machine = mc
	stateMu.Unlock()
}

func normalize(s api.InstanceSpec) api.InstanceSpec {
	if s.BootMode == "" {
		s.BootMode = api.BootModeLegacyBIOS
	}
	if s.ShutdownBehavior == "" {
		s.ShutdownBehavior = api.ShutdownStop
	}
	s.SMBIOS = core.ResolveSMBIOS(s)
	for i := range s.NICs {
		s.NICs[i].MAC = strings.ToLower(s.NICs[i].MAC)
	}
	if s.Volumes == nil {
		s.Volumes = []api.InstanceDisk{}
	}
	if s.NICs == nil {
		s.NICs = []api.InstanceNIC{}
	}
	return s
}

func (m *Manager) accelOK() error {
	if m.cfg.Accel == "" {
		return errorf(api.ErrUnavailable, "no accelerator for guests: %s", m.cfg.AccelProblem)
	}
	return nil
}

// Create registers an instance and launches it.
func (m *Manager) Create(ctx context.Context, spec api.InstanceSpec) (api.InstanceInfo, error) {
	if err := core.ValidateSpec(spec); err != nil {
		return api.InstanceInfo{}, errorf(api.ErrInvalidArgument, "%v", err)
	}
	spec = normalize(spec)
	m.mu.Lock()
	if in := m.inst[spec.ID]; in != nil {
		m.mu.Unlock()
		in.mu.Lock()
		defer in.mu.Unlock()
		if !reflect.DeepEqual(in.rec.Spec, spec) {
			return api.InstanceInfo{}, errorf(api.ErrConflict, "instance %s exists with other settings", spec.ID)
		}
		return m.info(in), nil
	}
	if err := m.accelOK(); err != nil {
		m.mu.Unlock()
		return api.InstanceInfo{}, err
	}
	if err := m.cfg.Capacity.Admit(m.usage(""), m.cfg.Capacity.Charge(int(spec.VCPUs), int(spec.MemoryMiB))); err != nil {
		m.mu.Unlock()
		return api.InstanceInfo{}, errorf(api.ErrInsufficientCapacity, "%v", err)
	}
	in := &instance{detached: map[string]chan struct{}{}}
	in.rec = record{Spec: spec, Machine: core.Machine{State: api.InstanceStateStopped}}
	for _, v := range spec.Volumes {
		in.rec.Volumes = append(in.rec.Volumes, volume{Disk: v, State: api.DiskAttached})
	}
	mc, _, _ := in.rec.Machine.Apply(core.EvLaunch, spec.ShutdownBehavior)
	in.setMachine(mc)
	in.mu.Lock()
	m.inst[spec.ID] = in // holds capacity from here on
	m.mu.Unlock()
	defer in.mu.Unlock()

	if err := m.launch(ctx, in); err != nil {
		// Nothing is kept of an instance that never ran: no record, no
		// files, no process.
		m.destroyFiles(in)
		m.mu.Lock()
		delete(m.inst, spec.ID)
		m.mu.Unlock()
		_ = m.cfg.DB.Update(func(tx *store.Tx) error { return tx.Delete(bucket, spec.ID) })
		return api.InstanceInfo{}, errorf(api.ErrFailed, "launching %s: %v", spec.ID, err)
	}
	return m.info(in), nil
}

// Start starts a stopped instance.
func (m *Manager) Start(ctx context.Context, id string) (api.InstanceInfo, error) {
	in, err := m.get(id)
	if err != nil {
		return api.InstanceInfo{}, err
	}
	in.mu.Lock()
	defer in.mu.Unlock()
	switch in.state() {
	case api.InstanceStatePending, api.InstanceStateRunning:
		return m.info(in), nil
	case api.InstanceStateStopped:
	default:
		return api.InstanceInfo{}, errorf(api.ErrConflict, "instance %s is %s; it cannot be started", id, in.state())
	}
	if err := m.accelOK(); err != nil {
		return api.InstanceInfo{}, err
	}
	// Admission and the move to pending are one step under m.mu, so two
	// starts cannot both take the last capacity; the observer hears of it
	// after m.mu is released (it reads the usage).
	m.mu.Lock()
	if err := m.cfg.Capacity.Admit(m.usage(id), m.cfg.Capacity.Charge(int(in.rec.Spec.VCPUs), int(in.rec.Spec.MemoryMiB))); err != nil {
		m.mu.Unlock()
		return api.InstanceInfo{}, errorf(api.ErrInsufficientCapacity, "%v", err)
	}
	before := in.rec.Machine
	after, _, err := before.Apply(core.EvLaunch, in.rec.Spec.ShutdownBehavior)
	if err != nil {
		m.mu.Unlock()
		return api.InstanceInfo{}, errorf(api.ErrConflict, "instance %s: %v", id, err)
	}
	in.setMachine(after)
	m.mu.Unlock()
	m.log.Info("instance state", "instance", id, "from", before.State, "to", after.State, "event", core.EvLaunch.String())
	m.save(in)
	m.observer().InstanceChanged(m.info(in), true)
	if err := m.launch(ctx, in); err != nil {
		m.handleExit(in, in.gen)
		return m.info(in), errorf(api.ErrFailed, "starting %s: %v", id, err)
	}
	return m.info(in), nil
}

// transition applies ev, persists, tells the observer and performs the
// effect. in.mu is held.
func (m *Manager) transition(in *instance, ev core.Event) error {
	if m.closed.Load() {
		return errorf(api.ErrUnavailable, "hangar-vmd is shutting down")
	}
	before := in.rec.Machine
	after, effect, err := before.Apply(ev, in.rec.Spec.ShutdownBehavior)
	if err != nil {
		var ce *core.ConflictError
		if errors.As(err, &ce) {
			return errorf(api.ErrConflict, "instance %s: %v", in.rec.Spec.ID, err)
		}
		return err
	}
	in.setMachine(after)
	switch effect {
	case core.EffectRelease:
		m.release(in)
	case core.EffectDestroy:
		m.release(in)
		m.destroyVars(in)
		for i := range in.rec.Volumes {
			in.rec.Volumes[i].State = api.DiskDetached
		}
		in.rec.Volumes = nil
	}
	if after.State != before.State {
		m.log.Info("instance state", "instance", in.rec.Spec.ID, "from", before.State, "to", after.State, "event", ev.String(), "reason", after.Reason)
	}
	m.save(in)
	m.observer().InstanceChanged(m.info(in), after.State != before.State)
	return nil
}

func (m *Manager) save(in *instance) {
	if m.closed.Load() {
		return
	}
	err := m.cfg.DB.Update(func(tx *store.Tx) error { return tx.Put(bucket, in.rec.Spec.ID, in.rec) })
	if err != nil {
		m.log.Error("saving instance", "instance", in.rec.Spec.ID, "err", err)
	}
}

// release removes what one run of QEMU needs: the unit or pidfile, the
// runtime directory, the monitor.
func (m *Manager) release(in *instance) {
	id := in.rec.Spec.ID
	if in.mon != nil {
		_ = in.mon.Close()
		in.mon = nil
	}
	if in.forceTimer != nil {
		in.forceTimer.Stop()
		in.forceTimer = nil
	}
	in.pid = 0
	ctx, cancel := context.WithTimeout(m.ctx, 10*time.Second)
	defer cancel()
	if err := m.cfg.Runner.Cleanup(ctx, m.runSpec(&in.rec, nil)); err != nil {
		m.log.Warn("cleaning up after qemu", "instance", id, "err", err)
	}
	if err := os.RemoveAll(m.runDir(id)); err != nil {
		m.log.Warn("removing runtime directory", "instance", id, "err", err)
	}
	for i := range in.rec.Volumes {
		in.rec.Volumes[i].Port = ""
		if in.rec.Volumes[i].State == api.DiskDetaching {
			in.rec.Volumes[i].State = api.DiskDetached
		}
	}
	in.rec.Volumes = keepAttached(in.rec.Volumes)
}

func keepAttached(vs []volume) []volume {
	out := vs[:0]
	for _, v := range vs {
		if v.State != api.DiskDetached {
			out = append(out, v)
		}
	}
	return out
}

func (m *Manager) destroyVars(in *instance) {
	if err := os.Remove(m.varsFile(in.rec.Spec.ID)); err != nil && !os.IsNotExist(err) {
		m.log.Warn("removing firmware vars", "instance", in.rec.Spec.ID, "err", err)
	}
}

// destroyFiles removes every file of an instance (console log included).
func (m *Manager) destroyFiles(in *instance) {
	m.release(in)
	_ = os.RemoveAll(m.instanceDir(in.rec.Spec.ID))
}

// launch starts QEMU for in (state pending) and connects to its monitor.
// in.mu is held.
func (m *Manager) launch(ctx context.Context, in *instance) error {
	r := &in.rec
	id := r.Spec.ID
	in.gen++
	gen := in.gen
	for _, d := range []string{m.instanceDir(id), m.runDir(id)} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			return fmt.Errorf("creating %s: %w", d, err)
		}
	}
	_ = os.Remove(m.qmpSocket(id))
	if err := trimLog(m.consoleLog(id), 1<<20, 256<<10); err != nil {
		return err
	}
	if r.Spec.BootMode == api.BootModeUEFI {
		if err := copyIfMissing(m.cfg.Firmware.OVMFVars, m.varsFile(id)); err != nil {
			return fmt.Errorf("preparing uefi variables: %w", err)
		}
	}
	var vols []api.InstanceDisk
	for _, v := range r.Volumes {
		vols = append(vols, v.Disk)
	}
	l := core.Launch{
		Spec: r.Spec, Volumes: vols, Accel: m.cfg.Accel, Firmware: m.cfg.Firmware,
		Paths: core.LaunchPaths{QMPSocket: m.qmpSocket(id), PIDFile: filepath.Join(m.runDir(id), "qemu.pid"), ConsoleLog: m.consoleLog(id), VarsFile: m.varsFile(id)},
	}
	args, err := core.QEMUArgs(l)
	if err != nil {
		return err
	}
	// the same port layout as core.QEMUArgs
	r.Ports = core.Ports(r.Spec, len(vols))
	port := len(r.Spec.NICs)
	r.RootPort = ""
	if r.Spec.RootVolume.ID != "" {
		r.RootPort = core.PortName(port)
		port++
	}
	for i := range r.Volumes {
		r.Volumes[i].Port = core.PortName(port)
		r.Volumes[i].State = api.DiskAttached
		port++
	}
	r.Accel = m.cfg.Accel
	r.Runner = m.cfg.Runner.Name()
	r.BootID = m.cfg.BootID
	r.LaunchTime = time.Now().Unix()
	r.GuestActivity = 0
	m.save(in)

	rs := m.runSpec(r, append([]string{m.cfg.QEMU}, args...))
	m.log.Info("launching qemu", "instance", id, "runner", rs.ID, "accel", m.cfg.Accel, "vcpus", r.Spec.VCPUs, "memory_mib", r.Spec.MemoryMiB)
	pid, err := m.cfg.Runner.Start(ctx, rs)
	if err != nil {
		return err
	}
	in.pid = pid
	if err := m.connect(ctx, in, gen, 60*time.Second); err != nil {
		kctx, cancel := context.WithTimeout(m.ctx, 20*time.Second)
		_ = m.cfg.Runner.Kill(kctx, rs)
		cancel()
		return fmt.Errorf("%w%s", err, m.qemuLogTail(id))
	}
	return nil
}

func (m *Manager) qemuLogTail(id string) string {
	tail, _ := readTail(filepath.Join(m.instanceDir(id), "qemu.log"), 600)
	if tail == "" {
		if u := m.cfg.Runner.Unit(id); u != "" {
			return " (see journalctl -u " + u + ")"
		}
		return ""
	}
	return "; qemu said: " + strings.TrimSpace(tail)
}

// connect dials QMP (retrying while QEMU comes up), asks the run state
// and starts the event loop. in.mu is held.
func (m *Manager) connect(ctx context.Context, in *instance, gen int, patience time.Duration) error {
	id := in.rec.Spec.ID
	rs := m.runSpec(&in.rec, nil)
	deadline := time.Now().Add(patience)
	var mon qmp.Monitor
	for {
		dctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		var err error
		mon, err = m.cfg.Dial(dctx, m.qmpSocket(id))
		cancel()
		if err == nil {
			break
		}
		pid, ferr := m.cfg.Runner.Find(ctx, rs)
		if ferr == nil && pid == 0 {
			return fmt.Errorf("qemu exited before its monitor answered")
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("qemu's monitor did not answer within %s: %v", patience, err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
	var status struct {
		Running bool   `json:"running"`
		Status  string `json:"status"`
	}
	qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := mon.Execute(qctx, "query-status", nil, &status); err != nil {
		_ = mon.Close()
		return err
	}
	if status.Status == "prelaunch" {
		// Held at -S: a fresh launch, or one vmd did not finish before it
		// stopped. Either way it is finished now.
		pctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		err := m.startGuest(pctx, in, mon)
		cancel()
		if err != nil {
			_ = mon.Close()
			return err
		}
		status.Running = true
	}
	in.mon = mon
	if pid, err := m.cfg.Runner.Find(ctx, rs); err == nil && pid != 0 {
		in.pid = pid
	}
	go m.watch(in, mon, gen)
	switch {
	case status.Running:
		if in.state() == api.InstanceStatePending {
			_ = m.transition(in, core.EvRunning)
		}
	case status.Status == "paused" || status.Status == "io-error" || status.Status == "internal-error":
		mc := in.rec.Machine
		mc.Paused = status.Status
		in.setMachine(mc)
		m.save(in)
	case status.Status == "shutdown":
		// the guest powered off while nobody listened; QEMU exits next
	}
	m.finishDetaches(ctx, in)
	m.observer().InstanceChanged(m.info(in), false)
	return nil
}

// startGuest lets a QEMU held at -S run, after plugging the NICs whose
// taps live in a VPC's namespace: QEMU cannot open those by name, so each
// start asks netd for the tap, opened, and passes the descriptor over QMP
// (getfd, netdev_add tap fd=…, device_add on the NIC's root port). This
// works the same for both runners: a transient unit inherits nothing from
// vmd, but its QMP socket takes descriptors. Once plugged, the netdev is
// QEMU's for the life of the process, so a reattach after a restart of vmd
// needs nothing from netd. A NIC found plugged already (vmd stopped
// half-way through a launch) is left as it is. in.mu is held.
func (m *Manager) startGuest(ctx context.Context, in *instance, mon qmp.Monitor) error {
	spec := in.rec.Spec
	if plug := core.PluggedNICs(spec); len(plug) > 0 {
		var present []struct {
			Name string `json:"name"`
		}
		if err := mon.Execute(ctx, "qom-list", map[string]any{"path": "/machine/peripheral"}, &present); err != nil {
			return fmt.Errorf("listing qemu's devices: %w", err)
		}
		have := map[string]bool{}
		for _, p := range present {
			have[p.Name] = true
		}
		for _, i := range plug {
			nic := spec.NICs[i]
			if have[core.NICDeviceID(i)] {
				continue
			}
			if err := m.plugNIC(ctx, mon, i, nic); err != nil {
				return fmt.Errorf("plugging %s (tap %s in namespace %s): %w", nic.ID, nic.Tap, nic.Namespace, err)
			}
			m.log.Debug("nic plugged", "instance", spec.ID, "eni", nic.ID, "tap", nic.Tap, "namespace", nic.Namespace)
		}
	}
	if err := mon.Execute(ctx, "cont", nil, nil); err != nil {
		return fmt.Errorf("starting the guest: %w", err)
	}
	return nil
}

func (m *Manager) plugNIC(ctx context.Context, mon qmp.Monitor, i int, nic api.InstanceNIC) error {
	if m.cfg.Taps == nil {
		return fmt.Errorf("vmd has no connection to hangar-netd, which holds the tap")
	}
	f, err := m.cfg.Taps.OpenTap(ctx, nic.ID)
	if err != nil {
		return fmt.Errorf("opening the tap through hangar-netd: %w", err)
	}
	defer f.Close() // QEMU has its own copy once getfd returned
	// A netdev without its device is what a launch interrupted between
	// the two leaves; QEMU has no query for netdevs, so it is removed
	// unconditionally (an absent one is an error that changes nothing).
	_ = mon.Execute(ctx, "netdev_del", map[string]any{"id": core.NetdevID(i)}, nil)
	if err := mon.ExecuteWithFile(ctx, "getfd", map[string]any{"fdname": core.TapFDName(i)}, f, nil); err != nil {
		return fmt.Errorf("passing the tap to qemu: %w", err)
	}
	if err := mon.Execute(ctx, "netdev_add", core.NetdevTapFD(i), nil); err != nil {
		_ = mon.Execute(ctx, "closefd", map[string]any{"fdname": core.TapFDName(i)}, nil)
		return err
	}
	if err := mon.Execute(ctx, "device_add", core.NICDevice(i, nic), nil); err != nil {
		_ = mon.Execute(ctx, "netdev_del", map[string]any{"id": core.NetdevID(i)}, nil)
		return err
	}
	return nil
}

// finishDetaches settles volumes left detaching, e.g. when the guest let go
// while vmd was not running and the DEVICE_DELETED event was lost: asking
// again either finds the device gone (then its backend is removed) or
// re-sends the unplug request, whose event the new monitor will see.
// in.mu is held.
func (m *Manager) finishDetaches(ctx context.Context, in *instance) {
	for i := range in.rec.Volumes {
		v := &in.rec.Volumes[i]
		if v.State != api.DiskDetaching || in.mon == nil {
			continue
		}
		qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := in.mon.Execute(qctx, "device_del", map[string]any{"id": core.DeviceID(v.Disk.ID)}, nil)
		if err != nil && strings.Contains(err.Error(), "not found") {
			_ = in.mon.Execute(qctx, "blockdev-del", map[string]any{"node-name": core.NodeName(v.Disk.ID)}, nil)
			v.State = api.DiskDetached
			m.observer().VolumeChanged(in.rec.Spec.ID, v.Disk.ID, api.DiskDetached)
		}
		cancel()
	}
	in.rec.Volumes = keepAttached(in.rec.Volumes)
	m.save(in)
}

// watch handles one monitor's events until it closes.
func (m *Manager) watch(in *instance, mon qmp.Monitor, gen int) {
	for ev := range mon.Events() {
		m.onEvent(in, mon, gen, ev)
	}
	in.mu.Lock()
	current := in.gen == gen && in.mon == mon
	if current {
		in.mon = nil
	}
	in.mu.Unlock()
	if !current {
		return
	}
	// The monitor closed: QEMU exited, or a command timed out and the
	// connection was dropped. The runner tells which.
	ctx, cancel := context.WithTimeout(m.ctx, 30*time.Second)
	err := runner.WaitGone(ctx, m.cfg.Runner, m.runSpec(&in.rec, nil))
	cancel()
	if err == nil {
		m.handleExit(in, gen)
		return
	}
	if m.ctx.Err() != nil {
		return
	}
	m.log.Warn("qmp connection closed but qemu still runs; reconnecting", "instance", in.rec.Spec.ID, "err", err)
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.gen != gen || in.mon != nil {
		return
	}
	cctx, cancel := context.WithTimeout(m.ctx, 30*time.Second)
	defer cancel()
	if err := m.connect(cctx, in, gen, 20*time.Second); err != nil {
		m.log.Error("reconnecting to qmp", "instance", in.rec.Spec.ID, "err", err)
	}
}

// handleExit turns a confirmed exit of generation gen into a state change.
func (m *Manager) handleExit(in *instance, gen int) {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.gen != gen || in.exitDone == gen {
		return
	}
	in.exitDone = gen
	if !core.Active(in.state()) {
		return
	}
	m.log.Info("qemu exited", "instance", in.rec.Spec.ID, "state", in.state())
	_ = m.transition(in, core.EvExited)
}

func (m *Manager) onEvent(in *instance, mon qmp.Monitor, gen int, ev qmp.Event) {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.gen != gen || in.mon != mon {
		return
	}
	id := in.rec.Spec.ID
	m.log.Debug("qmp event", "instance", id, "event", ev.Name, "data", ev.Data)
	switch ev.Name {
	case "SHUTDOWN":
		guest, _ := ev.Data["guest"].(bool)
		reason, _ := ev.Data["reason"].(string)
		m.log.Info("guest shutdown", "instance", id, "guest", guest, "reason", reason)
		switch {
		case guest:
			_ = m.transition(in, core.EvGuestShutdown)
		case in.rec.Machine.Intent == core.IntentNone:
			_ = m.transition(in, core.EvHostShutdown)
		}
	case "RESET":
		if in.resetSeen != nil {
			close(in.resetSeen)
			in.resetSeen = nil
		}
		in.rec.GuestActivity = 0
		in.rec.LaunchTime = time.Now().Unix()
		_ = m.transition(in, core.EvReset)
	case "POWERDOWN":
		_ = m.transition(in, core.EvPowerdown)
	case "STOP":
		_ = m.transition(in, core.EvPaused)
		// ask why: io-error and friends tell the operator more than "paused"
		var st struct {
			Status string `json:"status"`
		}
		ctx, cancel := context.WithTimeout(m.ctx, 5*time.Second)
		if err := mon.Execute(ctx, "query-status", nil, &st); err == nil && st.Status != "" && st.Status != "running" {
			mc := in.rec.Machine
			if mc.Paused != "" {
				mc.Paused = st.Status
				in.setMachine(mc)
				m.save(in)
			}
		}
		cancel()
		m.observer().InstanceChanged(m.info(in), false)
	case "RESUME":
		_ = m.transition(in, core.EvResumed)
	case "DEVICE_DELETED":
		dev, _ := ev.Data["device"].(string)
		for i, v := range in.rec.Volumes {
			if core.DeviceID(v.Disk.ID) != dev {
				continue
			}
			ctx, cancel := context.WithTimeout(m.ctx, 10*time.Second)
			if err := mon.Execute(ctx, "blockdev-del", map[string]any{"node-name": core.NodeName(v.Disk.ID)}, nil); err != nil {
				m.log.Warn("removing volume backend", "instance", id, "volume", v.Disk.ID, "err", err)
			}
			cancel()
			in.rec.Volumes[i].State = api.DiskDetached
			in.rec.Volumes = keepAttached(in.rec.Volumes)
			m.save(in)
			if ch := in.detached[v.Disk.ID]; ch != nil {
				close(ch)
				delete(in.detached, v.Disk.ID)
			}
			m.log.Info("volume detached", "instance", id, "volume", v.Disk.ID)
			m.observer().VolumeChanged(id, v.Disk.ID, api.DiskDetached)
			m.observer().InstanceChanged(m.info(in), false)
			break
		}
	}
}

// Stop powers an instance down: ACPI first, forced after timeout or at
// once with force.
func (m *Manager) Stop(ctx context.Context, id string, force bool, timeout time.Duration) (api.InstanceInfo, error) {
	in, err := m.get(id)
	if err != nil {
		return api.InstanceInfo{}, err
	}
	in.mu.Lock()
	defer in.mu.Unlock()
	switch in.state() {
	case api.InstanceStateStopped:
		return m.info(in), nil
	case api.InstanceStateShuttingDown, api.InstanceStateTerminated:
		return api.InstanceInfo{}, errorf(api.ErrConflict, "instance %s is %s; it cannot be stopped", id, in.state())
	}
	if err := m.transition(in, core.EvStopRequest); err != nil {
		return api.InstanceInfo{}, err
	}
	if timeout <= 0 {
		timeout = api.DefaultStopTimeoutSec * time.Second
	}
	m.powerdown(in, force, timeout)
	return m.info(in), nil
}

// powerdown asks the guest to power off and arms the forced end. in.mu is
// held.
func (m *Manager) powerdown(in *instance, force bool, timeout time.Duration) {
	id := in.rec.Spec.ID
	gen := in.gen
	if !force && in.mon != nil {
		ctx, cancel := context.WithTimeout(m.ctx, 5*time.Second)
		err := in.mon.Execute(ctx, "system_powerdown", nil, nil)
		cancel()
		if err != nil {
			m.log.Warn("acpi power-down failed; ending qemu", "instance", id, "err", err)
			force = true
		}
	}
	if force || in.mon == nil {
		go m.forceEnd(in, gen)
		return
	}
	if in.forceTimer != nil {
		in.forceTimer.Stop()
	}
	in.forceTimer = time.AfterFunc(timeout, func() {
		m.log.Info("guest did not power off in time; ending qemu", "instance", id, "timeout", timeout)
		m.forceEnd(in, gen)
	})
}

// forceEnd ends QEMU of generation gen: QMP quit (QEMU flushes and closes
// its NBD connections), SIGKILL when that does not do.
func (m *Manager) forceEnd(in *instance, gen int) {
	in.mu.Lock()
	if in.gen != gen || !core.Active(in.state()) {
		in.mu.Unlock()
		return
	}
	mon := in.mon
	rs := m.runSpec(&in.rec, nil)
	in.mu.Unlock()
	if mon != nil {
		ctx, cancel := context.WithTimeout(m.ctx, 5*time.Second)
		_ = mon.Execute(ctx, "quit", nil, nil)
		cancel()
		ctx, cancel = context.WithTimeout(m.ctx, 10*time.Second)
		err := runner.WaitGone(ctx, m.cfg.Runner, rs)
		cancel()
		if err == nil {
			m.handleExit(in, gen)
			return
		}
	}
	ctx, cancel := context.WithTimeout(m.ctx, 30*time.Second)
	defer cancel()
	if err := m.cfg.Runner.Kill(ctx, rs); err != nil {
		m.log.Error("killing qemu", "instance", in.rec.Spec.ID, "err", err)
		return
	}
	m.handleExit(in, gen)
}

// Terminate ends an instance for good.
func (m *Manager) Terminate(ctx context.Context, id string) (api.InstanceInfo, error) {
	in, err := m.get(id)
	if err != nil {
		return api.InstanceInfo{}, err
	}
	in.mu.Lock()
	defer in.mu.Unlock()
	switch in.state() {
	case api.InstanceStateTerminated:
		return m.info(in), nil
	case api.InstanceStateShuttingDown:
		return m.info(in), nil
	}
	wasStopping := in.state() == api.InstanceStateStopping
	if err := m.transition(in, core.EvTerminateRequest); err != nil {
		return api.InstanceInfo{}, err
	}
	if in.state() == api.InstanceStateShuttingDown {
		if wasStopping {
			// a stop is under way; make it quick
			go m.forceEnd(in, in.gen)
		} else {
			m.powerdown(in, false, TerminateGrace)
		}
	}
	return m.info(in), nil
}

// Delete forgets a terminated instance.
func (m *Manager) Delete(ctx context.Context, id string) error {
	m.mu.Lock()
	in := m.inst[id]
	m.mu.Unlock()
	if in == nil {
		return nil
	}
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.state() != api.InstanceStateTerminated {
		return errorf(api.ErrConflict, "instance %s is %s; terminate it first", id, in.state())
	}
	m.destroyFiles(in)
	if err := m.cfg.DB.Update(func(tx *store.Tx) error { return tx.Delete(bucket, id) }); err != nil {
		return err
	}
	m.mu.Lock()
	delete(m.inst, id)
	m.mu.Unlock()
	m.observer().InstanceRemoved(id)
	return nil
}

// Reboot asks the guest to reboot (Ctrl-Alt-Del) and resets it when it
// has not within grace.
func (m *Manager) Reboot(ctx context.Context, id string, grace time.Duration) (api.InstanceInfo, error) {
	in, err := m.get(id)
	if err != nil {
		return api.InstanceInfo{}, err
	}
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.state() != api.InstanceStateRunning && in.state() != api.InstanceStatePending {
		return api.InstanceInfo{}, errorf(api.ErrConflict, "instance %s is %s; only a running instance reboots", id, in.state())
	}
	if in.mon == nil {
		return api.InstanceInfo{}, errorf(api.ErrUnavailable, "instance %s: qemu's monitor is not connected", id)
	}
	if in.resetSeen != nil {
		return m.info(in), nil // a reboot is already under way
	}
	keys := map[string]any{"keys": []map[string]any{
		{"type": "qcode", "data": "ctrl"}, {"type": "qcode", "data": "alt"}, {"type": "qcode", "data": "delete"},
	}}
	qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	err = in.mon.Execute(qctx, "send-key", keys, nil)
	cancel()
	if err != nil {
		grace = 0
	}
	seen := make(chan struct{})
	in.resetSeen = seen
	gen := in.gen
	go func() {
		select {
		case <-seen:
			return
		case <-time.After(grace):
		case <-m.ctx.Done():
			return
		}
		in.mu.Lock()
		defer in.mu.Unlock()
		if in.gen != gen || in.resetSeen != seen || in.mon == nil {
			return
		}
		m.log.Info("guest did not reboot on ctrl-alt-del; resetting it", "instance", id, "grace", grace)
		ctx, cancel := context.WithTimeout(m.ctx, 5*time.Second)
		defer cancel()
		if err := in.mon.Execute(ctx, "system_reset", nil, nil); err != nil {
			m.log.Error("resetting guest", "instance", id, "err", err)
		}
	}()
	return m.info(in), nil
}

// Attach hot-plugs a volume into a running instance, or records it for
// the next start of a stopped one.
func (m *Manager) Attach(ctx context.Context, id string, d api.InstanceDisk) (api.InstanceInfo, error) {
	if err := core.ValidateDisk(d); err != nil {
		return api.InstanceInfo{}, errorf(api.ErrInvalidArgument, "%v", err)
	}
	in, err := m.get(id)
	if err != nil {
		return api.InstanceInfo{}, err
	}
	in.mu.Lock()
	defer in.mu.Unlock()
	r := &in.rec
	if r.Spec.RootVolume.ID == d.ID {
		return api.InstanceInfo{}, errorf(api.ErrConflict, "volume %s is the root volume of %s", d.ID, id)
	}
	for _, v := range r.Volumes {
		if v.Disk.ID == d.ID {
			if v.Disk != d {
				return api.InstanceInfo{}, errorf(api.ErrConflict, "volume %s is attached to %s with other settings", d.ID, id)
			}
			if v.State == api.DiskDetaching {
				return api.InstanceInfo{}, errorf(api.ErrConflict, "volume %s is still detaching from %s", d.ID, id)
			}
			return m.info(in), nil
		}
	}
	switch in.state() {
	case api.InstanceStateStopped:
		r.Volumes = append(r.Volumes, volume{Disk: d, State: api.DiskAttached})
		m.save(in)
		m.observer().InstanceChanged(m.info(in), false)
		return m.info(in), nil
	case api.InstanceStateRunning, api.InstanceStatePending:
	default:
		return api.InstanceInfo{}, errorf(api.ErrConflict, "instance %s is %s; volumes attach to running or stopped instances", id, in.state())
	}
	if in.mon == nil {
		return api.InstanceInfo{}, errorf(api.ErrUnavailable, "instance %s: qemu's monitor is not connected", id)
	}
	used := map[string]bool{r.RootPort: true}
	for i := range r.Spec.NICs {
		used[core.PortName(i)] = true
	}
	for _, v := range r.Volumes {
		used[v.Port] = true
	}
	port := core.FreePort(r.Ports, used)
	if port == "" {
		return api.InstanceInfo{}, errorf(api.ErrConflict, "instance %s has no free hot-plug slot (%d); stop it to attach more volumes", id, r.Ports)
	}
	qctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	if err := in.mon.Execute(qctx, "blockdev-add", core.BlockdevNBD(d), nil); err != nil {
		return api.InstanceInfo{}, errorf(api.ErrFailed, "connecting volume %s (%s): %v", d.ID, d.Socket, err)
	}
	if err := in.mon.Execute(qctx, "device_add", core.NVMeDevice(d, port, false), nil); err != nil {
		_ = in.mon.Execute(qctx, "blockdev-del", map[string]any{"node-name": core.NodeName(d.ID)}, nil)
		return api.InstanceInfo{}, errorf(api.ErrFailed, "plugging volume %s into %s: %v", d.ID, id, err)
	}
	r.Volumes = append(r.Volumes, volume{Disk: d, Port: port, State: api.DiskAttached})
	m.save(in)
	m.log.Info("volume attached", "instance", id, "volume", d.ID, "port", port)
	m.observer().VolumeChanged(id, d.ID, api.DiskAttached)
	m.observer().InstanceChanged(m.info(in), false)
	return m.info(in), nil
}

// Detach unplugs a volume. A running guest must let go of the PCIe device
// (DEVICE_DELETED); Detach waits up to grace for that and otherwise
// returns with the volume detaching.
func (m *Manager) Detach(ctx context.Context, id, volumeID string, force bool, grace time.Duration) (api.InstanceInfo, error) {
	in, err := m.get(id)
	if err != nil {
		return api.InstanceInfo{}, err
	}
	in.mu.Lock()
	r := &in.rec
	if r.Spec.RootVolume.ID == volumeID && core.Active(in.state()) {
		in.mu.Unlock()
		return api.InstanceInfo{}, errorf(api.ErrConflict, "volume %s is the root volume of running instance %s; stop it first", volumeID, id)
	}
	idx := -1
	for i, v := range r.Volumes {
		if v.Disk.ID == volumeID {
			idx = i
		}
	}
	if idx < 0 {
		info := m.info(in)
		in.mu.Unlock()
		return info, nil // not attached: nothing to do
	}
	v := r.Volumes[idx]
	if !core.Active(in.state()) || v.Port == "" {
		r.Volumes = append(r.Volumes[:idx], r.Volumes[idx+1:]...)
		m.save(in)
		m.observer().VolumeChanged(id, volumeID, api.DiskDetached)
		m.observer().InstanceChanged(m.info(in), false)
		info := m.info(in)
		in.mu.Unlock()
		return info, nil
	}
	if in.mon == nil {
		in.mu.Unlock()
		return api.InstanceInfo{}, errorf(api.ErrUnavailable, "instance %s: qemu's monitor is not connected", id)
	}
	ch := in.detached[volumeID]
	if ch == nil {
		ch = make(chan struct{})
		in.detached[volumeID] = ch
		qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := in.mon.Execute(qctx, "device_del", map[string]any{"id": core.DeviceID(volumeID)}, nil)
		cancel()
		if err != nil {
			delete(in.detached, volumeID)
			in.mu.Unlock()
			return api.InstanceInfo{}, errorf(api.ErrFailed, "unplugging volume %s from %s: %v", volumeID, id, err)
		}
		r.Volumes[idx].State = api.DiskDetaching
		m.save(in)
		m.observer().VolumeChanged(id, volumeID, api.DiskDetaching)
	}
	in.mu.Unlock()
	if force && grace < 30*time.Second {
		grace = 30 * time.Second
	}
	select {
	case <-ch:
	case <-time.After(grace):
	case <-ctx.Done():
	}
	in.mu.Lock()
	defer in.mu.Unlock()
	return m.info(in), nil
}

// ConsoleOutput returns the last max bytes of the serial console.
func (m *Manager) ConsoleOutput(id string, max int) (string, error) {
	if _, err := m.get(id); err != nil {
		return "", err
	}
	out, err := readTail(m.consoleLog(id), max)
	if err != nil {
		return "", errorf(api.ErrFailed, "reading console of %s: %v", id, err)
	}
	return out, nil
}

// ReportGuestActivity records that a guest reached DHCP or IMDS. key is an
// instance id, a NIC's MAC address or tap name.
func (m *Manager) ReportGuestActivity(key, kind string) error {
	if kind != api.GuestActivityDHCP && kind != api.GuestActivityIMDS {
		return errorf(api.ErrInvalidArgument, "activity kind %q is not %s or %s", kind, api.GuestActivityDHCP, api.GuestActivityIMDS)
	}
	key = strings.ToLower(key)
	m.mu.Lock()
	var found *instance
	for id, in := range m.inst {
		if id == key {
			found = in
			break
		}
		for _, n := range in.rec.Spec.NICs {
			if n.MAC == key || strings.ToLower(n.Tap) == key {
				found = in
			}
		}
		if found != nil && core.Active(found.state()) {
			break
		}
	}
	m.mu.Unlock()
	if found == nil {
		return errorf(api.ErrNotFound, "no instance has id, MAC or tap %q", key)
	}
	found.mu.Lock()
	defer found.mu.Unlock()
	if !core.Active(found.state()) {
		return nil // a late report from a guest that is gone
	}
	first := found.rec.GuestActivity == 0
	found.rec.GuestActivity = time.Now().Unix()
	m.save(found)
	if first {
		m.log.Info("guest reached the network", "instance", found.rec.Spec.ID, "via", kind)
		m.observer().InstanceChanged(m.info(found), false)
	}
	return nil
}

// Describe returns one instance.
func (m *Manager) Describe(id string) (api.InstanceInfo, error) {
	in, err := m.get(id)
	if err != nil {
		return api.InstanceInfo{}, err
	}
	in.mu.Lock()
	defer in.mu.Unlock()
	return m.info(in), nil
}

// List returns every instance.
func (m *Manager) List() []api.InstanceInfo {
	var out []api.InstanceInfo
	for _, id := range m.Instances() {
		if info, err := m.Describe(id); err == nil {
			out = append(out, info)
		}
	}
	return out
}

// info renders an instance. in.mu is held.
func (m *Manager) info(in *instance) api.InstanceInfo {
	r := &in.rec
	st := r.Machine.State
	info := api.InstanceInfo{
		ID: r.Spec.ID, InstanceType: r.Spec.InstanceType, State: st, StateReason: r.Machine.Reason,
		VCPUs: r.Spec.VCPUs, MemoryMiB: r.Spec.MemoryMiB, BootMode: r.Spec.BootMode,
		Accelerator: r.Accel, Runner: m.cfg.Runner.Name(), Unit: m.cfg.Runner.Unit(r.Spec.ID),
		QMPSocket: m.qmpSocket(r.Spec.ID), ConsoleLog: m.consoleLog(r.Spec.ID),
		LaunchTime: r.LaunchTime, GuestActivity: r.GuestActivity, Paused: r.Machine.Paused,
		Taps: []string{}, Volumes: []api.InstanceDiskInfo{},
	}
	if info.Accelerator == "" {
		info.Accelerator = m.cfg.Accel
	}
	if core.Active(st) && in.pid > 0 {
		info.PID = uint32(in.pid)
	}
	for _, n := range r.Spec.NICs {
		info.Taps = append(info.Taps, n.Tap)
	}
	if r.Spec.RootVolume.ID != "" && st != api.InstanceStateTerminated {
		info.Volumes = append(info.Volumes, api.InstanceDiskInfo{ID: r.Spec.RootVolume.ID, DeviceName: r.Spec.RootVolume.DeviceName, Socket: r.Spec.RootVolume.Socket, State: api.DiskAttached, Root: true})
	}
	for _, v := range r.Volumes {
		info.Volumes = append(info.Volumes, api.InstanceDiskInfo{ID: v.Disk.ID, DeviceName: v.Disk.DeviceName, Socket: v.Disk.Socket, State: v.State})
	}
	switch st {
	case api.InstanceStateRunning:
		switch {
		case in.mon == nil || r.Machine.Paused != "":
			info.SystemStatus = api.StatusCheckImpaired
		default:
			info.SystemStatus = api.StatusCheckOK
		}
		switch {
		case r.GuestActivity >= r.LaunchTime && r.GuestActivity > 0:
			info.InstanceStatus = api.StatusCheckOK
		case time.Since(time.Unix(r.LaunchTime, 0)) < 10*time.Minute:
			info.InstanceStatus = api.StatusCheckInitializing
		default:
			info.InstanceStatus = api.StatusCheckImpaired
		}
	case api.InstanceStatePending:
		info.SystemStatus, info.InstanceStatus = api.StatusCheckInitializing, api.StatusCheckInitializing
	default:
		info.SystemStatus, info.InstanceStatus = api.StatusCheckNotApplicable, api.StatusCheckNotApplicable
	}
	return info
}

// Recover reattaches to guests that still run, finishes stops that were
// under way, and starts again the instances a host reboot ended.
func (m *Manager) Recover(ctx context.Context) {
	for _, id := range m.Instances() {
		in, err := m.get(id)
		if err != nil {
			continue
		}
		m.recoverOne(ctx, in)
	}
}

func (m *Manager) recoverOne(ctx context.Context, in *instance) {
	in.mu.Lock()
	defer in.mu.Unlock()
	id := in.rec.Spec.ID
	if !core.Active(in.state()) {
		return
	}
	if in.rec.Runner != "" && in.rec.Runner != m.cfg.Runner.Name() {
		// The other runner's QEMU cannot be seen from here; calling it gone
		// would lose a live guest. Leave the record as it is.
		m.log.Error("instance was launched by another runner; start vmd with that runner to manage it",
			"instance", id, "launched_by", in.rec.Runner, "runner", m.cfg.Runner.Name())
		return
	}
	in.gen++
	gen := in.gen
	rs := m.runSpec(&in.rec, nil)
	pid, err := m.cfg.Runner.Find(ctx, rs)
	if err != nil {
		m.log.Error("looking for qemu", "instance", id, "err", err)
		return
	}
	if pid != 0 {
		in.pid = pid
		if err := m.connect(ctx, in, gen, 20*time.Second); err != nil {
			m.log.Error("reattaching to qemu", "instance", id, "pid", pid, "err", err)
			return
		}
		m.log.Info("reattached", "instance", id, "pid", pid, "state", in.state())
		switch in.state() {
		case api.InstanceStateStopping:
			m.powerdown(in, false, api.DefaultStopTimeoutSec*time.Second)
		case api.InstanceStateShuttingDown:
			m.powerdown(in, false, TerminateGrace)
		}
		return
	}
	if in.rec.BootID != "" && in.rec.BootID != m.cfg.BootID {
		wasUp := in.state() == api.InstanceStateRunning || in.state() == api.InstanceStatePending
		_ = m.transition(in, core.EvHostRebooted)
		if !wasUp {
			return
		}
		m.log.Info("host rebooted; starting the instance again", "instance", id)
		if err := m.accelOK(); err != nil {
			m.log.Error("cannot restart instance", "instance", id, "err", err)
			in.exitDone = 0
			_ = m.transition(in, core.EvExited)
			return
		}
		if err := m.launch(ctx, in); err != nil {
			m.log.Error("restarting instance after host reboot", "instance", id, "err", err)
			_ = m.transition(in, core.EvExited)
		}
		return
	}
	m.log.Warn("qemu exited while vmd was not running", "instance", id, "state", in.state())
	_ = m.transition(in, core.EvExited)
}

// helpers

func readTail(path string, max int) (string, error) {
	f, err := os.Open(path)
	if os.IsNotExist(err) {
		return "", nil
	}
	if err != nil {
		return "", err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return "", err
	}
	off := fi.Size() - int64(max)
	if off < 0 {
		off = 0
	}
	b := make([]byte, fi.Size()-off)
	if _, err := f.ReadAt(b, off); err != nil && err != io.EOF {
		return "", err
	}
	return strings.ToValidUTF8(string(b), "\uFFFD"), nil
}

// trimLog keeps a console log from growing without end across boots: past
// limit, only the last keep bytes stay.
func trimLog(path string, limit, keep int64) error {
	fi, err := os.Stat(path)
	if err != nil || fi.Size() <= limit {
		return nil
	}
	tail, err := readTail(path, int(keep))
	if err != nil {
		return fmt.Errorf("trimming console log: %w", err)
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(tail), 0o640); err != nil {
		return fmt.Errorf("trimming console log: %w", err)
	}
	return os.Rename(tmp, path)
}

func copyIfMissing(src, dst string) error {
	if _, err := os.Stat(dst); err == nil {
		return nil
	}
	b, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	tmp := dst + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, dst)
}
