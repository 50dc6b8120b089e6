package nbd

import (
	"bytes"
	"encoding/binary"
	"io"
	"log/slog"
	"math/rand"
	"net"
	"path/filepath"
	"sync"
	"testing"
)

// memDev is a Device in memory that counts the calls it gets.
type memDev struct {
	mu             sync.Mutex
	b              []byte
	reads, writes  int
	flushes, zeros int
}

func (d *memDev) Size() uint64 { return uint64(len(d.b)) }
func (d *memDev) ReadAt(p []byte, off uint64) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.reads++
	copy(p, d.b[off:])
	return nil
}
func (d *memDev) WriteAt(p []byte, off uint64) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.writes++
	copy(d.b[off:], p)
	return nil
}
func (d *memDev) Zero(off, n uint64) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.zeros++
	clear(d.b[off : off+n])
	return nil
}
func (d *memDev) Flush() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.flushes++
	return nil
}

// client is a raw NBD client that can send many requests in one write.
type client struct {
	t  *testing.T
	nc net.Conn
}

func dial(t *testing.T, path string) *client {
	t.Helper()
	nc, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { nc.Close() })
	var hello [18]byte
	if _, err := io.ReadFull(nc, hello[:]); err != nil {
		t.Fatal(err)
	}
	var out []byte
	out = binary.BigEndian.AppendUint32(out, flagFixedNewstyle|flagNoZeroes)
	out = binary.BigEndian.AppendUint64(out, optMagic)
	out = binary.BigEndian.AppendUint32(out, optExportName)
	out = binary.BigEndian.AppendUint32(out, 0)
	if _, err := nc.Write(out); err != nil {
		t.Fatal(err)
	}
	var info [10]byte // size, flags (no zeroes)
	if _, err := io.ReadFull(nc, info[:]); err != nil {
		t.Fatal(err)
	}
	return &client{t: t, nc: nc}
}

type req struct {
	typ, flags uint16
	off        uint64
	length     uint32
	data       []byte
}

// burst sends every request in one write and returns the replies by
// handle (the index in rqs): errno and read data.
func (c *client) burst(rqs []req) (map[uint64]uint32, map[uint64][]byte) {
	c.t.Helper()
	var out []byte
	for i, r := range rqs {
		out = binary.BigEndian.AppendUint32(out, requestMagic)
		out = binary.BigEndian.AppendUint16(out, r.flags)
		out = binary.BigEndian.AppendUint16(out, r.typ)
		out = binary.BigEndian.AppendUint64(out, uint64(i))
		out = binary.BigEndian.AppendUint64(out, r.off)
		out = binary.BigEndian.AppendUint32(out, r.length)
		out = append(out, r.data...)
	}
	go c.nc.Write(out)
	errs, data := map[uint64]uint32{}, map[uint64][]byte{}
	for range rqs {
		var h [16]byte
		if _, err := io.ReadFull(c.nc, h[:]); err != nil {
			c.t.Fatal(err)
		}
		if binary.BigEndian.Uint32(h[0:]) != simpleReplyMagc {
			c.t.Fatalf("bad reply magic %x", h[:4])
		}
		handle := binary.BigEndian.Uint64(h[8:])
		if _, dup := errs[handle]; dup || handle >= uint64(len(rqs)) {
			c.t.Fatalf("reply for handle %d twice or unknown", handle)
		}
		errs[handle] = binary.BigEndian.Uint32(h[4:])
		if r := rqs[handle]; r.typ == cmdRead && errs[handle] == 0 {
			p := make([]byte, r.length)
			if _, err := io.ReadFull(c.nc, p); err != nil {
				c.t.Fatal(err)
			}
			data[handle] = p
		}
	}
	return errs, data
}

// TestBurstsAreBatchedAndKeepTheirMeaning sends bursts of writes in
// shuffled order (so the server sorts and merges them), writes that
// overlap within one burst (which must land in the order sent), reads of
// every kind, a flush and requests past the end, and checks each reply and
// the device against a model, and that batching cut the calls.
func TestBurstsAreBatchedAndKeepTheirMeaning(t *testing.T) {
	const size = 8 << 20
	dev := &memDev{b: make([]byte, size)}
	exp, err := Listen(filepath.Join(t.TempDir(), "e.sock"), "vol-test", dev, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	defer exp.Close()
	c := dial(t, exp.Path())
	model := make([]byte, size)
	rng := rand.New(rand.NewSource(1))
	for round := 0; round < 20; round++ {
		// 64 contiguous 4 KiB writes, shuffled.
		base := uint64(rng.Intn(size/4096-64)) * 4096
		var rqs []req
		for i := 0; i < 64; i++ {
			p := make([]byte, 4096)
			rng.Read(p)
			rqs = append(rqs, req{typ: cmdWrite, off: base + uint64(i)*4096, length: 4096, data: p})
		}
		rng.Shuffle(len(rqs), func(i, j int) { rqs[i], rqs[j] = rqs[j], rqs[i] })
		// Overlapping writes in the same burst land in the order sent.
		if round%2 == 0 {
			for k := 0; k < 3; k++ {
				p := bytes.Repeat([]byte{byte(round*3 + k + 1)}, 6000)
				rqs = append(rqs, req{typ: cmdWrite, off: base + 1000, length: 6000, data: p})
			}
		}
		for _, r := range rqs {
			copy(model[r.off:], r.data)
		}
		errs, _ := c.burst(rqs)
		for h, e := range errs {
			if e != 0 {
				t.Fatalf("round %d: write %d got errno %d", round, h, e)
			}
		}
		// Reads: contiguous shuffled, overlapping, and one past the end.
		rqs = rqs[:0]
		for i := 0; i < 40; i++ {
			rqs = append(rqs, req{typ: cmdRead, off: base + uint64(i)*4096, length: 4096})
		}
		rqs = append(rqs, req{typ: cmdRead, off: base + 100, length: 9000}, req{typ: cmdRead, off: base, length: 512})
		rng.Shuffle(len(rqs), func(i, j int) { rqs[i], rqs[j] = rqs[j], rqs[i] })
		rqs = append(rqs, req{typ: cmdRead, off: size - 512, length: 1024}, req{typ: cmdFlush})
		errs, data := c.burst(rqs)
		for h, r := range rqs {
			switch {
			case r.typ == cmdFlush:
				if errs[uint64(h)] != 0 {
					t.Fatalf("flush errno %d", errs[uint64(h)])
				}
			case r.off+uint64(r.length) > size:
				if errs[uint64(h)] != errInval {
					t.Fatalf("read past the end: errno %d, want EINVAL", errs[uint64(h)])
				}
			default:
				if errs[uint64(h)] != 0 {
					t.Fatalf("read %d errno %d", h, errs[uint64(h)])
				}
				if want := model[r.off : r.off+uint64(r.length)]; !bytes.Equal(data[uint64(h)], want) {
					t.Fatalf("round %d: read of %d bytes at %d differs from what was written", round, r.length, r.off)
				}
			}
		}
	}
	dev.mu.Lock()
	defer dev.mu.Unlock()
	if !bytes.Equal(dev.b, model) {
		t.Fatal("the device differs from the model")
	}
	// 20 bursts of 64 (+3) writes and 42 reads: batching serves each
	// contiguous stretch with one call (the overlapping writes go one by
	// one), far fewer than one call per request.
	if dev.writes > 20*4+10*3 || dev.reads > 20*10 {
		t.Fatalf("%d WriteAt and %d ReadAt calls for 1340 writes and 840 reads: not batched", dev.writes, dev.reads)
	}
	if dev.flushes != 20 {
		t.Fatalf("%d flushes, want 20", dev.flushes)
	}
	t.Logf("%d WriteAt and %d ReadAt calls served 1340 writes and 840 reads", dev.writes, dev.reads)
}

// TestFUAWriteKeepsItsPlaceInOrder: a FUA write is applied in order like
// any other (only its flush runs aside), so a plain write to the same
// bytes sent right after it lands last, and the FUA reply comes after a
// flush.
func TestFUAWriteKeepsItsPlaceInOrder(t *testing.T) {
	dev := &memDev{b: make([]byte, 1<<20)}
	exp, err := Listen(filepath.Join(t.TempDir(), "e.sock"), "vol-test", dev, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	defer exp.Close()
	c := dial(t, exp.Path())
	for round := 0; round < 50; round++ {
		fua := bytes.Repeat([]byte{0xf0}, 8192)
		plain := bytes.Repeat([]byte{byte(round)}, 4096)
		errs, _ := c.burst([]req{
			{typ: cmdWrite, flags: cmdFlagFUA, off: 0, length: 8192, data: fua},
			{typ: cmdWrite, off: 4096, length: 4096, data: plain},
		})
		if errs[0] != 0 || errs[1] != 0 {
			t.Fatalf("errnos %v", errs)
		}
		dev.mu.Lock()
		got := bytes.Clone(dev.b[4096:8192])
		dev.mu.Unlock()
		if !bytes.Equal(got, plain) {
			t.Fatalf("round %d: the FUA write sent first landed over the plain write sent after it", round)
		}
	}
	dev.mu.Lock()
	defer dev.mu.Unlock()
	if dev.flushes < 50 {
		t.Fatalf("%d flushes for 50 FUA writes", dev.flushes)
	}
}
