// Package logging builds the one *slog.Logger each hangar program passes to
// its components: structured lines on stderr, which journald collects.
package logging

import (
	"log/slog"
	"os"
	"strings"
)

// New returns a logger for program. HANGAR_LOG_LEVEL (debug, info, warn,
// error) sets the level. Under journald (JOURNAL_STREAM set) timestamps are
// left out, since the journal records its own.
func New(program string) *slog.Logger {
	level := slog.LevelInfo
	switch strings.ToLower(os.Getenv("HANGAR_LOG_LEVEL")) {
	case "debug":
		level = slog.LevelDebug
	case "warn":
		level = slog.LevelWarn
	case "error":
		level = slog.LevelError
	}
	opts := &slog.HandlerOptions{Level: level}
	if os.Getenv("JOURNAL_STREAM") != "" {
		opts.ReplaceAttr = func(groups []string, a slog.Attr) slog.Attr {
			if len(groups) == 0 && a.Key == slog.TimeKey {
				return slog.Attr{}
			}
			return a
		}
	}
	return slog.New(slog.NewTextHandler(os.Stderr, opts)).With("program", program)
}
