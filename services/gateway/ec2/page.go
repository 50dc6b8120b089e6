package ec2

import (
	"encoding/base64"
	"strings"

	"hangar.dev/hangar/services/gateway/awserr"
)

// pager is the MaxResults/NextToken state of one Describe call. Records are
// listed in id order; the token names the last id returned, so a page is
// stable while records are added or removed elsewhere in the list.
type pager struct {
	max   int // 0: no limit
	after string
}

const tokenPrefix = "hangar1:"

// newPager validates MaxResults against the operation's documented range
// (for most Describe calls 5 to 1000) and decodes NextToken.
func newPager(maxResults *int32, nextToken *string, lo, hi int32) (pager, error) {
	var p pager
	if maxResults != nil {
		n := *maxResults
		if n < lo || n > hi {
			return p, awserr.InvalidParameterValue("Value ( %d ) for parameter maxResults is invalid. Expecting a value between %d and %d.", n, lo, hi)
		}
		p.max = int(n)
	}
	if t := deref(nextToken); t != "" {
		raw, err := base64.RawURLEncoding.DecodeString(t)
		if err != nil || !strings.HasPrefix(string(raw), tokenPrefix) {
			return p, awserr.InvalidParameterValue("The token '%s' is invalid.", clip(t))
		}
		p.after = strings.TrimPrefix(string(raw), tokenPrefix)
		if p.max == 0 {
			p.max = int(hi)
		}
	}
	return p, nil
}

// token returns the NextToken that continues after id.
func token(id string) *string {
	return ptr(base64.RawURLEncoding.EncodeToString([]byte(tokenPrefix + id)))
}

func clip(s string) string {
	if len(s) > 64 {
		return s[:64] + "…"
	}
	return s
}
