package busutil

import (
	"context"
	"fmt"

	"github.com/godbus/dbus/v5"
)

// WatchName calls appeared(true) when name gets an owner and appeared(false)
// when it loses one, until ctx ends. If name has an owner already,
// appeared(true) is called first: a client re-applies its state to a peer
// that (re)started, whether before or after the client did.
func WatchName(ctx context.Context, conn *dbus.Conn, name string, appeared func(bool)) error {
	opts := []dbus.MatchOption{
		dbus.WithMatchSender("org.freedesktop.DBus"),
		dbus.WithMatchInterface("org.freedesktop.DBus"),
		dbus.WithMatchMember("NameOwnerChanged"),
		dbus.WithMatchArg(0, name),
	}
	if err := conn.AddMatchSignalContext(ctx, opts...); err != nil {
		return fmt.Errorf("watching %s: %w", name, err)
	}
	ch := make(chan *dbus.Signal, 16)
	conn.Signal(ch)
	var has bool
	if err := conn.BusObject().CallWithContext(ctx, "org.freedesktop.DBus.NameHasOwner", 0, name).Store(&has); err != nil {
		return fmt.Errorf("asking whether %s has an owner: %w", name, err)
	}
	go func() {
		defer func() {
			conn.RemoveSignal(ch)
			_ = conn.RemoveMatchSignal(opts...)
		}()
		if has {
			appeared(true)
		}
		for {
			select {
			case <-ctx.Done():
				return
			case sig, ok := <-ch:
				if !ok {
					return
				}
				if sig.Name != "org.freedesktop.DBus.NameOwnerChanged" || len(sig.Body) != 3 {
					continue
				}
				if n, _ := sig.Body[0].(string); n != name {
					continue
				}
				newOwner, _ := sig.Body[2].(string)
				appeared(newOwner != "")
			}
		}
	}()
	return nil
}
