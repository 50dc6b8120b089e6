package image

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"hangar.dev/hangar/tests/harness"
)

// instanceHostConf is what a test host needs to run a guest on a 2-core
// machine without usable KVM: software emulation, and no vCPU kept back
// (a t3.micro has 2 vCPUs). Memory is never overcommitted; half a GiB kept
// back is plenty for the container's services.
const instanceHostConf = "ALLOW_SOFTWARE_EMULATION=yes\nHOST_RESERVE_VCPU=0\nHOST_RESERVE_MEMORY_MB=512\n"

// The container's LAN: a veth whose container end is the host's uplink and
// whose other end sits in a namespace of the test standing for a machine
// on the LAN. Public IPs come from the same /24, as on a metal host's LAN.
const (
	lanUplink    = "uplink0"
	lanHostAddr  = "192.0.2.1/24"  // the hangar host on its uplink
	lanPeerAddr  = "192.0.2.2/24"  // a machine on the LAN
	lanPublicIPs = "192.0.2.16/28" // PUBLIC_IP_POOL
)

// TestNspawnInstance launches the starter AMI on the booted image, as a
// user of a fresh host would: the image's own units under systemd, the
// gateway importing the bundled disk at start, the aws CLI against the
// container's API. run-instances with a key pair and user data, the
// instance-running waiter, the user data's marker on the console, ssh with
// the key from inside the VPC, IMDSv2 from inside the guest, the guest's
// transient unit in hangar-vms.slice; then terminate, and nothing is left.
func TestNspawnInstance(t *testing.T) {
	if testing.Short() {
		t.Skip("skipping: boots a Debian guest under emulation (minutes)")
	}
	img := builtImage(t)
	if _, err := os.Stat(filepath.Join(img.Rootfs, "usr/share/hangar/starter/ami.env")); err != nil {
		t.Skip("skipping: the image has no starter AMI (built with HANGAR_STARTER_AMI=no)")
	}
	harness.RequireRoot(t)
	harness.Require(t, harness.AWSCLI, "nsenter")
	if _, err := os.Stat("/dev/net/tun"); err != nil {
		t.Skip("skipping: no /dev/net/tun for the guest's tap")
	}

	dir := t.TempDir()
	hostConf := filepath.Join(dir, "host.conf")
	conf := instanceHostConf + "UPLINK_INTERFACE=" + lanUplink + "\nPUBLIC_IP_POOL=" + lanPublicIPs + "\n"
	if err := os.WriteFile(hostConf, []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	// host.conf as cloud-init's write_files leaves it, before first boot;
	// the uplink is there from the start, as a metal host's NIC is.
	lanVeth := fmt.Sprintf("hl-%d", os.Getpid())
	c := bootContainer(t, img, "--bind-ro="+hostConf+":/etc/hangar/host.conf",
		"--network-veth-extra="+lanVeth+":"+lanUplink)
	lanNS := lanNamespace(t, c, lanVeth)
	c.waitActive("hangar-gateway.service", 2*time.Minute)
	booted := time.Since(c.started)
	creds := c.copyOut("/etc/hangar/credentials")
	aws := func(args ...string) string {
		t.Helper()
		return c.mustAWS(creds, args...)
	}

	// What a failure needs to be understood: the guest's console and the
	// journals of everything that took part. Registered after the container
	// is up, so it runs before the container stops.
	var instance string
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		if instance != "" {
			console, _ := c.run("sh", "-c", "tail -c 20000 /var/lib/hangar/vmd/instances/"+instance+"/console.log")
			t.Logf("guest console (%s):\n%s", instance, console)
		}
		units := []string{"hangar-gateway", "hangar-vmd", "hangar-netd", "hangar-ebsd"}
		if instance != "" {
			units = append(units, "hangar-vm-"+instance)
		}
		for _, u := range units {
			// The gateway logs every request; the rest is what tells.
			j, _ := c.run("sh", "-c", "journalctl -b -u "+u+" --no-pager -o short-monotonic | grep -v msg=request | tail -n 60")
			t.Logf("journalctl -u %s:\n%s", u, j)
		}
	})

	// The readiness report says what vmd does: TCG, allowed.
	t.Run("readiness agrees with vmd's accelerator", func(t *testing.T) {
		checkAcceleratorVerdict(t, c)
	})

	// 1. The starter AMI, imported by the gateway at start.
	var ami string
	waitFor(t, 3*time.Minute, "the starter AMI hangar/debian-12-x86_64 to be available", func() bool {
		out, err := c.aws(creds, "--endpoint-url", "http://127.0.0.1:4566", "ec2", "describe-images", "--owners", "self",
			"--filters", "Name=name,Values=hangar/debian-12-x86_64", "Name=state,Values=available",
			"--query", "Images[0].ImageId", "--output", "text")
		if err == nil && strings.HasPrefix(out, "ami-") {
			ami = out
			return true
		}
		return false
	})
	journal := c.must("journalctl", "-b", "-u", "hangar-gateway", "--no-pager", "-o", "cat")
	importTook := "?"
	if m := regexp.MustCompile(`imported the starter AMI.* duration=(\S+)`).FindStringSubmatch(journal); m != nil {
		importTook = m[1]
	}
	record(t, img, "nspawn: starter AMI %s available %.1fs after boot started (API ready at %.1fs; the gateway's import took %s)",
		ami, time.Since(c.started).Seconds(), booted.Seconds(), importTook)

	// 2. A key pair, kept on the host as an operator would, and a
	// security group that lets ssh in.
	const key = "/root/e2e.pem"
	material := aws("ec2", "create-key-pair", "--key-name", "e2e", "--query", "KeyMaterial", "--output", "text")
	if out, err := c.runInput(context.Background(), material+"\n", "sh", "-c", "umask 077 && cat > "+key); err != nil {
		t.Fatalf("writing the key in the container: %v: %s", err, out)
	}
	vpc := aws("ec2", "describe-vpcs", "--filters", "Name=is-default,Values=true", "--query", "Vpcs[0].VpcId", "--output", "text")
	sg := aws("ec2", "create-security-group", "--group-name", "e2e-ssh", "--description", "ssh from anywhere", "--vpc-id", vpc, "--query", "GroupId", "--output", "text")
	aws("ec2", "authorize-security-group-ingress", "--group-id", sg, "--protocol", "tcp", "--port", "22", "--cidr", "0.0.0.0/0")

	// 3. run-instances with user data that prints a marker on the console.
	nonce := make([]byte, 6)
	rand.Read(nonce)
	marker := "HANGAR-E2E-MARKER-" + hex.EncodeToString(nonce)
	userData := "#!/bin/sh\necho " + marker + " > /dev/ttyS0\n"
	udFile := filepath.Join(dir, "user-data")
	if err := os.WriteFile(udFile, []byte(userData), 0o644); err != nil {
		t.Fatal(err)
	}
	launched := time.Now()
	var run struct {
		Instances []struct {
			InstanceId, PrivateIpAddress, VpcId string
			NetworkInterfaces                   []struct{ NetworkInterfaceId string }
		}
	}
	// The CLI reads file:// itself and base64-encodes it, as for any user.
	out := aws("ec2", "run-instances", "--image-id", ami, "--instance-type", "t3.micro", "--count", "1",
		"--key-name", "e2e", "--security-group-ids", sg, "--user-data", "file://"+udFile,
		"--tag-specifications", "ResourceType=instance,Tags=[{Key=Name,Value=e2e}]")
	runTook := time.Since(launched)
	if err := json.Unmarshal([]byte(out), &run); err != nil || len(run.Instances) != 1 {
		t.Fatalf("run-instances answered %v:\n%s", err, out)
	}
	inst := run.Instances[0]
	instance = inst.InstanceId
	if inst.PrivateIpAddress == "" || len(inst.NetworkInterfaces) != 1 || inst.VpcId != vpc {
		t.Fatalf("run-instances: %+v (default VPC %s)", inst, vpc)
	}
	eni := inst.NetworkInterfaces[0].NetworkInterfaceId
	state := func() string {
		out, _ := c.aws(creds, "--endpoint-url", "http://127.0.0.1:4566", "ec2", "describe-instances", "--instance-ids", instance,
			"--query", "Reservations[0].Instances[0].State.Name", "--output", "text")
		return out
	}

	// 4. Running: measured by polling every second, then the CLI's own
	// waiter must agree (its first poll returns at once).
	waitFor(t, 3*time.Minute, instance+" to be running", func() bool {
		switch s := state(); s {
		case "running":
			return true
		case "pending", "":
			return false
		default:
			t.Fatalf("%s went %s while starting", instance, s)
			return false
		}
	})
	running := time.Since(launched)
	if out, err := c.awsWithin(5*time.Minute, creds, "--endpoint-url", "http://127.0.0.1:4566", "ec2", "wait", "instance-running", "--instance-ids", instance); err != nil {
		t.Fatalf("aws ec2 wait instance-running: %v\n%s", err, out)
	}

	// 5. The user data ran: its marker is on the console.
	consoleOutput := func() string {
		out, _ := c.aws(creds, "--endpoint-url", "http://127.0.0.1:4566", "ec2", "get-console-output", "--instance-id", instance,
			"--latest", "--query", "Output", "--output", "text")
		return out
	}
	waitFor(t, 4*time.Minute, "the user data's marker "+marker+" on the console", func() bool {
		if s := state(); s != "running" {
			t.Fatalf("%s is %s while booting", instance, s)
		}
		return strings.Contains(consoleOutput(), marker)
	})
	markerAt := time.Since(launched)

	// 6. ssh with the key pair from inside the VPC, as docs/operations.md
	// says: on the host, `ip netns exec hangar-vpc-… ssh` (the VPC's router
	// namespace, as netd names it; the image's own ssh client).
	vpcNS := "hangar-vpc-" + strings.TrimPrefix(vpc, "vpc-")
	if out, err := c.run("ip", "netns", "exec", vpcNS, "true"); err != nil {
		ls, _ := c.run("ls", "-l", "/run/netns")
		t.Fatalf("cannot enter the VPC's namespace %s: %v: %s\n%s", vpcNS, err, out, ls)
	}
	ssh := func(stdin, remote string) (string, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		return c.runInput(ctx, stdin, "ip", "netns", "exec", vpcNS, "ssh", "-i", key,
			"-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes",
			"-o", "ConnectTimeout=5", "-o", "LogLevel=ERROR", "admin@"+inst.PrivateIpAddress, remote)
	}
	// user-data.txt is root's (0600); admin has sudo, as on Debian's AMIs.
	var got string
	var sshErr error
	deadline := time.Now().Add(2 * time.Minute)
	for {
		if got, sshErr = ssh("", "sudo cat /var/lib/cloud/instance/user-data.txt"); sshErr == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("ssh admin@%s with the key pair from the VPC: %v\n%s", inst.PrivateIpAddress, sshErr, got)
		}
		time.Sleep(2 * time.Second)
	}
	sshAt := time.Since(launched)
	if got+"\n" != userData { // runInput trims the last newline
		t.Errorf("the guest's user-data.txt is %q, sent %q", got, userData)
	}

	// 7. IMDSv2 from inside the guest: a token by PUT, then the instance id
	// with it. Python is there for cloud-init; curl is not in the AMI.
	const imdsV2 = `import urllib.request as u
base = "http://169.254.169.254/latest/"
tok = u.urlopen(u.Request(base + "api/token", method="PUT", headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"}), timeout=10).read().decode()
print(u.urlopen(u.Request(base + "meta-data/instance-id", headers={"X-aws-ec2-metadata-token": tok}), timeout=10).read().decode())
`
	if out, err := ssh(imdsV2, "python3 -"); err != nil || out != instance {
		t.Errorf("IMDSv2 from inside the guest: %v: %q, want %s", err, out, instance)
	}
	// 7b. ssh from a machine on the LAN through an Elastic IP: netd answers
	// ARP for it on the uplink and maps it 1:1 to the private address.
	var alloc struct{ AllocationId, PublicIp string }
	if err := json.Unmarshal([]byte(aws("ec2", "allocate-address", "--domain", "vpc")), &alloc); err != nil || alloc.PublicIp == "" {
		t.Fatalf("allocate-address: %v %+v", err, alloc)
	}
	aws("ec2", "associate-address", "--allocation-id", alloc.AllocationId, "--instance-id", instance)
	associated := time.Now()
	if pub := aws("ec2", "describe-instances", "--instance-ids", instance, "--query", "Reservations[0].Instances[0].PublicIpAddress", "--output", "text"); pub != alloc.PublicIp {
		t.Errorf("describe-instances shows public IP %q, associated %s", pub, alloc.PublicIp)
	}
	lanKey := filepath.Join(dir, "e2e.pem")
	if err := os.WriteFile(lanKey, []byte(material+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	var fromLAN string
	var lanErr error
	deadline = time.Now().Add(time.Minute)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		raw, err := exec.CommandContext(ctx, "ip", "netns", "exec", lanNS, "ssh", "-i", lanKey,
			"-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes",
			"-o", "ConnectTimeout=5", "-o", "LogLevel=ERROR", "admin@"+alloc.PublicIp, "cat /var/lib/cloud/data/instance-id; ip -4 -o addr show scope global").CombinedOutput()
		cancel()
		fromLAN, lanErr = string(raw), err
		if lanErr == nil || time.Now().After(deadline) {
			break
		}
		time.Sleep(2 * time.Second)
	}
	if lanErr != nil || !strings.Contains(fromLAN, instance) || !strings.Contains(fromLAN, " "+inst.PrivateIpAddress+"/") {
		t.Errorf("ssh admin@%s (Elastic IP of %s) from the LAN: %v\n%s", alloc.PublicIp, instance, lanErr, fromLAN)
	} else {
		record(t, img, "nspawn instance: ssh from the LAN through Elastic IP %s answered %.1fs after associate-address: %s",
			alloc.PublicIp, time.Since(associated).Seconds(), strings.Join(strings.Fields(fromLAN)[:5], " "))
	}
	aws("ec2", "disassociate-address", "--association-id", aws("ec2", "describe-addresses", "--allocation-ids", alloc.AllocationId,
		"--query", "Addresses[0].AssociationId", "--output", "text"))
	aws("ec2", "release-address", "--allocation-id", alloc.AllocationId)

	// Restarting netd keeps the guest's network: the namespace, bridge and
	// tap stay, and the new netd serves IMDS again.
	c.must("systemctl", "restart", "hangar-netd.service")
	c.waitActive("hangar-netd.service", time.Minute)
	waitFor(t, time.Minute, "IMDSv2 in the guest after a restart of netd", func() bool {
		out, err := ssh(imdsV2, "python3 -")
		return err == nil && out == instance
	})
	record(t, img, "nspawn instance (starter AMI, t3.micro, %s): run-instances answered %.1fs; running %.1fs; user-data marker on the console %.1fs; ssh ok %.1fs",
		accelOf(c), runTook.Seconds(), running.Seconds(), markerAt.Seconds(), sshAt.Seconds())

	// 8. What an operator sees: the guest's transient unit in
	// hangar-vms.slice, QEMU in its cgroup, limits from the instance type;
	// its NIC on netd's tap inside the VPC, not on a tap of the host's.
	unit := "hangar-vm-" + instance + ".service"
	status, _ := c.run("systemctl", "status", "--no-pager", "--lines=0", unit)
	if !strings.Contains(status, "active (running)") || !strings.Contains(status, "hangar-vms.slice/"+unit) ||
		!regexp.MustCompile(`qemu-system-x86_64 -name guest=`+instance).MatchString(status) {
		t.Errorf("systemctl status %s:\n%s", unit, status)
	}
	p := c.show(unit, "Slice", "CPUQuotaPerSecUSec", "MemoryMax", "MainPID")
	mem, _ := strconv.ParseInt(p["MemoryMax"], 10, 64)
	if p["Slice"] != "hangar-vms.slice" || p["CPUQuotaPerSecUSec"] != "2s" || mem <= 1<<30 || p["MainPID"] == "0" {
		t.Errorf("%s: %v (want the slice, 100%% CPU per vCPU of a t3.micro, memory above its 1 GiB)", unit, p)
	}
	tap := linkWithAlias(t, c, vpcNS, "hangar-netd "+eni)
	if tap.name == "" {
		t.Errorf("no tap of %s in the VPC's namespace", eni)
	} else {
		if !strings.Contains(tap.flags, "LOWER_UP") {
			t.Errorf("the tap %s of %s has no carrier (is QEMU on it?): %s", tap.name, eni, tap.flags)
		}
		if out, err := c.run("ip", "link", "show", tap.name); err == nil {
			t.Errorf("a tap %s exists in the host's namespace too (QEMU opened a new one by name):\n%s", tap.name, out)
		}
	}

	// 9. Terminate: nothing is left of the instance but its record.
	root := aws("ec2", "describe-instances", "--instance-ids", instance, "--query",
		"Reservations[0].Instances[0].BlockDeviceMappings[0].Ebs.VolumeId", "--output", "text")
	stopAt := time.Now()
	aws("ec2", "terminate-instances", "--instance-ids", instance)
	if out, err := c.awsWithin(5*time.Minute, creds, "--endpoint-url", "http://127.0.0.1:4566", "ec2", "wait", "instance-terminated", "--instance-ids", instance); err != nil {
		t.Fatalf("aws ec2 wait instance-terminated: %v\n%s", err, out)
	}
	terminated := time.Since(stopAt)
	waitFor(t, time.Minute, "the guest's unit to be gone", func() bool {
		return c.show(unit, "LoadState")["LoadState"] == "not-found"
	})
	if out, err := c.run("pgrep", "-af", "guest="+instance); err == nil {
		t.Errorf("QEMU of %s is still running:\n%s", instance, out)
	}
	if tap.name != "" {
		waitFor(t, time.Minute, "the tap "+tap.name+" to be gone", func() bool {
			return linkWithAlias(t, c, vpcNS, "hangar-netd "+eni).name == ""
		})
	}
	waitFor(t, time.Minute, "the root volume "+root+" to be deleted", func() bool {
		out, err := c.aws(creds, "--endpoint-url", "http://127.0.0.1:4566", "ec2", "describe-volumes", "--volume-ids", root)
		return err != nil && strings.Contains(out, "InvalidVolume.NotFound")
	})
	if out, _ := c.run("busctl", "tree", "--list", "dev.hangar.Storage1"); strings.Contains(out, strings.ReplaceAll(root, "-", "_")) {
		t.Errorf("ebsd still has %s:\n%s", root, out)
	}
	if _, err := c.run("test", "-e", "/run/hangar/ebs/"+root+".sock"); err == nil {
		t.Errorf("ebsd still serves %s", root)
	}
	record(t, img, "nspawn instance: terminate-instances to terminated (waiter) %.1fs", terminated.Seconds())
}

// checkAcceleratorVerdict checks that first boot's readiness report says
// what hangar-vmd does with guests: KVM (no reason), TCG
// (SoftwareEmulationOnly) or nothing (KVMUnavailable).
func checkAcceleratorVerdict(t *testing.T, c *container) {
	t.Helper()
	raw := c.must("cat", "/run/hangar/readiness.json")
	var r struct {
		Reasons []struct {
			Code, Message string
			Fatal         bool
		}
	}
	if err := json.Unmarshal([]byte(raw), &r); err != nil {
		t.Fatalf("readiness.json: %v\n%s", err, raw)
	}
	codes := map[string]string{}
	for _, x := range r.Reasons {
		codes[x.Code] = x.Message
	}
	accel := accelOf(c)
	_, tcg := codes["SoftwareEmulationOnly"]
	_, none := codes["KVMUnavailable"]
	switch {
	case accel == "kvm" && !tcg && !none,
		accel == "tcg" && tcg && !none,
		accel == "none" && none && !tcg:
	default:
		t.Errorf("vmd's accelerator is %s, but first boot's readiness says %v", accel, r.Reasons)
	}
	t.Logf("accelerator %s; readiness %v", accel, r.Reasons)
}

// accelOf is hangar-vmd's Accelerator property: kvm, tcg, or none.
func accelOf(c *container) string {
	out := c.must("busctl", "get-property", "dev.hangar.Compute1", "/dev/hangar/Compute1", "dev.hangar.Compute1", "Accelerator")
	v := strings.Trim(strings.TrimPrefix(out, "s "), `"`)
	if v == "" {
		return "none"
	}
	return v
}

// lanNamespace gives the container's uplink a LAN: its address inside the
// container, and the veth's other end (made by systemd-nspawn in this
// namespace) moved into a namespace of its own standing for a machine on
// the LAN, so the test touches none of this machine's own interfaces.
func lanNamespace(t *testing.T, c *container, veth string) string {
	t.Helper()
	ns := fmt.Sprintf("hangar-lan-%d", os.Getpid())
	ip := func(args ...string) {
		t.Helper()
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	ip("netns", "add", ns)
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", ns).Run() })
	ip("link", "set", veth, "netns", ns)
	ip("-n", ns, "addr", "add", lanPeerAddr, "dev", veth)
	ip("-n", ns, "link", "set", veth, "up")
	c.must("ip", "addr", "add", lanHostAddr, "dev", lanUplink)
	c.must("ip", "link", "set", lanUplink, "up")
	return ns
}

type link struct{ name, flags string }

// linkWithAlias finds the link whose alias is alias in the container's
// network namespace ns (netd marks every link it makes with its AWS id).
func linkWithAlias(t *testing.T, c *container, ns, alias string) link {
	t.Helper()
	out, err := c.run("ip", "netns", "exec", ns, "ip", "-o", "link", "show")
	if err != nil {
		t.Fatalf("ip link in %s: %v\n%s", ns, err, out)
	}
	for _, line := range strings.Split(out, "\n") {
		if !strings.HasSuffix(strings.TrimSpace(line), `alias `+alias) {
			continue
		}
		// "7: ht-0123abcd: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu …"
		f := strings.Fields(line)
		if len(f) >= 3 {
			return link{name: strings.TrimSuffix(strings.SplitN(f[1], "@", 2)[0], ":"), flags: f[2]}
		}
	}
	return link{}
}
