package hostconf

import (
	"path/filepath"
	"strings"
	"testing"
)

func TestParse(t *testing.T) {
	for _, tc := range []struct {
		name    string
		in      string
		m       Machine
		wantErr []string // substrings of error report lines, in order
		// wantWarn are substrings of warning lines, in order (checked
		// when set).
		wantWarn []string
		check    func(t *testing.T, c Config)
	}{
		{
			name: "empty file gives defaults",
			in:   "",
			check: func(t *testing.T, c Config) {
				if c.Region != "us-east-1" || c.AvailabilityZone != "us-east-1a" || c.APIListen != "0.0.0.0:4566" {
					t.Errorf("defaults: %+v", c)
				}
				if c.AllowSoftwareEmulation {
					t.Error("software emulation must be off by default")
				}
			},
		},
		{
			name: "values, quotes, comments",
			in:   "# host\nREGION=eu-west-1\nDNS_UPSTREAMS=\"1.1.1.1, 9.9.9.9:5353\"\nPROTECTED_CIDRS='192.168.1.0/24'\n",
			check: func(t *testing.T, c Config) {
				if c.Region != "eu-west-1" || c.AvailabilityZone != "eu-west-1a" {
					t.Errorf("region/zone: %s %s", c.Region, c.AvailabilityZone)
				}
				if len(c.DNSUpstreams) != 2 || c.DNSUpstreams[0] != "1.1.1.1:53" || c.DNSUpstreams[1] != "9.9.9.9:5353" {
					t.Errorf("upstreams: %v", c.DNSUpstreams)
				}
				if len(c.ProtectedCIDRs) != 1 || c.ProtectedCIDRs[0].String() != "192.168.1.0/24" {
					t.Errorf("protected: %v", c.ProtectedCIDRs)
				}
			},
		},
		{name: "unknown key", in: "REGON=us-east-1\n", wantErr: []string{"REGON is not a known key; did you mean REGION? (line 1)"}},
		{name: "lower case key", in: "region=us-east-1\n", wantErr: []string{"region keys are upper case: write REGION"}},
		{name: "duplicate", in: "REGION=us-east-1\nREGION=us-west-2\n", wantErr: []string{"REGION is set twice (first on line 1)"}},
		{name: "spaces", in: "API_TLS_NAMES=a b\n", wantErr: []string{"space in an unquoted value"}},
		{name: "not key value", in: "hello\n", wantErr: []string{"is not KEY=VALUE"}},
		{name: "bad cidr", in: "PROTECTED_CIDRS=10.0.0.1/8\n", wantErr: []string{"has host bits set; did you mean 10.0.0.0/8?"}},
		{name: "pool overlaps protected", in: "GUEST_SUBNET_POOL=10.0.0.0/8\nPROTECTED_CIDRS=10.1.0.0/16\n", wantErr: []string{"GUEST_SUBNET_POOL 10.0.0.0/8 overlaps PROTECTED_CIDRS entry 10.1.0.0/16"}},
		{name: "reserve too big", in: "HOST_RESERVE_VCPU=8\n", m: Machine{CPUs: 4}, wantErr: []string{"reserves 8 vCPUs but the machine has 4"}},
		{name: "bad bool", in: "API_TLS=maybe\n", wantErr: []string{"API_TLS must be yes or no"}},
		{name: "zone outside region", in: "REGION=us-west-2\nAVAILABILITY_ZONE=us-east-1a\n", wantErr: []string{"is not a zone of region us-west-2"}},
		{name: "half credentials", in: "ADMIN_ACCESS_KEY_ID=AKIAAAAAAAAAAAAAAAAA\n", wantErr: []string{"must be set together"}},
		{
			name: "crlf is a warning, not an error",
			in:   "REGION=us-west-2\r\n",
			check: func(t *testing.T, c Config) {
				if c.Region != "us-west-2" {
					t.Errorf("region %q", c.Region)
				}
			},
			wantWarn: []string{"has CRLF (Windows) line ends"},
		},
		{
			name:    "bad value keeps the default",
			in:      "REGION=mars\n",
			wantErr: []string{`REGION "mars" is not a region name`},
			check: func(t *testing.T, c Config) {
				if c.Region != "us-east-1" {
					t.Errorf("region %q", c.Region)
				}
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, rep := Parse(strings.NewReader(tc.in), tc.m)
			errs := rep.Errors()
			if len(errs) != len(tc.wantErr) {
				t.Fatalf("errors %v, want %d matching %q", errs, len(tc.wantErr), tc.wantErr)
			}
			for i, want := range tc.wantErr {
				if !strings.Contains(errs[i].String(), want) {
					t.Errorf("error %d = %q, want it to contain %q", i, errs[i].String(), want)
				}
			}
			if tc.wantWarn != nil {
				var warns []Problem
				for _, p := range rep.Problems {
					if p.Severity == Warning {
						warns = append(warns, p)
					}
				}
				if len(warns) != len(tc.wantWarn) {
					t.Fatalf("warnings %v, want %q", warns, tc.wantWarn)
				}
				for i, want := range tc.wantWarn {
					if !strings.Contains(warns[i].String(), want) {
						t.Errorf("warning %d = %q, want it to contain %q", i, warns[i].String(), want)
					}
				}
			}
			if tc.check != nil {
				tc.check(t, c)
			}
		})
	}
}

func TestDefaultsFileParsesToDefaults(t *testing.T) {
	c, rep := Parse(strings.NewReader(DefaultsFile()), Machine{})
	if !rep.OK() {
		t.Fatalf("the shipped defaults file does not parse cleanly: %v", rep.Errors())
	}
	if c.Region != Defaults().Region || c.APIListen != Defaults().APIListen {
		t.Fatalf("defaults file gives %+v", c)
	}
}

func TestSaveLoad(t *testing.T) {
	path := filepath.Join(t.TempDir(), "host.json")
	c := Defaults()
	c.AccountID = "123456789012"
	c.AdminSecretAccessKey = "never-in-the-json"
	if err := Save(path, c); err != nil {
		t.Fatal(err)
	}
	got, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	if got.AccountID != c.AccountID || got.AdminSecretAccessKey != "" {
		t.Fatalf("Load = %+v", got)
	}
}
