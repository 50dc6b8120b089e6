// Command run is `make run`: it boots the built hangar disk image in QEMU
// (KVM when it really works here, TCG with a loud warning otherwise), hands
// host.conf in through a NoCloud seed, forwards the API to the host, writes
// the aws CLI's credentials and config on the host side, and prints the
// command to try. The serial console is the terminal: log in as root.
// Ctrl-C powers the guest down through QMP (ACPI), a second one stops it.
package main

import (
	"bufio"
	"context"
	"crypto/rand"
	"errors"
	"flag"
	"fmt"
	"math/big"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"hangar.dev/hangar/image/vm"
)

// hostConf is written to STATE/host.conf on the first run; edit it and run
// again. The admin key is added from STATE/credentials when the seed is made.
const hostConf = `# host.conf for 'make run' (docs/host.conf.md): handed to the guest as
# cloud-init user data through a NoCloud seed. Edit it and run again.
ACCOUNT_ID=%s
REGION=us-east-1
API_LISTEN=0.0.0.0:4566
# A development machine may have no usable KVM: allow TCG for guests.
ALLOW_SOFTWARE_EMULATION=yes
HOST_RESERVE_VCPU=0
HOST_RESERVE_MEMORY_MB=256
CPU_OVERCOMMIT=8
# The gateway imports the image's starter AMI (hangar/debian-12-x86_64) at
# start; STARTER_AMI=no leaves it out.
`

var starterOff = regexp.MustCompile(`(?m)^\s*STARTER_AMI\s*=\s*["']?(no|false|0|off)["']?\s*$`)

func main() {
	imageDir := flag.String("image", "image/out", "directory of the built image (make image)")
	stateDir := flag.String("state-dir", ".hangar-run", "host-side state: host.conf, credentials, aws config, the VM's files")
	listen := flag.String("listen", "127.0.0.1:4566", "host address the API is forwarded to")
	accel := flag.String("accel", "auto", "auto (KVM when it works, else TCG), kvm or tcg")
	// 4 GiB: under TCG the host's vmd counts 1152 MiB of QEMU overhead per
	// guest besides its RAM, so a t3.micro (1 GiB) needs 2176 MiB free.
	memory := flag.Int("memory", 4096, "guest memory in MiB")
	cpus := flag.Int("cpus", 2, "guest vCPUs")
	flag.Parse()
	// QEMU gets SIGTERM if the thread that started it dies (Pdeathsig):
	// keep that thread for the whole run.
	runtime.LockOSThread()
	if err := run(*imageDir, *stateDir, *listen, *accel, *memory, *cpus); err != nil {
		fmt.Fprintf(os.Stderr, "make run: %v\n", err)
		os.Exit(1)
	}
}

func run(imageDir, stateDir, listen, accel string, memory, cpus int) error {
	img, err := vm.LoadImage(imageDir)
	if err != nil {
		return err
	}
	stateDir, err = filepath.Abs(stateDir)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(stateDir, 0o755); err != nil {
		return err
	}
	credsFile, configFile := filepath.Join(stateDir, "credentials"), filepath.Join(stateDir, "config")
	keyID, secret, err := credentials(credsFile)
	if err != nil {
		return err
	}
	if err := os.WriteFile(configFile, []byte("[default]\nregion = us-east-1\noutput = json\n"), 0o644); err != nil {
		return err
	}
	confPath := filepath.Join(stateDir, "host.conf")
	if _, err := os.Stat(confPath); errors.Is(err, os.ErrNotExist) {
		if err := os.WriteFile(confPath, []byte(fmt.Sprintf(hostConf, randomAccount())), 0o644); err != nil {
			return err
		}
	}
	conf, err := os.ReadFile(confPath)
	if err != nil {
		return err
	}
	if starterOff.Match(conf) {
		// Earlier versions of make run wrote this line when the image had
		// no starter AMI yet.
		fmt.Fprintf(os.Stderr, "make run: %s sets STARTER_AMI=no, so the host will have no AMI hangar/debian-12-x86_64; delete that line to have it imported\n", confPath)
	}
	conf = append(conf, []byte(fmt.Sprintf("# from %s\nADMIN_ACCESS_KEY_ID=%s\nADMIN_SECRET_ACCESS_KEY=%s\n", credsFile, keyID, secret))...)

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	vmDir := filepath.Join(stateDir, "vm")
	if err := os.MkdirAll(vmDir, 0o755); err != nil {
		return err
	}
	seed := filepath.Join(vmDir, "seed.img")
	if err := vm.MakeSeed(ctx, seed, vm.UserData(string(conf)), fmt.Sprintf("hangar-%d", time.Now().Unix()), "hangar"); err != nil {
		return err
	}

	switch accel {
	case "auto":
		fmt.Fprintln(os.Stderr, "make run: checking whether KVM works here…")
		if ok, why := vm.ProbeKVM(ctx, img.Kernel, filepath.Join(imageDir, "kvm-probe")); ok {
			accel = "kvm"
		} else {
			accel = "tcg"
			warnTCG(why)
		}
	case "tcg":
		warnTCG("--accel tcg")
	case "kvm":
	default:
		return fmt.Errorf("--accel %q: want auto, kvm or tcg", accel)
	}

	restore := rawTerminal()
	defer restore()
	out := os.Stdout
	machine, err := vm.Boot(ctx, vm.Config{
		Disk: img.Disk, Dir: vmDir, Accel: accel, MemoryMB: memory, CPUs: cpus,
		Forwards: []vm.Forward{{Host: listen, GuestPort: 4566}},
		Seed:     seed,
		Console:  os.Stdout,
	})
	if err != nil {
		return err
	}
	go func() {
		// Keystrokes go to the serial console (the guest echoes them).
		buf := make([]byte, 256)
		for {
			n, err := os.Stdin.Read(buf)
			if n > 0 {
				_ = machine.Type(string(buf[:n]))
			}
			if err != nil {
				return
			}
		}
	}()

	endpoint := "http://" + listen
	ready := make(chan time.Duration, 1)
	go func() {
		client := &http.Client{Timeout: 2 * time.Second}
		for ctx.Err() == nil {
			if resp, err := client.Get(endpoint + "/"); err == nil {
				resp.Body.Close()
				ready <- time.Since(machine.Started)
				return
			}
			time.Sleep(500 * time.Millisecond)
		}
	}()

	for {
		select {
		case took := <-ready:
			fmt.Fprintf(out, "\n==> hangar is up: API at %s after %s (%s). Try:\n\n"+
				"  AWS_SHARED_CREDENTIALS_FILE=%s AWS_CONFIG_FILE=%s aws --endpoint-url %s sts get-caller-identity\n\n"+
				"==> This terminal is the host's serial console: log in as root (no password). Ctrl-C powers the host down.\n",
				endpoint, took.Round(time.Second), strings.ToUpper(accel), credsFile, configFile, endpoint)
		case <-machine.Done():
			return fmt.Errorf("QEMU exited\n%s", machine.QEMUOutput())
		case <-ctx.Done():
			stop()
			fmt.Fprintln(out, "\n==> powering the host down (ACPI through QMP); Ctrl-C again stops it at once")
			second, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
			defer cancel()
			clean, err := machine.Powerdown(second, 2*time.Minute)
			if clean {
				fmt.Fprintln(out, "==> the host powered off cleanly")
				return nil
			}
			return err
		}
	}
}

func warnTCG(why string) {
	fmt.Fprintf(os.Stderr, "\n"+
		"  ********************************************************************\n"+
		"  WARNING: KVM is not usable here: %s.\n"+
		"  Booting under TCG software emulation: the host takes about a minute\n"+
		"  to boot and its guests run 10-50x slower than on KVM.\n"+
		"  ********************************************************************\n\n", why)
}

// credentials reads the host-side credentials file, making it the first time.
func credentials(path string) (id, secret string, err error) {
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		id = "AKIA" + randomString("ABCDEFGHIJKLMNOPQRSTUVWXYZ234567", 16)
		secret = randomString("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/", 40)
		body := fmt.Sprintf("[default]\naws_access_key_id = %s\naws_secret_access_key = %s\n", id, secret)
		return id, secret, os.WriteFile(path, []byte(body), 0o600)
	}
	if err != nil {
		return "", "", err
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		k, v, ok := strings.Cut(s.Text(), "=")
		if !ok {
			continue
		}
		switch strings.TrimSpace(k) {
		case "aws_access_key_id":
			id = strings.TrimSpace(v)
		case "aws_secret_access_key":
			secret = strings.TrimSpace(v)
		}
	}
	if id == "" || secret == "" {
		return "", "", fmt.Errorf("%s has no aws_access_key_id/aws_secret_access_key; remove it to make a new key", path)
	}
	return id, secret, nil
}

func randomString(alphabet string, n int) string {
	var b strings.Builder
	for range n {
		i, err := rand.Int(rand.Reader, big.NewInt(int64(len(alphabet))))
		if err != nil {
			panic(err)
		}
		b.WriteByte(alphabet[i.Int64()])
	}
	return b.String()
}

// randomAccount is a 12-digit account id that does not start with 0.
func randomAccount() string {
	return randomString("123456789", 1) + randomString("0123456789", 11)
}

// rawTerminal passes keystrokes through unbuffered and unechoed (the guest
// echoes) while Ctrl-C still signals this process. It returns the undo.
func rawTerminal() func() {
	fd := int(os.Stdin.Fd())
	old, err := unix.IoctlGetTermios(fd, unix.TCGETS)
	if err != nil {
		return func() {} // not a terminal (CI, a pipe)
	}
	t := *old
	t.Lflag &^= unix.ICANON | unix.ECHO
	t.Iflag &^= unix.ICRNL
	t.Cc[unix.VMIN], t.Cc[unix.VTIME] = 1, 0
	if err := unix.IoctlSetTermios(fd, unix.TCSETS, &t); err != nil {
		return func() {}
	}
	return func() { _ = unix.IoctlSetTermios(fd, unix.TCSETS, old) }
}
