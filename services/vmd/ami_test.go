package main

// The starter AMI as an EC2 guest: booted with exactly the QEMU command
// line vmd builds (EC2 SMBIOS identity, NVMe root over NBD, UEFI), plus a
// user-mode NIC whose only way out is 169.254.169.254:80, forwarded to a
// fake IMDS in this test. cloud-init must pick its Ec2 datasource by
// detection, take the IMDSv2 token, run the user data and install the
// key pair's public key. Part of make bench (a full cloud boot under TCG
// takes minutes on a loaded 2-core machine); netd's real IMDS replaces the
// fake in the end-to-end tests of a later phase.

import (
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/vmd/core"
	"hangar.dev/hangar/tests/harness"
)

const (
	ec2Marker  = "HANGAR-EC2-USERDATA-RAN"
	benchKey   = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBHangarStarterAmiTestKeyOnlyForTheFakeImds bench-key"
	benchKeyID = "bench-key"
)

// fakeIMDS serves the part of EC2's instance metadata cloud-init reads.
type fakeIMDS struct {
	mu     sync.Mutex
	seen   []string
	tree   map[string]string // path under /<version>/ -> body; directories end in /
	tokens bool
}

func newFakeIMDS(id string) *fakeIMDS {
	md := map[string]string{
		"ami-id":                         "ami-0123456789abcdef0",
		"hostname":                       "ip-169-254-0-10.ec2.internal",
		"instance-id":                    id,
		"instance-type":                  "t3.micro",
		"local-hostname":                 "ip-169-254-0-10.ec2.internal",
		"local-ipv4":                     "169.254.0.10",
		"placement/availability-zone":    "us-east-1a",
		"placement/region":               "us-east-1",
		"public-keys/0/openssh-key":      benchKey,
		"services/domain":                "amazonaws.com",
		"services/partition":             "aws",
		"instance-action":                "none",
		"reservation-id":                 "r-0123456789abcdef0",
		"security-groups":                "default",
		"block-device-mapping/ami":       "/dev/xvda",
		"block-device-mapping/root":      "/dev/xvda",
		"metrics/vhostmd":                `<?xml version="1.0" encoding="UTF-8"?>`,
		"profile":                        "default-hvm",
		"ami-launch-index":               "0",
		"ami-manifest-path":              "(unknown)",
		"instance-life-cycle":            "on-demand",
		"placement/availability-zone-id": "use1-az1",
	}
	tree := map[string]string{}
	dirs := map[string][]string{}
	for p, body := range md {
		full := "meta-data/" + p
		tree[full] = body
		parts := strings.Split(full, "/")
		for i := 1; i < len(parts); i++ {
			dir := strings.Join(parts[:i], "/") + "/"
			entry := parts[i]
			if i < len(parts)-1 {
				entry += "/"
			}
			if dir == "meta-data/public-keys/" && entry == "0/" {
				entry = "0=" + benchKeyID
			}
			if !slices.Contains(dirs[dir], entry) {
				dirs[dir] = append(dirs[dir], entry)
			}
		}
	}
	for d, entries := range dirs {
		slices.Sort(entries)
		tree[d] = strings.Join(entries, "\n")
	}
	tree["user-data"] = "#!/bin/sh\necho " + ec2Marker + " uuid=$(cat /sys/class/dmi/id/product_uuid) > /dev/ttyS0\n" +
		"echo HANGAR-AUTHORIZED-KEYS $(cat /home/admin/.ssh/authorized_keys) > /dev/ttyS0\n"
	tree["dynamic/instance-identity/"] = "document"
	tree["dynamic/instance-identity/document"] = fmt.Sprintf(`{"accountId":"123456789012","architecture":"x86_64","availabilityZone":"us-east-1a","imageId":"ami-0123456789abcdef0","instanceId":%q,"instanceType":"t3.micro","privateIp":"169.254.0.10","region":"us-east-1","version":"2017-09-30"}`, id)
	return &fakeIMDS{tree: tree}
}

func (f *fakeIMDS) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	f.seen = append(f.seen, r.Method+" "+r.URL.Path)
	f.mu.Unlock()
	if r.Method == http.MethodPut && r.URL.Path == "/latest/api/token" {
		if r.Header.Get("X-aws-ec2-metadata-token-ttl-seconds") == "" {
			http.Error(w, "missing ttl", http.StatusBadRequest)
			return
		}
		f.mu.Lock()
		f.tokens = true
		f.mu.Unlock()
		fmt.Fprint(w, "hangar-fake-imds-token")
		return
	}
	if r.Method != http.MethodGet {
		http.Error(w, "method", http.StatusMethodNotAllowed)
		return
	}
	if f.tokens && r.Header.Get("X-aws-ec2-metadata-token") != "hangar-fake-imds-token" {
		http.Error(w, "unauthorized", http.StatusUnauthorized)
		return
	}
	// /<version>/<path>, any version
	_, rest, ok := strings.Cut(strings.TrimPrefix(r.URL.Path, "/"), "/")
	if !ok {
		fmt.Fprint(w, "latest\n2021-03-23")
		return
	}
	body, ok := f.tree[rest]
	if !ok && !strings.HasSuffix(rest, "/") {
		body, ok = f.tree[rest+"/"]
	}
	if !ok {
		http.NotFound(w, r)
		return
	}
	fmt.Fprint(w, body)
}

func (f *fakeIMDS) requests() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.seen...)
}

func TestBenchStarterAMIEc2Datasource(t *testing.T) {
	if os.Getenv("HANGAR_BENCH") == "" {
		t.Skip("skipping: boots the starter AMI under TCG for minutes (make bench sets HANGAR_BENCH=1)")
	}
	requireGuestPrereqs(t)
	harness.Require(t, "qemu-nbd", "qemu-img", "busybox")
	if !fileExists("/usr/share/OVMF/OVMF_CODE_4M.fd") {
		t.Skip("skipping: OVMF is not installed (apt-get install ovmf)")
	}
	disk := starterAMI(t)
	dir, err := os.MkdirTemp("", "vmdami-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	id := randomID("i-", 17)

	imds := newFakeIMDS(id)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: imds, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { srv.Close() })

	overlay(t, disk, filepath.Join(dir, "root.qcow2"))
	sock := filepath.Join(dir, "root.sock")
	serveNBD(t, filepath.Join(dir, "root.qcow2"), "qcow2", sock)
	vars := filepath.Join(dir, "vars.fd")
	b, _ := os.ReadFile("/usr/share/OVMF/OVMF_VARS_4M.fd")
	if err := os.WriteFile(vars, b, 0o600); err != nil {
		t.Fatal(err)
	}
	console := filepath.Join(dir, "console.log")
	args, err := core.QEMUArgs(core.Launch{
		Spec: api.InstanceSpec{ID: id, InstanceType: "t3.micro", VCPUs: 2, MemoryMiB: 1024, BootMode: api.BootModeUEFI,
			RootVolume: api.InstanceDisk{ID: "vol-0c0000000000000a1", Socket: sock}},
		Accel:    core.AccelTCG,
		Firmware: core.Firmware{OVMFCode: "/usr/share/OVMF/OVMF_CODE_4M.fd"},
		Paths:    core.LaunchPaths{QMPSocket: filepath.Join(dir, "qmp.sock"), PIDFile: filepath.Join(dir, "qemu.pid"), ConsoleLog: console, VarsFile: vars},
	})
	if err != nil {
		t.Fatal(err)
	}
	// vmd's command line, less the sandbox's spawn ban (the forward below
	// runs a command per connection), plus a NIC that reaches only IMDS.
	if i := slices.Index(args, "-sandbox"); i >= 0 {
		args = slices.Delete(args, i, i+2)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	args = append(args,
		"-netdev", fmt.Sprintf("user,id=n0,net=169.254.0.0/16,host=169.254.0.1,dhcpstart=169.254.0.10,restrict=on,guestfwd=tcp:169.254.169.254:80-cmd:busybox nc 127.0.0.1 %d", port),
		"-device", "virtio-net-pci,netdev=n0,bus=rp8")
	cmd := exec.Command("qemu-system-x86_64", args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	out, _ := os.Create(filepath.Join(dir, "qemu.log"))
	cmd.Stdout, cmd.Stderr = out, out
	start := time.Now()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })

	var text string
	for {
		raw, _ := os.ReadFile(console)
		text = string(raw)
		if strings.Contains(text, "Datasource Data") && strings.Contains(text, "HANGAR-AUTHORIZED-KEYS") {
			break
		}
		if time.Since(start) > 12*time.Minute {
			q, _ := os.ReadFile(out.Name())
			t.Fatalf("the AMI did not finish cloud-init within 12m; IMDS saw %v\nqemu: %s\nconsole:\n%s", imds.requests(), q, tail(text, 4000))
		}
		time.Sleep(500 * time.Millisecond)
	}
	t.Logf("starter AMI finished cloud-init from the fake IMDS in %s", time.Since(start).Round(time.Second))
	if !strings.Contains(text, "Datasource DataSourceEc2") {
		t.Errorf("cloud-init did not use the EC2 datasource: %q", lineWith(text, "Datasource Data"))
	}
	if l := lineWith(text, ec2Marker); !strings.Contains(l, "uuid="+core.InstanceUUID(id)) {
		t.Errorf("user data did not run, or the guest's UUID is not the instance's: %q", l)
	}
	if l := lineWith(text, "HANGAR-AUTHORIZED-KEYS"); !strings.Contains(l, benchKey) {
		t.Errorf("the key pair's public key is not in admin's authorized_keys: %q", l)
	}
	reqs := strings.Join(imds.requests(), "\n")
	for _, want := range []string{"PUT /latest/api/token", "/meta-data/instance-id", "/user-data"} {
		if !strings.Contains(reqs, want) {
			t.Errorf("IMDS never saw %q; requests:\n%s", want, reqs)
		}
	}
}
