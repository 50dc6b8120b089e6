package vm

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The probe answers in words, and caches its answer for this boot of the
// host: a second call reads the cache (the cache file is the proof).
func TestProbeKVMCaches(t *testing.T) {
	kernel := os.Getenv("HANGAR_IMAGE_DIR")
	if kernel == "" {
		t.Skip("skipping: HANGAR_IMAGE_DIR is not set (make test sets it to the built image)")
	}
	kernel = filepath.Join(kernel, "vmlinuz")
	if _, err := os.Stat(kernel); err != nil {
		t.Skipf("skipping: no image kernel at %s", kernel)
	}
	cache := filepath.Join(t.TempDir(), "kvm-probe")
	ok, why := ProbeKVM(context.Background(), kernel, cache)
	if why == "" {
		t.Fatal("the probe gave no reason")
	}
	t.Logf("KVM usable: %v (%s)", ok, why)
	raw, err := os.ReadFile(cache)
	if err != nil || !strings.Contains(string(raw), kernel) {
		t.Fatalf("cache %q, %v", raw, err)
	}
	// A planted answer is returned as is: the second call did not probe.
	lines := strings.SplitN(string(raw), "\n", 2)
	os.WriteFile(cache, []byte(lines[0]+"\nno planted answer\n"), 0o644)
	if ok2, why2 := ProbeKVM(context.Background(), kernel, cache); ok2 || why2 != "planted answer" {
		t.Fatalf("second call = %v %q, want the cached answer", ok2, why2)
	}
}
