// Package version holds the build version, set by the Makefile with
// -ldflags "-X hangar.dev/hangar/services/internal/version.Version=…".
package version

import "runtime/debug"

// Version is the build's version.
var Version = ""

// String returns Version, or the VCS revision Go recorded, or "dev".
func String() string {
	if Version != "" {
		return Version
	}
	if info, ok := debug.ReadBuildInfo(); ok {
		rev, dirty := "", false
		for _, s := range info.Settings {
			switch s.Key {
			case "vcs.revision":
				rev = s.Value
			case "vcs.modified":
				dirty = s.Value == "true"
			}
		}
		if len(rev) > 12 {
			rev = rev[:12]
		}
		if rev != "" {
			if dirty {
				rev += "-dirty"
			}
			return rev
		}
	}
	return "dev"
}
