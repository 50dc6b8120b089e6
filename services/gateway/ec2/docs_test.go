package ec2

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestDocsNameEveryFilter keeps docs/ec2-api.md true to the code: every
// filter a Describe call of this package accepts is named there.
func TestDocsNameEveryFilter(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join("..", "..", "..", "docs", "ec2-api.md"))
	if err != nil {
		t.Fatal(err)
	}
	doc := string(raw)
	sets := map[string][]string{
		"subnets":         subnetFilters.names(),
		"security groups": sgFilters(nil).names(),
		"rules":           sgRuleFilters.names(),
		"key pairs":       keyPairFilters.names(),
		"gateways":        igwFilters.names(),
		"route tables":    rtbFilters.names(),
		"instance types":  instanceTypeFilters.names(),
		"offerings":       offeringFilters.names(),
	}
	for what, names := range sets {
		for _, n := range names {
			if !strings.Contains(doc, "`"+n+"`") {
				t.Errorf("docs/ec2-api.md does not name the %s filter `%s`", what, n)
			}
		}
	}
}
