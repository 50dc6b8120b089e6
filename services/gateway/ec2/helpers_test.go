package ec2

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"path/filepath"
	"reflect"
	"testing"

	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"

	"hangar.dev/hangar/services/gateway/awserr"
	"hangar.dev/hangar/services/gateway/awsmodel"
	"hangar.dev/hangar/services/gateway/awsproto"
	"hangar.dev/hangar/services/internal/hostconf"
	"hangar.dev/hangar/services/internal/store"
)

const testAccount = "123456789012"

var bg = context.Background()

// newSvc is a Service over a fresh state file, initialised as on a new
// host (default VPC, subnet, security group, gateway).
func newSvc(t *testing.T) *Service {
	t.Helper()
	db, err := store.Open(filepath.Join(t.TempDir(), "state.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	cfg := hostconf.Defaults()
	cfg.AccountID = testAccount
	s := New(db, cfg, slog.New(slog.DiscardHandler))
	if err := s.Init(bg); err != nil {
		t.Fatal(err)
	}
	return s
}

// code returns the AWS error code of err ("" for nil).
func code(err error) string {
	if err == nil {
		return ""
	}
	var e *awserr.Error
	if errors.As(err, &e) {
		return e.Code
	}
	return "non-AWS error: " + err.Error()
}

func wantCode(t *testing.T, err error, want string) {
	t.Helper()
	if got := code(err); got != want {
		t.Fatalf("error = %v (code %q), want code %q", err, got, want)
	}
}

func must[T any](t *testing.T) func(v T, err error) T {
	return func(v T, err error) T {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
}

// snapshot is every record in the state file, for "a failed request
// changes nothing" checks.
func snapshot(t *testing.T, s *Service) map[string]map[string]string {
	t.Helper()
	out := map[string]map[string]string{}
	err := s.db.View(func(tx *store.Tx) error {
		for _, k := range tx.Kinds() {
			if k == bucketTokens {
				continue
			}
			m := map[string]string{}
			if err := tx.Each(k, "", func(id string, decode func(any) error) (bool, error) {
				var raw json.RawMessage
				if err := decode(&raw); err != nil {
					return false, err
				}
				m[id] = string(raw)
				return true, nil
			}); err != nil {
				return err
			}
			out[k] = m
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func sameState(t *testing.T, before, after map[string]map[string]string, what string) {
	t.Helper()
	if !reflect.DeepEqual(before, after) {
		for k, m := range after {
			for id, v := range m {
				if before[k][id] != v {
					t.Errorf("%s changed %s/%s: %s", what, k, id, v)
				}
			}
		}
		for k, m := range before {
			for id := range m {
				if _, ok := after[k][id]; !ok {
					t.Errorf("%s removed %s/%s", what, k, id)
				}
			}
		}
		t.Fatalf("%s changed the state", what)
	}
}

// encodes checks that an output goes through the EC2 XML encoder, as the
// server would send it.
func encodes(t *testing.T, op string, out any) {
	t.Helper()
	if _, err := awsproto.EncodeXML(awsmodel.MustLoad("ec2"), op, "req-1", out); err != nil {
		t.Fatalf("encoding %s output: %v", op, err)
	}
}

func tagSpec(rt types.ResourceType, kv ...string) []types.TagSpecification {
	var tags []types.Tag
	for i := 0; i+1 < len(kv); i += 2 {
		tags = append(tags, types.Tag{Key: ptr(kv[i]), Value: ptr(kv[i+1])})
	}
	return []types.TagSpecification{{ResourceType: rt, Tags: tags}}
}

func filter(name string, values ...string) types.Filter {
	return types.Filter{Name: ptr(name), Values: values}
}

func mkVPC(t *testing.T, s *Service, cidr string) string {
	t.Helper()
	out, err := s.CreateVpc(bg, &ec2.CreateVpcInput{CidrBlock: ptr(cidr)})
	if err != nil {
		t.Fatal(err)
	}
	return *out.Vpc.VpcId
}

func mkSubnet(t *testing.T, s *Service, vpc, cidr string) string {
	t.Helper()
	out, err := s.CreateSubnet(bg, &ec2.CreateSubnetInput{VpcId: ptr(vpc), CidrBlock: ptr(cidr)})
	if err != nil {
		t.Fatal(err)
	}
	return *out.Subnet.SubnetId
}

func mkSG(t *testing.T, s *Service, vpc, name string) string {
	t.Helper()
	out, err := s.CreateSecurityGroup(bg, &ec2.CreateSecurityGroupInput{VpcId: ptr(vpc), GroupName: ptr(name), Description: ptr("test group " + name)})
	if err != nil {
		t.Fatal(err)
	}
	return *out.GroupId
}

func mkIGW(t *testing.T, s *Service) string {
	t.Helper()
	out, err := s.CreateInternetGateway(bg, &ec2.CreateInternetGatewayInput{})
	if err != nil {
		t.Fatal(err)
	}
	return *out.InternetGateway.InternetGatewayId
}

func mkRTB(t *testing.T, s *Service, vpc string) string {
	t.Helper()
	out, err := s.CreateRouteTable(bg, &ec2.CreateRouteTableInput{VpcId: ptr(vpc)})
	if err != nil {
		t.Fatal(err)
	}
	return *out.RouteTable.RouteTableId
}

// pageAll walks a Describe call's pages and returns every id in order,
// failing on a repeated id.
func pageAll(t *testing.T, page func(token *string) ([]string, *string, error)) ([]string, int) {
	t.Helper()
	var (
		ids   []string
		tok   *string
		pages int
		seen  = map[string]bool{}
	)
	for {
		got, next, err := page(tok)
		if err != nil {
			t.Fatal(err)
		}
		pages++
		for _, id := range got {
			if seen[id] {
				t.Fatalf("page %d repeats %s", pages, id)
			}
			seen[id] = true
		}
		ids = append(ids, got...)
		if next == nil {
			return ids, pages
		}
		tok = next
		if pages > 1000 {
			t.Fatal("pagination does not end")
		}
	}
}
