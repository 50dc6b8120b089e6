package vm

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// ProbeKVM tells whether guests actually run under KVM here. /dev/kvm
// opening is not enough: on some hosts (a PVM kernel, nested setups) the
// device answers but guest kernels hang. So it boots the image's kernel
// with no root file system under -accel kvm and waits for the panic it
// must reach within seconds; silence means KVM is not usable.
//
// The answer is kept in cacheFile for the host's boot (keyed by its boot
// id), so only the first make run after a reboot pays for the probe.
func ProbeKVM(ctx context.Context, kernel, cacheFile string) (ok bool, why string) {
	bootID, _ := os.ReadFile("/proc/sys/kernel/random/boot_id")
	key := strings.TrimSpace(string(bootID)) + " " + kernel
	if cacheFile != "" {
		if raw, err := os.ReadFile(cacheFile); err == nil {
			if k, rest, found := strings.Cut(string(raw), "\n"); found && k == key {
				res, why, _ := strings.Cut(strings.TrimSpace(rest), " ")
				return res == "ok", why
			}
		}
	}
	ok, why = probeKVM(ctx, kernel)
	if cacheFile != "" {
		res := "no"
		if ok {
			res = "ok"
		}
		_ = os.WriteFile(cacheFile, []byte(key+"\n"+res+" "+why+"\n"), 0o644)
	}
	return ok, why
}

func probeKVM(ctx context.Context, kernel string) (bool, string) {
	f, err := os.OpenFile("/dev/kvm", os.O_RDWR, 0)
	if err != nil {
		return false, fmt.Sprintf("/dev/kvm cannot be opened (%v)", err)
	}
	f.Close()
	qemu, err := exec.LookPath("qemu-system-x86_64")
	if err != nil {
		return false, "qemu-system-x86_64 is not installed"
	}
	dir, err := os.MkdirTemp("", "hangar-kvm-probe-")
	if err != nil {
		return false, err.Error()
	}
	defer os.RemoveAll(dir)
	serial := filepath.Join(dir, "serial.log")
	cmd := exec.Command(qemu, "-accel", "kvm", "-cpu", "host", "-machine", "q35", "-m", "256",
		"-nodefaults", "-display", "none", "-no-reboot",
		"-kernel", kernel, "-append", "console=ttyS0 panic=-1",
		"-serial", "file:"+serial)
	var stderr lockedBuf
	cmd.Stderr = &stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return false, fmt.Sprintf("starting QEMU: %v", err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	defer func() {
		_ = cmd.Process.Kill()
		<-done
	}()
	// A kernel under working KVM reaches "Kernel panic" (no root) in about
	// a second; under TCG it takes two. Ten seconds is generous.
	deadline := time.After(10 * time.Second)
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		raw, _ := os.ReadFile(serial)
		if strings.Contains(string(raw), "Kernel panic") || strings.Contains(string(raw), "VFS: Unable to mount root") {
			return true, "a test kernel booted under KVM"
		}
		select {
		case <-ctx.Done():
			return false, ctx.Err().Error()
		case <-done:
			raw, _ := os.ReadFile(serial)
			if strings.Contains(string(raw), "Kernel panic") {
				return true, "a test kernel booted under KVM"
			}
			why := strings.TrimSpace(stderr.String())
			if i := strings.IndexByte(why, '\n'); i > 0 {
				why = why[:i]
			}
			return false, "QEMU stopped at once under KVM (" + why + ")"
		case <-deadline:
			return false, "/dev/kvm opens but a test kernel made no progress under KVM in 10s (guests hang here)"
		case <-t.C:
		}
	}
}
