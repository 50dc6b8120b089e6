// Package image boots hangar's image and drives it as its users do. Two
// tiers share one image build (make test builds it first, as root):
//
//   - nspawn: the image's root tree under systemd-nspawn, systemd as PID 1
//     and the real system bus, in seconds;
//   - QEMU: the real GPT disk under TCG with a NoCloud seed, as make run
//     boots it, in about a minute.
//
// Without a built image, root, or the tools, each test skips with one line.
package image

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"hangar.dev/hangar/image/vm"
	"hangar.dev/hangar/tests/harness"
)

// builtImage finds the image make test built (HANGAR_IMAGE_DIR), or
// image/out when run by hand.
func builtImage(t *testing.T) *vm.Image {
	t.Helper()
	dir := os.Getenv("HANGAR_IMAGE_DIR")
	if dir == "" {
		dir = filepath.Join(harness.RepoRoot(t), "image", "out")
	}
	// Hold the image's lock shared while the test runs, so nobody's
	// image/build.sh replaces it underneath (builds take it exclusively).
	if f, err := os.Open(filepath.Join(dir, ".lock")); err == nil {
		if err := syscall.Flock(int(f.Fd()), syscall.LOCK_SH); err == nil {
			t.Cleanup(func() { f.Close() })
		} else {
			f.Close()
		}
	}
	img, err := vm.LoadImage(dir)
	if err != nil {
		t.Skipf("skipping: no built image in %s (make test builds it as root; or run make image)", dir)
	}
	return img
}

// record appends a measurement to the image directory's measurements.txt
// (boot times, sizes, security exposure), for docs and the closing note.
func record(t *testing.T, img *vm.Image, format string, args ...any) {
	line := fmt.Sprintf(format, args...)
	t.Log(line)
	f, err := os.OpenFile(filepath.Join(img.Dir, "measurements.txt"), os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		return
	}
	defer f.Close()
	fmt.Fprintf(f, "%s %s: %s\n", time.Now().Format(time.RFC3339), t.Name(), line)
}

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// waitFor polls cond until it holds or the deadline passes, and names the
// condition that never came.
func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", d, what)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func runOut(name string, args ...string) (string, error) {
	out, err := exec.Command(name, args...).CombinedOutput()
	return strings.TrimSpace(string(out)), err
}
