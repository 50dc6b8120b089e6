// Package vm boots hangar's disk image in QEMU the way `make run` and the
// QEMU boot test need it: UEFI firmware, the disk behind a qcow2 overlay
// (the built disk is never written), a NoCloud seed carrying host.conf, the
// API port forwarded to the host, the serial console on a socket (logged to
// a file), and QMP for a clean power-off.
//
// It is outside services/ on purpose: it drives the image from the outside,
// as a user's machine does, and shares nothing with the services.
package vm

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Image is a built disk image, as image/build.sh describes it in image.env.
type Image struct {
	Dir         string
	Disk        string // raw GPT disk: ESP (systemd-boot) + ext4 root
	Rootfs      string // the tree the disk was made from (systemd-nspawn boots it)
	Kernel      string // the image's kernel, for the KVM probe
	Initrd      string
	Cmdline     string
	RootfsBytes int64
	DiskBytes   int64 // apparent size
	DiskUsed    int64 // blocks actually used (the disk is sparse)
}

// LoadImage reads DIR/image.env.
func LoadImage(dir string) (*Image, error) {
	f, err := os.Open(filepath.Join(dir, "image.env"))
	if err != nil {
		return nil, fmt.Errorf("no built image in %s (make image builds it): %w", dir, err)
	}
	defer f.Close()
	img := &Image{Dir: dir}
	s := bufio.NewScanner(f)
	for s.Scan() {
		k, v, ok := strings.Cut(s.Text(), "=")
		if !ok {
			continue
		}
		var n int64
		fmt.Sscan(v, &n)
		switch k {
		case "disk":
			img.Disk = v
		case "rootfs":
			img.Rootfs = v
		case "kernel":
			img.Kernel = v
		case "initrd":
			img.Initrd = v
		case "cmdline":
			img.Cmdline = v
		case "rootfs_bytes":
			img.RootfsBytes = n
		case "disk_bytes":
			img.DiskBytes = n
		case "disk_bytes_used":
			img.DiskUsed = n
		}
	}
	if img.Disk == "" || img.Rootfs == "" {
		return nil, fmt.Errorf("%s/image.env names no disk or rootfs", dir)
	}
	for _, p := range []string{img.Disk, img.Rootfs} {
		if _, err := os.Stat(p); err != nil {
			return nil, fmt.Errorf("the image in %s is incomplete: %w", dir, err)
		}
	}
	return img, nil
}

// Forward maps a host address to a guest TCP port (QEMU user networking).
type Forward struct {
	Host      string // 127.0.0.1:4566
	GuestPort int
}

// Config is one boot.
type Config struct {
	Disk     string // raw disk, used read-only through an overlay
	Dir      string // working directory: overlay, firmware vars, sockets, serial.log
	Accel    string // "kvm" or "tcg"
	MemoryMB int
	CPUs     int
	Forwards []Forward
	Seed     string // NoCloud seed image (MakeSeed); empty for none
	// OVMF firmware; empty finds Debian's (package ovmf).
	OVMFCode, OVMFVars string
	// Console, when set, receives the serial output as it comes (make run
	// shows it on the terminal). serial.log in Dir always has all of it.
	Console io.Writer
}

// VM is a running guest.
type VM struct {
	cfg       Config
	cmd       *exec.Cmd
	serial    net.Conn
	serialLog string
	qmpPath   string
	stderr    *lockedBuf
	done      chan struct{}
	waitErr   error
	Started   time.Time
}

type lockedBuf struct {
	mu sync.Mutex
	b  strings.Builder
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

// firmware finds OVMF's code and a vars template.
func firmware(code, vars string) (string, string, error) {
	if code != "" && vars != "" {
		return code, vars, nil
	}
	for _, pair := range [][2]string{
		{"/usr/share/OVMF/OVMF_CODE_4M.fd", "/usr/share/OVMF/OVMF_VARS_4M.fd"},
		{"/usr/share/OVMF/OVMF_CODE.fd", "/usr/share/OVMF/OVMF_VARS.fd"},
		{"/usr/share/edk2/ovmf/OVMF_CODE.fd", "/usr/share/edk2/ovmf/OVMF_VARS.fd"},
	} {
		if _, err := os.Stat(pair[0]); err == nil {
			if _, err := os.Stat(pair[1]); err == nil {
				return pair[0], pair[1], nil
			}
		}
	}
	return "", "", errors.New("no OVMF UEFI firmware found (apt-get install ovmf)")
}

// Boot starts QEMU and connects to its serial console. The guest boots in
// the background; wait for it with WaitSerial or by polling the API.
func Boot(ctx context.Context, cfg Config) (*VM, error) {
	if cfg.MemoryMB == 0 {
		cfg.MemoryMB = 2048
	}
	if cfg.CPUs == 0 {
		cfg.CPUs = 2
	}
	if cfg.Accel == "" {
		cfg.Accel = "tcg"
	}
	qemu, err := exec.LookPath("qemu-system-x86_64")
	if err != nil {
		return nil, errors.New("qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)")
	}
	code, varsTemplate, err := firmware(cfg.OVMFCode, cfg.OVMFVars)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(cfg.Dir, 0o755); err != nil {
		return nil, err
	}
	for _, f := range cfg.Forwards {
		l, err := net.Listen("tcp", f.Host)
		if err != nil {
			return nil, fmt.Errorf("cannot forward %s to the guest: %w (is another hangar running?)", f.Host, err)
		}
		l.Close()
	}

	overlay := filepath.Join(cfg.Dir, "overlay.qcow2")
	_ = os.Remove(overlay)
	absDisk, err := filepath.Abs(cfg.Disk)
	if err != nil {
		return nil, err
	}
	if out, err := exec.CommandContext(ctx, "qemu-img", "create", "-q", "-f", "qcow2", "-b", absDisk, "-F", "raw", overlay).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("creating the disk overlay: %v: %s", err, out)
	}
	vars := filepath.Join(cfg.Dir, "efivars.fd")
	if err := copyFile(varsTemplate, vars); err != nil {
		return nil, fmt.Errorf("copying the UEFI variables: %w", err)
	}
	serialSock := filepath.Join(cfg.Dir, "serial.sock")
	serialLog := filepath.Join(cfg.Dir, "serial.log")
	qmpSock := filepath.Join(cfg.Dir, "qmp.sock")
	for _, p := range []string{serialSock, serialLog, qmpSock} {
		_ = os.Remove(p)
	}

	var hostfwd strings.Builder
	for _, f := range cfg.Forwards {
		fmt.Fprintf(&hostfwd, ",hostfwd=tcp:%s-:%d", f.Host, f.GuestPort)
	}
	args := []string{
		"-name", "hangar",
		"-machine", "q35", "-accel", cfg.Accel,
		"-m", fmt.Sprint(cfg.MemoryMB), "-smp", fmt.Sprint(cfg.CPUs),
		"-nodefaults", "-display", "none", "-no-reboot",
		"-drive", "if=pflash,format=raw,unit=0,readonly=on,file=" + code,
		"-drive", "if=pflash,format=raw,unit=1,file=" + vars,
		"-drive", "file=" + overlay + ",format=qcow2,if=virtio",
		"-netdev", "user,id=n0" + hostfwd.String(),
		"-device", "virtio-net-pci,netdev=n0",
		"-device", "virtio-rng-pci",
		"-chardev", "socket,id=ser0,path=" + serialSock + ",server=on,wait=on,logfile=" + serialLog,
		"-serial", "chardev:ser0",
		"-qmp", "unix:" + qmpSock + ",server=on,wait=off",
	}
	switch cfg.Accel {
	case "kvm":
		args = append(args, "-cpu", "host")
	case "tcg":
		// QEMU's default CPU model advertises AMD-V (svm), which TCG
		// emulates: the host's vmd would then run its guests under nested
		// KVM, and QEMU 7.2's TCG aborts on that ("tcg_handle_interrupt:
		// assertion failed") as soon as an SMP guest runs, taking the whole
		// host down. Without svm the host's first boot and vmd see no KVM
		// and, with ALLOW_SOFTWARE_EMULATION=yes, run guests under TCG.
		args = append(args, "-cpu", "qemu64,-svm")
	}
	if cfg.Seed != "" {
		args = append(args, "-drive", "file="+cfg.Seed+",format=raw,if=virtio,readonly=on")
	}
	v := &VM{cfg: cfg, serialLog: serialLog, qmpPath: qmpSock, stderr: &lockedBuf{}, done: make(chan struct{})}
	v.cmd = exec.Command(qemu, args...)
	v.cmd.Stdout = v.stderr
	v.cmd.Stderr = v.stderr
	// Its own process group: a Ctrl-C on the terminal reaches make run,
	// which powers the guest down, not QEMU, which would just die.
	v.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
	v.Started = time.Now()
	if err := v.cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting QEMU: %w", err)
	}
	go func() {
		v.waitErr = v.cmd.Wait()
		close(v.done)
	}()

	// wait=on: QEMU starts the guest once the console is connected, so
	// nothing it prints is lost.
	deadline := time.Now().Add(30 * time.Second)
	for {
		c, err := net.Dial("unix", serialSock)
		if err == nil {
			v.serial = c
			break
		}
		select {
		case <-v.done:
			return nil, fmt.Errorf("QEMU exited before its console opened: %v\n%s", v.waitErr, v.stderr)
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			v.Kill()
			return nil, fmt.Errorf("QEMU's serial console did not open within 30s\n%s", v.stderr)
		}
	}
	go func() {
		out := io.Discard
		if cfg.Console != nil {
			out = cfg.Console
		}
		_, _ = io.Copy(out, v.serial)
	}()
	return v, nil
}

func copyFile(from, to string) error {
	raw, err := os.ReadFile(from)
	if err != nil {
		return err
	}
	return os.WriteFile(to, raw, 0o644)
}

// Serial returns everything the guest printed on its console so far.
func (v *VM) Serial() string {
	raw, _ := os.ReadFile(v.serialLog)
	return string(raw)
}

// SerialLogPath is the file holding the console output.
func (v *VM) SerialLogPath() string { return v.serialLog }

// QEMUOutput is what QEMU itself printed (warnings, errors).
func (v *VM) QEMUOutput() string { return v.stderr.String() }

// Type sends keystrokes to the serial console.
func (v *VM) Type(s string) error {
	_, err := io.WriteString(v.serial, s)
	return err
}

// Done is closed when QEMU has exited.
func (v *VM) Done() <-chan struct{} { return v.done }

// WaitSerial waits until marker appears on the console, QEMU exits or ctx
// ends, and says which.
func (v *VM) WaitSerial(ctx context.Context, marker string) error {
	t := time.NewTicker(200 * time.Millisecond)
	defer t.Stop()
	for {
		if strings.Contains(v.Serial(), marker) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for %q on the serial console: %w", marker, ctx.Err())
		case <-v.done:
			if strings.Contains(v.Serial(), marker) {
				return nil
			}
			return fmt.Errorf("QEMU exited (%v) before %q appeared on the console\n%s", v.waitErr, marker, v.stderr)
		case <-t.C:
		}
	}
}

// Powerdown presses the power button through QMP (ACPI: the guest's
// systemd shuts down cleanly) and waits for QEMU to exit. If the guest has
// not gone within timeout, QEMU is told to quit, then killed.
func (v *VM) Powerdown(ctx context.Context, timeout time.Duration) (clean bool, err error) {
	select {
	case <-v.done:
		return false, fmt.Errorf("QEMU had already exited: %v", v.waitErr)
	default:
	}
	q, err := DialQMP(ctx, v.qmpPath)
	if err != nil {
		v.Kill()
		return false, err
	}
	defer q.Close()
	if _, err := q.Execute(ctx, "system_powerdown", nil); err != nil {
		v.Kill()
		return false, err
	}
	select {
	case <-v.done:
		return true, nil
	case <-time.After(timeout):
	case <-ctx.Done():
	}
	_, _ = q.Execute(context.Background(), "quit", nil)
	select {
	case <-v.done:
	case <-time.After(5 * time.Second):
		v.Kill()
	}
	return false, fmt.Errorf("the guest did not power off within %s; QEMU was stopped", timeout)
}

// Kill stops QEMU at once and waits for it.
func (v *VM) Kill() {
	if v.cmd.Process != nil {
		_ = v.cmd.Process.Kill()
	}
	<-v.done
	if v.serial != nil {
		v.serial.Close()
	}
}

// Exec logs in as root on the serial console (the dev image has no root
// password) and runs a shell command, returning its output. It is slow
// (seconds under TCG) and meant for diagnostics: the boot test uses it to
// print the journal when something failed.
func (v *VM) Exec(ctx context.Context, command string) (string, error) {
	const begin, end = "__HANGAR_BEGIN__", "__HANGAR_END__"
	before := len(v.Serial())
	// Wake the getty, log in (no password prompt for an empty password);
	// if a shell is already there, "root" is just a failed command.
	_ = v.Type("\r")
	time.Sleep(500 * time.Millisecond)
	_ = v.Type("root\r")
	if err := v.waitAfter(ctx, before, "# "); err != nil {
		return "", fmt.Errorf("logging in on the console: %w", err)
	}
	// The markers are split in the typed line so only the output matches.
	mark := func(m string) string { return m[:4] + "''" + m[4:] }
	start := len(v.Serial())
	if err := v.Type(fmt.Sprintf("stty cols 250; echo %s; %s; echo %s\r", mark(begin), command, mark(end))); err != nil {
		return "", err
	}
	if err := v.waitAfter(ctx, start, end); err != nil {
		return v.Serial()[start:], err
	}
	out := v.Serial()[start:]
	if i := strings.Index(out, begin); i >= 0 {
		out = out[i+len(begin):]
	}
	if i := strings.Index(out, end); i >= 0 {
		out = out[:i]
	}
	return strings.TrimSpace(out), nil
}

func (v *VM) waitAfter(ctx context.Context, offset int, marker string) error {
	t := time.NewTicker(200 * time.Millisecond)
	defer t.Stop()
	for {
		s := v.Serial()
		if len(s) > offset && strings.Contains(s[offset:], marker) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for %q: %w", marker, ctx.Err())
		case <-v.done:
			return errors.New("QEMU exited")
		case <-t.C:
		}
	}
}
