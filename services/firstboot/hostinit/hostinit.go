// Package hostinit is what first boot does, as a library: read host.conf
// over the shipped defaults, validate it, and write the host's identity and
// the services' view of it: the runtime config (host.json), the admin
// credentials, the account id, a CA and server certificate, and the
// readiness report. hangar-firstboot runs it at every boot; `hangar dev`
// runs the same function against its state directory, so the image and a
// development host cannot drift apart.
//
// Every step measures, then acts: a re-run with the same host.conf changes
// nothing, and a changed host.conf changes only what it changed. Nothing
// here deletes what an operator wrote; what cannot be made valid is named
// in the readiness report instead.
package hostinit

import (
	"bufio"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"math/big"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"hangar.dev/hangar/services/internal/atomicfile"
	"hangar.dev/hangar/services/internal/hostconf"
	"hangar.dev/hangar/services/internal/kvm"
)

// Paths are where first boot reads and writes. DefaultPaths is the image's
// layout; `hangar dev` points them into its state directory.
type Paths struct {
	HostConf      string // operator's config: /etc/hangar/host.conf
	Defaults      string // shipped defaults: /usr/share/hangar/host.conf.defaults ("" = built-in table)
	RuntimeConfig string // validated config for the services: /run/hangar/host.json
	Readiness     string // readiness report: /run/hangar/readiness.json
	Credentials   string // admin credentials: /etc/hangar/credentials
	TLSDir        string // CA and server certificate: /etc/hangar/tls
	StateDir      string // persistent identity (account id): /var/lib/hangar
	KVMDevice     string // /dev/kvm
	// SysModule and CPUInfo are what the KVM verdict reads besides the
	// device ("" = /sys/module, /proc/cpuinfo).
	SysModule, CPUInfo string
	// StarterAMI is the bundled starter AMI's description
	// (/usr/share/hangar/starter/ami.env), which the gateway imports when
	// STARTER_AMI=yes; "" skips the check (hangar dev).
	StarterAMI string
}

// DefaultPaths is the layout of the image (see docs/image.md).
func DefaultPaths() Paths {
	return Paths{
		HostConf:      "/etc/hangar/host.conf",
		Defaults:      "/usr/share/hangar/host.conf.defaults",
		RuntimeConfig: hostconf.DefaultRuntimePath,
		Readiness:     hostconf.DefaultReadinessPath,
		Credentials:   "/etc/hangar/credentials",
		TLSDir:        "/etc/hangar/tls",
		StateDir:      "/var/lib/hangar",
		KVMDevice:     "/dev/kvm",
		StarterAMI:    "/usr/share/hangar/starter/ami.env",
	}
}

// Options adjust a run. Zero values mean "measure it".
type Options struct {
	// Machine is the host's size for the reserve checks; zero measures it.
	Machine hostconf.Machine
	// Listen, when set, replaces API_LISTEN (hangar dev --listen).
	Listen string
	// Owner is the user that must be able to read the credentials and the
	// server key (the gateway's, hangar-gateway in the image). Empty leaves
	// owners alone, as in `hangar dev`.
	Owner string
	// Hostname and Addresses go into the server certificate; empty measures.
	Hostname  string
	Addresses []netip.Addr
	// MinFreeBytes below which the state directory's file system is
	// reported as StorageMissing; zero means 1 GiB.
	MinFreeBytes uint64
	// Now is the clock for certificates; nil is time.Now.
	Now func() time.Time
}

// Result is what a run found and did.
type Result struct {
	Config    hostconf.Config
	Report    *hostconf.Report
	Readiness hostconf.Readiness
	// Actions say what changed, one line each; empty on a re-run that
	// found everything as it should be.
	Actions []string
}

// AccountIDFile is where a generated account id is kept, under StateDir.
const AccountIDFile = "account-id"

// Run does first boot. It returns an error only when it could not write
// what the services need (the runtime config or the readiness report);
// everything wrong with the host or its config is in the readiness report.
func Run(ctx context.Context, log *slog.Logger, p Paths, o Options) (*Result, error) {
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.Machine == (hostconf.Machine{}) {
		o.Machine = measureMachine()
	}
	res := &Result{Readiness: hostconf.Readiness{Ready: true}}
	act := func(format string, args ...any) {
		msg := fmt.Sprintf(format, args...)
		res.Actions = append(res.Actions, msg)
		log.Info(msg)
	}

	// 1. host.conf over the defaults.
	cfg, rep := parse(p, o.Machine, &res.Readiness)
	res.Report = rep
	for _, pr := range rep.Problems {
		res.Readiness.Add(pr.Code(), pr.Severity == hostconf.Error, "%s", pr.Text())
	}
	if o.Listen != "" {
		cfg.APIListen = o.Listen
	}

	// 2. The account id: host.conf's when set, otherwise generated once and
	// kept, so the ARNs the API hands out stay the same across boots.
	if cfg.AccountID == "" {
		id, created, err := accountID(filepath.Join(p.StateDir, AccountIDFile))
		if err != nil {
			return nil, err
		}
		if created {
			act("generated account id %s (kept in %s)", id, filepath.Join(p.StateDir, AccountIDFile))
		}
		cfg.AccountID = id
	}

	// 3. Credentials, 4. certificates.
	ensureCredentials(p.Credentials, cfg, rep, o.Owner, &res.Readiness, act)
	ensureTLS(p.TLSDir, cfg, o, &res.Readiness, act)

	// 5. What the machine and the image lack.
	checkKVM(kvm.Probe{Device: p.KVMDevice, SysModule: p.SysModule, CPUInfo: p.CPUInfo}, cfg, &res.Readiness)
	checkStorage(p.StateDir, o.MinFreeBytes, &res.Readiness)
	checkStarterAMI(p.StarterAMI, cfg, &res.Readiness)

	// 6. Hand the result to the services, then the report to operators.
	if err := saveIfChanged(p.RuntimeConfig, cfg, act); err != nil {
		return nil, err
	}
	if err := hostconf.SaveReadiness(p.Readiness, res.Readiness); err != nil {
		return nil, fmt.Errorf("writing the readiness report: %w", err)
	}
	for _, r := range res.Readiness.Reasons {
		log.Warn("readiness", "code", r.Code, "fatal", r.Fatal, "reason", r.Message)
	}
	res.Config = cfg
	return res, ctx.Err()
}

// parse reads the defaults and host.conf. A missing or unreadable host.conf
// is not fatal: the defaults apply and the report says so.
func parse(p Paths, m hostconf.Machine, r *hostconf.Readiness) (hostconf.Config, *hostconf.Report) {
	var defaults io.Reader
	if p.Defaults != "" {
		raw, err := os.ReadFile(p.Defaults)
		switch {
		case err == nil:
			defaults = strings.NewReader(string(raw))
		default:
			r.Add(hostconf.ReasonConfigWarning, false, "cannot read the shipped defaults %s (%v); the built-in defaults apply", p.Defaults, errText(err))
		}
	}
	var conf io.Reader
	raw, err := os.ReadFile(p.HostConf)
	switch {
	case err == nil:
		conf = strings.NewReader(string(raw))
	case errors.Is(err, fs.ErrNotExist):
		r.Add(hostconf.ReasonConfigMissing, false, "%s does not exist; every key has its default", p.HostConf)
	default:
		r.Add(hostconf.ReasonConfigMissing, false, "cannot read %s (%v); every key has its default", p.HostConf, errText(err))
	}
	return hostconf.ParseLayered(defaults, p.Defaults, conf, m)
}

// errText is an error without the path the message already names.
func errText(err error) string {
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return pe.Err.Error()
	}
	return err.Error()
}

func measureMachine() hostconf.Machine {
	m := hostconf.Machine{CPUs: runtime.NumCPU()}
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return m
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		fields := strings.Fields(s.Text())
		if len(fields) >= 2 && fields[0] == "MemTotal:" {
			if kb, err := strconv.Atoi(fields[1]); err == nil {
				m.MemoryMB = kb / 1024
			}
		}
	}
	return m
}

// accountID returns the kept account id, generating it on first use.
func accountID(path string) (id string, created bool, err error) {
	raw, err := os.ReadFile(path)
	if err == nil {
		id = strings.TrimSpace(string(raw))
		if len(id) == 12 && strings.Trim(id, "0123456789") == "" {
			return id, false, nil
		}
		return "", false, fmt.Errorf("%s holds %q, not a 12-digit account id; fix or remove it", path, id)
	}
	if !errors.Is(err, fs.ErrNotExist) {
		return "", false, fmt.Errorf("reading the account id: %w", err)
	}
	n, err := rand.Int(rand.Reader, big.NewInt(9e11))
	if err != nil {
		return "", false, fmt.Errorf("generating an account id: %w", err)
	}
	id = fmt.Sprintf("%012d", n.Int64()+1e11)
	if err := atomicfile.Write(path, []byte(id+"\n"), 0o644, 0o755); err != nil {
		return "", false, fmt.Errorf("keeping the account id: %w", err)
	}
	return id, true, nil
}

// saveIfChanged writes the runtime config only when its content changed, so
// a re-run that changed nothing says so.
func saveIfChanged(path string, cfg hostconf.Config, act func(string, ...any)) error {
	before, _ := os.ReadFile(path)
	if err := hostconf.Save(path, cfg); err != nil {
		return fmt.Errorf("writing the runtime config: %w", err)
	}
	after, _ := os.ReadFile(path)
	if string(before) != string(after) {
		act("wrote the validated config to %s (region %s, API %s)", path, cfg.Region, cfg.APIListen)
	}
	return nil
}

// checkKVM reports what hangar-vmd will do with guests: it reads the same
// verdict (services/internal/kvm) vmd uses to pick KVM, TCG when
// ALLOW_SOFTWARE_EMULATION=yes, or nothing.
func checkKVM(p kvm.Probe, cfg hostconf.Config, r *hostconf.Readiness) {
	ok, why := p.Usable()
	if ok {
		return
	}
	if cfg.AllowSoftwareEmulation {
		r.Add(hostconf.ReasonSoftwareEmulationOnly, false, "%s; guests run under QEMU TCG (ALLOW_SOFTWARE_EMULATION=yes), 10-50x slower", why)
		return
	}
	r.Add(hostconf.ReasonKVMUnavailable, true, "%s; instances cannot start (enable virtualisation, or set ALLOW_SOFTWARE_EMULATION=yes)", why)
}

// checkStarterAMI says when STARTER_AMI=yes but the image carries no
// usable starter AMI for the gateway to import: the host still serves, but
// run-instances has no image until someone registers one.
func checkStarterAMI(envPath string, cfg hostconf.Config, r *hostconf.Readiness) {
	if envPath == "" || !cfg.StarterAMI {
		return
	}
	const consequence = "no AMI hangar/debian-12-x86_64 will be imported; register one (ebs start-snapshot, ec2 register-image) or set STARTER_AMI=no"
	name, disk, err := readStarterEnv(envPath)
	if err != nil {
		r.Add(hostconf.ReasonStarterAMIMissing, false, "STARTER_AMI=yes but %v; %s", err, consequence)
		return
	}
	if _, err := os.Stat(disk); err != nil {
		r.Add(hostconf.ReasonStarterAMIMissing, false, "STARTER_AMI=yes but the disk of %s (%s) is missing (%s); %s", name, disk, errText(err), consequence)
	}
}

// readStarterEnv reads the name and the disk from a starter AMI's ami.env
// (written by image/starter-ami/build.sh); the disk is found next to it.
func readStarterEnv(path string) (name, disk string, err error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return "", "", fmt.Errorf("the image has no starter AMI (%s: %s)", path, errText(err))
	}
	for _, line := range strings.Split(string(raw), "\n") {
		k, v, _ := strings.Cut(strings.TrimSpace(line), "=")
		switch k {
		case "name":
			name = v
		case "disk":
			disk = v
		}
	}
	if name == "" || disk == "" {
		return "", "", fmt.Errorf("%s names no image or disk", path)
	}
	// As the gateway does: the path as written when it exists, else the
	// file of that name next to ami.env, wherever the image put both.
	if _, err := os.Stat(disk); err != nil || !filepath.IsAbs(disk) {
		disk = filepath.Join(filepath.Dir(path), filepath.Base(disk))
	}
	return name, disk, nil
}

func checkStorage(dir string, minFree uint64, r *hostconf.Readiness) {
	if minFree == 0 {
		minFree = 1 << 30
	}
	probe := filepath.Join(dir, ".hangar-write-test")
	if err := os.WriteFile(probe, nil, 0o600); err != nil {
		r.Add(hostconf.ReasonStorageMissing, true, "%s is not writable (%s); nothing can be stored", dir, errText(err))
		return
	}
	_ = os.Remove(probe)
	var st syscall.Statfs_t
	if err := syscall.Statfs(dir, &st); err != nil {
		r.Add(hostconf.ReasonStorageMissing, true, "cannot measure %s (%v)", dir, err)
		return
	}
	free := st.Bavail * uint64(st.Bsize)
	if free < minFree {
		r.Add(hostconf.ReasonStorageMissing, false, "%s has %d MiB free, less than %d MiB; volumes and snapshots will not fit", dir, free>>20, minFree>>20)
	}
}
