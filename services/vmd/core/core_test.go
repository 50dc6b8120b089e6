package core

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"hangar.dev/hangar/services/internal/api"
)

func TestStateMachine(t *testing.T) {
	type step struct {
		ev       Event
		behavior string
		want     string
		effect   Effect
		conflict bool
	}
	cases := []struct {
		name  string
		start string
		steps []step
	}{
		{"launch to running, user stop, start again", api.InstanceStateStopped, []step{
			{ev: EvLaunch, want: api.InstanceStatePending},
			{ev: EvRunning, want: api.InstanceStateRunning},
			{ev: EvReset, want: api.InstanceStateRunning},
			{ev: EvStopRequest, want: api.InstanceStateStopping},
			{ev: EvPowerdown, want: api.InstanceStateStopping},
			{ev: EvExited, want: api.InstanceStateStopped, effect: EffectRelease},
			{ev: EvLaunch, want: api.InstanceStatePending},
		}},
		{"guest powers off, behaviour stop", api.InstanceStateRunning, []step{
			{ev: EvGuestShutdown, behavior: api.ShutdownStop, want: api.InstanceStateStopping},
			{ev: EvExited, want: api.InstanceStateStopped, effect: EffectRelease},
		}},
		{"guest powers off, behaviour terminate", api.InstanceStateRunning, []step{
			{ev: EvGuestShutdown, behavior: api.ShutdownTerminate, want: api.InstanceStateShuttingDown},
			{ev: EvExited, want: api.InstanceStateTerminated, effect: EffectDestroy},
			{ev: EvLaunch, want: api.InstanceStateTerminated, conflict: true},
		}},
		{"terminate while stopping", api.InstanceStateRunning, []step{
			{ev: EvStopRequest, want: api.InstanceStateStopping},
			{ev: EvTerminateRequest, want: api.InstanceStateShuttingDown},
			{ev: EvExited, want: api.InstanceStateTerminated, effect: EffectDestroy},
		}},
		{"terminate a stopped instance", api.InstanceStateStopped, []step{
			{ev: EvTerminateRequest, want: api.InstanceStateTerminated, effect: EffectDestroy},
			{ev: EvTerminateRequest, want: api.InstanceStateTerminated},
		}},
		{"crash while running", api.InstanceStateRunning, []step{
			{ev: EvExited, want: api.InstanceStateStopped, effect: EffectRelease},
		}},
		{"start while stopping is a conflict", api.InstanceStateStopping, []step{
			{ev: EvLaunch, want: api.InstanceStateStopping, conflict: true},
		}},
		{"host reboot restarts a running instance", api.InstanceStateRunning, []step{
			{ev: EvHostRebooted, want: api.InstanceStatePending, effect: EffectRelease},
			{ev: EvRunning, want: api.InstanceStateRunning},
		}},
		{"host reboot while stopping finishes the stop", api.InstanceStateStopping, []step{
			{ev: EvHostRebooted, want: api.InstanceStateStopped, effect: EffectRelease},
		}},
		{"outside quit stops", api.InstanceStateRunning, []step{
			{ev: EvHostShutdown, want: api.InstanceStateStopping},
			{ev: EvExited, want: api.InstanceStateStopped, effect: EffectRelease},
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m := Machine{State: c.start}
			if c.start == api.InstanceStateStopping {
				m.Intent = IntentStop
			}
			for i, s := range c.steps {
				n, eff, err := m.Apply(s.ev, s.behavior)
				var ce *ConflictError
				if s.conflict != errors.As(err, &ce) {
					t.Fatalf("step %d (%s): err = %v, want conflict %v", i, s.ev, err, s.conflict)
				}
				if n.State != s.want || eff != s.effect {
					t.Fatalf("step %d (%s) from %s: got %s/%d, want %s/%d", i, s.ev, m.State, n.State, eff, s.want, s.effect)
				}
				m = n
			}
		})
	}
}

func TestStateReasons(t *testing.T) {
	m, _, _ := Machine{State: api.InstanceStateRunning}.Apply(EvGuestShutdown, api.ShutdownStop)
	if m.Reason != ReasonInstanceShutdown {
		t.Errorf("guest shutdown reason %q", m.Reason)
	}
	m, _, _ = Machine{State: api.InstanceStateRunning}.Apply(EvStopRequest, "")
	if m.Reason != ReasonUserShutdown {
		t.Errorf("user stop reason %q", m.Reason)
	}
	m, _, _ = Machine{State: api.InstanceStateRunning}.Apply(EvPaused, "")
	if m.Paused == "" || m.State != api.InstanceStateRunning {
		t.Errorf("paused: %+v", m)
	}
	m, _, _ = m.Apply(EvResumed, "")
	if m.Paused != "" {
		t.Errorf("resumed: %+v", m)
	}
}

func TestCapacity(t *testing.T) {
	c := Capacity{HostCPUs: 2, HostMemoryMiB: 4096, ReserveVCPU: 0, ReserveMemoryMiB: 1024, CPUOvercommit: 8, PerGuestOverhead: 64}
	if l := c.Limits(); l.VCPUs != 16 || l.MemoryMiB != 3072 {
		t.Fatalf("limits %+v", l)
	}
	if err := c.Admit(Usage{}, c.Charge(2, 512)); err != nil {
		t.Fatal(err)
	}
	var ie *InsufficientCapacityError
	if err := c.Admit(Usage{VCPUs: 15}, c.Charge(2, 512)); !errors.As(err, &ie) || ie.Resource != "vCPUs" {
		t.Fatalf("vcpu overflow: %v", err)
	}
	// memory is never overcommitted: guest RAM plus overhead must fit
	if err := c.Admit(Usage{MemoryMiB: 3072 - 576}, c.Charge(1, 512)); err != nil {
		t.Fatalf("exact fit refused: %v", err)
	}
	if err := c.Admit(Usage{MemoryMiB: 3072 - 575}, c.Charge(1, 512)); !errors.As(err, &ie) || ie.Resource != "memory" {
		t.Fatalf("memory overflow: %v", err)
	}
	if l := (Capacity{HostCPUs: 4, ReserveVCPU: 1}).Limits(); l.VCPUs != 3 {
		t.Fatalf("default overcommit 1: %+v", l)
	}
}

func TestInstanceUUIDMatchesCloudInitEC2Detection(t *testing.T) {
	for _, id := range []string{"i-0123456789abcdef0", "i-0fedcba9876543210", "i-12345678"} {
		u := InstanceUUID(id)
		if !strings.HasPrefix(u, "ec2") || len(u) != 36 || strings.Count(u, "-") != 4 || u[14] != '4' || !strings.ContainsRune("89ab", rune(u[19])) {
			t.Errorf("%s: uuid %s", id, u)
		}
		if InstanceUUID(id) != u {
			t.Errorf("not stable")
		}
		sm := ResolveSMBIOS(api.InstanceSpec{ID: id, InstanceType: "t3.micro"})
		// ds-identify: uuid and serial both start with ec2 and are equal ignoring case.
		if !strings.EqualFold(sm.UUID, sm.Serial) || sm.Manufacturer != "Amazon EC2" || sm.Product != "t3.micro" || sm.AssetTag != id {
			t.Errorf("smbios %+v", sm)
		}
	}
	if InstanceUUID("i-0123456789abcdef0") == InstanceUUID("i-0123456789abcdef1") {
		t.Error("different ids share a uuid")
	}
}

func validSpec() api.InstanceSpec {
	return api.InstanceSpec{
		ID: "i-0123456789abcdef0", InstanceType: "t3.micro", VCPUs: 2, MemoryMiB: 1024,
		RootVolume: api.InstanceDisk{ID: "vol-0123456789abcdef0", Socket: "/run/hangar/ebs/vol-0123456789abcdef0.sock"},
		NICs:       []api.InstanceNIC{{ID: "eni-1", Tap: "tap0", MAC: "02:00:00:aa:bb:cc"}},
	}
}

func TestValidateSpec(t *testing.T) {
	mut := func(f func(*api.InstanceSpec)) api.InstanceSpec { s := validSpec(); f(&s); return s }
	bad := map[string]api.InstanceSpec{
		"id":            mut(func(s *api.InstanceSpec) { s.ID = "i-xyz" }),
		"vcpus":         mut(func(s *api.InstanceSpec) { s.VCPUs = 0 }),
		"memory":        mut(func(s *api.InstanceSpec) { s.MemoryMiB = 1 }),
		"boot mode":     mut(func(s *api.InstanceSpec) { s.BootMode = "coreboot" }),
		"no root":       mut(func(s *api.InstanceSpec) { s.RootVolume = api.InstanceDisk{} }),
		"type comma":    mut(func(s *api.InstanceSpec) { s.InstanceType = "t3.micro,x=y" }),
		"tap":           mut(func(s *api.InstanceSpec) { s.NICs[0].Tap = "tap0,script=/bin/sh" }),
		"mac":           mut(func(s *api.InstanceSpec) { s.NICs[0].MAC = "nope" }),
		"multicast mac": mut(func(s *api.InstanceSpec) { s.NICs[0].MAC = "01:00:00:00:00:01" }),
		"socket":        mut(func(s *api.InstanceSpec) { s.RootVolume.Socket = "relative.sock" }),
		"dup volume":    mut(func(s *api.InstanceSpec) { s.Volumes = []api.InstanceDisk{s.RootVolume} }),
		"smbios":        mut(func(s *api.InstanceSpec) { s.SMBIOS.Serial = "a,b" }),
		"behavior":      mut(func(s *api.InstanceSpec) { s.ShutdownBehavior = "hibernate" }),
		"kernel comma":  mut(func(s *api.InstanceSpec) { s.Kernel = "/k,x" }),
		"netns name":    mut(func(s *api.InstanceSpec) { s.NICs[0].ID, s.NICs[0].Namespace = "eni-0123456789abcdef0", "../x" }),
		"netns eni id":  mut(func(s *api.InstanceSpec) { s.NICs[0].Namespace = "hangar-vpc-0123" }),
	}
	for name, s := range bad {
		if err := ValidateSpec(s); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if err := ValidateSpec(validSpec()); err != nil {
		t.Fatal(err)
	}
}

func TestQEMUArgs(t *testing.T) {
	l := Launch{
		Spec:     validSpec(),
		Volumes:  []api.InstanceDisk{{ID: "vol-0000000000000000a", Socket: "/run/hangar/ebs/vol-0000000000000000a.sock"}},
		Accel:    AccelTCG,
		Firmware: Firmware{SeaBIOS: "/usr/share/seabios/bios-256k.bin", OVMFCode: "/code.fd"},
		Paths:    LaunchPaths{QMPSocket: "/run/hangar/vm/i/qmp.sock", PIDFile: "/run/hangar/vm/i/qemu.pid", ConsoleLog: "/var/lib/c.log", VarsFile: "/var/lib/vars.fd"},
	}
	args, err := QEMUArgs(l)
	if err != nil {
		t.Fatal(err)
	}
	line := strings.Join(args, " ")
	for _, want := range []string{
		"-nodefaults", "-machine q35", "-accel tcg", "-cpu max", "-smp 2", "-m 1024M",
		"-bios /usr/share/seabios/bios-256k.bin",
		"type=1,manufacturer=Amazon EC2,product=t3.micro,serial=ec2",
		"type=2,manufacturer=Amazon EC2,asset=i-0123456789abcdef0",
		"socket,id=qmp,path=/run/hangar/vm/i/qmp.sock,server=on,wait=off",
		"file,id=console,path=/var/lib/c.log,append=on",
		"tap,id=net0,ifname=tap0,script=no,downscript=no",
		"virtio-net-pci,id=nic0,netdev=net0,mac=02:00:00:aa:bb:cc,bus=rp0",
		`"reconnect-delay":30`, `"path":"/run/hangar/ebs/vol-0123456789abcdef0.sock"`,
		"nvme,id=nvme-vol-0123456789abcdef0,drive=blk-vol-0123456789abcdef0,serial=vol0123456789abcdef0,bus=rp1,bootindex=0",
		"nvme,id=nvme-vol-0000000000000000a,drive=blk-vol-0000000000000000a,serial=vol0000000000000000a,bus=rp2",
	} {
		if !strings.Contains(line, want) {
			t.Errorf("command line lacks %q:\n%s", want, line)
		}
	}
	// 1 NIC + root + 1 volume + spares
	if n := strings.Count(line, "pcie-root-port"); n != 3+SpareHotplugPorts {
		t.Errorf("%d root ports", n)
	}
	if slices.Contains(args, "-kernel") {
		t.Error("kernel without spec.Kernel")
	}

	l.Spec.BootMode = api.BootModeUEFI
	l.Accel = AccelKVM
	args, _ = QEMUArgs(l)
	line = strings.Join(args, " ")
	for _, want := range []string{"-accel kvm", "-cpu host", "if=pflash,format=raw,unit=0,readonly=on,file=/code.fd", "if=pflash,format=raw,unit=1,file=/var/lib/vars.fd"} {
		if !strings.Contains(line, want) {
			t.Errorf("uefi command line lacks %q", want)
		}
	}
	if strings.Contains(line, "-bios") {
		t.Error("uefi with -bios")
	}
	l.Accel = "hvf"
	if _, err := QEMUArgs(l); err == nil {
		t.Error("unknown accelerator accepted")
	}
}

// A NIC whose tap is in a VPC's namespace is not on the command line: it
// is plugged over QMP on its own root port while the guest is held at -S.
func TestQEMUArgsNamespaceNIC(t *testing.T) {
	s := validSpec()
	s.NICs = []api.InstanceNIC{
		{ID: "eni-0123456789abcdef0", Tap: "ht-0123456789ab", MAC: "02:00:00:AA:BB:01", Namespace: "hangar-vpc-0123456789abcdef0"},
		{ID: "eni-1", Tap: "tap1", MAC: "02:00:00:aa:bb:02"},
	}
	args, err := QEMUArgs(Launch{Spec: s, Accel: AccelTCG, Firmware: Firmware{SeaBIOS: "/bios.bin"},
		Paths: LaunchPaths{QMPSocket: "/run/q.sock", PIDFile: "/run/q.pid", ConsoleLog: "/var/c.log"}})
	if err != nil {
		t.Fatal(err)
	}
	line := strings.Join(args, " ")
	if !slices.Contains(args, "-S") {
		t.Error("no -S: the guest would run before its NICs are plugged")
	}
	if strings.Contains(line, "ht-0123456789ab") || strings.Contains(line, "id=nic0") {
		t.Errorf("the namespace NIC is on the command line:\n%s", line)
	}
	for _, want := range []string{"tap,id=net1,ifname=tap1,script=no,downscript=no", "virtio-net-pci,id=nic1,netdev=net1,mac=02:00:00:aa:bb:02,bus=rp1", "serial=vol0123456789abcdef0,bus=rp2,bootindex=0"} {
		if !strings.Contains(line, want) {
			t.Errorf("command line lacks %q:\n%s", want, line)
		}
	}
	if got := PluggedNICs(s); !slices.Equal(got, []int{0}) {
		t.Errorf("PluggedNICs = %v", got)
	}
	if d := NICDevice(0, s.NICs[0]); d["bus"] != "rp0" || d["mac"] != "02:00:00:aa:bb:01" || d["netdev"] != "net0" {
		t.Errorf("NICDevice = %v", d)
	}
	if n := NetdevTapFD(0); n["fd"] != TapFDName(0) || n["type"] != "tap" {
		t.Errorf("NetdevTapFD = %v", n)
	}
}

func TestFreePort(t *testing.T) {
	if p := FreePort(3, map[string]bool{"rp0": true, "rp2": true}); p != "rp1" {
		t.Errorf("got %s", p)
	}
	if p := FreePort(2, map[string]bool{"rp0": true, "rp1": true}); p != "" {
		t.Errorf("got %s", p)
	}
}
