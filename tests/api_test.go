// Package tests drives a whole hangar host, started with `hangar dev`, the
// way its users do: the real aws CLI and aws-sdk-go-v2.
package tests

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/aws/aws-sdk-go-v2/service/sts"

	"hangar.dev/hangar/tests/harness"
)

func TestCLICallerIdentityAndRegion(t *testing.T) {
	d := harness.StartDev(t, harness.Options{})
	var id struct{ Account, Arn, UserId string }
	if err := json.Unmarshal([]byte(d.MustAWS("sts", "get-caller-identity")), &id); err != nil {
		t.Fatal(err)
	}
	if len(id.Account) != 12 || id.Arn != "arn:aws:iam::"+id.Account+":root" {
		t.Fatalf("get-caller-identity = %+v", id)
	}
	out := d.MustAWS("ec2", "describe-availability-zones", "--query", "AvailabilityZones[].ZoneName", "--output", "text")
	if strings.TrimSpace(out) != "us-east-1a" {
		t.Fatalf("zones = %q", out)
	}

	// The SDK agrees.
	res, err := sts.NewFromConfig(d.SDK()).GetCallerIdentity(context.Background(), &sts.GetCallerIdentityInput{})
	if err != nil {
		t.Fatal(err)
	}
	if *res.Account != id.Account {
		t.Fatalf("SDK account %s, CLI %s", *res.Account, id.Account)
	}
}
