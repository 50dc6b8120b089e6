// Package hostconf parses and validates /etc/hangar/host.conf, the one file
// an operator (or Cluster API's cloud-init) writes to configure a host, and
// carries the validated result to the services as JSON.
//
// host.conf is KEY=VALUE, one per line, '#' comments, values optionally
// quoted. It is parsed, never sourced: nothing in it is executed or
// expanded. Parse returns the config and a report; a key that is unknown or
// malformed is a report line naming the key and the line, never silently
// skipped. This package must not touch the machine: callers pass in what
// they measured (CPUs, memory) so validation stays a pure function.
package hostconf

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
)

// Config is a validated host configuration.
type Config struct {
	AccountID              string         `json:"account_id"`
	Region                 string         `json:"region"`
	AvailabilityZone       string         `json:"availability_zone"`
	APIListen              string         `json:"api_listen"`
	APITLS                 bool           `json:"api_tls"`
	APITLSNames            []string       `json:"api_tls_names,omitempty"`
	GuestSubnetPool        []netip.Prefix `json:"guest_subnet_pool"`
	ProtectedCIDRs         []netip.Prefix `json:"protected_cidrs"`
	PublicIPPool           []netip.Prefix `json:"public_ip_pool"`
	UplinkInterface        string         `json:"uplink_interface,omitempty"`
	DNSUpstreams           []string       `json:"dns_upstreams"`
	HostReserveVCPU        int            `json:"host_reserve_vcpu"`
	HostReserveMemoryMB    int            `json:"host_reserve_memory_mb"`
	CPUOvercommit          float64        `json:"cpu_overcommit"`
	AllowSoftwareEmulation bool           `json:"allow_software_emulation"`
	AdminAccessKeyID       string         `json:"-"`
	AdminSecretAccessKey   string         `json:"-"`
	K3SURL                 string         `json:"k3s_url,omitempty"`
	K3SToken               string         `json:"-"`
	StarterAMI             bool           `json:"starter_ami"`
}

// Severity separates what stops a key from applying from what only deserves
// an operator's attention.
type Severity string

const (
	Error   Severity = "error"
	Warning Severity = "warning"
)

// Problem is one report line.
type Problem struct {
	Severity Severity `json:"severity"`
	Key      string   `json:"key,omitempty"`
	Line     int      `json:"line,omitempty"`
	Message  string   `json:"message"`
	// File names the file when it is not host.conf itself (the shipped
	// defaults file).
	File string `json:"file,omitempty"`
}

// Code is the readiness reason code the problem is reported under.
func (p Problem) Code() string {
	if p.Severity == Error {
		return ReasonConfigInvalid
	}
	return ReasonConfigWarning
}

// Text is the problem without its code: the key, what is wrong, where.
func (p Problem) Text() string {
	var b strings.Builder
	if p.Key != "" {
		b.WriteString(p.Key)
		b.WriteString(" ")
	}
	b.WriteString(p.Message)
	switch {
	case p.Line > 0 && p.File != "":
		fmt.Fprintf(&b, " (%s line %d)", p.File, p.Line)
	case p.Line > 0:
		fmt.Fprintf(&b, " (line %d)", p.Line)
	case p.File != "":
		fmt.Fprintf(&b, " (%s)", p.File)
	}
	return b.String()
}

func (p Problem) String() string { return p.Code() + ": " + p.Text() }

// Report is what Parse found wrong, in file order.
type Report struct {
	Problems []Problem `json:"problems"`
}

// Errors returns the problems of severity Error.
func (r *Report) Errors() []Problem {
	var out []Problem
	for _, p := range r.Problems {
		if p.Severity == Error {
			out = append(out, p)
		}
	}
	return out
}

// OK reports whether nothing of severity Error was found.
func (r *Report) OK() bool { return len(r.Errors()) == 0 }

func (r *Report) add(sev Severity, key string, line int, format string, args ...any) {
	r.Problems = append(r.Problems, Problem{Severity: sev, Key: key, Line: line, Message: fmt.Sprintf(format, args...)})
}

// Machine is what the caller measured about the host, for the checks that
// depend on it. Zero values skip those checks.
type Machine struct {
	CPUs     int
	MemoryMB int
}

// Entry is one KEY=VALUE line as read.
type Entry struct {
	Key, Value string
	Line       int
}

// maxFileSize bounds what ReadEntries reads: a host.conf is a few dozen lines.
const maxFileSize = 1 << 20

var keyPattern = regexp.MustCompile(`^[A-Z][A-Z0-9_]*$`)

// ReadEntries splits a host.conf into entries, reporting lines that are not
// KEY=VALUE, duplicate keys, lower-case keys, unquoted spaces and CRLF line
// ends. It does not know which keys exist.
func ReadEntries(r io.Reader, rep *Report) []Entry {
	var (
		out  []Entry
		seen = map[string]int{}
		n    int
	)
	// bufio's line splitting drops a "\r" before "\n" silently; read the
	// whole (small) file first so CRLF line ends can be reported.
	data, err := io.ReadAll(io.LimitReader(r, maxFileSize+1))
	if err != nil {
		rep.add(Error, "", 0, "reading the file: %v", err)
		return nil
	}
	if len(data) > maxFileSize {
		rep.add(Error, "", 0, "is larger than %d bytes; is it the right file?", maxFileSize)
		return nil
	}
	crlf := bytes.Contains(data, []byte("\r\n"))
	lines := bufio.NewScanner(bytes.NewReader(data))
	lines.Buffer(make([]byte, 64*1024), maxFileSize)
	for lines.Scan() {
		n++
		raw := strings.TrimSuffix(lines.Text(), "\r")
		line := strings.TrimSpace(raw)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		line = strings.TrimPrefix(line, "export ")
		k, v, ok := strings.Cut(line, "=")
		if !ok {
			rep.add(Error, "", n, "is not KEY=VALUE: %q", truncate(line))
			continue
		}
		k = strings.TrimSpace(k)
		v = strings.TrimSpace(v)
		if !keyPattern.MatchString(k) {
			if up := strings.ToUpper(k); keyPattern.MatchString(up) {
				rep.add(Error, k, n, "keys are upper case: write %s", up)
			} else {
				rep.add(Error, k, n, "is not a valid key name")
			}
			continue
		}
		val, err := unquote(v)
		if err != nil {
			rep.add(Error, k, n, "%v", err)
			continue
		}
		if first, dup := seen[k]; dup {
			rep.add(Error, k, n, "is set twice (first on line %d); remove one", first)
			continue
		}
		seen[k] = n
		out = append(out, Entry{Key: k, Value: val, Line: n})
	}
	if err := lines.Err(); err != nil {
		rep.add(Error, "", n+1, "reading the file: %v", err)
	}
	if crlf {
		rep.add(Warning, "", 0, "has CRLF (Windows) line ends; they were read as plain line ends")
	}
	return out
}

func truncate(s string) string {
	if len(s) > 60 {
		return s[:60] + "…"
	}
	return s
}

// unquote accepts VALUE, "VALUE" and 'VALUE'. It expands nothing: a host.conf
// is data, and "$X" means the three characters $, X.
func unquote(v string) (string, error) {
	if len(v) >= 2 && (v[0] == '"' && v[len(v)-1] == '"' || v[0] == '\'' && v[len(v)-1] == '\'') {
		return v[1 : len(v)-1], nil
	}
	if strings.ContainsAny(v, "\"'") {
		return "", fmt.Errorf("has an unbalanced quote")
	}
	if strings.ContainsAny(v, " \t") {
		return "", fmt.Errorf("has a space in an unquoted value; quote it or use commas for lists")
	}
	return v, nil
}

// key describes one known key: its default and how to apply a value.
type key struct {
	def   string
	apply func(c *Config, v string) error
	doc   string
}

var accountPattern = regexp.MustCompile(`^[0-9]{12}$`)
var regionPattern = regexp.MustCompile(`^[a-z]{2}(-gov|-iso[a-z]?)?-[a-z]+-[0-9]{1,2}$`)

// Keys are every key host.conf may hold, with their defaults. The shipped
// /usr/share/hangar/host.conf.defaults is rendered from this table.
var Keys = map[string]key{
	"ACCOUNT_ID": {"", func(c *Config, v string) error {
		if v != "" && !accountPattern.MatchString(v) {
			return fmt.Errorf("must be 12 digits, like an AWS account id")
		}
		c.AccountID = v
		return nil
	}, "12-digit account id the API reports; generated once when empty"},
	"REGION": {"us-east-1", func(c *Config, v string) error {
		if !regionPattern.MatchString(v) {
			return fmt.Errorf("%q is not a region name like us-east-1", v)
		}
		c.Region = v
		return nil
	}, "region the host answers as"},
	"AVAILABILITY_ZONE": {"", func(c *Config, v string) error {
		c.AvailabilityZone = v
		return nil
	}, "zone the host answers as; REGION + \"a\" when empty"},
	"API_LISTEN": {"0.0.0.0:4566", func(c *Config, v string) error {
		host, port, err := net.SplitHostPort(v)
		if err != nil {
			return fmt.Errorf("must be ADDRESS:PORT: %v", err)
		}
		if host != "" {
			if _, err := netip.ParseAddr(host); err != nil {
				return fmt.Errorf("%q is not an IP address", host)
			}
		}
		if p, err := strconv.Atoi(port); err != nil || p < 1 || p > 65535 {
			return fmt.Errorf("port %q is not 1-65535", port)
		}
		c.APIListen = v
		return nil
	}, "address and port of the AWS API"},
	"API_TLS": {"no", boolKey(func(c *Config, b bool) { c.APITLS = b }), "serve the API over HTTPS with the first-boot certificate"},
	"API_TLS_NAMES": {"", func(c *Config, v string) error {
		c.APITLSNames = splitList(v)
		return nil
	}, "extra DNS names for the API certificate, comma-separated"},
	"GUEST_SUBNET_POOL": {"10.0.0.0/8,172.16.0.0/12,192.168.0.0/16,100.64.0.0/10", prefixListKey(func(c *Config, p []netip.Prefix) { c.GuestSubnetPool = p }), "CIDRs that VPC CIDR blocks must lie inside"},
	"PROTECTED_CIDRS":   {"", prefixListKey(func(c *Config, p []netip.Prefix) { c.ProtectedCIDRs = p }), "CIDRs no guest may ever reach"},
	"PUBLIC_IP_POOL":    {"", prefixListKey(func(c *Config, p []netip.Prefix) { c.PublicIPPool = p }), "LAN addresses handed out as public and Elastic IPs"},
	"UPLINK_INTERFACE": {"", func(c *Config, v string) error {
		if len(v) > 15 || strings.ContainsAny(v, "/ ") {
			return fmt.Errorf("%q is not an interface name", v)
		}
		c.UplinkInterface = v
		return nil
	}, "interface for NAT and public IPs; the default route's when empty"},
	"DNS_UPSTREAMS": {"", func(c *Config, v string) error {
		var out []string
		for _, s := range splitList(v) {
			if ap, err := netip.ParseAddrPort(s); err == nil {
				out = append(out, ap.String())
				continue
			}
			a, err := netip.ParseAddr(s)
			if err != nil {
				return fmt.Errorf("%q is not an IP address or IP:PORT", s)
			}
			out = append(out, netip.AddrPortFrom(a, 53).String())
		}
		c.DNSUpstreams = out
		return nil
	}, "resolvers the VPC DNS forwards to; none means REFUSED for outside names"},
	"HOST_RESERVE_VCPU":      {"1", intKey(0, 4096, func(c *Config, n int) { c.HostReserveVCPU = n }), "vCPUs kept back from guests"},
	"HOST_RESERVE_MEMORY_MB": {"1024", intKey(0, 1<<24, func(c *Config, n int) { c.HostReserveMemoryMB = n }), "memory kept back from guests"},
	"CPU_OVERCOMMIT": {"1", func(c *Config, v string) error {
		f, err := strconv.ParseFloat(v, 64)
		if err != nil || f < 1 || f > 16 {
			return fmt.Errorf("must be a number from 1 to 16")
		}
		c.CPUOvercommit = f
		return nil
	}, "guest vCPUs per host vCPU; memory is never overcommitted"},
	"ALLOW_SOFTWARE_EMULATION": {"no", boolKey(func(c *Config, b bool) { c.AllowSoftwareEmulation = b }), "run guests under QEMU TCG when KVM is missing (slow)"},
	"ADMIN_ACCESS_KEY_ID": {"", func(c *Config, v string) error {
		c.AdminAccessKeyID = v
		return nil
	}, "root access key id; generated when empty"},
	"ADMIN_SECRET_ACCESS_KEY": {"", func(c *Config, v string) error {
		c.AdminSecretAccessKey = v
		return nil
	}, "root secret access key; generated when empty"},
	"K3S_URL":     {"", func(c *Config, v string) error { c.K3SURL = v; return nil }, "k3s server to join as a host-pool member"},
	"K3S_TOKEN":   {"", func(c *Config, v string) error { c.K3SToken = v; return nil }, "join token for K3S_URL"},
	"STARTER_AMI": {"yes", boolKey(func(c *Config, b bool) { c.StarterAMI = b }), "import the bundled Debian AMI at first boot"},
}

func boolKey(set func(*Config, bool)) func(*Config, string) error {
	return func(c *Config, v string) error {
		switch strings.ToLower(v) {
		case "yes", "true", "1", "on":
			set(c, true)
		case "no", "false", "0", "off":
			set(c, false)
		default:
			return fmt.Errorf("must be yes or no, not %q", v)
		}
		return nil
	}
}

func intKey(min, max int, set func(*Config, int)) func(*Config, string) error {
	return func(c *Config, v string) error {
		n, err := strconv.Atoi(v)
		if err != nil || n < min || n > max {
			return fmt.Errorf("must be a whole number from %d to %d, not %q", min, max, v)
		}
		set(c, n)
		return nil
	}
}

func prefixListKey(set func(*Config, []netip.Prefix)) func(*Config, string) error {
	return func(c *Config, v string) error {
		var out []netip.Prefix
		for _, s := range splitList(v) {
			p, err := netip.ParsePrefix(s)
			if err != nil {
				a, aerr := netip.ParseAddr(s)
				if aerr != nil {
					return fmt.Errorf("%q is not a CIDR", s)
				}
				p = netip.PrefixFrom(a, a.BitLen())
			}
			if p.Masked() != p {
				return fmt.Errorf("%q has host bits set; did you mean %s?", s, p.Masked())
			}
			out = append(out, p)
		}
		set(c, out)
		return nil
	}
}

func splitList(v string) []string {
	var out []string
	for _, s := range strings.Split(v, ",") {
		if s = strings.TrimSpace(s); s != "" {
			out = append(out, s)
		}
	}
	return out
}

// Defaults returns the configuration with every key at its default.
func Defaults() Config {
	var c Config
	for _, name := range KeyNames() {
		if err := Keys[name].apply(&c, Keys[name].def); err != nil {
			panic(fmt.Sprintf("hostconf: default of %s does not parse: %v", name, err))
		}
	}
	c.AvailabilityZone = c.Region + "a"
	return c
}

// KeyDefault returns a key's default as the defaults file writes it.
func KeyDefault(name string) (string, bool) {
	k, ok := Keys[name]
	return k.def, ok
}

// KeyDoc returns a key's one-line description.
func KeyDoc(name string) string { return Keys[name].doc }

// KeyNames lists the known keys in order.
func KeyNames() []string {
	names := make([]string, 0, len(Keys))
	for k := range Keys {
		names = append(names, k)
	}
	sort.Strings(names)
	return names
}

// DefaultsFile renders the shipped defaults file.
func DefaultsFile() string {
	var b strings.Builder
	b.WriteString("# hangar host configuration defaults. Do not edit: set keys in /etc/hangar/host.conf.\n")
	for _, name := range KeyNames() {
		k := Keys[name]
		fmt.Fprintf(&b, "\n# %s\n%s=%s\n", k.doc, name, quoteIfNeeded(k.def))
	}
	return b.String()
}

func quoteIfNeeded(v string) string {
	if v == "" || strings.ContainsAny(v, " \t#") {
		return `"` + v + `"`
	}
	return v
}

// Apply layers entries on top of c, reporting unknown keys and bad values.
// A bad value leaves c's value for that key as it was (the default), so a
// typo never turns into something the operator did not write.
func Apply(c *Config, entries []Entry, rep *Report) {
	for _, e := range entries {
		k, ok := Keys[e.Key]
		if !ok {
			rep.add(Error, e.Key, e.Line, "is not a known key%s", suggest(e.Key))
			continue
		}
		if err := k.apply(c, e.Value); err != nil {
			rep.add(Error, e.Key, e.Line, "%v", err)
		}
	}
}

func suggest(k string) string {
	best, bestD := "", 4
	for name := range Keys {
		if d := distance(k, name); d < bestD {
			best, bestD = name, d
		}
	}
	if best == "" {
		return ""
	}
	return "; did you mean " + best + "?"
}

// distance is the Levenshtein distance, for "did you mean" hints.
func distance(a, b string) int {
	prev := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur := make([]int, len(b)+1)
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev = cur
	}
	return prev[len(b)]
}

// Parse reads a host.conf over the defaults and checks the whole.
func Parse(r io.Reader, m Machine) (Config, *Report) {
	return ParseLayered(nil, "", r, m)
}

// ParseLayered reads the shipped defaults file (named defaultsName in the
// report) and then host.conf over it, and checks the whole. A derived image
// may change a default by shipping its own defaults file; what is wrong in
// it is reported with the file's name. A nil defaults reader means the
// built-in table alone.
func ParseLayered(defaults io.Reader, defaultsName string, r io.Reader, m Machine) (Config, *Report) {
	rep := &Report{}
	c := Defaults()
	c.AvailabilityZone = ""
	if defaults != nil {
		drep := &Report{}
		Apply(&c, ReadEntries(defaults, drep), drep)
		for _, p := range drep.Problems {
			p.File = defaultsName
			rep.Problems = append(rep.Problems, p)
		}
	}
	var entries []Entry
	if r != nil {
		entries = ReadEntries(r, rep)
	}
	Apply(&c, entries, rep)
	line := map[string]int{}
	for _, e := range entries {
		line[e.Key] = e.Line
	}
	Check(&c, m, rep, line)
	return c, rep
}

// Check validates the keys against each other and the machine.
func Check(c *Config, m Machine, rep *Report, line map[string]int) {
	if c.AvailabilityZone == "" {
		c.AvailabilityZone = c.Region + "a"
	} else if !strings.HasPrefix(c.AvailabilityZone, c.Region) || len(c.AvailabilityZone) != len(c.Region)+1 ||
		c.AvailabilityZone[len(c.Region)] < 'a' || c.AvailabilityZone[len(c.Region)] > 'z' {
		rep.add(Error, "AVAILABILITY_ZONE", line["AVAILABILITY_ZONE"], "%q is not a zone of region %s (like %sa)", c.AvailabilityZone, c.Region, c.Region)
		c.AvailabilityZone = c.Region + "a"
	}
	for _, pool := range []struct {
		key string
		ps  []netip.Prefix
	}{{"GUEST_SUBNET_POOL", c.GuestSubnetPool}, {"PUBLIC_IP_POOL", c.PublicIPPool}} {
		for _, p := range pool.ps {
			for _, prot := range c.ProtectedCIDRs {
				if !p.Overlaps(prot) {
					continue
				}
				if _, set := line[pool.key]; !set && pool.key == "GUEST_SUBNET_POOL" {
					// The default pool is all of private space; protecting
					// part of the LAN is normal, so only say what follows.
					rep.add(Warning, pool.key, 0, "default %s overlaps PROTECTED_CIDRS entry %s; VPC CIDRs overlapping it are refused", p, prot)
					continue
				}
				rep.add(Error, pool.key, line[pool.key], "%s overlaps PROTECTED_CIDRS entry %s", p, prot)
			}
		}
	}
	for _, p := range c.PublicIPPool {
		for _, g := range c.GuestSubnetPool {
			if p.Overlaps(g) {
				rep.add(Warning, "PUBLIC_IP_POOL", line["PUBLIC_IP_POOL"], "%s overlaps GUEST_SUBNET_POOL entry %s; a VPC using those addresses cannot reach its own public IPs", p, g)
			}
		}
	}
	if m.CPUs > 0 && c.HostReserveVCPU >= m.CPUs {
		rep.add(Error, "HOST_RESERVE_VCPU", line["HOST_RESERVE_VCPU"], "reserves %d vCPUs but the machine has %d; nothing would be left for guests", c.HostReserveVCPU, m.CPUs)
	}
	if m.MemoryMB > 0 && c.HostReserveMemoryMB >= m.MemoryMB {
		rep.add(Error, "HOST_RESERVE_MEMORY_MB", line["HOST_RESERVE_MEMORY_MB"], "reserves %d MiB but the machine has %d MiB; nothing would be left for guests", c.HostReserveMemoryMB, m.MemoryMB)
	}
	if (c.AdminAccessKeyID == "") != (c.AdminSecretAccessKey == "") {
		rep.add(Error, "ADMIN_SECRET_ACCESS_KEY", line["ADMIN_SECRET_ACCESS_KEY"], "ADMIN_ACCESS_KEY_ID and ADMIN_SECRET_ACCESS_KEY must be set together")
	}
	if c.AdminAccessKeyID != "" && (len(c.AdminAccessKeyID) < 16 || strings.ToUpper(c.AdminAccessKeyID) != c.AdminAccessKeyID) {
		rep.add(Error, "ADMIN_ACCESS_KEY_ID", line["ADMIN_ACCESS_KEY_ID"], "must be at least 16 upper-case letters and digits, like AKIA…")
	}
	if c.AdminSecretAccessKey != "" && len(c.AdminSecretAccessKey) < 16 {
		rep.add(Error, "ADMIN_SECRET_ACCESS_KEY", line["ADMIN_SECRET_ACCESS_KEY"], "is shorter than 16 characters")
	}
	if (c.K3SURL == "") != (c.K3SToken == "") {
		rep.add(Error, "K3S_TOKEN", line["K3S_TOKEN"], "K3S_URL and K3S_TOKEN must be set together")
	}
	if c.AllowSoftwareEmulation {
		rep.add(Warning, "ALLOW_SOFTWARE_EMULATION", line["ALLOW_SOFTWARE_EMULATION"], "is on: guests may run under QEMU TCG, 10-50x slower than KVM")
	}
}

// Save writes c as the runtime JSON the services read.
func Save(path string, c Config) error {
	raw, err := json.MarshalIndent(c, "", "  ")
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, append(raw, '\n'), 0o644); err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	return os.Rename(tmp, path)
}

// Load reads the runtime JSON written by Save.
func Load(path string) (Config, error) {
	var c Config
	raw, err := os.ReadFile(path)
	if err != nil {
		return c, fmt.Errorf("reading host config: %w", err)
	}
	if err := json.Unmarshal(raw, &c); err != nil {
		return c, fmt.Errorf("parsing host config %s: %w", path, err)
	}
	if c.Region == "" || c.AvailabilityZone == "" {
		return c, fmt.Errorf("host config %s has no region or zone; was it written by hangar-firstboot?", path)
	}
	return c, nil
}

// DefaultRuntimePath is where hangar-firstboot writes the validated config.
const DefaultRuntimePath = "/run/hangar/host.json"
