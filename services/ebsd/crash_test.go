package main

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"math/rand"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/godbus/dbus/v5"

	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/internal/awsid"
	"hangar.dev/hangar/tests/harness"
)

// daemon is a hangar-ebsd process on a private bus.
type daemon struct {
	t        *testing.T
	bin      string
	bus      string
	state    string
	runtime  string
	cmd      *exec.Cmd
	done     chan error
	client   *api.StorageClient
	busConn  *dbus.Conn
	logFile  string
	restarts int
}

func buildEbsd(t *testing.T) string {
	t.Helper()
	if d := os.Getenv("HANGAR_BIN_DIR"); d != "" {
		if p := filepath.Join(d, "hangar-ebsd"); fileExists(p) {
			return p
		}
	}
	out := filepath.Join(t.TempDir(), "hangar-ebsd")
	if b, err := exec.Command("go", "build", "-o", out, ".").CombinedOutput(); err != nil {
		t.Fatalf("building hangar-ebsd: %v\n%s", err, b)
	}
	return out
}

func fileExists(p string) bool { _, err := os.Stat(p); return err == nil }

func startDaemon(t *testing.T) *daemon {
	harness.Require(t, "dbus-daemon", "qemu-io", "qemu-img")
	dir := t.TempDir()
	d := &daemon{t: t, bin: buildEbsd(t), bus: harness.StartBus(t), state: filepath.Join(dir, "state"),
		runtime: filepath.Join(dir, "run"), logFile: filepath.Join(dir, "ebsd.log")}
	conn, err := dbus.Connect(d.bus)
	if err != nil {
		t.Fatal(err)
	}
	d.busConn = conn
	d.client = api.NewStorageClient(conn)
	t.Cleanup(func() {
		d.kill(syscall.SIGTERM)
		conn.Close()
		if t.Failed() {
			raw, _ := os.ReadFile(d.logFile)
			t.Logf("hangar-ebsd log:\n%s", raw)
		}
	})
	d.start()
	return d
}

func (d *daemon) start() {
	d.t.Helper()
	logf, err := os.OpenFile(d.logFile, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		d.t.Fatal(err)
	}
	defer logf.Close()
	d.cmd = exec.Command(d.bin, "--config", filepath.Join(d.state, "no-host.json"), "--state-dir", d.state, "--runtime-dir", d.runtime)
	d.cmd.Env = append(os.Environ(), "DBUS_SYSTEM_BUS_ADDRESS="+d.bus, "NOTIFY_SOCKET=")
	d.cmd.Stdout, d.cmd.Stderr = logf, logf
	if err := d.cmd.Start(); err != nil {
		d.t.Fatal(err)
	}
	d.done = make(chan error, 1)
	go func(c *exec.Cmd, done chan error) { done <- c.Wait() }(d.cmd, d.done)
	// Named condition: the bus name answers Status.
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, err := d.client.Status(ctx)
		cancel()
		if err == nil {
			return
		}
		select {
		case err := <-d.done:
			d.t.Fatalf("hangar-ebsd exited before owning its bus name: %v", err)
		default:
		}
		if time.Now().After(deadline) {
			d.t.Fatalf("hangar-ebsd did not answer Status within 30s: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (d *daemon) kill(sig syscall.Signal) {
	if d.cmd == nil || d.cmd.Process == nil {
		return
	}
	_ = d.cmd.Process.Signal(sig)
	select {
	case <-d.done:
	case <-time.After(20 * time.Second):
		_ = d.cmd.Process.Kill()
		<-d.done
	}
	d.cmd = nil
}

func qemuIO(t *testing.T, target string, imageOpts bool, cmds ...string) (string, error) {
	args := []string{}
	if imageOpts {
		args = append(args, "--image-opts")
	} else {
		args = append(args, "-f", "raw")
	}
	for _, c := range cmds {
		args = append(args, "-c", c)
	}
	args = append(args, target)
	out, err := exec.Command("qemu-io", args...).CombinedOutput()
	if err == nil && (strings.Contains(string(out), "failed") || strings.Contains(string(out), "rror")) {
		err = fmt.Errorf("qemu-io reported a failure")
	}
	return string(out), err
}

// TestKillNineLosesNoFlushedWrite kills hangar-ebsd with SIGKILL at random
// points of a qemu-io loop that writes a batch and flushes it, restarts
// it, and checks that every batch whose flush was acknowledged reads back,
// round after round.
func TestKillNineLosesNoFlushedWrite(t *testing.T) {
	d := startDaemon(t)
	ctx := context.Background()
	vol, err := d.client.CreateVolume(ctx, awsid.New("vol"), 64<<20, "")
	if err != nil {
		t.Fatal(err)
	}
	if vol.ExportSocket != filepath.Join(d.runtime, vol.VolumeID+".sock") {
		t.Fatalf("export socket %q", vol.ExportSocket)
	}
	rng := rand.New(rand.NewSource(time.Now().UnixNano()))
	const batches, batchSize = 200, 256 << 10
	type batch struct{ pattern, index int }
	var survivors []batch // acknowledged in earlier rounds and not overwritten
	for round := 0; round < 5; round++ {
		pattern := func(b int) int { return (round*61+b)%250 + 1 }
		var cmds []string
		for b := 0; b < batches; b++ {
			cmds = append(cmds, fmt.Sprintf("write -P %d %d %d", pattern(b), b*batchSize, batchSize), "flush")
		}
		args := []string{"-f", "raw"}
		for _, c := range cmds {
			args = append(args, "-c", c)
		}
		args = append(args, "nbd:unix:"+vol.ExportSocket)
		io := exec.Command("qemu-io", args...)
		out := &strings.Builder{}
		io.Stdout, io.Stderr = out, out
		if err := io.Start(); err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Duration(15+rng.Intn(200)) * time.Millisecond)
		d.kill(syscall.SIGKILL)
		_ = io.Wait()
		// A batch is acknowledged when its flush returned: qemu-io runs
		// commands in order, so every "wrote" line but the last is a
		// write whose flush was answered.
		wrote := strings.Count(out.String(), "wrote ")
		acked := max(wrote-1, 0)
		d.start()
		for b := 0; b < acked; b++ {
			if o, err := qemuIO(t, "nbd:unix:"+vol.ExportSocket, false, fmt.Sprintf("read -P %d %d %d", pattern(b), b*batchSize, batchSize)); err != nil {
				t.Fatalf("round %d: batch %d of %d acknowledged batches did not survive kill -9: %v\n%s", round, b, acked, err, o)
			}
		}
		// Batches of earlier rounds that this round did not reach are
		// intact. (Batch number `wrote` may have been in flight when the
		// kill came: unacknowledged, it may or may not have landed.)
		for _, s := range survivors {
			if s.index <= wrote {
				continue
			}
			if o, err := qemuIO(t, "nbd:unix:"+vol.ExportSocket, false, fmt.Sprintf("read -P %d %d %d", s.pattern, s.index*batchSize, batchSize)); err != nil {
				t.Fatalf("round %d: batch %d of an earlier round was damaged: %v\n%s", round, s.index, err, o)
			}
		}
		next := survivors[:0]
		for _, s := range survivors {
			if s.index > wrote {
				next = append(next, s)
			}
		}
		for b := 0; b < acked; b++ {
			next = append(next, batch{pattern(b), b})
		}
		survivors = next
		t.Logf("round %d: killed after %d acknowledged batches; all read back", round, acked)
	}
}

// TestReconnectAfterRestart: a client with reconnect-delay keeps working
// across a kill -9 and restart of ebsd, because the export comes back at
// the same path.
func TestReconnectAfterRestart(t *testing.T) {
	d := startDaemon(t)
	ctx := context.Background()
	vol, err := d.client.CreateVolume(ctx, awsid.New("vol"), 8<<20, "")
	if err != nil {
		t.Fatal(err)
	}
	opts := "driver=nbd,server.type=unix,server.path=" + vol.ExportSocket + ",reconnect-delay=30"
	io := exec.Command("qemu-io", "--image-opts",
		"-c", "write -P 7 0 1M", "-c", "flush", "-c", "sleep 2500",
		"-c", "write -P 8 1M 1M", "-c", "flush", "-c", "read -P 7 0 1M", "-c", "read -P 8 1M 1M", opts)
	out := &strings.Builder{}
	io.Stdout, io.Stderr = out, out
	if err := io.Start(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1200 * time.Millisecond)
	d.kill(syscall.SIGKILL)
	d.start()
	if err := io.Wait(); err != nil || strings.Contains(out.String(), "failed") {
		t.Fatalf("qemu-io across the restart: %v\n%s", err, out)
	}
	if strings.Count(out.String(), "read ") != 2 {
		t.Fatalf("qemu-io did not finish its reads:\n%s", out)
	}
	// The objects come back too.
	info, err := d.client.GetVolume(ctx, vol.VolumeID)
	if err != nil || info.ExportSocket != vol.ExportSocket {
		t.Fatalf("after restart: %v %+v", err, info)
	}
	var size uint64
	if err := d.busConn.Object(api.Storage.Name, api.VolumePath(vol.VolumeID)).StoreProperty(api.StorageVolumeInterface+".SizeBytes", &size); err != nil || size != 8<<20 {
		t.Fatalf("SizeBytes property: %v %d", err, size)
	}
}

// TestKillNineLosesNoAcknowledgedBlock kills hangar-ebsd with SIGKILL at
// random points while 8 writers put blocks of an EBS direct snapshot over
// the bus (group-committed into the snapshot's pack), restarts it, and
// puts only the blocks whose PutBlock was not acknowledged, round after
// round. Completing with the full count then proves no acknowledged block
// was lost (a lost one would leave the count short), and every block reads
// back with its content.
func TestKillNineLosesNoAcknowledgedBlock(t *testing.T) {
	d := startDaemon(t)
	ctx := context.Background()
	const blocks = 96
	snap := awsid.New("snap")
	if _, err := d.client.StartSnapshot(ctx, api.StartSnapshotArgs{SnapshotID: snap, VolumeSizeBytes: blocks * api.SnapshotBlockSize}); err != nil {
		t.Fatal(err)
	}
	content := func(i int) ([]byte, string) {
		b := make([]byte, api.SnapshotBlockSize)
		for k := 0; k < len(b); k += 64 {
			copy(b[k:], fmt.Sprintf("block %06d offset %010d ", i, k))
		}
		s := sha256.Sum256(b)
		return b, base64.StdEncoding.EncodeToString(s[:])
	}
	rng := rand.New(rand.NewSource(time.Now().UnixNano()))
	acked := make([]bool, blocks)
	left := func() []int {
		var out []int
		for i, ok := range acked {
			if !ok {
				out = append(out, i)
			}
		}
		return out
	}
	for round := 0; len(left()) > 0; round++ {
		todo := left()
		// Kill after a random number of this round's blocks were
		// acknowledged (so every round makes progress however slow the
		// machine), with the other writers' blocks in flight; the last
		// round runs to its end.
		killAfter := 1 + rng.Intn(min(24, len(todo)))
		last := len(todo) <= 8
		var mu sync.Mutex
		var wg sync.WaitGroup
		next := 0
		ackedNow := make(chan struct{}, len(todo))
		for w := 0; w < 8; w++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					mu.Lock()
					if next >= len(todo) {
						mu.Unlock()
						return
					}
					i := todo[next]
					next++
					mu.Unlock()
					b, sum := content(i)
					cctx, cancel := context.WithTimeout(ctx, 60*time.Second)
					err := d.client.PutBlock(cctx, snap, uint64(i), b, sum)
					cancel()
					if err != nil {
						return // the daemon is gone: not acknowledged
					}
					mu.Lock()
					acked[i] = true
					mu.Unlock()
					ackedNow <- struct{}{}
				}
			}()
		}
		if !last {
			deadline := time.After(2 * time.Minute)
			for k := 0; k < killAfter; k++ {
				select {
				case <-ackedNow:
				case <-deadline:
					t.Fatalf("round %d: %d of %d blocks acknowledged within 2 minutes", round, k, killAfter)
				}
			}
			d.kill(syscall.SIGKILL)
		}
		wg.Wait()
		n := blocks - len(left())
		d.kill(syscall.SIGKILL)
		d.start()
		t.Logf("round %d: killed after %d more acknowledged; %d of %d blocks acknowledged so far", round, killAfter, n, blocks)
	}
	// The snapshot was resumed at each restart; every acknowledged block
	// is in it, so the full count completes it.
	if _, err := d.client.CompleteSnapshot(ctx, api.CompleteSnapshotArgs{SnapshotID: snap, ChangedBlocks: blocks}); err != nil {
		t.Fatalf("completing with every block acknowledged: %v", err)
	}
	page, err := d.client.ListBlocks(ctx, snap, 0, 1000)
	if err != nil || len(page.Blocks) != blocks {
		t.Fatalf("listing: %v, %d blocks", err, len(page.Blocks))
	}
	for _, b := range page.Blocks {
		got, sum, err := d.client.GetBlock(ctx, snap, b.Index, b.Token)
		want, wantSum := content(int(b.Index))
		if err != nil || sum != wantSum || !bytes.Equal(got, want) {
			t.Fatalf("block %d reads back wrong: %v", b.Index, err)
		}
	}
	// And after one more restart, still.
	d.kill(syscall.SIGKILL)
	d.start()
	got, _, err := d.client.GetBlock(ctx, snap, page.Blocks[0].Index, page.Blocks[0].Token)
	if want, _ := content(int(page.Blocks[0].Index)); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("after a restart block %d reads back wrong: %v", page.Blocks[0].Index, err)
	}
}
