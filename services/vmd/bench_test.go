package main

// make bench (HANGAR_BENCH=1): the starter AMI booted to a user-data marker
// on the console, once through hangar-vmd (CreateInstance, root and seed
// disks over NBD as ebsd serves them) and once by bare qemu-system-x86_64
// on the same disk, in the same run; the ratio is hangar's overhead. It
// also reports QEMU's resident memory beyond guest RAM.

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/tests/harness"
)

const userDataMarker = "HANGAR-USERDATA-RAN"

// starterAMI builds (or reuses) the starter AMI and returns its disk.
func starterAMI(t *testing.T) string {
	t.Helper()
	root := harness.RepoRoot(t)
	out := filepath.Join(root, "image", "starter-ami", "out")
	cmd := exec.Command(filepath.Join(root, "image", "starter-ami", "build.sh"), "--out", out)
	start := time.Now()
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building the starter AMI: %v\n%s", err, tail(string(b), 3000))
	}
	t.Logf("starter AMI ready in %s", time.Since(start).Round(time.Second))
	return filepath.Join(out, "debian-12-x86_64.raw")
}

// seedDisk makes a NoCloud seed (vfat labelled CIDATA) whose user data
// prints the marker on the serial console.
func seedDisk(t *testing.T, dir, instanceID string) string {
	t.Helper()
	harness.Require(t, "mkfs.vfat", "mcopy")
	img := filepath.Join(dir, "seed.img")
	if out, err := exec.Command("mkfs.vfat", "-C", "-n", "CIDATA", img, "2048").CombinedOutput(); err != nil {
		t.Fatalf("mkfs.vfat: %v: %s", err, out)
	}
	files := map[string]string{
		"meta-data": "instance-id: " + instanceID + "\nlocal-hostname: bench\n",
		"user-data": "#!/bin/sh\necho " + userDataMarker + " > /dev/ttyS0\n",
	}
	for name, body := range files {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command("mcopy", "-i", img, p, "::/"+name)
		cmd.Env = append(os.Environ(), "MTOOLS_SKIP_CHECK=1")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("mcopy: %v: %s", err, out)
		}
	}
	return img
}

func overlay(t *testing.T, base, path string) {
	t.Helper()
	if out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", "-b", base, "-F", "raw", path).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img create: %v: %s", err, out)
	}
}

// serveNBD exports a file on a unix socket as ebsd would.
func serveNBD(t *testing.T, file, format, sock string) {
	t.Helper()
	cmd := exec.Command("qemu-nbd", "--socket="+sock, "--format="+format, "--persistent", "--shared=4", "--cache=writeback", file)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	waitFor(t, 10*time.Second, "qemu-nbd on "+sock, func() bool { return fileExists(sock) })
}

// rssBeyondGuest sums the resident memory of every mapping of pid except
// the guest's RAM (the anonymous mapping of the guest's size).
func rssBeyondGuest(pid int, guestMiB int) (total, beyond int64) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/smaps", pid))
	if err != nil {
		return 0, 0
	}
	defer f.Close()
	var (
		size     int64
		guestRSS int64
		s        = bufio.NewScanner(f)
	)
	for s.Scan() {
		fields := strings.Fields(s.Text())
		if len(fields) < 2 {
			continue
		}
		switch fields[0] {
		case "Size:":
			size, _ = strconv.ParseInt(fields[1], 10, 64)
		case "Rss:":
			rss, _ := strconv.ParseInt(fields[1], 10, 64)
			total += rss
			// the guest RAM block, possibly with alignment padding
			if size >= int64(guestMiB)*1024 && size <= int64(guestMiB)*1024+4096 && guestRSS == 0 {
				guestRSS = rss
			}
		}
	}
	return total * 1024, (total - guestRSS) * 1024
}

// bareRun is one bare QEMU boot.
type bareRun struct {
	cmd     *exec.Cmd
	console string
	start   time.Time
}

func startBare(t *testing.T, dir string, args ...string) *bareRun {
	t.Helper()
	console := filepath.Join(dir, "console.log")
	_ = os.Remove(console)
	all := append([]string{"-nodefaults", "-machine", "q35", "-accel", "tcg", "-cpu", "max", "-display", "none",
		"-chardev", "file,id=console,path=" + console, "-serial", "chardev:console"}, args...)
	cmd := exec.Command("qemu-system-x86_64", all...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	r := &bareRun{cmd: cmd, console: console, start: time.Now()}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	return r
}

func (r *bareRun) stop() {
	_ = r.cmd.Process.Kill()
	_ = r.cmd.Wait()
}

// vmdBoot creates an instance and waits for marker on its console.
func vmdBoot(t *testing.T, e *vmdEnv, spec api.InstanceSpec, cond func(string) bool, d time.Duration) (time.Duration, api.InstanceInfo) {
	t.Helper()
	killLeftovers(t, spec.ID)
	start := time.Now()
	info, err := e.client.CreateInstance(ctx(t), spec)
	if err != nil {
		t.Fatalf("CreateInstance: %v", err)
	}
	for !cond(e.console(spec.ID)) {
		if time.Since(start) > d {
			t.Fatalf("no marker through vmd within %s:\n%s", d, tail(e.console(spec.ID), 3000))
		}
		time.Sleep(100 * time.Millisecond)
	}
	return time.Since(start), info
}

func vmdDone(t *testing.T, e *vmdEnv, id string) {
	t.Helper()
	if _, err := e.client.TerminateInstance(ctx(t), id); err != nil {
		t.Fatal(err)
	}
	e.waitState(id, api.InstanceStateTerminated, 2*time.Minute)
	if err := e.client.DeleteInstance(ctx(t), id); err != nil {
		t.Fatal(err)
	}
}

func TestBenchBootRatio(t *testing.T) {
	if os.Getenv("HANGAR_BENCH") == "" {
		t.Skip("skipping: a benchmark (make bench sets HANGAR_BENCH=1)")
	}
	requireGuestPrereqs(t)
	harness.Require(t, "qemu-nbd", "qemu-img")
	e := newVMDEnv(t, devConfig())
	load, _ := os.ReadFile("/proc/loadavg")
	t.Logf("host load average at start: %s", strings.TrimSpace(string(load)))

	// 1. The busybox guest booted directly from the cloud kernel, to its
	// init's main loop: rounds alternate which side goes first, so load
	// from the rest of the machine falls on both.
	g := testGuest(t)
	const rounds = 3
	var bareT, vmT []time.Duration
	var vmRSS, vmBeyond, bareBeyond int64
	for i := 0; i < rounds; i++ {
		runBare := func() {
			r := startBare(t, t.TempDir(), "-smp", "1", "-m", "256M", "-kernel", g.kernel, "-initrd", g.initrd, "-append", "console=ttyS0 panic=-1 loglevel=4 rdinit=/init")
			for {
				b, _ := os.ReadFile(r.console)
				if booted(string(b)) {
					bareT = append(bareT, time.Since(r.start))
					break
				}
				if time.Since(r.start) > 2*time.Minute {
					t.Fatalf("bare busybox guest did not boot:\n%s", tail(string(b), 2000))
				}
				time.Sleep(50 * time.Millisecond)
			}
			_, bareBeyond = rssBeyondGuest(r.cmd.Process.Pid, 256)
			r.stop()
		}
		runVMD := func() {
			spec := g.spec(randomID("i-", 17), "", "")
			d, info := vmdBoot(t, e, spec, booted, 2*time.Minute)
			vmT = append(vmT, d)
			vmRSS, vmBeyond = rssBeyondGuest(int(info.PID), 256)
			vmdDone(t, e, spec.ID)
		}
		if i%2 == 0 {
			runBare()
			runVMD()
		} else {
			runVMD()
			runBare()
		}
	}
	t.Logf("busybox initramfs guest (cloud kernel, 1 vCPU, 256 MiB, TCG) to its init's main loop, %d rounds:", rounds)
	t.Logf("  bare qemu-system-x86_64        median %5.2f s  %v", harness.Median(bareT).Seconds(), bareT)
	t.Logf("  hangar-vmd CreateInstance      median %5.2f s  %v", harness.Median(vmT).Seconds(), vmT)
	t.Logf("  ratio                                 %5.2fx (goal <= 1.10x)", harness.Median(vmT).Seconds()/harness.Median(bareT).Seconds())
	t.Logf("  QEMU RSS beyond guest RAM: hangar %d MiB (total %d MiB), bare %d MiB", vmBeyond>>20, vmRSS>>20, bareBeyond>>20)

	// 2. The starter AMI (uefi) to its user-data marker, in rounds that
	// alternate which side goes first (bare, vmd, vmd, bare). Each boot
	// starts from a fresh copy-on-write overlay, so cloud-init's first boot
	// runs every time. The bare side reads its disks as local files; vmd's
	// come over NBD from qemu-nbd, as ebsd will serve them.
	code, vars := "/usr/share/OVMF/OVMF_CODE_4M.fd", "/usr/share/OVMF/OVMF_VARS_4M.fd"
	if !fileExists(code) || !fileExists(vars) {
		t.Skip("skipping the starter AMI part: OVMF is not installed (apt-get install ovmf)")
	}
	disk := starterAMI(t)
	const vcpus, memMiB = 2, 1024
	amiRounds := 2
	if n, err := strconv.Atoi(os.Getenv("HANGAR_BENCH_AMI_ROUNDS")); err == nil && n > 0 {
		amiRounds = n
	}
	marker := func(s string) bool { return strings.Contains(s, userDataMarker) }
	var amiBare, amiVM []time.Duration
	var amiTotal, amiBeyond, amiBareBeyond int64
	bareAMI := func() {
		dir := t.TempDir()
		overlay(t, disk, filepath.Join(dir, "root.qcow2"))
		seed := seedDisk(t, dir, "i-0bare000000000000")
		varsCopy := filepath.Join(dir, "vars.fd")
		b, _ := os.ReadFile(vars)
		_ = os.WriteFile(varsCopy, b, 0o600)
		r := startBare(t, dir, "-smp", strconv.Itoa(vcpus), "-m", fmt.Sprintf("%dM", memMiB),
			"-drive", "if=pflash,format=raw,unit=0,readonly=on,file="+code,
			"-drive", "if=pflash,format=raw,unit=1,file="+varsCopy,
			"-drive", "if=none,id=root,format=qcow2,file="+filepath.Join(dir, "root.qcow2"),
			"-device", "nvme,drive=root,serial=vol0bare,bootindex=0",
			"-drive", "if=none,id=seed,format=raw,readonly=on,file="+seed,
			"-device", "nvme,drive=seed,serial=vol0seed")
		for {
			b, _ := os.ReadFile(r.console)
			if marker(string(b)) {
				amiBare = append(amiBare, time.Since(r.start))
				break
			}
			if time.Since(r.start) > 10*time.Minute {
				t.Fatalf("bare qemu: no user-data marker within 10m:\n%s", tail(string(b), 3000))
			}
			time.Sleep(100 * time.Millisecond)
		}
		_, amiBareBeyond = rssBeyondGuest(r.cmd.Process.Pid, memMiB)
		r.stop()
	}
	vmdAMI := func(round int) {
		id := randomID("i-", 17)
		dir := t.TempDir()
		overlay(t, disk, filepath.Join(dir, "root.qcow2"))
		seed := seedDisk(t, dir, id)
		rootSock := filepath.Join(e.dir, fmt.Sprintf("root%d.sock", round))
		seedSock := filepath.Join(e.dir, fmt.Sprintf("seed%d.sock", round))
		serveNBD(t, filepath.Join(dir, "root.qcow2"), "qcow2", rootSock)
		serveNBD(t, seed, "raw", seedSock)
		spec := api.InstanceSpec{
			ID: id, InstanceType: "t3.micro", VCPUs: vcpus, MemoryMiB: memMiB, BootMode: api.BootModeUEFI,
			RootVolume: api.InstanceDisk{ID: "vol-0b0000000000000a1", Socket: rootSock, DeviceName: "/dev/xvda"},
			Volumes:    []api.InstanceDisk{{ID: "vol-0b0000000000000a2", Socket: seedSock, DeviceName: "/dev/sdf", ReadOnly: true}},
		}
		d, info := vmdBoot(t, e, spec, marker, 10*time.Minute)
		amiVM = append(amiVM, d)
		amiTotal, amiBeyond = rssBeyondGuest(int(info.PID), memMiB)
		vmdDone(t, e, id)
	}
	for i := 0; i < amiRounds; i++ {
		if i%2 == 0 {
			bareAMI()
			vmdAMI(i)
		} else {
			vmdAMI(i)
			bareAMI()
		}
	}
	load, _ = os.ReadFile("/proc/loadavg")
	t.Logf("starter AMI (uefi, %d vCPU, %d MiB, TCG) to the user-data marker on the console, %d rounds:", vcpus, memMiB, amiRounds)
	t.Logf("  bare qemu-system-x86_64 (local qcow2)       median %6.1f s  %v", harness.Median(amiBare).Seconds(), amiBare)
	t.Logf("  hangar-vmd CreateInstance (disks over NBD)  median %6.1f s  %v", harness.Median(amiVM).Seconds(), amiVM)
	t.Logf("  ratio                                              %6.2fx (goal <= 1.10x)", harness.Median(amiVM).Seconds()/harness.Median(amiBare).Seconds())
	t.Logf("  QEMU RSS beyond guest RAM: hangar %d MiB (total %d MiB), bare %d MiB", amiBeyond>>20, amiTotal>>20, amiBareBeyond>>20)
	t.Logf("host load average at end: %s", strings.TrimSpace(string(load)))
}
