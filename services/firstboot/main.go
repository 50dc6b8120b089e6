// Command hangar-firstboot turns host.conf into the host's identity, at
// every boot (hangar-firstboot.service, before every hangar service):
// validated config for the services, admin credentials, account id, CA and
// API certificate, and the readiness report `hangar status` prints. The
// work is in package hostinit, which `hangar dev` runs too.
//
// With --check FILE it only validates a host.conf and prints the report,
// writing nothing: for operators and for the image's check stage.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"hangar.dev/hangar/services/firstboot/hostinit"
	"hangar.dev/hangar/services/internal/hostconf"
	"hangar.dev/hangar/services/internal/logging"
	"hangar.dev/hangar/services/internal/sdnotify"
)

func main() {
	p := hostinit.DefaultPaths()
	var o hostinit.Options
	flag.StringVar(&p.HostConf, "host-conf", p.HostConf, "the operator's host.conf")
	flag.StringVar(&p.Defaults, "defaults", p.Defaults, "the shipped defaults file (empty: the built-in table)")
	flag.StringVar(&p.RuntimeConfig, "config", p.RuntimeConfig, "where to write the validated config the services read")
	flag.StringVar(&p.Readiness, "readiness", p.Readiness, "where to write the readiness report")
	flag.StringVar(&p.Credentials, "credentials", p.Credentials, "the admin credentials file")
	flag.StringVar(&p.TLSDir, "tls-dir", p.TLSDir, "directory for the CA and the API certificate")
	flag.StringVar(&p.StateDir, "state-dir", envOr("STATE_DIRECTORY", p.StateDir), "directory for the persistent host identity")
	flag.StringVar(&p.KVMDevice, "kvm-device", p.KVMDevice, "the KVM device to probe")
	flag.StringVar(&p.StarterAMI, "starter-ami", p.StarterAMI, "the bundled starter AMI's ami.env, checked when STARTER_AMI=yes (empty: no check)")
	flag.StringVar(&o.Owner, "owner", "", "user given the credentials and the API key (the gateway's)")
	flag.StringVar(&o.Listen, "listen", "", "replace API_LISTEN (development)")
	check := flag.String("check", "", "only validate this host.conf and print the report")
	printDefaults := flag.Bool("print-defaults", false, "print the defaults file rendered from the key table")
	flag.Parse()

	switch {
	case *printDefaults:
		fmt.Print(hostconf.DefaultsFile())
		return
	case *check != "":
		os.Exit(runCheck(*check, p.Defaults))
	}

	log := logging.New("hangar-firstboot")
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	res, err := hostinit.Run(ctx, log, p, o)
	if err != nil {
		log.Error("first boot failed", "err", err)
		os.Exit(1)
	}
	if len(res.Actions) == 0 {
		log.Info("nothing to change: host.conf, credentials and certificates are as they should be")
	}
	state := "ready"
	if !res.Readiness.Ready {
		state = "NOT READY"
	}
	log.Info("host "+state, "reasons", len(res.Readiness.Reasons), "region", res.Config.Region, "api", res.Config.APIListen, "account", res.Config.AccountID)
	// The line `systemctl status hangar-firstboot` shows after it exited.
	status := fmt.Sprintf("host %s: account %s, region %s, API %s", state, res.Config.AccountID, res.Config.Region, res.Config.APIListen)
	for _, r := range res.Readiness.Reasons {
		if r.Fatal {
			status += "; " + r.String()
			break
		}
	}
	sdnotify.Status("%s", status)
}

// runCheck validates a host.conf the way first boot does and prints one
// line per problem; it exits 1 when a key is invalid.
func runCheck(path, defaults string) int {
	var d *os.File
	if defaults != "" {
		if f, err := os.Open(defaults); err == nil {
			d = f
			defer f.Close()
		}
	}
	f, err := os.Open(path)
	if err != nil {
		fmt.Fprintf(os.Stderr, "hangar-firstboot: %v\n", err)
		return 1
	}
	defer f.Close()
	var c hostconf.Config
	var rep *hostconf.Report
	if d != nil {
		c, rep = hostconf.ParseLayered(d, defaults, f, hostconf.Machine{})
	} else {
		c, rep = hostconf.Parse(f, hostconf.Machine{})
	}
	for _, p := range rep.Problems {
		fmt.Printf("%s: %s\n", path, p)
	}
	if !rep.OK() {
		return 1
	}
	fmt.Printf("%s: valid (region %s, zone %s, API %s%s)\n", path, c.Region, c.AvailabilityZone, c.APIListen, map[bool]string{true: " over TLS"}[c.APITLS])
	return 0
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}
