package main

import (
	"os"
	"strings"
	"testing"

	"hangar.dev/hangar/services/internal/hostconf"
)

// The image ships image/host.conf.defaults as
// /usr/share/hangar/host.conf.defaults; it must be what the key table
// renders, or a default documented in one place differs from the other.
// Regenerate with: go run ./services/firstboot --print-defaults > image/host.conf.defaults
func TestShippedDefaultsMatchTheKeyTable(t *testing.T) {
	raw, err := os.ReadFile("../../image/host.conf.defaults")
	if err != nil {
		t.Fatal(err)
	}
	if string(raw) != hostconf.DefaultsFile() {
		t.Fatal("image/host.conf.defaults is stale; run: go run ./services/firstboot --print-defaults > image/host.conf.defaults")
	}
}

// docs/host.conf.md documents every key with its real default.
func TestDocsCoverEveryKey(t *testing.T) {
	raw, err := os.ReadFile("../../docs/host.conf.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range hostconf.KeyNames() {
		def, _ := hostconf.KeyDefault(name)
		shown := "(empty)"
		if def != "" {
			shown = "`" + def + "`"
		}
		row := "| `" + name + "` | " + shown + " |"
		if !strings.Contains(string(raw), row) {
			t.Errorf("docs/host.conf.md has no row starting %q", row)
		}
	}
}
