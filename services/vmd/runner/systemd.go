package runner

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"syscall"

	sd "github.com/coreos/go-systemd/v22/dbus"
	"github.com/godbus/dbus/v5"
)

// Systemd runs each guest as a transient service in hangar-vms.slice:
// `systemctl status hangar-vm-<id>.service` shows QEMU with its cgroup
// limits and `journalctl -u` its log. The unit is its own cgroup, so
// stopping or restarting hangar-vmd.service never touches it.
type Systemd struct {
	conn *sd.Conn
}

// SystemdAvailable reports whether this host runs systemd as its init
// (the check sd_booted(3) makes).
func SystemdAvailable() bool {
	fi, err := os.Lstat("/run/systemd/system")
	return err == nil && fi.IsDir()
}

// NewSystemd connects to systemd: on the system bus when address is "",
// else on the bus at address (tests reach a container's systemd so).
func NewSystemd(ctx context.Context, address string) (*Systemd, error) {
	var (
		conn *sd.Conn
		err  error
	)
	if address == "" {
		conn, err = sd.NewSystemConnectionContext(ctx)
	} else {
		conn, err = sd.NewConnection(func() (*dbus.Conn, error) {
			c, err := dbus.Dial(address, dbus.WithContext(ctx))
			if err != nil {
				return nil, err
			}
			if err := c.Auth(nil); err != nil {
				c.Close()
				return nil, err
			}
			if err := c.Hello(); err != nil {
				c.Close()
				return nil, err
			}
			return c, nil
		})
	}
	if err != nil {
		return nil, fmt.Errorf("connecting to systemd: %w", err)
	}
	return &Systemd{conn: conn}, nil
}

// Close drops the connection; units keep running.
func (r *Systemd) Close() { r.conn.Close() }

func (r *Systemd) Name() string          { return "systemd" }
func (r *Systemd) Unit(id string) string { return UnitName(id) }

// Properties are the transient unit's settings; exported so tests and
// docs show exactly what a guest unit is.
func Properties(s Spec) []sd.Property {
	prop := func(name string, v any) sd.Property { return sd.Property{Name: name, Value: dbus.MakeVariant(v)} }
	return []sd.Property{
		sd.PropDescription("hangar EC2 instance " + s.ID),
		sd.PropExecStart(s.Argv, true),
		sd.PropSlice(Slice),
		// exec: the start job fails when QEMU cannot be exec'ed.
		prop("Type", "exec"),
		// mixed: SIGTERM to QEMU alone, then SIGKILL to anything left.
		prop("KillMode", "mixed"),
		prop("CPUAccounting", true),
		prop("CPUQuotaPerSecUSec", uint64(s.VCPUs)*1_000_000),
		prop("MemoryAccounting", true),
		prop("MemoryMax", s.MemoryMaxBytes),
		prop("TasksAccounting", true),
		// A finished unit goes away even when it failed, so the next start
		// of the instance can reuse the name.
		prop("CollectMode", "inactive-or-failed"),
		prop("TimeoutStopUSec", uint64(30_000_000)),
	}
}

func (r *Systemd) Start(ctx context.Context, s Spec) (int, error) {
	unit := UnitName(s.ID)
	if pid, err := r.Find(ctx, s); err != nil {
		return 0, err
	} else if pid != 0 {
		return 0, fmt.Errorf("unit %s already runs (pid %d)", unit, pid)
	}
	_ = r.conn.ResetFailedUnitContext(ctx, unit) // a leftover failed unit would block the name
	done := make(chan string, 1)
	if _, err := r.conn.StartTransientUnitContext(ctx, unit, "fail", Properties(s), done); err != nil {
		return 0, fmt.Errorf("starting unit %s: %w", unit, err)
	}
	select {
	case res := <-done:
		if res != "done" {
			return 0, fmt.Errorf("starting unit %s: job %s (journalctl -u %s)", unit, res, unit)
		}
	case <-ctx.Done():
		return 0, fmt.Errorf("starting unit %s: %w", unit, ctx.Err())
	}
	pid, err := r.Find(ctx, s)
	if err != nil {
		return 0, err
	}
	if pid == 0 {
		return 0, fmt.Errorf("unit %s exited right after it started (journalctl -u %s)", unit, unit)
	}
	return pid, nil
}

// Find asks systemd for the unit's state and main pid. The pid is in
// systemd's pid namespace.
func (r *Systemd) Find(ctx context.Context, s Spec) (int, error) {
	unit := UnitName(s.ID)
	props, err := r.conn.GetUnitPropertiesContext(ctx, unit)
	if err != nil {
		var de dbus.Error
		if errors.As(err, &de) && strings.HasSuffix(de.Name, "NoSuchUnit") {
			return 0, nil
		}
		return 0, fmt.Errorf("reading unit %s: %w", unit, err)
	}
	switch props["ActiveState"] {
	case "active", "activating", "deactivating", "reloading":
	default:
		return 0, nil
	}
	p, err := r.conn.GetServicePropertyContext(ctx, unit, "MainPID")
	if err != nil {
		return 0, fmt.Errorf("reading MainPID of %s: %w", unit, err)
	}
	pid, _ := p.Value.Value().(uint32)
	if pid == 0 {
		// activating without a main process yet still counts as running
		return -1, nil
	}
	return int(pid), nil
}

func (r *Systemd) Kill(ctx context.Context, s Spec) error {
	unit := UnitName(s.ID)
	if pid, err := r.Find(ctx, s); err != nil || pid == 0 {
		return err
	}
	if err := r.conn.KillUnitWithTarget(ctx, unit, sd.All, int32(syscall.SIGKILL)); err != nil {
		return fmt.Errorf("killing unit %s: %w", unit, err)
	}
	if err := WaitGone(ctx, r, s); err != nil {
		return err
	}
	return r.Cleanup(ctx, s)
}

func (r *Systemd) Cleanup(ctx context.Context, s Spec) error {
	// With CollectMode=inactive-or-failed the unit is normally gone
	// already; reset-failed covers a systemd that kept it. Its error for a
	// unit that is not loaded or not failed means there is nothing to do.
	_ = r.conn.ResetFailedUnitContext(ctx, UnitName(s.ID))
	return nil
}
