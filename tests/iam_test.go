package tests

import (
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"

	"hangar.dev/hangar/tests/harness"
)

// assumed is the answer of sts assume-role.
type assumed struct {
	Credentials struct {
		AccessKeyId, SecretAccessKey, SessionToken, Expiration string
	}
	AssumedRoleUser struct{ Arn, AssumedRoleId string }
}

// env is the environment that makes /usr/bin/aws use these credentials.
func (a assumed) env() []string {
	return []string{"AWS_ACCESS_KEY_ID=" + a.Credentials.AccessKeyId,
		"AWS_SECRET_ACCESS_KEY=" + a.Credentials.SecretAccessKey, "AWS_SESSION_TOKEN=" + a.Credentials.SessionToken}
}

// TestIAMRolesAndTemporaryCredentials drives IAM and STS as a user does:
// roles, a profile, assume-role, and the temporary credentials used with
// the aws CLI, read-only where the role's policies only read, refused
// once expired, kept across a restart.
func TestIAMRolesAndTemporaryCredentials(t *testing.T) {
	d := harness.StartDev(t, harness.Options{})
	account := cliText(t, d, "sts", "get-caller-identity", "--query", "Account")
	trust := `{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Principal":{"AWS":"arn:aws:iam::` + account + `:root"},"Action":"sts:AssumeRole"}]}`

	var role struct{ Role struct{ Arn, RoleId string } }
	cli(t, d, &role, "iam", "create-role", "--role-name", "deployer", "--assume-role-policy-document", trust)
	if role.Role.Arn != "arn:aws:iam::"+account+":role/deployer" || !strings.HasPrefix(role.Role.RoleId, "AROA") {
		t.Fatalf("create-role: %+v", role)
	}
	d.MustAWS("iam", "put-role-policy", "--role-name", "deployer", "--policy-name", "vpcs",
		"--policy-document", `{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Action":"ec2:*","Resource":"*"}]}`)
	cli(t, d, nil, "iam", "create-role", "--role-name", "auditor", "--assume-role-policy-document", trust)
	d.MustAWS("iam", "attach-role-policy", "--role-name", "auditor", "--policy-arn", "arn:aws:iam::aws:policy/ReadOnlyAccess")
	cliFails(t, d, "EntityAlreadyExists", "iam", "create-role", "--role-name", "Deployer", "--assume-role-policy-document", trust)
	cliFails(t, d, "MalformedPolicyDocument", "iam", "create-role", "--role-name", "bad", "--assume-role-policy-document", "{not json")
	cliFails(t, d, "NoSuchEntity", "iam", "get-role", "--role-name", "nobody")

	// An instance profile holds one role.
	cli(t, d, nil, "iam", "create-instance-profile", "--instance-profile-name", "deployer")
	d.MustAWS("iam", "add-role-to-instance-profile", "--instance-profile-name", "deployer", "--role-name", "deployer")
	cliFails(t, d, "LimitExceeded", "iam", "add-role-to-instance-profile", "--instance-profile-name", "deployer", "--role-name", "auditor")
	if got := cliText(t, d, "iam", "get-instance-profile", "--instance-profile-name", "deployer", "--query", "InstanceProfile.Roles[0].RoleName"); got != "deployer" {
		t.Fatalf("profile's role: %q", got)
	}
	cliFails(t, d, "DeleteConflict", "iam", "delete-role", "--role-name", "deployer")

	// Assume both roles; the credentials work as the role.
	var dep, aud assumed
	cli(t, d, &dep, "sts", "assume-role", "--role-arn", role.Role.Arn, "--role-session-name", "release-7")
	cli(t, d, &aud, "sts", "assume-role", "--role-arn", "arn:aws:iam::"+account+":role/auditor", "--role-session-name", "audit", "--duration-seconds", "900")
	if !strings.HasPrefix(dep.Credentials.AccessKeyId, "ASIA") || dep.AssumedRoleUser.Arn != "arn:aws:sts::"+account+":assumed-role/deployer/release-7" {
		t.Fatalf("assume-role: %+v", dep)
	}
	out, stderr, err := awsWith(t, d, dep.env(), "sts", "get-caller-identity", "--output", "json")
	if err != nil {
		t.Fatalf("get-caller-identity with the role's credentials: %v: %s", err, stderr)
	}
	var who struct{ Arn, UserId, Account string }
	if err := json.Unmarshal([]byte(out), &who); err != nil {
		t.Fatal(err)
	}
	if who.Arn != dep.AssumedRoleUser.Arn || who.UserId != role.Role.RoleId+":release-7" || who.Account != account {
		t.Fatalf("caller with role credentials: %+v", who)
	}
	// The deployer may write (DryRunOperation means "would have
	// succeeded"); the auditor, read-only, may only read.
	wantCLIError(t, d, dep.env(), "DryRunOperation", "ec2", "create-vpc", "--cidr-block", "10.20.0.0/16", "--dry-run")
	if _, stderr, err := awsWith(t, d, aud.env(), "ec2", "describe-vpcs"); err != nil {
		t.Fatalf("read-only role cannot describe-vpcs: %s", stderr)
	}
	msg := wantCLIError(t, d, aud.env(), "UnauthorizedOperation", "ec2", "create-vpc", "--cidr-block", "10.20.0.0/16")
	if !strings.Contains(msg, "assumed-role/auditor/audit") {
		t.Errorf("UnauthorizedOperation does not name the assumed role: %s", msg)
	}
	wantCLIError(t, d, aud.env(), "AccessDenied", "sts", "assume-role", "--role-arn", role.Role.Arn, "--role-session-name", "chain")
	// A wrong token is no key.
	bad := append(dep.env(), "AWS_SESSION_TOKEN="+dep.Credentials.SessionToken[:20])
	wantCLIError(t, d, bad, "InvalidClientTokenId", "sts", "get-caller-identity")

	// get-session-token: the root key's own identity, for an hour.
	var sess assumed
	cli(t, d, &sess, "sts", "get-session-token")
	if got, _, err := awsWith(t, d, sess.env(), "sts", "get-caller-identity", "--query", "Arn", "--output", "text"); err != nil || strings.TrimSpace(got) != "arn:aws:iam::"+account+":root" {
		t.Fatalf("session token's identity: %q %v", got, err)
	}

	// EC2's side of instance profiles answers the CLI (associating one
	// with a running instance is covered by the ec2 package's tests).
	if got := cliText(t, d, "ec2", "describe-iam-instance-profile-associations", "--query", "length(IamInstanceProfileAssociations)"); got != "0" {
		t.Fatalf("associations on a new host: %s", got)
	}
	cliFails(t, d, "InvalidInstanceID.NotFound", "ec2", "associate-iam-instance-profile", "--instance-id", "i-0123456789abcdef0", "--iam-instance-profile", "Name=deployer")
	cliFails(t, d, "InvalidAssociationID.NotFound", "ec2", "disassociate-iam-instance-profile", "--association-id", "iip-assoc-0123456789abcdef0")

	// Temporary keys are records: they survive a restart, and one whose
	// expiry has passed is refused as AWS refuses it. Nobody waits 15
	// minutes here: the auditor's expiry is moved into the past in the
	// stopped gateway's state file.
	d.Stop()
	expireSession(t, filepath.Join(d.Dir, "gateway", "state.db"), aud.Credentials.AccessKeyId)
	d.Restart()
	if _, stderr, err := awsWith(t, d, dep.env(), "sts", "get-caller-identity"); err != nil {
		t.Fatalf("role credentials after a restart: %s", stderr)
	}
	msg = wantCLIError(t, d, aud.env(), "ExpiredToken", "sts", "get-caller-identity")
	if !strings.Contains(msg, "The security token included in the request is expired") {
		t.Errorf("expired token message: %s", msg)
	}
	wantCLIError(t, d, aud.env(), "RequestExpired", "ec2", "describe-vpcs")
}

// expireSession sets a temporary key's expiry a minute in the past, in
// the state file of a stopped gateway.
func expireSession(t *testing.T, path, accessKeyID string) {
	t.Helper()
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: 10 * time.Second})
	if err != nil {
		t.Fatalf("opening the stopped gateway's state: %v", err)
	}
	defer db.Close()
	err = db.Update(func(tx *bolt.Tx) error {
		b := tx.Bucket([]byte("sts-sessions"))
		if b == nil {
			t.Fatal("the state file has no sts-sessions bucket")
		}
		var rec map[string]any
		if err := json.Unmarshal(b.Get([]byte(accessKeyID)), &rec); err != nil {
			t.Fatalf("session %s: %v", accessKeyID, err)
		}
		rec["Expiration"] = time.Now().Add(-time.Minute).UTC().Format(time.RFC3339)
		raw, err := json.Marshal(rec)
		if err != nil {
			return err
		}
		return b.Put([]byte(accessKeyID), raw)
	})
	if err != nil {
		t.Fatal(err)
	}
}
