#!/bin/sh
# image/build.sh: build hangar's development disk image, the Debian twin of
# the bootc image (Containerfile). Both install image/packages.list and the
# overlay image/install-overlay.sh lays from image/files.list.
#
#   image/build.sh [--bin DIR] [--out DIR] [--starter DIR]
#
# Stages, each reusing what did not change:
#   0. starter image/starter-ami/out (or --starter DIR): the starter AMI, a
#              Debian 12 cloud disk and its ami.env, built by
#              image/starter-ami/build.sh with its own cache (minutes the
#              first time, nothing when up to date). The image carries it in
#              /usr/share/hangar/starter/ and the gateway imports it as the
#              AMI hangar/debian-12-x86_64 when STARTER_AMI=yes (the
#              default). HANGAR_STARTER_AMI=no leaves it out (first boot's
#              readiness report then says so).
#   1. base    OUT/cache/base-KEY.tar: Debian 12 with the packages, built by
#              mmdebstrap from this machine's apt sources. KEY hashes the
#              package list, the sources and this recipe, so it is rebuilt
#              only when one of those changes (about 2-3 minutes).
#   2. rootfs  OUT/rootfs: the base unpacked afresh, the hangar overlay
#              (binaries from --bin, units, policy, config) and the dev-image
#              settings applied. systemd-nspawn boots this tree.
#   3. disk    OUT/disk.raw: GPT with an EFI system partition (systemd-boot,
#              the kernel and initrd) and an ext4 root made with mkfs.ext4 -d.
#              No loop devices, no mounts. QEMU boots this disk.
#
# It needs root (mmdebstrap --mode=root and mkfs.ext4 -d keep file owners)
# and mmdebstrap, e2fsprogs, dosfstools, mtools, fdisk (make image-deps).
set -eu

here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
bin=$repo/bin
out=$here/out
starter=$here/starter-ami/out
base_only=
while [ $# -gt 0 ]; do
	case $1 in
	--bin) bin=$2; shift 2 ;;
	--out) out=$2; shift 2 ;;
	--starter) starter=$2; shift 2 ;;
	--base-only) base_only=1; shift ;;
	*) echo "image/build.sh: unknown argument $1" >&2; exit 2 ;;
	esac
done

# Sizes of the disk: the root filesystem is sparse, so its size costs only
# what the files use. The guest's hangar state lives on it: about 0.6 GiB of
# system, the starter disk (0.45 GiB of data in a 2 GiB sparse file), its
# import into ebsd's block store (as much again), and what instances write
# to their root volumes (up to the AMI's 2 GiB each). 6 GiB leaves room for
# a couple of instances; a metal host keeps /var/lib/hangar on its own disk.
ROOT_MB=${HANGAR_ROOT_MB:-6144}
ESP_MB=128
SUITE=bookworm
# Bump when the base recipe below changes in a way the key cannot see.
RECIPE=3

log() { printf 'image: %s\n' "$*" >&2; }
die() { printf 'image/build.sh: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "needs root (mmdebstrap --mode=root, mkfs.ext4 -d keeping owners); run make as root"
for tool in mmdebstrap mkfs.ext4 mkfs.vfat mcopy mmd sfdisk; do
	command -v "$tool" >/dev/null 2>&1 || die "$tool is missing; run 'make image-deps' (as root)"
done
[ -n "$base_only" ] || [ -d "$bin" ] || die "no binaries in $bin; run make build first"

# The machine's own apt sources when it is Debian (so a local mirror or
# snapshot is honoured); mmdebstrap's default Debian mirror otherwise.
# HANGAR_APT_SOURCES overrides.
sources=${HANGAR_APT_SOURCES:-}
if [ -z "$sources" ] && grep -qs '^ID=debian' /etc/os-release; then
	for f in /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list; do
		if [ -s "$f" ] && grep -qs "$SUITE" "$f"; then sources=$f; break; fi
	done
fi

mkdir -p "$out/cache"
# One build at a time, and none while a boot test reads the image (the
# tests hold this lock shared): several people may share a working tree.
exec 9>"$out/.lock"
if ! flock -n 9; then
	log "waiting for another build or boot test using $out"
	flock 9
fi
packages=$("$here/packages.sh" debian)

# ---- 0. starter AMI ---------------------------------------------------------
if [ -n "$base_only" ] || [ "${HANGAR_STARTER_AMI:-yes}" = no ]; then
	starter=
	[ -n "$base_only" ] || log "starter AMI: left out (HANGAR_STARTER_AMI=no)"
else
	"$here/starter-ami/build.sh" --out "$starter" || die "building the starter AMI failed"
	[ -s "$starter/ami.env" ] || die "no ami.env in $starter"
fi

# ---- 1. base --------------------------------------------------------------
key=$( {
	echo "recipe $RECIPE suite $SUITE"
	echo "$packages"
	[ -n "$sources" ] && cat "$sources"
} | sha256sum | cut -c1-16)
base=$out/cache/base-$key.tar
if [ -s "$base" ]; then
	log "base: reusing $base"
else
	log "base: building Debian $SUITE with $(echo "$packages" | wc -w) packages (a few minutes)"
	started=$(date +%s)
	# Recommends stay out (QEMU would pull a GUI); documentation and
	# translations are not installed, copyright files are.
	set -- mmdebstrap --mode=root --variant=apt --quiet \
		--aptopt='APT::Install-Recommends "false"' \
		--dpkgopt='path-exclude=/usr/share/man/*' \
		--dpkgopt='path-exclude=/usr/share/doc/*' \
		--dpkgopt='path-include=/usr/share/doc/*/copyright' \
		--dpkgopt='path-exclude=/usr/share/locale/*' \
		--dpkgopt='path-exclude=/usr/share/info/*' \
		--include="$(echo "$packages" | tr ' ' ',')" \
		--format=tar "$SUITE" "$base.tmp"
	[ -n "$sources" ] && set -- "$@" "$sources"
	"$@" || die "mmdebstrap failed"
	mv "$base.tmp" "$base"
	# Older bases are dead weight once the key moved on.
	find "$out/cache" -name 'base-*.tar' ! -name "base-$key.tar" -delete
	log "base: built in $(( $(date +%s) - started ))s: $(du -h "$base" | cut -f1)"
fi

[ -z "$base_only" ] || exit 0

# Stages 2 and 3 take half a minute (most of it copying the starter disk
# into the root file system); skip both when nothing that goes into the
# image changed: the base, the starter AMI, the binaries, and every file
# of the repository the overlay or this script reads.
inputs=$( {
	echo "recipe $RECIPE base $key root $ROOT_MB esp $ESP_MB"
	[ -n "$starter" ] && grep '^key=' "$starter/ami.env"
	find "$bin" "$repo/units" "$repo/docs" "$here/files.list" "$here/install-overlay.sh" "$here/build.sh" \
		"$here/host.conf.defaults" "$here/host.conf.example" "$here/cloud" "$here/network" -type f 2>/dev/null |
		LC_ALL=C sort | xargs sha256sum
} | sha256sum | cut -c1-16)
if grep -qs "^inputs=$inputs\$" "$out/image.env" && [ -d "$out/rootfs" ] && [ -s "$out/disk.raw" ]; then
	log "up to date: $out/disk.raw (nothing that goes into it changed)"
	exit 0
fi

# ---- 2. rootfs ------------------------------------------------------------
# Unpacked afresh each time: cheap (seconds) and nothing stale survives.
root=$out/rootfs
rm -rf "$root" "$root.tmp"
mkdir -p "$root.tmp"
tar -C "$root.tmp" -xf "$base"
"$here/install-overlay.sh" --root "$root.tmp" --bin "$bin" --repo "$repo" ${starter:+--starter "$starter"}

# Dev-image settings (the AMI gets these from cloud-init and its own base):
# root logs in on the serial console without a password, the root file
# system is found by label, networkd does DHCP, and /etc/machine-id is made
# at first boot.
chroot "$root.tmp" passwd -dq root
# No fstab: the kernel command line mounts the root read-write by label,
# and the same tree boots under systemd-nspawn, where a root entry would
# fail systemd-remount-fs and leave the system "degraded".
: >"$root.tmp/etc/fstab"
echo hangar >"$root.tmp/etc/hostname"
printf '127.0.0.1 localhost\n127.0.1.1 hangar\n::1 localhost ip6-localhost ip6-loopback\n' >"$root.tmp/etc/hosts"
: >"$root.tmp/etc/machine-id"
rm -f "$root.tmp/var/lib/dbus/machine-id"
systemctl --root="$root.tmp" enable systemd-networkd.service >/dev/null 2>&1
# No background apt runs on a host that is rebuilt, not upgraded.
systemctl --root="$root.tmp" mask apt-daily.timer apt-daily-upgrade.timer >/dev/null 2>&1
systemd-sysusers --root="$root.tmp" >/dev/null 2>&1
mv "$root.tmp" "$root"

# ---- 3. disk --------------------------------------------------------------
started=$(date +%s)
kernel=$(ls "$root"/boot/vmlinuz-* | sort -V | tail -n1)
initrd=$root/boot/initrd.img-${kernel#*/boot/vmlinuz-}
[ -f "$kernel" ] && [ -f "$initrd" ] || die "no kernel or initrd in the base's /boot"
cp "$kernel" "$out/vmlinuz"
cp "$initrd" "$out/initrd.img"
cmdline="root=LABEL=hangar-root rw console=tty0 console=ttyS0,115200"
echo "$cmdline" >"$out/cmdline"

esp=$out/esp.img
rm -f "$esp"
truncate -s "${ESP_MB}M" "$esp"
mkfs.vfat -F 32 -n HANGAR-ESP "$esp" >/dev/null
export MTOOLS_SKIP_CHECK=1
mmd -i "$esp" ::/EFI ::/EFI/BOOT ::/loader ::/loader/entries ::/hangar
mcopy -i "$esp" "$root/usr/lib/systemd/boot/efi/systemd-bootx64.efi" ::/EFI/BOOT/BOOTX64.EFI
mcopy -i "$esp" "$kernel" ::/hangar/vmlinuz
mcopy -i "$esp" "$initrd" ::/hangar/initrd.img
tmp=$(mktemp -d)
printf 'default hangar.conf\ntimeout 0\nconsole-mode keep\n' >"$tmp/loader.conf"
printf 'title hangar\nlinux /hangar/vmlinuz\ninitrd /hangar/initrd.img\noptions %s\n' "$cmdline" >"$tmp/hangar.conf"
mcopy -i "$esp" "$tmp/loader.conf" ::/loader/loader.conf
mcopy -i "$esp" "$tmp/hangar.conf" ::/loader/entries/hangar.conf
rm -rf "$tmp"

rootimg=$out/root.img
rm -f "$rootimg"
mkfs.ext4 -q -F -L hangar-root -d "$root" "$rootimg" "${ROOT_MB}M"

# GPT: 1 MiB gap, the ESP, the root (x86-64 root type, so a
# systemd-gpt-auto-generator finds it too), 1 MiB for the backup table.
disk=$out/disk.raw
rm -f "$disk.tmp"
truncate -s $(( (1 + ESP_MB + ROOT_MB + 1) * 1024 * 1024 )) "$disk.tmp"
sfdisk --quiet "$disk.tmp" <<EOF
label: gpt
start=2048, size=$(( ESP_MB * 2048 )), type=C12A7328-F81F-11D2-BA4B-00A0C93EC93B, name=esp
start=$(( 2048 + ESP_MB * 2048 )), size=$(( ROOT_MB * 2048 )), type=4F68BCE3-E8CD-4DB1-96E7-FBCAF984B709, name=hangar-root
EOF
dd if="$esp" of="$disk.tmp" bs=1M seek=1 conv=notrunc,sparse status=none
dd if="$rootimg" of="$disk.tmp" bs=1M seek=$(( 1 + ESP_MB )) conv=notrunc,sparse status=none
rm -f "$esp" "$rootimg"
mv "$disk.tmp" "$disk"

# What make run and tests/image read: where the pieces are and how big.
{
	echo "inputs=$inputs"
	echo "base=$base"
	echo "rootfs=$root"
	echo "disk=$disk"
	echo "kernel=$out/vmlinuz"
	echo "initrd=$out/initrd.img"
	echo "cmdline=$cmdline"
	echo "starter_ami=${starter:+/usr/share/hangar/starter/ami.env}"
	echo "rootfs_bytes=$(du -sB1 "$root" | cut -f1)"
	echo "disk_bytes_used=$(du -B1 "$disk" | cut -f1)"
	echo "disk_bytes=$(stat -c %s "$disk")"
} >"$out/image.env"
log "disk: $disk in $(( $(date +%s) - started ))s ($(du -h "$disk" | cut -f1) used of $(du -h --apparent-size "$disk" | cut -f1)); rootfs $(du -sh "$root" | cut -f1)"
