package iam

import (
	"encoding/json"
	"testing"
)

// FuzzParsePolicy feeds policy documents (user input that decides whether
// credentials are read-only) to the parser: it must never panic, accept
// only JSON, and call read-only only what allows nothing but reads.
func FuzzParsePolicy(f *testing.F) {
	for _, seed := range []string{
		`{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Action":"ec2:Describe*","Resource":"*"}]}`,
		`{"Statement":{"Effect":"Allow","NotAction":"ec2:Get*","Resource":"*"}}`,
		`{"Statement":[{"Effect":"Deny","Action":["*"],"Resource":"*"},{"Effect":"Allow","Action":["s3:List*","ec2:D*"],"Resource":"*"}]}`,
		`{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Principal":{"Service":"ec2.amazonaws.com"},"Action":"sts:AssumeRole"}]}`,
		`{"Statement":[]}`, `[]`, `{`, ``,
	} {
		f.Add(seed, false)
		f.Add(seed, true)
	}
	f.Fuzz(func(t *testing.T, doc string, trust bool) {
		kind := permissionPolicy
		if trust {
			kind = trustPolicy
		}
		sts, err := parsePolicy(doc, kind)
		if err != nil {
			return
		}
		if !json.Valid([]byte(doc)) {
			t.Fatalf("accepted a document that is not JSON: %q", doc)
		}
		if !grantsOnlyRead(sts) {
			return
		}
		for _, s := range sts {
			if s.Effect != "Allow" {
				continue
			}
			if s.NotAction {
				t.Fatalf("read-only with an Allow NotAction: %q", doc)
			}
			for _, a := range s.Actions {
				if !readAction(a) {
					t.Fatalf("read-only while allowing %q: %q", a, doc)
				}
			}
		}
	})
}
