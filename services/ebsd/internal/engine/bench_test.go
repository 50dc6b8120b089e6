package engine

// Measurements of the engine alone, without the bus, the gateway and the
// rest of hangar dev, to tell where the time of the end-to-end figures in
// tests/bench goes. Run by make bench (HANGAR_BENCH=1); each figure is a
// ratio against a baseline measured in the same run.

import (
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/internal/awsid"
)

func requireBench(t *testing.T) {
	if os.Getenv("HANGAR_BENCH") == "" {
		t.Skip("skipping: a benchmark; run it with make bench (HANGAR_BENCH=1)")
	}
}

// cpuSeconds is the CPU time (user and system) this process used so far.
func cpuSeconds() float64 {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return float64(ru.Utime.Nano()+ru.Stime.Nano()) / 1e9
}

var runCompleted = regexp.MustCompile(`Run completed in ([0-9.]+) seconds`)

type benchResult struct {
	opsPerSec          float64
	serverUs, clientUs float64 // CPU per operation
}

// qemuBench runs qemu-img bench (4 KiB, depth 32) and measures the CPU the
// client and this process (the NBD server, when target is an export) used.
func qemuBench(t *testing.T, target string, ops int, write bool) benchResult {
	t.Helper()
	args := []string{"bench", "-f", "raw", "-c", strconv.Itoa(ops), "-d", "32", "-s", "4k"}
	if write {
		args = append(args, "-w", "--pattern=0x5a")
	}
	args = append(args, target)
	c0 := cpuSeconds()
	cmd := exec.Command("qemu-img", args...)
	out, err := cmd.CombinedOutput()
	server := cpuSeconds() - c0
	if err != nil {
		t.Fatalf("qemu-img %v: %v\n%s", args, err, out)
	}
	m := runCompleted.FindSubmatch(out)
	if m == nil {
		t.Fatalf("qemu-img bench said: %s", out)
	}
	secs, _ := strconv.ParseFloat(string(m[1]), 64)
	client := (cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()).Seconds()
	return benchResult{float64(ops) / secs, server * 1e6 / float64(ops), client * 1e6 / float64(ops)}
}

// TestBenchNBDInProcess runs qemu-img bench against a raw file and the
// engine's export in alternating rounds and reports the median ratio and
// the CPU each side spends per 4 KiB request.
func TestBenchNBDInProcess(t *testing.T) {
	requireBench(t)
	requireQEMU(t)
	en := newEnv(t)
	v := en.volume(1<<30, "")
	raw := filepath.Join(t.TempDir(), "raw")
	if err := os.WriteFile(raw, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(raw, 1<<30); err != nil {
		t.Fatal(err)
	}
	for _, target := range []string{raw, nbdURL(v.ExportSocket)} {
		qemuBench(t, target, 262144, true) // allocate and fill both
	}
	const rounds, ops = 5, 50000
	for _, write := range []bool{false, true} {
		var ratios []float64
		var last, lastRaw benchResult
		for r := 0; r < rounds; r++ {
			lastRaw = qemuBench(t, raw, ops, write)
			last = qemuBench(t, nbdURL(v.ExportSocket), ops, write)
			ratios = append(ratios, last.opsPerSec/lastRaw.opsPerSec)
		}
		slices.Sort(ratios)
		t.Logf("4 KiB sequential write=%v, depth 32, %d rounds: NBD/raw median %.2fx (%.2f); last round: raw %.0f/s (qemu-img %.1f µs CPU/op), NBD %.0f/s (ebsd %.1f + qemu-img %.1f µs CPU/op)",
			write, rounds, ratios[rounds/2], ratios, lastRaw.opsPerSec, lastRaw.clientUs, last.opsPerSec, last.serverUs, last.clientUs)
	}
}

// TestBenchEnginePutBlock: 16 goroutines put 2 GiB of distinct blocks
// into a direct snapshot through the engine (hash, pack, group commit),
// against the same goroutines hashing and writing each block to a file of
// its own with fsync.
func TestBenchEnginePutBlock(t *testing.T) {
	requireBench(t)
	en := newEnv(t)
	const writers, blocks = 16, 4096
	base := make([]byte, BlockSize)
	for i := range base {
		base[i] = byte(i * 7)
	}
	block := func(i int) ([]byte, string) {
		b := bytes.Clone(base)
		copy(b, fmt.Sprintf("%08d", i))
		s := sha256.Sum256(b)
		return b, base64.StdEncoding.EncodeToString(s[:])
	}
	run := func(put func(i int) error) (time.Duration, float64) {
		var next atomic.Int64
		var wg sync.WaitGroup
		c0 := cpuSeconds()
		start := time.Now()
		for w := 0; w < writers; w++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					i := int(next.Add(1) - 1)
					if i >= blocks {
						return
					}
					if err := put(i); err != nil {
						t.Error(err)
						return
					}
				}
			}()
		}
		wg.Wait()
		return time.Since(start), (cpuSeconds() - c0) * 1e6 / blocks
	}
	dir := filepath.Join(t.TempDir(), "baseline")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	baseT, baseCPU := run(func(i int) error {
		b, _ := block(i)
		s := sha256.Sum256(b)
		f, err := os.Create(filepath.Join(dir, fmt.Sprintf("%x", s)))
		if err != nil {
			return err
		}
		defer f.Close()
		if _, err := f.Write(b); err != nil {
			return err
		}
		return f.Sync()
	})
	snap := awsid.New("snap")
	if _, err := en.e.StartSnapshot(api.StartSnapshotArgs{SnapshotID: snap, VolumeSizeBytes: blocks * BlockSize}); err != nil {
		t.Fatal(err)
	}
	gotT, gotCPU := run(func(i int) error {
		b, sum := block(i)
		return en.e.PutBlock(snap, uint64(i), b, sum)
	})
	en.e.mu.Lock()
	syncs := en.e.pending[snap].pack.Syncs()
	en.e.mu.Unlock()
	start := time.Now()
	if _, err := en.e.CompleteSnapshot(api.CompleteSnapshotArgs{SnapshotID: snap, ChangedBlocks: blocks}); err != nil {
		t.Fatal(err)
	}
	mb := float64(blocks*BlockSize) / 1e6
	t.Logf("engine PutBlock, %d writers, %d MB: %.0f MB/s (%.0f µs CPU/block, %d fdatasyncs for %d blocks); file per block + fsync %.0f MB/s (%.0f µs CPU/block); ratio %.2fx; CompleteSnapshot %.2fs",
		writers, int(mb), mb/gotT.Seconds(), gotCPU, syncs, blocks, mb/baseT.Seconds(), baseCPU, baseT.Seconds()/gotT.Seconds(), time.Since(start).Seconds())
}
