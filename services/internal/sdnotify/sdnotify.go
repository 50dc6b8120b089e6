// Package sdnotify tells systemd how a service is doing: READY=1 once the
// service's bus name is owned and its listeners are open, STATUS= lines for
// `systemctl status`, WATCHDOG=1 pings, STOPPING=1 on shutdown. Outside
// systemd (NOTIFY_SOCKET unset) every call is a no-op.
package sdnotify

import (
	"context"
	"fmt"
	"time"

	"github.com/coreos/go-systemd/v22/daemon"
)

// Ready reports readiness together with a status line.
func Ready(status string) {
	_, _ = daemon.SdNotify(false, daemon.SdNotifyReady+"\nSTATUS="+status)
}

// Status sets the line `systemctl status` shows.
func Status(format string, args ...any) {
	_, _ = daemon.SdNotify(false, "STATUS="+fmt.Sprintf(format, args...))
}

// Stopping reports that shutdown has begun.
func Stopping() {
	_, _ = daemon.SdNotify(false, daemon.SdNotifyStopping)
}

// Watchdog pings systemd at half the configured WatchdogSec until ctx ends.
// healthy is asked before each ping; a false answer skips the ping, so a
// wedged service is restarted by systemd rather than kept alive by a timer.
func Watchdog(ctx context.Context, healthy func() bool) {
	interval, err := daemon.SdWatchdogEnabled(false)
	if err != nil || interval == 0 {
		return
	}
	t := time.NewTicker(interval / 2)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if healthy == nil || healthy() {
				_, _ = daemon.SdNotify(false, daemon.SdNotifyWatchdog)
			}
		}
	}
}
