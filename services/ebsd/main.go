// Command hangar-ebsd is hangar's block storage: it owns dev.hangar.Storage1,
// keeps every volume's data (a sparse file and its block bitmaps) and every
// snapshot's blocks (content-addressed, shared, refcounted) under
// --state-dir, and serves each volume over NBD on
// --runtime-dir/<vol-id>.sock. It never decides what AWS shows: the gateway
// holds the records and calls it with the ids it chose.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"hangar.dev/hangar/services/ebsd/internal/engine"
	"hangar.dev/hangar/services/internal/busutil"
	"hangar.dev/hangar/services/internal/hostconf"
	"hangar.dev/hangar/services/internal/logging"
	"hangar.dev/hangar/services/internal/sdnotify"
)

func main() {
	var (
		configPath = flag.String("config", hostconf.DefaultRuntimePath, "validated host config written by hangar-firstboot")
		stateDir   = flag.String("state-dir", envOr("STATE_DIRECTORY", "/var/lib/hangar/ebs"), "directory for volume data, snapshot blocks and state.db")
		runtimeDir = flag.String("runtime-dir", envOr("RUNTIME_DIRECTORY", "/run/hangar/ebs"), "directory for the NBD export sockets")
	)
	flag.Parse()
	log := logging.New("hangar-ebsd")
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, log, *configPath, *stateDir, *runtimeDir); err != nil {
		log.Error("hangar-ebsd failed", "err", err)
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

func run(ctx context.Context, log *slog.Logger, configPath, stateDir, runtimeDir string) error {
	// ebsd needs nothing from the host config yet, but a config that is
	// there and broken is an operator's mistake worth stopping for.
	if _, err := hostconf.Load(configPath); err != nil {
		if !errors.Is(err, os.ErrNotExist) {
			return err
		}
		log.Warn("no host config; continuing with defaults", "config", configPath)
	}
	eng, err := engine.Open(ctx, stateDir, runtimeDir, log.With("component", "engine"), engine.Hooks{})
	if err != nil {
		return err
	}
	defer eng.Close()

	conn, err := busutil.Connect(ctx)
	if err != nil {
		return err
	}
	defer conn.Close()
	bus := newBusObject(busutil.NewServer(conn), eng, log.With("component", "bus"))
	if err := bus.export(); err != nil {
		return err
	}
	go bus.refresh(ctx)
	go sdnotify.Watchdog(ctx, eng.Healthy)

	status := fmt.Sprintf("serving %d NBD exports in %s", eng.Exports(), runtimeDir)
	sdnotify.Ready(status)
	log.Info("ready", "state_dir", stateDir, "runtime_dir", runtimeDir, "exports", eng.Exports())
	<-ctx.Done()
	sdnotify.Stopping()
	log.Info("stopping: flushing volumes")
	return nil
}
