package core

import (
	"strings"
	"testing"

	"hangar.dev/hangar/services/internal/api"
)

// The keys each comma-separated QEMU option may carry. A spec value that
// smuggled a comma into an option would show up as a key outside these.
var allowedKeys = map[string]map[string]bool{
	"-netdev":  {"tap": true, "id": true, "ifname": true, "script": true, "downscript": true},
	"-device":  {"virtio-net-pci": true, "virtio-rng-pci": true, "pcie-root-port": true, "nvme": true, "id": true, "netdev": true, "mac": true, "bus": true, "rng": true, "chassis": true, "drive": true, "serial": true, "bootindex": true},
	"-smbios":  {"type": true, "vendor": true, "manufacturer": true, "product": true, "serial": true, "uuid": true, "asset": true},
	"-chardev": {"socket": true, "file": true, "id": true, "path": true, "server": true, "wait": true, "append": true},
	"-name":    {"guest": true, "debug-threads": true},
}

// FuzzQEMUArgs: whatever the strings of a spec hold, a spec that validates
// yields a command line whose options carry only the keys vmd writes.
func FuzzQEMUArgs(f *testing.F) {
	f.Add("t3.micro", "tap0", "02:00:00:00:00:01", "ec2abc", "/run/hangar/ebs/vol-0123456789abcdef0.sock", "", "console=ttyS0")
	f.Add("t3.micro,x=y", "tap0,script=/bin/sh", "02:00:00:00:00:01", "a,b", "/s,x", "exp", "a\nb")
	f.Fuzz(func(t *testing.T, itype, tap, mac, serial, socket, export, cmdline string) {
		s := api.InstanceSpec{
			ID: "i-0123456789abcdef0", InstanceType: itype, VCPUs: 1, MemoryMiB: 256,
			RootVolume:    api.InstanceDisk{ID: "vol-0123456789abcdef0", Socket: socket, Export: export},
			NICs:          []api.InstanceNIC{{Tap: tap, MAC: mac}},
			SMBIOS:        api.InstanceSMBIOS{Serial: serial},
			Kernel:        "/vmlinuz",
			KernelCmdline: cmdline,
		}
		if ValidateSpec(s) != nil {
			return
		}
		args, err := QEMUArgs(Launch{Spec: s, Accel: AccelTCG, Firmware: Firmware{SeaBIOS: "/bios.bin"},
			Paths: LaunchPaths{QMPSocket: "/run/q.sock", PIDFile: "/run/q.pid", ConsoleLog: "/var/c.log"}})
		if err != nil {
			t.Fatalf("valid spec rejected: %v", err)
		}
		for i := 0; i+1 < len(args); i++ {
			keys, ok := allowedKeys[args[i]]
			if !ok {
				continue
			}
			for _, kv := range strings.Split(args[i+1], ",") {
				k, _, _ := strings.Cut(kv, "=")
				if !keys[k] {
					t.Fatalf("option %s %q carries key %q", args[i], args[i+1], k)
				}
			}
		}
	})
}
