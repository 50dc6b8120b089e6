// Command hangar-vmd runs hangar's EC2 instances as QEMU guests and owns
// dev.hangar.Compute1 on the system bus. Each guest runs in its own
// transient systemd unit (hangar-vm-<id>.service in hangar-vms.slice), or,
// where no systemd runs, as a plain process vmd supervises; either way it
// outlives vmd, which reattaches through the QMP sockets when it starts.
package main

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/internal/busutil"
	"hangar.dev/hangar/services/internal/hostconf"
	"hangar.dev/hangar/services/internal/logging"
	"hangar.dev/hangar/services/internal/sdnotify"
	"hangar.dev/hangar/services/internal/store"
	"hangar.dev/hangar/services/vmd/core"
	"hangar.dev/hangar/services/vmd/manager"
	"hangar.dev/hangar/services/vmd/runner"
)

type options struct {
	config, stateDir, runtimeDir string
	runner, systemdBus           string
	qemu, accel                  string
	seabios, ovmfCode, ovmfVars  string
}

func main() {
	var o options
	flag.StringVar(&o.config, "config", hostconf.DefaultRuntimePath, "validated host config written by hangar-firstboot")
	flag.StringVar(&o.stateDir, "state-dir", envOr("STATE_DIRECTORY", "/var/lib/hangar/vmd"), "directory for state.db, console logs and firmware variables")
	flag.StringVar(&o.runtimeDir, "runtime-dir", envOr("RUNTIME_DIRECTORY", "/run/hangar/vm"), "directory for QMP sockets and pidfiles")
	flag.StringVar(&o.runner, "runner", "auto", "how guests run: systemd (transient units), process (vmd supervises QEMU), or auto (systemd when it is the init)")
	flag.StringVar(&o.systemdBus, "systemd-bus", "", "D-Bus address of systemd's bus for the systemd runner (default: the system bus)")
	flag.StringVar(&o.qemu, "qemu", "qemu-system-x86_64", "QEMU binary")
	flag.StringVar(&o.accel, "accelerator", "auto", "kvm, tcg (needs ALLOW_SOFTWARE_EMULATION=yes), or auto (kvm when usable, else tcg when allowed)")
	flag.StringVar(&o.seabios, "seabios", "/usr/share/seabios/bios-256k.bin", "SeaBIOS image for legacy-bios guests")
	flag.StringVar(&o.ovmfCode, "ovmf-code", "/usr/share/OVMF/OVMF_CODE_4M.fd", "OVMF code for uefi guests")
	flag.StringVar(&o.ovmfVars, "ovmf-vars", "/usr/share/OVMF/OVMF_VARS_4M.fd", "OVMF variables template, copied per instance")
	flag.Parse()
	log := logging.New("hangar-vmd")
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, log, o); err != nil {
		log.Error("hangar-vmd failed", "err", err)
		sdnotify.Status("failed: %v", err)
		os.Exit(1)
	}
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

func run(ctx context.Context, log *slog.Logger, o options) error {
	cfg, err := hostconf.Load(o.config)
	if err != nil {
		return err
	}
	qemu, err := lookPath(o.qemu)
	if err != nil {
		return err
	}
	accel, accelProblem, err := chooseAccel(o.accel, cfg.AllowSoftwareEmulation)
	if err != nil {
		return err
	}
	switch accel {
	case core.AccelTCG:
		log.Warn("guests run under software emulation (QEMU TCG): slow, for development only", "why", accelProblem)
	case "":
		log.Error("no accelerator for guests; instances cannot start", "why", accelProblem)
	}
	mem, err := memTotalMiB()
	if err != nil {
		return err
	}
	capacity := core.Capacity{
		HostCPUs: runtime.NumCPU(), HostMemoryMiB: mem,
		ReserveVCPU: cfg.HostReserveVCPU, ReserveMemoryMiB: cfg.HostReserveMemoryMB,
		CPUOvercommit: cfg.CPUOvercommit, PerGuestOverhead: core.OverheadFor(accel).Account,
	}

	run, closeRunner, err := chooseRunner(ctx, o)
	if err != nil {
		return err
	}
	defer closeRunner()

	db, err := store.Open(filepath.Join(o.stateDir, "state.db"))
	if err != nil {
		return err
	}
	defer db.Close()

	conn, err := busutil.Connect(ctx)
	if err != nil {
		return err
	}
	defer conn.Close()
	srv := busutil.NewServer(conn)
	bus := newBusService(srv, log)

	bootID, _ := os.ReadFile("/proc/sys/kernel/random/boot_id")
	mgr, err := manager.New(ctx, manager.Config{
		StateDir: o.stateDir, RuntimeDir: o.runtimeDir, QEMU: qemu,
		Firmware:     core.Firmware{SeaBIOS: o.seabios, OVMFCode: o.ovmfCode, OVMFVars: o.ovmfVars},
		Accel:        accel,
		AccelProblem: accelProblem,
		Capacity:     capacity, Runner: run, DB: db, Log: log, Observer: bus,
		// Taps in a VPC's namespace come opened from hangar-netd.
		Taps:   api.NetworkClient{Conn: conn},
		BootID: strings.TrimSpace(string(bootID)), MemoryOverheadMiB: core.OverheadFor(accel).Headroom,
	})
	if err != nil {
		return err
	}
	bus.mgr = mgr
	bus.accel, bus.accelProblem, bus.runner = accel, accelProblem, run.Name()
	// Export everything, reattach, then claim the name: no caller sees the
	// name before every instance object and its true state exist.
	if err := bus.export(); err != nil {
		return err
	}
	mgr.Recover(ctx)
	if err := srv.ClaimName(busName); err != nil {
		return err
	}
	lim := capacity.Limits()
	status := fmt.Sprintf("%d instances; accelerator %s; runner %s; capacity %d vCPUs, %d MiB", len(mgr.Instances()), orNone(accel), run.Name(), lim.VCPUs, lim.MemoryMiB)
	sdnotify.Ready(status)
	log.Info("ready", "instances", len(mgr.Instances()), "accelerator", orNone(accel), "runner", run.Name(), "vcpus", lim.VCPUs, "memory_mib", lim.MemoryMiB)
	go sdnotify.Watchdog(ctx, func() bool { return db.View(func(*store.Tx) error { return nil }) == nil })
	go func() {
		t := time.NewTicker(30 * time.Second)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				sdnotify.Status("%s", bus.statusLine())
			}
		}
	}()
	<-ctx.Done()
	sdnotify.Stopping()
	mgr.Close()
	// Guests keep running: a restart of vmd reattaches to them.
	log.Info("stopping; guests keep running")
	return nil
}

func orNone(s string) string {
	if s == "" {
		return "none"
	}
	return s
}

func lookPath(p string) (string, error) {
	if strings.Contains(p, "/") {
		if _, err := os.Stat(p); err != nil {
			return "", fmt.Errorf("qemu binary: %w", err)
		}
		return p, nil
	}
	for _, dir := range filepath.SplitList(os.Getenv("PATH") + ":/usr/bin:/usr/local/bin") {
		c := filepath.Join(dir, p)
		if fi, err := os.Stat(c); err == nil && !fi.IsDir() {
			return c, nil
		}
	}
	return "", fmt.Errorf("%s not found (apt-get install qemu-system-x86)", p)
}

// chooseAccel picks the accelerator. KVM counts as usable only when
// /dev/kvm opens and the CPU has hardware virtualisation (vmx/svm) without
// kvm_pvm: a PVM /dev/kvm opens but hangs ordinary guest kernels.
func chooseAccel(flagValue string, allowTCG bool) (accel, problem string, err error) {
	kvmOK, why := kvmUsable()
	switch flagValue {
	case "kvm":
		if !kvmOK {
			return "", "", fmt.Errorf("--accelerator kvm: %s", why)
		}
		return core.AccelKVM, "", nil
	case "tcg":
		if !allowTCG {
			return "", "", fmt.Errorf("--accelerator tcg needs ALLOW_SOFTWARE_EMULATION=yes in host.conf")
		}
		return core.AccelTCG, "software emulation chosen with --accelerator tcg", nil
	case "auto", "":
		if kvmOK {
			return core.AccelKVM, "", nil
		}
		if allowTCG {
			return core.AccelTCG, why + "; ALLOW_SOFTWARE_EMULATION=yes", nil
		}
		return "", why + ", and ALLOW_SOFTWARE_EMULATION is not yes", nil
	}
	return "", "", fmt.Errorf("--accelerator %q is not kvm, tcg or auto", flagValue)
}

func kvmUsable() (bool, string) {
	f, err := os.OpenFile("/dev/kvm", os.O_RDWR, 0)
	if err != nil {
		return false, fmt.Sprintf("KVM is not available (%v)", err)
	}
	f.Close()
	if _, err := os.Stat("/sys/module/kvm_pvm"); err == nil {
		return false, "/dev/kvm is a PVM device (kvm_pvm), which does not run ordinary guest kernels"
	}
	cpuinfo, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return false, fmt.Sprintf("reading /proc/cpuinfo: %v", err)
	}
	for _, line := range strings.Split(string(cpuinfo), "\n") {
		if strings.HasPrefix(line, "flags") {
			for _, f := range strings.Fields(line) {
				if f == "vmx" || f == "svm" {
					return true, ""
				}
			}
			break
		}
	}
	return false, "the CPU has no hardware virtualisation (vmx/svm) flag"
}

func memTotalMiB() (int, error) {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0, fmt.Errorf("reading host memory: %w", err)
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		fields := strings.Fields(s.Text())
		if len(fields) >= 2 && fields[0] == "MemTotal:" {
			kb, err := strconv.Atoi(fields[1])
			if err != nil {
				return 0, fmt.Errorf("parsing MemTotal: %w", err)
			}
			return kb / 1024, nil
		}
	}
	return 0, fmt.Errorf("no MemTotal in /proc/meminfo")
}

func chooseRunner(ctx context.Context, o options) (runner.Runner, func(), error) {
	useSystemd := false
	switch o.runner {
	case "systemd":
		useSystemd = true
	case "process":
	case "auto", "":
		useSystemd = runner.SystemdAvailable() && os.Getenv("HANGAR_DEV") == ""
	default:
		return nil, nil, fmt.Errorf("--runner %q is not systemd, process or auto", o.runner)
	}
	if !useSystemd {
		return runner.NewProcess(), func() {}, nil
	}
	r, err := runner.NewSystemd(ctx, o.systemdBus)
	if err != nil {
		return nil, nil, err
	}
	return r, r.Close, nil
}
