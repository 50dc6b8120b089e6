#!/bin/sh
# install-overlay.sh --root ROOT --bin DIR [--repo DIR] [--starter DIR]: lay
# hangar's files (image/files.list) into an image root and enable its units
# by preset. --starter names the starter AMI's directory
# (image/starter-ami/build.sh --out DIR); without it the image has no
# starter AMI. The dev disk builder and the Containerfile both run it.
set -eu
root= bin= starter= repo=$(cd "$(dirname "$0")/.." && pwd)
while [ $# -gt 0 ]; do
	case $1 in
	--root) root=$2; shift 2 ;;
	--bin) bin=$2; shift 2 ;;
	--repo) repo=$2; shift 2 ;;
	--starter) starter=$2; shift 2 ;;
	*) echo "install-overlay.sh: unknown argument $1" >&2; exit 2 ;;
	esac
done
[ -n "$root" ] && [ -n "$bin" ] || { echo "usage: install-overlay.sh --root ROOT --bin DIR [--repo DIR] [--starter DIR]" >&2; exit 2; }
if [ -n "$starter" ] && [ ! -s "$starter/ami.env" ]; then
	echo "install-overlay.sh: no starter AMI in $starter (image/starter-ami/build.sh --out $starter makes it)" >&2
	exit 1
fi
[ "$root" = / ] && root=

log() { printf 'overlay: %s\n' "$*" >&2; }

n=0
while read -r src dest mode when rest; do
	case $src in '' | '#'*) continue ;; esac
	[ -n "$when" ] && [ -z "$rest" ] || { log "bad line in files.list: $src $dest $mode $when $rest"; exit 1; }
	case $src in
	bin/*) base=$bin pat=${src#bin/} ;;
	starter/*)
		# Only with --starter; the starter AMI's own lines are optional.
		[ -n "$starter" ] || continue
		base=$starter pat=${src#starter/} ;;
	*) base=$repo pat=$src ;;
	esac
	matched=
	for f in "$base"/$pat; do
		[ -e "$f" ] || continue
		matched=1
		case $dest in
		*/) target=$root$dest$(basename "$f") ;;
		*) target=$root$dest ;;
		esac
		if [ "$when" = exec ]; then
			exe=$(sed -n 's/^ExecStart=[-@:+!]*\([^ ]*\).*/\1/p' "$f" | head -n1)
			if [ -n "$exe" ] && [ ! -x "$root$exe" ]; then
				log "leaving out $(basename "$f"): $exe is not built"
				continue
			fi
		fi
		install -D -m "$mode" "$f" "$target"
		n=$((n + 1))
	done
	if [ -z "$matched" ] && [ "$when" != optional ]; then
		log "nothing matches $src (in $base)"
		exit 1
	fi
done <"$repo/image/files.list"

# Enable what the preset names: the target and every hangar service present.
units=$(cd "$root/usr/lib/systemd/system" && grep -l '^\[Install\]' hangar.target hangar-*.service)
# shellcheck disable=SC2086
systemctl --root="${root:-/}" preset $units 2>&1 | sed 's/^/overlay: /' >&2
log "installed $n files; enabled by preset: $(echo $units | tr '\n' ' ')"
