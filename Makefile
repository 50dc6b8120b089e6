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
	hangar-ebsd=./services/ebsd

# Debian packages the tests drive for real (aws CLI, D-Bus, QEMU, …).
TEST_DEBS := awscli dbus-daemon dbus-bin qemu-utils

.PHONY: all build test vet unit fuzz bench run deps clean generate

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

test: deps build vet
	HANGAR_BIN_DIR=$(CURDIR)/$(BIN) $(GO) test -count=1 -timeout 45m ./...
	$(MAKE) -s fuzz FUZZTIME=10s

# Each fuzz target runs briefly in make test; longer with FUZZTIME=5m.
FUZZTIME ?= 10s
FUZZ_TARGETS := \
	./services/gateway/sigv4:FuzzVerify \
	./services/gateway/awsproto:FuzzDecodeQuery

fuzz:
	@for t in $(FUZZ_TARGETS); do \
		pkg=$${t%%:*}; name=$${t#*:}; \
		echo "fuzz $$name ($(FUZZTIME))"; \
		$(GO) test -run '^$$' -fuzz "^$$name\$$" -fuzztime $(FUZZTIME) $$pkg || exit 1; \
	done

bench: build
	HANGAR_BIN_DIR=$(CURDIR)/$(BIN) HANGAR_BENCH=1 $(GO) test -count=1 -timeout 60m -run '^TestBench' -v ./tests/bench/ | grep -v '^=== RUN'

# run: until the image lands, a development host on 127.0.0.1:4566.
RUN_DIR ?= $(CURDIR)/.hangar-dev
run: build
	$(BIN)/hangar dev --state-dir $(RUN_DIR) --listen 127.0.0.1:4566

generate:
	$(GO) generate ./...

clean:
	rm -rf $(BIN)
