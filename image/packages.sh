#!/bin/sh
# packages.sh debian|fedora [LIST]: print the package names of one column of
# image/packages.list, space-separated, skipping "-" (provided by the base).
# The dev disk builder and the Containerfile both call it, so the two images
# cannot install different package lists.
set -eu
col=$1
list=${2:-$(dirname "$0")/packages.list}
case $col in
debian) n=2 ;;
fedora) n=3 ;;
*) echo "packages.sh: unknown distribution $col (debian or fedora)" >&2; exit 2 ;;
esac
awk -v n="$n" '!/^[[:space:]]*(#|$)/ { if (NF != 3) { printf "packages.list line %d: want 3 columns, got %d\n", NR, NF > "/dev/stderr"; bad = 1; exit 2 } if ($n != "-") { printf "%s%s", sep, $n; sep = " " } } END { if (!bad) print "" }' "$list"
