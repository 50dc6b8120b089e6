package api

// The contract of hangar-vmd (dev.hangar.Compute1): method names, argument
// and result types, signals, and ComputeClient, the typed client the gateway
// uses. Every method is keyed by the EC2 instance id the gateway chose, and
// every method is idempotent: calling it again with the same arguments
// converges on the same result instead of failing.

import (
	"context"
	"fmt"
	"strings"

	"github.com/godbus/dbus/v5"
)

// Methods of dev.hangar.Compute1 (root object /dev/hangar/Compute1).
const (
	// CreateInstance(spec InstanceSpec) -> InstanceInfo. Registers the
	// instance and launches it (state pending, then running once QEMU
	// answers on QMP). Calling it again with the same spec returns the
	// instance as it is; with a different spec it is Conflict. Past the
	// host's capacity it is InsufficientCapacity and nothing is kept.
	MethodCreateInstance = "CreateInstance"
	// StartInstance(id) -> InstanceInfo. Starts a stopped instance; on a
	// pending or running one it changes nothing.
	MethodStartInstance = "StartInstance"
	// StopInstance(id, force bool, timeoutSec uint32) -> InstanceInfo.
	// Returns at once with state stopping: ACPI power-down through QMP,
	// then QEMU is ended when the guest has not powered off within
	// timeoutSec (0: DefaultStopTimeoutSec), or at once with force.
	MethodStopInstance = "StopInstance"
	// RebootInstance(id) -> InstanceInfo. Asks the guest to reboot
	// (Ctrl-Alt-Del), and resets it when it has not within
	// RebootGraceSec, as EC2 does. The instance stays running.
	MethodRebootInstance = "RebootInstance"
	// TerminateInstance(id) -> InstanceInfo. Returns at once with state
	// shutting-down (or terminated when nothing runs); QEMU is powered
	// down like Stop with force, the unit, the runtime directory and the
	// firmware vars are removed. The record stays, terminated, so
	// describe and get-console-output still answer, until DeleteInstance.
	MethodTerminateInstance = "TerminateInstance"
	// DeleteInstance(id). Forgets a terminated instance and its console
	// log. Deleting what is not there is not an error; deleting one that is
	// not terminated is Conflict.
	MethodDeleteInstance = "DeleteInstance"
	// AttachVolume(id, InstanceDisk) -> InstanceInfo. Hot-plugs the volume
	// (NBD client + NVMe controller) into a running instance, or records
	// it for the next start of a stopped one.
	MethodInstanceAttachVolume = "AttachVolume"
	// DetachVolume(id, volumeID, force bool) -> InstanceInfo. Unplugs the
	// volume; the guest is asked to let go (PCIe hot-unplug), and with
	// force the backend is dropped even when it has not within
	// DetachGraceSec. The result lists the volume as "detaching" until the
	// guest released it (VolumeStateChanged tells when).
	MethodInstanceDetachVolume = "DetachVolume"
	// GetConsoleOutput(id, latest bool) -> (output string, unixTime int64).
	// The last ConsoleOutputMax bytes of the serial console.
	MethodGetConsoleOutput = "GetConsoleOutput"
	// DescribeInstance(id) -> InstanceInfo.
	MethodDescribeInstance = "DescribeInstance"
	// ListInstances() -> []InstanceInfo, every instance vmd knows,
	// terminated ones included, for the gateway to reconcile on start.
	MethodListInstances = "ListInstances"
	// ReportGuestActivity(key, kind string). netd calls it when a guest
	// reached DHCP or IMDS (kind GuestActivityDHCP/IMDS); key is the
	// instance id, a NIC's MAC address or its tap name. It turns the
	// instance status check to ok. Unknown keys are NotFound.
	MethodReportGuestActivity = "ReportGuestActivity"
)

// Signals of dev.hangar.Compute1.
const (
	// InstanceStateChanged(id, state, reason string), on every state change.
	// reason is an EC2 state reason ("Client.UserInitiatedShutdown: User
	// initiated shutdown") or empty.
	SignalInstanceStateChanged = "InstanceStateChanged"
	// VolumeStateChanged(id, volumeID, state string): attached, detaching,
	// detached.
	SignalInstanceVolumeChanged = "VolumeStateChanged"
)

// ComputeInstanceInterface is the interface of each per-instance object
// /dev/hangar/Compute1/instance/i_0abc…, which only exposes properties.
const ComputeInstanceInterface = "dev.hangar.Compute1.Instance"

// Properties of a per-instance object.
const (
	PropInstanceID           = "InstanceId"
	PropInstanceType         = "InstanceType"
	PropInstanceState        = "State"
	PropStateReason          = "StateReason"
	PropInstanceVCPUs        = "VCPUs"
	PropInstanceMemoryMiB    = "MemoryMiB"
	PropInstanceTaps         = "Taps"
	PropInstanceVolumes      = "Volumes"
	PropInstanceQMPSocket    = "QMPSocket"
	PropInstanceUnit         = "Unit"
	PropInstanceAccelerator  = "Accelerator"
	PropInstancePID          = "PID"
	PropInstanceSystemStatus = "SystemStatus"
	PropInstanceStatus       = "InstanceStatus"
)

// Instance states, as EC2 names them.
const (
	InstanceStatePending      = "pending"
	InstanceStateRunning      = "running"
	InstanceStateStopping     = "stopping"
	InstanceStateStopped      = "stopped"
	InstanceStateShuttingDown = "shutting-down"
	InstanceStateTerminated   = "terminated"
)

// Boot modes, as EC2's BootMode names them.
const (
	BootModeLegacyBIOS = "legacy-bios"
	BootModeUEFI       = "uefi"
)

// Shutdown behaviours (EC2's InstanceInitiatedShutdownBehavior).
const (
	ShutdownStop      = "stop"
	ShutdownTerminate = "terminate"
)

// Status-check values, as DescribeInstanceStatus names them.
const (
	StatusCheckOK               = "ok"
	StatusCheckImpaired         = "impaired"
	StatusCheckInitializing     = "initializing"
	StatusCheckInsufficientData = "insufficient-data"
	StatusCheckNotApplicable    = "not-applicable"
)

// Guest activity kinds for ReportGuestActivity.
const (
	GuestActivityDHCP = "dhcp"
	GuestActivityIMDS = "imds"
)

// Volume attachment states.
const (
	DiskAttaching = "attaching"
	DiskAttached  = "attached"
	DiskDetaching = "detaching"
	DiskDetached  = "detached"
)

// Defaults and limits of the contract.
const (
	DefaultStopTimeoutSec = 120
	RebootGraceSec        = 30 // EC2 hard-reboots after "four minutes"; a shorter wait serves tests and users better
	DetachGraceSec        = 10
	ConsoleOutputMax      = 64 * 1024 // EC2: "only the most recent 64 KB of console output is available"
)

// InstanceSpec is what CreateInstance needs: the resolved instance type, the
// disks ebsd serves and the taps netd made. The gateway fills it; vmd
// decides nothing about AWS records.
type InstanceSpec struct {
	ID           string // i-0123456789abcdef0
	InstanceType string // t3.micro: SMBIOS product name
	VCPUs        uint32
	MemoryMiB    uint32
	BootMode     string // BootModeLegacyBIOS (default) or BootModeUEFI
	// ShutdownBehavior is what a guest-initiated power-off does:
	// ShutdownStop (default) or ShutdownTerminate.
	ShutdownBehavior string
	// RootVolume is the boot disk; its ID may be empty only when Kernel is
	// set (a disk-less guest, used by tests and development).
	RootVolume InstanceDisk
	Volumes    []InstanceDisk // further disks, in attach order
	NICs       []InstanceNIC  // device index order: NICs[0] is eth0
	// SMBIOS overrides; empty fields are derived from ID and InstanceType
	// so that cloud-init's EC2 detection matches (see docs/vmd.md).
	SMBIOS InstanceSMBIOS
	// Kernel, Initrd and KernelCmdline boot a kernel directly (development
	// and tests); the gateway leaves them empty.
	Kernel        string
	Initrd        string
	KernelCmdline string
}

// InstanceDisk is one EBS volume as an NBD export of ebsd.
type InstanceDisk struct {
	ID         string // vol-0123…; the guest sees it as NVMe serial vol0123…
	Socket     string // /run/hangar/ebs/vol-0123….sock
	Export     string // NBD export name: ebsd names exports by volume id; empty for a server's default export
	DeviceName string // EC2 device name as the API shows it (/dev/sdf)
	ReadOnly   bool
}

// InstanceNIC is one ENI as a tap netd created.
type InstanceNIC struct {
	ID  string // eni-…
	Tap string // tap name on the subnet's bridge
	MAC string // the ENI's MAC address
	// Namespace is the network namespace the tap lives in (netd's
	// InterfaceInfo.Namespace, the VPC's hangar-vpc-…). When set, vmd asks
	// netd for the tap, opened, each time it starts QEMU (NetworkClient
	// OpenTap by ID) and hands the descriptor to QEMU over QMP, so neither
	// vmd nor QEMU enters the VPC's namespace. When empty, the tap is in
	// vmd's own namespace and QEMU opens it by name (tests, development).
	Namespace string
}

// InstanceSMBIOS is what the guest reads from /sys/class/dmi/id.
type InstanceSMBIOS struct {
	Manufacturer string // sys_vendor: "Amazon EC2"
	Product      string // product_name: the instance type
	Serial       string // product_serial: equal to UUID, as on EC2
	UUID         string // product_uuid: starts with "ec2"
	AssetTag     string // board_asset_tag: the instance id, as on Nitro
}

// InstanceInfo is an instance as vmd sees it.
type InstanceInfo struct {
	ID           string
	InstanceType string
	State        string
	StateReason  string
	VCPUs        uint32
	MemoryMiB    uint32
	BootMode     string
	Accelerator  string // "kvm" or "tcg"
	Runner       string // "systemd" or "process"
	Unit         string // hangar-vm-i-….service
	PID          uint32 // QEMU's pid, 0 when not running
	QMPSocket    string
	ConsoleLog   string
	Taps         []string
	Volumes      []InstanceDiskInfo
	LaunchTime   int64 // unix seconds of the last start
	// SystemStatus is the EC2 system status check: QEMU alive and
	// answering QMP. InstanceStatus is the instance check: the guest
	// reached DHCP or IMDS since its last start.
	SystemStatus   string
	InstanceStatus string
	// GuestActivity is the unix time netd last reported the guest.
	GuestActivity int64
	// Paused is set while QEMU has the guest stopped (STOP event, such as
	// an I/O error on a volume); the system status is impaired meanwhile.
	Paused string
}

// InstanceDiskInfo is one attached volume.
type InstanceDiskInfo struct {
	ID         string
	DeviceName string
	Socket     string
	State      string // DiskAttached, DiskDetaching, …
	Root       bool
}

// InstancePath is the object path of an instance:
// /dev/hangar/Compute1/instance/i_0abc… (D-Bus paths allow no '-').
func InstancePath(id string) dbus.ObjectPath {
	return Compute.Path + "/instance/" + dbus.ObjectPath(strings.ReplaceAll(id, "-", "_"))
}

// ComputeClient calls hangar-vmd. It is safe for concurrent use.
type ComputeClient struct {
	conn *dbus.Conn
}

// NewComputeClient wraps a bus connection.
func NewComputeClient(conn *dbus.Conn) *ComputeClient { return &ComputeClient{conn: conn} }

func (c *ComputeClient) info(ctx context.Context, method string, args ...any) (InstanceInfo, error) {
	var info InstanceInfo
	err := Call(ctx, c.conn, Compute, method, []any{&info}, args...)
	return info, err
}

// CreateInstance registers and launches an instance.
func (c *ComputeClient) CreateInstance(ctx context.Context, spec InstanceSpec) (InstanceInfo, error) {
	return c.info(ctx, MethodCreateInstance, spec)
}

// StartInstance starts a stopped instance.
func (c *ComputeClient) StartInstance(ctx context.Context, id string) (InstanceInfo, error) {
	return c.info(ctx, MethodStartInstance, id)
}

// StopInstance powers an instance down (ACPI, then forced after timeoutSec).
func (c *ComputeClient) StopInstance(ctx context.Context, id string, force bool, timeoutSec uint32) (InstanceInfo, error) {
	return c.info(ctx, MethodStopInstance, id, force, timeoutSec)
}

// RebootInstance reboots a running instance.
func (c *ComputeClient) RebootInstance(ctx context.Context, id string) (InstanceInfo, error) {
	return c.info(ctx, MethodRebootInstance, id)
}

// TerminateInstance ends an instance for good.
func (c *ComputeClient) TerminateInstance(ctx context.Context, id string) (InstanceInfo, error) {
	return c.info(ctx, MethodTerminateInstance, id)
}

// DeleteInstance forgets a terminated instance.
func (c *ComputeClient) DeleteInstance(ctx context.Context, id string) error {
	return Call(ctx, c.conn, Compute, MethodDeleteInstance, nil, id)
}

// AttachVolume hot-plugs a volume.
func (c *ComputeClient) AttachVolume(ctx context.Context, id string, vol InstanceDisk) (InstanceInfo, error) {
	return c.info(ctx, MethodInstanceAttachVolume, id, vol)
}

// DetachVolume unplugs a volume.
func (c *ComputeClient) DetachVolume(ctx context.Context, id, volumeID string, force bool) (InstanceInfo, error) {
	return c.info(ctx, MethodInstanceDetachVolume, id, volumeID, force)
}

// GetConsoleOutput returns the tail of the serial console and the time it
// was read.
func (c *ComputeClient) GetConsoleOutput(ctx context.Context, id string, latest bool) (string, int64, error) {
	var (
		out string
		ts  int64
	)
	err := Call(ctx, c.conn, Compute, MethodGetConsoleOutput, []any{&out, &ts}, id, latest)
	return out, ts, err
}

// DescribeInstance returns one instance.
func (c *ComputeClient) DescribeInstance(ctx context.Context, id string) (InstanceInfo, error) {
	return c.info(ctx, MethodDescribeInstance, id)
}

// ListInstances returns every instance vmd knows.
func (c *ComputeClient) ListInstances(ctx context.Context) ([]InstanceInfo, error) {
	var out []InstanceInfo
	err := Call(ctx, c.conn, Compute, MethodListInstances, []any{&out})
	return out, err
}

// ReportGuestActivity tells vmd a guest reached DHCP or IMDS.
func (c *ComputeClient) ReportGuestActivity(ctx context.Context, key, kind string) error {
	return Call(ctx, c.conn, Compute, MethodReportGuestActivity, nil, key, kind)
}

// InstanceStateChange is one InstanceStateChanged signal.
type InstanceStateChange struct {
	ID, State, Reason string
}

// WatchInstanceStates delivers InstanceStateChanged signals until ctx ends;
// the channel is closed then. Reconcile with ListInstances after
// subscribing, as signals sent before are not replayed.
func (c *ComputeClient) WatchInstanceStates(ctx context.Context) (<-chan InstanceStateChange, error) {
	opts := []dbus.MatchOption{
		dbus.WithMatchInterface(Compute.Interface),
		dbus.WithMatchMember(SignalInstanceStateChanged),
		dbus.WithMatchObjectPath(Compute.Path),
	}
	if err := c.conn.AddMatchSignalContext(ctx, opts...); err != nil {
		return nil, fmt.Errorf("subscribing to %s: %w", SignalInstanceStateChanged, err)
	}
	raw := make(chan *dbus.Signal, 64)
	c.conn.Signal(raw)
	out := make(chan InstanceStateChange, 64)
	name := Compute.Interface + "." + SignalInstanceStateChanged
	go func() {
		defer close(out)
		defer func() {
			c.conn.RemoveSignal(raw)
			_ = c.conn.RemoveMatchSignal(opts...)
		}()
		for {
			select {
			case <-ctx.Done():
				return
			case s, ok := <-raw:
				if !ok {
					return
				}
				if s.Name != name || len(s.Body) != 3 {
					continue
				}
				id, _ := s.Body[0].(string)
				st, _ := s.Body[1].(string)
				reason, _ := s.Body[2].(string)
				select {
				case out <- InstanceStateChange{ID: id, State: st, Reason: reason}:
				case <-ctx.Done():
					return
				}
			}
		}
	}()
	return out, nil
}
