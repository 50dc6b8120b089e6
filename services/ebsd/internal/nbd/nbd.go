// Package nbd serves block devices over the NBD protocol (fixed newstyle
// negotiation, NBD_OPT_GO/INFO/LIST/ABORT and EXPORT_NAME, simple
// replies; READ, WRITE, FLUSH, TRIM, WRITE_ZEROES with FUA), one unix
// socket per export, as QEMU, qemu-img and qemu-io connect to it.
//
// Several connections may read an export; only one at a time may change
// it: the first connection that writes becomes the export's writer until it
// disconnects, and writes from any other get EPERM. A write is applied only
// once its whole payload has arrived, so a client that disconnects
// mid-request changes nothing. FLUSH and FUA are answered only after the
// export's Flush returned, and only after every write received before them
// was applied.
//
// Requests are served on the connection's goroutine, in the order they
// come. A burst of reads (or of writes) that the client sent back to back
// is sorted by offset and each contiguous stretch is served with one
// ReadAt or WriteAt; writes that overlap keep the order they were sent in.
// A FUA write is applied in its place too; only its flush (and FLUSH)
// runs on a goroutine of its own.
package nbd

import (
	"bufio"
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"slices"
	"sync"
	"syscall"
)

// Device is what an export serves.
type Device interface {
	Size() uint64
	ReadAt(p []byte, off uint64) error
	WriteAt(p []byte, off uint64) error
	Zero(off, n uint64) error
	Flush() error
}

// Protocol constants (NetworkBlockDevice/nbd doc/proto.md).
const (
	nbdMagic        = 0x4e42444d41474943 // NBDMAGIC
	optMagic        = 0x49484156454f5054 // IHAVEOPT
	optReplyMagic   = 0x3e889045565a9
	requestMagic    = 0x25609513
	simpleReplyMagc = 0x67446698

	flagFixedNewstyle = 1 << 0
	flagNoZeroes      = 1 << 1

	optExportName = 1
	optAbort      = 2
	optList       = 3
	optInfo       = 6
	optGo         = 7

	repAck        = 1
	repServer     = 2
	repInfo       = 3
	repErrUnsup   = 1<<31 + 1
	repErrUnknown = 1<<31 + 6
	repErrInvalid = 1<<31 + 3

	infoExport    = 0
	infoBlockSize = 3

	tflagHasFlags     = 1 << 0
	tflagSendFlush    = 1 << 2
	tflagSendFUA      = 1 << 3
	tflagSendTrim     = 1 << 5
	tflagWriteZeroes  = 1 << 6
	tflagSendFastZero = 1 << 11

	cmdRead        = 0
	cmdWrite       = 1
	cmdDisc        = 2
	cmdFlush       = 3
	cmdTrim        = 4
	cmdWriteZeroes = 6

	cmdFlagFUA = 1 << 0

	errPerm     = 1
	errIO       = 5
	errInval    = 22
	errNoSpc    = 28
	errNotSup   = 95
	errShutdown = 108

	// MaxPayload is the largest READ or WRITE accepted (QEMU's own limit).
	MaxPayload = 32 << 20
)

// Export is one device on its socket.
type Export struct {
	name   string
	dev    Device
	ln     net.Listener
	path   string
	log    *slog.Logger
	mu     sync.Mutex
	conns  map[*conn]bool
	writer *conn
	closed bool
	wg     sync.WaitGroup
}

// Listen serves dev as export name on a unix socket at path, replacing a
// stale socket a previous run left.
func Listen(path, name string, dev Device, log *slog.Logger) (*Export, error) {
	if st, err := os.Lstat(path); err == nil && st.Mode()&os.ModeSocket != 0 {
		_ = os.Remove(path)
	}
	ln, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("listening on %s: %w", path, err)
	}
	e := &Export{name: name, dev: dev, ln: ln, path: path, log: log, conns: map[*conn]bool{}}
	e.wg.Add(1)
	go e.accept()
	return e, nil
}

// Path returns the socket path.
func (e *Export) Path() string { return e.path }

// HasWriter reports whether a connection has written to the export and is
// still connected.
func (e *Export) HasWriter() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.writer != nil
}

// Connections returns the number of open connections.
func (e *Export) Connections() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.conns)
}

// Close stops listening, drops every connection and removes the socket.
func (e *Export) Close() {
	e.mu.Lock()
	e.closed = true
	for c := range e.conns {
		_ = c.nc.Close()
	}
	e.mu.Unlock()
	_ = e.ln.Close()
	e.wg.Wait()
	_ = os.Remove(e.path)
}

func (e *Export) accept() {
	defer e.wg.Done()
	for {
		nc, err := e.ln.Accept()
		if err != nil {
			return
		}
		c := &conn{e: e, nc: nc, r: bufio.NewReaderSize(nc, 256<<10)}
		e.mu.Lock()
		if e.closed {
			e.mu.Unlock()
			_ = nc.Close()
			return
		}
		e.conns[c] = true
		e.mu.Unlock()
		e.wg.Add(1)
		go func() {
			defer e.wg.Done()
			err := c.serve()
			if err != nil && !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
				e.log.Info("nbd connection ended", "export", e.name, "err", err)
			}
			_ = nc.Close()
			e.mu.Lock()
			delete(e.conns, c)
			if e.writer == c {
				e.writer = nil
			}
			e.mu.Unlock()
		}()
	}
}

// claimWrite makes c the writer if there is none.
func (e *Export) claimWrite(c *conn) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.writer == nil {
		e.writer = c
	}
	return e.writer == c
}

type conn struct {
	e  *Export
	nc net.Conn
	r  *bufio.Reader
	wm sync.Mutex    // serialises replies
	w  *bufio.Writer // replies, flushed when no request is waiting
	// idle is set (under wm) while the reader waits for the client, so a
	// reply finished meanwhile is flushed by whoever finished it.
	idle bool
	wg   sync.WaitGroup
	b    batch // only the transmit goroutine touches it
}

func (c *conn) serve() error {
	var hello [18]byte
	binary.BigEndian.PutUint64(hello[0:], nbdMagic)
	binary.BigEndian.PutUint64(hello[8:], optMagic)
	binary.BigEndian.PutUint16(hello[16:], flagFixedNewstyle|flagNoZeroes)
	if _, err := c.nc.Write(hello[:]); err != nil {
		return err
	}
	var cf [4]byte
	if _, err := io.ReadFull(c.r, cf[:]); err != nil {
		return err
	}
	clientFlags := binary.BigEndian.Uint32(cf[:])
	if clientFlags&flagFixedNewstyle == 0 {
		return errors.New("client does not speak fixed newstyle")
	}
	noZeroes := clientFlags&flagNoZeroes != 0
	ok, err := c.negotiate(noZeroes)
	if err != nil || !ok {
		return err
	}
	return c.transmit()
}

func (c *conn) optReply(opt, typ uint32, data []byte) error {
	b := make([]byte, 20+len(data))
	binary.BigEndian.PutUint64(b[0:], optReplyMagic)
	binary.BigEndian.PutUint32(b[8:], opt)
	binary.BigEndian.PutUint32(b[12:], typ)
	binary.BigEndian.PutUint32(b[16:], uint32(len(data)))
	copy(b[20:], data)
	_, err := c.nc.Write(b)
	return err
}

func (c *conn) flags() uint16 {
	return tflagHasFlags | tflagSendFlush | tflagSendFUA | tflagSendTrim | tflagWriteZeroes | tflagSendFastZero
}

func (c *conn) known(name string) bool { return name == "" || name == c.e.name }

// negotiate runs option haggling; true means enter transmission.
func (c *conn) negotiate(noZeroes bool) (bool, error) {
	for {
		var h [16]byte
		if _, err := io.ReadFull(c.r, h[:]); err != nil {
			return false, err
		}
		if binary.BigEndian.Uint64(h[0:]) != optMagic {
			return false, errors.New("bad option magic")
		}
		opt := binary.BigEndian.Uint32(h[8:])
		n := binary.BigEndian.Uint32(h[12:])
		if n > 64<<10 {
			return false, fmt.Errorf("option %d of %d bytes is too long", opt, n)
		}
		data := make([]byte, n)
		if _, err := io.ReadFull(c.r, data); err != nil {
			return false, err
		}
		switch opt {
		case optExportName:
			if !c.known(string(data)) {
				return false, fmt.Errorf("unknown export %q", data)
			}
			b := make([]byte, 10, 134)
			binary.BigEndian.PutUint64(b[0:], c.e.dev.Size())
			binary.BigEndian.PutUint16(b[8:], c.flags())
			if !noZeroes {
				b = b[:134]
			}
			_, err := c.nc.Write(b)
			return err == nil, err
		case optAbort:
			_ = c.optReply(opt, repAck, nil)
			return false, nil
		case optList:
			if n != 0 {
				if err := c.optReply(opt, repErrInvalid, []byte("NBD_OPT_LIST takes no data")); err != nil {
					return false, err
				}
				continue
			}
			b := make([]byte, 4+len(c.e.name))
			binary.BigEndian.PutUint32(b, uint32(len(c.e.name)))
			copy(b[4:], c.e.name)
			if err := c.optReply(opt, repServer, b); err != nil {
				return false, err
			}
			if err := c.optReply(opt, repAck, nil); err != nil {
				return false, err
			}
		case optInfo, optGo:
			if n < 6 {
				if err := c.optReply(opt, repErrInvalid, []byte("short request")); err != nil {
					return false, err
				}
				continue
			}
			nl := binary.BigEndian.Uint32(data)
			if uint64(nl)+6 > uint64(n) {
				if err := c.optReply(opt, repErrInvalid, []byte("bad name length")); err != nil {
					return false, err
				}
				continue
			}
			name := string(data[4 : 4+nl])
			if !c.known(name) {
				if err := c.optReply(opt, repErrUnknown, []byte("no such export: "+name)); err != nil {
					return false, err
				}
				continue
			}
			info := make([]byte, 12)
			binary.BigEndian.PutUint16(info[0:], infoExport)
			binary.BigEndian.PutUint64(info[2:], c.e.dev.Size())
			binary.BigEndian.PutUint16(info[10:], c.flags())
			if err := c.optReply(opt, repInfo, info); err != nil {
				return false, err
			}
			bs := make([]byte, 14)
			binary.BigEndian.PutUint16(bs[0:], infoBlockSize)
			binary.BigEndian.PutUint32(bs[2:], 1)
			binary.BigEndian.PutUint32(bs[6:], 4096)
			binary.BigEndian.PutUint32(bs[10:], MaxPayload)
			if err := c.optReply(opt, repInfo, bs); err != nil {
				return false, err
			}
			if err := c.optReply(opt, repAck, nil); err != nil {
				return false, err
			}
			if opt == optGo {
				return true, nil
			}
		default:
			if err := c.optReply(opt, repErrUnsup, nil); err != nil {
				return false, err
			}
		}
	}
}

type request struct {
	flags  uint16
	typ    uint16
	handle uint64
	off    uint64
	length uint32
	data   []byte
	urgent bool // FLUSH or FUA: its reply is sent at once
}

// maxInFlight bounds the FLUSH and FUA requests one connection runs at once.
const maxInFlight = 32

// maxBatch bounds the bytes of one batch of reads or writes, and
// maxMerge the size of a request that may join a batch.
const (
	maxBatch = 4 << 20
	maxMerge = 1 << 20
)

// batch is a burst of READs, or of WRITEs without FUA, that the client
// sent back to back. Clients keep many requests in flight and send them in
// no particular order (QEMU's NBD client interleaves its coroutines), so a
// batch is sorted by offset and every contiguous stretch is served with one
// ReadAt or WriteAt; the replies are written together.
type batch struct {
	typ  uint16
	rqs  []batched
	slab []byte // the payloads of writes, in arrival order
	sc   []byte // scratch: merged writes, read destinations
	idx  []int
}

type batched struct {
	handle uint64
	off    uint64
	length uint32
	pos    int // of the payload in slab
}

// transmit serves requests. Reads and writes are gathered into a batch
// while the client has more requests waiting; the batch is served when a
// request of another kind comes or before waiting for the client, and the
// replies go out in one write per burst. Other requests are served in
// order after the batch before them; FLUSH and FUA writes run on their own
// goroutines, after every write before them was applied, so an fsync never
// holds up the pipeline.
func (c *conn) transmit() error {
	c.w = bufio.NewWriterSize(c.nc, 256<<10)
	c.b = batch{slab: make([]byte, 0, maxBatch), sc: make([]byte, maxBatch)}
	sem := make(chan struct{}, maxInFlight)
	defer c.wg.Wait()
	var h [28]byte
	writer := false // this connection is the export's writer
	for {
		if c.r.Buffered() < len(h) {
			// About to wait for the client: serve the batch, send what is
			// answered.
			c.execBatch()
			c.wm.Lock()
			c.idle = true
			err := c.w.Flush()
			c.wm.Unlock()
			if err != nil {
				return err
			}
			if _, err := io.ReadFull(c.r, h[:]); err != nil {
				return err
			}
			c.wm.Lock()
			c.idle = false
			c.wm.Unlock()
		} else if _, err := io.ReadFull(c.r, h[:]); err != nil {
			return err
		}
		if binary.BigEndian.Uint32(h[0:]) != requestMagic {
			c.execBatch()
			return errors.New("bad request magic")
		}
		rq := request{
			flags:  binary.BigEndian.Uint16(h[4:]),
			typ:    binary.BigEndian.Uint16(h[6:]),
			handle: binary.BigEndian.Uint64(h[8:]),
			off:    binary.BigEndian.Uint64(h[16:]),
			length: binary.BigEndian.Uint32(h[24:]),
		}
		end := rq.off + uint64(rq.length)
		mergeable := rq.flags&cmdFlagFUA == 0 && rq.length > 0 && rq.length <= maxMerge &&
			end >= rq.off && end <= c.e.dev.Size()
		switch rq.typ {
		case cmdDisc:
			c.execBatch()
			c.wg.Wait()
			_ = c.e.dev.Flush()
			return nil
		case cmdWrite:
			if rq.length > MaxPayload {
				// The payload cannot be skipped safely: end the connection.
				c.execBatch()
				return fmt.Errorf("write of %d bytes exceeds %d", rq.length, MaxPayload)
			}
			if mergeable && !writer {
				writer = c.e.claimWrite(c)
			}
			if mergeable && writer {
				c.join(&rq)
				n := len(c.b.slab)
				c.b.slab = c.b.slab[:n+int(rq.length)]
				if _, err := io.ReadFull(c.r, c.b.slab[n:]); err != nil {
					// The complete writes before it stand; this one
					// changes nothing.
					c.b.slab = c.b.slab[:n]
					c.execBatch()
					return fmt.Errorf("client went away in the middle of a %d-byte write: %w", rq.length, err)
				}
				c.b.rqs = append(c.b.rqs, batched{handle: rq.handle, off: rq.off, length: rq.length, pos: n})
				continue
			}
			c.execBatch()
			rq.data = getPayload(int(rq.length))
			if _, err := io.ReadFull(c.r, rq.data); err != nil {
				putPayload(rq.data)
				return fmt.Errorf("client went away in the middle of a %d-byte write: %w", rq.length, err)
			}
		case cmdRead:
			if mergeable {
				c.join(&rq)
				c.b.slab = c.b.slab[:len(c.b.slab)+int(rq.length)] // accounts the batch's bytes
				c.b.rqs = append(c.b.rqs, batched{handle: rq.handle, off: rq.off, length: rq.length})
				continue
			}
			c.execBatch()
		default:
			c.execBatch()
		}
		rq.urgent = rq.typ == cmdFlush || rq.flags&cmdFlagFUA != 0
		if !rq.urgent {
			errno, data := c.apply(&rq)
			c.reply(&rq, errno, data)
			putPayload(data)
			continue
		}
		if rq.typ != cmdFlush {
			// A FUA request is applied here, in order like any other;
			// only the flush it asks for runs aside.
			errno, data := c.apply(&rq)
			if errno != 0 || rq.typ == cmdRead {
				c.reply(&rq, errno, data)
				putPayload(data)
				continue
			}
		}
		sem <- struct{}{}
		c.wg.Add(1)
		go func(rq *request) {
			defer func() { <-sem; c.wg.Done() }()
			err := c.e.dev.Flush()
			if err != nil {
				c.e.log.Warn("nbd flush failed", "export", c.e.name, "cmd", rq.typ, "offset", rq.off, "length", rq.length, "err", err)
			}
			c.reply(rq, errnoOf(err), nil)
		}(&rq)
	}
}

// join serves the open batch first unless rq can join it: same kind,
// room left, and for a write no overlap with a write of the batch (writes
// to the same bytes keep the order they were sent in).
func (c *conn) join(rq *request) {
	b := &c.b
	if len(b.rqs) > 0 && (b.typ != rq.typ || len(b.slab)+int(rq.length) > maxBatch || rq.typ == cmdWrite && b.overlaps(rq)) {
		c.execBatch()
	}
	b.typ = rq.typ
}

func (b *batch) overlaps(rq *request) bool {
	end := rq.off + uint64(rq.length)
	for _, r := range b.rqs {
		if r.off < end && rq.off < r.off+uint64(r.length) {
			return true
		}
	}
	return false
}

// execBatch serves the open batch, if any, and queues its replies.
func (c *conn) execBatch() {
	b := &c.b
	if len(b.rqs) == 0 {
		return
	}
	defer func() { b.rqs, b.slab = b.rqs[:0], b.slab[:0] }()
	b.idx = b.idx[:0]
	for i := range b.rqs {
		b.idx = append(b.idx, i)
	}
	slices.SortFunc(b.idx, func(x, y int) int { return cmp.Compare(b.rqs[x].off, b.rqs[y].off) })
	// Each contiguous stretch idx[from:to] is served with one call.
	for from := 0; from < len(b.idx); {
		first := b.rqs[b.idx[from]]
		end := first.off + uint64(first.length)
		to := from + 1
		for to < len(b.idx) && b.rqs[b.idx[to]].off == end {
			end += uint64(b.rqs[b.idx[to]].length)
			to++
		}
		n := int(end - first.off)
		var err error
		switch {
		case b.typ == cmdRead:
			err = c.e.dev.ReadAt(b.sc[:n], first.off)
		case to == from+1:
			err = c.e.dev.WriteAt(b.slab[first.pos:first.pos+n], first.off)
		default:
			p := 0
			for _, i := range b.idx[from:to] {
				r := b.rqs[i]
				p += copy(b.sc[p:], b.slab[r.pos:r.pos+int(r.length)])
			}
			err = c.e.dev.WriteAt(b.sc[:n], first.off)
		}
		errno := c.served(b.typ, first.off, uint64(n), to-from, err)
		var data []byte
		if b.typ == cmdRead && errno == 0 {
			data = b.sc[:n] // copied out by replies before the next read
		}
		c.replies(b.idx[from:to], data, errno)
		from = to
	}
}

// served logs a failed batched call and returns its errno.
func (c *conn) served(typ uint16, off, n uint64, requests int, err error) uint32 {
	if err != nil {
		c.e.log.Warn("nbd request failed", "export", c.e.name, "cmd", typ, "offset", off, "length", n, "requests", requests, "errno", errnoOf(err), "err", err)
	}
	return errnoOf(err)
}

// replies queues the replies of the batched requests idx; data, when
// given, holds their read payloads back to back.
func (c *conn) replies(idx []int, data []byte, errno uint32) {
	var hdr [16]byte
	binary.BigEndian.PutUint32(hdr[0:], simpleReplyMagc)
	c.wm.Lock()
	defer c.wm.Unlock()
	pos := 0
	for _, i := range idx {
		r := c.b.rqs[i]
		binary.BigEndian.PutUint32(hdr[4:], errno)
		binary.BigEndian.PutUint64(hdr[8:], r.handle)
		_, _ = c.w.Write(hdr[:])
		if data != nil {
			_, _ = c.w.Write(data[pos : pos+int(r.length)])
			pos += int(r.length)
		}
	}
}

var payloadPool = sync.Pool{New: func() any { b := make([]byte, 0, 1<<20); return &b }}

func getPayload(n int) []byte {
	if n > 1<<20 {
		return make([]byte, n)
	}
	bp := payloadPool.Get().(*[]byte)
	return (*bp)[:n]
}

func putPayload(b []byte) {
	if b != nil && cap(b) == 1<<20 {
		b = b[:0]
		payloadPool.Put(&b)
	}
}

func errnoOf(err error) uint32 {
	switch {
	case err == nil:
		return 0
	case errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.EDQUOT):
		return errNoSpc
	case errors.Is(err, syscall.EPERM):
		return errPerm
	default:
		return errIO
	}
}

// apply serves a request other than FLUSH, without the flush a FUA asks
// for, and returns its errno and, for a read, the data (from the payload
// pool: the caller puts it back once replied).
func (c *conn) apply(rq *request) (errno uint32, data []byte) {
	var err error
	dev := c.e.dev
	if rq.off+uint64(rq.length) > dev.Size() || rq.off+uint64(rq.length) < rq.off {
		// Past the end: EINVAL for reads, ENOSPC for writes, as the
		// protocol asks; the payload of a write was already read.
		errno = errInval
		if rq.typ != cmdRead {
			errno = errNoSpc
			putPayload(rq.data)
		}
		c.e.log.Warn("nbd request past the end", "export", c.e.name, "cmd", rq.typ, "offset", rq.off, "length", rq.length, "size", dev.Size())
		return errno, nil
	}
	switch rq.typ {
	case cmdRead:
		if rq.length > MaxPayload {
			errno = errInval
			break
		}
		data = getPayload(int(rq.length))
		err = dev.ReadAt(data, rq.off)
		errno = errnoOf(err)
	case cmdWrite, cmdTrim, cmdWriteZeroes:
		if !c.e.claimWrite(c) {
			errno = errPerm
			err = errors.New("another connection is this export's writer")
			putPayload(rq.data)
			break
		}
		if rq.typ == cmdWrite {
			err = dev.WriteAt(rq.data, rq.off)
			putPayload(rq.data)
		} else {
			err = dev.Zero(rq.off, uint64(rq.length))
		}
		errno = errnoOf(err)
	default:
		errno = errInval
		err = fmt.Errorf("unsupported command %d", rq.typ)
	}
	if err != nil {
		c.e.log.Warn("nbd request failed", "export", c.e.name, "cmd", rq.typ, "offset", rq.off, "length", rq.length, "errno", errno, "err", err)
	}
	return errno, data
}

func (c *conn) reply(rq *request, errno uint32, data []byte) {
	var hdr [16]byte
	binary.BigEndian.PutUint32(hdr[0:], simpleReplyMagc)
	binary.BigEndian.PutUint32(hdr[4:], errno)
	binary.BigEndian.PutUint64(hdr[8:], rq.handle)
	c.wm.Lock()
	defer c.wm.Unlock()
	_, _ = c.w.Write(hdr[:])
	if rq.typ == cmdRead && errno == 0 {
		_, _ = c.w.Write(data)
	}
	if rq.urgent || c.idle {
		_ = c.w.Flush()
	}
}
