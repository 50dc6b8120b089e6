package engine

import (
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"fmt"
	"io"
	"log/slog"
	"math/rand"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/internal/awsid"
)

func requireQEMU(t *testing.T) {
	t.Helper()
	for _, p := range []string{"qemu-io", "qemu-img"} {
		if _, err := exec.LookPath(p); err != nil {
			t.Skipf("skipping: %s is not installed (make test installs qemu-utils)", p)
		}
	}
}

func testLog(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

type env struct {
	t       *testing.T
	state   string
	runtime string
	e       *Engine
}

func newEnv(t *testing.T) *env {
	dir := t.TempDir()
	en := &env{t: t, state: filepath.Join(dir, "state"), runtime: filepath.Join(dir, "run")}
	en.open()
	t.Cleanup(func() {
		if en.e != nil {
			en.e.Close()
		}
	})
	return en
}

func (en *env) open() {
	e, err := Open(en.t.Context(), en.state, en.runtime, testLog(en.t), Hooks{})
	if err != nil {
		en.t.Fatal(err)
	}
	en.e = e
}

func (en *env) restart() {
	en.e.Close()
	en.open()
}

func (en *env) volume(size uint64, from string) api.VolumeInfo {
	en.t.Helper()
	v, err := en.e.CreateVolume(awsid.New("vol"), size, from)
	if err != nil {
		en.t.Fatal(err)
	}
	return v
}

func nbdURL(sock string) string { return "nbd:unix:" + sock }

// qemuIO runs qemu-io commands against an export and fails on any error.
func qemuIO(t *testing.T, sock string, cmds ...string) string {
	t.Helper()
	out, err := qemuIOErr(sock, cmds...)
	if err != nil {
		t.Fatalf("qemu-io %v: %v\n%s", cmds, err, out)
	}
	return out
}

func qemuIOErr(sock string, cmds ...string) (string, error) {
	args := []string{"-f", "raw"}
	for _, c := range cmds {
		args = append(args, "-c", c)
	}
	args = append(args, nbdURL(sock))
	out, err := exec.Command("qemu-io", args...).CombinedOutput()
	s := string(out)
	if err == nil && (strings.Contains(s, "failed") || strings.Contains(s, "error") || strings.Contains(s, "Error")) {
		err = fmt.Errorf("qemu-io reported a failure")
	}
	return s, err
}

// readAll copies the whole export out with qemu-img convert.
func readAll(t *testing.T, sock string) []byte {
	t.Helper()
	out := filepath.Join(t.TempDir(), "out.raw")
	if b, err := exec.Command("qemu-img", "convert", "-f", "raw", "-O", "raw", nbdURL(sock), out).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img convert: %v\n%s", err, b)
	}
	raw, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	return raw
}

func fill(img []byte, off, n int, b byte) {
	for i := off; i < off+n; i++ {
		img[i] = b
	}
}

func firstDiff(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	if len(a) != len(b) {
		return min(len(a), len(b))
	}
	return -1
}

const KiB, MiB = 1 << 10, 1 << 20

// TestNBDPatternsAcrossBlocks drives an export with qemu-io: pattern writes
// across 512 KiB block boundaries, trims, zero writes, FUA writes; reads
// verify each, and qemu-img convert reads back exactly the expected image,
// before and after a restart.
func TestNBDPatternsAcrossBlocks(t *testing.T) {
	requireQEMU(t)
	en := newEnv(t)
	v := en.volume(16*MiB, "")
	img := make([]byte, 16*MiB)

	qemuIO(t, v.ExportSocket,
		"write -P 0xab 500k 100k", // crosses the first block boundary
		"write -P 0xcd 1M 2M",
		"write -f -P 0x11 4092k 8k", // FUA, crossing a boundary
		"discard 1536k 512k",        // one whole block
		"write -z 2200k 8k",         // part of a block
		"discard 2600k 100k",        // part of a block
		"write -P 0xee 16380k 4k",   // the last 4 KiB
		"flush",
	)
	fill(img, 500*KiB, 100*KiB, 0xab)
	fill(img, 1*MiB, 2*MiB, 0xcd)
	fill(img, 4092*KiB, 8*KiB, 0x11)
	fill(img, 1536*KiB, 512*KiB, 0)
	fill(img, 2200*KiB, 8*KiB, 0)
	fill(img, 2600*KiB, 100*KiB, 0)
	fill(img, 16380*KiB, 4*KiB, 0xee)

	qemuIO(t, v.ExportSocket,
		"read -P 0xab 500k 100k",
		"read -P 0xcd 1M 512k",
		"read -P 0 1536k 512k",
		"read -P 0 2200k 8k",
		"read -P 0xcd 2208k 392k",
		"read -P 0x11 4092k 8k",
		"read -P 0xee 16380k 4k",
	)
	if got := readAll(t, v.ExportSocket); !bytes.Equal(got, img) {
		t.Fatalf("image differs at byte %d", firstDiff(got, img))
	}
	// qemu-img bench drives many requests in flight.
	if out, err := exec.Command("qemu-img", "bench", "-f", "raw", "-w", "-c", "2000", "-d", "16", "-s", "4k", "-o", "8M", nbdURL(v.ExportSocket)).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img bench: %v\n%s", err, out)
	}
	fill(img, 8*MiB, 2000*4*KiB, 0) // bench writes zeros
	en.restart()
	if got := readAll(t, v.ExportSocket); !bytes.Equal(got, img) {
		t.Fatalf("after restart the image differs at byte %d", firstDiff(got, img))
	}
	info, err := en.e.GetVolume(v.VolumeID)
	if err != nil {
		t.Fatal(err)
	}
	if info.ExportSocket != v.ExportSocket || info.WrittenBytes == 0 {
		t.Fatalf("after restart the volume is %+v", info)
	}
}

func waitSnapshot(t *testing.T, e *Engine, id string) api.SnapshotInfo {
	t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		s, err := e.GetSnapshot(id)
		if err != nil {
			t.Fatal(err)
		}
		if s.State != api.SnapshotPending {
			if s.State != api.SnapshotCompleted {
				t.Fatalf("snapshot %s is %s: %s", id, s.State, s.Error)
			}
			return s
		}
		if time.Now().After(deadline) {
			t.Fatalf("snapshot %s did not complete within 2m (progress %d%%)", id, s.Progress)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestSnapshotIsPointInTimeUnderConcurrentWrites snapshots a volume while
// writers overwrite every block, then proves the snapshot holds exactly the
// data at the moment it was taken (copy-on-write), that a volume made from
// it reads byte-identical over NBD, and that the next snapshot is
// incremental.
func TestSnapshotIsPointInTimeUnderConcurrentWrites(t *testing.T) {
	requireQEMU(t)
	en := newEnv(t)
	const size = 32 * MiB
	v := en.volume(size, "")
	ov := en.e.vols[v.VolumeID]
	before := make([]byte, size)
	rand.New(rand.NewSource(7)).Read(before)
	if err := ov.v.WriteAt(before, 0); err != nil {
		t.Fatal(err)
	}
	after := bytes.Clone(before)
	for i := range after {
		after[i] ^= 0x5a
	}
	snap := awsid.New("snap")
	var wg sync.WaitGroup
	start := make(chan struct{})
	for w := 0; w < 2; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			<-start
			// Each writer rewrites half the blocks, 64 KiB at a time, in an
			// order that races the capture.
			for off := w * 64 * KiB; off < size; off += 128 * KiB {
				if err := ov.v.WriteAt(after[off:off+64*KiB], uint64(off)); err != nil {
					t.Error(err)
					return
				}
			}
		}(w)
	}
	if _, err := en.e.CreateSnapshot(snap, v.VolumeID); err != nil {
		t.Fatal(err)
	}
	close(start)
	wg.Wait()
	s := waitSnapshot(t, en.e, snap)
	if s.BlockCount != size/BlockSize {
		t.Fatalf("snapshot holds %d blocks, want %d", s.BlockCount, size/BlockSize)
	}
	// The volume itself has the new data; the snapshot the old.
	if got := readAll(t, v.ExportSocket); !bytes.Equal(got, after) {
		t.Fatalf("volume differs from what was written at %d", firstDiff(got, after))
	}
	from := en.volume(size, snap)
	if got := readAll(t, from.ExportSocket); !bytes.Equal(got, before) {
		t.Fatalf("volume from the snapshot differs from the point in time at byte %d", firstDiff(got, before))
	}

	// The writes that raced the first snapshot are changes after its point
	// in time: the next snapshot holds them all.
	mid := awsid.New("snap")
	if _, err := en.e.CreateSnapshot(mid, v.VolumeID); err != nil {
		t.Fatal(err)
	}
	if sm := waitSnapshot(t, en.e, mid); sm.ParentID != snap || sm.ChangedBlocks != size/BlockSize {
		t.Fatalf("second snapshot %+v: want all %d blocks changed since %s", sm, size/BlockSize, snap)
	}
	// The next stores only what changed since: change 10 blocks.
	for i := 0; i < 10; i++ {
		off := i*3*BlockSize + 100
		if err := ov.v.WriteAt([]byte{after[off] ^ 0xff}, uint64(off)); err != nil {
			t.Fatal(err)
		}
	}
	snap2 := awsid.New("snap")
	if _, err := en.e.CreateSnapshot(snap2, v.VolumeID); err != nil {
		t.Fatal(err)
	}
	s2 := waitSnapshot(t, en.e, snap2)
	if s2.ParentID != mid || s2.ChangedBlocks != 10 || s2.BlockCount != size/BlockSize {
		t.Fatalf("child snapshot %+v: want parent %s, 10 changed blocks", s2, mid)
	}
	page, err := en.e.ListChangedBlocks(mid, snap2, 0, 100)
	if err != nil {
		t.Fatal(err)
	}
	if len(page.Blocks) != 10 {
		t.Fatalf("ListChangedBlocks = %d blocks, want 10", len(page.Blocks))
	}
	// The snapshot a volume was made from survives deletion while the
	// volume reads from it.
	if err := en.e.DeleteSnapshot(snap); err != nil {
		t.Fatal(err)
	}
	en.restart()
	from2, err := en.e.GetVolume(from.VolumeID)
	if err != nil {
		t.Fatal(err)
	}
	if got := readAll(t, from2.ExportSocket); !bytes.Equal(got, before) {
		t.Fatalf("after deleting its snapshot and a restart, the volume differs at byte %d", firstDiff(got, before))
	}
}

func b64sum(b []byte) string {
	s := sha256.Sum256(b)
	return base64.StdEncoding.EncodeToString(s[:])
}

type memWriter struct{ b []byte }

func (m *memWriter) WriteAt(p []byte, off int64) (int, error) {
	if need := int(off) + len(p); need > len(m.b) {
		m.b = append(m.b, make([]byte, need-len(m.b))...)
	}
	copy(m.b[off:], p)
	return len(p), nil
}

func isErr(err error, name string) bool {
	e, ok := api.AsError(err)
	return ok && e.Name == name
}

// TestDirectSnapshotsAndBadInput writes snapshots block by block as the
// EBS direct API does and checks every bad input is refused with a named
// error and changes nothing; deleting everything frees every block.
func TestDirectSnapshotsAndBadInput(t *testing.T) {
	en := newEnv(t)
	e := en.e
	const size = 64 * MiB
	parent := awsid.New("snap")
	if _, err := e.StartSnapshot(api.StartSnapshotArgs{SnapshotID: parent, VolumeSizeBytes: size, TimeoutMinutes: 60}); err != nil {
		t.Fatal(err)
	}
	blocks := map[uint64][]byte{}
	rng := rand.New(rand.NewSource(3))
	for _, i := range []uint64{0, 1, 5, 17, 100, 127} {
		b := make([]byte, BlockSize)
		rng.Read(b)
		blocks[i] = b
		if err := e.PutBlock(parent, i, b, b64sum(b)); err != nil {
			t.Fatal(err)
		}
	}
	// A duplicate of block 0 at 64 is stored once.
	blocks[64] = blocks[0]
	if err := e.PutBlock(parent, 64, blocks[0], b64sum(blocks[0])); err != nil {
		t.Fatal(err)
	}
	bad := make([]byte, BlockSize)
	for name, c := range map[string]struct {
		err  error
		want string
	}{
		"wrong checksum":   {e.PutBlock(parent, 2, bad, b64sum([]byte("other"))), api.ErrInvalidArgument},
		"index past end":   {e.PutBlock(parent, 128, bad, b64sum(bad)), api.ErrInvalidArgument},
		"short block":      {e.PutBlock(parent, 2, bad[:4096], b64sum(bad[:4096])), api.ErrInvalidArgument},
		"unknown snapshot": {e.PutBlock(awsid.New("snap"), 2, bad, b64sum(bad)), api.ErrNotFound},
	} {
		if !isErr(c.err, c.want) {
			t.Errorf("%s: got %v, want %s", name, c.err, c.want)
		}
	}
	if _, err := e.CompleteSnapshot(api.CompleteSnapshotArgs{SnapshotID: parent, ChangedBlocks: 6}); !isErr(err, api.ErrInvalidArgument) {
		t.Fatalf("completing with a wrong count: %v", err)
	}
	if _, err := e.CompleteSnapshot(api.CompleteSnapshotArgs{SnapshotID: parent, ChangedBlocks: 7, Checksum: b64sum(nil), ChecksumAlgorithm: "SHA256", AggregationMethod: "LINEAR"}); !isErr(err, api.ErrInvalidArgument) {
		t.Fatalf("completing with a wrong aggregated checksum: %v", err)
	}
	// The right aggregated checksum: SHA-256 over the blocks' checksums in
	// index order.
	agg := sha256.New()
	for _, i := range []uint64{0, 1, 5, 17, 64, 100, 127} {
		s := sha256.Sum256(blocks[i])
		agg.Write(s[:])
	}
	done, err := e.CompleteSnapshot(api.CompleteSnapshotArgs{SnapshotID: parent, ChangedBlocks: 7,
		Checksum: base64.StdEncoding.EncodeToString(agg.Sum(nil)), ChecksumAlgorithm: "SHA256", AggregationMethod: "LINEAR"})
	if err != nil {
		t.Fatal(err)
	}
	if done.State != api.SnapshotCompleted || done.BlockCount != 7 || done.StoredBytes != 6*BlockSize {
		t.Fatalf("completed snapshot %+v", done)
	}
	if err := e.PutBlock(parent, 3, bad, b64sum(bad)); !isErr(err, api.ErrConflict) {
		t.Fatalf("a block to a completed snapshot: %v", err)
	}
	page, err := e.ListBlocks(parent, 0, 3)
	if err != nil {
		t.Fatal(err)
	}
	if len(page.Blocks) != 3 || !page.More || page.NextIndex != 6 {
		t.Fatalf("first page %+v", page)
	}
	page, err = e.ListBlocks(parent, page.NextIndex, 100)
	if err != nil {
		t.Fatal(err)
	}
	if len(page.Blocks) != 4 || page.More {
		t.Fatalf("second page %+v", page)
	}
	for _, b := range page.Blocks {
		var w memWriter
		n, sum, err := e.GetBlock(parent, b.Index, b.Token, &w)
		if err != nil {
			t.Fatal(err)
		}
		if n != BlockSize || !bytes.Equal(w.b, blocks[b.Index]) || sum != b64sum(blocks[b.Index]) {
			t.Fatalf("block %d reads back wrong", b.Index)
		}
	}
	if _, _, err := e.GetBlock(parent, 5, page.Blocks[0].Token, &memWriter{}); !isErr(err, api.ErrInvalidArgument) {
		t.Fatalf("a token of another block: %v", err)
	}

	// A child with exactly 10 changed blocks lists exactly those.
	child := awsid.New("snap")
	if _, err := e.StartSnapshot(api.StartSnapshotArgs{SnapshotID: child, VolumeSizeBytes: size, ParentID: parent}); err != nil {
		t.Fatal(err)
	}
	changed := map[uint64]bool{}
	for k := 0; k < 10; k++ {
		i := uint64(k * 11)
		b := make([]byte, BlockSize)
		rng.Read(b)
		changed[i] = true
		if err := e.PutBlock(child, i, b, b64sum(b)); err != nil {
			t.Fatal(err)
		}
	}
	// A restart while pending loses no acknowledged block.
	en.restart()
	e = en.e
	if _, err := e.CompleteSnapshot(api.CompleteSnapshotArgs{SnapshotID: child, ChangedBlocks: 10}); err != nil {
		t.Fatal(err)
	}
	cb, err := e.ListChangedBlocks(parent, child, 0, 1000)
	if err != nil {
		t.Fatal(err)
	}
	if len(cb.Blocks) != 10 {
		t.Fatalf("ListChangedBlocks = %d, want 10", len(cb.Blocks))
	}
	for _, c := range cb.Blocks {
		if !changed[c.Index] || c.SecondToken == "" {
			t.Fatalf("unexpected changed block %+v", c)
		}
		if (c.FirstToken != "") != (blocks[c.Index] != nil) {
			t.Fatalf("block %d: first token %q, parent has block %v", c.Index, c.FirstToken, blocks[c.Index] != nil)
		}
	}
	// Deleting the parent keeps the child whole; deleting both frees all.
	if err := e.DeleteSnapshot(parent); err != nil {
		t.Fatal(err)
	}
	all, err := e.ListBlocks(child, 0, 1000)
	if err != nil {
		t.Fatal(err)
	}
	if len(all.Blocks) != 7+10-1 { // index 0 was rewritten by the child
		t.Fatalf("child lists %d blocks after its parent went, want 16", len(all.Blocks))
	}
	if err := e.DeleteSnapshot(child); err != nil {
		t.Fatal(err)
	}
	if n, _ := e.blocks.Usage(); n != 0 {
		t.Fatalf("%d block files remain after every snapshot was deleted", n)
	}
}

// nbdClient is a minimal client for what qemu-io will not send.
type nbdClient struct {
	c    net.Conn
	size uint64
}

func dialNBD(t *testing.T, sock string) *nbdClient {
	t.Helper()
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	hello := make([]byte, 18)
	if _, err := io.ReadFull(c, hello); err != nil {
		t.Fatal(err)
	}
	_ = binary.Write(c, binary.BigEndian, uint32(3))
	// NBD_OPT_GO with the default export and no info requests.
	opt := make([]byte, 16+6)
	binary.BigEndian.PutUint64(opt, 0x49484156454f5054)
	binary.BigEndian.PutUint32(opt[8:], 7)
	binary.BigEndian.PutUint32(opt[12:], 6)
	if _, err := c.Write(opt); err != nil {
		t.Fatal(err)
	}
	cl := &nbdClient{c: c}
	for {
		h := make([]byte, 20)
		if _, err := io.ReadFull(c, h); err != nil {
			t.Fatal(err)
		}
		typ := binary.BigEndian.Uint32(h[12:])
		data := make([]byte, binary.BigEndian.Uint32(h[16:]))
		if _, err := io.ReadFull(c, data); err != nil {
			t.Fatal(err)
		}
		if typ == 3 && binary.BigEndian.Uint16(data) == 0 {
			cl.size = binary.BigEndian.Uint64(data[2:])
		}
		if typ == 1 {
			return cl
		}
		if typ&(1<<31) != 0 {
			t.Fatalf("NBD_OPT_GO failed with reply %#x", typ)
		}
	}
}

func (cl *nbdClient) send(typ uint16, off uint64, length uint32, data []byte) {
	h := make([]byte, 28)
	binary.BigEndian.PutUint32(h, 0x25609513)
	binary.BigEndian.PutUint16(h[6:], typ)
	binary.BigEndian.PutUint64(h[8:], 42)
	binary.BigEndian.PutUint64(h[16:], off)
	binary.BigEndian.PutUint32(h[24:], length)
	_, _ = cl.c.Write(append(h, data...))
}

func (cl *nbdClient) errno(t *testing.T, readLen int) uint32 {
	t.Helper()
	r := make([]byte, 16)
	if _, err := io.ReadFull(cl.c, r); err != nil {
		t.Fatal(err)
	}
	e := binary.BigEndian.Uint32(r[4:])
	if e == 0 && readLen > 0 {
		if _, err := io.ReadFull(cl.c, make([]byte, readLen)); err != nil {
			t.Fatal(err)
		}
	}
	return e
}

// TestNBDBadRequests: requests past the end get EINVAL/ENOSPC, a second
// writer gets EPERM, a client that disconnects in the middle of a write
// changes nothing, and the export keeps serving.
func TestNBDBadRequests(t *testing.T) {
	requireQEMU(t)
	en := newEnv(t)
	v := en.volume(4*MiB, "")
	qemuIO(t, v.ExportSocket, "write -P 0x42 0 4M", "flush")

	a := dialNBD(t, v.ExportSocket)
	if a.size != 4*MiB {
		t.Fatalf("export size %d", a.size)
	}
	a.send(0, 4*MiB-512, 1024, nil)
	if e := a.errno(t, 1024); e != 22 {
		t.Fatalf("read past the end: errno %d, want EINVAL", e)
	}
	a.send(1, 4*MiB, 512, make([]byte, 512))
	if e := a.errno(t, 0); e != 28 {
		t.Fatalf("write past the end: errno %d, want ENOSPC", e)
	}
	a.send(1, 0, 512, bytes.Repeat([]byte{0x99}, 512)) // a becomes the writer
	if e := a.errno(t, 0); e != 0 {
		t.Fatalf("write: errno %d", e)
	}
	b := dialNBD(t, v.ExportSocket)
	b.send(1, 4096, 512, make([]byte, 512))
	if e := b.errno(t, 0); e != 1 {
		t.Fatalf("a second writer: errno %d, want EPERM", e)
	}
	b.send(0, 4096, 512, nil) // reading is fine
	if e := b.errno(t, 512); e != 0 {
		t.Fatalf("a second reader: errno %d", e)
	}
	// Half a write, then gone.
	h := make([]byte, 28)
	binary.BigEndian.PutUint32(h, 0x25609513)
	binary.BigEndian.PutUint16(h[6:], 1)
	binary.BigEndian.PutUint64(h[16:], 1*MiB)
	binary.BigEndian.PutUint32(h[24:], 64*KiB)
	_, _ = a.c.Write(append(h, make([]byte, 1000)...))
	a.c.Close()
	b.c.Close()
	deadline := time.Now().Add(10 * time.Second)
	for en.e.vols[v.VolumeID].exp.Connections() > 0 {
		if time.Now().After(deadline) {
			t.Fatal("connections were not dropped")
		}
		time.Sleep(10 * time.Millisecond)
	}
	qemuIO(t, v.ExportSocket, "read -P 0x99 0 512", "read -P 0x42 512 4095k")
	if _, err := qemuIOErr(v.ExportSocket, "write -P 1 4M 4k"); err == nil {
		t.Fatal("qemu-io wrote past the end")
	}
}

// TestVolumeLifecycleErrors covers the named errors of the volume calls.
func TestVolumeLifecycleErrors(t *testing.T) {
	en := newEnv(t)
	e := en.e
	if _, err := e.CreateVolume("vol-nope", MiB, ""); !isErr(err, api.ErrInvalidArgument) {
		t.Fatalf("bad id: %v", err)
	}
	if _, err := e.CreateVolume(awsid.New("vol"), 1000, ""); !isErr(err, api.ErrInvalidArgument) {
		t.Fatalf("bad size: %v", err)
	}
	if _, err := e.CreateVolume(awsid.New("vol"), MiB, awsid.New("snap")); !isErr(err, api.ErrNotFound) {
		t.Fatalf("missing snapshot: %v", err)
	}
	// 16 TiB is sparse: nothing but bitmaps is allocated.
	big := en.volume(16<<40, "")
	again, err := e.CreateVolume(big.VolumeID, 16<<40, "")
	if err != nil || again.ExportSocket != big.ExportSocket {
		t.Fatalf("a retried create: %v %+v", err, again)
	}
	if _, err := e.CreateVolume(big.VolumeID, 16<<40, awsid.New("snap")); !isErr(err, api.ErrConflict) {
		t.Fatalf("the same id with other settings: %v", err)
	}
	if _, err := e.ResizeVolume(big.VolumeID, 1<<40); !isErr(err, api.ErrInvalidArgument) {
		t.Fatalf("shrinking: %v", err)
	}
	if v, err := e.ResizeVolume(big.VolumeID, 17<<40); err != nil || v.SizeBytes != 17<<40 {
		t.Fatalf("growing: %v %+v", err, v)
	}
	inst := awsid.New("i")
	if _, err := e.AttachVolume(big.VolumeID, inst, "/dev/sdf"); err != nil {
		t.Fatal(err)
	}
	if _, err := e.AttachVolume(big.VolumeID, awsid.New("i"), "/dev/sdf"); !isErr(err, api.ErrInUse) {
		t.Fatalf("attaching twice: %v", err)
	}
	if err := e.DeleteVolume(big.VolumeID); !isErr(err, api.ErrInUse) {
		t.Fatalf("deleting an attached volume: %v", err)
	}
	if _, err := e.DetachVolume(big.VolumeID, inst); err != nil {
		t.Fatal(err)
	}
	if err := e.DeleteVolume(big.VolumeID); err != nil {
		t.Fatal(err)
	}
	if err := e.DeleteVolume(big.VolumeID); err != nil {
		t.Fatalf("deleting twice: %v", err)
	}
	if _, err := os.Stat(en.e.SocketPath(big.VolumeID)); !os.IsNotExist(err) {
		t.Fatalf("the export socket outlived its volume: %v", err)
	}
}

// TestFullDiskFailsTheWriterAndLosesNothing runs ebsd's state on a tiny
// tmpfs and writes until it is full: the writer gets ENOSPC, every write
// acknowledged before reads back, before and after a restart, and the
// catalog still opens.
func TestFullDiskFailsTheWriterAndLosesNothing(t *testing.T) {
	requireQEMU(t)
	if os.Geteuid() != 0 {
		t.Skip("skipping: mounting a small tmpfs to fill needs root")
	}
	dir := t.TempDir()
	state := filepath.Join(dir, "state")
	if err := os.MkdirAll(state, 0o750); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size=12m", "hangar-ebsd-test", state).CombinedOutput(); err != nil {
		t.Skipf("skipping: cannot mount a tmpfs: %v %s", err, out)
	}
	en := &env{t: t, state: state, runtime: filepath.Join(dir, "run")}
	t.Cleanup(func() {
		if en.e != nil {
			en.e.Close()
		}
		_ = exec.Command("umount", state).Run()
	})
	en.open()
	v := en.volume(64*MiB, "")
	acked := 0
	var failure string
	for chunk := 0; chunk < 32; chunk++ {
		out, err := qemuIOErr(v.ExportSocket, fmt.Sprintf("write -P %d %dM 2M", chunk+1, chunk*2), "flush")
		if err != nil {
			failure = out
			break
		}
		acked++
	}
	if failure == "" {
		t.Fatal("64 MiB fit on a 12 MiB tmpfs: nothing was provoked")
	}
	if !strings.Contains(failure, "No space left on device") {
		t.Fatalf("the writer got %q, want ENOSPC", failure)
	}
	if acked == 0 {
		t.Fatal("no write succeeded before the disk filled")
	}
	verify := func() {
		for chunk := 0; chunk < acked; chunk++ {
			qemuIO(t, v.ExportSocket, fmt.Sprintf("read -P %d %dM 2M", chunk+1, chunk*2))
		}
	}
	verify()
	en.restart()
	verify()
	// Snapshot blocks cannot be stored either; the error says why, when
	// the snapshot starts (its pack cannot be created) or at the first
	// block that does not fit.
	snap := awsid.New("snap")
	_, err := en.e.StartSnapshot(api.StartSnapshotArgs{SnapshotID: snap, VolumeSizeBytes: 64 * MiB})
	if err == nil {
		for i := uint64(0); i < 32 && err == nil; i++ {
			b := bytes.Repeat([]byte{byte(i + 1)}, BlockSize)
			err = en.e.PutBlock(snap, i, b, b64sum(b))
		}
	} else if _, gerr := en.e.GetSnapshot(snap); !isErr(gerr, api.ErrNotFound) {
		t.Fatalf("a snapshot that could not start left a record: %v", gerr)
	}
	if !isErr(err, api.ErrInsufficientCapacity) {
		t.Fatalf("a snapshot on a full disk: %v, want InsufficientCapacity", err)
	}
	verify()
}
