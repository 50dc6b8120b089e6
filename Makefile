# hangar: build, test, run.
#
#   make run     boot a hangar host and print the aws command to try
#   make test    install test prerequisites (as root), build, run every test
#   make bench   long measurements, reported as tables

GO      ?= go
BIN     ?= bin
VERSION := $(shell git describe --always --dirty 2>/dev/null || echo dev)
LDFLAGS := -X hangar.dev/hangar/services/internal/version.Version=$(VERSION)
export PATH := $(PATH):/usr/local/go/bin

# Binaries: name=package. Every service is hangar-<name>; the CLI is hangar.
PROGRAMS := \
	hangar=./services/hangarctl \
	hangar-firstboot=./services/firstboot \
	hangar-gateway=./services/gateway \
	hangar-netd=./services/netd \
	hangar-ebsd=./services/ebsd \
	hangar-vmd=./services/vmd

# Debian packages the tests drive for real (aws CLI, D-Bus, QEMU, …).
TEST_DEBS := awscli dbus-daemon dbus-bin qemu-utils openssh-client openssl putty-tools iproute2 nftables udhcpc dnsutils curl

.PHONY: all build test vet unit fuzz bench run deps clean generate image test-image dev image-ami

all: build

build:
	@mkdir -p $(BIN)
	@for p in $(PROGRAMS); do \
		name=$${p%%=*}; pkg=$${p#*=}; \
		$(GO) build -trimpath -ldflags "$(LDFLAGS)" -o $(BIN)/$$name $$pkg || exit 1; \
	done

# deps installs what the tests need, only what is missing, and only as root;
# without root it names what is missing (the tests that need it then skip
# with a line saying so).
deps:
	@missing=""; for p in $(TEST_DEBS); do \
		dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q 'install ok installed' || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ]; then \
			echo "make deps: installing$$missing"; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null || exit 1; \
		else \
			echo "make deps: missing Debian packages (run make as root to install):$$missing"; \
		fi; \
	fi

vet:
	@test -z "$$(gofmt -l services tests 2>/dev/null)" || { echo "gofmt needed:"; gofmt -l services tests; exit 1; }
	$(GO) vet ./...

unit:
	$(GO) test -count=1 -short ./...

test: deps build vet test-image
	HANGAR_BIN_DIR=$(CURDIR)/$(BIN) HANGAR_IMAGE_DIR=$(IMAGE_OUT) $(GO) test -count=1 -timeout 45m ./...
	$(MAKE) -s fuzz FUZZTIME=10s

# Each fuzz target runs briefly in make test; longer with FUZZTIME=5m.
FUZZTIME ?= 10s
FUZZ_TARGETS := \
	./services/gateway/sigv4:FuzzVerify \
	./services/gateway/awsproto:FuzzDecodeQuery \
	./services/gateway/iam:FuzzParsePolicy \
	./services/vmd/core:FuzzQEMUArgs \
	./services/ebsd/internal/blockstore:FuzzPackRecovery

fuzz:
	@for t in $(FUZZ_TARGETS); do \
		pkg=$${t%%:*}; name=$${t#*:}; \
		echo "fuzz $$name ($(FUZZTIME))"; \
		$(GO) test -run '^$$' -fuzz "^$$name\$$" -fuzztime $(FUZZTIME) $$pkg || exit 1; \
	done

bench: build
	HANGAR_BIN_DIR=$(CURDIR)/$(BIN) HANGAR_BENCH=1 $(GO) test -count=1 -timeout 60m -run '^TestBench' -v ./tests/bench/ ./services/vmd/ ./services/netd/ ./services/gateway/ec2/ ./services/ebsd/internal/engine/ | grep -v '^=== RUN'

# The image (docs/image.md): a Debian 12 disk with hangar's overlay, built by
# image/build.sh from static binaries of every program in PROGRAMS. The base
# is cached by package list, so a second build takes seconds. make test
# builds it once for the boot tests in tests/image (which skip without it).
IMAGE_OUT ?= $(CURDIR)/image/out
IMAGE_DEBS := mmdebstrap qemu-system-x86 ovmf systemd-container e2fsprogs dosfstools mtools fdisk
TEST_DEBS += $(IMAGE_DEBS)
# vmd's guest tests: QEMU with its firmware, a static busybox for the test
# initramfs, ip(8) for taps, qemu-nbd for hot-plugged disks.
TEST_DEBS += qemu-system-x86 qemu-utils seabios ovmf busybox-static iproute2
# tests/instances_test.go's UEFI test AMI: systemd-boot on an ESP made with
# dosfstools and mtools, partitioned with sfdisk.
TEST_DEBS += systemd-boot-efi dosfstools mtools fdisk

image:
	@CGO_ENABLED=0 $(MAKE) -s build BIN=$(IMAGE_OUT)/bin
	image/build.sh --bin $(IMAGE_OUT)/bin --out $(IMAGE_OUT)

test-image:
	@if [ "$$(id -u)" = 0 ]; then $(MAKE) -s image; \
	else echo "make test: not root, so no image is built; the boot tests in tests/image skip"; fi

# run: boot the image in QEMU with the API on 127.0.0.1:4566 (image/run).
RUN_DIR ?= $(CURDIR)/.hangar-run
run: image
	@$(GO) build -o $(IMAGE_OUT)/hangar-run ./image/run
	$(IMAGE_OUT)/hangar-run --image $(IMAGE_OUT) --state-dir $(RUN_DIR) --listen 127.0.0.1:4566

# dev: a host without the image or systemd (hangar dev), on 127.0.0.1:4566.
DEV_DIR ?= $(CURDIR)/.hangar-dev
dev: build
	$(BIN)/hangar dev --state-dir $(DEV_DIR) --listen 127.0.0.1:4566

# image-ami: publish the image as an AMI with bootc-image-builder
# (image/ami.sh; AMI_FLAGS=--dry-run prints the commands).
AMI_FLAGS ?=
image-ami:
	image/ami.sh $(AMI_FLAGS)

generate:
	$(GO) generate ./...

clean:
	rm -rf $(BIN)
