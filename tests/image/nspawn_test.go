package image

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"hangar.dev/hangar/image/vm"
	"hangar.dev/hangar/tests/harness"
)

// container is the image's root tree booted by systemd-nspawn: systemd as
// PID 1, the image's own D-Bus, units and users, its own network namespace
// (only loopback), and a throwaway overlay over the tree so nothing it does
// reaches the built image.
type container struct {
	t       *testing.T
	cmd     *exec.Cmd
	console *lockedBuffer
	leader  int
	done    chan struct{}
	started time.Time
}

// bootContainer boots the image's tree; extra are more systemd-nspawn
// arguments (a host.conf bound in, say).
func bootContainer(t *testing.T, img *vm.Image, extra ...string) *container {
	t.Helper()
	harness.RequireRoot(t)
	harness.Require(t, "systemd-nspawn", "nsenter")
	c := &container{t: t, console: &lockedBuffer{}, done: make(chan struct{})}
	args := []string{"--boot", "--directory=" + img.Rootfs, "--volatile=overlay",
		"--register=no", "--keep-unit", "--private-network", "--console=read-only",
		"--machine=" + fmt.Sprintf("hangar-test-%d", os.Getpid())}
	for _, dev := range []string{"/dev/kvm", "/dev/net/tun"} {
		if _, err := os.Stat(dev); err == nil {
			args = append(args, "--bind="+dev)
		}
	}
	c.cmd = exec.Command("systemd-nspawn", append(args, extra...)...)
	c.cmd.Stdout, c.cmd.Stderr = c.console, c.console
	c.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	c.started = time.Now()
	if err := c.cmd.Start(); err != nil {
		t.Fatalf("starting systemd-nspawn: %v", err)
	}
	go func() { _ = c.cmd.Wait(); close(c.done) }()
	t.Cleanup(c.stop)

	// The container's PID 1 is nspawn's child running systemd.
	waitFor(t, 30*time.Second, "systemd to start as the container's PID 1", func() bool {
		select {
		case <-c.done:
			t.Fatalf("systemd-nspawn exited:\n%s", c.console)
		default:
		}
		c.leader = childSystemd(c.cmd.Process.Pid)
		return c.leader != 0
	})
	// Early on, nsenter may find systemd before its bus is up, and the
	// answer is an error rather than a state: wait for a state.
	waitFor(t, 30*time.Second, "the container's systemd to answer on its bus", func() bool {
		state, _ := c.run("systemctl", "is-system-running")
		switch state {
		case "initializing", "starting", "running", "degraded", "maintenance":
			return true
		}
		return false
	})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	state, _ := c.runCtx(ctx, "systemctl", "is-system-running", "--wait")
	if state != "running" {
		failed, _ := c.run("systemctl", "--failed", "--no-legend", "--plain")
		t.Fatalf("the container booted to %q, not running; failed units:\n%s", state, failed)
	}
	return c
}

func childSystemd(pid int) int {
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/children", pid))
	for _, f := range tasks {
		raw, _ := os.ReadFile(f)
		for _, field := range strings.Fields(string(raw)) {
			child, _ := strconv.Atoi(field)
			comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", child))
			if strings.TrimSpace(string(comm)) == "systemd" {
				return child
			}
		}
	}
	return 0
}

// stop powers the container off (nspawn turns SIGTERM into a clean
// shutdown of its systemd) and, if the test failed, prints the console and
// the journal first.
func (c *container) stop() {
	if c.t.Failed() && c.leader != 0 {
		journal, _ := c.run("journalctl", "-b", "--no-pager", "-n", "150", "-o", "short-monotonic")
		c.t.Logf("container console:\n%s\n\ncontainer journal (last 150 lines):\n%s", tail(c.console.String(), 6000), journal)
	}
	_ = c.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-c.done:
	case <-time.After(30 * time.Second):
		_ = syscall.Kill(-c.cmd.Process.Pid, syscall.SIGKILL)
		<-c.done
	}
}

func tail(s string, n int) string {
	if len(s) > n {
		return "…" + s[len(s)-n:]
	}
	return s
}

// run runs a command inside the container (all its namespaces: its file
// system, its bus, its systemd).
func (c *container) run(args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	return c.runCtx(ctx, args...)
}

func (c *container) runCtx(ctx context.Context, args ...string) (string, error) {
	return c.runInput(ctx, "", args...)
}

// runInput runs a command inside the container with stdin.
func (c *container) runInput(ctx context.Context, stdin string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, "nsenter", append([]string{"-t", strconv.Itoa(c.leader), "-a", "--"}, args...)...)
	cmd.Env = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8", "SYSTEMD_COLORS=0", "SYSTEMD_PAGER="}
	cmd.Stdin = strings.NewReader(stdin)
	out, err := cmd.CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

func (c *container) must(args ...string) string {
	c.t.Helper()
	out, err := c.run(args...)
	if err != nil {
		c.t.Fatalf("%s in the container: %v\n%s", strings.Join(args, " "), err, out)
	}
	return out
}

// sh runs a shell line inside the container.
func (c *container) sh(script string) string {
	c.t.Helper()
	return c.must("sh", "-c", script)
}

// show returns unit properties.
func (c *container) show(unit string, props ...string) map[string]string {
	c.t.Helper()
	out := c.must("systemctl", "show", unit, "-p", strings.Join(props, ","))
	m := map[string]string{}
	for _, line := range strings.Split(out, "\n") {
		if k, v, ok := strings.Cut(line, "="); ok {
			m[k] = v
		}
	}
	return m
}

func (c *container) waitActive(unit string, d time.Duration) {
	c.t.Helper()
	waitFor(c.t, d, unit+" to be active", func() bool {
		out, _ := c.run("systemctl", "is-active", unit)
		return out == "active"
	})
}

// aws runs the host's aws CLI inside the container's network namespace
// only, against its 127.0.0.1:4566, with the container's credentials.
func (c *container) aws(creds string, args ...string) (string, error) {
	return c.awsWithin(60*time.Second, creds, args...)
}

// awsWithin is aws with its own deadline (the CLI's waiters poll for minutes).
func (c *container) awsWithin(d time.Duration, creds string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	cmd := exec.CommandContext(ctx, "nsenter", append([]string{"-t", strconv.Itoa(c.leader), "-n", "--", harness.AWSCLI}, args...)...)
	cmd.Env = append(os.Environ(), "AWS_SHARED_CREDENTIALS_FILE="+creds, "AWS_CONFIG_FILE=/dev/null",
		"AWS_DEFAULT_REGION=us-east-1", "AWS_PAGER=", "AWS_EC2_METADATA_DISABLED=true")
	out, err := cmd.CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

func (c *container) mustAWS(creds string, args ...string) string {
	c.t.Helper()
	out, err := c.aws(creds, append([]string{"--endpoint-url", "http://127.0.0.1:4566"}, args...)...)
	if err != nil {
		c.t.Fatalf("aws %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return out
}

// copyOut copies a file from the container to the host, mode 0600.
func (c *container) copyOut(path string) string {
	c.t.Helper()
	dst := filepath.Join(c.t.TempDir(), filepath.Base(path))
	if err := os.WriteFile(dst, []byte(c.must("cat", path)+"\n"), 0o600); err != nil {
		c.t.Fatal(err)
	}
	return dst
}

// hangarServices are the hangar service units the image holds.
func hangarServices(t *testing.T, img *vm.Image) []string {
	units, _ := filepath.Glob(filepath.Join(img.Rootfs, "usr/lib/systemd/system/hangar-*.service"))
	var out []string
	for _, u := range units {
		out = append(out, filepath.Base(u))
	}
	if len(out) < 3 {
		t.Fatalf("the image holds too few hangar units: %v", out)
	}
	return out
}

func TestNspawn(t *testing.T) {
	img := builtImage(t)
	c := bootContainer(t, img)
	harness.Require(t, harness.AWSCLI)

	// Boot to API ready: the gateway is active only after READY=1, which
	// it sends once its bus name is owned and its listener is open.
	c.waitActive("hangar-gateway.service", 2*time.Minute)
	record(t, img, "nspawn boot to API ready (hangar-gateway READY=1): %.1fs", time.Since(c.started).Seconds())

	t.Run("every hangar unit is active", func(t *testing.T) {
		for _, unit := range append(hangarServices(t, img), "hangar.target") {
			p := c.show(unit, "LoadState", "ActiveState", "SubState")
			if p["LoadState"] != "loaded" || p["ActiveState"] != "active" {
				t.Errorf("%s: %v", unit, p)
			}
		}
		if p := c.show("hangar-vms.slice", "LoadState"); p["LoadState"] != "loaded" {
			t.Errorf("hangar-vms.slice: %v", p)
		}
	})

	t.Run("the console says the host is up", func(t *testing.T) {
		waitFor(t, time.Minute, "the boot-finished line on the console", func() bool {
			return strings.Contains(c.console.String(), "hangar: boot finished")
		})
		if !regexp.MustCompile(`hangar-gateway\.service\s+running`).MatchString(c.console.String()) {
			t.Errorf("the console's hangar status does not show the gateway running:\n%s", tail(c.console.String(), 3000))
		}
	})

	t.Run("services sent READY=1 and a status line", func(t *testing.T) {
		for _, unit := range hangarServices(t, img) {
			p := c.show(unit, "Type", "ActiveState", "SubState", "StatusText", "NRestarts", "WatchdogUSec", "BusName")
			if p["Type"] == "oneshot" && unit == "hangar-firstboot.service" {
				// Without host.conf software emulation is not allowed, so
				// a machine without usable KVM (this one) is not ready,
				// and the status line names why.
				ready := strings.HasPrefix(p["StatusText"], "host ready: account ")
				noKVM := strings.HasPrefix(p["StatusText"], "host NOT READY: account ") && strings.Contains(p["StatusText"], "; KVMUnavailable: ")
				if !ready && !noKVM {
					t.Errorf("%s: %v", unit, p)
				}
				continue
			}
			if p["Type"] != "notify" {
				continue
			}
			if p["SubState"] != "running" || p["StatusText"] == "" || p["NRestarts"] != "0" || p["WatchdogUSec"] == "0" || p["WatchdogUSec"] == "infinity" || p["BusName"] == "" {
				t.Errorf("%s: %v", unit, p)
			}
		}
	})

	t.Run("readiness says what vmd does with guests", func(t *testing.T) {
		checkAcceleratorVerdict(t, c)
	})

	t.Run("the gateway's interface is on the system bus", func(t *testing.T) {
		out := c.must("busctl", "introspect", "--no-pager", "dev.hangar.Gateway1", "/dev/hangar/Gateway1")
		for _, want := range []string{"dev.hangar.Gateway1", ".Status", ".Version", "org.freedesktop.DBus.Properties"} {
			if !strings.Contains(out, want) {
				t.Errorf("introspection lacks %q:\n%s", want, out)
			}
		}
	})

	t.Run("policy: only root and group hangar may call", func(t *testing.T) {
		call := []string{"busctl", "call", "dev.hangar.Gateway1", "/dev/hangar/Gateway1", "dev.hangar.Gateway1", "Status"}
		out, err := c.run(append([]string{"setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"}, call...)...)
		if err == nil || !strings.Contains(out, "Access denied") {
			t.Errorf("a call from nobody was not refused: %v: %s", err, out)
		}
		c.must("useradd", "--no-create-home", "--groups", "hangar", "--shell", "/usr/sbin/nologin", "hangar-operator")
		if out, err := c.run(append([]string{"setpriv", "--reuid=hangar-operator", "--regid=hangar-operator", "--init-groups"}, call...)...); err != nil {
			t.Errorf("a member of group hangar was refused: %v: %s", err, out)
		}
		// Owning a service's name is not for other users either.
		out, err = c.run("setpriv", "--reuid=hangar-ebs", "--regid=hangar-ebs", "--init-groups",
			"busctl", "call", "org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus", "RequestName", "su", "dev.hangar.Gateway1", "4")
		if err == nil || !strings.Contains(out, "Access denied") && !strings.Contains(out, "not allowed to own") {
			t.Errorf("ebsd's user could claim the gateway's name: %v: %s", err, out)
		}
	})

	creds := c.copyOut("/etc/hangar/credentials")
	account := c.must("cat", "/var/lib/hangar/account-id")

	t.Run("aws sts get-caller-identity answers on 4566", func(t *testing.T) {
		var id struct{ Account, Arn string }
		if err := json.Unmarshal([]byte(c.mustAWS(creds, "sts", "get-caller-identity")), &id); err != nil {
			t.Fatal(err)
		}
		if id.Account != account || id.Arn != "arn:aws:iam::"+account+":root" {
			t.Fatalf("caller identity %+v, account id file %s", id, account)
		}
	})

	t.Run("restarting the gateway keeps its records", func(t *testing.T) {
		vpc := c.mustAWS(creds, "ec2", "create-vpc", "--cidr-block", "10.42.0.0/16", "--query", "Vpc.VpcId", "--output", "text")
		c.must("systemctl", "restart", "hangar-gateway.service")
		c.waitActive("hangar-gateway.service", time.Minute)
		got := c.mustAWS(creds, "ec2", "describe-vpcs", "--vpc-ids", vpc, "--query", "Vpcs[0].CidrBlock", "--output", "text")
		if got != "10.42.0.0/16" {
			t.Fatalf("after a restart %s has CIDR %q", vpc, got)
		}
	})

	// A VPC is a named network namespace: a mount in /run/netns that must
	// be the host's (ip netns exec, nsenter, operators), not one in a
	// mount namespace of netd's own, which would die with netd.
	t.Run("VPC namespaces are the host's and outlive a netd restart", func(t *testing.T) {
		vpc := c.mustAWS(creds, "ec2", "describe-vpcs", "--filters", "Name=is-default,Values=true", "--query", "Vpcs[0].VpcId", "--output", "text")
		ns := "hangar-vpc-" + strings.TrimPrefix(vpc, "vpc-")
		var before string
		waitFor(t, 30*time.Second, "netd's namespace "+ns+" to be enterable from the host", func() bool {
			out, err := c.run("ip", "netns", "exec", ns, "ip", "-o", "link", "show")
			before = out
			return err == nil && strings.Contains(out, "alias hangar-netd "+vpc)
		})
		inode := c.must("stat", "-L", "-c", "%i", "/run/netns/"+ns)
		c.must("systemctl", "restart", "hangar-netd.service")
		c.waitActive("hangar-netd.service", time.Minute)
		if got := c.must("stat", "-L", "-c", "%i", "/run/netns/"+ns); got != inode {
			t.Errorf("after a restart of netd %s is namespace %s, was %s: the VPC was rebuilt, not kept", ns, got, inode)
		}
		if out, err := c.run("ip", "netns", "exec", ns, "ip", "-o", "link", "show"); err != nil || strings.Count(out, "\n") != strings.Count(before, "\n") {
			t.Errorf("after a restart of netd the links of %s changed: %v\nbefore:\n%s\nafter:\n%s", ns, err, before, out)
		}
	})

	t.Run("a bad key in host.conf is named by hangar status", func(t *testing.T) {
		c.sh(`printf 'REGON=us-west-2\nALLOW_SOFTWARE_EMULATION=yes\n' > /etc/hangar/host.conf`)
		c.must("systemctl", "restart", "hangar-firstboot.service")
		c.waitActive("hangar-gateway.service", time.Minute)
		out, err := c.run("hangar", "status")
		if err == nil {
			t.Errorf("hangar status exited 0 for a host with an invalid host.conf:\n%s", out)
		}
		for _, want := range []string{"NOT READY", "ConfigInvalid: REGON is not a known key; did you mean REGION? (line 1)", "hangar-gateway.service", "running"} {
			if !strings.Contains(out, want) {
				t.Errorf("hangar status lacks %q:\n%s", want, out)
			}
		}
		// The journal says what first boot did.
		journal := c.must("journalctl", "-b", "-u", "hangar-firstboot", "--no-pager", "-o", "cat")
		if !strings.Contains(journal, "REGON") || !strings.Contains(journal, "generated the admin key") {
			t.Errorf("journalctl -u hangar-firstboot does not tell the story:\n%s", journal)
		}
		c.must("rm", "/etc/hangar/host.conf")
		c.must("systemctl", "restart", "hangar-firstboot.service")
		c.waitActive("hangar-gateway.service", time.Minute)
	})

	t.Run("no valid credentials, no API", func(t *testing.T) {
		c.sh(`printf '[default]\nnot a key\n' > /etc/hangar/credentials`)
		c.must("systemctl", "restart", "--no-block", "hangar-firstboot.service")
		waitFor(t, time.Minute, "the gateway to refuse to start", func() bool {
			j, _ := c.run("journalctl", "-b", "-u", "hangar-gateway", "--no-pager", "-o", "cat")
			return strings.Contains(j, "refusing to serve without valid credentials")
		})
		if out, _ := c.run("systemctl", "is-active", "hangar-gateway"); out == "active" {
			t.Error("the gateway is active without valid credentials")
		}
		out, _ := c.run("hangar", "status")
		if !strings.Contains(out, "CredentialsMissing: /etc/hangar/credentials cannot be parsed") {
			t.Errorf("hangar status does not name the credentials:\n%s", out)
		}
		// The service line shows systemd's view of the unit, not just "absent".
		if !regexp.MustCompile(`hangar-gateway\.service\s+(failed|activating)`).MatchString(out) {
			t.Errorf("hangar status does not show the gateway's unit failing:\n%s", out)
		}
		t.Logf("hangar status without credentials:\n%s", out)
		// Removing the broken file lets first boot make a key again.
		c.must("rm", "/etc/hangar/credentials")
		c.must("systemctl", "reset-failed", "hangar-gateway.service")
		c.must("systemctl", "restart", "hangar-firstboot.service")
		c.waitActive("hangar-gateway.service", time.Minute)
		creds = c.copyOut("/etc/hangar/credentials")
		c.mustAWS(creds, "sts", "get-caller-identity")
	})

	t.Run("API_TLS=yes serves HTTPS with the first-boot certificate", func(t *testing.T) {
		c.sh(`printf 'API_TLS=yes\n' > /etc/hangar/host.conf`)
		c.must("systemctl", "restart", "hangar-firstboot.service")
		c.waitActive("hangar-gateway.service", time.Minute)
		ca := c.copyOut("/etc/hangar/tls/ca.crt")
		out, err := c.aws(creds, "--endpoint-url", "https://localhost:4566", "--ca-bundle", ca, "sts", "get-caller-identity")
		if err != nil || !strings.Contains(out, account) {
			t.Fatalf("aws over HTTPS: %v\n%s", err, out)
		}
		c.must("rm", "/etc/hangar/host.conf")
		c.must("systemctl", "restart", "hangar-firstboot.service")
		c.waitActive("hangar-gateway.service", time.Minute)
	})

	t.Run("systemd-analyze verify and security", func(t *testing.T) {
		units := []string{"/usr/lib/systemd/system/hangar.target", "/usr/lib/systemd/system/hangar-vms.slice"}
		for _, u := range hangarServices(t, img) {
			units = append(units, "/usr/lib/systemd/system/"+u)
		}
		out, err := c.run(append([]string{"systemd-analyze", "verify", "--man=no"}, units...)...)
		if err != nil || out != "" {
			t.Errorf("systemd-analyze verify: %v\n%s", err, out)
		}
		exposure := regexp.MustCompile(`Overall exposure level for (\S+): ([0-9.]+) (\S+)`)
		for _, u := range hangarServices(t, img) {
			out, _ := c.run("systemd-analyze", "security", "--no-pager", u)
			m := exposure.FindStringSubmatch(out)
			if m == nil {
				t.Errorf("systemd-analyze security %s: no exposure level in:\n%s", u, out)
				continue
			}
			record(t, img, "systemd-analyze security %s: %s %s", m[1], m[2], m[3])
		}
	})
}
