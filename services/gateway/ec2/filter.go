package ec2

import (
	"sort"
	"strings"

	"github.com/aws/aws-sdk-go-v2/service/ec2/types"

	"hangar.dev/hangar/services/gateway/awserr"
)

// filterSet maps the documented filter names of one resource kind to the
// values a record has for them. tag:<key>, tag-key and tag-value come free
// for every taggable kind.
type filterSet[T any] map[string]func(*T) []string

// matcher is a compiled Filter.N list: filters AND, values within one OR.
type matcher[T any] func(r *T, tags []types.Tag) bool

// compile checks every filter name and returns the matcher. An unknown
// filter name is an error, as in EC2, not a filter that matches nothing.
func (fs filterSet[T]) compile(in []types.Filter) (matcher[T], error) {
	type one struct {
		name   string
		values []glob
		get    func(*T) []string
		tagKey string // for tag:<key>
	}
	var all []one
	for _, f := range in {
		name := deref(f.Name)
		if name == "" {
			return nil, awserr.InvalidParameterValue("A filter has no Name")
		}
		if len(f.Values) == 0 {
			return nil, awserr.InvalidParameterValue("The filter '%s' has no values", name)
		}
		o := one{name: name}
		for _, v := range f.Values {
			o.values = append(o.values, compileGlob(v))
		}
		switch {
		case strings.HasPrefix(name, "tag:"):
			o.tagKey = strings.TrimPrefix(name, "tag:")
		case name == "tag-key" || name == "tag-value":
		default:
			get, ok := fs[name]
			if !ok {
				return nil, awserr.InvalidParameterValue("The filter '%s' is invalid", name)
			}
			o.get = get
		}
		all = append(all, o)
	}
	return func(r *T, tags []types.Tag) bool {
		for _, f := range all {
			var have []string
			switch {
			case f.get != nil:
				have = f.get(r)
			case f.tagKey != "":
				for _, t := range tags {
					if deref(t.Key) == f.tagKey {
						have = append(have, deref(t.Value))
					}
				}
			case f.name == "tag-key":
				for _, t := range tags {
					have = append(have, deref(t.Key))
				}
			case f.name == "tag-value":
				for _, t := range tags {
					have = append(have, deref(t.Value))
				}
			}
			if !anyMatch(f.values, have) {
				return false
			}
		}
		return true
	}, nil
}

// names lists the filter names, for documentation and tests.
func (fs filterSet[T]) names() []string {
	out := make([]string, 0, len(fs))
	for k := range fs {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

func anyMatch(patterns []glob, have []string) bool {
	for _, p := range patterns {
		for _, h := range have {
			if p.match(h) {
				return true
			}
		}
	}
	return false
}

// glob is a filter value: EC2 filter values may use * (any run) and ? (any
// one character), with a backslash escaping either.
type glob struct {
	literal string
	parts   []globPart
	exact   bool
}

type globPart struct {
	star, any bool
	text      string
}

func compileGlob(p string) glob {
	if !strings.ContainsAny(p, `*?\`) {
		return glob{literal: p, exact: true}
	}
	var parts []globPart
	var text strings.Builder
	flush := func() {
		if text.Len() > 0 {
			parts = append(parts, globPart{text: text.String()})
			text.Reset()
		}
	}
	for i := 0; i < len(p); i++ {
		switch c := p[i]; {
		case c == '\\' && i+1 < len(p):
			i++
			text.WriteByte(p[i])
		case c == '*':
			flush()
			parts = append(parts, globPart{star: true})
		case c == '?':
			flush()
			parts = append(parts, globPart{any: true})
		default:
			text.WriteByte(c)
		}
	}
	flush()
	return glob{parts: parts}
}

func (g glob) match(s string) bool {
	if g.exact {
		return g.literal == s
	}
	return matchParts(g.parts, s)
}

func matchParts(parts []globPart, s string) bool {
	if len(parts) == 0 {
		return s == ""
	}
	p := parts[0]
	switch {
	case p.star:
		for i := 0; i <= len(s); i++ {
			if matchParts(parts[1:], s[i:]) {
				return true
			}
		}
		return false
	case p.any:
		if s == "" {
			return false
		}
		_, size := firstRune(s)
		return matchParts(parts[1:], s[size:])
	default:
		return strings.HasPrefix(s, p.text) && matchParts(parts[1:], s[len(p.text):])
	}
}

func firstRune(s string) (rune, int) {
	for i, r := range s {
		if i > 0 {
			return r, i
		}
	}
	return 0, len(s)
}

// boolString renders a bool as filter values compare it.
func boolString(b bool) string {
	if b {
		return "true"
	}
	return "false"
}
