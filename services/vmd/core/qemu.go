package core

import (
	"encoding/json"
	"fmt"
	"net"
	"regexp"
	"strings"

	"hangar.dev/hangar/services/internal/api"
)

// Accelerators.
const (
	AccelKVM = "kvm"
	AccelTCG = "tcg"
)

// ReconnectDelaySec is how long QEMU's NBD client keeps retrying a volume
// whose ebsd socket went away (ebsd restarting) before failing guest I/O.
// Requests wait meanwhile instead of erroring, so a restart of ebsd is a
// pause to the guest, not an I/O error.
const ReconnectDelaySec = 30

// SpareHotplugPorts is how many empty PCIe root ports each guest gets for
// volumes attached while it runs: q35's root bus does not hot-plug, its
// root ports do.
const SpareHotplugPorts = 8

// Overhead is the memory a guest's QEMU uses beyond guest RAM, as
// measured (docs/vmd.md): about 100 MiB of QEMU itself, plus under TCG the
// translated-code cache, which QEMU lets grow to 1 GiB and a full Linux
// boot fills. Capping the cache (tb-size) made boots 30 % slower and
// stalled a guest under load, so the cache keeps QEMU's default and the
// accounting pays for it instead.
type Overhead struct {
	// Account is charged against the host's memory per instance.
	Account int
	// Headroom is added to guest RAM for the unit's MemoryMax.
	Headroom int
}

// OverheadFor returns the overhead of one guest under accel.
func OverheadFor(accel string) Overhead {
	if accel == AccelTCG {
		return Overhead{Account: 1024 + 128, Headroom: 1024 + 256}
	}
	return Overhead{Account: 128, Headroom: 256}
}

// Firmware names the files QEMU boots with.
type Firmware struct {
	SeaBIOS  string // /usr/share/seabios/bios-256k.bin
	OVMFCode string // /usr/share/OVMF/OVMF_CODE_4M.fd
	OVMFVars string // the template copied per instance
}

// LaunchPaths are where one instance's files live.
type LaunchPaths struct {
	QMPSocket  string // /run/hangar/vm/<id>/qmp.sock
	PIDFile    string // /run/hangar/vm/<id>/qemu.pid
	ConsoleLog string // /var/lib/hangar/vmd/instances/<id>/console.log
	VarsFile   string // /var/lib/hangar/vmd/instances/<id>/OVMF_VARS.fd (uefi only)
}

// Launch is everything the QEMU command line is built from.
type Launch struct {
	Spec     api.InstanceSpec
	Volumes  []api.InstanceDisk // the data volumes attached now (root excluded)
	Accel    string
	Firmware Firmware
	Paths    LaunchPaths
}

var (
	instanceIDPattern = regexp.MustCompile(`^i-[0-9a-f]{8}([0-9a-f]{9})?$`)
	volumeIDPattern   = regexp.MustCompile(`^vol-[0-9a-f]{8}([0-9a-f]{9})?$`)
	tapPattern        = regexp.MustCompile(`^[A-Za-z0-9_.-]{1,15}$`)
	netnsPattern      = regexp.MustCompile(`^[A-Za-z0-9_.-]{1,64}$`)
	eniIDPattern      = regexp.MustCompile(`^eni-[0-9a-f]{8}([0-9a-f]{9})?$`)
	smbiosPattern     = regexp.MustCompile(`^[A-Za-z0-9 ._:/()+-]{0,64}$`)
)

// ValidateSpec checks a spec before anything is created for it. Every
// string that reaches the QEMU command line is checked here, so no value
// can smuggle in an option.
func ValidateSpec(s api.InstanceSpec) error {
	if !instanceIDPattern.MatchString(s.ID) {
		return fmt.Errorf("instance id %q is not of the form i-0123456789abcdef0", s.ID)
	}
	if s.VCPUs < 1 || s.VCPUs > 255 {
		return fmt.Errorf("vcpus %d is not 1-255", s.VCPUs)
	}
	if s.MemoryMiB < 64 || s.MemoryMiB > 4<<20 {
		return fmt.Errorf("memory %d MiB is not 64 MiB-4 TiB", s.MemoryMiB)
	}
	switch s.BootMode {
	case "", api.BootModeLegacyBIOS, api.BootModeUEFI:
	default:
		return fmt.Errorf("boot mode %q is not %s or %s", s.BootMode, api.BootModeLegacyBIOS, api.BootModeUEFI)
	}
	switch s.ShutdownBehavior {
	case "", api.ShutdownStop, api.ShutdownTerminate:
	default:
		return fmt.Errorf("shutdown behavior %q is not %s or %s", s.ShutdownBehavior, api.ShutdownStop, api.ShutdownTerminate)
	}
	if !smbiosPattern.MatchString(s.InstanceType) || s.InstanceType == "" {
		return fmt.Errorf("instance type %q is empty or has characters other than letters, digits and . _ -", s.InstanceType)
	}
	if s.RootVolume.ID == "" && s.Kernel == "" {
		return fmt.Errorf("a root volume is needed unless a kernel is booted directly")
	}
	seen := map[string]bool{}
	vols := s.Volumes
	if s.RootVolume.ID != "" {
		vols = append([]api.InstanceDisk{s.RootVolume}, vols...)
	}
	for _, v := range vols {
		if err := ValidateDisk(v); err != nil {
			return err
		}
		if seen[v.ID] {
			return fmt.Errorf("volume %s is given twice", v.ID)
		}
		seen[v.ID] = true
	}
	if len(s.Volumes) > 24 {
		return fmt.Errorf("%d data volumes; at most 24", len(s.Volumes))
	}
	if len(s.NICs) > 8 {
		return fmt.Errorf("%d network interfaces; at most 8", len(s.NICs))
	}
	taps := map[string]bool{}
	for i, n := range s.NICs {
		if !tapPattern.MatchString(n.Tap) {
			return fmt.Errorf("nic %d: tap name %q is not a valid interface name", i, n.Tap)
		}
		if taps[n.Tap] {
			return fmt.Errorf("nic %d: tap %s is given twice", i, n.Tap)
		}
		taps[n.Tap] = true
		if n.Namespace != "" {
			// vmd asks netd for the tap by ENI id, so the id must be one.
			if !netnsPattern.MatchString(n.Namespace) || n.Namespace == "." || n.Namespace == ".." {
				return fmt.Errorf("nic %d: namespace %q is not a network namespace name", i, n.Namespace)
			}
			if !eniIDPattern.MatchString(n.ID) {
				return fmt.Errorf("nic %d: %q is not an ENI id (eni-0123456789abcdef0); a tap in a namespace is opened by it", i, n.ID)
			}
		}
		mac, err := net.ParseMAC(n.MAC)
		if err != nil || len(mac) != 6 {
			return fmt.Errorf("nic %d: %q is not a MAC address", i, n.MAC)
		}
		if mac[0]&1 == 1 {
			return fmt.Errorf("nic %d: %s is a multicast address", i, n.MAC)
		}
	}
	sm := s.SMBIOS
	for name, v := range map[string]string{"manufacturer": sm.Manufacturer, "product": sm.Product, "serial": sm.Serial, "uuid": sm.UUID, "asset tag": sm.AssetTag} {
		if !smbiosPattern.MatchString(v) {
			return fmt.Errorf("smbios %s %q has characters other than letters, digits, spaces and ._:/()+-", name, v)
		}
	}
	for name, p := range map[string]string{"kernel": s.Kernel, "initrd": s.Initrd} {
		if strings.ContainsAny(p, ",\n") {
			return fmt.Errorf("%s path %q has a comma or newline", name, p)
		}
	}
	if s.Initrd != "" && s.Kernel == "" {
		return fmt.Errorf("an initrd needs a kernel")
	}
	if strings.ContainsAny(s.KernelCmdline, "\n\x00") {
		return fmt.Errorf("kernel command line has a newline")
	}
	return nil
}

// ValidateDisk checks one volume.
func ValidateDisk(v api.InstanceDisk) error {
	if !volumeIDPattern.MatchString(v.ID) {
		return fmt.Errorf("volume id %q is not of the form vol-0123456789abcdef0", v.ID)
	}
	if !strings.HasPrefix(v.Socket, "/") || strings.ContainsAny(v.Socket, "\n\x00") || len(v.Socket) > 107 {
		return fmt.Errorf("volume %s: socket %q is not an absolute path of at most 107 bytes", v.ID, v.Socket)
	}
	if strings.ContainsAny(v.Export, "\n\x00") || len(v.Export) > 4096 {
		return fmt.Errorf("volume %s: export name is invalid", v.ID)
	}
	if v.DeviceName != "" && !regexp.MustCompile(`^/dev/[a-z0-9]{2,12}$`).MatchString(v.DeviceName) {
		return fmt.Errorf("volume %s: device name %q is not like /dev/sdf", v.ID, v.DeviceName)
	}
	return nil
}

// NVMeSerial is the NVMe serial number a volume shows the guest: its id
// without the dash, as EBS volumes show on Nitro ("vol0123456789abcdef0"),
// so the guest's udev rules and ebsnvme-id find the volume by id.
func NVMeSerial(volumeID string) string { return strings.ReplaceAll(volumeID, "-", "") }

// NodeName is the QEMU block node of a volume; DeviceID its NVMe
// controller; PortID the PCIe root port it sits on.
func NodeName(volumeID string) string { return "blk-" + volumeID }
func DeviceID(volumeID string) string { return "nvme-" + volumeID }

// BlockdevNBD is the blockdev-add argument (and -blockdev JSON) of a
// volume: an NBD client of ebsd's socket that reconnects.
func BlockdevNBD(v api.InstanceDisk) map[string]any {
	b := map[string]any{
		"driver":          "nbd",
		"node-name":       NodeName(v.ID),
		"server":          map[string]any{"type": "unix", "path": v.Socket},
		"reconnect-delay": ReconnectDelaySec,
		"read-only":       v.ReadOnly,
		"cache":           map[string]any{"direct": false, "no-flush": false},
	}
	if v.Export != "" {
		b["export"] = v.Export
	}
	return b
}

// NVMeDevice is the device_add argument (and -device) of a volume's NVMe
// controller on port.
func NVMeDevice(v api.InstanceDisk, port string, boot bool) map[string]any {
	d := map[string]any{
		"driver": "nvme",
		"id":     DeviceID(v.ID),
		"drive":  NodeName(v.ID),
		"serial": NVMeSerial(v.ID),
		"bus":    port,
	}
	if boot {
		d["bootindex"] = 0
	}
	return d
}

// PortName is the id of the i-th PCIe root port.
func PortName(i int) string { return fmt.Sprintf("rp%d", i) }

// Ports is how many root ports a guest gets: one per NIC and volume it
// starts with, plus the spares for hot-plug.
func Ports(spec api.InstanceSpec, dataVolumes int) int {
	n := len(spec.NICs) + dataVolumes + SpareHotplugPorts
	if spec.RootVolume.ID != "" {
		n++
	}
	return n
}

func jsonArg(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err) // maps of strings, ints and bools always marshal
	}
	return string(b)
}

// QEMUArgs builds the QEMU command line (without the program name).
// Every value in it was checked by ValidateSpec.
func QEMUArgs(l Launch) ([]string, error) {
	s := l.Spec
	if err := ValidateSpec(s); err != nil {
		return nil, err
	}
	if l.Accel != AccelKVM && l.Accel != AccelTCG {
		return nil, fmt.Errorf("accelerator %q is not kvm or tcg", l.Accel)
	}
	sm := ResolveSMBIOS(s)
	a := []string{
		"-name", "guest=" + s.ID + ",debug-threads=on",
		// The guest is held until vmd has plugged what only QMP can carry
		// (tap descriptors from netd) and says cont.
		"-S",
		"-nodefaults", "-no-user-config",
		"-machine", "q35",
		"-accel", l.Accel,
		"-cpu", map[string]string{AccelKVM: "host", AccelTCG: "max"}[l.Accel],
		"-smp", fmt.Sprint(s.VCPUs),
		"-m", fmt.Sprintf("%dM", s.MemoryMiB),
		"-display", "none",
		"-rtc", "base=utc",
		"-msg", "timestamp=on",
		"-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
		"-uuid", sm.UUID,
		"-smbios", "type=0,vendor=" + sm.Manufacturer,
		"-smbios", fmt.Sprintf("type=1,manufacturer=%s,product=%s,serial=%s,uuid=%s", sm.Manufacturer, sm.Product, sm.Serial, sm.UUID),
		"-smbios", "type=2,manufacturer=" + sm.Manufacturer + ",asset=" + sm.AssetTag,
		"-smbios", "type=3,manufacturer=" + sm.Manufacturer + ",asset=" + sm.Manufacturer,
		"-chardev", "socket,id=qmp,path=" + l.Paths.QMPSocket + ",server=on,wait=off",
		"-mon", "chardev=qmp,mode=control",
		"-chardev", "file,id=console,path=" + l.Paths.ConsoleLog + ",append=on",
		"-serial", "chardev:console",
		"-pidfile", l.Paths.PIDFile,
		"-object", "rng-random,id=rng0,filename=/dev/urandom",
		"-device", "virtio-rng-pci,rng=rng0",
	}
	for _, p := range []string{l.Paths.QMPSocket, l.Paths.ConsoleLog, l.Paths.PIDFile} {
		if strings.ContainsAny(p, ",\n") {
			return nil, fmt.Errorf("path %q has a comma or newline", p)
		}
	}
	switch s.BootMode {
	case api.BootModeUEFI:
		if strings.ContainsAny(l.Firmware.OVMFCode+l.Paths.VarsFile, ",\n") || l.Paths.VarsFile == "" {
			return nil, fmt.Errorf("uefi needs firmware paths without commas")
		}
		a = append(a,
			"-drive", "if=pflash,format=raw,unit=0,readonly=on,file="+l.Firmware.OVMFCode,
			"-drive", "if=pflash,format=raw,unit=1,file="+l.Paths.VarsFile)
	default:
		a = append(a, "-bios", l.Firmware.SeaBIOS)
	}
	nports := Ports(s, len(l.Volumes))
	for i := 0; i < nports; i++ {
		a = append(a, "-device", fmt.Sprintf("pcie-root-port,id=%s,chassis=%d", PortName(i), i+1))
	}
	port := 0
	for i, n := range s.NICs {
		// A tap in a VPC's namespace cannot be opened by name from here:
		// its descriptor comes from netd and reaches QEMU over QMP while
		// the guest is held at -S (see PluggedNICs). Its port is kept.
		if n.Namespace == "" {
			a = append(a,
				"-netdev", fmt.Sprintf("tap,id=%s,ifname=%s,script=no,downscript=no", NetdevID(i), n.Tap),
				"-device", deviceArg(NICDevice(i, n)))
		}
		port++
	}
	if s.RootVolume.ID != "" {
		a = append(a, "-blockdev", jsonArg(BlockdevNBD(s.RootVolume)), "-device", deviceArg(NVMeDevice(s.RootVolume, PortName(port), true)))
		port++
	}
	for _, v := range l.Volumes {
		a = append(a, "-blockdev", jsonArg(BlockdevNBD(v)), "-device", deviceArg(NVMeDevice(v, PortName(port), false)))
		port++
	}
	if s.Kernel != "" {
		a = append(a, "-kernel", s.Kernel)
		if s.Initrd != "" {
			a = append(a, "-initrd", s.Initrd)
		}
		if s.KernelCmdline != "" {
			a = append(a, "-append", s.KernelCmdline)
		}
	}
	return a, nil
}

// NetdevID is the QEMU netdev of the i-th NIC; NICDeviceID its
// virtio-net device; TapFDName the name its tap descriptor is passed
// under (QMP getfd).
func NetdevID(i int) string    { return fmt.Sprintf("net%d", i) }
func NICDeviceID(i int) string { return fmt.Sprintf("nic%d", i) }
func TapFDName(i int) string   { return fmt.Sprintf("tapfd%d", i) }

// NICDevice is the device_add argument (and -device) of the i-th NIC: a
// virtio-net on the i-th root port with the ENI's MAC.
func NICDevice(i int, n api.InstanceNIC) map[string]any {
	return map[string]any{
		"driver": "virtio-net-pci",
		"id":     NICDeviceID(i),
		"netdev": NetdevID(i),
		"mac":    strings.ToLower(n.MAC),
		"bus":    PortName(i),
	}
}

// NetdevTapFD is the netdev_add argument of the i-th NIC's tap, given to
// QEMU as the descriptor named TapFDName(i).
func NetdevTapFD(i int) map[string]any {
	return map[string]any{"type": "tap", "id": NetdevID(i), "fd": TapFDName(i)}
}

// PluggedNICs returns the indexes of the NICs vmd plugs over QMP before
// the guest starts: those whose tap is in another network namespace.
func PluggedNICs(s api.InstanceSpec) []int {
	var out []int
	for i, n := range s.NICs {
		if n.Namespace != "" {
			out = append(out, i)
		}
	}
	return out
}

// deviceArg renders a device map as -device's key=value list, driver
// first. Values were validated, so none holds a comma.
func deviceArg(d map[string]any) string {
	parts := []string{fmt.Sprint(d["driver"])}
	for _, k := range []string{"id", "netdev", "mac", "drive", "serial", "bus", "bootindex"} {
		if v, ok := d[k]; ok {
			parts = append(parts, fmt.Sprintf("%s=%v", k, v))
		}
	}
	return strings.Join(parts, ",")
}

// FreePort returns the first root port not in used, or "" when all
// nports are taken.
func FreePort(nports int, used map[string]bool) string {
	for i := 0; i < nports; i++ {
		if !used[PortName(i)] {
			return PortName(i)
		}
	}
	return ""
}
