// Command hangar-gateway is the AWS API front door: it serves EC2, STS (and
// the other services as they land) on API_LISTEN, verifies every signature
// against the host's credentials, keeps the AWS records in its state file,
// and owns dev.hangar.Gateway1 on the system bus.
package main

import (
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"hangar.dev/hangar/services/gateway/awsmodel"
	"hangar.dev/hangar/services/gateway/ebs"
	"hangar.dev/hangar/services/gateway/ec2"
	"hangar.dev/hangar/services/gateway/iam"
	"hangar.dev/hangar/services/gateway/server"
	"hangar.dev/hangar/services/gateway/sts"
	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/internal/busutil"
	"hangar.dev/hangar/services/internal/creds"
	"hangar.dev/hangar/services/internal/hostconf"
	"hangar.dev/hangar/services/internal/logging"
	"hangar.dev/hangar/services/internal/sdnotify"
	"hangar.dev/hangar/services/internal/store"
)

func main() {
	var (
		configPath = flag.String("config", hostconf.DefaultRuntimePath, "validated host config written by hangar-firstboot")
		credsPath  = flag.String("credentials", "/etc/hangar/credentials", "host credentials (AWS shared-credentials format)")
		stateDir   = flag.String("state-dir", envOr("STATE_DIRECTORY", "/var/lib/hangar/gateway"), "directory for state.db")
		listen     = flag.String("listen", "", "address:port to serve the API on (default: API_LISTEN from the host config)")
		tlsCert    = flag.String("tls-cert", "/etc/hangar/tls/server.crt", "certificate served when API_TLS=yes")
		tlsKey     = flag.String("tls-key", "/etc/hangar/tls/server.key", "key of -tls-cert")
		starter    = flag.String("starter-ami", "/usr/share/hangar/starter/ami.env", "bundled starter AMI to import when STARTER_AMI=yes")
	)
	flag.Parse()
	log := logging.New("hangar-gateway")
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, log, *configPath, *credsPath, *stateDir, *listen, *tlsCert, *tlsKey, *starter); err != nil {
		log.Error("hangar-gateway failed", "err", err)
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

// reloadableKeys is the key store, replaced whole on SIGHUP.
type reloadableKeys struct {
	mu   sync.RWMutex
	keys server.StaticKeys
}

func (r *reloadableKeys) Lookup(id string) (creds.Key, bool) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return r.keys.Lookup(id)
}

func (r *reloadableKeys) set(k []creds.Key) {
	r.mu.Lock()
	r.keys = k
	r.mu.Unlock()
}

func run(ctx context.Context, log *slog.Logger, configPath, credsPath, stateDir, listen, tlsCert, tlsKey, starter string) error {
	cfg, err := hostconf.Load(configPath)
	if err != nil {
		return err
	}
	if cfg.AccountID == "" {
		return fmt.Errorf("host config %s has no account id; run hangar-firstboot", configPath)
	}
	// No credentials, no API: the gateway never invents a key.
	keys, err := creds.Load(credsPath)
	if err != nil {
		return fmt.Errorf("refusing to serve without valid credentials: %w", err)
	}
	store, err := store.Open(filepath.Join(stateDir, "state.db"))
	if err != nil {
		return err
	}
	defer store.Close()

	conn, err := busutil.Connect(ctx)
	if err != nil {
		return err
	}
	defer conn.Close()

	ec2svc := ec2.New(store, cfg, log.With("component", "ec2"))
	// VPCs are networks in hangar-netd: every change to their records is
	// pushed there, and all of them again whenever netd (re)starts.
	ec2svc.SetNetwork(api.NetworkClient{Conn: conn})
	if err := ec2svc.Init(ctx); err != nil {
		return fmt.Errorf("initialising EC2 records: %w", err)
	}
	keyStore := &reloadableKeys{}
	keyStore.set(keys)
	// IAM's roles and profiles and STS's temporary keys live in the same
	// state file; the verifier finds a key in the host's credentials
	// first, then among the temporary keys STS issued.
	iamsvc := iam.New(store, cfg.AccountID, log.With("component", "iam"))
	stssvc := sts.New(iamsvc, log.With("component", "sts"))
	go stssvc.RunPurge(ctx)
	// Instance profiles: EC2 resolves them in IAM and has STS issue the
	// role credentials IMDS serves; identity documents are signed with
	// a key kept next to state.db (its certificate is for users).
	signer, err := ec2.LoadIdentitySigner(stateDir, cfg.AccountID)
	if err != nil {
		return err
	}
	ec2svc.SetIdentity(stssvc, signer)
	srv := server.New(server.Config{AccountID: cfg.AccountID, Region: cfg.Region, Keys: keyStore, Temporary: stssvc, Log: log.With("component", "api")})
	srv.RegisterQuery("ec2", awsmodel.MustLoad("ec2"), ec2svc, ec2svc.Idempotency)
	srv.RegisterQuery("sts", awsmodel.MustLoad("sts"), stssvc)
	srv.RegisterQuery("iam", awsmodel.MustLoad("iam"), iamsvc)

	if listen == "" {
		listen = cfg.APIListen
	}
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return fmt.Errorf("listening on %s: %w", listen, err)
	}
	scheme := "http"
	if cfg.APITLS {
		cert, err := tls.LoadX509KeyPair(tlsCert, tlsKey)
		if err != nil {
			return fmt.Errorf("API_TLS=yes but the certificate cannot be loaded: %w", err)
		}
		ln = tls.NewListener(ln, &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12})
		scheme = "https"
	}
	endpoint := scheme + "://" + ln.Addr().String()
	httpSrv := &http.Server{Handler: srv, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 2 * time.Minute}

	// Volumes and snapshots hold their data in hangar-ebsd.
	storage := api.NewStorageClient(conn)
	ec2svc.SetStorage(storage)
	srv.RegisterREST("ebs", ebs.New(ec2svc, storage, log.With("component", "ebs")))
	bus := newBusObject(busutil.NewServer(conn), store, srv, endpoint, log)
	if err := bus.export(); err != nil {
		return err
	}

	// Instances run in hangar-vmd: its state signals drive the records,
	// and whenever vmd (re)claims its name the two are reconciled.
	ec2svc.SetCompute(api.NewComputeClient(conn))
	if err := ec2svc.StartCompute(ctx); err != nil {
		return err
	}
	ec2svc.StartNetwork(ctx)
	ec2svc.StartRoleCredentials(ctx)
	if err := busutil.WatchName(ctx, conn, api.Network.Name, func(up bool) {
		if up {
			log.Info("hangar-netd is on the bus; pushing every VPC")
			ec2svc.NetworkAppeared(ctx)
		} else {
			log.Warn("hangar-netd left the bus; VPC changes wait for it")
		}
	}); err != nil {
		return err
	}

	if err := busutil.WatchName(ctx, conn, api.Compute.Name, func(up bool) {
		if up {
			log.Info("hangar-vmd is on the bus; reconciling instances")
			go ec2svc.ComputeAppeared(ctx)
		} else {
			log.Warn("hangar-vmd left the bus; instance changes wait for it")
		}
	}); err != nil {
		return err
	}

	// A fresh host can run-instances with nothing else: the bundled
	// Debian disk becomes the AMI hangar/debian-12-x86_64 (once).
	if _, err := os.Stat(starter); cfg.StarterAMI && err == nil {
		go func() {
			if err := ec2svc.ImportStarterAMI(ctx, starter, storage); err != nil && ctx.Err() == nil {
				log.Error("importing the starter AMI", "path", starter, "err", err)
			}
		}()
	}

	errc := make(chan error, 1)
	go func() { errc <- httpSrv.Serve(ln) }()
	go bus.refresh(ctx)
	go sdnotify.Watchdog(ctx, func() bool { return store.View(func(*storeTx) error { return nil }) == nil })

	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	go func() {
		for range hup {
			k, err := creds.Load(credsPath)
			if err != nil {
				log.Error("reloading credentials; keeping the old ones", "err", err)
				continue
			}
			keyStore.set(k)
			log.Info("reloaded credentials", "keys", len(k))
		}
	}()

	status := fmt.Sprintf("serving %s, region %s", endpoint, cfg.Region)
	sdnotify.Ready(status)
	log.Info("ready", "endpoint", endpoint, "region", cfg.Region, "zone", cfg.AvailabilityZone, "account", cfg.AccountID)

	select {
	case <-ctx.Done():
	case err := <-errc:
		if !errors.Is(err, http.ErrServerClosed) {
			return fmt.Errorf("serving the API: %w", err)
		}
	}
	sdnotify.Stopping()
	log.Info("stopping")
	shutdownCtx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return httpSrv.Shutdown(shutdownCtx)
}
