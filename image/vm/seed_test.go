package vm

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

func TestMakeSeed(t *testing.T) {
	for _, p := range []string{"mkfs.vfat", "mcopy", "fatlabel"} {
		if _, err := exec.LookPath(p); err != nil {
			t.Skipf("skipping: %s is not installed (make test installs dosfstools and mtools)", p)
		}
	}
	dir := t.TempDir()
	seed := filepath.Join(dir, "seed.img")
	ud := UserData("REGION=eu-west-1\nAPI_TLS_NAMES=\"a.example, b.example\"\n")
	if err := MakeSeed(context.Background(), seed, ud, "i-test", "host-a"); err != nil {
		t.Fatal(err)
	}
	// cloud-init finds a NoCloud seed by its label.
	label, err := exec.Command("fatlabel", seed).CombinedOutput()
	if err != nil || strings.TrimSpace(string(label)) != "CIDATA" {
		t.Fatalf("label %q, %v", label, err)
	}
	read := func(name string) string {
		out := filepath.Join(dir, name)
		cmd := exec.Command("mcopy", "-i", seed, "::/"+name, out)
		cmd.Env = append(os.Environ(), "MTOOLS_SKIP_CHECK=1")
		if b, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("mcopy %s: %v %s", name, err, b)
		}
		raw, _ := os.ReadFile(out)
		return string(raw)
	}
	if got := read("user-data"); got != ud {
		t.Fatalf("user-data %q", got)
	}
	if got := read("meta-data"); got != "instance-id: i-test\nlocal-hostname: host-a\n" {
		t.Fatalf("meta-data %q", got)
	}
	want := "write_files:\n  - path: /etc/hangar/host.conf\n"
	if !strings.HasPrefix(ud, "#cloud-config\n") || !strings.Contains(ud, want) || !strings.Contains(ud, "      API_TLS_NAMES=\"a.example, b.example\"\n") {
		t.Fatalf("user data:\n%s", ud)
	}
}
