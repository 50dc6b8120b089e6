// Package testguest provides what vmd's tests and benchmarks boot: a
// Debian cloud kernel (from the installed linux-image-cloud-amd64, or
// fetched with apt-get download and unpacked with dpkg-deb into a cache)
// and a busybox initramfs whose init prints markers on the serial console:
// the DMI identity it sees, the block devices it has (so hot-plug shows),
// and what it does on the ACPI power button and Ctrl-Alt-Del.
//
// It is test support: it runs apt-get and writes a cache, and must never be
// used by a service.
package testguest

import (
	"bytes"
	"compress/gzip"
	"debug/elf"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
)

// Console markers the init prints.
const (
	MarkerUp       = "HANGAR-GUEST-UP"
	MarkerDMI      = "HANGAR-DMI"
	MarkerBlock    = "HANGAR-BLOCK:"
	MarkerPoweroff = "HANGAR-GUEST-POWEROFF"
	MarkerCAD      = "HANGAR-GUEST-CTRL-ALT-DEL"
	MarkerSelfOff  = "HANGAR-GUEST-SELF-POWEROFF"
)

// SelfPoweroff, added to the kernel command line, makes the guest power
// itself off once it is up: a guest-initiated shutdown.
const SelfPoweroff = "hangar.poweroff"

// CacheDir keeps the unpacked kernel between test runs.
var CacheDir = filepath.Join(os.TempDir(), "hangar-test-kernel")

// Cmdline is the kernel command line for the initramfs.
const Cmdline = "console=ttyS0 panic=-1 loglevel=4 rdinit=/init"

var (
	once      sync.Once
	kernel    string
	modDir    string
	kernelErr error
)

// Kernel returns the path of a cloud kernel and its module tree, skipping
// the test with one line when none can be had.
func Kernel(t testing.TB) (vmlinuz, modules string) {
	t.Helper()
	once.Do(func() { kernel, modDir, kernelErr = findKernel() })
	if kernelErr != nil {
		t.Skipf("skipping: no Debian cloud kernel for the test guest: %v", kernelErr)
	}
	return kernel, modDir
}

func findKernel() (string, string, error) {
	for _, root := range []string{"/", CacheDir} {
		ks, _ := filepath.Glob(filepath.Join(root, "boot", "vmlinuz-*-cloud-amd64"))
		sort.Strings(ks)
		if len(ks) > 0 {
			k := ks[len(ks)-1]
			ver := strings.TrimPrefix(filepath.Base(k), "vmlinuz-")
			mods := filepath.Join(root, "lib", "modules", ver)
			if _, err := os.Stat(mods); err == nil {
				return k, mods, nil
			}
			mods = filepath.Join(root, "usr", "lib", "modules", ver)
			if _, err := os.Stat(mods); err == nil {
				return k, mods, nil
			}
		}
	}
	// Fetch the package the linux-image-cloud-amd64 metapackage points at.
	out, err := exec.Command("apt-cache", "depends", "linux-image-cloud-amd64").Output()
	if err != nil {
		return "", "", fmt.Errorf("apt-cache depends linux-image-cloud-amd64: %v", err)
	}
	pkg := ""
	for _, line := range strings.Split(string(out), "\n") {
		if f := strings.Fields(line); len(f) == 2 && f[0] == "Depends:" && strings.HasPrefix(f[1], "linux-image-") {
			pkg = f[1]
		}
	}
	if pkg == "" {
		return "", "", fmt.Errorf("apt-cache names no kernel package for linux-image-cloud-amd64 (run apt-get update)")
	}
	dl, err := os.MkdirTemp("", "hangar-kernel-dl-")
	if err != nil {
		return "", "", err
	}
	defer os.RemoveAll(dl)
	_ = os.Chmod(dl, 0o755) // apt's _apt user downloads into it
	cmd := exec.Command("apt-get", "download", "-q", pkg)
	cmd.Dir = dl
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", "", fmt.Errorf("apt-get download %s: %v: %s", pkg, err, bytes.TrimSpace(out))
	}
	debs, _ := filepath.Glob(filepath.Join(dl, "*.deb"))
	if len(debs) != 1 {
		return "", "", fmt.Errorf("apt-get download %s left %d packages", pkg, len(debs))
	}
	tmp, err := os.MkdirTemp(filepath.Dir(CacheDir), "hangar-test-kernel-")
	if err != nil {
		return "", "", err
	}
	if out, err := exec.Command("dpkg-deb", "-x", debs[0], tmp).CombinedOutput(); err != nil {
		os.RemoveAll(tmp)
		return "", "", fmt.Errorf("dpkg-deb -x: %v: %s", err, out)
	}
	_ = os.RemoveAll(CacheDir)
	if err := os.Rename(tmp, CacheDir); err != nil {
		return "", "", err
	}
	return findKernel()
}

// wantModules are what the guest loads, with whatever they depend on
// (read from each module's .modinfo): virtio for the NIC, the ACPI button
// and evdev so init sees the power button.
var wantModules = []string{"virtio_pci", "virtio_net", "button", "evdev"}

// moduleOrder returns module files (relative to dir) in load order.
func moduleOrder(dir string, want []string) ([]string, error) {
	index := map[string]string{}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() && strings.HasSuffix(p, ".ko") {
			name := strings.ReplaceAll(strings.TrimSuffix(d.Name(), ".ko"), "-", "_")
			index[name] = p
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	var order []string
	done := map[string]bool{}
	var visit func(name string, depth int) error
	visit = func(name string, depth int) error {
		name = strings.ReplaceAll(name, "-", "_")
		if done[name] || depth > 20 {
			return nil
		}
		done[name] = true
		p, ok := index[name]
		if !ok {
			return nil // built into the kernel
		}
		deps, err := moduleDepends(p)
		if err != nil {
			return err
		}
		for _, d := range deps {
			if err := visit(d, depth+1); err != nil {
				return err
			}
		}
		order = append(order, p)
		return nil
	}
	for _, w := range want {
		if err := visit(w, 0); err != nil {
			return nil, err
		}
	}
	return order, nil
}

// moduleDepends reads "depends=" from a module's .modinfo section.
func moduleDepends(path string) ([]string, error) {
	f, err := elf.Open(path)
	if err != nil {
		return nil, fmt.Errorf("reading module %s: %w", path, err)
	}
	defer f.Close()
	sec := f.Section(".modinfo")
	if sec == nil {
		return nil, nil
	}
	data, err := sec.Data()
	if err != nil {
		return nil, err
	}
	for _, kv := range bytes.Split(data, []byte{0}) {
		if v, ok := bytes.CutPrefix(kv, []byte("depends=")); ok && len(v) > 0 {
			return strings.Split(string(v), ","), nil
		}
	}
	return nil, nil
}

// Init is the guest's /init.
const Init = `#!/bin/busybox sh
/bin/busybox mkdir -p /proc /sys /dev /tmp /etc /sbin /usr/bin /usr/sbin
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for m in $(cat /lib/modules/order); do insmod /lib/modules/$m || echo "HANGAR-INSMOD-FAILED $m"; done
echo "` + MarkerUp + ` boot=$(cat /proc/sys/kernel/random/boot_id)"
echo "` + MarkerDMI + ` vendor=$(cat /sys/class/dmi/id/sys_vendor) product=$(cat /sys/class/dmi/id/product_name) uuid=$(cat /sys/class/dmi/id/product_uuid) serial=$(cat /sys/class/dmi/id/product_serial) asset=$(cat /sys/class/dmi/id/board_asset_tag)"
# The ACPI power button is an input device; any event on it is a press.
sleep 1
for e in /sys/class/input/event*; do
  if grep -q "Power Button" "$e/device/name" 2>/dev/null; then
    (dd if=/dev/input/${e##*/} of=/dev/null bs=24 count=1 2>/dev/null; echo "` + MarkerPoweroff + `"; sync; poweroff -f) &
  fi
done
# Ctrl-Alt-Del reaches init as SIGINT (with 1 here the kernel restarts at once).
echo 0 > /proc/sys/kernel/ctrl-alt-del
trap 'echo "` + MarkerCAD + `"; sleep 1; reboot -f' INT
echo "HANGAR-NET: $(ls /sys/class/net | tr '\n' ' ')"
# Links up: the kernel's IPv6 DAD and router solicitations show on the tap.
for n in $(ls /sys/class/net); do ip link set "$n" up; done
case " $(cat /proc/cmdline) " in *" hangar.poweroff "*) echo "` + MarkerSelfOff + `"; poweroff -f;; esac
last="-"
while true; do
  cur=""
  for b in $(ls /sys/block); do
    s=$(cat /sys/block/$b/device/serial 2>/dev/null | tr -d ' ')
    cur="$cur $b=$s"
  done
  if [ "$cur" != "$last" ]; then echo "` + MarkerBlock + `$cur"; last="$cur"; fi
  sleep 1
done
`

// Initramfs writes a gzip'd newc initramfs with busybox, the init and the
// modules into dir and returns its path.
func Initramfs(t testing.TB, dir, modules string) string {
	t.Helper()
	return InitramfsWith(t, dir, modules, Init, WantModules)
}

// WantModules are the modules Initramfs puts in (with their dependencies).
var WantModules = wantModules

// InitramfsWith is Initramfs with another init script and module list
// (module names; their dependencies come along, in load order, listed in
// /lib/modules/order). The archive is the same bytes for the same inputs,
// so callers may cache what they build from it.
func InitramfsWith(t testing.TB, dir, modules, init string, want []string) string {
	t.Helper()
	bb, err := findBusybox()
	if err != nil {
		t.Skipf("skipping: %v", err)
	}
	w := newCPIO()
	for _, d := range []string{"bin", "lib", "lib/modules", "dev", "proc", "sys"} {
		w.dir(d)
	}
	raw, err := os.ReadFile(bb)
	if err != nil {
		t.Fatal(err)
	}
	w.file("bin/busybox", 0o755, raw)
	w.file("init", 0o755, []byte(init))
	paths, err := moduleOrder(modules, want)
	if err != nil {
		t.Fatal(err)
	}
	var order []string
	for _, p := range paths {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		name := filepath.Base(p)
		w.file("lib/modules/"+name, 0o644, b)
		order = append(order, name)
	}
	w.file("lib/modules/order", 0o644, []byte(strings.Join(order, "\n")+"\n"))
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	if _, err := zw.Write(w.bytes()); err != nil {
		t.Fatal(err)
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, "initramfs.cpio.gz")
	if err := os.WriteFile(p, gz.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func findBusybox() (string, error) {
	// busybox-static: a dynamic busybox would need its libraries too.
	for _, p := range []string{"/bin/busybox", "/usr/bin/busybox"} {
		out, err := exec.Command("file", "-L", p).Output()
		if err == nil && bytes.Contains(out, []byte("statically linked")) {
			return p, nil
		}
		if err != nil {
			if _, serr := os.Stat(p); serr == nil {
				return p, nil // no file(1); busybox-static is what Debian installs as /bin/busybox
			}
		}
	}
	return "", fmt.Errorf("no static busybox (apt-get install busybox-static)")
}

// cpio writes the newc format the kernel unpacks.
type cpio struct {
	buf bytes.Buffer
	ino int
}

func newCPIO() *cpio { return &cpio{ino: 1} }

func (c *cpio) header(name string, mode uint32, size int) {
	c.ino++
	fmt.Fprintf(&c.buf, "070701%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X",
		c.ino, mode, 0, 0, 1, 0, size, 0, 0, 0, 0, len(name)+1, 0)
	c.buf.WriteString(name)
	c.buf.WriteByte(0)
	c.pad()
}

func (c *cpio) pad() {
	for c.buf.Len()%4 != 0 {
		c.buf.WriteByte(0)
	}
}

func (c *cpio) dir(name string) { c.header(name, 0o040755, 0) }

func (c *cpio) file(name string, perm uint32, data []byte) {
	c.header(name, 0o100000|perm, len(data))
	c.buf.Write(data)
	c.pad()
}

func (c *cpio) bytes() []byte {
	c.header("TRAILER!!!", 0, 0)
	return c.buf.Bytes()
}
