package main

import (
	"context"
	"log/slog"
	"maps"
	"time"

	"github.com/godbus/dbus/v5"
	"github.com/godbus/dbus/v5/prop"

	"hangar.dev/hangar/services/gateway/server"
	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/internal/busutil"
	"hangar.dev/hangar/services/internal/store"
	"hangar.dev/hangar/services/internal/version"
)

type storeTx = store.Tx

// busObject is dev.hangar.Gateway1: status and counts for operators.
type busObject struct {
	bus      *busutil.Server
	db       *store.DB
	srv      *server.Server
	endpoint string
	started  time.Time
	log      *slog.Logger
}

func newBusObject(bus *busutil.Server, db *store.DB, srv *server.Server, endpoint string, log *slog.Logger) *busObject {
	return &busObject{bus: bus, db: db, srv: srv, endpoint: endpoint, started: time.Now(), log: log}
}

// recordKinds are the buckets worth counting for an operator.
var recordKinds = []string{"vpc", "subnet", "sg", "key", "igw", "rtb", "i", "vol", "snap", "ami", "eipalloc"}

func (b *busObject) counts() map[string]uint32 {
	out := map[string]uint32{}
	_ = b.db.View(func(tx *store.Tx) error {
		for _, k := range recordKinds {
			if n := tx.Count(k); n > 0 {
				out[k] = uint32(n)
			}
		}
		return nil
	})
	return out
}

func (b *busObject) status() api.ServiceStatus {
	return api.ServiceStatus{
		State:   "running",
		Detail:  "serving " + b.endpoint,
		Version: version.String(),
		Started: b.started.Unix(),
		Counts:  b.counts(),
	}
}

func (b *busObject) export() error {
	obj := &busutil.Object{
		Path:      api.Gateway.Path,
		Interface: api.Gateway.Interface,
		Methods: map[string]any{
			api.MethodStatus: func() (api.ServiceStatus, *dbus.Error) { return b.status(), nil },
		},
		Props: map[string]*prop.Prop{
			api.PropVersion:  {Value: version.String(), Emit: prop.EmitConst},
			api.PropStarted:  {Value: b.started.Unix(), Emit: prop.EmitConst},
			api.PropState:    {Value: "running", Emit: prop.EmitTrue},
			"Endpoint":       {Value: b.endpoint, Emit: prop.EmitConst},
			"Records":        {Value: b.counts(), Emit: prop.EmitTrue},
			"RequestsServed": {Value: uint64(0), Emit: prop.EmitFalse},
		},
	}
	if err := b.bus.Export(obj); err != nil {
		return err
	}
	return b.bus.ClaimName(api.Gateway.Name)
}

// refresh keeps the Records and RequestsServed properties current.
func (b *busObject) refresh(ctx context.Context) {
	t := time.NewTicker(2 * time.Second)
	defer t.Stop()
	last := map[string]uint32{}
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		c := b.counts()
		if !maps.Equal(c, last) {
			if err := b.bus.Set(api.Gateway.Path, "Records", c); err != nil {
				b.log.Warn("updating Records", "err", err)
			}
			last = c
		}
		_ = b.bus.Set(api.Gateway.Path, "RequestsServed", uint64(b.srv.Requests()))
	}
}
