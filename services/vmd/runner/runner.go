// Package runner starts, finds and ends the QEMU processes of hangar-vmd's
// instances. Two implementations stand behind one interface: Systemd runs
// each guest as a transient unit hangar-vm-<id>.service in
// hangar-vms.slice (go-systemd over D-Bus), with CPUQuota and MemoryMax
// from the instance type; Process runs QEMU as a plain process in its own
// session where no systemd runs (`hangar dev`, tests). Either way the guest
// outlives vmd: nothing here ties QEMU's life to vmd's.
//
// This package decides nothing about instances; it only runs argv.
package runner

import (
	"context"
	"fmt"
	"time"
)

// Slice holds every guest's unit.
const Slice = "hangar-vms.slice"

// UnitName is the unit (or, for the process runner, the label) of an
// instance's QEMU.
func UnitName(id string) string { return "hangar-vm-" + id + ".service" }

// Spec is one QEMU to run.
type Spec struct {
	ID   string
	Argv []string // Argv[0] is the QEMU binary
	// VCPUs and MemoryMaxBytes become CPUQuota= (100% per vCPU) and
	// MemoryMax= of the unit.
	VCPUs          int
	MemoryMaxBytes uint64
	// LogFile receives QEMU's stderr under the process runner; under
	// systemd it goes to the journal (journalctl -u).
	LogFile string
	// PIDFile is QEMU's -pidfile; QMPSocket its monitor. Both identify the
	// process when vmd finds it again after a restart.
	PIDFile   string
	QMPSocket string
}

// Runner runs QEMU for instances.
type Runner interface {
	// Name is "systemd" or "process".
	Name() string
	// Unit is the unit name shown to operators ("" for the process runner).
	Unit(id string) string
	// Start launches QEMU and returns its pid once it was exec'ed. A QEMU
	// already running for the instance is an error: callers Find first.
	Start(ctx context.Context, s Spec) (int, error)
	// Find returns the pid of the instance's live QEMU, or 0 when none.
	Find(ctx context.Context, s Spec) (int, error)
	// Kill ends the instance's QEMU with SIGKILL and returns once it is
	// gone.
	Kill(ctx context.Context, s Spec) error
	// Cleanup removes what a finished QEMU left behind (a failed unit).
	Cleanup(ctx context.Context, s Spec) error
}

// WaitGone returns once Find reports no process, or ctx ends. It is used
// after QMP reported the end (the socket closed), to confirm the exit.
func WaitGone(ctx context.Context, r Runner, s Spec) error {
	for {
		pid, err := r.Find(ctx, s)
		if err == nil && pid == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			if err != nil {
				return fmt.Errorf("waiting for %s's qemu to exit: %w (last: %v)", s.ID, ctx.Err(), err)
			}
			return fmt.Errorf("waiting for %s's qemu (pid %d) to exit: %w", s.ID, pid, ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}
