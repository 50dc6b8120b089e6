package vm

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// UserData is cloud-init user data that writes host.conf, as a fleet's
// bootstrap (Cluster API's, see image/capi) delivers it.
func UserData(hostConf string) string {
	var b strings.Builder
	b.WriteString("#cloud-config\n# hangar: host.conf for hangar-firstboot (docs/host.conf.md)\nwrite_files:\n  - path: /etc/hangar/host.conf\n    owner: root:root\n    permissions: \"0644\"\n    content: |\n")
	for _, line := range strings.Split(strings.TrimRight(hostConf, "\n"), "\n") {
		b.WriteString("      " + line + "\n")
	}
	return b.String()
}

// MakeSeed writes a NoCloud seed (a FAT image labelled CIDATA holding
// user-data and meta-data) to path. instanceID changes make cloud-init run
// its per-instance modules again.
func MakeSeed(ctx context.Context, path, userData, instanceID, hostname string) error {
	dir, err := os.MkdirTemp("", "hangar-seed-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	meta := fmt.Sprintf("instance-id: %s\nlocal-hostname: %s\n", instanceID, hostname)
	if err := os.WriteFile(filepath.Join(dir, "user-data"), []byte(userData), 0o600); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "meta-data"), []byte(meta), 0o644); err != nil {
		return err
	}
	_ = os.Remove(path)
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		return err
	}
	if err := os.Truncate(path, 2<<20); err != nil {
		return err
	}
	run := func(name string, args ...string) error {
		cmd := exec.CommandContext(ctx, name, args...)
		cmd.Env = append(os.Environ(), "MTOOLS_SKIP_CHECK=1")
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("%s: %v: %s", name, err, out)
		}
		return nil
	}
	if err := run("mkfs.vfat", "-n", "CIDATA", path); err != nil {
		return fmt.Errorf("making the NoCloud seed (apt-get install dosfstools mtools): %w", err)
	}
	return run("mcopy", "-i", path, filepath.Join(dir, "user-data"), filepath.Join(dir, "meta-data"), "::/")
}
