package ec2

import (
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"
	iamsdk "github.com/aws/aws-sdk-go-v2/service/iam"

	"hangar.dev/hangar/services/gateway/iam"
	"hangar.dev/hangar/services/gateway/sts"
	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/internal/store"
)

// profileHost is an instance host (fake netd, ebsd, vmd) with the real
// IAM and STS on the same state file, two roles (web, db) each in a
// profile of the same name, and EC2's clock under the test's control.
type profileHost struct {
	*instanceHost
	iam *iam.Service
	sts *sts.Service

	mu     sync.Mutex
	offset time.Duration
}

const ec2Trust = `{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Principal":{"Service":"ec2.amazonaws.com"},"Action":"sts:AssumeRole"}]}`

func newProfileHost(t *testing.T) *profileHost {
	t.Helper()
	h := &profileHost{instanceHost: newInstanceHost(t, 8)}
	log := slog.New(slog.DiscardHandler)
	h.iam = iam.New(h.s.db, testAccount, log)
	h.sts = sts.New(h.iam, log)
	signer, err := LoadIdentitySigner(t.TempDir(), testAccount)
	if err != nil {
		t.Fatal(err)
	}
	h.s.SetIdentity(h.sts, signer)
	h.s.now = func() time.Time {
		h.mu.Lock()
		defer h.mu.Unlock()
		return time.Now().Add(h.offset)
	}
	for _, n := range []string{"web", "db"} {
		must[*iamsdk.CreateRoleOutput](t)(h.iam.CreateRole(bg, &iamsdk.CreateRoleInput{RoleName: ptr(n), AssumeRolePolicyDocument: ptr(ec2Trust)}))
		must[*iamsdk.CreateInstanceProfileOutput](t)(h.iam.CreateInstanceProfile(bg, &iamsdk.CreateInstanceProfileInput{InstanceProfileName: ptr(n)}))
		must[*iamsdk.AddRoleToInstanceProfileOutput](t)(h.iam.AddRoleToInstanceProfile(bg, &iamsdk.AddRoleToInstanceProfileInput{InstanceProfileName: ptr(n), RoleName: ptr(n)}))
	}
	return h
}

func (h *profileHost) setOffset(d time.Duration) {
	h.mu.Lock()
	h.offset = d
	h.mu.Unlock()
}

// served is what IMDS would serve the instance: the metadata EC2 builds,
// with the identity filled in as instances.go's metadata() does.
func (h *profileHost) served(t *testing.T, id string) api.InstanceMetadata {
	t.Helper()
	var md api.InstanceMetadata
	err := h.s.db.View(func(tx *store.Tx) error {
		parts, err := readInstance(tx, id)
		if err != nil {
			return err
		}
		md = h.s.metadata(tx, parts)
		h.s.instanceIdentity(tx, parts, &md)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return md
}

// callerOf is who the gateway's verifier takes an IMDS key for.
func (h *profileHost) callerOf(t *testing.T, c api.IAMCredentials) string {
	t.Helper()
	caller, exp, ok := h.sts.LookupTemporary(c.AccessKeyID)
	if !ok || caller.Key.SecretAccessKey != c.SecretAccessKey || caller.Key.SessionToken != c.Token || exp.Unix() != c.Expiration {
		t.Fatalf("the gateway does not know the IMDS key %s as served", c.AccessKeyID)
	}
	return caller.ARN
}

// pushes empties the fake netd's metadata and returns a function that
// reports whether the instance's was pushed since.
func (h *profileHost) pushes() func() bool {
	h.net.mu.Lock()
	for k := range h.net.md {
		delete(h.net.md, k)
	}
	h.net.mu.Unlock()
	return func() bool {
		h.net.mu.Lock()
		defer h.net.mu.Unlock()
		return len(h.net.md) == 1
	}
}

func TestAssociateIamInstanceProfile(t *testing.T) {
	h := newProfileHost(t)
	id := *h.run(t, &ec2.RunInstancesInput{}).Instances[0].InstanceId
	if md := h.served(t, id); md.IAMRole != "" {
		t.Fatalf("an instance without a profile is served role %q", md.IAMRole)
	}

	_, err := h.s.AssociateIamInstanceProfile(bg, &ec2.AssociateIamInstanceProfileInput{InstanceId: ptr(id), IamInstanceProfile: &types.IamInstanceProfileSpecification{Name: ptr("nope")}})
	wantCode(t, err, "InvalidParameterValue")
	if !strings.Contains(err.Error(), "Value (nope) for parameter iamInstanceProfile.name is invalid. Invalid IAM Instance Profile name") {
		t.Fatalf("message: %v", err)
	}
	_, err = h.s.AssociateIamInstanceProfile(bg, &ec2.AssociateIamInstanceProfileInput{InstanceId: ptr("i-0123456789abcdef0"), IamInstanceProfile: &types.IamInstanceProfileSpecification{Name: ptr("web")}})
	wantCode(t, err, "InvalidInstanceID.NotFound")

	pushed := h.pushes()
	out := must[*ec2.AssociateIamInstanceProfileOutput](t)(h.s.AssociateIamInstanceProfile(bg, &ec2.AssociateIamInstanceProfileInput{
		InstanceId: ptr(id), IamInstanceProfile: &types.IamInstanceProfileSpecification{Name: ptr("web")}}))
	a := out.IamInstanceProfileAssociation
	if !strings.HasPrefix(*a.AssociationId, "iip-assoc-") || a.State != types.IamInstanceProfileAssociationStateAssociating ||
		*a.IamInstanceProfile.Arn != "arn:aws:iam::"+testAccount+":instance-profile/web" || !strings.HasPrefix(*a.IamInstanceProfile.Id, "AIPA") {
		t.Fatalf("association %+v %+v", a, a.IamInstanceProfile)
	}
	if !pushed() {
		t.Error("the instance's metadata was not pushed to netd after the association")
	}
	if v := h.describe(t, id); v.IamInstanceProfile == nil || *v.IamInstanceProfile.Arn != *a.IamInstanceProfile.Arn {
		t.Fatalf("DescribeInstances shows profile %+v", v.IamInstanceProfile)
	}
	md := h.served(t, id)
	if md.IAMRole != "web" || md.IAMProfileArn != *a.IamInstanceProfile.Arn || md.IAMProfileID != *a.IamInstanceProfile.Id {
		t.Fatalf("IMDS role %q profile %s %s", md.IAMRole, md.IAMProfileArn, md.IAMProfileID)
	}
	if d := time.Until(time.Unix(md.Credentials.Expiration, 0)); d < roleCredentialLifetime-time.Minute || d > roleCredentialLifetime {
		t.Fatalf("IMDS credentials last %v", d)
	}
	if arn := h.callerOf(t, md.Credentials); arn != "arn:aws:sts::"+testAccount+":assumed-role/web/"+id {
		t.Fatalf("IMDS credentials act as %s", arn)
	}

	_, err = h.s.AssociateIamInstanceProfile(bg, &ec2.AssociateIamInstanceProfileInput{InstanceId: ptr(id), IamInstanceProfile: &types.IamInstanceProfileSpecification{Name: ptr("db")}})
	wantCode(t, err, "IncorrectState")

	desc := must[*ec2.DescribeIamInstanceProfileAssociationsOutput](t)(h.s.DescribeIamInstanceProfileAssociations(bg, &ec2.DescribeIamInstanceProfileAssociationsInput{
		Filters: []types.Filter{{Name: ptr("instance-id"), Values: []string{id}}, {Name: ptr("state"), Values: []string{"associated"}}}}))
	if len(desc.IamInstanceProfileAssociations) != 1 || *desc.IamInstanceProfileAssociations[0].AssociationId != *a.AssociationId {
		t.Fatalf("describe by instance: %+v", desc.IamInstanceProfileAssociations)
	}
	_, err = h.s.DescribeIamInstanceProfileAssociations(bg, &ec2.DescribeIamInstanceProfileAssociationsInput{Filters: []types.Filter{{Name: ptr("role"), Values: []string{"x"}}}})
	wantCode(t, err, "InvalidParameterValue")

	// Replace: a new association with the other profile, at once.
	rep := must[*ec2.ReplaceIamInstanceProfileAssociationOutput](t)(h.s.ReplaceIamInstanceProfileAssociation(bg, &ec2.ReplaceIamInstanceProfileAssociationInput{
		AssociationId: a.AssociationId, IamInstanceProfile: &types.IamInstanceProfileSpecification{Arn: ptr("arn:aws:iam::" + testAccount + ":instance-profile/db")}}))
	b := rep.IamInstanceProfileAssociation
	if *b.AssociationId == *a.AssociationId || *b.InstanceId != id {
		t.Fatalf("replacement %+v", b)
	}
	_, err = h.s.DescribeIamInstanceProfileAssociations(bg, &ec2.DescribeIamInstanceProfileAssociationsInput{AssociationIds: []string{*a.AssociationId}})
	wantCode(t, err, "InvalidAssociationID.NotFound")
	if md := h.served(t, id); md.IAMRole != "db" || h.callerOf(t, md.Credentials) != "arn:aws:sts::"+testAccount+":assumed-role/db/"+id {
		t.Fatalf("after replace IMDS serves role %q", md.IAMRole)
	}
	_, err = h.s.ReplaceIamInstanceProfileAssociation(bg, &ec2.ReplaceIamInstanceProfileAssociationInput{
		AssociationId: b.AssociationId, IamInstanceProfile: &types.IamInstanceProfileSpecification{Arn: ptr("arn:aws:iam::" + testAccount + ":instance-profile/x/db")}})
	wantCode(t, err, "InvalidParameterValue")

	pushed = h.pushes()
	must[*ec2.DisassociateIamInstanceProfileOutput](t)(h.s.DisassociateIamInstanceProfile(bg, &ec2.DisassociateIamInstanceProfileInput{AssociationId: b.AssociationId}))
	if !pushed() {
		t.Error("the instance's metadata was not pushed to netd after disassociating")
	}
	if md := h.served(t, id); md.IAMRole != "" || md.Credentials.AccessKeyID != "" {
		t.Fatalf("after disassociating IMDS serves role %q", md.IAMRole)
	}
	if v := h.describe(t, id); v.IamInstanceProfile != nil {
		t.Fatalf("DescribeInstances still shows %+v", v.IamInstanceProfile)
	}
	_, err = h.s.DisassociateIamInstanceProfile(bg, &ec2.DisassociateIamInstanceProfileInput{AssociationId: b.AssociationId})
	wantCode(t, err, "InvalidAssociationID.NotFound")
	_, err = h.s.DisassociateIamInstanceProfile(bg, &ec2.DisassociateIamInstanceProfileInput{AssociationId: ptr("assoc-1")})
	wantCode(t, err, "InvalidAssociationID.Malformed")
	all := must[*ec2.DescribeIamInstanceProfileAssociationsOutput](t)(h.s.DescribeIamInstanceProfileAssociations(bg, &ec2.DescribeIamInstanceProfileAssociationsInput{}))
	if len(all.IamInstanceProfileAssociations) != 0 {
		t.Fatalf("associations left: %+v", all.IamInstanceProfileAssociations)
	}
}

func TestLaunchProfile(t *testing.T) {
	h := newProfileHost(t)
	launch := func(id string, spec *types.IamInstanceProfileSpecification) (*types.IamInstanceProfile, error) {
		var out *types.IamInstanceProfile
		err := h.s.db.Update(func(tx *store.Tx) (err error) { out, err = h.s.launchProfile(tx, id, spec); return err })
		return out, err
	}
	before := snapshot(t, h.s)
	for _, tc := range []struct {
		spec *types.IamInstanceProfileSpecification
		code string
		msg  string
	}{
		{&types.IamInstanceProfileSpecification{Name: ptr("missing")}, "InvalidParameterValue", "Value (missing) for parameter iamInstanceProfile.name is invalid. Invalid IAM Instance Profile name"},
		{&types.IamInstanceProfileSpecification{Arn: ptr("arn:aws:iam::999999999999:instance-profile/web")}, "InvalidParameterValue", "Invalid IAM Instance Profile ARN"},
		{&types.IamInstanceProfileSpecification{Arn: ptr("arn:aws:iam::" + testAccount + ":instance-profile/web"), Name: ptr("web")}, "InvalidParameterCombination", ""},
		{&types.IamInstanceProfileSpecification{}, "MissingParameter", ""},
	} {
		_, err := launch("i-0aaaaaaaaaaaaaaaa", tc.spec)
		wantCode(t, err, tc.code)
		if !strings.Contains(err.Error(), tc.msg) {
			t.Errorf("message %v, want %q", err, tc.msg)
		}
	}
	sameState(t, before, snapshot(t, h.s), "refused launch profiles")
	if p, err := launch("i-0aaaaaaaaaaaaaaaa", nil); p != nil || err != nil {
		t.Fatalf("no profile: %+v %v", p, err)
	}

	// What the lead's RunInstances does with a profile, for a real
	// instance: its record carries the profile, IMDS its credentials.
	id := *h.run(t, &ec2.RunInstancesInput{}).Instances[0].InstanceId
	err := h.s.db.Update(func(tx *store.Tx) error {
		rec, err := get[instanceRecord](tx, kindInstance, id)
		if err != nil {
			return err
		}
		if rec.IamInstanceProfile, err = h.s.launchProfile(tx, id, &types.IamInstanceProfileSpecification{Name: ptr("WEB")}); err != nil {
			return err
		}
		return put(tx, kindInstance, id, rec)
	})
	if err != nil {
		t.Fatal(err)
	}
	if v := h.describe(t, id); v.IamInstanceProfile == nil || !strings.HasSuffix(*v.IamInstanceProfile.Arn, ":instance-profile/web") {
		t.Fatalf("launched instance shows profile %+v", v.IamInstanceProfile)
	}
	if md := h.served(t, id); md.IAMRole != "web" || h.callerOf(t, md.Credentials) != "arn:aws:sts::"+testAccount+":assumed-role/web/"+id {
		t.Fatalf("launched instance is served role %q", md.IAMRole)
	}

	// A launch that failed after its profile was recorded leaves an
	// association of an instance that never existed; the refresh drops it.
	if _, err := launch("i-0bbbbbbbbbbbbbbbb", &types.IamInstanceProfileSpecification{Name: ptr("db")}); err != nil {
		t.Fatal(err)
	}
	if err := h.s.refreshRoleCredentials(bg); err != nil {
		t.Fatal(err)
	}
	all := must[*ec2.DescribeIamInstanceProfileAssociationsOutput](t)(h.s.DescribeIamInstanceProfileAssociations(bg, &ec2.DescribeIamInstanceProfileAssociationsInput{}))
	if len(all.IamInstanceProfileAssociations) != 1 || *all.IamInstanceProfileAssociations[0].InstanceId != id {
		t.Fatalf("associations after refresh: %+v", all.IamInstanceProfileAssociations)
	}
}

func TestRoleCredentialRefresh(t *testing.T) {
	h := newProfileHost(t)
	id := *h.run(t, &ec2.RunInstancesInput{}).Instances[0].InstanceId
	must[*ec2.AssociateIamInstanceProfileOutput](t)(h.s.AssociateIamInstanceProfile(bg, &ec2.AssociateIamInstanceProfileInput{
		InstanceId: ptr(id), IamInstanceProfile: &types.IamInstanceProfileSpecification{Name: ptr("web")}}))
	first := h.served(t, id).Credentials

	// Fresh credentials are left alone.
	pushed := h.pushes()
	if err := h.s.refreshRoleCredentials(bg); err != nil {
		t.Fatal(err)
	}
	if h.served(t, id).Credentials != first || pushed() {
		t.Fatal("fresh credentials were replaced")
	}
	// With less than an hour left they are replaced and pushed; the old
	// ones stay valid until they expire, as EC2's do.
	h.setOffset(roleCredentialLifetime - roleCredentialRefresh + time.Minute)
	if err := h.s.refreshRoleCredentials(bg); err != nil {
		t.Fatal(err)
	}
	second := h.served(t, id).Credentials
	if second.AccessKeyID == first.AccessKeyID || !pushed() {
		t.Fatalf("credentials near expiry were not replaced and pushed")
	}
	if h.callerOf(t, second) != h.callerOf(t, first) {
		t.Fatal("the new credentials act as someone else")
	}

	// The profile's role changes: IMDS follows.
	pushed = h.pushes()
	must[*iamsdk.RemoveRoleFromInstanceProfileOutput](t)(h.iam.RemoveRoleFromInstanceProfile(bg, &iamsdk.RemoveRoleFromInstanceProfileInput{InstanceProfileName: ptr("web"), RoleName: ptr("web")}))
	if err := h.s.refreshRoleCredentials(bg); err != nil {
		t.Fatal(err)
	}
	if md := h.served(t, id); md.IAMRole != "" || !pushed() {
		t.Fatalf("profile without a role: IMDS serves role %q", md.IAMRole)
	}
	must[*iamsdk.AddRoleToInstanceProfileOutput](t)(h.iam.AddRoleToInstanceProfile(bg, &iamsdk.AddRoleToInstanceProfileInput{InstanceProfileName: ptr("web"), RoleName: ptr("db")}))
	if err := h.s.refreshRoleCredentials(bg); err != nil {
		t.Fatal(err)
	}
	if md := h.served(t, id); md.IAMRole != "db" || h.callerOf(t, md.Credentials) != "arn:aws:sts::"+testAccount+":assumed-role/db/"+id {
		t.Fatalf("profile given role db: IMDS serves role %q", md.IAMRole)
	}
	// The profile is deleted: the association stays, with no credentials.
	must[*iamsdk.RemoveRoleFromInstanceProfileOutput](t)(h.iam.RemoveRoleFromInstanceProfile(bg, &iamsdk.RemoveRoleFromInstanceProfileInput{InstanceProfileName: ptr("web"), RoleName: ptr("db")}))
	must[*iamsdk.DeleteInstanceProfileOutput](t)(h.iam.DeleteInstanceProfile(bg, &iamsdk.DeleteInstanceProfileInput{InstanceProfileName: ptr("web")}))
	if err := h.s.refreshRoleCredentials(bg); err != nil {
		t.Fatal(err)
	}
	if md := h.served(t, id); md.IAMRole != "" {
		t.Fatalf("deleted profile: IMDS serves role %q", md.IAMRole)
	}
}

func TestProfilesNeedIdentity(t *testing.T) {
	h := newInstanceHost(t, 8)
	id := *h.run(t, &ec2.RunInstancesInput{}).Instances[0].InstanceId
	_, err := h.s.AssociateIamInstanceProfile(bg, &ec2.AssociateIamInstanceProfileInput{InstanceId: ptr(id), IamInstanceProfile: &types.IamInstanceProfileSpecification{Name: ptr("web")}})
	wantCode(t, err, "Unsupported")
	if !strings.Contains(err.Error(), "without IAM") {
		t.Fatalf("message: %v", err)
	}
}

// TestRunInstancesWithProfile is RunInstances with --iam-instance-profile
// end to end through the fakes: the association, the instance record, and
// what netd is given to serve. It skips until instances.go calls
// launchProfile and instanceIdentity.
func TestRunInstancesWithProfile(t *testing.T) {
	h := newProfileHost(t)
	before := snapshot(t, h.s)
	_, err := h.s.RunInstances(bg, &ec2.RunInstancesInput{ImageId: ptr(h.image), MinCount: ptr(int32(1)), MaxCount: ptr(int32(1)),
		InstanceType: types.InstanceTypeT3Micro, IamInstanceProfile: &types.IamInstanceProfileSpecification{Name: ptr("missing")}})
	if code(err) == "Unsupported" {
		t.Skip("skipping: instances.go does not resolve --iam-instance-profile yet (launchProfile is not called)")
	}
	wantCode(t, err, "InvalidParameterValue")
	if !strings.Contains(err.Error(), "Value (missing) for parameter iamInstanceProfile.name is invalid. Invalid IAM Instance Profile name") {
		t.Fatalf("message: %v", err)
	}
	sameState(t, before, snapshot(t, h.s), "a launch with a missing profile")

	out := h.run(t, &ec2.RunInstancesInput{IamInstanceProfile: &types.IamInstanceProfileSpecification{Arn: ptr("arn:aws:iam::" + testAccount + ":instance-profile/web")}})
	inst := out.Instances[0]
	id := *inst.InstanceId
	if inst.IamInstanceProfile == nil || !strings.HasSuffix(*inst.IamInstanceProfile.Arn, ":instance-profile/web") {
		t.Fatalf("RunInstances shows profile %+v", inst.IamInstanceProfile)
	}
	assocs := must[*ec2.DescribeIamInstanceProfileAssociationsOutput](t)(h.s.DescribeIamInstanceProfileAssociations(bg, &ec2.DescribeIamInstanceProfileAssociationsInput{
		Filters: []types.Filter{{Name: ptr("instance-id"), Values: []string{id}}}}))
	if len(assocs.IamInstanceProfileAssociations) != 1 {
		t.Fatalf("associations of the launched instance: %+v", assocs.IamInstanceProfileAssociations)
	}
	eni := ""
	for _, ni := range inst.NetworkInterfaces {
		eni = deref(ni.NetworkInterfaceId)
	}
	h.net.mu.Lock()
	md, ok := h.net.md[eni]
	h.net.mu.Unlock()
	if !ok || md.IAMRole != "web" || md.IdentityDocument == "" || md.IdentitySignature == "" || md.IdentityPKCS7 == "" {
		t.Fatalf("netd was given role %q, document %d bytes (pushed: %v)", md.IAMRole, len(md.IdentityDocument), ok)
	}
	if arn := h.callerOf(t, md.Credentials); arn != "arn:aws:sts::"+testAccount+":assumed-role/web/"+id {
		t.Fatalf("IMDS credentials of the launched instance act as %s", arn)
	}
	if !strings.Contains(md.IdentityDocument, `"instanceId" : "`+id+`"`) {
		t.Fatalf("document %s", md.IdentityDocument)
	}
}
