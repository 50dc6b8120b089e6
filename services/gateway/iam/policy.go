package iam

import (
	"bytes"
	"encoding/json"
	"strings"
	"unicode"
)

// policyKind is what a document is for: IAM checks a role's trust policy
// (who may assume it) and its permission policies (what it may do)
// against different rules.
type policyKind int

const (
	permissionPolicy policyKind = iota
	trustPolicy
)

// statement is one element of a policy's Statement.
type statement struct {
	Effect    string
	Actions   []string
	NotAction bool // the actions are a NotAction list
}

// parsePolicy checks doc as IAM checks a policy's grammar (JSON, Version,
// Statement, Effect, Action/NotAction, Resource or Principal where each
// belongs, vendor-prefixed actions) and returns its statements. It does
// not and cannot say what the policy allows; see readOnly.
func parsePolicy(doc string, kind policyKind) ([]statement, error) {
	if strings.TrimSpace(doc) == "" {
		return nil, malformedPolicy("Syntax errors in policy.")
	}
	dec := json.NewDecoder(strings.NewReader(doc))
	dec.UseNumber()
	var top map[string]json.RawMessage
	if err := dec.Decode(&top); err != nil || dec.More() {
		return nil, malformedPolicy("This policy contains invalid Json")
	}
	for k := range top {
		switch k {
		case "Version", "Id", "Statement":
		default:
			return nil, malformedPolicy("Syntax errors in policy. Unknown field %s", k)
		}
	}
	if raw, ok := top["Version"]; ok {
		var v string
		if json.Unmarshal(raw, &v) != nil || (v != "2012-10-17" && v != "2008-10-17") {
			return nil, malformedPolicy("The policy failed legacy parsing")
		}
	}
	raw, ok := top["Statement"]
	if !ok {
		return nil, malformedPolicy("Syntax errors in policy.")
	}
	var list []map[string]json.RawMessage
	if t := bytes.TrimSpace(raw); len(t) > 0 && t[0] == '{' {
		var one map[string]json.RawMessage
		if json.Unmarshal(raw, &one) != nil {
			return nil, malformedPolicy("Syntax errors in policy.")
		}
		list = []map[string]json.RawMessage{one}
	} else if json.Unmarshal(raw, &list) != nil || len(list) == 0 {
		return nil, malformedPolicy("Syntax errors in policy.")
	}
	var out []statement
	for _, st := range list {
		for k := range st {
			switch k {
			case "Sid", "Effect", "Action", "NotAction", "Resource", "NotResource", "Principal", "NotPrincipal", "Condition":
			default:
				return nil, malformedPolicy("Syntax errors in policy. Unknown field %s", k)
			}
		}
		var s statement
		if json.Unmarshal(st["Effect"], &s.Effect) != nil || (s.Effect != "Allow" && s.Effect != "Deny") {
			return nil, malformedPolicy("Invalid effect: %s", strings.Trim(string(st["Effect"]), `"`))
		}
		actRaw, hasAction := st["Action"]
		notRaw, hasNot := st["NotAction"]
		switch {
		case hasAction == hasNot:
			return nil, malformedPolicy("Policy statement must contain actions.")
		case hasNot:
			s.NotAction = true
			actRaw = notRaw
		}
		acts, ok := stringOrList(actRaw)
		if !ok || len(acts) == 0 {
			return nil, malformedPolicy("Policy statement must contain actions.")
		}
		for _, a := range acts {
			if a != "*" && !validAction(a) {
				return nil, malformedPolicy("Actions/Conditions must be prefaced by a vendor, e.g., iam, sdb, ec2, etc.")
			}
		}
		s.Actions = acts
		_, hasRes := st["Resource"]
		_, hasNotRes := st["NotResource"]
		_, hasPrin := st["Principal"]
		_, hasNotPrin := st["NotPrincipal"]
		switch kind {
		case trustPolicy:
			if hasRes || hasNotRes {
				return nil, malformedPolicy("Has prohibited field Resource")
			}
			if !hasPrin && !hasNotPrin {
				return nil, malformedPolicy("AssumeRolepolicy contained an invalid principal: a trust policy statement needs a Principal")
			}
		default:
			if hasPrin || hasNotPrin {
				return nil, malformedPolicy("Policy document should not specify a principal.")
			}
			if !hasRes && !hasNotRes {
				return nil, malformedPolicy("Policy statement must contain resources.")
			}
		}
		out = append(out, s)
	}
	return out, nil
}

// validAction is "vendor:Action", the action possibly with wildcards.
func validAction(a string) bool {
	vendor, name, ok := strings.Cut(a, ":")
	if !ok || vendor == "" || name == "" {
		return false
	}
	for _, c := range vendor {
		if !(c == '-' || unicode.IsLetter(c) || unicode.IsDigit(c)) {
			return false
		}
	}
	return true
}

func stringOrList(raw json.RawMessage) ([]string, bool) {
	var one string
	if json.Unmarshal(raw, &one) == nil {
		return []string{one}, true
	}
	var many []string
	if json.Unmarshal(raw, &many) == nil {
		return many, true
	}
	return nil, false
}

// readActionPrefixes are the verbs of AWS actions that only read. The
// gateway's server applies the same rule to the operations a read-only
// key may call.
var readActionPrefixes = []string{"describe", "get", "list"}

// readAction reports whether every action pattern a matches only reads:
// the literal part before its first wildcard must already start with
// Describe, Get or List, so "ec2:Describe*" is a read and "ec2:D*" (which
// matches DeleteVpc too) is not.
func readAction(a string) bool {
	_, name, ok := strings.Cut(a, ":")
	if !ok {
		return false // "*"
	}
	lit := strings.ToLower(name)
	if i := strings.IndexAny(lit, "*?"); i >= 0 {
		lit = lit[:i]
	}
	for _, p := range readActionPrefixes {
		if strings.HasPrefix(lit, p) {
			return true
		}
	}
	return false
}

// grantsOnlyRead reports whether the statements allow nothing but reads.
// Deny statements allow nothing, so they never make a policy more than
// read-only; an Allow with NotAction allows everything outside its list.
func grantsOnlyRead(sts []statement) bool {
	for _, s := range sts {
		if s.Effect != "Allow" {
			continue
		}
		if s.NotAction {
			return false
		}
		for _, a := range s.Actions {
			if !readAction(a) {
				return false
			}
		}
	}
	return true
}

// PolicyGrantsOnlyRead checks a permission policy document (a session
// policy given to AssumeRole) and reports whether it allows only reads.
func PolicyGrantsOnlyRead(doc string) (bool, error) {
	sts, err := parsePolicy(doc, permissionPolicy)
	if err != nil {
		return false, err
	}
	return grantsOnlyRead(sts), nil
}

// policySize is how IAM counts a policy against its size quotas: without
// whitespace.
func policySize(doc string) int {
	n := 0
	for _, c := range doc {
		if !unicode.IsSpace(c) {
			n++
		}
	}
	return n
}

// managedPolicy is an AWS-managed policy hangar knows by ARN. hangar does
// not hold these policies' documents; what it needs of each is whether it
// grants only reads, as its AWS documentation says.
type managedPolicy struct {
	readOnly bool
}

// awsManaged are the AWS-managed policies AttachRolePolicy accepts. The
// read-only ones are those AWS documents as granting only reads.
var awsManaged = map[string]managedPolicy{
	"arn:aws:iam::aws:policy/ReadOnlyAccess":                             {readOnly: true},
	"arn:aws:iam::aws:policy/ViewOnlyAccess":                             {readOnly: true},
	"arn:aws:iam::aws:policy/SecurityAudit":                              {readOnly: true},
	"arn:aws:iam::aws:policy/AmazonEC2ReadOnlyAccess":                    {readOnly: true},
	"arn:aws:iam::aws:policy/AmazonVPCReadOnlyAccess":                    {readOnly: true},
	"arn:aws:iam::aws:policy/AmazonS3ReadOnlyAccess":                     {readOnly: true},
	"arn:aws:iam::aws:policy/IAMReadOnlyAccess":                          {readOnly: true},
	"arn:aws:iam::aws:policy/AdministratorAccess":                        {},
	"arn:aws:iam::aws:policy/PowerUserAccess":                            {},
	"arn:aws:iam::aws:policy/AmazonEC2FullAccess":                        {},
	"arn:aws:iam::aws:policy/AmazonVPCFullAccess":                        {},
	"arn:aws:iam::aws:policy/AmazonS3FullAccess":                         {},
	"arn:aws:iam::aws:policy/IAMFullAccess":                              {},
	"arn:aws:iam::aws:policy/AmazonSSMManagedInstanceCore":               {},
	"arn:aws:iam::aws:policy/CloudWatchAgentServerPolicy":                {},
	"arn:aws:iam::aws:policy/AmazonEC2ContainerRegistryReadOnly":         {readOnly: true},
	"arn:aws:iam::aws:policy/AmazonEKSClusterPolicy":                     {},
	"arn:aws:iam::aws:policy/AmazonEKSWorkerNodePolicy":                  {},
	"arn:aws:iam::aws:policy/AmazonEKS_CNI_Policy":                       {},
	"arn:aws:iam::aws:policy/service-role/AmazonEBSCSIDriverPolicy":      {},
	"arn:aws:iam::aws:policy/service-role/AmazonEC2RoleforSSM":           {},
	"arn:aws:iam::aws:policy/service-role/AmazonEC2ContainerServiceRole": {},
}

// ManagedPolicyReadOnly reports whether the AWS-managed policy arn is one
// hangar knows, and whether it grants only reads.
func ManagedPolicyReadOnly(arn string) (readOnly, known bool) {
	p, ok := awsManaged[arn]
	return p.readOnly, ok
}

// policyName is the last element of a policy ARN.
func policyName(arn string) string {
	return arn[strings.LastIndexByte(arn, '/')+1:]
}

// policyPath is the path of a policy ARN ("/" or "/service-role/").
func policyPath(arn string) string {
	_, rest, _ := strings.Cut(arn, ":policy")
	return rest[:strings.LastIndexByte(rest, '/')+1]
}
