// Package testami builds the tiny AMI the end-to-end tests import and
// boot: a raw GPT disk whose only partition is an EFI system partition with
// systemd-boot (as EFI/BOOT/BOOTX64.EFI), the Debian cloud kernel and a
// busybox initramfs. Its init behaves like a minimal cloud image: it takes
// a DHCP lease on the first NIC, reads its instance id and user data from
// IMDSv2, runs user data that starts with "#!", serves a line on a TCP port
// (for security group checks), powers off on the ACPI power button and
// reboots on Ctrl-Alt-Del, printing a marker on the serial console at each
// step.
//
// The disk is built without loop devices or mounts (mkfs.vfat on an image
// file, mtools, sfdisk, dd conv=notrunc) and cached under the temp dir,
// keyed by everything it is made of. It is test support only.
package testami

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"hangar.dev/hangar/services/vmd/testguest"
)

// Console markers the init prints.
const (
	MarkerUp       = "HANGAR-AMI-UP"       // init started
	MarkerLease    = "HANGAR-AMI-LEASE"    // "HANGAR-AMI-LEASE ip=10.0.1.5 router=10.0.1.1"
	MarkerNoLease  = "HANGAR-AMI-NO-LEASE" // udhcpc gave up
	MarkerIMDS     = "HANGAR-AMI-IMDS"     // "HANGAR-AMI-IMDS instance-id=i-…"
	MarkerUserData = "HANGAR-AMI-USERDATA" // "HANGAR-AMI-USERDATA <base64 of the user data>"
	MarkerListen   = "HANGAR-AMI-LISTEN"   // the TCP port answers from now on
	MarkerPoweroff = "HANGAR-AMI-POWEROFF" // the power button was pressed
	MarkerReboot   = "HANGAR-AMI-REBOOT"   // Ctrl-Alt-Del
	Pong           = "HANGAR-AMI-PONG"     // what the TCP port answers, followed by the instance id
	ListenPort     = 8080                  // the TCP port
	Size           = 1 << 30               // the disk (and snapshot) size: 1 GiB
	BlockSize      = 512 << 10             // EBS direct API block size
	espStart       = 1 << 20               // the ESP starts at 1 MiB
	espSize        = 40 << 20              // and holds the kernel, initrd and systemd-boot
	builderVersion = "3"                   // bump when the layout below changes
	systemdBoot    = "/usr/lib/systemd/boot/efi/systemd-bootx64.efi"
	kernelCmdline  = "console=ttyS0 panic=-1 loglevel=4 rdinit=/init"
)

// Init is the guest's /init.
const Init = `#!/bin/busybox sh
/bin/busybox mkdir -p /proc /sys /dev /tmp /etc /run
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for m in $(cat /lib/modules/order); do insmod /lib/modules/$m || echo "HANGAR-AMI-INSMOD-FAILED $m"; done
echo "` + MarkerUp + ` boot=$(cat /proc/sys/kernel/random/boot_id)"
# The ACPI power button is an input device; any event on it is a press.
sleep 1
for e in /sys/class/input/event*; do
  if grep -q "Power Button" "$e/device/name" 2>/dev/null; then
    (dd if=/dev/input/${e##*/} of=/dev/null bs=24 count=1 2>/dev/null; echo "` + MarkerPoweroff + `"; sync; poweroff -f) &
  fi
done
# Ctrl-Alt-Del reaches init as SIGINT (with 1 here the kernel restarts at once).
echo 0 > /proc/sys/kernel/ctrl-alt-del
# (reboot -f does not wait for the console: give the marker a moment)
trap 'echo "` + MarkerReboot + `"; sleep 1; reboot -f' INT
ip link set lo up
nic=$(ls /sys/class/net | grep -v '^lo$' | head -n 1)
cat > /etc/udhcpc.script <<'EOF'
#!/bin/sh
case "$1" in
bound|renew)
  ip addr flush dev "$interface"
  ip addr add "$ip/$mask" dev "$interface"
  ip route add default via "$router" dev "$interface"
  echo "` + MarkerLease + ` ip=$ip router=$router mask=$mask dns=$dns hostname=$hostname" > /dev/console
  ;;
esac
EOF
chmod +x /etc/udhcpc.script
ip link set "$nic" up
udhcpc -i "$nic" -s /etc/udhcpc.script -q -f -n -t 30 -T 2 >/dev/null 2>&1 || echo "` + MarkerNoLease + `"
# IMDSv2 with nc (busybox wget crashes in these guests): HTTP/1.0, so the
# server closes and nc ends.
imds() {
  { printf '%s %s HTTP/1.0\r\nHost: 169.254.169.254\r\n' "$1" "$2"; printf '%s\r\n' "$3"; printf '\r\n'; } |
    nc -w 5 169.254.169.254 80 | tr -d '\r' | sed '1,/^$/d'
}
tok=$(imds PUT /latest/api/token "X-aws-ec2-metadata-token-ttl-seconds: 300")
iid=$(imds GET /latest/meta-data/instance-id "X-aws-ec2-metadata-token: $tok")
echo "` + MarkerIMDS + ` instance-id=$iid"
imds GET /latest/user-data "X-aws-ec2-metadata-token: $tok" > /tmp/user-data
echo "` + MarkerUserData + ` $(base64 /tmp/user-data | tr -d '\n')"
(while true; do echo "` + Pong + ` $iid" | nc -l -p ` + "8080" + ` >/dev/null 2>&1; done) &
echo "` + MarkerListen + ` port=8080"
if [ "$(head -c 2 /tmp/user-data)" = '#!' ]; then
  chmod +x /tmp/user-data
  /tmp/user-data > /dev/console 2>&1 &
fi
while true; do sleep 1; done
`

// modules the init loads (with their dependencies): virtio for the NIC,
// the ACPI button and evdev for the power button.
var modules = []string{"virtio_pci", "virtio_net", "button", "evdev"}

// Disk returns the path of the AMI's raw disk (Size bytes, sparse),
// building it when the cache has none for these inputs. It skips the test
// with one line when a tool or file it needs is missing.
func Disk(t testing.TB) string {
	t.Helper()
	for _, p := range []string{"mkfs.vfat", "mmd", "mcopy", "sfdisk"} {
		if _, err := exec.LookPath(p); err != nil {
			t.Skipf("skipping: %s is not installed (apt-get install dosfstools mtools fdisk)", p)
		}
	}
	if _, err := os.Stat(systemdBoot); err != nil {
		t.Skipf("skipping: %s is missing (apt-get install systemd-boot-efi)", systemdBoot)
	}
	kernel, mods := testguest.Kernel(t)
	work := t.TempDir()
	initrd := testguest.InitramfsWith(t, work, mods, Init, modules)
	entry := "title hangar test AMI\nlinux /vmlinuz\ninitrd /initrd.img\noptions " + kernelCmdline + "\n"
	loader := "default hangar.conf\ntimeout 0\n"

	h := sha256.New()
	fmt.Fprintf(h, "testami %s\n%s\n%s\n", builderVersion, entry, loader)
	for _, f := range []string{kernel, initrd, systemdBoot} {
		if err := hashFile(h, f); err != nil {
			t.Fatal(err)
		}
	}
	key := hex.EncodeToString(h.Sum(nil))[:16]
	cache := filepath.Join(os.TempDir(), "hangar-testami")
	disk := filepath.Join(cache, key+".raw")
	if fi, err := os.Stat(disk); err == nil && fi.Size() == Size {
		return disk
	}
	if err := os.MkdirAll(cache, 0o755); err != nil {
		t.Fatal(err)
	}

	esp := filepath.Join(work, "esp.img")
	if err := os.WriteFile(esp, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(esp, espSize); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(work, "loader.conf"), []byte(loader), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(work, "hangar.conf"), []byte(entry), 0o644); err != nil {
		t.Fatal(err)
	}
	tmp := filepath.Join(cache, fmt.Sprintf("%s.%d.tmp", key, os.Getpid()))
	defer os.Remove(tmp)
	run(t, "mkfs.vfat", "-n", "ESP", esp)
	run(t, "mmd", "-i", esp, "::EFI", "::EFI/BOOT", "::loader", "::loader/entries")
	run(t, "mcopy", "-i", esp, systemdBoot, "::EFI/BOOT/BOOTX64.EFI")
	run(t, "mcopy", "-i", esp, kernel, "::vmlinuz")
	run(t, "mcopy", "-i", esp, initrd, "::initrd.img")
	run(t, "mcopy", "-i", esp, filepath.Join(work, "loader.conf"), "::loader/loader.conf")
	run(t, "mcopy", "-i", esp, filepath.Join(work, "hangar.conf"), "::loader/entries/hangar.conf")

	if err := os.WriteFile(tmp, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(tmp, Size); err != nil {
		t.Fatal(err)
	}
	layout := fmt.Sprintf("label: gpt\nstart=%d, size=%d, type=C12A7328-F81F-11D2-BA4B-00A0C93EC93B, name=\"EFI System\"\n", espStart/512, espSize/512)
	cmd := exec.Command("sfdisk", "--quiet", "--no-reread", "--no-tell-kernel", tmp)
	cmd.Stdin = strings.NewReader(layout)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("sfdisk: %v: %s", err, out)
	}
	run(t, "dd", "if="+esp, "of="+tmp, "bs=1M", fmt.Sprintf("seek=%d", espStart>>20), "conv=notrunc,sparse", "status=none")
	if err := os.Rename(tmp, disk); err != nil {
		t.Fatal(err)
	}
	return disk
}

func hashFile(w io.Writer, path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	_, err = io.Copy(w, f)
	return err
}

func run(t testing.TB, name string, args ...string) {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Env = append(os.Environ(), "MTOOLS_SKIP_CHECK=1")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%s %s: %v: %s", name, strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
}

// Blocks returns the indexes of the disk's 512 KiB blocks that hold
// anything but zeros: the ones an import sends.
func Blocks(t testing.TB, disk string) []int {
	t.Helper()
	f, err := os.Open(disk)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []int
	buf := make([]byte, BlockSize)
	zero := make([]byte, BlockSize)
	for i := 0; i < Size/BlockSize; i++ {
		if _, err := f.ReadAt(buf, int64(i)*BlockSize); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(buf, zero) {
			out = append(out, i)
		}
	}
	return out
}
