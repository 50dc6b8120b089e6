package bench

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/ec2"
	ec2types "github.com/aws/aws-sdk-go-v2/service/ec2/types"

	"hangar.dev/hangar/tests/harness"
)

// TestBenchRunInstancesBoot is issue 6's boot-time ratio on the whole
// path: the starter AMI imported by the gateway through ebsd, run-instances
// through the SDK (netd's tap, DHCP and IMDS, ebsd's NBD root, vmd's QEMU),
// timed to the user data's marker in get-console-output; against bare
// qemu-system-x86_64 booting the same disk (a qcow2 overlay of it, cloud-init
// reading the same user data from a NoCloud seed) to the same marker, with
// the same machine, CPU model, vCPUs, memory, firmware, NVMe root and a
// virtio NIC. Rounds alternate which side goes first (bare, hangar, hangar,
// bare, …) so the machine's other load falls on both.
func TestBenchRunInstancesBoot(t *testing.T) {
	requireBench(t)
	harness.RequireRoot(t)
	harness.Require(t, "qemu-system-x86_64", "qemu-img", "mkfs.vfat", "mcopy")
	code, vars := "/usr/share/OVMF/OVMF_CODE_4M.fd", "/usr/share/OVMF/OVMF_VARS_4M.fd"
	for _, f := range []string{code, vars, "/dev/net/tun"} {
		if _, err := os.Stat(f); err != nil {
			t.Skipf("skipping: %s is missing (apt-get install ovmf; a tun device)", f)
		}
	}
	rounds := 2
	if n, err := strconv.Atoi(os.Getenv("HANGAR_BENCH_AMI_ROUNDS")); err == nil && n > 0 {
		rounds = n
	}
	root := harness.RepoRoot(t)
	out := filepath.Join(root, "image", "starter-ami", "out")
	if b, err := exec.Command(filepath.Join(root, "image", "starter-ami", "build.sh"), "--out", out).CombinedOutput(); err != nil {
		t.Fatalf("building the starter AMI: %v\n%s", err, b)
	}
	disk := filepath.Join(out, "debian-12-x86_64.raw")

	d := harness.StartDev(t, harness.Options{Args: []string{"--starter-ami", filepath.Join(out, "ami.env")}})
	ctx := context.Background()
	c := ec2.NewFromConfig(d.SDK())
	var ami string
	deadline := time.Now().Add(5 * time.Minute)
	for ami == "" {
		imgs, err := c.DescribeImages(ctx, &ec2.DescribeImagesInput{Owners: []string{"self"}, Filters: []ec2types.Filter{
			{Name: aws.String("name"), Values: []string{"hangar/debian-12-x86_64"}},
			{Name: aws.String("state"), Values: []string{"available"}}}})
		if err == nil && len(imgs.Images) == 1 {
			ami = aws.ToString(imgs.Images[0].ImageId)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the starter AMI is not available after 5 min (%v)\n%s", err, d.Log())
		}
		time.Sleep(time.Second)
	}

	const vcpus, memMiB = 2, 1024 // t3.micro
	userData := func() (string, string) {
		nonce := make([]byte, 6)
		_, _ = rand.Read(nonce)
		marker := "HANGAR-BENCH-" + hex.EncodeToString(nonce)
		return marker, "#!/bin/sh\necho " + marker + " > /dev/ttyS0\n"
	}
	var hangarT, bareT []time.Duration

	viaHangar := func() {
		marker, ud := userData()
		start := time.Now()
		run, err := c.RunInstances(ctx, &ec2.RunInstancesInput{ImageId: aws.String(ami), InstanceType: ec2types.InstanceTypeT3Micro,
			MinCount: aws.Int32(1), MaxCount: aws.Int32(1), UserData: aws.String(base64.StdEncoding.EncodeToString([]byte(ud)))})
		if err != nil {
			t.Fatalf("run-instances: %v", err)
		}
		id := aws.ToString(run.Instances[0].InstanceId)
		for {
			co, err := c.GetConsoleOutput(ctx, &ec2.GetConsoleOutputInput{InstanceId: aws.String(id), Latest: aws.Bool(true)})
			if err == nil {
				text, _ := base64.StdEncoding.DecodeString(aws.ToString(co.Output))
				if strings.Contains(string(text), marker) {
					hangarT = append(hangarT, time.Since(start))
					break
				}
			}
			if time.Since(start) > 10*time.Minute {
				t.Fatalf("%s: no user-data marker on the console within 10 min (%v)", id, err)
			}
			time.Sleep(250 * time.Millisecond)
		}
		if _, err := c.TerminateInstances(ctx, &ec2.TerminateInstancesInput{InstanceIds: []string{id}}); err != nil {
			t.Fatal(err)
		}
		w := ec2.NewInstanceTerminatedWaiter(c, func(o *ec2.InstanceTerminatedWaiterOptions) { o.MinDelay, o.MaxDelay = time.Second, 2*time.Second })
		if err := w.Wait(ctx, &ec2.DescribeInstancesInput{InstanceIds: []string{id}}, 3*time.Minute); err != nil {
			t.Fatalf("%s did not terminate: %v", id, err)
		}
	}

	bare := func() {
		marker, ud := userData()
		dir := t.TempDir()
		overlay := filepath.Join(dir, "root.qcow2")
		if b, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b", disk, overlay).CombinedOutput(); err != nil {
			t.Fatalf("qemu-img create: %v: %s", err, b)
		}
		seed := filepath.Join(dir, "seed.img")
		if b, err := exec.Command("mkfs.vfat", "-C", "-n", "CIDATA", seed, "2048").CombinedOutput(); err != nil {
			t.Fatalf("mkfs.vfat: %v: %s", err, b)
		}
		for name, body := range map[string]string{"meta-data": "instance-id: i-0bare" + marker[len(marker)-12:] + "\nlocal-hostname: bare\n", "user-data": ud} {
			p := filepath.Join(dir, name)
			if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
				t.Fatal(err)
			}
			if b, err := exec.Command("mcopy", "-i", seed, p, "::"+name).CombinedOutput(); err != nil {
				t.Fatalf("mcopy: %v: %s", err, b)
			}
		}
		varsCopy := filepath.Join(dir, "vars.fd")
		b, err := os.ReadFile(vars)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(varsCopy, b, 0o600); err != nil {
			t.Fatal(err)
		}
		console := filepath.Join(dir, "console.log")
		start := time.Now()
		cmd := exec.Command("qemu-system-x86_64", "-nodefaults", "-machine", "q35", "-accel", "tcg", "-cpu", "max",
			"-smp", strconv.Itoa(vcpus), "-m", fmt.Sprintf("%dM", memMiB), "-display", "none",
			"-chardev", "file,id=console,path="+console, "-serial", "chardev:console",
			"-drive", "if=pflash,format=raw,unit=0,readonly=on,file="+code,
			"-drive", "if=pflash,format=raw,unit=1,file="+varsCopy,
			"-drive", "if=none,id=root,format=qcow2,file="+overlay,
			"-device", "nvme,drive=root,serial=vol0bare,bootindex=0",
			"-drive", "if=none,id=seed,format=raw,readonly=on,file="+seed,
			"-device", "nvme,drive=seed,serial=vol0seed",
			"-nic", "user,model=virtio-net-pci,restrict=on")
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
		for {
			b, _ := os.ReadFile(console)
			if strings.Contains(string(b), marker) {
				bareT = append(bareT, time.Since(start))
				return
			}
			if time.Since(start) > 10*time.Minute {
				t.Fatalf("bare qemu: no user-data marker within 10 min:\n%s", b[max(0, len(b)-3000):])
			}
			time.Sleep(250 * time.Millisecond)
		}
	}

	load, _ := os.ReadFile("/proc/loadavg")
	t.Logf("host load average at start: %s", strings.TrimSpace(string(load)))
	for i := 0; i < rounds; i++ {
		if i%2 == 0 {
			bare()
			viaHangar()
		} else {
			viaHangar()
			bare()
		}
	}
	load, _ = os.ReadFile("/proc/loadavg")
	hm, bm := harness.Median(hangarT), harness.Median(bareT)
	t.Logf("starter AMI (t3.micro: uefi, %d vCPUs, %d MiB, TCG) to the user-data marker on the console, %d rounds:", vcpus, memMiB, rounds)
	t.Logf("  bare qemu-system-x86_64 (local qcow2 overlay, NoCloud seed)  median %6.1f s  %v", bm.Seconds(), bareT)
	t.Logf("  run-instances through hangar dev (get-console-output)        median %6.1f s  %v", hm.Seconds(), hangarT)
	t.Logf("  ratio                                                               %6.2fx (goal <= 1.10x)", hm.Seconds()/bm.Seconds())
	t.Logf("host load average at end: %s", strings.TrimSpace(string(load)))
}
