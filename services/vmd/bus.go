package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/godbus/dbus/v5"
	"github.com/godbus/dbus/v5/introspect"
	"github.com/godbus/dbus/v5/prop"

	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/internal/busutil"
	"hangar.dev/hangar/services/internal/version"
	"hangar.dev/hangar/services/vmd/manager"
)

var busName = api.Compute.Name

// busService is vmd on the bus: the root object's methods, one object per
// instance with its properties, and the signals.
type busService struct {
	srv          *busutil.Server
	log          *slog.Logger
	mgr          *manager.Manager
	started      time.Time
	accel        string
	accelProblem string
	runner       string

	mu       sync.Mutex
	exported map[string]bool
}

func newBusService(srv *busutil.Server, log *slog.Logger) *busService {
	return &busService{srv: srv, log: log, started: time.Now(), exported: map[string]bool{}}
}

// callTimeout bounds one method call; stops and terminations return at
// once and finish in the background.
const callTimeout = 90 * time.Second

func dbusErr(err error) *dbus.Error {
	if err == nil {
		return nil
	}
	var me *manager.Error
	if errors.As(err, &me) {
		return api.Errorf(me.Name, "%s", me.Msg)
	}
	return api.Errorf(api.ErrFailed, "%v", err)
}

func (b *busService) methods() map[string]any {
	ctx := func() (context.Context, context.CancelFunc) {
		return context.WithTimeout(context.Background(), callTimeout)
	}
	info := func(i api.InstanceInfo, err error) (api.InstanceInfo, *dbus.Error) { return i, dbusErr(err) }
	return map[string]any{
		api.MethodStatus: func() (api.ServiceStatus, *dbus.Error) { return b.status(), nil },
		api.MethodCreateInstance: func(spec api.InstanceSpec) (api.InstanceInfo, *dbus.Error) {
			c, cancel := ctx()
			defer cancel()
			return info(b.mgr.Create(c, spec))
		},
		api.MethodStartInstance: func(id string) (api.InstanceInfo, *dbus.Error) {
			c, cancel := ctx()
			defer cancel()
			return info(b.mgr.Start(c, id))
		},
		api.MethodStopInstance: func(id string, force bool, timeoutSec uint32) (api.InstanceInfo, *dbus.Error) {
			c, cancel := ctx()
			defer cancel()
			return info(b.mgr.Stop(c, id, force, time.Duration(timeoutSec)*time.Second))
		},
		api.MethodRebootInstance: func(id string) (api.InstanceInfo, *dbus.Error) {
			c, cancel := ctx()
			defer cancel()
			return info(b.mgr.Reboot(c, id, api.RebootGraceSec*time.Second))
		},
		api.MethodTerminateInstance: func(id string) (api.InstanceInfo, *dbus.Error) {
			c, cancel := ctx()
			defer cancel()
			return info(b.mgr.Terminate(c, id))
		},
		api.MethodDeleteInstance: func(id string) *dbus.Error {
			c, cancel := ctx()
			defer cancel()
			return dbusErr(b.mgr.Delete(c, id))
		},
		api.MethodInstanceAttachVolume: func(id string, d api.InstanceDisk) (api.InstanceInfo, *dbus.Error) {
			c, cancel := ctx()
			defer cancel()
			return info(b.mgr.Attach(c, id, d))
		},
		api.MethodInstanceDetachVolume: func(id, volumeID string, force bool) (api.InstanceInfo, *dbus.Error) {
			c, cancel := ctx()
			defer cancel()
			return info(b.mgr.Detach(c, id, volumeID, force, api.DetachGraceSec*time.Second))
		},
		api.MethodGetConsoleOutput: func(id string, latest bool) (string, int64, *dbus.Error) {
			// Both forms return the most recent 64 KiB: the log is read at
			// call time, so "latest" is what EC2's default also gives after
			// a transition.
			out, err := b.mgr.ConsoleOutput(id, api.ConsoleOutputMax)
			return out, time.Now().Unix(), dbusErr(err)
		},
		api.MethodDescribeInstance: func(id string) (api.InstanceInfo, *dbus.Error) {
			return info(b.mgr.Describe(id))
		},
		api.MethodListInstances: func() ([]api.InstanceInfo, *dbus.Error) {
			l := b.mgr.List()
			if l == nil {
				l = []api.InstanceInfo{}
			}
			return l, nil
		},
		api.MethodReportGuestActivity: func(key, kind string) *dbus.Error {
			return dbusErr(b.mgr.ReportGuestActivity(key, kind))
		},
	}
}

// Root properties beyond the common ones.
const (
	propAccelerator  = "Accelerator"
	propRunner       = "Runner"
	propCapacityVCPU = "CapacityVCPUs"
	propCapacityMem  = "CapacityMemoryMiB"
	propUsedVCPU     = "UsedVCPUs"
	propUsedMem      = "UsedMemoryMiB"
)

func (b *busService) export() error {
	used, lim := b.mgr.Usage()
	ro := func(v any) *prop.Prop { return &prop.Prop{Value: v, Emit: prop.EmitTrue} }
	root := &busutil.Object{
		Path:      api.Compute.Path,
		Interface: api.Compute.Interface,
		Methods:   b.methods(),
		Props: map[string]*prop.Prop{
			api.PropVersion:  ro(version.String()),
			api.PropStarted:  ro(b.started.Unix()),
			api.PropState:    ro(b.serviceState()),
			propAccelerator:  ro(orNone(b.accel)),
			propRunner:       ro(b.runner),
			propCapacityVCPU: ro(uint32(lim.VCPUs)),
			propCapacityMem:  ro(uint32(lim.MemoryMiB)),
			propUsedVCPU:     ro(uint32(used.VCPUs)),
			propUsedMem:      ro(uint32(used.MemoryMiB)),
		},
		Signals: []introspect.Signal{
			{Name: api.SignalInstanceStateChanged, Args: []introspect.Arg{{Name: "id", Type: "s"}, {Name: "state", Type: "s"}, {Name: "reason", Type: "s"}}},
			{Name: api.SignalInstanceVolumeChanged, Args: []introspect.Arg{{Name: "id", Type: "s"}, {Name: "volume", Type: "s"}, {Name: "state", Type: "s"}}},
		},
	}
	if err := b.srv.Export(root); err != nil {
		return err
	}
	for _, info := range b.mgr.List() {
		if err := b.exportInstance(info); err != nil {
			return err
		}
	}
	return nil
}

func (b *busService) serviceState() string {
	if b.accel == "" {
		return "degraded"
	}
	return "running"
}

func volumeStrings(info api.InstanceInfo) []string {
	out := []string{}
	for _, v := range info.Volumes {
		s := v.ID + " " + v.State
		if v.Root {
			s += " root"
		}
		out = append(out, s)
	}
	return out
}

func instanceProps(info api.InstanceInfo) map[string]any {
	return map[string]any{
		api.PropInstanceID:           info.ID,
		api.PropInstanceType:         info.InstanceType,
		api.PropInstanceState:        info.State,
		api.PropStateReason:          info.StateReason,
		api.PropInstanceVCPUs:        info.VCPUs,
		api.PropInstanceMemoryMiB:    info.MemoryMiB,
		api.PropInstanceTaps:         info.Taps,
		api.PropInstanceVolumes:      volumeStrings(info),
		api.PropInstanceQMPSocket:    info.QMPSocket,
		api.PropInstanceUnit:         info.Unit,
		api.PropInstanceAccelerator:  info.Accelerator,
		api.PropInstancePID:          info.PID,
		api.PropInstanceSystemStatus: info.SystemStatus,
		api.PropInstanceStatus:       info.InstanceStatus,
	}
}

func (b *busService) exportInstance(info api.InstanceInfo) error {
	props := map[string]*prop.Prop{}
	for k, v := range instanceProps(info) {
		props[k] = &prop.Prop{Value: v, Emit: prop.EmitTrue}
	}
	err := b.srv.Export(&busutil.Object{
		Path:      api.InstancePath(info.ID),
		Interface: api.ComputeInstanceInterface,
		Methods:   map[string]any{},
		Props:     props,
	})
	if err != nil {
		return err
	}
	b.mu.Lock()
	b.exported[info.ID] = true
	b.mu.Unlock()
	return nil
}

// InstanceChanged implements manager.Observer.
func (b *busService) InstanceChanged(info api.InstanceInfo, stateChanged bool) {
	b.mu.Lock()
	known := b.exported[info.ID]
	b.mu.Unlock()
	if !known {
		if err := b.exportInstance(info); err != nil {
			b.log.Error("exporting instance object", "instance", info.ID, "err", err)
		}
	} else {
		for k, v := range instanceProps(info) {
			if err := b.srv.Set(api.InstancePath(info.ID), k, v); err != nil {
				b.log.Error("updating instance property", "instance", info.ID, "property", k, "err", err)
			}
		}
	}
	if stateChanged {
		if err := b.srv.Emit(api.Compute.Path, api.Compute.Interface, api.SignalInstanceStateChanged, info.ID, info.State, info.StateReason); err != nil {
			b.log.Error("emitting state change", "instance", info.ID, "err", err)
		}
		b.updateUsage()
	}
}

// InstanceRemoved implements manager.Observer.
func (b *busService) InstanceRemoved(id string) {
	b.srv.Unexport(api.InstancePath(id))
	b.mu.Lock()
	delete(b.exported, id)
	b.mu.Unlock()
	b.updateUsage()
}

// VolumeChanged implements manager.Observer.
func (b *busService) VolumeChanged(id, volumeID, state string) {
	if err := b.srv.Emit(api.Compute.Path, api.Compute.Interface, api.SignalInstanceVolumeChanged, id, volumeID, state); err != nil {
		b.log.Error("emitting volume change", "instance", id, "volume", volumeID, "err", err)
	}
}

func (b *busService) updateUsage() {
	if b.mgr == nil || !b.srv.Exported(api.Compute.Path) {
		return
	}
	used, _ := b.mgr.Usage()
	_ = b.srv.Set(api.Compute.Path, propUsedVCPU, uint32(used.VCPUs))
	_ = b.srv.Set(api.Compute.Path, propUsedMem, uint32(used.MemoryMiB))
}

func (b *busService) statusLine() string {
	counts := map[string]int{}
	for _, i := range b.mgr.List() {
		counts[i.State]++
	}
	used, lim := b.mgr.Usage()
	return fmt.Sprintf("%d running, %d stopped; %d/%d vCPUs, %d/%d MiB; accelerator %s",
		counts[api.InstanceStateRunning], counts[api.InstanceStateStopped], used.VCPUs, lim.VCPUs, used.MemoryMiB, lim.MemoryMiB, orNone(b.accel))
}

func (b *busService) status() api.ServiceStatus {
	counts := map[string]uint32{}
	for _, i := range b.mgr.List() {
		counts[i.State]++
	}
	st := api.ServiceStatus{State: b.serviceState(), Detail: b.statusLine(), Version: version.String(), Started: b.started.Unix(), Counts: counts, Problems: []string{}}
	if b.accel == "" {
		st.Problems = append(st.Problems, "KVMUnavailable: "+b.accelProblem)
	} else if b.accel == "tcg" {
		st.Problems = append(st.Problems, "SoftwareEmulationOnly: guests run under QEMU TCG ("+b.accelProblem+")")
	}
	return st
}
