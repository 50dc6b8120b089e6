// Package kvm decides whether guests can run under KVM on this machine: one
// verdict for first boot's readiness report and for hangar-vmd's choice of
// accelerator, so `hangar status` says what vmd will do.
//
// /dev/kvm opening is not enough. Some hosts (a kernel with KVM_PVM, which
// is what this project's build machines run) have a /dev/kvm that opens and
// answers KVM_GET_API_VERSION, yet ordinary guest kernels hang under it. So
// the verdict also wants the CPU's hardware virtualisation flag (vmx or
// svm) and no kvm_pvm module. It only reads: it never starts a guest (that
// is a probe for tools with seconds to spare, like image/vm.ProbeKVM).
package kvm

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
)

// Probe names what the verdict reads. Zero fields mean the machine's own:
// /dev/kvm, /sys/module, /proc/cpuinfo.
type Probe struct {
	Device    string
	SysModule string
	CPUInfo   string
	// APIVersion asks an open device its KVM API version; nil is the real
	// ioctl. Tests replace it, since a regular file does not answer.
	APIVersion func(*os.File) (int, error)
}

// apiVersion is KVM_GET_API_VERSION; every working KVM answers 12.
func apiVersion(f *os.File) (int, error) {
	const kvmGetAPIVersion = 0xAE00
	v, _, errno := syscall.Syscall(syscall.SYS_IOCTL, f.Fd(), kvmGetAPIVersion, 0)
	if errno != 0 {
		return 0, errno
	}
	return int(v), nil
}

// Usable reports whether guests can run under KVM here and, when not, why,
// in words an operator can act on.
func Usable() (bool, string) { return Probe{}.Usable() }

// Usable reports whether guests can run under KVM and, when not, why.
func (p Probe) Usable() (bool, string) {
	dev := orDefault(p.Device, "/dev/kvm")
	f, err := os.OpenFile(dev, os.O_RDWR, 0)
	if err != nil {
		return false, fmt.Sprintf("%s cannot be opened (%s)", dev, errText(err))
	}
	ask := p.APIVersion
	if ask == nil {
		ask = apiVersion
	}
	v, err := ask(f)
	f.Close()
	if err != nil {
		return false, fmt.Sprintf("%s does not answer KVM_GET_API_VERSION (%v)", dev, err)
	}
	if v != 12 {
		return false, fmt.Sprintf("%s reports KVM API version %d, not 12", dev, v)
	}
	if _, err := os.Stat(filepath.Join(orDefault(p.SysModule, "/sys/module"), "kvm_pvm")); err == nil {
		return false, dev + " is a PVM device (kvm_pvm), which does not run ordinary guest kernels"
	}
	cpuinfo := orDefault(p.CPUInfo, "/proc/cpuinfo")
	raw, err := os.ReadFile(cpuinfo)
	if err != nil {
		return false, fmt.Sprintf("cannot read %s (%s)", cpuinfo, errText(err))
	}
	for _, line := range strings.Split(string(raw), "\n") {
		name, flags, ok := strings.Cut(line, ":")
		if !ok || strings.TrimSpace(name) != "flags" {
			continue
		}
		for _, f := range strings.Fields(flags) {
			if f == "vmx" || f == "svm" {
				return true, ""
			}
		}
		break
	}
	return false, "the CPU has no hardware virtualisation (vmx/svm) flag"
}

func orDefault(v, def string) string {
	if v == "" {
		return def
	}
	return v
}

// errText is an error without the path the message already names.
func errText(err error) string {
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return pe.Err.Error()
	}
	return err.Error()
}
