// Package core is hangar-vmd's pure logic: the EC2 instance state machine
// driven by QMP events and process exits, the host's capacity accounting,
// the SMBIOS identity that makes cloud-init see EC2, and the QEMU command
// line. It must never touch the machine: no processes, sockets, files or
// clocks; the adapters around it do, and feed it what they saw.
package core

import (
	"fmt"

	"hangar.dev/hangar/services/internal/api"
)

// Event is something that happened to an instance: a request through the
// API, a QMP event, or the QEMU process going away.
type Event int

const (
	// EvLaunch: QEMU was started for the instance (create, start, or the
	// restart after a host reboot).
	EvLaunch Event = iota
	// EvRunning: QMP answered and query-status says the guest runs.
	EvRunning
	// EvStopRequest and EvTerminateRequest come from the API.
	EvStopRequest
	EvTerminateRequest
	// EvGuestShutdown is QMP SHUTDOWN with guest=true: the guest powered
	// itself off.
	EvGuestShutdown
	// EvHostShutdown is QMP SHUTDOWN with guest=false that vmd did not ask
	// for (someone sent QEMU SIGTERM or `quit`, or stopped its unit).
	EvHostShutdown
	// EvReset is QMP RESET: the guest rebooted.
	EvReset
	// EvPowerdown is QMP POWERDOWN: the ACPI power button was pressed.
	EvPowerdown
	// EvPaused and EvResumed are QMP STOP and RESUME.
	EvPaused
	EvResumed
	// EvExited: the QEMU process is gone (the QMP connection closed and the
	// runner confirms no process), or it never came up.
	EvExited
	// EvHostRebooted: vmd found the instance's QEMU gone after a host
	// reboot.
	EvHostRebooted
)

var eventNames = map[Event]string{
	EvLaunch: "launch", EvRunning: "running", EvStopRequest: "stop-request",
	EvTerminateRequest: "terminate-request", EvGuestShutdown: "guest-shutdown",
	EvHostShutdown: "host-shutdown", EvReset: "reset", EvPowerdown: "powerdown",
	EvPaused: "paused", EvResumed: "resumed", EvExited: "exited", EvHostRebooted: "host-rebooted",
}

func (e Event) String() string {
	if n, ok := eventNames[e]; ok {
		return n
	}
	return fmt.Sprintf("event(%d)", int(e))
}

// Intent is what vmd means to happen when QEMU exits.
type Intent string

const (
	IntentNone      Intent = ""
	IntentStop      Intent = "stop"
	IntentTerminate Intent = "terminate"
)

// EC2 state reasons (StateReason.Code: Message), as EC2 reports them.
const (
	ReasonUserShutdown     = "Client.UserInitiatedShutdown: User initiated shutdown"
	ReasonInstanceShutdown = "Client.InstanceInitiatedShutdown: Instance initiated shutdown"
	ReasonInternalError    = "Server.InternalError: Internal error on launch"
	ReasonUnexpectedExit   = "Server.InternalError: the instance's QEMU process exited unexpectedly"
	ReasonOutsideShutdown  = "Client.UserInitiatedShutdown: QEMU was told to quit outside the API"
	ReasonHostReboot       = "Server.ScheduledStop: the host rebooted; the instance is starting again"
)

// Machine is an instance's lifecycle state.
type Machine struct {
	State  string // api.State*
	Reason string // EC2 state reason of the last transition that set one
	Intent Intent // what the next exit of QEMU means
	// Paused holds the reason QEMU paused the guest (QMP STOP), "" when
	// it runs.
	Paused string
	// GuestShutdown records a guest-initiated power-off seen before exit.
	GuestShutdown bool
}

// Effect is what the adapters must do after a transition.
type Effect int

const (
	EffectNone Effect = iota
	// EffectRelease: QEMU is gone for good; remove the per-boot runtime
	// (unit, runtime dir) but keep the instance's disks and firmware vars.
	EffectRelease
	// EffectDestroy: the instance is terminated: release, and remove the
	// firmware vars too.
	EffectDestroy
)

// ConflictError is a request the state does not allow (EC2's
// IncorrectInstanceState).
type ConflictError struct{ State, Event string }

func (e *ConflictError) Error() string {
	return fmt.Sprintf("the instance is %s; %s is not possible in that state", e.State, e.Event)
}

// Apply returns the machine after ev, and what must be done. behavior is
// the instance's shutdown behaviour (api.ShutdownStop or
// api.ShutdownTerminate). Requests that make no sense in the state are a
// *ConflictError; events that change nothing return the machine as is.
func (m Machine) Apply(ev Event, behavior string) (Machine, Effect, error) {
	n := m
	switch ev {
	case EvPaused:
		if n.State == api.InstanceStatePending || n.State == api.InstanceStateRunning {
			if n.Paused == "" {
				n.Paused = "paused"
			}
		}
		return n, EffectNone, nil
	case EvResumed:
		n.Paused = ""
		return n, EffectNone, nil
	}

	switch m.State {
	case api.InstanceStatePending, api.InstanceStateRunning:
		switch ev {
		case EvLaunch:
			return n, EffectNone, nil // already launched: idempotent start
		case EvRunning:
			n.State = api.InstanceStateRunning
			n.Paused = ""
		case EvReset:
			n.State = api.InstanceStateRunning
			n.Paused = ""
		case EvPowerdown:
		case EvStopRequest:
			n.State, n.Intent, n.Reason = api.InstanceStateStopping, IntentStop, ReasonUserShutdown
		case EvTerminateRequest:
			n.State, n.Intent, n.Reason = api.InstanceStateShuttingDown, IntentTerminate, ReasonUserShutdown
		case EvGuestShutdown:
			n.GuestShutdown = true
			n.Reason = ReasonInstanceShutdown
			if behavior == api.ShutdownTerminate {
				n.State, n.Intent = api.InstanceStateShuttingDown, IntentTerminate
			} else {
				n.State, n.Intent = api.InstanceStateStopping, IntentStop
			}
		case EvHostShutdown:
			n.State, n.Intent, n.Reason = api.InstanceStateStopping, IntentStop, ReasonOutsideShutdown
		case EvExited:
			n.State, n.Intent, n.Paused = api.InstanceStateStopped, IntentNone, ""
			if m.State == api.InstanceStatePending {
				n.Reason = ReasonInternalError
			} else {
				n.Reason = ReasonUnexpectedExit
			}
			return n, EffectRelease, nil
		case EvHostRebooted:
			n.State, n.Intent, n.Reason, n.Paused = api.InstanceStatePending, IntentNone, ReasonHostReboot, ""
			return n, EffectRelease, nil
		}
		return n, EffectNone, nil

	case api.InstanceStateStopping, api.InstanceStateShuttingDown:
		switch ev {
		case EvTerminateRequest:
			n.State, n.Intent = api.InstanceStateShuttingDown, IntentTerminate
			if n.Reason == "" {
				n.Reason = ReasonUserShutdown
			}
		case EvStopRequest, EvGuestShutdown, EvHostShutdown, EvPowerdown, EvReset, EvRunning:
			// already going down; a forced stop is the adapters' business
		case EvLaunch:
			return m, EffectNone, &ConflictError{m.State, "start"}
		case EvExited, EvHostRebooted:
			n.Paused, n.GuestShutdown = "", false
			if m.Intent == IntentTerminate || m.State == api.InstanceStateShuttingDown {
				n.State, n.Intent = api.InstanceStateTerminated, IntentNone
				return n, EffectDestroy, nil
			}
			n.State, n.Intent = api.InstanceStateStopped, IntentNone
			return n, EffectRelease, nil
		}
		return n, EffectNone, nil

	case api.InstanceStateStopped:
		switch ev {
		case EvLaunch:
			n.State, n.Intent, n.Reason, n.GuestShutdown, n.Paused = api.InstanceStatePending, IntentNone, "", false, ""
		case EvTerminateRequest:
			n.State, n.Intent, n.Reason = api.InstanceStateTerminated, IntentNone, ReasonUserShutdown
			return n, EffectDestroy, nil
		case EvStopRequest, EvExited, EvHostRebooted:
		default:
			// QMP events cannot come from a stopped instance; ignore stale ones.
		}
		return n, EffectNone, nil

	case api.InstanceStateTerminated:
		switch ev {
		case EvLaunch:
			return m, EffectNone, &ConflictError{m.State, "start"}
		}
		return m, EffectNone, nil
	}
	return m, EffectNone, fmt.Errorf("instance in unknown state %q", m.State)
}

// HoldsCapacity reports whether an instance in state counts against the
// host's capacity. Stopped and terminated instances do not, as in EC2,
// where starting a stopped instance can fail for capacity.
func HoldsCapacity(state string) bool {
	switch state {
	case api.InstanceStatePending, api.InstanceStateRunning, api.InstanceStateStopping, api.InstanceStateShuttingDown:
		return true
	}
	return false
}

// Active reports whether QEMU is expected to exist in state.
func Active(state string) bool { return HoldsCapacity(state) }
