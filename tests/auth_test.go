package tests

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	v4 "github.com/aws/aws-sdk-go-v2/aws/signer/v4"
	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/smithy-go"

	"hangar.dev/hangar/tests/harness"
)

// awsWith runs /usr/bin/aws against d with extra environment (which wins
// over the harness's) and returns stdout and stderr.
func awsWith(t *testing.T, d *harness.Dev, env []string, args ...string) (string, string, error) {
	t.Helper()
	harness.Require(t, harness.AWSCLI)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, harness.AWSCLI, append([]string{"--endpoint-url", d.Endpoint}, args...)...)
	cmd.Env = append(d.Env(), env...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	return stdout.String(), stderr.String(), err
}

// wantCLIError runs the CLI and requires it to fail with AWS error code.
func wantCLIError(t *testing.T, d *harness.Dev, env []string, code string, args ...string) string {
	t.Helper()
	_, stderr, err := awsWith(t, d, env, args...)
	if err == nil {
		t.Fatalf("aws %s succeeded; want %s", strings.Join(args, " "), code)
	}
	if !strings.Contains(stderr, "An error occurred ("+code+")") {
		t.Fatalf("aws %s: want error %s, got: %s", strings.Join(args, " "), code, stderr)
	}
	return stderr
}

func TestCLIRefusesBadCredentials(t *testing.T) {
	d := harness.StartDev(t, harness.Options{})
	root := d.Key()
	wrongSecret := []string{"AWS_ACCESS_KEY_ID=" + root.AccessKeyID, "AWS_SECRET_ACCESS_KEY=" + strings.Repeat("x", 40)}
	unknownKey := []string{"AWS_ACCESS_KEY_ID=AKIAUNKNOWNUNKNOWN00", "AWS_SECRET_ACCESS_KEY=" + root.SecretAccessKey}

	msg := wantCLIError(t, d, wrongSecret, "AuthFailure", "ec2", "describe-vpcs")
	if !strings.Contains(msg, "AWS was not able to validate the provided access credentials") {
		t.Errorf("ec2 wrong secret: %s", msg)
	}
	msg = wantCLIError(t, d, wrongSecret, "SignatureDoesNotMatch", "sts", "get-caller-identity")
	if !strings.Contains(msg, "The request signature we calculated does not match the signature you provided") {
		t.Errorf("sts wrong secret: %s", msg)
	}
	wantCLIError(t, d, unknownKey, "AuthFailure", "ec2", "describe-vpcs")
	msg = wantCLIError(t, d, unknownKey, "InvalidClientTokenId", "sts", "get-caller-identity")
	if !strings.Contains(msg, "The security token included in the request is invalid") {
		t.Errorf("sts unknown key: %s", msg)
	}
	// A key with a session token the host never issued.
	withToken := append(append([]string{}, "AWS_ACCESS_KEY_ID="+root.AccessKeyID, "AWS_SECRET_ACCESS_KEY="+root.SecretAccessKey), "AWS_SESSION_TOKEN=FwoGZXIvYXdzEBogus")
	wantCLIError(t, d, withToken, "InvalidClientTokenId", "sts", "get-caller-identity")

	// The SDK hears the same codes, and a clock 20 minutes off is refused
	// as AWS refuses it.
	for _, c := range []struct {
		name   string
		secret string
		skew   time.Duration
		want   string
	}{
		{"wrong secret", "wrong" + root.SecretAccessKey[5:], 0, "AuthFailure"},
		{"20 minutes slow", root.SecretAccessKey, -20 * time.Minute, "RequestExpired"},
		{"20 minutes fast", root.SecretAccessKey, 20 * time.Minute, "RequestExpired"},
	} {
		cfg := d.SDK()
		cfg.Credentials = aws.CredentialsProviderFunc(func(context.Context) (aws.Credentials, error) {
			return aws.Credentials{AccessKeyID: root.AccessKeyID, SecretAccessKey: c.secret}, nil
		})
		cfg.RetryMaxAttempts = 1
		client := ec2.NewFromConfig(cfg, func(o *ec2.Options) {
			o.HTTPSignerV4 = skewedSigner{skew: c.skew, signer: v4.NewSigner()}
		})
		_, err := client.DescribeVpcs(context.Background(), &ec2.DescribeVpcsInput{})
		var api smithy.APIError
		if !errors.As(err, &api) || api.ErrorCode() != c.want {
			t.Errorf("SDK %s: %v, want %s", c.name, err, c.want)
		}
	}
}

// skewedSigner is the SDK's signer with a clock that is off by skew.
type skewedSigner struct {
	skew   time.Duration
	signer *v4.Signer
}

func (k skewedSigner) SignHTTP(ctx context.Context, c aws.Credentials, r *http.Request, payloadHash, service, region string, t time.Time, opts ...func(*v4.SignerOptions)) error {
	return k.signer.SignHTTP(ctx, c, r, payloadHash, service, region, t.Add(k.skew), opts...)
}

// gatewayPID finds the hangar-gateway that d started: the process whose
// command line names d's own credentials file.
func gatewayPID(t *testing.T, d *harness.Dev) int {
	t.Helper()
	entries, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		raw, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		args := strings.Split(string(raw), "\x00")
		if filepath.Base(args[0]) != "hangar-gateway" {
			continue
		}
		for i, a := range args {
			if a == "--credentials" && i+1 < len(args) && args[i+1] == d.Credentials {
				return pid
			}
		}
	}
	t.Fatalf("no hangar-gateway serving %s", d.Credentials)
	return 0
}

func TestCLIReadOnlyProfile(t *testing.T) {
	d := harness.StartDev(t, harness.Options{})
	const id, secret = "AKIAAUDITORAUDITOR01", "auditorSecretAuditorSecretAuditorSecret1"
	f, err := os.OpenFile(d.Credentials, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	_, err = fmt.Fprintf(f, "\n[auditor]\naws_access_key_id = %s\naws_secret_access_key = %s\nhangar_access = read-only\n", id, secret)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		t.Fatal(err)
	}
	// The gateway rereads the file on SIGHUP.
	if err := syscall.Kill(gatewayPID(t, d), syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	// The aws CLI takes a profile's region from the config file, which has
	// only [default]; the host's region goes in the environment.
	auditor := []string{"AWS_PROFILE=auditor", "AWS_DEFAULT_REGION=" + hostRegion(t, d)}
	deadline := time.Now().Add(30 * time.Second)
	var out string
	for {
		var stderr string
		out, stderr, err = awsWith(t, d, auditor, "sts", "get-caller-identity")
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the gateway never accepted the read-only key after SIGHUP: %s", stderr)
		}
		time.Sleep(300 * time.Millisecond)
	}
	var who struct{ Arn string }
	if err := json.Unmarshal([]byte(out), &who); err != nil || !strings.HasSuffix(who.Arn, ":user/auditor") {
		t.Fatalf("read-only caller identity: %s", out)
	}
	if _, stderr, err := awsWith(t, d, auditor, "ec2", "describe-vpcs"); err != nil {
		t.Fatalf("read-only describe-vpcs: %s", stderr)
	}
	msg := wantCLIError(t, d, auditor, "UnauthorizedOperation", "ec2", "create-vpc", "--cidr-block", "10.7.0.0/16")
	if !strings.Contains(msg, "ec2:CreateVpc") {
		t.Errorf("read-only create-vpc: %s", msg)
	}
	// A read-only key's dry run is refused as unauthorized, as AWS does
	// for a caller without the permission.
	wantCLIError(t, d, auditor, "UnauthorizedOperation", "ec2", "create-vpc", "--cidr-block", "10.7.0.0/16", "--dry-run")
	out = d.MustAWS("ec2", "describe-vpcs", "--filters", "Name=cidr,Values=10.7.0.0/16", "--query", "Vpcs[].VpcId", "--output", "text")
	if strings.TrimSpace(out) != "" {
		t.Fatalf("a refused create-vpc left a VPC: %q", out)
	}
}

// hostRegion is the region hangar dev wrote into the CLI's config.
func hostRegion(t *testing.T, d *harness.Dev) string {
	t.Helper()
	raw, err := os.ReadFile(d.Config)
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(raw), "\n") {
		if k, v, ok := strings.Cut(line, "="); ok && strings.TrimSpace(k) == "region" {
			return strings.TrimSpace(v)
		}
	}
	t.Fatalf("%s names no region", d.Config)
	return ""
}

func TestCLIDryRun(t *testing.T) {
	d := harness.StartDev(t, harness.Options{})
	msg := wantCLIError(t, d, nil, "DryRunOperation", "ec2", "create-vpc", "--cidr-block", "10.8.0.0/16", "--dry-run")
	if !strings.Contains(msg, "Request would have succeeded, but DryRun flag is set") {
		t.Errorf("dry run: %s", msg)
	}
	out := d.MustAWS("ec2", "describe-vpcs", "--filters", "Name=cidr,Values=10.8.0.0/16", "--query", "Vpcs[].VpcId", "--output", "text")
	if strings.TrimSpace(out) != "" {
		t.Fatalf("a dry run created a VPC: %q", out)
	}
	if _, stderr, err := awsWith(t, d, nil, "ec2", "describe-vpcs", "--dry-run"); !strings.Contains(stderr, "(DryRunOperation)") {
		t.Fatalf("describe-vpcs --dry-run: %v %s", err, stderr)
	}
}

func TestCLIUnknownServiceAnswersQuickly(t *testing.T) {
	d := harness.StartDev(t, harness.Options{})
	start := time.Now()
	_, stderr, err := awsWith(t, d, []string{"AWS_MAX_ATTEMPTS=1"}, "s3api", "list-buckets")
	if err == nil {
		t.Fatal("s3api list-buckets succeeded against a host with no S3")
	}
	if !strings.Contains(stderr, "(UnknownService)") || !strings.Contains(stderr, `"s3"`) {
		t.Fatalf("s3api list-buckets: %s", stderr)
	}
	if d := time.Since(start); d > 30*time.Second {
		t.Fatalf("the unknown service took %v to answer", d)
	}
}
