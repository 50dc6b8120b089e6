// Package blockstore keeps snapshot blocks, addressed by the SHA-256 of
// their content, so equal blocks are stored once, whichever snapshot or
// volume they came from.
//
// Blocks live in append-only pack files, one per snapshot that wrote new
// blocks (packs/<snap-id>.pack). A pack is a row of fixed-size slots: a
// 4 KiB header (magic, block index, SHA-256, flags, CRC-32C) followed by
// the 512 KiB block. While its snapshot is pending the pack is also the
// snapshot's journal: a slot is acknowledged once a group fdatasync that
// started after its write returned (one fdatasync covers every block
// written meanwhile), and a restart rebuilds the snapshot from the slots
// whose header and content check out; a torn slot was never acknowledged.
// Slot 0 holds the pack's watermark: after each fdatasync, the number of
// leading slots it made durable. A restart trusts those slots' headers
// and hashes only the blocks past it, so resuming costs what the last
// unsynced writes cost, not the whole pack.
// When the snapshot commits, the blocks the store did not hold yet get a
// location (hash → pack, slot) in the catalog's transaction; every other
// slot is punched out of the file. Freeing a block punches its slot; a
// pack with no block left is removed.
//
// Blocks of older versions, one file per block (blocks/ab/abcdef…), are
// still read and freed.
//
// Whether a block is still wanted is the catalog's reference count plus
// the pins of snapshots still being written; Free forgets a block only
// when both say nobody wants it, under one lock, so a block being written
// again is never removed under its writer.
package blockstore

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"

	"hangar.dev/hangar/services/internal/store"
)

// Sizes of a pack's slots.
const (
	BlockSize  = 512 << 10
	HeaderSize = 4096
	SlotSize   = HeaderSize + BlockSize
)

// KindLoc is the bucket of block locations: hash hex → Loc.
const KindLoc = "blockloc"

const (
	magic        = "HNGRBLK1"
	metaMagic    = "HNGRPAK1"
	flagData     = 1 // the slot holds the block; else it refers to a stored one
	headerFields = 52
	metaFields   = 16
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Tx is what the store needs of a transaction; *store.Tx has it.
type Tx interface {
	Get(kind, id string, v any) error
	Put(kind, id string, v any) error
	Delete(kind, id string) error
	Each(kind, after string, fn func(id string, decode func(v any) error) (bool, error)) error
}

// Loc is where a committed block lives.
type Loc struct {
	Pack string `json:"p"`
	Slot uint64 `json:"s"`
}

// Store is a directory of packs (and of legacy block files).
type Store struct {
	dir  string
	db   *store.DB
	mu   sync.Mutex
	pins map[string]int
}

// Open opens (creating) the store at dir; locations are kept in db.
func Open(dir string, db *store.DB) (*Store, error) {
	if err := os.MkdirAll(filepath.Join(dir, "packs"), 0o750); err != nil {
		return nil, fmt.Errorf("creating block store %s: %w", dir, err)
	}
	// Leftovers of legacy writes a crash interrupted.
	if ents, err := os.ReadDir(filepath.Join(dir, "tmp")); err == nil {
		for _, e := range ents {
			_ = os.Remove(filepath.Join(dir, "tmp", e.Name()))
		}
	}
	return &Store{dir: dir, db: db, pins: map[string]int{}}, nil
}

// Sum returns the hex SHA-256 of data.
func Sum(data []byte) string {
	s := sha256.Sum256(data)
	return hex.EncodeToString(s[:])
}

// ValidHash reports whether h looks like a hex SHA-256.
func ValidHash(h string) bool {
	if len(h) != 64 {
		return false
	}
	_, err := hex.DecodeString(h)
	return err == nil
}

// legacyPath is where a block of the one-file-per-block layout lives.
func (s *Store) legacyPath(h string) string { return filepath.Join(s.dir, h[:2], h) }

func (s *Store) packPath(name string) string {
	return filepath.Join(s.dir, "packs", name+".pack")
}

// Pin keeps h from being freed until Unpin; pending snapshots pin the
// blocks they have written but not yet committed.
func (s *Store) Pin(h string) {
	s.mu.Lock()
	s.pins[h]++
	s.mu.Unlock()
}

// Unpin releases a Pin.
func (s *Store) Unpin(h string) {
	s.mu.Lock()
	if s.pins[h]--; s.pins[h] <= 0 {
		delete(s.pins, h)
	}
	s.mu.Unlock()
}

func (s *Store) locate(h string) (Loc, bool) {
	var l Loc
	err := s.db.View(func(tx *store.Tx) error { return tx.Get(KindLoc, h, &l) })
	return l, err == nil
}

// Stored reports whether a committed block with hash h is held.
func (s *Store) Stored(h string) bool {
	if _, ok := s.locate(h); ok {
		return true
	}
	_, err := os.Stat(s.legacyPath(h))
	return err == nil
}

// Read fills buf with the block h (zero-padding a short block).
func (s *Store) Read(h string, buf []byte) error {
	var (
		f   *os.File
		off int64
		err error
	)
	if l, ok := s.locate(h); ok {
		f, err = os.Open(s.packPath(l.Pack))
		off = int64(l.Slot)*SlotSize + HeaderSize
	} else {
		f, err = os.Open(s.legacyPath(h))
	}
	if err != nil {
		return fmt.Errorf("opening block %s: %w", h, err)
	}
	defer f.Close()
	n, err := f.ReadAt(buf[:min(len(buf), BlockSize)], off)
	if err != nil && !errors.Is(err, io.EOF) {
		return fmt.Errorf("reading block %s: %w", h, err)
	}
	clear(buf[n:])
	return nil
}

// ---- packs ----

// Pack is the pack file of one snapshot being written.
type Pack struct {
	s    *Store
	name string
	f    *os.File
	// wf writes blocks with O_DIRECT where the filesystem allows it: they
	// go from the caller's buffer to the disk without a copy into the page
	// cache, which is most of the CPU a buffered write of 512 KiB costs.
	wf *os.File

	mu       sync.Mutex
	cond     *sync.Cond
	next     uint64 // next slot to hand out
	inflight int    // appends between reserving a slot and finishing its write
	sealed   bool
	// group commit: writes finished (each gets the next ticket) and the
	// highest ticket a finished fdatasync covers
	completed, synced uint64
	syncing           bool
	syncs             uint64
	// the watermark: slots below contig finished their writes (the others
	// that finished are in done); wm is the last watermark written
	contig, wm uint64
	done       map[uint64]bool
	verified   int               // blocks ResumePack hashed (for tests)
	err        error             // a failed fdatasync: the pack cannot be trusted
	data       map[string]uint64 // hash → first slot whose block was written
}

// Record is a slot that checked out when a pack was read back.
type Record struct {
	Slot, Index uint64
	Hash        string
	Data        bool // false: a reference to a block stored before
}

// ErrPackInUse is a pack of that name that still holds blocks: a
// committed snapshot's, whose blocks others may still use.
var ErrPackInUse = errors.New("a pack of that name still holds blocks")

// CreatePack creates the pack of a new snapshot. An empty leftover of the
// same name is reused; one that still holds blocks is never truncated.
func (s *Store) CreatePack(name string) (*Pack, error) {
	f, err := os.OpenFile(s.packPath(name), os.O_CREATE|os.O_RDWR, 0o640)
	if err != nil {
		return nil, fmt.Errorf("creating pack %s: %w", name, err)
	}
	if _, err := unix.Seek(int(f.Fd()), 0, unix.SEEK_DATA); !errors.Is(err, unix.ENXIO) {
		f.Close()
		return nil, fmt.Errorf("creating pack %s: %w", name, ErrPackInUse)
	}
	if err := f.Truncate(0); err != nil {
		f.Close()
		return nil, fmt.Errorf("creating pack %s: %w", name, err)
	}
	p := s.newPack(name, f, 1)
	if err := p.writeMeta(1); err != nil {
		p.Close()
		_ = os.Remove(s.packPath(name))
		return nil, fmt.Errorf("creating pack %s: %w", name, err)
	}
	return p, nil
}

// writeMeta writes the watermark into slot 0. It is not synced: it only
// ever names slots an fdatasync already made durable, so a lost update
// costs the next restart some hashing, nothing else.
func (p *Pack) writeMeta(wm uint64) error {
	hp := hdrPool.Get().(*[]byte)
	defer hdrPool.Put(hp)
	hdr := *hp
	clear(hdr)
	copy(hdr, metaMagic)
	binary.LittleEndian.PutUint64(hdr[8:], wm)
	binary.LittleEndian.PutUint32(hdr[metaFields:], crc32.Checksum(hdr[:metaFields], castagnoli))
	_, err := p.f.WriteAt(hdr, 0)
	if err == nil {
		p.wm = wm
	}
	return err
}

// readMeta returns the watermark in slot 0, or 1 (trust nothing).
func (p *Pack) readMeta() uint64 {
	hdr := make([]byte, metaFields+4)
	if n, _ := p.f.ReadAt(hdr, 0); n != len(hdr) || string(hdr[:8]) != metaMagic ||
		binary.LittleEndian.Uint32(hdr[metaFields:]) != crc32.Checksum(hdr[:metaFields], castagnoli) {
		return 1
	}
	return max(1, binary.LittleEndian.Uint64(hdr[8:]))
}

func (s *Store) newPack(name string, f *os.File, next uint64) *Pack {
	p := &Pack{s: s, name: name, f: f, next: next, contig: next, wm: next, done: map[uint64]bool{}, data: map[string]uint64{}}
	p.cond = sync.NewCond(&p.mu)
	if wf, err := os.OpenFile(s.packPath(name), os.O_WRONLY|unix.O_DIRECT, 0); err == nil {
		p.wf = wf // a filesystem refusing O_DIRECT (older tmpfs) gets buffered writes
	}
	return p
}

// aligned reports whether b can be written with O_DIRECT.
func aligned(b []byte) bool {
	return len(b)%HeaderSize == 0 && uintptr(unsafe.Pointer(unsafe.SliceData(b)))%HeaderSize == 0
}

// alignedBuf returns n bytes aligned for O_DIRECT.
func alignedBuf(n int) []byte {
	b := make([]byte, n+HeaderSize)
	a := int(uintptr(unsafe.Pointer(unsafe.SliceData(b))) % HeaderSize)
	if a != 0 {
		a = HeaderSize - a
	}
	return b[a : a+n : a+n]
}

// ResumePack reopens the pack of a pending snapshot after a restart and
// returns its slots that check out, in slot order. A slot whose header is
// damaged or whose block does not hash to its header (a write a crash
// tore; it was never acknowledged) is punched out and skipped. A missing
// pack is an empty one.
func (s *Store) ResumePack(name string) (*Pack, []Record, error) {
	f, err := os.OpenFile(s.packPath(name), os.O_CREATE|os.O_RDWR, 0o640)
	if err != nil {
		return nil, nil, fmt.Errorf("opening pack %s: %w", name, err)
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, nil, err
	}
	slots := max(1, (uint64(st.Size())+SlotSize-1)/SlotSize)
	p := s.newPack(name, f, slots)
	trusted := min(p.readMeta(), slots)
	var recs []Record
	hdr := make([]byte, HeaderSize)
	buf := make([]byte, BlockSize)
	for slot := uint64(1); slot < slots; slot++ {
		r, ok := p.check(slot, hdr, buf, slot >= trusted)
		if !ok {
			_ = p.punch(slot, 1)
			continue
		}
		if r.Data {
			if _, seen := p.data[r.Hash]; !seen {
				p.data[r.Hash] = slot
			}
		}
		recs = append(recs, r)
	}
	// What checked out may only be in the page cache (a write finished,
	// its sync did not): make it durable before the watermark says so.
	if err := unix.Fdatasync(int(f.Fd())); err != nil {
		p.Close()
		return nil, nil, fmt.Errorf("syncing pack %s: %w", name, err)
	}
	if err := p.writeMeta(slots); err != nil {
		p.Close()
		return nil, nil, fmt.Errorf("opening pack %s: %w", name, err)
	}
	return p, recs, nil
}

// check reads slot back and reports whether it is a whole record; verify
// hashes the block too (a slot past the watermark may be torn).
func (p *Pack) check(slot uint64, hdr, buf []byte, verify bool) (Record, bool) {
	off := int64(slot) * SlotSize
	if n, _ := p.f.ReadAt(hdr, off); n < headerFields+4 {
		return Record{}, false
	}
	r, ok := decodeHeader(hdr)
	if !ok {
		return Record{}, false
	}
	r.Slot = slot
	if r.Data && verify {
		p.verified++
		if n, _ := p.f.ReadAt(buf, off+HeaderSize); n != BlockSize || Sum(buf) != r.Hash {
			return Record{}, false
		}
	}
	return r, true
}

func encodeHeader(hdr []byte, index uint64, h string, data bool) {
	clear(hdr)
	copy(hdr, magic)
	binary.LittleEndian.PutUint64(hdr[8:], index)
	_, _ = hex.Decode(hdr[16:48], []byte(h))
	if data {
		binary.LittleEndian.PutUint32(hdr[48:], flagData)
	}
	binary.LittleEndian.PutUint32(hdr[headerFields:], crc32.Checksum(hdr[:headerFields], castagnoli))
}

func decodeHeader(hdr []byte) (Record, bool) {
	if string(hdr[:8]) != magic || binary.LittleEndian.Uint32(hdr[headerFields:]) != crc32.Checksum(hdr[:headerFields], castagnoli) {
		return Record{}, false
	}
	flags := binary.LittleEndian.Uint32(hdr[48:])
	if flags&^flagData != 0 {
		return Record{}, false
	}
	return Record{Index: binary.LittleEndian.Uint64(hdr[8:]), Hash: hex.EncodeToString(hdr[16:48]), Data: flags&flagData != 0}, true
}

var hdrPool = sync.Pool{New: func() any { b := alignedBuf(HeaderSize); return &b }}

// ErrSealed is an append to a pack whose snapshot completed or failed.
var ErrSealed = errors.New("the snapshot's pack is sealed")

// Append writes a record for block index with hash h into the next slot:
// the block itself, or with data nil a reference to a block the store
// holds (the caller has pinned h). It returns the slot and a ticket for
// Sync. Nothing is durable before Sync(ticket) returns.
func (p *Pack) Append(index uint64, h string, data []byte) (slot, ticket uint64, err error) {
	if data != nil && len(data) != BlockSize {
		return 0, 0, fmt.Errorf("a block must be %d bytes, not %d", BlockSize, len(data))
	}
	p.mu.Lock()
	if p.sealed {
		p.mu.Unlock()
		return 0, 0, ErrSealed
	}
	slot = p.next
	p.next++
	p.inflight++
	p.mu.Unlock()

	hp := hdrPool.Get().(*[]byte)
	encodeHeader(*hp, index, h, data != nil)
	off := int64(slot) * SlotSize
	w := p.f
	if p.wf != nil && (data == nil || aligned(data)) {
		w = p.wf
	}
	if data != nil {
		err = pwritev(int(w.Fd()), [][]byte{*hp, data}, off)
	} else {
		_, err = w.WriteAt(*hp, off)
	}
	hdrPool.Put(hp)

	p.mu.Lock()
	defer p.mu.Unlock()
	p.inflight--
	p.cond.Broadcast()
	p.done[slot] = true
	for p.done[p.contig] {
		delete(p.done, p.contig)
		p.contig++
	}
	if err != nil {
		// A partial record (a full disk) reads back as torn; free its space.
		_ = p.punch(slot, 1)
		return 0, 0, fmt.Errorf("writing block %s to pack %s: %w", h, p.name, err)
	}
	if _, seen := p.data[h]; data != nil && !seen {
		p.data[h] = slot
	}
	p.completed++
	return slot, p.completed, nil
}

func pwritev(fd int, iov [][]byte, off int64) error {
	for len(iov) > 0 {
		n, err := unix.Pwritev(fd, iov, off)
		if err != nil {
			return err
		}
		if n == 0 {
			return io.ErrShortWrite
		}
		off += int64(n)
		for n > 0 && len(iov) > 0 {
			k := min(n, len(iov[0]))
			iov[0] = iov[0][k:]
			n -= k
			if len(iov[0]) == 0 {
				iov = iov[1:]
			}
		}
	}
	return nil
}

// HasData reports whether the pack holds the block h itself.
func (p *Pack) HasData(h string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	_, ok := p.data[h]
	return ok
}

// Sync returns once the write with ticket is durable. Concurrent callers
// share fdatasyncs: while one runs, the writes that finish gather behind
// it, and the next one covers them all (group commit). A failed
// fdatasync fails this and every later Sync: what the kernel dropped
// cannot be known.
func (p *Pack) Sync(ticket uint64) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	for p.synced < ticket {
		if p.err != nil {
			return p.err
		}
		if p.syncing {
			p.cond.Wait()
			continue
		}
		p.syncing = true
		target, wm := p.completed, p.contig
		p.mu.Unlock()
		err := unix.Fdatasync(int(p.f.Fd()))
		if err == nil && wm > p.wm {
			// Only the goroutine that holds syncing writes the watermark.
			_ = p.writeMeta(wm)
		}
		p.mu.Lock()
		p.syncing = false
		p.syncs++
		if err != nil {
			p.err = fmt.Errorf("syncing pack %s: %w", p.name, err)
		} else {
			p.synced = max(p.synced, target)
		}
		p.cond.Broadcast()
	}
	return nil
}

// Syncs returns how many fdatasyncs the pack took.
func (p *Pack) Syncs() uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.syncs
}

// Quiesce waits for the appends under way and makes everything written
// durable.
func (p *Pack) Quiesce() error {
	p.mu.Lock()
	for p.inflight > 0 {
		p.cond.Wait()
	}
	t := p.completed
	p.mu.Unlock()
	return p.Sync(t)
}

// seal refuses further appends and waits for those under way.
func (p *Pack) seal() {
	p.mu.Lock()
	p.sealed = true
	for p.inflight > 0 {
		p.cond.Wait()
	}
	p.mu.Unlock()
}

// Close closes the file (a pending snapshot's pack at shutdown).
func (p *Pack) Close() {
	_ = p.f.Close()
	if p.wf != nil {
		_ = p.wf.Close()
	}
}

// Discard seals the pack, closes and removes it: its snapshot failed, and
// no location points into it.
func (p *Pack) Discard() {
	p.seal()
	p.Close()
	_ = os.Remove(p.s.packPath(p.name))
}

func (p *Pack) punch(slot, n uint64) error {
	return punchFile(p.f, slot, n)
}

func punchFile(f *os.File, slot, n uint64) error {
	return unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, int64(slot)*SlotSize, int64(n)*SlotSize)
}

// Commit records, in the catalog transaction that commits the pack's
// snapshot, a location for every block of hashes the store does not hold
// yet and the pack does. The pack must be quiesced. It returns the slots
// that stay live; Trim punches the others once tx committed.
func (s *Store) Commit(tx Tx, p *Pack, hashes []string) (map[uint64]bool, error) {
	live := map[uint64]bool{}
	for _, h := range hashes {
		var l Loc
		err := tx.Get(KindLoc, h, &l)
		if err == nil {
			if l.Pack == p.name {
				live[l.Slot] = true
			}
			continue
		}
		if !errors.Is(err, store.ErrNotFound) {
			return nil, err
		}
		slot, ok := p.data[h]
		if !ok {
			if _, err := os.Stat(s.legacyPath(h)); err == nil {
				continue
			}
			return nil, fmt.Errorf("block %s is neither in the store nor in pack %s", h, p.name)
		}
		if err := tx.Put(KindLoc, h, Loc{Pack: p.name, Slot: slot}); err != nil {
			return nil, err
		}
		live[slot] = true
	}
	return live, nil
}

// Trim punches every slot of a committed pack that is not live and closes
// it; a pack with nothing live is removed. A crash before Trim leaves dead
// slots that the next start's Sweep punches.
func (s *Store) Trim(p *Pack, live map[uint64]bool) {
	p.seal()
	defer p.Close()
	if len(live) == 0 {
		_ = os.Remove(s.packPath(p.name))
		return
	}
	p.mu.Lock()
	n := p.next
	p.mu.Unlock()
	for slot := uint64(0); slot < n; {
		if live[slot] {
			slot++
			continue
		}
		end := slot
		for end < n && !live[end] {
			end++
		}
		_ = p.punch(slot, end-slot)
		slot = end
	}
}

// Free forgets the blocks that referenced reports unreferenced and that no
// one has pinned: their location goes (in one transaction) before their
// slot is punched, so a crash in between leaks space the next Sweep takes
// back, never a location pointing at a hole. It returns how many blocks it
// freed.
func (s *Store) Free(hashes []string, referenced func(h string) bool) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	var cands []string
	for _, h := range hashes {
		if s.pins[h] > 0 || referenced(h) {
			continue
		}
		cands = append(cands, h)
	}
	if len(cands) == 0 {
		return 0
	}
	locs := map[string]Loc{}
	err := s.db.Update(func(tx *store.Tx) error {
		for _, h := range cands {
			var l Loc
			if err := tx.Get(KindLoc, h, &l); err != nil {
				continue
			}
			if err := tx.Delete(KindLoc, h); err != nil {
				return err
			}
			locs[h] = l
		}
		return nil
	})
	if err != nil {
		return 0
	}
	n := 0
	byPack := map[string][]uint64{}
	for _, h := range cands {
		if l, ok := locs[h]; ok {
			byPack[l.Pack] = append(byPack[l.Pack], l.Slot)
			n++
		} else if os.Remove(s.legacyPath(h)) == nil {
			n++
		}
	}
	for name, slots := range byPack {
		s.punchPack(name, slots)
	}
	return n
}

// punchPack punches slots of a committed pack and removes the pack when
// nothing is left in it.
func (s *Store) punchPack(name string, slots []uint64) {
	f, err := os.OpenFile(s.packPath(name), os.O_RDWR, 0)
	if err != nil {
		return
	}
	defer f.Close()
	for _, slot := range slots {
		_ = punchFile(f, slot, 1)
	}
	if _, err := unix.Seek(int(f.Fd()), 0, unix.SEEK_DATA); errors.Is(err, unix.ENXIO) {
		_ = os.Remove(s.packPath(name))
	}
}

// Sweep runs at start, after pending snapshots were resumed (pending
// names their packs): it forgets every block neither referenced nor
// pinned (written by a snapshot that a crash interrupted between its
// commit and its frees), removes packs no location points into (snapshots
// that failed or never committed) and punches slots of committed packs
// that no location points to (a crash before Trim or Free punched them).
func (s *Store) Sweep(referenced func(h string) bool, pending map[string]bool) (int, error) {
	// Candidates go to Free a page at a time, so a large store is swept
	// in bounded memory.
	const page = 4096
	freed := 0
	for after := ""; ; {
		var cands []string
		err := s.db.View(func(tx *store.Tx) error {
			return tx.Each(KindLoc, after, func(h string, _ func(any) error) (bool, error) {
				cands = append(cands, h)
				return len(cands) < page, nil
			})
		})
		if err != nil {
			return freed, fmt.Errorf("sweeping the block store: %w", err)
		}
		if len(cands) == 0 {
			break
		}
		after = cands[len(cands)-1]
		freed += s.Free(cands, referenced)
	}
	var legacy []string
	err := filepath.WalkDir(s.dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if path != s.dir && (d.Name() == "tmp" || d.Name() == "packs") {
				return filepath.SkipDir
			}
			return nil
		}
		if h := d.Name(); ValidHash(h) {
			if legacy = append(legacy, h); len(legacy) == page {
				freed += s.Free(legacy, referenced)
				legacy = legacy[:0]
			}
		}
		return nil
	})
	if err != nil {
		return freed, fmt.Errorf("sweeping the block store: %w", err)
	}
	freed += s.Free(legacy, referenced)

	// The live slots of every pack, as sorted slices (8 bytes a block).
	live := map[string][]uint64{}
	err = s.db.View(func(tx *store.Tx) error {
		return tx.Each(KindLoc, "", func(_ string, decode func(any) error) (bool, error) {
			var l Loc
			if err := decode(&l); err != nil {
				return false, err
			}
			live[l.Pack] = append(live[l.Pack], l.Slot)
			return true, nil
		})
	})
	if err != nil {
		return freed, fmt.Errorf("sweeping the block store: %w", err)
	}
	ents, err := os.ReadDir(filepath.Join(s.dir, "packs"))
	if err != nil {
		return freed, fmt.Errorf("sweeping the block store: %w", err)
	}
	for _, e := range ents {
		name, ok := strings.CutSuffix(e.Name(), ".pack")
		if !ok || pending[name] {
			continue
		}
		if len(live[name]) == 0 {
			_ = os.Remove(s.packPath(name))
			continue
		}
		slices.Sort(live[name])
		s.trimDead(name, live[name])
		delete(live, name)
	}
	return freed, nil
}

// trimDead punches the slots of a committed pack that hold data but are
// not live (live is sorted), visiting only the file's data extents.
func (s *Store) trimDead(name string, live []uint64) {
	f, err := os.OpenFile(s.packPath(name), os.O_RDWR, 0)
	if err != nil {
		return
	}
	defer f.Close()
	fd := int(f.Fd())
	for off := int64(0); ; {
		start, err := unix.Seek(fd, off, unix.SEEK_DATA)
		if err != nil {
			break
		}
		end, err := unix.Seek(fd, start, unix.SEEK_HOLE)
		if err != nil {
			break
		}
		for slot := uint64(start) / SlotSize; int64(slot)*SlotSize < end; slot++ {
			if _, ok := slices.BinarySearch(live, slot); !ok {
				_ = punchFile(f, slot, 1)
			}
		}
		off = end
	}
}

// Usage returns the number of pack and legacy block files and the bytes
// they take on disk.
func (s *Store) Usage() (files int, bytes int64) {
	_ = filepath.WalkDir(s.dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return nil
		}
		if info, err := d.Info(); err == nil {
			files++
			if st, ok := info.Sys().(*syscall.Stat_t); ok {
				bytes += st.Blocks * 512
			} else {
				bytes += info.Size()
			}
		}
		return nil
	})
	return files, bytes
}
