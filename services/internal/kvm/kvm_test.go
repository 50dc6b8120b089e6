package kvm

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

func TestUsable(t *testing.T) {
	const vmxFlags = "processor\t: 0\nflags\t\t: fpu vme de pse vmx sse2\n\nprocessor\t: 1\nflags\t\t: fpu vme de pse vmx sse2\n"
	const noFlags = "processor\t: 0\nflags\t\t: fpu vme de pse sse2 hypervisor\n"
	for _, tc := range []struct {
		name    string
		device  bool
		version int
		verr    error
		pvm     bool
		cpuinfo string
		ok      bool
		why     string
	}{
		{name: "working kvm", device: true, version: 12, cpuinfo: vmxFlags, ok: true},
		{name: "amd", device: true, version: 12, cpuinfo: "flags : svm sse2\n", ok: true},
		{name: "no device", device: false, why: "cannot be opened (no such file or directory)"},
		{name: "not a kvm device", device: true, verr: syscall.ENOTTY, cpuinfo: vmxFlags, why: "does not answer KVM_GET_API_VERSION"},
		{name: "old api", device: true, version: 11, cpuinfo: vmxFlags, why: "KVM API version 11, not 12"},
		// This project's build machines: /dev/kvm opens and answers 12,
		// but it is PVM, and ordinary guest kernels hang under it.
		{name: "pvm", device: true, version: 12, pvm: true, cpuinfo: vmxFlags, why: "is a PVM device (kvm_pvm)"},
		{name: "no vmx", device: true, version: 12, cpuinfo: noFlags, why: "no hardware virtualisation (vmx/svm) flag"},
		// "flags" of a later field must not count ("vmx flags" lines exist).
		{name: "vmx only in another field", device: true, version: 12, cpuinfo: "flags : sse2\nvmx flags : vnmi ept\n", why: "no hardware virtualisation"},
		{name: "cpuinfo unreadable", device: true, version: 12, why: "cannot read"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			p := Probe{
				Device:     filepath.Join(dir, "kvm"),
				SysModule:  filepath.Join(dir, "module"),
				CPUInfo:    filepath.Join(dir, "cpuinfo"),
				APIVersion: func(*os.File) (int, error) { return tc.version, tc.verr },
			}
			if tc.device {
				os.WriteFile(p.Device, nil, 0o600)
			}
			os.MkdirAll(filepath.Join(p.SysModule, "kvm"), 0o755)
			if tc.pvm {
				os.MkdirAll(filepath.Join(p.SysModule, "kvm_pvm"), 0o755)
			}
			if tc.cpuinfo != "" {
				os.WriteFile(p.CPUInfo, []byte(tc.cpuinfo), 0o644)
			}
			ok, why := p.Usable()
			if ok != tc.ok || !strings.Contains(why, tc.why) || (ok && why != "") {
				t.Fatalf("Usable() = %v, %q; want %v, %q", ok, why, tc.ok, tc.why)
			}
		})
	}
}

// The real ioctl on something that is not KVM fails rather than passing.
func TestAPIVersionOfARegularFile(t *testing.T) {
	f, err := os.CreateTemp(t.TempDir(), "not-kvm")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if v, err := apiVersion(f); err == nil {
		t.Fatalf("KVM_GET_API_VERSION on a regular file answered %d", v)
	}
}
