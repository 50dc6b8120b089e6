package creds

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestWriteLoadRoundTrip(t *testing.T) {
	path := filepath.Join(t.TempDir(), "credentials")
	root := Generate("default")
	ro := Generate("auditor")
	ro.Access = ReadOnlyAccess
	if err := Write(path, []Key{ro, root}); err != nil {
		t.Fatal(err)
	}
	st, _ := os.Stat(path)
	if st.Mode().Perm() != 0o600 {
		t.Fatalf("mode %v, want 0600", st.Mode().Perm())
	}
	keys, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(keys) != 2 || keys[0] != root || keys[1] != ro {
		t.Fatalf("round trip: got %+v", keys)
	}
	if !ValidAccessKeyID(root.AccessKeyID) || len(root.AccessKeyID) != 20 || len(root.SecretAccessKey) != 40 {
		t.Fatalf("generated key has the wrong shape: %q", root.AccessKeyID)
	}
}

func TestLoadRefusesOpenModes(t *testing.T) {
	path := filepath.Join(t.TempDir(), "credentials")
	if err := os.WriteFile(path, []byte(Format([]Key{Generate("default")})), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Load(path); err == nil || !strings.Contains(err.Error(), "0600") {
		t.Fatalf("Load of a 0644 file = %v", err)
	}
}

func TestParseErrors(t *testing.T) {
	for name, in := range map[string]string{
		"no secret":     "[default]\naws_access_key_id = AKIAEXAMPLE\n",
		"outside":       "aws_access_key_id = AKIAEXAMPLE\n",
		"bad header":    "[default\n",
		"no equals":     "[default]\nnonsense\n",
		"bad access":    "[default]\naws_access_key_id=A\naws_secret_access_key=B\nhangar_access=admin\n",
		"empty profile": "[]\n",
	} {
		if _, err := Parse(strings.NewReader(in)); err == nil {
			t.Errorf("%s: Parse accepted %q", name, in)
		}
	}
	keys, err := Parse(strings.NewReader("# c\r\n[profile x]\r\naws_access_key_id=AKIAX\r\naws_secret_access_key=S\r\n"))
	if err != nil || len(keys) != 1 || keys[0].Profile != "x" || keys[0].SecretAccessKey != "S" {
		t.Fatalf("CRLF file: %+v, %v", keys, err)
	}
}
