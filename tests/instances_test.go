package tests

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/ebs"
	ebstypes "github.com/aws/aws-sdk-go-v2/service/ebs/types"
	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/godbus/dbus/v5"

	"hangar.dev/hangar/tests/harness"
	"hangar.dev/hangar/tests/testami"
)

// TestInstancesEndToEnd is `aws ec2 run-instances` booting a real guest on
// a `hangar dev` host, driven with the real aws CLI as a user drives EC2:
// a tiny UEFI AMI imported through the EBS direct API and registered, two
// guests in a VPC (one serving a TCP port, one knocking on it) that take
// their address from netd's DHCP and their identity and user data from its
// IMDSv2, a security group opening and closing the port for live traffic,
// describe filters, reboot, stop, start and terminate, and after that
// nothing of the instance left: no QEMU, no tap, no volume, its address
// back; then hangar dev stops with the other guest running and leaves no
// QEMU. A launch beyond the host's memory fails with
// InsufficientInstanceCapacity and leaves nothing in vmd, netd or ebsd.
func TestInstancesEndToEnd(t *testing.T) {
	if testing.Short() {
		t.Skip("skipping: boots two UEFI guests under hangar dev for minutes (-short)")
	}
	harness.RequireRoot(t)
	harness.Require(t, harness.AWSCLI, "qemu-system-x86_64", "ip", "dbus-daemon")
	for _, f := range []string{"/usr/share/OVMF/OVMF_CODE_4M.fd", "/usr/share/OVMF/OVMF_VARS_4M.fd"} {
		if _, err := os.Stat(f); err != nil {
			t.Skipf("skipping: %s is missing (apt-get install ovmf)", f)
		}
	}
	disk := testami.Disk(t)
	d := harness.StartDev(t, harness.Options{})
	bus := devBus(t, d)
	// Polls go through the SDK (a CLI process per poll would load the
	// machine it measures), each bounded by the client's timeout.
	sdk := ec2.NewFromConfig(d.SDK(), func(o *ec2.Options) { o.HTTPClient = &http.Client{Timeout: 30 * time.Second} })
	tag := randHex(4)
	start := time.Now()
	step := func(what string) { t.Logf("%6.1fs %s", time.Since(start).Seconds(), what) }

	// The AMI, imported the way users import a disk: EBS direct API, only
	// the blocks that hold data, each with its checksum; then registered.
	snap := importDisk(t, d, disk)
	d.MustAWS("ec2", "wait", "snapshot-completed", "--snapshot-ids", snap)
	ami := cliText(t, d, "ec2", "register-image", "--name", "hangar-e2e-"+tag, "--architecture", "x86_64",
		"--boot-mode", "uefi", "--root-device-name", "/dev/xvda", "--virtualization-type", "hvm", "--ena-support",
		"--block-device-mappings", "DeviceName=/dev/xvda,Ebs={SnapshotId="+snap+",DeleteOnTermination=true,VolumeType=gp3}",
		"--query", "ImageId")
	d.MustAWS("ec2", "wait", "image-available", "--image-ids", ami)
	step("AMI " + ami + " imported and registered")

	// A VPC with a /28 subnet (11 usable addresses), a server group and a
	// client group, a key pair.
	vpc := cliText(t, d, "ec2", "create-vpc", "--cidr-block", "10.77.0.0/16", "--query", "Vpc.VpcId")
	subnet := cliText(t, d, "ec2", "create-subnet", "--vpc-id", vpc, "--cidr-block", "10.77.1.0/28", "--query", "Subnet.SubnetId")
	freeIPs := func() string {
		return cliText(t, d, "ec2", "describe-subnets", "--subnet-ids", subnet, "--query", "Subnets[0].AvailableIpAddressCount")
	}
	if got := freeIPs(); got != "11" {
		t.Fatalf("a fresh /28 has %s free addresses, want 11", got)
	}
	server := cliText(t, d, "ec2", "create-security-group", "--group-name", "e2e-server", "--description", "serves 8080", "--vpc-id", vpc, "--query", "GroupId")
	client := cliText(t, d, "ec2", "create-security-group", "--group-name", "e2e-client", "--description", "knocks on 8080", "--vpc-id", vpc, "--query", "GroupId")
	key := "e2e-" + tag
	if !strings.Contains(cliText(t, d, "ec2", "create-key-pair", "--key-name", key, "--query", "KeyMaterial"), "PRIVATE KEY") {
		t.Fatal("create-key-pair returned no private key")
	}
	ns := vpcNamespace(t, bus, vpc)

	// Capacity: an r5.24xlarge (96 vCPUs, 768 GiB) does not fit a host
	// that never overcommits memory, and the refusal leaves nothing behind.
	before := leftovers(t, d, bus, ns)
	cliFails(t, d, "InsufficientInstanceCapacity", "ec2", "run-instances", "--image-id", ami, "--instance-type", "r5.24xlarge",
		"--subnet-id", subnet, "--security-group-ids", server)
	if after := leftovers(t, d, bus, ns); after != before {
		t.Fatalf("a refused launch left something behind:\nbefore %s\nafter  %s", before, after)
	}
	if got := freeIPs(); got != "11" {
		t.Fatalf("a refused launch kept an address: %s free", got)
	}
	step("oversized launch refused, nothing left")

	// The server guest: user data, key pair, tags.
	userData := "hangar e2e user data " + tag
	t0 := time.Now()
	var run struct {
		Instances []struct {
			InstanceId, PrivateIpAddress string
			State                        struct{ Name string }
		}
	}
	cli(t, d, &run, "ec2", "run-instances", "--image-id", ami, "--instance-type", "t3.nano", "--subnet-id", subnet,
		"--security-group-ids", server, "--key-name", key, "--user-data", userData,
		"--tag-specifications", "ResourceType=instance,Tags=[{Key=Name,Value=e2e-server},{Key=role,Value=server}]",
		"ResourceType=volume,Tags=[{Key=Name,Value=e2e-root}]")
	if len(run.Instances) != 1 {
		t.Fatalf("run-instances launched %d instances", len(run.Instances))
	}
	a, ipA := run.Instances[0].InstanceId, run.Instances[0].PrivateIpAddress
	tReturned := time.Since(t0)
	killGuestsAtEnd(t, a)
	step(fmt.Sprintf("run-instances %s at %s returned %s after %.1fs", a, ipA, run.Instances[0].State.Name, tReturned.Seconds()))

	// Timings, each from the run-instances call: running, the first and
	// the IMDS markers on the console, the instance status check ok, all
	// watched at once (through the SDK: a CLI process per poll would load
	// the machine it measures) while the second guest is launched.
	type timings struct{ running, up, imds, ok time.Duration }
	var tm timings
	if run.Instances[0].State.Name == "running" {
		tm.running = tReturned
	}
	watched := make(chan error, 1)
	go func() {
		deadline := time.Now().Add(3 * time.Minute)
		for time.Now().Before(deadline) {
			state, console, status, err := peek(sdk, a)
			if err != nil {
				watched <- err
				return
			}
			if tm.running == 0 && state == "running" {
				tm.running = time.Since(t0)
			}
			if tm.up == 0 && strings.Contains(console, testami.MarkerUp) {
				tm.up = time.Since(t0)
			}
			if tm.imds == 0 && strings.Contains(console, testami.MarkerIMDS) {
				tm.imds = time.Since(t0)
			}
			if tm.ok == 0 && status == "ok" {
				tm.ok = time.Since(t0)
			}
			if tm.running > 0 && tm.up > 0 && tm.imds > 0 && tm.ok > 0 {
				watched <- nil
				return
			}
			time.Sleep(250 * time.Millisecond)
		}
		watched <- fmt.Errorf("after 3 minutes %s has: running after %s, init marker after %s, IMDS marker after %s, status ok after %s (0: not yet)",
			a, tm.running, tm.up, tm.imds, tm.ok)
	}()

	// The client guest runs its user data as a script: it knocks on the
	// server's port every second and says what happened.
	script := "#!/bin/sh\nwhile true; do\n  r=$(nc -w 2 " + ipA + " " + strconv.Itoa(testami.ListenPort) + " </dev/null 2>/dev/null)\n" +
		"  case \"$r\" in *" + testami.Pong + "*) echo \"HANGAR-SG-OPEN $r\";; *) echo HANGAR-SG-CLOSED;; esac\n  sleep 1\ndone\n"
	cli(t, d, &run, "ec2", "run-instances", "--image-id", ami, "--instance-type", "t3.nano", "--subnet-id", subnet,
		"--security-group-ids", client, "--user-data", script,
		"--tag-specifications", "ResourceType=instance,Tags=[{Key=Name,Value=e2e-client},{Key=role,Value=client}]")
	b := run.Instances[0].InstanceId
	killGuestsAtEnd(t, b)

	if err := <-watched; err != nil {
		t.Fatal(err)
	}
	t.Logf("TIMING run-instances→running %.1fs, →console %s %.1fs, →console %s %.1fs, →status ok %.1fs",
		tm.running.Seconds(), testami.MarkerUp, tm.up.Seconds(), testami.MarkerIMDS, tm.imds.Seconds(), tm.ok.Seconds())
	// The CLI's own waiters agree.
	d.MustAWS("ec2", "wait", "instance-running", "--instance-ids", a, b)
	d.MustAWS("ec2", "wait", "instance-status-ok", "--instance-ids", a)
	step("server up and status ok")

	// What the guest printed: its lease is the API's address, IMDS gave it
	// its real instance id and the user data.
	out := cliText(t, d, "ec2", "get-console-output", "--instance-id", a, "--latest", "--query", "Output")
	if l := lineWith(out, testami.MarkerLease); !strings.Contains(l, "ip="+ipA+" ") || !strings.Contains(l, "router=10.77.1.1 ") {
		t.Errorf("guest lease %q, want ip=%s router=10.77.1.1", l, ipA)
	}
	if l := lineWith(out, testami.MarkerIMDS); l != testami.MarkerIMDS+" instance-id="+a {
		t.Errorf("IMDS said %q, want instance-id=%s", l, a)
	}
	if l := lineWith(out, testami.MarkerUserData); l != testami.MarkerUserData+" "+base64.StdEncoding.EncodeToString([]byte(userData)) {
		t.Errorf("user data line %q, want base64 of %q", l, userData)
	}

	// Security groups on live traffic: closed by default, open once the
	// server group admits the client group, closed again on revoke.
	waitUntil(t, 3*time.Minute, "the client to be refused by the server's group", func() bool {
		return strings.Contains(consoleSDK(t, sdk, b), "HANGAR-SG-CLOSED")
	})
	if strings.Contains(consoleSDK(t, sdk, b), "HANGAR-SG-OPEN") {
		t.Fatal("the client reached the server before any ingress rule")
	}
	d.MustAWS("ec2", "authorize-security-group-ingress", "--group-id", server, "--protocol", "tcp",
		"--port", strconv.Itoa(testami.ListenPort), "--source-group", client)
	waitUntil(t, 60*time.Second, "the client to reach the server once authorized", func() bool {
		return strings.Contains(consoleSDK(t, sdk, b), "HANGAR-SG-OPEN "+testami.Pong+" "+a)
	})
	d.MustAWS("ec2", "revoke-security-group-ingress", "--group-id", server, "--protocol", "tcp",
		"--port", strconv.Itoa(testami.ListenPort), "--source-group", client)
	closed := strings.Count(consoleSDK(t, sdk, b), "HANGAR-SG-CLOSED")
	waitUntil(t, 60*time.Second, "the client to be refused again after revoke", func() bool {
		c := consoleSDK(t, sdk, b)
		return strings.Count(c, "HANGAR-SG-CLOSED") > closed && strings.HasPrefix(lastLineWith(c, "HANGAR-SG-"), "HANGAR-SG-CLOSED")
	})
	step("security group opened and closed live traffic")

	// describe-instances filters.
	ids := func(filters ...string) string {
		return cliText(t, d, append([]string{"ec2", "describe-instances", "--filters"}, append(filters, "--query", "sort(Reservations[].Instances[].InstanceId)")...)...)
	}
	if got := ids("Name=instance-state-name,Values=running", "Name=tag:role,Values=server"); got != a {
		t.Errorf("running servers: %q, want %s", got, a)
	}
	if got := ids("Name=private-ip-address,Values=" + ipA); got != a {
		t.Errorf("instances at %s: %q", ipA, got)
	}
	if got := ids("Name=tag:Name,Values=e2e-*", "Name=vpc-id,Values="+vpc); !strings.Contains(got, a) || !strings.Contains(got, b) {
		t.Errorf("e2e-* instances in %s: %q", vpc, got)
	}
	if got := ids("Name=instance-state-name,Values=stopped"); got != "" {
		t.Errorf("stopped instances: %q", got)
	}
	var desc struct {
		Reservations []struct {
			Instances []struct {
				KeyName, PrivateDnsName, RootDeviceName, BootMode string
				SecurityGroups                                    []struct{ GroupId string }
				BlockDeviceMappings                               []struct {
					DeviceName string
					Ebs        struct{ VolumeId, Status string }
				}
			}
		}
	}
	cli(t, d, &desc, "ec2", "describe-instances", "--instance-ids", a)
	inst := desc.Reservations[0].Instances[0]
	if inst.KeyName != key || inst.PrivateDnsName != "ip-"+strings.ReplaceAll(ipA, ".", "-")+".ec2.internal" || inst.BootMode != "uefi" ||
		len(inst.SecurityGroups) != 1 || inst.SecurityGroups[0].GroupId != server || len(inst.BlockDeviceMappings) != 1 ||
		inst.BlockDeviceMappings[0].DeviceName != "/dev/xvda" || inst.BlockDeviceMappings[0].Ebs.Status != "attached" {
		t.Fatalf("describe-instances %s: %+v", a, inst)
	}
	rootVol := inst.BlockDeviceMappings[0].Ebs.VolumeId
	if got := cliText(t, d, "ec2", "describe-volumes", "--filters", "Name=tag:Name,Values=e2e-root", "--query", "Volumes[0].VolumeId"); got != rootVol {
		t.Errorf("the tagged root volume is %q, want %s", got, rootVol)
	}
	rootSocket := busProp[string](t, bus, "dev.hangar.Storage1", "/dev/hangar/Storage1/volume/"+strings.ReplaceAll(rootVol, "-", "_"), "dev.hangar.Storage1.Volume", "ExportSocket")
	if _, err := os.Stat(rootSocket); err != nil {
		t.Fatalf("root volume's NBD socket: %v", err)
	}
	step("describe filters")

	// Reboot: the guest sees Ctrl-Alt-Del and boots again; still running.
	ups := strings.Count(consoleSDK(t, sdk, a), testami.MarkerUp)
	d.MustAWS("ec2", "reboot-instances", "--instance-ids", a)
	waitUntil(t, 3*time.Minute, a+" to boot again and reach IMDS after reboot", func() bool {
		c := consoleSDK(t, sdk, a)
		i := strings.LastIndex(c, testami.MarkerUp)
		return strings.Count(c, testami.MarkerUp) > ups && strings.Contains(c[i:], testami.MarkerIMDS+" instance-id="+a)
	})
	if c := consoleSDK(t, sdk, a); !strings.Contains(c, testami.MarkerReboot) || instanceState(t, sdk, a) != "running" {
		t.Errorf("after reboot: state %s, reboot marker %v", instanceState(t, sdk, a), strings.Contains(c, testami.MarkerReboot))
	}
	step("rebooted")

	// Stop through ACPI (the CLI's waiter does the waiting), then start.
	d.MustAWS("ec2", "stop-instances", "--instance-ids", a)
	d.MustAWS("ec2", "wait", "instance-stopped", "--instance-ids", a)
	if !strings.Contains(consoleSDK(t, sdk, a), testami.MarkerPoweroff) {
		t.Error("the guest did not see the ACPI power button")
	}
	if p := qemuOf(a); len(p) != 0 {
		t.Errorf("stopped instance still has qemu %v", p)
	}
	step("stopped")
	ups = strings.Count(consoleSDK(t, sdk, a), testami.MarkerUp)
	d.MustAWS("ec2", "start-instances", "--instance-ids", a)
	d.MustAWS("ec2", "wait", "instance-running", "--instance-ids", a)
	waitUntil(t, 3*time.Minute, a+" to reach IMDS after start", func() bool {
		c := consoleSDK(t, sdk, a)
		i := strings.LastIndex(c, testami.MarkerUp)
		return strings.Count(c, testami.MarkerUp) > ups && strings.Contains(c[i:], testami.MarkerIMDS+" instance-id="+a)
	})
	c := consoleSDK(t, sdk, a)
	if l := lastLineWith(c, testami.MarkerLease); !strings.Contains(l, "ip="+ipA+" ") {
		t.Errorf("lease after start %q, want %s again", l, ipA)
	}
	step("started again")

	// Terminate the server: nothing of it stays but its record.
	instPath := func(id string) string { return "/dev/hangar/Compute1/instance/" + strings.ReplaceAll(id, "-", "_") }
	tapA := busProp[[]string](t, bus, "dev.hangar.Compute1", instPath(a), "dev.hangar.Compute1.Instance", "Taps")
	tapB := busProp[[]string](t, bus, "dev.hangar.Compute1", instPath(b), "dev.hangar.Compute1.Instance", "Taps")
	if len(tapA) != 1 || len(tapB) != 1 || !strings.Contains(inNetns(t, ns, "ip", "-o", "link", "show"), tapA[0]+":") {
		t.Fatalf("taps %v and %v, in %s: %s", tapA, tapB, ns, inNetns(t, ns, "ip", "-o", "link", "show"))
	}
	volB := cliText(t, d, "ec2", "describe-instances", "--instance-ids", b, "--query", "Reservations[0].Instances[0].BlockDeviceMappings[0].Ebs.VolumeId")
	d.MustAWS("ec2", "terminate-instances", "--instance-ids", a)
	waitUntil(t, 2*time.Minute, a+" to be terminated", func() bool { return instanceState(t, sdk, a) == "terminated" })
	d.MustAWS("ec2", "wait", "instance-terminated", "--instance-ids", a)
	waitUntil(t, time.Minute, "the root volume to be deleted", func() bool {
		_, err := d.AWS("ec2", "describe-volumes", "--volume-ids", rootVol)
		return err != nil && strings.Contains(err.Error(), "InvalidVolume.NotFound")
	})
	if _, err := os.Stat(rootSocket); !os.IsNotExist(err) {
		t.Errorf("root volume's socket %s after terminate: %v", rootSocket, err)
	}
	if p := qemuOf(a); len(p) != 0 {
		t.Errorf("terminated %s still has qemu %v", a, p)
	}
	waitUntil(t, time.Minute, "the server's tap to leave "+ns, func() bool {
		return !strings.Contains(inNetns(t, ns, "ip", "-o", "link", "show"), tapA[0]+":")
	})
	if got := freeIPs(); got != "10" {
		t.Errorf("after terminate the subnet has %s free addresses, want 10 (11 less the client's)", got)
	}
	want := fmt.Sprintf("vmd instances [%s running]; taps [%s]; ebsd volumes [%s]; EC2 volumes [%s]",
		strings.ReplaceAll(b, "-", "_"), tapB[0], strings.ReplaceAll(volB, "-", "_"), volB)
	if got := leftovers(t, d, bus, ns); got != want {
		t.Errorf("after terminate:\nhave %s\nwant %s (the client's only)", got, want)
	}
	if ifs := busProp[map[string]string](t, bus, "dev.hangar.Network1", vpcPath(vpc), "dev.hangar.Network1.VPC", "Interfaces"); len(ifs) != 1 {
		t.Errorf("netd's interfaces in %s after terminate: %v, want the client's only", vpc, ifs)
	}
	step("server terminated; nothing of it left")

	// hangar dev stopping leaves no guest behind: the client still runs
	// and goes with it, as do the VPC's namespace and taps.
	if len(qemuOf(b)) == 0 {
		t.Fatal("the client's qemu is not running")
	}
	d.Stop()
	if p := qemuOf(b); len(p) != 0 {
		t.Errorf("hangar dev stopped but the client's qemu %v runs on", p)
	}
	if out, _ := exec.Command("ip", "netns", "list").Output(); strings.Contains(string(out), ns) {
		t.Errorf("hangar dev stopped but namespace %s stays", ns)
	}
	step("hangar dev stopped; no guest left")
}

// importDisk sends the disk's non-zero blocks with the EBS direct API and
// returns the completed snapshot's id. start-snapshot, complete-snapshot
// and the partition table's blocks go through the aws CLI; the kernel's
// and initrd's blocks through aws-sdk-go-v2, as tools like coldsnap send
// them: one CLI process per block costs about a second of CPU here.
func importDisk(t *testing.T, d *harness.Dev, disk string) string {
	t.Helper()
	snap := cliText(t, d, "ebs", "start-snapshot", "--volume-size", strconv.Itoa(testami.Size>>30), "--timeout", "60",
		"--description", "hangar e2e test AMI", "--query", "SnapshotId")
	blocks := testami.Blocks(t, disk)
	f, err := os.Open(disk)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	dir := t.TempDir()
	eb := ebs.NewFromConfig(d.SDK())
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		errs []error
		sums = make([][]byte, len(blocks))
		sem  = make(chan struct{}, 4)
	)
	for i, idx := range blocks {
		buf := make([]byte, testami.BlockSize)
		if _, err := f.ReadAt(buf, int64(idx)*testami.BlockSize); err != nil {
			t.Fatal(err)
		}
		sum := sha256.Sum256(buf)
		sums[i] = sum[:]
		checksum := base64.StdEncoding.EncodeToString(sum[:])
		// The GPT: the protective MBR and primary header in block 0, the
		// backup header in the last block.
		viaCLI := idx == 0 || idx == testami.Size/testami.BlockSize-1
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			var err error
			if viaCLI {
				path := filepath.Join(dir, strconv.Itoa(idx))
				if err = os.WriteFile(path, buf, 0o644); err == nil {
					_, err = d.AWS("ebs", "put-snapshot-block", "--snapshot-id", snap, "--block-index", strconv.Itoa(idx),
						"--block-data", path, "--data-length", strconv.Itoa(testami.BlockSize),
						"--checksum", checksum, "--checksum-algorithm", "SHA256")
				}
			} else {
				_, err = eb.PutSnapshotBlock(context.Background(), &ebs.PutSnapshotBlockInput{SnapshotId: aws.String(snap),
					BlockIndex: aws.Int32(int32(idx)), BlockData: bytes.NewReader(buf), DataLength: aws.Int32(testami.BlockSize),
					Checksum: aws.String(checksum), ChecksumAlgorithm: ebstypes.ChecksumAlgorithmChecksumAlgorithmSha256})
			}
			if err != nil {
				mu.Lock()
				errs = append(errs, fmt.Errorf("block %d: %w", idx, err))
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if len(errs) > 0 {
		t.Fatalf("put-snapshot-block: %v", errs[0])
	}
	agg := sha256.Sum256(bytes.Join(sums, nil))
	d.MustAWS("ebs", "complete-snapshot", "--snapshot-id", snap, "--changed-blocks-count", strconv.Itoa(len(blocks)),
		"--checksum", base64.StdEncoding.EncodeToString(agg[:]), "--checksum-algorithm", "SHA256", "--checksum-aggregation-method", "LINEAR")
	t.Logf("imported %d of %d blocks as %s", len(blocks), testami.Size/testami.BlockSize, snap)
	return snap
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func waitUntil(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", d, what)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

func instanceState(t *testing.T, c *ec2.Client, id string) string {
	t.Helper()
	out, err := c.DescribeInstances(context.Background(), &ec2.DescribeInstancesInput{InstanceIds: []string{id}})
	if err != nil {
		t.Fatalf("describe-instances %s: %v", id, err)
	}
	return string(out.Reservations[0].Instances[0].State.Name)
}

// consoleSDK returns an instance's console output, decoded.
func consoleSDK(t *testing.T, c *ec2.Client, id string) string {
	t.Helper()
	out, err := c.GetConsoleOutput(context.Background(), &ec2.GetConsoleOutputInput{InstanceId: aws.String(id), Latest: aws.Bool(true)})
	if err != nil {
		t.Fatalf("get-console-output %s: %v", id, err)
	}
	raw, err := base64.StdEncoding.DecodeString(aws.ToString(out.Output))
	if err != nil {
		t.Fatalf("console output of %s is not base64: %v", id, err)
	}
	return strings.ReplaceAll(string(raw), "\r", "")
}

// peek reads an instance's state, console and instance status check
// through the SDK, for a goroutine (it returns errors, never fails the
// test).
func peek(c *ec2.Client, id string) (state, console, status string, err error) {
	ctx := context.Background()
	di, err := c.DescribeInstances(ctx, &ec2.DescribeInstancesInput{InstanceIds: []string{id}})
	if err != nil {
		return "", "", "", fmt.Errorf("describe-instances %s: %w", id, err)
	}
	state = string(di.Reservations[0].Instances[0].State.Name)
	co, err := c.GetConsoleOutput(ctx, &ec2.GetConsoleOutputInput{InstanceId: aws.String(id), Latest: aws.Bool(true)})
	if err != nil {
		return "", "", "", fmt.Errorf("get-console-output %s: %w", id, err)
	}
	raw, err := base64.StdEncoding.DecodeString(aws.ToString(co.Output))
	if err != nil {
		return "", "", "", fmt.Errorf("console output of %s is not base64: %w", id, err)
	}
	st, err := c.DescribeInstanceStatus(ctx, &ec2.DescribeInstanceStatusInput{InstanceIds: []string{id}})
	if err != nil {
		return "", "", "", fmt.Errorf("describe-instance-status %s: %w", id, err)
	}
	if len(st.InstanceStatuses) > 0 && st.InstanceStatuses[0].InstanceStatus != nil {
		status = string(st.InstanceStatuses[0].InstanceStatus.Status)
	}
	return state, string(raw), status, nil
}

func lineWith(s, marker string) string {
	for _, l := range strings.Split(s, "\n") {
		if i := strings.Index(l, marker); i >= 0 {
			return strings.TrimSpace(l[i:])
		}
	}
	return ""
}

func lastLineWith(s, marker string) string {
	ls := strings.Split(s, "\n")
	for i := len(ls) - 1; i >= 0; i-- {
		if j := strings.Index(ls[i], marker); j >= 0 {
			return strings.TrimSpace(ls[i][j:])
		}
	}
	return ""
}

// devBus connects to the dev host's private system bus, where an operator
// would use busctl.
func devBus(t *testing.T, d *harness.Dev) *dbus.Conn {
	t.Helper()
	conn, err := dbus.Connect(d.BusAddress())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func busProp[T any](t *testing.T, conn *dbus.Conn, dest, path, iface, name string) T {
	t.Helper()
	var v T
	p, err := conn.Object(dest, dbus.ObjectPath(path)).GetProperty(iface + "." + name)
	if err != nil {
		t.Fatalf("%s %s %s.%s: %v", dest, path, iface, name, err)
	}
	if err := p.Store(&v); err != nil {
		t.Fatalf("%s.%s is %s: %v", iface, name, p.Signature(), err)
	}
	return v
}

func vpcPath(vpc string) string {
	return "/dev/hangar/Network1/vpc/" + strings.ReplaceAll(vpc, "-", "_")
}

// vpcNamespace waits for netd to have made the VPC's namespace.
func vpcNamespace(t *testing.T, conn *dbus.Conn, vpc string) string {
	t.Helper()
	var ns string
	waitUntil(t, 30*time.Second, "netd to hold "+vpc, func() bool {
		p, err := conn.Object("dev.hangar.Network1", dbus.ObjectPath(vpcPath(vpc))).GetProperty("dev.hangar.Network1.VPC.Namespace")
		if err != nil {
			return false
		}
		_ = p.Store(&ns)
		return ns != ""
	})
	return ns
}

func inNetns(t *testing.T, ns string, args ...string) string {
	t.Helper()
	out, err := exec.Command("ip", append([]string{"netns", "exec", ns}, args...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("ip netns exec %s %s: %v: %s", ns, strings.Join(args, " "), err, out)
	}
	return string(out)
}

// leftovers sums up what the services hold that a launch creates: vmd's
// instances, netd's interfaces and taps in the VPC, ebsd's volumes (by
// bus object and by the EC2 API).
func leftovers(t *testing.T, d *harness.Dev, conn *dbus.Conn, ns string) string {
	t.Helper()
	children := func(dest, path string) []string {
		var xml string
		if err := conn.Object(dest, dbus.ObjectPath(path)).Call("org.freedesktop.DBus.Introspectable.Introspect", 0).Store(&xml); err != nil {
			t.Fatalf("introspecting %s %s: %v", dest, path, err)
		}
		var names []string
		for _, part := range strings.Split(xml, "<node name=\"")[1:] {
			names = append(names, part[:strings.IndexByte(part, '"')])
		}
		sort.Strings(names)
		return names
	}
	var taps []string
	for _, l := range strings.Split(inNetns(t, ns, "ip", "-o", "link", "show"), "\n") {
		if f := strings.Fields(l); len(f) > 1 && strings.HasPrefix(f[1], "ht-") {
			taps = append(taps, strings.TrimSuffix(f[1], ":"))
		}
	}
	// vmd keeps a terminated instance's record (and console) until the
	// gateway forgets it; it holds nothing else.
	vmdObjs := []string{}
	if has(children("dev.hangar.Compute1", "/dev/hangar/Compute1"), "instance") {
		for _, c := range children("dev.hangar.Compute1", "/dev/hangar/Compute1/instance") {
			st := busProp[string](t, conn, "dev.hangar.Compute1", "/dev/hangar/Compute1/instance/"+c, "dev.hangar.Compute1.Instance", "State")
			if st != "terminated" {
				vmdObjs = append(vmdObjs, c+" "+st)
			}
		}
	}
	ebsObjs := []string{}
	if has(children("dev.hangar.Storage1", "/dev/hangar/Storage1"), "volume") {
		ebsObjs = children("dev.hangar.Storage1", "/dev/hangar/Storage1/volume")
	}
	volumes := cliText(t, d, "ec2", "describe-volumes", "--query", "sort(Volumes[].VolumeId)")
	return fmt.Sprintf("vmd instances %v; taps %v; ebsd volumes %v; EC2 volumes [%s]", vmdObjs, taps, ebsObjs, volumes)
}

func has(l []string, s string) bool {
	for _, x := range l {
		if x == s {
			return true
		}
	}
	return false
}

// qemuOf lists the live QEMU processes of an instance.
func qemuOf(id string) []int {
	var pids []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cmdline, err := os.ReadFile("/proc/" + e.Name() + "/cmdline")
		if err != nil || !bytes.Contains(cmdline, []byte("guest="+id+",")) {
			continue
		}
		stat, _ := os.ReadFile("/proc/" + e.Name() + "/stat")
		if i := bytes.LastIndexByte(stat, ')'); i > 0 && i+2 < len(stat) && (stat[i+2] == 'Z' || stat[i+2] == 'X') {
			continue
		}
		pids = append(pids, pid)
	}
	return pids
}

// killGuestsAtEnd makes sure no guest of a failed test outlives it.
func killGuestsAtEnd(t *testing.T, id string) {
	t.Cleanup(func() {
		for _, pid := range qemuOf(id) {
			t.Logf("killing leftover qemu %d of %s", pid, id)
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	})
}
