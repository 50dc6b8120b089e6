#!/bin/sh
# image/ami.sh: publish hangar's bootc image (Containerfile) as an AMI with
# bootc-image-builder, for Cluster API host pools (image/capi).
#
#   image/ami.sh [--dry-run] [--bucket S3BUCKET] [--region REGION]
#                [--name AMI_NAME] [--image LOCAL_REF]
#
# It builds the container image with podman, then runs bootc-image-builder
# (privileged, with the host's container storage) to convert it to a disk,
# upload it to the S3 bucket and register the AMI. AWS credentials come from
# the environment or ~/.aws, as for the aws CLI; the bucket needs the
# vmimport service role. --dry-run prints the commands and runs nothing.
set -eu
cd "$(dirname "$0")/.."

version=$(git describe --always --dirty 2>/dev/null || echo dev)
dry=
bucket=${HANGAR_AMI_BUCKET:-}
region=${AWS_REGION:-${AWS_DEFAULT_REGION:-us-east-1}}
name=hangar-$version
image=localhost/hangar:$version
# The builder is a tool, like the compiler: take its current release.
builder=${HANGAR_BIB_IMAGE:-quay.io/centos-bootc/bootc-image-builder:latest}
while [ $# -gt 0 ]; do
	case $1 in
	--dry-run) dry=1; shift ;;
	--bucket) bucket=$2; shift 2 ;;
	--region) region=$2; shift 2 ;;
	--name) name=$2; shift 2 ;;
	--image) image=$2; shift 2 ;;
	*) echo "image/ami.sh: unknown argument $1" >&2; exit 2 ;;
	esac
done
if [ -z "$bucket" ]; then
	if [ -n "$dry" ]; then
		bucket='<S3 bucket: --bucket or HANGAR_AMI_BUCKET>'
	else
		echo "image/ami.sh: name the S3 bucket for the upload: --bucket BUCKET or HANGAR_AMI_BUCKET" >&2
		exit 2
	fi
fi

run() {
	# Print each command as a shell would run it; run it unless dry.
	printf '+'
	for a in "$@"; do
		case $a in
		*[!A-Za-z0-9_./:=@,+-]*) printf " '%s'" "$a" ;;
		*) printf ' %s' "$a" ;;
		esac
	done
	printf '\n'
	[ -n "$dry" ] || "$@"
}

if [ -z "$dry" ]; then
	command -v podman >/dev/null || { echo "image/ami.sh: podman is not installed (apt-get install podman)" >&2; exit 1; }
	[ "$(id -u)" = 0 ] || { echo "image/ami.sh: bootc-image-builder needs root (rootful podman)" >&2; exit 1; }
fi

# The starter stage runs mmdebstrap, which mounts /proc in its chroot.
run podman build --pull=newer --tag "$image" --cap-add=SYS_ADMIN --file Containerfile .
run podman run --rm --privileged --pull=newer \
	--security-opt label=type:unconfined_t \
	--volume /var/lib/containers/storage:/var/lib/containers/storage \
	--volume "${HOME:-/root}/.aws:/root/.aws:ro" \
	--env AWS_PROFILE --env AWS_ACCESS_KEY_ID --env AWS_SECRET_ACCESS_KEY --env AWS_SESSION_TOKEN \
	"$builder" \
	--type ami --rootfs xfs \
	--aws-ami-name "$name" --aws-bucket "$bucket" --aws-region "$region" \
	"$image"
[ -n "$dry" ] && echo "(dry run: nothing was built or uploaded)"
exit 0
