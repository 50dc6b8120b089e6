package awsid

import "testing"

func TestNewIsValidAndDistinct(t *testing.T) {
	seen := map[string]bool{}
	for range 1000 {
		id := New("vpc")
		if !Valid("vpc", id) {
			t.Fatalf("New made %q, which Valid rejects", id)
		}
		if seen[id] {
			t.Fatalf("New repeated %q", id)
		}
		seen[id] = true
	}
}

func TestValid(t *testing.T) {
	for _, tc := range []struct {
		prefix, id string
		want       bool
	}{
		{"vpc", "vpc-0a1b2c3d4e5f67890", true},
		{"vpc", "vpc-1a2b3c4d", true},
		{"vpc", "vpc-1A2B3C4D", false},
		{"vpc", "subnet-1a2b3c4d", false},
		{"vpc", "vpc-", false},
		{"vpc", "vpc-0a1b2c3d4e5f6789", false},
		{"vpc", "vpc-0a1b2c3d4e5f6789g", false},
		{"sg", "sg-0123456789abcdef0", true},
	} {
		if got := Valid(tc.prefix, tc.id); got != tc.want {
			t.Errorf("Valid(%q, %q) = %v, want %v", tc.prefix, tc.id, got, tc.want)
		}
	}
}

func TestBusPathRoundTrip(t *testing.T) {
	id := "i-0123456789abcdef0"
	if got := BusPath(id); got != "i_0123456789abcdef0" {
		t.Fatalf("BusPath = %q", got)
	}
	if FromBusPath(BusPath(id)) != id {
		t.Fatal("FromBusPath does not reverse BusPath")
	}
}

func TestRequestIDShape(t *testing.T) {
	id := RequestID()
	if len(id) != 36 || id[8] != '-' || id[14] != '4' {
		t.Fatalf("RequestID = %q", id)
	}
}
