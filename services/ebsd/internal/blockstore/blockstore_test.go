package blockstore

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"

	"hangar.dev/hangar/services/internal/store"
)

func openStore(t *testing.T, dir string) (*Store, *store.DB) {
	t.Helper()
	db, err := store.Open(filepath.Join(dir, "state.db"))
	if err != nil {
		t.Fatal(err)
	}
	s, err := Open(filepath.Join(dir, "blocks"), db)
	if err != nil {
		t.Fatal(err)
	}
	return s, db
}

func block(seed int) ([]byte, string) {
	b := bytes.Repeat([]byte(fmt.Sprintf("block %08d ", seed)), BlockSize/15+1)[:BlockSize]
	return b, Sum(b)
}

// allocated is the space a file takes on disk (0 when it is gone).
func allocated(t *testing.T, path string) int64 {
	t.Helper()
	st, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return st.Sys().(*syscall.Stat_t).Blocks * 512
}

// TestPackRecoveryKeepsWholeSlotsAndDropsTornOnes writes slots (three
// synced, the rest written but not yet synced when the "crash" comes),
// then damages the unsynced ones the ways a crash can (a block cut short,
// a header torn mid-write, a slot never written between two that were, a
// short tail) and checks that a restart gets exactly the whole slots back,
// in order, punches the torn ones, and hashes only blocks past the
// watermark.
func TestPackRecoveryKeepsWholeSlotsAndDropsTornOnes(t *testing.T) {
	dir := t.TempDir()
	s, db := openStore(t, dir)
	defer db.Close()
	p, err := s.CreatePack("snap-1")
	if err != nil {
		t.Fatal(err)
	}
	var want []Record
	for i := 1; i <= 6; i++ {
		b, h := block(i)
		slot, ticket, err := p.Append(uint64(100+i), h, b)
		if err != nil {
			t.Fatal(err)
		}
		if slot != uint64(i) {
			t.Fatalf("block %d went to slot %d", i, slot)
		}
		if i <= 3 {
			if err := p.Sync(ticket); err != nil {
				t.Fatal(err)
			}
		}
		want = append(want, Record{Slot: slot, Index: uint64(100 + i), Hash: h, Data: true})
	}
	// A reference record (the block is held elsewhere), not synced either.
	_, h1 := block(1)
	slot, _, err := p.Append(7, h1, nil)
	if err != nil {
		t.Fatal(err)
	}
	want = append(want, Record{Slot: slot, Index: 7, Hash: h1})
	p.Close()
	if got := (&Pack{f: mustOpen(t, s.packPath("snap-1"))}).readMeta(); got != 4 {
		t.Fatalf("watermark %d after syncing slots 1-3, want 4", got)
	}

	f := mustOpen(t, s.packPath("snap-1"))
	// Slot 4: its block half overwritten (a torn data write).
	if _, err := f.WriteAt(make([]byte, BlockSize/2), 4*SlotSize+HeaderSize+1000); err != nil {
		t.Fatal(err)
	}
	// Slot 6: a header torn in its middle.
	if _, err := f.WriteAt([]byte("garbage!"), 6*SlotSize+20); err != nil {
		t.Fatal(err)
	}
	// Slot 9 written (a concurrent write) while slot 8 never was; then a
	// slot cut short at the end of the file.
	b9, h9 := block(9)
	hdr := make([]byte, HeaderSize)
	encodeHeader(hdr, 109, h9, true)
	if _, err := f.WriteAt(append(hdr, b9...), 9*SlotSize); err != nil {
		t.Fatal(err)
	}
	b10, h10 := block(10)
	encodeHeader(hdr, 110, h10, true)
	if _, err := f.WriteAt(append(hdr, b10[:4096]...), 10*SlotSize); err != nil {
		t.Fatal(err)
	}
	f.Close()
	want = append(want, Record{Slot: 9, Index: 109, Hash: h9, Data: true})
	var keep []Record
	for _, r := range want {
		if r.Slot != 4 && r.Slot != 6 {
			keep = append(keep, r)
		}
	}

	p, recs, err := s.ResumePack("snap-1")
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(recs) != fmt.Sprint(keep) {
		t.Fatalf("recovered\n%v\nwant\n%v", recs, keep)
	}
	// Blocks below the watermark (slots 1-3) were trusted; 4, 5, 9 and 10
	// were hashed (6's header did not check out).
	if p.verified != 4 {
		t.Fatalf("hashed %d blocks on resume, want 4", p.verified)
	}
	// The torn slots were punched.
	for _, torn := range []uint64{4, 6, 10} {
		if _, ok := p.check(torn, make([]byte, HeaderSize), make([]byte, BlockSize), true); ok {
			t.Fatalf("torn slot %d still checks out", torn)
		}
	}
	p.Close()
	// Resuming synced what checked out and moved the watermark: a second
	// restart hashes nothing.
	p, recs2, err := s.ResumePack("snap-1")
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(recs2) != fmt.Sprint(keep) || p.verified != 0 {
		t.Fatalf("second resume: %v, hashed %d", recs2, p.verified)
	}
	// Appends go after the last slot.
	b, h := block(11)
	slot, _, err = p.Append(111, h, b)
	if err != nil || slot != 11 {
		t.Fatalf("append after recovery: slot %d, %v (want 11)", slot, err)
	}
	p.Close()
}

func mustOpen(t *testing.T, path string) *os.File {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

// TestGroupCommitSharesSyncs: 32 writers appending and syncing at once
// need far fewer fdatasyncs than blocks, and every acknowledged block is in
// the pack after a reopen.
func TestGroupCommitSharesSyncs(t *testing.T) {
	dir := t.TempDir()
	s, db := openStore(t, dir)
	defer db.Close()
	p, err := s.CreatePack("snap-g")
	if err != nil {
		t.Fatal(err)
	}
	const writers, each = 32, 8
	var wg sync.WaitGroup
	errs := make(chan error, writers)
	for w := 0; w < writers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for k := 0; k < each; k++ {
				b, h := block(w*each + k)
				_, ticket, err := p.Append(uint64(w*each+k), h, b)
				if err == nil {
					err = p.Sync(ticket)
				}
				if err != nil {
					errs <- err
					return
				}
			}
		}(w)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	syncs := p.Syncs()
	p.Close()
	if syncs >= writers*each {
		t.Fatalf("%d fdatasyncs for %d blocks: no group commit", syncs, writers*each)
	}
	_, recs, err := s.ResumePack("snap-g")
	if err != nil {
		t.Fatal(err)
	}
	seen := map[uint64]bool{}
	for _, r := range recs {
		if b, h := block(int(r.Index)); h != r.Hash || !r.Data || len(b) != BlockSize {
			t.Fatalf("record %+v", r)
		}
		seen[r.Index] = true
	}
	if len(seen) != writers*each {
		t.Fatalf("%d of %d blocks back", len(seen), writers*each)
	}
	t.Logf("%d blocks, %d fdatasyncs", writers*each, syncs)
}

// TestCommitTrimFreeAndSweep: committed blocks are read back from their
// pack; a block another pack already holds is not stored twice; freeing
// punches slots and removes empty packs; and after simulated crashes
// (between commit and trim, between forgetting a block and punching it,
// a pack never committed) Sweep puts the space back.
func TestCommitTrimFreeAndSweep(t *testing.T) {
	dir := t.TempDir()
	s, db := openStore(t, dir)
	defer db.Close()
	refs := map[string]bool{}
	referenced := func(h string) bool { return refs[h] }
	commit := func(p *Pack, hashes []string, trim bool) {
		t.Helper()
		if err := p.Quiesce(); err != nil {
			t.Fatal(err)
		}
		var live map[uint64]bool
		if err := db.Update(func(tx *store.Tx) (err error) { live, err = s.Commit(tx, p, hashes); return err }); err != nil {
			t.Fatal(err)
		}
		for _, h := range hashes {
			refs[h] = true
		}
		if trim {
			s.Trim(p, live)
		} else {
			p.Close()
		}
	}
	put := func(p *Pack, seeds ...int) []string {
		var hs []string
		for _, i := range seeds {
			b, h := block(i)
			if s.Stored(h) {
				b = nil
			}
			if _, _, err := p.Append(uint64(i), h, b); err != nil {
				t.Fatal(err)
			}
			hs = append(hs, h)
		}
		return hs
	}
	a, _ := s.CreatePack("snap-a")
	ha := put(a, 1, 2, 3, 3) // block 3 twice: one slot is redundant
	commit(a, ha, true)
	if got := allocated(t, s.packPath("snap-a")); got > 3*SlotSize+8192 {
		t.Fatalf("pack a takes %d bytes for 3 blocks: the duplicate slot was not punched", got)
	}
	b, _ := s.CreatePack("snap-b")
	hb := put(b, 3, 4, 4) // 3 is already stored: written as a reference
	commit(b, hb, false)  // crash before Trim
	if got := allocated(t, s.packPath("snap-b")); got < 2*BlockSize {
		t.Fatalf("pack b takes %d bytes before the sweep, want two slots of block 4", got)
	}
	for _, i := range []int{1, 2, 3, 4} {
		want, h := block(i)
		got := make([]byte, BlockSize)
		if err := s.Read(h, got); err != nil || !bytes.Equal(got, want) {
			t.Fatalf("block %d reads back wrong: %v", i, err)
		}
	}
	// A new pack of a committed pack's name is refused: truncating it would
	// lose blocks others use.
	if _, err := s.CreatePack("snap-b"); !errors.Is(err, ErrPackInUse) {
		t.Fatalf("creating a pack over a committed one: %v", err)
	}
	// A pack whose snapshot never committed, and one still pending.
	c, _ := s.CreatePack("snap-c")
	put(c, 5)
	c.Close()
	d, _ := s.CreatePack("snap-d")
	put(d, 6)
	d.Close()
	if _, err := s.Sweep(referenced, map[string]bool{"snap-d": true}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(s.packPath("snap-c")); !os.IsNotExist(err) {
		t.Fatalf("the uncommitted pack survived the sweep: %v", err)
	}
	if _, err := os.Stat(s.packPath("snap-d")); err != nil {
		t.Fatalf("the pending pack was swept: %v", err)
	}
	if got := allocated(t, s.packPath("snap-b")); got > SlotSize+8192 {
		t.Fatalf("pack b takes %d bytes for its one new block after the sweep", got)
	}
	// Freeing: a block still referenced or pinned stays.
	_, h1 := block(1)
	_, h4 := block(4)
	s.Pin(h1)
	delete(refs, h1)
	if n := s.Free([]string{h1, h4}, referenced); n != 0 {
		t.Fatalf("freed %d blocks that were pinned or referenced", n)
	}
	s.Unpin(h1)
	if n := s.Free([]string{h1}, referenced); n != 1 || s.Stored(h1) {
		t.Fatalf("freed %d, stored %v", n, s.Stored(h1))
	}
	// A crash between forgetting block 2 and punching it: the sweep
	// punches the slot.
	_, h2 := block(2)
	delete(refs, h2)
	if err := db.Update(func(tx *store.Tx) error { return tx.Delete(KindLoc, h2) }); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Sweep(referenced, map[string]bool{"snap-d": true}); err != nil {
		t.Fatal(err)
	}
	if got := allocated(t, s.packPath("snap-a")); got > SlotSize+8192 {
		t.Fatalf("pack a takes %d bytes for its one live block after the sweep", got)
	}
	// Freeing the rest removes the packs.
	clear(refs)
	d2, _ := os.ReadDir(filepath.Join(s.dir, "packs"))
	if _, err := s.Sweep(referenced, nil); err != nil {
		t.Fatal(err)
	}
	if files, bytes := s.Usage(); files != 0 || bytes != 0 {
		t.Fatalf("%d files, %d bytes left after freeing everything (packs before: %d)", files, bytes, len(d2))
	}
}

// FuzzPackRecovery writes a slot of arbitrary bytes (a header, a block,
// cut anywhere) between two whole slots and reopens the pack: recovery
// never accepts a slot whose block does not hash to its header, and never
// loses the whole slots around it.
func FuzzPackRecovery(f *testing.F) {
	b0, h0 := block(0)
	valid := make([]byte, HeaderSize)
	encodeHeader(valid, 5, h0, true)
	f.Add(valid, uint32(SlotSize), byte(0))
	f.Add(valid, uint32(HeaderSize+100), byte(0))
	f.Add(valid, uint32(SlotSize), byte(1))
	f.Add([]byte("HNGRBLK1garbage"), uint32(30), byte(0))
	dir := f.TempDir()
	db, err := store.Open(filepath.Join(dir, "state.db"))
	if err != nil {
		f.Fatal(err)
	}
	defer db.Close()
	s, err := Open(filepath.Join(dir, "blocks"), db)
	if err != nil {
		f.Fatal(err)
	}
	var n atomic.Int64
	f.Fuzz(func(t *testing.T, hdr []byte, cut uint32, flip byte) {
		name := fmt.Sprintf("snap-f%d", n.Add(1))
		defer os.Remove(s.packPath(name))
		p, err := s.CreatePack(name)
		if err != nil {
			t.Fatal(err)
		}
		b1, h1 := block(1)
		b2, h2 := block(2)
		if slot, _, err := p.Append(1, h1, b1); err != nil || slot != 1 {
			t.Fatal(slot, err)
		}
		p.Close()
		slot := make([]byte, SlotSize)
		copy(slot, hdr)
		copy(slot[HeaderSize:], b0)
		slot[HeaderSize+int(flip)%BlockSize] ^= flip
		slot = slot[:min(int(cut), SlotSize)]
		hdr2 := make([]byte, HeaderSize)
		encodeHeader(hdr2, 2, h2, true)
		fh, err := os.OpenFile(s.packPath(name), os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := fh.WriteAt(slot, 2*SlotSize); err != nil {
			t.Fatal(err)
		}
		if _, err := fh.WriteAt(append(hdr2, b2...), 3*SlotSize); err != nil {
			t.Fatal(err)
		}
		fh.Close()
		p, recs, err := s.ResumePack(name)
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		got := map[uint64]Record{}
		buf := make([]byte, BlockSize)
		for _, r := range recs {
			got[r.Slot] = r
			if r.Data {
				rf, _ := os.Open(s.packPath(name))
				n, _ := rf.ReadAt(buf, int64(r.Slot)*SlotSize+HeaderSize)
				rf.Close()
				if n != BlockSize || Sum(buf) != r.Hash {
					t.Fatalf("slot %d accepted with a block that does not hash to its header", r.Slot)
				}
			}
		}
		if got[1].Hash != h1 || got[3].Hash != h2 || len(recs) > 3 {
			t.Fatalf("recovered %v", recs)
		}
	})
}

// TestUnalignedBlockIsWrittenBuffered: a block in a buffer O_DIRECT cannot
// take (not 4 KiB-aligned) is written through the page cache instead, and
// reads back after a reopen like any other.
func TestUnalignedBlockIsWrittenBuffered(t *testing.T) {
	s, db := openStore(t, t.TempDir())
	defer db.Close()
	p, err := s.CreatePack("snap-u")
	if err != nil {
		t.Fatal(err)
	}
	b, h := block(7)
	buf := make([]byte, BlockSize+1)
	odd := buf[1:]
	copy(odd, b)
	if aligned(odd) {
		t.Fatal("the test buffer is aligned")
	}
	_, ticket, err := p.Append(7, h, odd)
	if err == nil {
		err = p.Sync(ticket)
	}
	if err != nil {
		t.Fatal(err)
	}
	p.Close()
	_, recs, err := s.ResumePack("snap-u")
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != 1 || recs[0].Hash != h || !recs[0].Data {
		t.Fatalf("recovered %v", recs)
	}
}
