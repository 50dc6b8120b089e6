package bitmap

import (
	"math/rand"
	"sync"
	"testing"
)

func TestSetTakeDirtyLoad(t *testing.T) {
	b := New(100000)
	rng := rand.New(rand.NewSource(1))
	want := map[uint64]bool{}
	var wg sync.WaitGroup
	var mu sync.Mutex
	for g := 0; g < 4; g++ {
		idx := make([]uint64, 500)
		for i := range idx {
			idx[i] = uint64(rng.Intn(100000))
			want[idx[i]] = true
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for _, i := range idx {
				b.Set(i)
			}
			mu.Lock()
			mu.Unlock()
		}()
	}
	wg.Wait()
	if b.Count() != uint64(len(want)) {
		t.Fatalf("count %d, want %d", b.Count(), len(want))
	}
	// Writing the dirty pages into an image reproduces the bitmap.
	img := make([]byte, b.Bytes())
	for _, p := range b.TakeDirty() {
		copy(img[p.Index*PageBytes:], p.Data)
	}
	if len(b.TakeDirty()) != 0 {
		t.Fatal("pages still dirty after TakeDirty")
	}
	c := New(100000)
	c.Load(img)
	for i := uint64(0); i < 100000; i++ {
		if c.Test(i) != want[i] {
			t.Fatalf("bit %d = %v after load, want %v", i, c.Test(i), want[i])
		}
	}
	// Next walks the set bits in order.
	n := 0
	for i, ok := c.Next(0); ok; i, ok = c.Next(i + 1) {
		if !want[i] {
			t.Fatalf("Next returned unset bit %d", i)
		}
		n++
	}
	if n != len(want) {
		t.Fatalf("Next visited %d bits, want %d", n, len(want))
	}
	// A set after TakeDirty makes its page dirty again.
	c.Set(99999)
	if d := c.TakeDirty(); len(d) != 1 || d[0].Index != 99999/8/PageBytes {
		t.Fatalf("dirty pages %v", d)
	}
	// Grow keeps bits; Load ignores bits past Len.
	c.Grow(200000)
	if !c.Test(99999) || c.Test(150000) {
		t.Fatal("grow lost or invented bits")
	}
	full := make([]byte, c.Bytes())
	for i := range full {
		full[i] = 0xff
	}
	d := New(70)
	d.Load(full)
	if d.Count() != 70 {
		t.Fatalf("load set %d bits of 70", d.Count())
	}
}
