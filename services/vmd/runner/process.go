package runner

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Process runs QEMU as a plain process in a session of its own, so a
// signal to vmd's process group never reaches a guest and killing vmd
// leaves QEMU running. vmd finds it again by its pidfile, checked against
// /proc so a recycled pid is never mistaken for the guest.
type Process struct {
	mu       sync.Mutex
	children map[int]*exec.Cmd
}

// NewProcess returns a process runner.
func NewProcess() *Process { return &Process{children: map[int]*exec.Cmd{}} }

func (p *Process) Name() string       { return "process" }
func (p *Process) Unit(string) string { return "" }

func (p *Process) Start(ctx context.Context, s Spec) (int, error) {
	if pid, _ := p.Find(ctx, s); pid != 0 {
		return 0, fmt.Errorf("qemu for %s already runs as pid %d", s.ID, pid)
	}
	log, err := os.OpenFile(s.LogFile, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o640)
	if err != nil {
		return 0, fmt.Errorf("opening qemu log of %s: %w", s.ID, err)
	}
	defer log.Close()
	fmt.Fprintf(log, "%s hangar-vmd: starting %s\n", time.Now().UTC().Format(time.RFC3339), strings.Join(s.Argv, " "))
	cmd := exec.Command(s.Argv[0], s.Argv[1:]...)
	cmd.Stdin = nil
	cmd.Stdout = log
	cmd.Stderr = log
	cmd.Dir = "/"
	// Setsid: QEMU is nobody's foreground job and gets no signal meant for
	// vmd. No Pdeathsig: the guest must outlive vmd.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return 0, fmt.Errorf("starting qemu for %s: %w", s.ID, err)
	}
	pid := cmd.Process.Pid
	p.mu.Lock()
	p.children[pid] = cmd
	p.mu.Unlock()
	go func() {
		// Reap our own child; after a restart of vmd QEMU is someone
		// else's child and Find tells a zombie from a live process.
		_ = cmd.Wait()
		p.mu.Lock()
		delete(p.children, pid)
		p.mu.Unlock()
	}()
	return pid, nil
}

// Find reads the pidfile and checks the process is alive, not a zombie, and
// really the QEMU of this instance (its command line names its QMP socket).
func (p *Process) Find(_ context.Context, s Spec) (int, error) {
	raw, err := os.ReadFile(s.PIDFile)
	if os.IsNotExist(err) {
		return p.findChild(s), nil
	}
	if err != nil {
		return 0, fmt.Errorf("reading pidfile of %s: %w", s.ID, err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(raw)))
	if err != nil || pid <= 0 {
		return p.findChild(s), nil
	}
	if alive(pid, s.QMPSocket) {
		return pid, nil
	}
	return 0, nil
}

// findChild covers the moment between exec and QEMU writing its pidfile.
func (p *Process) findChild(s Spec) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	for pid := range p.children {
		if alive(pid, s.QMPSocket) {
			return pid
		}
	}
	return 0
}

// alive reports whether pid runs (and is not a zombie) with marker in its
// command line.
func alive(pid int, marker string) bool {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// the state follows the parenthesised command name
	if i := bytes.LastIndexByte(stat, ')'); i < 0 || i+2 >= len(stat) || stat[i+2] == 'Z' || stat[i+2] == 'X' {
		return false
	}
	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil {
		return false
	}
	return marker == "" || bytes.Contains(cmdline, []byte(marker))
}

func (p *Process) Kill(ctx context.Context, s Spec) error {
	pid, err := p.Find(ctx, s)
	if err != nil {
		return err
	}
	if pid == 0 {
		return nil
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil && err != syscall.ESRCH {
		return fmt.Errorf("killing qemu %d of %s: %w", pid, s.ID, err)
	}
	return WaitGone(ctx, p, s)
}

func (p *Process) Cleanup(_ context.Context, s Spec) error {
	if err := os.Remove(s.PIDFile); err != nil && !os.IsNotExist(err) {
		return fmt.Errorf("removing pidfile of %s: %w", s.ID, err)
	}
	return nil
}
