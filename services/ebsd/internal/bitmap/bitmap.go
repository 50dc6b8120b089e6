// Package bitmap is a block bitmap that many goroutines may set at once
// and that remembers which 4 KiB pages changed since they were last taken
// for writing, so a flush writes only those pages.
//
// It is pure: the volume decides when and where pages go to disk.
package bitmap

import (
	"math/bits"
	"sync/atomic"
)

// PageBytes is the unit in which a bitmap is written to disk.
const PageBytes = 4096

const wordsPerPage = PageBytes / 8

// Bitmap is a fixed-size bitmap. Set, Test and TakeDirty may run
// concurrently; Grow may not run with anything else.
type Bitmap struct {
	n     uint64
	words []uint64
	dirty []uint32 // one flag per page
}

// New returns an all-zero bitmap of n bits.
func New(n uint64) *Bitmap {
	b := &Bitmap{}
	b.Grow(n)
	return b
}

// Len returns the number of bits.
func (b *Bitmap) Len() uint64 { return b.n }

// Bytes returns the size of the bitmap on disk: whole pages.
func (b *Bitmap) Bytes() int64 { return int64(len(b.words)) * 8 }

// Grow extends the bitmap to n bits; shrinking is not supported.
func (b *Bitmap) Grow(n uint64) {
	if n < b.n {
		return
	}
	words := (n + 63) / 64
	words = (words + wordsPerPage - 1) / wordsPerPage * wordsPerPage
	if words > uint64(len(b.words)) {
		nw := make([]uint64, words)
		copy(nw, b.words)
		b.words = nw
		nd := make([]uint32, words/wordsPerPage)
		copy(nd, b.dirty)
		b.dirty = nd
	}
	b.n = n
}

// Test reports whether bit i is set.
func (b *Bitmap) Test(i uint64) bool {
	if i >= b.n {
		return false
	}
	return atomic.LoadUint64(&b.words[i/64])&(1<<(i%64)) != 0
}

// Set sets bit i and reports whether it was clear.
func (b *Bitmap) Set(i uint64) bool {
	mask := uint64(1) << (i % 64)
	old := atomic.OrUint64(&b.words[i/64], mask)
	if old&mask != 0 {
		return false
	}
	atomic.StoreUint32(&b.dirty[i/64/wordsPerPage], 1)
	return true
}

// Clear clears bit i.
func (b *Bitmap) Clear(i uint64) {
	mask := uint64(1) << (i % 64)
	old := atomic.AndUint64(&b.words[i/64], ^mask)
	if old&mask != 0 {
		atomic.StoreUint32(&b.dirty[i/64/wordsPerPage], 1)
	}
}

// Count returns the number of set bits.
func (b *Bitmap) Count() uint64 {
	var n int
	for i := range b.words {
		n += bits.OnesCount64(atomic.LoadUint64(&b.words[i]))
	}
	return uint64(n)
}

// Next returns the first set bit at or after i, or false.
func (b *Bitmap) Next(i uint64) (uint64, bool) {
	for i < b.n {
		w := atomic.LoadUint64(&b.words[i/64]) >> (i % 64)
		if w != 0 {
			j := i + uint64(bits.TrailingZeros64(w))
			if j < b.n {
				return j, true
			}
			return 0, false
		}
		i = (i/64 + 1) * 64
	}
	return 0, false
}

// Clone returns a copy (dirty flags clear).
func (b *Bitmap) Clone() *Bitmap {
	c := New(b.n)
	for i := range b.words {
		c.words[i] = atomic.LoadUint64(&b.words[i])
	}
	return c
}

// Page is one page of the bitmap as it is to be written.
type Page struct {
	Index int // page number; the file offset is Index*PageBytes
	Data  []byte
}

// TakeDirty returns a copy of every page set since the last TakeDirty and
// clears their flags first, so a bit set while the copy is made marks its
// page dirty again for the next flush.
func (b *Bitmap) TakeDirty() []Page {
	var out []Page
	for p := range b.dirty {
		if atomic.SwapUint32(&b.dirty[p], 0) == 0 {
			continue
		}
		out = append(out, Page{Index: p, Data: b.page(p)})
	}
	return out
}

// MarkDirty flags pages again (after a failed write).
func (b *Bitmap) MarkDirty(pages []Page) {
	for _, p := range pages {
		atomic.StoreUint32(&b.dirty[p.Index], 1)
	}
}

func (b *Bitmap) page(p int) []byte {
	out := make([]byte, PageBytes)
	for w := 0; w < wordsPerPage; w++ {
		v := atomic.LoadUint64(&b.words[p*wordsPerPage+w])
		for k := 0; k < 8; k++ {
			out[w*8+k] = byte(v >> (8 * k))
		}
	}
	return out
}

// Encode returns the whole bitmap as it is stored.
func (b *Bitmap) Encode() []byte {
	out := make([]byte, 0, len(b.words)*8)
	for p := range b.dirty {
		out = append(out, b.page(p)...)
	}
	return out
}

// Load fills the bitmap from stored bytes (little-endian words); bits
// past Len are ignored.
func (b *Bitmap) Load(raw []byte) {
	for w := range b.words {
		var v uint64
		for k := 0; k < 8; k++ {
			if i := w*8 + k; i < len(raw) {
				v |= uint64(raw[i]) << (8 * k)
			}
		}
		b.words[w] = v
	}
	start := b.n / 64
	if rem := b.n % 64; rem != 0 {
		b.words[start] &= (1 << rem) - 1
		start++
	}
	for w := start; w < uint64(len(b.words)); w++ {
		b.words[w] = 0
	}
}
