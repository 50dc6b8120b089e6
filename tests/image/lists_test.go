package image

import (
	"bufio"
	"bytes"
	"encoding/base64"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"hangar.dev/hangar/tests/harness"
)

func readRepo(t *testing.T, rel string) string {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(harness.RepoRoot(t), rel))
	if err != nil {
		t.Fatal(err)
	}
	return string(raw)
}

// listLines returns the non-comment lines of a list file, split in fields.
func listLines(t *testing.T, rel string) [][]string {
	var out [][]string
	s := bufio.NewScanner(strings.NewReader(readRepo(t, rel)))
	for s.Scan() {
		line := strings.TrimSpace(s.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		out = append(out, strings.Fields(line))
	}
	return out
}

// programs are the binaries `make build` makes (the Makefile's PROGRAMS).
func programs(t *testing.T) []string {
	mk := readRepo(t, "Makefile")
	m := regexp.MustCompile(`(?s)PROGRAMS :=(.*?)\n\n`).FindStringSubmatch(mk)
	if m == nil {
		t.Fatal("no PROGRAMS in the Makefile")
	}
	var out []string
	for _, f := range strings.Fields(strings.ReplaceAll(m[1], "\\", " ")) {
		if name, _, ok := strings.Cut(f, "="); ok {
			out = append(out, name)
		}
	}
	return out
}

// The bootc image and the dev disk must be built from the same lists:
// packages.list through packages.sh, files.list through install-overlay.sh.
func TestContainerfileAndDevImageShareTheLists(t *testing.T) {
	cf := readRepo(t, "Containerfile")
	build := readRepo(t, "image/build.sh")

	for _, want := range []string{
		"packages.sh fedora /tmp/hangar/image/packages.list",
		"COPY image/packages.list image/packages.sh",
		"install-overlay.sh --root / --bin /tmp/hangar/bin",
		"make build BIN=/out/bin",
		// The same starter AMI, by the same script, into the same place.
		"image/starter-ami/build.sh --out /out/starter",
		"COPY --from=starter /out/starter /tmp/hangar/starter",
		"--starter /tmp/hangar/starter",
	} {
		if !strings.Contains(cf, want) {
			t.Errorf("the Containerfile does not %q", want)
		}
	}
	for _, want := range []string{`"$here/packages.sh" debian`, `"$here/install-overlay.sh" --root`, `"$here/starter-ami/build.sh" --out "$starter"`, `--starter "$starter"`} {
		if !strings.Contains(build, want) {
			t.Errorf("image/build.sh does not %q", want)
		}
	}
	// The base is pinned by digest, and linting is the last step.
	if !regexp.MustCompile(`(?m)^FROM quay\.io/\S+-bootc:\S+@sha256:[0-9a-f]{64}\b`).MatchString(cf) {
		t.Error("the Containerfile's bootc base is not pinned by digest")
	}
	runs := regexp.MustCompile(`(?m)^RUN .*$`).FindAllString(cf, -1)
	if len(runs) == 0 || runs[len(runs)-1] != "RUN bootc container lint" {
		t.Errorf("the last step is not bootc container lint: %q", runs[len(runs)-1])
	}
	// The check stage runs, because the final image takes its result.
	if !strings.Contains(cf, "FROM image AS check") || !strings.Contains(cf, "COPY --from=check") {
		t.Error("the Containerfile has no check stage the final image depends on")
	}
	// Nothing is shipped in /var or /run.
	for _, line := range strings.Split(cf, "\n") {
		if regexp.MustCompile(`^(COPY|ADD)\b.*\s/(var|run)/`).MatchString(line) {
			t.Errorf("the Containerfile ships into /var or /run: %s", line)
		}
	}

	// Every package line names a Debian and a Fedora package (or "-").
	for _, f := range listLines(t, "image/packages.list") {
		if len(f) != 3 {
			t.Errorf("packages.list: %v has not 3 columns", f)
		}
	}
	for _, role := range []string{"qemu", "firmware-uefi", "firmware-bios", "nftables", "dbus", "cloud-init"} {
		found := false
		for _, f := range listLines(t, "image/packages.list") {
			if f[0] == role && f[1] != "-" && (f[2] != "-" || role == "dbus") {
				found = true
			}
		}
		if !found {
			t.Errorf("packages.list has no %s for both images", role)
		}
	}
}

// files.list lays every unit and config file the repository has, and every
// program; every service program has a unit.
func TestFilesListCoversTheRepository(t *testing.T) {
	root := harness.RepoRoot(t)
	var patterns []string
	for _, f := range listLines(t, "image/files.list") {
		if len(f) != 4 {
			t.Fatalf("files.list: %v has not 4 columns", f)
		}
		patterns = append(patterns, f[0])
	}
	covered := func(rel string) bool {
		for _, p := range patterns {
			if ok, _ := filepath.Match(p, rel); ok {
				return true
			}
		}
		return false
	}
	filepath.Walk(filepath.Join(root, "units"), func(path string, info os.FileInfo, err error) error {
		if err == nil && info.Mode().IsRegular() {
			rel, _ := filepath.Rel(root, path)
			if !covered(rel) {
				t.Errorf("%s is not in image/files.list: no image would have it", rel)
			}
		}
		return nil
	})
	for _, p := range programs(t) {
		if !covered("bin/" + p) {
			t.Errorf("program %s is not in image/files.list", p)
		}
		if p == "hangar" {
			continue
		}
		if _, err := os.Stat(filepath.Join(root, "units", p+".service")); err != nil {
			t.Errorf("program %s has no unit units/%s.service", p, p)
		}
	}
}

// The built dev image holds what the lists say.
func TestBuiltImageMatchesTheLists(t *testing.T) {
	img := builtImage(t)
	var missing []string
	for _, f := range listLines(t, "image/packages.list") {
		if f[1] == "-" {
			continue
		}
		info := filepath.Join(img.Rootfs, "var/lib/dpkg/info", f[1])
		_, err1 := os.Stat(info + ".list")
		_, err2 := os.Stat(info + ":amd64.list") // Multi-Arch: same packages
		if err1 != nil && err2 != nil {
			missing = append(missing, f[1])
		}
	}
	if len(missing) > 0 {
		t.Errorf("packages of packages.list missing from the image: %v", missing)
	}
	for _, p := range programs(t) {
		dest := "usr/libexec/hangar/" + p
		if p == "hangar" {
			dest = "usr/bin/hangar"
		}
		if st, err := os.Stat(filepath.Join(img.Rootfs, dest)); err != nil || st.Mode().Perm()&0o111 == 0 {
			t.Errorf("program %s is not installed at /%s", p, dest)
		}
	}
	for _, rel := range []string{"usr/share/dbus-1/system.d/dev.hangar.conf", "usr/lib/sysusers.d/hangar.conf", "usr/share/hangar/host.conf.defaults",
		"etc/systemd/system/multi-user.target.wants/hangar.target", "etc/systemd/system/hangar.target.wants/hangar-gateway.service"} {
		if _, err := os.Lstat(filepath.Join(img.Rootfs, rel)); err != nil {
			t.Errorf("the image lacks /%s", rel)
		}
	}
	// The starter AMI the gateway imports: ami.env and its disk, still
	// sparse (the image build must not fill in its holes).
	starter := filepath.Join(img.Rootfs, "usr/share/hangar/starter")
	env, err := os.ReadFile(filepath.Join(starter, "ami.env"))
	if err != nil {
		t.Errorf("the image has no starter AMI: %v", err)
	} else {
		fields := map[string]string{}
		for _, line := range strings.Split(string(env), "\n") {
			if k, v, ok := strings.Cut(line, "="); ok {
				fields[k] = v
			}
		}
		if fields["name"] != "hangar/debian-12-x86_64" || fields["boot_mode"] != "uefi" || strings.Contains(fields["disk"], "/") {
			t.Errorf("ami.env: %v (want the name, uefi, and the disk by its file name)", fields)
		}
		var st syscall.Stat_t
		if err := syscall.Stat(filepath.Join(starter, fields["disk"]), &st); err != nil {
			t.Errorf("the starter disk: %v", err)
		} else if want := fields["disk_bytes"]; strconv.FormatInt(st.Size, 10) != want || st.Blocks*512 >= st.Size/2 {
			t.Errorf("the starter disk is %d bytes (ami.env says %s) with %d allocated: not the sparse disk", st.Size, want, st.Blocks*512)
		} else {
			record(t, img, "starter AMI in the image: %d MiB allocated of %d MiB", st.Blocks*512>>20, st.Size>>20)
		}
	}
	record(t, img, "image size: root tree %d MiB, disk %d MiB used (sparse, %d MiB apparent)", img.RootfsBytes>>20, img.DiskUsed>>20, img.DiskBytes>>20)
}

// The Cluster API host pool renders with kustomize, and its objects refer
// to each other and carry a host.conf first boot accepts.
func TestCAPIPoolRenders(t *testing.T) {
	if testing.Short() {
		t.Skip("skipping: builds kustomize (a minute the first time)")
	}
	tools := filepath.Join(harness.RepoRoot(t), "image", "capi", "tools")
	rendered, err := exec.Command("go", "-C", tools, "tool", "kustomize", "build", "../example").Output()
	if err != nil {
		t.Fatalf("kustomize build image/capi/example: %v\n%s", err, stderrOf(err))
	}
	objs := yamlToJSON(t, tools, rendered)

	byKind := map[string]map[string]any{}
	for _, o := range objs {
		kind, _ := o["kind"].(string)
		if byKind[kind] != nil {
			t.Errorf("two %s objects", kind)
		}
		byKind[kind] = o
	}
	for _, k := range []string{"MachineDeployment", "AWSMachineTemplate", "MachineHealthCheck", "Secret"} {
		if byKind[k] == nil {
			t.Fatalf("the pool renders no %s (kinds: %v)", k, keys(byKind))
		}
	}
	md, amt, mhc, secret := byKind["MachineDeployment"], byKind["AWSMachineTemplate"], byKind["MachineHealthCheck"], byKind["Secret"]
	eq := func(what string, got, want any) {
		t.Helper()
		if got != want {
			t.Errorf("%s = %v, want %v", what, got, want)
		}
	}
	eq("MachineDeployment apiVersion", md["apiVersion"], "cluster.x-k8s.io/v1beta1")
	eq("AWSMachineTemplate apiVersion", amt["apiVersion"], "infrastructure.cluster.x-k8s.io/v1beta2")
	eq("bootstrap.dataSecretName", get(md, "spec", "template", "spec", "bootstrap", "dataSecretName"), get(secret, "metadata", "name"))
	eq("infrastructureRef.name", get(md, "spec", "template", "spec", "infrastructureRef", "name"), get(amt, "metadata", "name"))
	eq("infrastructureRef.kind", get(md, "spec", "template", "spec", "infrastructureRef", "kind"), "AWSMachineTemplate")
	eq("MachineDeployment clusterName", get(md, "spec", "clusterName"), "lab")
	eq("template clusterName", get(md, "spec", "template", "spec", "clusterName"), "lab")
	eq("MachineHealthCheck clusterName", get(mhc, "spec", "clusterName"), "lab")
	eq("replicas", get(md, "spec", "replicas"), 3.0)
	sel := get(md, "spec", "selector", "matchLabels", "hangar.dev/pool")
	eq("pool selector", sel, "lab-a")
	eq("template label", get(md, "spec", "template", "metadata", "labels", "hangar.dev/pool"), sel)
	eq("health check selector", get(mhc, "spec", "selector", "matchLabels", "hangar.dev/pool"), sel)
	if len(getSlice(mhc, "spec", "unhealthyConditions")) == 0 || get(mhc, "spec", "maxUnhealthy") == nil {
		t.Errorf("the health check has no conditions or no maxUnhealthy: %v", mhc["spec"])
	}
	itype, _ := get(amt, "spec", "template", "spec", "instanceType").(string)
	if !regexp.MustCompile(`^[a-z][a-z0-9]*d[n]?\.metal$`).MatchString(itype) {
		t.Errorf("instance type %q is not a metal type with instance storage", itype)
	}
	if ami, _ := get(amt, "spec", "template", "spec", "ami", "id").(string); !strings.HasPrefix(ami, "ami-") {
		t.Errorf("ami id %q", ami)
	}
	eq("secret type", secret["type"], "cluster.x-k8s.io/secret")
	format, _ := base64.StdEncoding.DecodeString(get(secret, "data", "format").(string))
	eq("secret format", string(format), "cloud-config")

	// The user data is cloud-config that writes a host.conf first boot
	// accepts.
	rawUserData, err := base64.StdEncoding.DecodeString(strings.ReplaceAll(get(secret, "data", "value").(string), "\n", ""))
	if err != nil || !bytes.HasPrefix(rawUserData, []byte("#cloud-config\n")) {
		t.Fatalf("user data is not cloud-config: %v\n%s", err, rawUserData)
	}
	ud := yamlToJSON(t, tools, rawUserData)[0]
	var hostConf string
	for _, f := range getSlice(ud, "write_files") {
		if m, ok := f.(map[string]any); ok && m["path"] == "/etc/hangar/host.conf" {
			hostConf, _ = m["content"].(string)
		}
	}
	if hostConf == "" {
		t.Fatalf("the user data writes no /etc/hangar/host.conf: %s", rawUserData)
	}
	conf := filepath.Join(t.TempDir(), "host.conf")
	os.WriteFile(conf, []byte(hostConf), 0o644)
	out, err := exec.Command(filepath.Join(harness.Binaries(t), "hangar-firstboot"), "--check", conf, "--defaults", "").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "valid (region eu-west-1") {
		t.Errorf("the pool's host.conf does not validate: %v\n%s", err, out)
	}
}

func yamlToJSON(t *testing.T, tools string, y []byte) []map[string]any {
	t.Helper()
	cmd := exec.Command("go", "-C", tools, "run", "./yaml2json")
	cmd.Stdin = bytes.NewReader(y)
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("yaml2json: %v\n%s", err, stderrOf(err))
	}
	var objs []map[string]any
	if err := json.Unmarshal(out, &objs); err != nil {
		t.Fatal(err)
	}
	return objs
}

func stderrOf(err error) string {
	if ee, ok := err.(*exec.ExitError); ok {
		return string(ee.Stderr)
	}
	return ""
}

func get(o map[string]any, path ...string) any {
	var cur any = o
	for _, p := range path {
		m, ok := cur.(map[string]any)
		if !ok {
			return nil
		}
		cur = m[p]
	}
	return cur
}

func getSlice(o map[string]any, path ...string) []any {
	s, _ := get(o, path...).([]any)
	return s
}

func keys(m map[string]map[string]any) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

// make image-ami publishes with bootc-image-builder; --dry-run prints the
// commands and runs nothing (there is no registry or AWS account here).
func TestImageAMIDryRun(t *testing.T) {
	root := harness.RepoRoot(t)
	cmd := exec.Command("make", "-s", "image-ami", "AMI_FLAGS=--dry-run --bucket hangar-amis --region eu-west-1 --name hangar-test")
	cmd.Dir = root
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("make image-ami --dry-run: %v\n%s", err, out)
	}
	for _, want := range []string{
		"+ podman build --pull=newer --tag localhost/hangar:",
		"--file Containerfile .",
		"bootc-image-builder",
		"--type ami",
		"--aws-ami-name hangar-test --aws-bucket hangar-amis --aws-region eu-west-1",
		"--volume /var/lib/containers/storage:/var/lib/containers/storage",
		"(dry run: nothing was built or uploaded)",
	} {
		if !strings.Contains(string(out), want) {
			t.Errorf("dry run lacks %q:\n%s", want, out)
		}
	}
	// Without a bucket, a real run stops before doing anything.
	cmd = exec.Command(filepath.Join(root, "image/ami.sh"))
	cmd.Env = append(os.Environ(), "HANGAR_AMI_BUCKET=")
	out, err = cmd.CombinedOutput()
	if err == nil || !strings.Contains(string(out), "name the S3 bucket") {
		t.Errorf("ami.sh without a bucket: %v\n%s", err, out)
	}
}

// install-overlay.sh leaves out the unit of a service whose binary is not
// built, so a service still being written breaks neither image, and enables
// what it installs by preset.
func TestOverlayLeavesOutUnbuiltServices(t *testing.T) {
	harness.Require(t, "systemctl", "install")
	root := harness.RepoRoot(t)
	bin, dest := t.TempDir(), t.TempDir()
	for _, p := range []string{"hangar", "hangar-firstboot", "hangar-gateway"} {
		if err := os.WriteFile(filepath.Join(bin, p), []byte("#!/bin/sh\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	out, err := exec.Command(filepath.Join(root, "image/install-overlay.sh"), "--root", dest, "--bin", bin, "--repo", root).CombinedOutput()
	if err != nil {
		t.Fatalf("install-overlay.sh: %v\n%s", err, out)
	}
	unit := func(name string) string { return filepath.Join(dest, "usr/lib/systemd/system", name) }
	for _, want := range []string{"hangar.target", "hangar-firstboot.service", "hangar-gateway.service", "hangar-banner.service", "hangar-vms.slice"} {
		if _, err := os.Stat(unit(want)); err != nil {
			t.Errorf("%s not installed", want)
		}
	}
	for _, absent := range []string{"hangar-netd.service", "hangar-vmd.service", "hangar-ebsd.service"} {
		if _, err := os.Stat(unit(absent)); err == nil {
			t.Errorf("%s installed without its binary", absent)
		}
		if !strings.Contains(string(out), "leaving out "+absent) {
			t.Errorf("no line says %s was left out:\n%s", absent, out)
		}
	}
	for _, link := range []string{"etc/systemd/system/multi-user.target.wants/hangar.target", "etc/systemd/system/hangar.target.wants/hangar-gateway.service", "etc/systemd/system/hangar.target.wants/hangar-firstboot.service"} {
		if _, err := os.Lstat(filepath.Join(dest, link)); err != nil {
			t.Errorf("preset did not enable /%s", link)
		}
	}
	if _, err := os.Stat(filepath.Join(dest, "usr/libexec/hangar/hangar-gateway")); err != nil {
		t.Error("the gateway binary is not in /usr/libexec/hangar")
	}
}
