package iam

import (
	"context"
	"errors"
	"log/slog"
	"net/http/httptest"
	"net/url"
	"path/filepath"
	"strings"
	"testing"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/iam"
	"github.com/aws/aws-sdk-go-v2/service/iam/types"
	"github.com/aws/smithy-go"

	"hangar.dev/hangar/services/gateway/awsmodel"
	"hangar.dev/hangar/services/gateway/server"
	"hangar.dev/hangar/services/internal/creds"
	"hangar.dev/hangar/services/internal/store"
)

const testAccount = "123456789012"

var (
	bg      = context.Background()
	rootKey = creds.Key{Profile: "default", AccessKeyID: "AKIAROOTROOTROOTROOT", SecretAccessKey: "rootSecretRootSecretRootSecretRootSecret", Access: creds.FullAccess}
)

const trust = `{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Principal":{"Service":"ec2.amazonaws.com"},"Action":"sts:AssumeRole"}]}`

// newIAM is IAM behind the gateway's server, and an SDK client of it: the
// SDK's serializer and deserializer check the wire forms both ways.
func newIAM(t *testing.T) (*Service, *iam.Client) {
	t.Helper()
	db, err := store.Open(filepath.Join(t.TempDir(), "state.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	s := New(db, testAccount, slog.New(slog.DiscardHandler))
	srv := server.New(server.Config{AccountID: testAccount, Region: "eu-west-1", Keys: server.StaticKeys{rootKey}, Log: slog.New(slog.DiscardHandler)})
	srv.RegisterQuery("iam", awsmodel.MustLoad("iam"), s)
	hs := httptest.NewServer(srv)
	t.Cleanup(hs.Close)
	c := iam.New(iam.Options{Region: "us-east-1", BaseEndpoint: aws.String(hs.URL), HTTPClient: hs.Client(), RetryMaxAttempts: 1,
		Credentials: aws.CredentialsProviderFunc(func(context.Context) (aws.Credentials, error) {
			return aws.Credentials{AccessKeyID: rootKey.AccessKeyID, SecretAccessKey: rootKey.SecretAccessKey}, nil
		})})
	return s, c
}

// apiError returns the AWS error code and HTTP status of err.
func apiError(t *testing.T, err error) (string, int) {
	t.Helper()
	if err == nil {
		return "", 200
	}
	var ae smithy.APIError
	if !errors.As(err, &ae) {
		t.Fatalf("not an API error: %v", err)
	}
	status := 0
	var re interface{ HTTPStatusCode() int }
	if errors.As(err, &re) {
		status = re.HTTPStatusCode()
	}
	return ae.ErrorCode(), status
}

func wantErr(t *testing.T, err error, code string, status int) {
	t.Helper()
	c, st := apiError(t, err)
	if c != code || st != status {
		t.Fatalf("error %v: code %s status %d, want %s %d", err, c, st, code, status)
	}
}

func TestRoleLifecycle(t *testing.T) {
	_, c := newIAM(t)
	out, err := c.CreateRole(bg, &iam.CreateRoleInput{RoleName: aws.String("web"), Path: aws.String("/app/"),
		AssumeRolePolicyDocument: aws.String(trust), Description: aws.String("web servers"),
		Tags: []types.Tag{{Key: aws.String("team"), Value: aws.String("a")}}})
	if err != nil {
		t.Fatal(err)
	}
	r := out.Role
	if *r.Arn != "arn:aws:iam::"+testAccount+":role/app/web" || !strings.HasPrefix(*r.RoleId, "AROA") || len(*r.RoleId) != 21 {
		t.Fatalf("role %s id %s", *r.Arn, *r.RoleId)
	}
	if doc, _ := url.QueryUnescape(*r.AssumeRolePolicyDocument); doc != trust {
		t.Fatalf("trust policy comes back as %q", *r.AssumeRolePolicyDocument)
	}
	if *r.MaxSessionDuration != 3600 || r.CreateDate == nil {
		t.Fatalf("role %+v", r)
	}
	// Names are unique and found regardless of case.
	_, err = c.CreateRole(bg, &iam.CreateRoleInput{RoleName: aws.String("WEB"), AssumeRolePolicyDocument: aws.String(trust)})
	wantErr(t, err, "EntityAlreadyExists", 409)
	got, err := c.GetRole(bg, &iam.GetRoleInput{RoleName: aws.String("Web")})
	if err != nil || *got.Role.RoleId != *r.RoleId || len(got.Role.Tags) != 1 {
		t.Fatalf("GetRole: %v %+v", err, got)
	}

	if _, err := c.UpdateRole(bg, &iam.UpdateRoleInput{RoleName: aws.String("web"), MaxSessionDuration: aws.Int32(7200)}); err != nil {
		t.Fatal(err)
	}
	newTrust := strings.Replace(trust, "ec2.amazonaws.com", "lambda.amazonaws.com", 1)
	if _, err := c.UpdateAssumeRolePolicy(bg, &iam.UpdateAssumeRolePolicyInput{RoleName: aws.String("web"), PolicyDocument: aws.String(newTrust)}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.TagRole(bg, &iam.TagRoleInput{RoleName: aws.String("web"), Tags: []types.Tag{{Key: aws.String("TEAM"), Value: aws.String("b")}, {Key: aws.String("env"), Value: aws.String("prod")}}}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.UntagRole(bg, &iam.UntagRoleInput{RoleName: aws.String("web"), TagKeys: []string{"env"}}); err != nil {
		t.Fatal(err)
	}
	tags, err := c.ListRoleTags(bg, &iam.ListRoleTagsInput{RoleName: aws.String("web")})
	if err != nil || len(tags.Tags) != 1 || *tags.Tags[0].Key != "TEAM" || *tags.Tags[0].Value != "b" {
		t.Fatalf("tags after tag/untag: %v %+v", err, tags)
	}
	got, _ = c.GetRole(bg, &iam.GetRoleInput{RoleName: aws.String("web")})
	if doc, _ := url.QueryUnescape(*got.Role.AssumeRolePolicyDocument); doc != newTrust || *got.Role.MaxSessionDuration != 7200 {
		t.Fatalf("after updates: %+v", got.Role)
	}

	if _, err := c.DeleteRole(bg, &iam.DeleteRoleInput{RoleName: aws.String("web")}); err != nil {
		t.Fatal(err)
	}
	_, err = c.GetRole(bg, &iam.GetRoleInput{RoleName: aws.String("web")})
	wantErr(t, err, "NoSuchEntity", 404)
}

func TestRoleInputErrors(t *testing.T) {
	_, c := newIAM(t)
	long := strings.Repeat("a", 65)
	for _, tc := range []struct {
		name   string
		in     iam.CreateRoleInput
		code   string
		status int
	}{
		{"bad name", iam.CreateRoleInput{RoleName: aws.String("a b"), AssumeRolePolicyDocument: aws.String(trust)}, "ValidationError", 400},
		{"long name", iam.CreateRoleInput{RoleName: aws.String(long), AssumeRolePolicyDocument: aws.String(trust)}, "ValidationError", 400},
		{"bad path", iam.CreateRoleInput{RoleName: aws.String("r"), Path: aws.String("app"), AssumeRolePolicyDocument: aws.String(trust)}, "ValidationError", 400},
		{"not json", iam.CreateRoleInput{RoleName: aws.String("r"), AssumeRolePolicyDocument: aws.String(`{"Statement": [`)}, "MalformedPolicyDocument", 400},
		{"no statement", iam.CreateRoleInput{RoleName: aws.String("r"), AssumeRolePolicyDocument: aws.String(`{"Version":"2012-10-17"}`)}, "MalformedPolicyDocument", 400},
		{"bad effect", iam.CreateRoleInput{RoleName: aws.String("r"), AssumeRolePolicyDocument: aws.String(strings.Replace(trust, "Allow", "Permit", 1))}, "MalformedPolicyDocument", 400},
		{"resource in trust", iam.CreateRoleInput{RoleName: aws.String("r"), AssumeRolePolicyDocument: aws.String(strings.Replace(trust, `"Action"`, `"Resource":"*","Action"`, 1))}, "MalformedPolicyDocument", 400},
		{"bad version", iam.CreateRoleInput{RoleName: aws.String("r"), AssumeRolePolicyDocument: aws.String(strings.Replace(trust, "2012-10-17", "2020-01-01", 1))}, "MalformedPolicyDocument", 400},
		{"trust too big", iam.CreateRoleInput{RoleName: aws.String("r"), AssumeRolePolicyDocument: aws.String(strings.Replace(trust, `"Action"`, `"Sid":"`+strings.Repeat("x", 2100)+`","Action"`, 1))}, "LimitExceeded", 409},
		{"session too short", iam.CreateRoleInput{RoleName: aws.String("r"), AssumeRolePolicyDocument: aws.String(trust), MaxSessionDuration: aws.Int32(60)}, "ValidationError", 400},
		{"aws tag", iam.CreateRoleInput{RoleName: aws.String("r"), AssumeRolePolicyDocument: aws.String(trust), Tags: []types.Tag{{Key: aws.String("aws:x"), Value: aws.String("")}}}, "InvalidInput", 400},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := c.CreateRole(bg, &tc.in)
			wantErr(t, err, tc.code, tc.status)
		})
	}
	// None of them left a role behind.
	out, err := c.ListRoles(bg, &iam.ListRolesInput{})
	if err != nil || len(out.Roles) != 0 {
		t.Fatalf("roles after failed creates: %v %+v", err, out)
	}
	_, err = c.DeleteRole(bg, &iam.DeleteRoleInput{RoleName: aws.String("nope")})
	wantErr(t, err, "NoSuchEntity", 404)
}

func TestListRolesPages(t *testing.T) {
	_, c := newIAM(t)
	for _, n := range []string{"c", "a", "e", "b", "d"} {
		path := "/"
		if n == "b" || n == "d" {
			path = "/ops/"
		}
		if _, err := c.CreateRole(bg, &iam.CreateRoleInput{RoleName: aws.String(n), Path: aws.String(path), AssumeRolePolicyDocument: aws.String(trust)}); err != nil {
			t.Fatal(err)
		}
	}
	var names []string
	var marker *string
	pages := 0
	for {
		out, err := c.ListRoles(bg, &iam.ListRolesInput{MaxItems: aws.Int32(2), Marker: marker})
		if err != nil {
			t.Fatal(err)
		}
		pages++
		for _, r := range out.Roles {
			names = append(names, *r.RoleName)
			if r.Tags != nil {
				t.Errorf("ListRoles shows tags of %s, which IAM leaves out", *r.RoleName)
			}
		}
		if !out.IsTruncated {
			break
		}
		marker = out.Marker
	}
	if strings.Join(names, ",") != "a,b,c,d,e" || pages != 3 {
		t.Fatalf("paged roles %v in %d pages", names, pages)
	}
	ops, err := c.ListRoles(bg, &iam.ListRolesInput{PathPrefix: aws.String("/ops")})
	if err != nil || len(ops.Roles) != 2 || *ops.Roles[0].RoleName != "b" {
		t.Fatalf("PathPrefix /ops: %v %+v", err, ops)
	}
	_, err = c.ListRoles(bg, &iam.ListRolesInput{MaxItems: aws.Int32(0)})
	wantErr(t, err, "ValidationError", 400)
	_, err = c.ListRoles(bg, &iam.ListRolesInput{Marker: aws.String("garbage!")})
	wantErr(t, err, "InvalidInput", 400)
}

func TestRolePolicies(t *testing.T) {
	s, c := newIAM(t)
	if _, err := c.CreateRole(bg, &iam.CreateRoleInput{RoleName: aws.String("r"), AssumeRolePolicyDocument: aws.String(trust)}); err != nil {
		t.Fatal(err)
	}
	readDoc := `{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Action":["ec2:Describe*","s3:GetObject","iam:List*"],"Resource":"*"}]}`
	if _, err := c.PutRolePolicy(bg, &iam.PutRolePolicyInput{RoleName: aws.String("r"), PolicyName: aws.String("read"), PolicyDocument: aws.String(readDoc)}); err != nil {
		t.Fatal(err)
	}
	got, err := c.GetRolePolicy(bg, &iam.GetRolePolicyInput{RoleName: aws.String("r"), PolicyName: aws.String("read")})
	if err != nil {
		t.Fatal(err)
	}
	if doc, _ := url.QueryUnescape(*got.PolicyDocument); doc != readDoc {
		t.Fatalf("document comes back as %q", *got.PolicyDocument)
	}
	if !roleReadOnly(t, s, "r") {
		t.Fatal("a role whose only policy allows Describe*/Get*/List* is not read-only")
	}

	for _, tc := range []struct {
		name, doc string
		code      string
	}{
		{"principal in identity policy", `{"Statement":{"Effect":"Allow","Principal":"*","Action":"ec2:*","Resource":"*"}}`, "MalformedPolicyDocument"},
		{"no resource", `{"Statement":{"Effect":"Allow","Action":"ec2:*"}}`, "MalformedPolicyDocument"},
		{"no vendor", `{"Statement":{"Effect":"Allow","Action":"DescribeVpcs","Resource":"*"}}`, "MalformedPolicyDocument"},
		{"too big", `{"Statement":{"Effect":"Allow","Action":"ec2:Describe*","Resource":"*","Sid":"` + strings.Repeat("x", 10300) + `"}}`, "LimitExceeded"},
	} {
		_, err := c.PutRolePolicy(bg, &iam.PutRolePolicyInput{RoleName: aws.String("r"), PolicyName: aws.String("bad"), PolicyDocument: aws.String(tc.doc)})
		if code, _ := apiError(t, err); code != tc.code {
			t.Errorf("%s: %v, want %s", tc.name, err, tc.code)
		}
	}
	_, err = c.PutRolePolicy(bg, &iam.PutRolePolicyInput{RoleName: aws.String("nope"), PolicyName: aws.String("p"), PolicyDocument: aws.String(readDoc)})
	wantErr(t, err, "NoSuchEntity", 404)
	_, err = c.GetRolePolicy(bg, &iam.GetRolePolicyInput{RoleName: aws.String("r"), PolicyName: aws.String("nope")})
	wantErr(t, err, "NoSuchEntity", 404)

	// One writing statement makes the role fully capable.
	write := `{"Statement":[{"Effect":"Allow","Action":"ec2:CreateVpc","Resource":"*"}]}`
	if _, err := c.PutRolePolicy(bg, &iam.PutRolePolicyInput{RoleName: aws.String("r"), PolicyName: aws.String("write"), PolicyDocument: aws.String(write)}); err != nil {
		t.Fatal(err)
	}
	if roleReadOnly(t, s, "r") {
		t.Fatal("a role allowed ec2:CreateVpc is read-only")
	}
	names, err := c.ListRolePolicies(bg, &iam.ListRolePoliciesInput{RoleName: aws.String("r")})
	if err != nil || strings.Join(names.PolicyNames, ",") != "read,write" {
		t.Fatalf("ListRolePolicies: %v %+v", err, names)
	}
	if _, err := c.DeleteRolePolicy(bg, &iam.DeleteRolePolicyInput{RoleName: aws.String("r"), PolicyName: aws.String("write")}); err != nil {
		t.Fatal(err)
	}

	// Managed policies: AWS's read-only ones keep the role read-only.
	ro := "arn:aws:iam::aws:policy/ReadOnlyAccess"
	if _, err := c.AttachRolePolicy(bg, &iam.AttachRolePolicyInput{RoleName: aws.String("r"), PolicyArn: aws.String(ro)}); err != nil {
		t.Fatal(err)
	}
	if !roleReadOnly(t, s, "r") {
		t.Fatal("ReadOnlyAccess plus a read inline policy is not read-only")
	}
	admin := "arn:aws:iam::aws:policy/AdministratorAccess"
	if _, err := c.AttachRolePolicy(bg, &iam.AttachRolePolicyInput{RoleName: aws.String("r"), PolicyArn: aws.String(admin)}); err != nil {
		t.Fatal(err)
	}
	if roleReadOnly(t, s, "r") {
		t.Fatal("AdministratorAccess is read-only")
	}
	att, err := c.ListAttachedRolePolicies(bg, &iam.ListAttachedRolePoliciesInput{RoleName: aws.String("r")})
	if err != nil || len(att.AttachedPolicies) != 2 || *att.AttachedPolicies[1].PolicyName != "ReadOnlyAccess" {
		t.Fatalf("attached: %v %+v", err, att)
	}
	_, err = c.AttachRolePolicy(bg, &iam.AttachRolePolicyInput{RoleName: aws.String("r"), PolicyArn: aws.String("arn:aws:iam::aws:policy/NoSuchPolicy")})
	wantErr(t, err, "NoSuchEntity", 404)
	_, err = c.AttachRolePolicy(bg, &iam.AttachRolePolicyInput{RoleName: aws.String("r"), PolicyArn: aws.String("not-an-arn-at-all-really")})
	wantErr(t, err, "InvalidInput", 400)
	_, err = c.DetachRolePolicy(bg, &iam.DetachRolePolicyInput{RoleName: aws.String("r"), PolicyArn: aws.String("arn:aws:iam::aws:policy/PowerUserAccess")})
	wantErr(t, err, "NoSuchEntity", 404)

	// A role with policies cannot be deleted.
	_, err = c.DeleteRole(bg, &iam.DeleteRoleInput{RoleName: aws.String("r")})
	wantErr(t, err, "DeleteConflict", 409)
	for _, a := range []string{ro, admin} {
		if _, err := c.DetachRolePolicy(bg, &iam.DetachRolePolicyInput{RoleName: aws.String("r"), PolicyArn: aws.String(a)}); err != nil {
			t.Fatal(err)
		}
	}
	_, err = c.DeleteRole(bg, &iam.DeleteRoleInput{RoleName: aws.String("r")})
	wantErr(t, err, "DeleteConflict", 409) // the inline policy "read"
	if _, err := c.DeleteRolePolicy(bg, &iam.DeleteRolePolicyInput{RoleName: aws.String("r"), PolicyName: aws.String("read")}); err != nil {
		t.Fatal(err)
	}
	if roleReadOnly(t, s, "r") {
		t.Fatal("a role without policies is read-only; hangar's rule gives it full access")
	}
	if _, err := c.DeleteRole(bg, &iam.DeleteRoleInput{RoleName: aws.String("r")}); err != nil {
		t.Fatal(err)
	}
}

func roleReadOnly(t *testing.T, s *Service, name string) bool {
	t.Helper()
	var info RoleInfo
	err := s.db.View(func(tx *store.Tx) (err error) { info, err = s.Role(tx, name); return err })
	if err != nil {
		t.Fatal(err)
	}
	return info.ReadOnly
}

func TestReadAction(t *testing.T) {
	for a, want := range map[string]bool{
		"ec2:DescribeVpcs": true, "ec2:Describe*": true, "s3:getobject": true, "iam:List*": true, "ec2:Get?": true,
		"*": false, "ec2:*": false, "ec2:D*": false, "ec2:Des*": false, "ec2:CreateVpc": false, "iam:PassRole": false,
	} {
		if got := readAction(a); got != want {
			t.Errorf("readAction(%q) = %v, want %v", a, got, want)
		}
	}
	for doc, want := range map[string]bool{
		`{"Statement":{"Effect":"Allow","Action":"ec2:Describe*","Resource":"*"}}`:                                            true,
		`{"Statement":[{"Effect":"Deny","Action":"*","Resource":"*"},{"Effect":"Allow","Action":"ec2:Get*","Resource":"*"}]}`: true,
		`{"Statement":{"Effect":"Allow","NotAction":"ec2:TerminateInstances","Resource":"*"}}`:                                false,
		`{"Statement":{"Effect":"Allow","Action":["ec2:DescribeVpcs","ec2:RunInstances"],"Resource":"*"}}`:                    false,
	} {
		got, err := PolicyGrantsOnlyRead(doc)
		if err != nil || got != want {
			t.Errorf("PolicyGrantsOnlyRead(%s) = %v, %v; want %v", doc, got, err, want)
		}
	}
}

func TestInstanceProfiles(t *testing.T) {
	s, c := newIAM(t)
	for _, n := range []string{"web", "db"} {
		if _, err := c.CreateRole(bg, &iam.CreateRoleInput{RoleName: aws.String(n), AssumeRolePolicyDocument: aws.String(trust)}); err != nil {
			t.Fatal(err)
		}
	}
	out, err := c.CreateInstanceProfile(bg, &iam.CreateInstanceProfileInput{InstanceProfileName: aws.String("web-profile"), Path: aws.String("/svc/")})
	if err != nil {
		t.Fatal(err)
	}
	p := out.InstanceProfile
	if *p.Arn != "arn:aws:iam::"+testAccount+":instance-profile/svc/web-profile" || !strings.HasPrefix(*p.InstanceProfileId, "AIPA") || len(*p.InstanceProfileId) != 21 || len(p.Roles) != 0 {
		t.Fatalf("profile %+v", p)
	}
	_, err = c.CreateInstanceProfile(bg, &iam.CreateInstanceProfileInput{InstanceProfileName: aws.String("Web-Profile")})
	wantErr(t, err, "EntityAlreadyExists", 409)

	if _, err := c.AddRoleToInstanceProfile(bg, &iam.AddRoleToInstanceProfileInput{InstanceProfileName: aws.String("web-profile"), RoleName: aws.String("web")}); err != nil {
		t.Fatal(err)
	}
	_, err = c.AddRoleToInstanceProfile(bg, &iam.AddRoleToInstanceProfileInput{InstanceProfileName: aws.String("web-profile"), RoleName: aws.String("db")})
	wantErr(t, err, "LimitExceeded", 409)
	_, err = c.AddRoleToInstanceProfile(bg, &iam.AddRoleToInstanceProfileInput{InstanceProfileName: aws.String("nope"), RoleName: aws.String("db")})
	wantErr(t, err, "NoSuchEntity", 404)

	got, err := c.GetInstanceProfile(bg, &iam.GetInstanceProfileInput{InstanceProfileName: aws.String("web-profile")})
	if err != nil || len(got.InstanceProfile.Roles) != 1 || *got.InstanceProfile.Roles[0].RoleName != "web" {
		t.Fatalf("GetInstanceProfile: %v %+v", err, got)
	}
	forRole, err := c.ListInstanceProfilesForRole(bg, &iam.ListInstanceProfilesForRoleInput{RoleName: aws.String("web")})
	if err != nil || len(forRole.InstanceProfiles) != 1 {
		t.Fatalf("ListInstanceProfilesForRole: %v %+v", err, forRole)
	}
	none, err := c.ListInstanceProfilesForRole(bg, &iam.ListInstanceProfilesForRoleInput{RoleName: aws.String("db")})
	if err != nil || len(none.InstanceProfiles) != 0 {
		t.Fatalf("profiles of db: %v %+v", err, none)
	}
	_, err = c.ListInstanceProfilesForRole(bg, &iam.ListInstanceProfilesForRoleInput{RoleName: aws.String("nope")})
	wantErr(t, err, "NoSuchEntity", 404)
	all, err := c.ListInstanceProfiles(bg, &iam.ListInstanceProfilesInput{PathPrefix: aws.String("/svc/")})
	if err != nil || len(all.InstanceProfiles) != 1 {
		t.Fatalf("ListInstanceProfiles: %v %+v", err, all)
	}

	// EC2 finds it by name or ARN; a wrong path in the ARN is no profile.
	err = s.db.View(func(tx *store.Tx) error {
		info, err := s.InstanceProfile(tx, "", "WEB-PROFILE")
		if err != nil || info.RoleName != "web" || info.ARN != *p.Arn || info.ID != *p.InstanceProfileId {
			t.Errorf("by name: %+v %v", info, err)
		}
		if _, err := s.InstanceProfile(tx, *p.Arn, ""); err != nil {
			t.Errorf("by ARN: %v", err)
		}
		for _, bad := range []string{"arn:aws:iam::" + testAccount + ":instance-profile/web-profile", "arn:aws:iam::999999999999:instance-profile/svc/web-profile"} {
			if _, err := s.InstanceProfile(tx, bad, ""); !errors.Is(err, ErrNotFound) {
				t.Errorf("ARN %s: %v, want ErrNotFound", bad, err)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}

	_, err = c.DeleteRole(bg, &iam.DeleteRoleInput{RoleName: aws.String("web")})
	wantErr(t, err, "DeleteConflict", 409)
	_, err = c.DeleteInstanceProfile(bg, &iam.DeleteInstanceProfileInput{InstanceProfileName: aws.String("web-profile")})
	wantErr(t, err, "DeleteConflict", 409)
	_, err = c.RemoveRoleFromInstanceProfile(bg, &iam.RemoveRoleFromInstanceProfileInput{InstanceProfileName: aws.String("web-profile"), RoleName: aws.String("db")})
	wantErr(t, err, "NoSuchEntity", 404)
	if _, err := c.RemoveRoleFromInstanceProfile(bg, &iam.RemoveRoleFromInstanceProfileInput{InstanceProfileName: aws.String("web-profile"), RoleName: aws.String("web")}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.DeleteInstanceProfile(bg, &iam.DeleteInstanceProfileInput{InstanceProfileName: aws.String("web-profile")}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.DeleteRole(bg, &iam.DeleteRoleInput{RoleName: aws.String("web")}); err != nil {
		t.Fatal(err)
	}
	_, err = c.GetInstanceProfile(bg, &iam.GetInstanceProfileInput{InstanceProfileName: aws.String("web-profile")})
	wantErr(t, err, "NoSuchEntity", 404)
}
