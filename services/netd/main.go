// Command hangar-netd owns dev.hangar.Network1: it turns the gateway's
// VPC, subnet, security group, internet gateway, route and Elastic IP
// records into kernel state (a network namespace per VPC, a bridge per
// subnet, a tap per interface, nftables rules) and serves DHCP, DNS and
// instance metadata inside each VPC. See docs/netd.md.
//
// It needs root, or CAP_NET_ADMIN, CAP_NET_RAW and CAP_NET_BIND_SERVICE
// (and CAP_SYS_ADMIN for setns into the namespaces it makes).
package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"os/user"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/internal/busutil"
	"hangar.dev/hangar/services/internal/hostconf"
	"hangar.dev/hangar/services/internal/logging"
	"hangar.dev/hangar/services/internal/sdnotify"
	"hangar.dev/hangar/services/internal/store"
	"hangar.dev/hangar/services/netd/kernel"
	"hangar.dev/hangar/services/netd/service"
)

func main() {
	var (
		configPath = flag.String("config", hostconf.DefaultRuntimePath, "validated host config written by hangar-firstboot")
		stateDir   = flag.String("state-dir", envOr("STATE_DIRECTORY", "/var/lib/hangar/netd"), "directory for state.db")
		runtimeDir = flag.String("runtime-dir", envOr("RUNTIME_DIRECTORY", "/run/hangar/netd"), "directory for runtime files")
		tapUser    = flag.String("tap-user", "root", "user (name or uid) that owns the taps, so vmd can open them")
		tapGroup   = flag.String("tap-group", "root", "group (name or gid) that owns the taps")
		dev        = flag.Bool("dev", false, "development host (hangar dev): name the host table after the state dir, and remove every namespace, link and rule on exit (the state file stays, so the next start rebuilds them)")
	)
	flag.Parse()
	log := logging.New("hangar-netd")
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, log, *configPath, *stateDir, *runtimeDir, *tapUser, *tapGroup, *dev); err != nil {
		log.Error("hangar-netd failed", "err", err)
		sdnotify.Status("failed: %v", err)
		os.Exit(1)
	}
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

func lookupID(name string, group bool) (uint32, error) {
	if n, err := strconv.ParseUint(name, 10, 32); err == nil {
		return uint32(n), nil
	}
	var id string
	if group {
		g, err := user.LookupGroup(name)
		if err != nil {
			return 0, err
		}
		id = g.Gid
	} else {
		u, err := user.Lookup(name)
		if err != nil {
			return 0, err
		}
		id = u.Uid
	}
	n, err := strconv.ParseUint(id, 10, 32)
	return uint32(n), err
}

func run(ctx context.Context, log *slog.Logger, configPath, stateDir, runtimeDir, tapUser, tapGroup string, dev bool) error {
	cfg, err := hostconf.Load(configPath)
	if err != nil {
		return err
	}
	uid, err := lookupID(tapUser, false)
	if err != nil {
		return fmt.Errorf("--tap-user %s: %w", tapUser, err)
	}
	gid, err := lookupID(tapGroup, true)
	if err != nil {
		return fmt.Errorf("--tap-group %s: %w", tapGroup, err)
	}
	if err := os.MkdirAll(runtimeDir, 0o755); err != nil {
		return fmt.Errorf("creating runtime directory: %w", err)
	}
	k, err := kernel.New()
	if err != nil {
		return err
	}
	if dev {
		// Several development hosts (and tests) may share one machine:
		// each keeps its own host table.
		abs, _ := filepath.Abs(stateDir)
		sum := sha256.Sum256([]byte(abs))
		k.HostTable = kernel.DefaultHostTable + "-" + hex.EncodeToString(sum[:4])
	}
	uplink := cfg.UplinkInterface
	if uplink == "" {
		if uplink, err = k.DefaultRouteLink(); err != nil {
			log.Warn("no uplink: public IPs will be routed but not answered on the LAN", "err", err)
			uplink = ""
		}
	}
	db, err := store.Open(filepath.Join(stateDir, "state.db"))
	if err != nil {
		return err
	}
	defer db.Close()
	svc, err := service.New(service.Config{
		Region: cfg.Region, Protected: cfg.ProtectedCIDRs, PublicPool: cfg.PublicIPPool, Uplink: uplink,
		DNSUpstreams: cfg.DNSUpstreams, TapOwner: kernel.Owner{UID: uid, GID: gid},
	}, k, db, service.RealStarters(k, log), log)
	if err != nil {
		return err
	}
	sdnotify.Status("restoring VPCs")
	if err := svc.Start(); err != nil {
		return fmt.Errorf("restoring kernel state: %w", err)
	}
	defer svc.Close()

	conn, err := busutil.Connect(ctx)
	if err != nil {
		return err
	}
	defer conn.Close()
	srv := busutil.NewServer(conn)
	bus, err := service.ExportBus(srv, svc, log)
	if err != nil {
		return err
	}
	if err := srv.ClaimName(api.Network.Name); err != nil {
		return err
	}
	// vmd's instance status check waits for the guest to reach DHCP or
	// IMDS; tell it, without ever holding up the guest (vmd may be absent).
	compute := api.NewComputeClient(conn)
	svc.Activity = func(key, kind string) {
		actx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		if err := compute.ReportGuestActivity(actx, key, kind); err != nil && !api.IsName(err, api.ErrNotFound) {
			log.Debug("reporting guest activity to vmd", "key", key, "kind", kind, "err", err)
		}
	}
	done := make(chan struct{})
	defer close(done)
	go bus.Run(done)
	go sdnotify.Watchdog(ctx, func() bool { return db.View(func(*store.Tx) error { return nil }) == nil })

	status := fmt.Sprintf("serving %d VPCs, uplink %q", len(svc.ListVPCs()), uplink)
	sdnotify.Ready(status)
	log.Info("ready", "vpcs", len(svc.ListVPCs()), "uplink", uplink, "region", cfg.Region, "tap_uid", uid, "tap_gid", gid)
	<-ctx.Done()
	sdnotify.Stopping()
	if dev {
		log.Info("stopping a development host; removing its namespaces and rules")
		svc.Close()
		return svc.Teardown()
	}
	log.Info("stopping; kernel state stays for the guests")
	return nil
}
