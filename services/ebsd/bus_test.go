package main

import (
	"bytes"
	"os"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

func memfd(t *testing.T, data []byte, seal bool) *os.File {
	t.Helper()
	fd, err := unix.MemfdCreate("test-block", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		t.Skipf("skipping: no memfd: %v", err)
	}
	f := os.NewFile(uintptr(fd), "test-block")
	t.Cleanup(func() { f.Close() })
	if _, err := f.Write(data); err != nil {
		t.Fatal(err)
	}
	if seal {
		if _, err := unix.FcntlInt(f.Fd(), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_WRITE|unix.F_SEAL_SEAL); err != nil {
			t.Fatal(err)
		}
	}
	return f
}

// TestBlockFromDescriptor: a sealed memfd is used in place (mapped), an
// unsealed one is copied (its writer could change it under the hash), and
// a descriptor shorter than announced is refused either way.
func TestBlockFromDescriptor(t *testing.T) {
	data := bytes.Repeat([]byte("0123456789abcdef"), 512<<10/16)
	for _, seal := range []bool{true, false} {
		f := memfd(t, data, seal)
		buf, release, err := blockFrom(f, len(data))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(buf, data) {
			t.Fatalf("sealed=%v: the block differs", seal)
		}
		if !seal {
			// A copy: writing the memfd afterwards does not change it.
			if _, err := f.WriteAt([]byte("changed!"), 0); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(buf, data) {
				t.Fatal("an unsealed descriptor was not copied")
			}
		}
		release()
		short := memfd(t, data[:1000], seal)
		if _, _, err := blockFrom(short, len(data)); err == nil || !strings.Contains(err.Error(), "holds 1000 bytes") {
			t.Fatalf("sealed=%v: a short descriptor: %v", seal, err)
		}
	}
}
