package hostinit

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/user"
	"strconv"
	"syscall"

	"hangar.dev/hangar/services/internal/creds"
	"hangar.dev/hangar/services/internal/hostconf"
)

// ensureCredentials makes the credentials file hold the admin key:
//
//   - ADMIN_ACCESS_KEY_ID/ADMIN_SECRET_ACCESS_KEY set and valid: the
//     "default" profile is that key (other profiles are kept);
//   - not set: the key already in the file stays; a file without one gets a
//     generated key, once;
//   - set but invalid, or a file that cannot be parsed: nothing is written
//     and the report says CredentialsMissing, so the gateway refuses to
//     serve rather than serve with a key nobody asked for.
func ensureCredentials(path string, cfg hostconf.Config, rep *hostconf.Report, owner string, r *hostconf.Readiness, act func(string, ...any)) {
	missing := func(format string, args ...any) {
		r.Add(hostconf.ReasonCredentialsMissing, true, format+"; hangar-gateway refuses to serve until this is fixed", args...)
	}
	fromConf := cfg.AdminAccessKeyID != "" || cfg.AdminSecretAccessKey != ""
	if fromConf {
		for _, p := range rep.Errors() {
			if p.Key == "ADMIN_ACCESS_KEY_ID" || p.Key == "ADMIN_SECRET_ACCESS_KEY" {
				if _, err := os.Stat(path); err == nil {
					// The old key keeps working; the report says why the
					// new one was not applied.
					r.Add(hostconf.ReasonConfigInvalid, true, "the admin key in host.conf is invalid; %s keeps its current key", path)
				} else {
					missing("the admin key in host.conf is invalid and %s does not exist", path)
				}
				return
			}
		}
	}

	raw, err := os.ReadFile(path)
	var keys []creds.Key
	switch {
	case errors.Is(err, fs.ErrNotExist):
	case err != nil:
		missing("cannot read %s (%s)", path, errText(err))
		return
	default:
		keys, err = creds.Parse(bytes.NewReader(raw))
		if err != nil {
			missing("%s cannot be parsed (%v); fix it, or remove it to have a key generated", path, err)
			return
		}
	}

	changed := false
	rootAt := -1
	for i, k := range keys {
		if k.Root() {
			rootAt = i
		}
	}
	switch {
	case fromConf && rootAt >= 0 && keys[rootAt].AccessKeyID == cfg.AdminAccessKeyID && keys[rootAt].SecretAccessKey == cfg.AdminSecretAccessKey:
	case fromConf:
		k := creds.Key{Profile: "default", AccessKeyID: cfg.AdminAccessKeyID, SecretAccessKey: cfg.AdminSecretAccessKey, Access: creds.FullAccess}
		if rootAt >= 0 {
			keys[rootAt] = k
			act("replaced the admin key in %s with ADMIN_ACCESS_KEY_ID %s from host.conf", path, k.AccessKeyID)
		} else {
			keys = append(keys, k)
			act("wrote the admin key %s from host.conf to %s", k.AccessKeyID, path)
		}
		changed = true
	case rootAt < 0:
		k := creds.Generate("default")
		keys = append(keys, k)
		changed = true
		act("generated the admin key %s in %s", k.AccessKeyID, path)
	}
	if changed {
		if err := creds.Write(path, keys); err != nil {
			missing("cannot write %s (%v)", path, err)
			return
		}
	}

	st, err := os.Stat(path)
	if err != nil {
		missing("cannot read %s (%s)", path, errText(err))
		return
	}
	if st.Mode().Perm() != 0o600 {
		if err := os.Chmod(path, 0o600); err != nil {
			missing("%s has mode %v and cannot be made 0600 (%v)", path, st.Mode().Perm(), err)
			return
		}
		act("set %s to mode 0600 (it was %v; consider rotating the keys it holds)", path, st.Mode().Perm())
	}
	if err := chownTo(path, owner, act); err != nil {
		missing("%v", err)
	}
}

// chownTo gives path to the named user (group unchanged), when one is named
// and it is not the owner already.
func chownTo(path, owner string, act func(string, ...any)) error {
	if owner == "" {
		return nil
	}
	u, err := user.Lookup(owner)
	if err != nil {
		return fmt.Errorf("user %s does not exist, so it cannot be given %s (is /usr/lib/sysusers.d/hangar.conf applied?)", owner, path)
	}
	uid, _ := strconv.Atoi(u.Uid)
	st, err := os.Stat(path)
	if err != nil {
		return err
	}
	if sys, ok := st.Sys().(*syscall.Stat_t); ok && int(sys.Uid) == uid {
		return nil
	}
	if err := os.Chown(path, uid, -1); err != nil {
		return fmt.Errorf("giving %s to %s: %w", path, owner, err)
	}
	act("gave %s to user %s", path, owner)
	return nil
}
