#!/bin/sh
# image/starter-ami/build.sh: build hangar's starter AMI, a small Debian 12
# cloud disk (cloud-init with the EC2 datasource, openssh-server, the cloud
# kernel), from Debian packages, without loop devices or mounts.
#
#   image/starter-ami/build.sh [--out DIR]
#
# Writes DIR/debian-12-x86_64.raw (sparse; 2 GiB apparent) and DIR/ami.env,
# which says how to register it: boot mode uefi (systemd-boot on the ESP),
# architecture x86_64, root device /dev/xvda, and the disk by its file name
# (found next to ami.env, wherever an image puts the two). The Debian tree is cached by
# package list and sources in DIR/cache, so a rebuild takes seconds.
# First boot of a hangar host imports the disk through ebsd as the AMI
# hangar/debian-12-x86_64.
#
# Needs root (mmdebstrap --mode=root, mkfs.ext4 -d keeping owners) and
# mmdebstrap, e2fsprogs, dosfstools, mtools, fdisk.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
out=$here/out
while [ $# -gt 0 ]; do
	case $1 in
	--out) out=$2; shift 2 ;;
	*) echo "starter-ami/build.sh: unknown argument $1" >&2; exit 2 ;;
	esac
done

SUITE=bookworm
DISK_MB=2048
ESP_MB=64
LABEL=debian-root
# Bump when the recipe below changes in a way the cache key cannot see.
RECIPE=1

log() { printf 'starter-ami: %s\n' "$*" >&2; }
die() { printf 'starter-ami/build.sh: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "needs root (mmdebstrap --mode=root, mkfs.ext4 -d keeping owners)"
for tool in mmdebstrap mkfs.ext4 mkfs.vfat mcopy mmd sfdisk; do
	command -v "$tool" >/dev/null 2>&1 || die "$tool is missing (apt-get install mmdebstrap e2fsprogs dosfstools mtools fdisk)"
done

# This machine's apt sources when it is Debian (a local mirror or snapshot
# is honoured); mmdebstrap's default mirror otherwise.
sources=${HANGAR_APT_SOURCES:-}
if [ -z "$sources" ] && grep -qs '^ID=debian' /etc/os-release; then
	for f in /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list; do
		if [ -s "$f" ] && grep -qs "$SUITE" "$f"; then sources=$f; break; fi
	done
fi

packages=$(grep -v '^#' "$here/packages.list" | tr -s ' \n' ' ' | sed 's/^ //; s/ $//')
mkdir -p "$out/cache"
# One build at a time: the image build, make bench and a developer may all
# ask for the disk at once; the second waits and then finds it up to date.
exec 8>"$out/.lock"
if ! flock -n 8; then
	log "waiting for another build of $out"
	flock 8
fi
# The tree is keyed by what goes into it; the disk also by this script and
# the cloud-init settings, which are laid onto the tree at disk time.
treekey=$( {
	echo "recipe $RECIPE suite $SUITE"
	echo "$packages"
	[ -n "$sources" ] && cat "$sources"
} | sha256sum | cut -c1-16)
key=$( { echo "$treekey"; cat "$here/90-hangar-ec2.cfg" "$here/build.sh"; } | sha256sum | cut -c1-16)
disk=$out/debian-12-x86_64.raw
if [ -s "$out/ami.env" ] && grep -qs "^key=$key\$" "$out/ami.env" && [ -s "$disk" ]; then
	log "up to date: $disk"
	exit 0
fi

# ---- the Debian tree --------------------------------------------------------
tree=$out/cache/tree-$treekey.tar
if [ ! -s "$tree" ]; then
	log "building Debian $SUITE with: $packages"
	started=$(date +%s)
	# The customize hooks make it an AMI rather than a machine: no SSH host
	# keys, no machine-id, no root password (cloud-init makes keys and the
	# user per instance), a serial console on ttyS0 like EC2's, and the root
	# found by label.
	set -- mmdebstrap --mode=root --variant=apt --quiet \
		--aptopt='APT::Install-Recommends "false"' \
		--dpkgopt='path-exclude=/usr/share/man/*' \
		--dpkgopt='path-exclude=/usr/share/doc/*' \
		--dpkgopt='path-include=/usr/share/doc/*/copyright' \
		--dpkgopt='path-exclude=/usr/share/locale/*' \
		--include="$(echo "$packages" | tr ' ' ',')" \
		--customize-hook='rm -f "$1"/etc/ssh/ssh_host_*' \
		--customize-hook=': > "$1/etc/machine-id"; rm -f "$1/var/lib/dbus/machine-id"' \
		--customize-hook="printf 'LABEL=$LABEL / ext4 rw,discard,errors=remount-ro 0 1\n' > \"\$1/etc/fstab\"" \
		--customize-hook='printf "auto lo\niface lo inet loopback\n\nsource /etc/network/interfaces.d/*\n" > "$1/etc/network/interfaces"' \
		--customize-hook='echo localhost > "$1/etc/hostname"' \
		--customize-hook='chroot "$1" apt-get clean' \
		--customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/log/*.log' \
		--format=tar "$SUITE" "$tree.tmp"
	[ -n "$sources" ] && set -- "$@" "$sources"
	"$@" || die "mmdebstrap failed"
	mv "$tree.tmp" "$tree"
	find "$out/cache" -name 'tree-*.tar' ! -name "tree-$treekey.tar" -delete
	log "tree built in $(( $(date +%s) - started ))s: $(du -h "$tree" | cut -f1)"
fi

# ---- the disk -----------------------------------------------------------------
started=$(date +%s)
work=$(mktemp -d "$out/work.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir "$work/root"
tar -C "$work/root" -xf "$tree"
cp "$here/90-hangar-ec2.cfg" "$work/root/etc/cloud/cloud.cfg.d/90-hangar-ec2.cfg"
kernel=$(ls "$work/root"/boot/vmlinuz-* | sort -V | tail -n1)
initrd=$work/root/boot/initrd.img-${kernel#*/boot/vmlinuz-}
[ -f "$kernel" ] && [ -f "$initrd" ] || die "no kernel or initrd in the tree's /boot"
# EC2 shows the serial console; tty0 is there for a VGA console.
cmdline="root=LABEL=$LABEL ro console=tty0 console=ttyS0,115200 earlyprintk=ttyS0,115200"

# ESP with systemd-boot. The kernel and initrd sit on the ESP, so an
# updated kernel package in the guest needs `kernel-install` (or a new AMI).
esp=$work/esp.img
truncate -s "${ESP_MB}M" "$esp"
mkfs.vfat -F 32 -n EFI "$esp" >/dev/null
export MTOOLS_SKIP_CHECK=1
mmd -i "$esp" ::/EFI ::/EFI/BOOT ::/loader ::/loader/entries ::/debian
mcopy -i "$esp" "$work/root/usr/lib/systemd/boot/efi/systemd-bootx64.efi" ::/EFI/BOOT/BOOTX64.EFI
mcopy -i "$esp" "$kernel" ::/debian/vmlinuz
mcopy -i "$esp" "$initrd" ::/debian/initrd.img
printf 'default debian.conf\ntimeout 0\nconsole-mode keep\n' >"$work/loader.conf"
printf 'title Debian GNU/Linux 12 (hangar starter AMI)\nlinux /debian/vmlinuz\ninitrd /debian/initrd.img\noptions %s\n' "$cmdline" >"$work/debian.conf"
mcopy -i "$esp" "$work/loader.conf" ::/loader/loader.conf
mcopy -i "$esp" "$work/debian.conf" ::/loader/entries/debian.conf

root_mb=$(( DISK_MB - ESP_MB - 2 ))
truncate -s "${root_mb}M" "$work/root.img"
mkfs.ext4 -q -F -L "$LABEL" -d "$work/root" "$work/root.img"

# GPT: the ESP, then the root (x86-64 root type) to the end, so growpart
# can extend it into a larger volume.
rm -f "$disk.tmp"
truncate -s "${DISK_MB}M" "$disk.tmp"
sfdisk --quiet "$disk.tmp" <<PARTS
label: gpt
start=2048, size=$(( ESP_MB * 2048 )), type=C12A7328-F81F-11D2-BA4B-00A0C93EC93B, name=EFI
start=$(( 2048 + ESP_MB * 2048 )), size=$(( root_mb * 2048 )), type=4F68BCE3-E8CD-4DB1-96E7-FBCAF984B709, name=$LABEL
PARTS
dd if="$esp" of="$disk.tmp" bs=1M seek=1 conv=notrunc,sparse status=none
dd if="$work/root.img" of="$disk.tmp" bs=1M seek=$(( 1 + ESP_MB )) conv=notrunc,sparse status=none
mv "$disk.tmp" "$disk"

{
	echo "key=$key"
	echo "name=hangar/debian-12-x86_64"
	echo "description=Debian 12 (bookworm) with cloud-init, built by hangar"
	echo "disk=$(basename "$disk")"
	echo "boot_mode=uefi"
	echo "architecture=x86_64"
	echo "root_device_name=/dev/xvda"
	echo "default_user=admin"
	echo "disk_bytes=$(stat -c %s "$disk")"
	echo "disk_bytes_used=$(du -B1 "$disk" | cut -f1)"
	echo "kernel=$(basename "$kernel")"
} >"$out/ami.env"
log "disk: $disk in $(( $(date +%s) - started ))s ($(du -h "$disk" | cut -f1) used of $(du -h --apparent-size "$disk" | cut -f1))"
