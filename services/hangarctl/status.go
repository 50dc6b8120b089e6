package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/godbus/dbus/v5"

	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/internal/busutil"
	"hangar.dev/hangar/services/internal/creds"
	"hangar.dev/hangar/services/internal/hostconf"
	"hangar.dev/hangar/services/internal/version"
)

func cmdVersion() error {
	fmt.Println(version.String())
	return nil
}

// cmdStatus prints one line per service and the host's readiness reasons.
// It exits non-zero when a service that should run is not answering or
// the host is not ready, so scripts can gate on it.
func cmdStatus(args []string) error {
	fs := flag.NewFlagSet("status", flag.ExitOnError)
	readiness := fs.String("readiness", hostconf.DefaultReadinessPath, "readiness report written by hangar-firstboot")
	timeout := fs.Duration("timeout", 5*time.Second, "how long to wait for each service")
	_ = fs.Parse(args)

	// Each step gets its own deadline: on a loaded host one slow answer must
	// not make every later service look absent.
	cctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	conn, err := busutil.Connect(cctx)
	if err != nil {
		return err
	}
	defer conn.Close()

	healthy := true
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "SERVICE\tSTATE\tVERSION\tUP\tDETAIL")
	for _, svc := range api.Services {
		ctx, cancel := context.WithTimeout(context.Background(), *timeout)
		defer cancel()
		var owner string
		if err := conn.BusObject().CallWithContext(ctx, "org.freedesktop.DBus.GetNameOwner", 0, svc.Name).Store(&owner); err != nil {
			if !api.IsName(err, "org.freedesktop.DBus.Error.NameHasNoOwner") {
				fmt.Fprintf(tw, "%s\t%s\t-\t-\tasking the bus for %s: %v\n", svc.Unit, "error", svc.Name, err)
				healthy = false
				continue
			}
			// Not on the bus: say what systemd knows of its unit, when
			// there is a systemd (there is none under hangar dev).
			u, uerr := unitState(ctx, conn, svc.Unit)
			switch {
			case uerr != nil:
				fmt.Fprintf(tw, "%s\t%s\t-\t-\tnot running (%s has no owner)\n", svc.Unit, "absent", svc.Name)
				if svc.Name == api.Gateway.Name {
					healthy = false
				}
			case u.load != "loaded":
				fmt.Fprintf(tw, "%s\t%s\t-\t-\tnot in this image\n", svc.Unit, "absent")
			default:
				detail := u.status
				if detail == "" {
					detail = fmt.Sprintf("%s has no owner; journalctl -u %s", svc.Name, svc.Unit)
				}
				fmt.Fprintf(tw, "%s\t%s\t-\t-\t%s\n", svc.Unit, u.active+" ("+u.sub+")", detail)
				healthy = false
			}
			continue
		}
		st, err := api.Status(ctx, conn, svc)
		if err != nil {
			fmt.Fprintf(tw, "%s\t%s\t-\t-\t%v\n", svc.Unit, "error", err)
			healthy = false
			continue
		}
		up := time.Since(time.Unix(st.Started, 0)).Round(time.Second)
		detail := st.Detail
		if len(st.Counts) > 0 {
			detail += " (" + formatCounts(st.Counts) + ")"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", svc.Unit, st.State, st.Version, up, detail)
		for _, p := range st.Problems {
			fmt.Fprintf(tw, "\t\t\t\t! %s\n", p)
		}
		if st.State != "running" {
			healthy = false
		}
	}
	_ = tw.Flush()

	r, err := hostconf.LoadReadiness(*readiness)
	switch {
	case err != nil:
		fmt.Printf("\nreadiness: unknown (%v)\n", err)
	case r.Ready && len(r.Reasons) == 0:
		fmt.Println("\nreadiness: ready")
	default:
		state := "ready, with warnings"
		if !r.Ready {
			state = "NOT READY"
			healthy = false
		}
		fmt.Printf("\nreadiness: %s\n", state)
		for _, reason := range r.Reasons {
			fmt.Printf("  %s\n", reason)
		}
	}
	if !healthy {
		return fmt.Errorf("the host is not healthy")
	}
	return nil
}

type unit struct{ load, active, sub, status string }

// unitState asks systemd (org.freedesktop.systemd1) for a unit's state and
// the STATUS= line its service last sent.
func unitState(ctx context.Context, conn *dbus.Conn, name string) (unit, error) {
	const dest = "org.freedesktop.systemd1"
	var path dbus.ObjectPath
	if err := conn.Object(dest, "/org/freedesktop/systemd1").CallWithContext(ctx, "org.freedesktop.systemd1.Manager.LoadUnit", 0, name).Store(&path); err != nil {
		return unit{}, err
	}
	obj := conn.Object(dest, path)
	prop := func(iface, p string) string {
		v, err := obj.GetProperty(iface + "." + p)
		if err != nil {
			return ""
		}
		s, _ := v.Value().(string)
		return s
	}
	return unit{
		load:   prop("org.freedesktop.systemd1.Unit", "LoadState"),
		active: prop("org.freedesktop.systemd1.Unit", "ActiveState"),
		sub:    prop("org.freedesktop.systemd1.Unit", "SubState"),
		status: prop("org.freedesktop.systemd1.Service", "StatusText"),
	}, nil
}

func formatCounts(c map[string]uint32) string {
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%s=%d", k, c[k])
	}
	return strings.Join(parts, " ")
}

// cmdCredentials prints the admin key as environment variables, for
// `eval $(hangar credentials)`.
func cmdCredentials(args []string) error {
	fs := flag.NewFlagSet("credentials", flag.ExitOnError)
	file := fs.String("file", "/etc/hangar/credentials", "credentials file")
	profile := fs.String("profile", "default", "profile to print")
	config := fs.String("config", hostconf.DefaultRuntimePath, "host config, for the region")
	_ = fs.Parse(args)
	keys, err := creds.Load(*file)
	if err != nil {
		return err
	}
	for _, k := range keys {
		if k.Profile != *profile {
			continue
		}
		fmt.Printf("export AWS_ACCESS_KEY_ID=%s\nexport AWS_SECRET_ACCESS_KEY=%s\n", k.AccessKeyID, k.SecretAccessKey)
		if cfg, err := hostconf.Load(*config); err == nil {
			fmt.Printf("export AWS_DEFAULT_REGION=%s\n", cfg.Region)
		}
		return nil
	}
	return fmt.Errorf("no profile %q in %s", *profile, *file)
}
