package image

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"hangar.dev/hangar/image/vm"
	"hangar.dev/hangar/tests/harness"
)

// TestQEMU boots the real disk (UEFI, systemd-boot, ext4 root) under TCG,
// hands host.conf in through a NoCloud seed as a fleet's cloud-init would,
// drives the API through the forwarded port with the aws CLI, and powers
// the guest off through QMP.
func TestQEMU(t *testing.T) {
	img := builtImage(t)
	harness.Require(t, "qemu-system-x86_64", "qemu-img", "mkfs.vfat", "mcopy", harness.AWSCLI)
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()

	dir := t.TempDir()
	const (
		account = "210987654321"
		keyID   = "AKIAHANGARQEMUTEST01"
		secret  = "qemuTestSecretqemuTestSecretqemuTestSecr"
	)
	hostConf := fmt.Sprintf("ACCOUNT_ID=%s\nREGION=eu-west-1\nALLOW_SOFTWARE_EMULATION=yes\nHOST_RESERVE_MEMORY_MB=256\nADMIN_ACCESS_KEY_ID=%s\nADMIN_SECRET_ACCESS_KEY=%s\n", account, keyID, secret)
	seed := filepath.Join(dir, "seed.img")
	if err := vm.MakeSeed(ctx, seed, vm.UserData(hostConf), "hangar-qemu-test", "hangar-qemu"); err != nil {
		t.Fatal(err)
	}
	creds := filepath.Join(dir, "credentials")
	if err := os.WriteFile(creds, []byte(fmt.Sprintf("[default]\naws_access_key_id = %s\naws_secret_access_key = %s\n", keyID, secret)), 0o600); err != nil {
		t.Fatal(err)
	}

	port := harness.FreePort(t)
	endpoint := fmt.Sprintf("http://127.0.0.1:%d", port)
	machine, err := vm.Boot(ctx, vm.Config{
		Disk: img.Disk, Dir: dir, Accel: "tcg", MemoryMB: 1536, CPUs: 2,
		Forwards: []vm.Forward{{Host: fmt.Sprintf("127.0.0.1:%d", port), GuestPort: 4566}},
		Seed:     seed,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		select {
		case <-machine.Done():
		default:
			if t.Failed() {
				// Ask the guest itself, over its console, for the journal.
				jctx, jcancel := context.WithTimeout(context.Background(), 90*time.Second)
				out, err := machine.Exec(jctx, "systemctl --failed --no-pager; journalctl -b --no-pager -n 120 -o short-monotonic")
				jcancel()
				t.Logf("guest journal (%v):\n%s", err, out)
			}
			machine.Kill()
		}
		if t.Failed() {
			t.Logf("serial console (%s):\n%s\nQEMU:\n%s", machine.SerialLogPath(), tail(machine.Serial(), 12000), machine.QEMUOutput())
		}
	})

	// Boot to API ready: the forwarded port answers HTTP (QEMU accepts the
	// connection at once; only a listening gateway answers it).
	client := &http.Client{Timeout: 2 * time.Second}
	deadline := time.Now().Add(6 * time.Minute)
	for {
		resp, err := client.Get(endpoint + "/")
		if err == nil {
			resp.Body.Close()
			break
		}
		select {
		case <-machine.Done():
			t.Fatalf("QEMU exited before the API answered")
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for the API on %s: %v", endpoint, err)
		}
		time.Sleep(500 * time.Millisecond)
	}
	record(t, img, "QEMU TCG (UEFI, 2 vCPUs) boot to API ready: %.1fs", time.Since(machine.Started).Seconds())
	if err := machine.WaitSerial(ctx, "hangar: boot finished"); err != nil {
		t.Fatal(err)
	}
	record(t, img, "QEMU TCG boot to the console's boot-finished line: %.1fs", time.Since(machine.Started).Seconds())

	aws := func(args ...string) string {
		t.Helper()
		cmd := exec.CommandContext(ctx, harness.AWSCLI, append([]string{"--endpoint-url", endpoint}, args...)...)
		cmd.Env = append(os.Environ(), "AWS_SHARED_CREDENTIALS_FILE="+creds, "AWS_CONFIG_FILE=/dev/null",
			"AWS_DEFAULT_REGION=eu-west-1", "AWS_PAGER=", "AWS_EC2_METADATA_DISABLED=true")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("aws %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return strings.TrimSpace(string(out))
	}
	var id struct{ Account, Arn string }
	if err := json.Unmarshal([]byte(aws("sts", "get-caller-identity")), &id); err != nil {
		t.Fatal(err)
	}
	if id.Account != account {
		t.Fatalf("caller identity %+v; host.conf from the seed said account %s", id, account)
	}
	// REGION from the seed's host.conf reached the gateway.
	if zones := aws("ec2", "describe-availability-zones", "--query", "AvailabilityZones[].ZoneName", "--output", "text"); zones != "eu-west-1a" {
		t.Fatalf("zones %q, want eu-west-1a (REGION=eu-west-1 in the seed)", zones)
	}
	serial := machine.Serial()
	for _, want := range []string{"hangar-gateway.service", "readiness: ready"} {
		if !strings.Contains(serial, want) {
			t.Errorf("the console's hangar status lacks %q", want)
		}
	}
	// The disk carries the starter AMI the gateway imports (under TCG that
	// takes minutes; tests/image's nspawn tier waits for it).
	if strings.Contains(serial, "StarterAMIMissing") {
		t.Errorf("first boot found no starter AMI on the disk")
	}
	// A TCG machine shows its guests no AMD-V (nested KVM on TCG aborts
	// QEMU), so the host runs its own guests under TCG and says so.
	if !strings.Contains(serial, "SoftwareEmulationOnly") {
		t.Errorf("the console's hangar status does not say guests run under software emulation")
	}

	// Root logs in on the serial console, as make run's user does.
	out, err := machine.Exec(ctx, "systemctl is-active hangar-gateway hangar.target; hangar status")
	// Kernel and cloud-init lines may interleave with the command's output.
	active := regexp.MustCompile(`(?m)^active\r?$`).FindAllString(out, -1)
	if err != nil || len(active) != 2 || !regexp.MustCompile(`hangar-gateway\.service\s+running`).MatchString(out) {
		t.Errorf("root on the serial console: %v\n%s", err, out)
	}

	// Power off through QMP: ACPI power button, systemd shuts down cleanly.
	downAt := time.Now()
	clean, err := machine.Powerdown(ctx, 3*time.Minute)
	if !clean {
		t.Fatalf("power-off was not clean: %v", err)
	}
	record(t, img, "QEMU TCG power-off through QMP: %.1fs", time.Since(downAt).Seconds())
	if !strings.Contains(machine.Serial(), "reboot: Power down") {
		t.Errorf("the kernel did not report a power-down on the console")
	}
}
