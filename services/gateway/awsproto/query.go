// Package awsproto reads and writes the AWS wire protocols the gateway
// speaks, driven by the AWS API models: the EC2 and Query protocols (form
// parameters in, XML out) now, REST-JSON for EBS and EKS. Requests decode
// into, and responses encode from, aws-sdk-go-v2's typed input and output
// structs, whose field names are the models' member names.
//
// It owns wire shapes only: what a parameter means is the handler's business.
package awsproto

import (
	"encoding/base64"
	"fmt"
	"net/url"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"time"

	"hangar.dev/hangar/services/gateway/awserr"
	"hangar.dev/hangar/services/gateway/awsmodel"
)

// MaxListItems bounds any one list parameter (AWS's own limits are lower for
// most lists; this stops a request from allocating without bound).
const MaxListItems = 10000

// enumExempt names enum shapes that are not checked on input: the model
// shipped here predates values newer SDKs send (instance types chiefly), and
// the handler checks them against what the host offers.
var enumExempt = map[string]bool{"InstanceType": true, "ArchitectureType": true}

// ignoredParams are protocol parameters that are not members of any input.
func ignoredParam(k string) bool {
	return k == "Action" || k == "Version" || strings.HasPrefix(k, "X-Amz-")
}

// DecodeQuery fills in (a pointer to an SDK input struct) from the form
// parameters of an EC2- or Query-protocol request, following the model's
// shape for the operation's input. Unknown parameters, malformed values and
// missing required members are AWS-shaped errors.
func DecodeQuery(m *awsmodel.Model, op string, form url.Values, in any) error {
	o, ok := m.Operations[op]
	if !ok {
		return fmt.Errorf("awsproto: %s model has no operation %s", m.Metadata.EndpointPrefix, op)
	}
	d := &decoder{m: m, form: form, used: map[string]bool{}, ec2: m.Metadata.Protocol == "ec2"}
	d.prefixes = map[string]bool{}
	for k := range form {
		for i := 0; i < len(k); i++ {
			if k[i] == '.' {
				d.prefixes[k[:i]] = true
			}
		}
	}
	if o.Input != nil {
		v := reflect.ValueOf(in)
		if v.Kind() != reflect.Pointer || v.Elem().Kind() != reflect.Struct {
			return fmt.Errorf("awsproto: DecodeQuery needs a pointer to a struct, got %T", in)
		}
		if err := d.structure("", m.Shape(o.Input.Shape), v.Elem()); err != nil {
			return err
		}
	}
	var unknown []string
	for k := range form {
		if !d.used[k] && !ignoredParam(k) {
			unknown = append(unknown, k)
		}
	}
	if len(unknown) > 0 {
		sort.Strings(unknown)
		return awserr.UnknownParameter(unknown[0])
	}
	return nil
}

type decoder struct {
	m        *awsmodel.Model
	form     url.Values
	used     map[string]bool
	prefixes map[string]bool
	ec2      bool
}

// consume marks wire and everything under it as read.
func (d *decoder) consume(wire string) {
	for k := range d.form {
		if k == wire || strings.HasPrefix(k, wire+".") {
			d.used[k] = true
		}
	}
}

func (d *decoder) present(name string) bool {
	_, ok := d.form[name]
	return ok || d.prefixes[name]
}

// memberName is the wire name of a member, per protocol.
func (d *decoder) memberName(name string, ref *awsmodel.Ref) string {
	if d.ec2 {
		if ref.QueryName != "" {
			return ref.QueryName
		}
		if ref.LocationName != "" {
			return strings.ToUpper(ref.LocationName[:1]) + ref.LocationName[1:]
		}
		return name
	}
	if ref.LocationName != "" {
		return ref.LocationName
	}
	return name
}

func join(prefix, name string) string {
	if prefix == "" {
		return name
	}
	return prefix + "." + name
}

// field finds the struct field for a model member: the SDK names fields
// after members, with the first letter upper-cased.
func field(v reflect.Value, member string) reflect.Value {
	index, ok := fieldIndex(v.Type(), member)
	if !ok {
		return reflect.Value{}
	}
	f, err := v.FieldByIndexErr(index)
	if err != nil {
		return reflect.Value{}
	}
	return f
}

// fieldIndex is field's lookup on a type, so it can be cached.
func fieldIndex(t reflect.Type, member string) ([]int, bool) {
	if f, ok := t.FieldByName(member); ok {
		return f.Index, true
	}
	up := strings.ToUpper(member[:1]) + member[1:]
	if f, ok := t.FieldByName(up); ok {
		return f.Index, true
	}
	if f, ok := t.FieldByNameFunc(func(n string) bool { return strings.EqualFold(n, member) }); ok {
		return f.Index, true
	}
	return nil, false
}

func (d *decoder) structure(prefix string, s *awsmodel.Shape, v reflect.Value) error {
	names := make([]string, 0, len(s.Members))
	for n := range s.Members {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, name := range names {
		ref := s.Members[name]
		wire := join(prefix, d.memberName(name, ref))
		if !d.present(wire) {
			if s.IsRequired(name) {
				return awserr.MissingParameter(wire)
			}
			continue
		}
		f := field(v, name)
		if !f.IsValid() || !f.CanSet() {
			// A member the model has and the SDK struct does not: the SDK
			// keeps a few for its own middleware (CopySnapshot's
			// DestinationRegion, which the CLI always sends, feeds the
			// presigned URL). The request is valid; the value has nowhere
			// to go and nothing in hangar reads it.
			d.consume(wire)
			continue
		}
		if err := d.value(wire, ref, f); err != nil {
			return err
		}
	}
	return nil
}

// value decodes the parameter(s) at wire into f, allocating pointers.
func (d *decoder) value(wire string, ref *awsmodel.Ref, f reflect.Value) error {
	s := d.m.Shape(ref.Shape)
	if f.Kind() == reflect.Pointer {
		n := reflect.New(f.Type().Elem())
		if err := d.value(wire, ref, n.Elem()); err != nil {
			return err
		}
		f.Set(n)
		return nil
	}
	switch s.Type {
	case "structure":
		if f.Kind() != reflect.Struct {
			return fmt.Errorf("awsproto: %s: structure into %s", wire, f.Type())
		}
		return d.structure(wire, s, f)
	case "list":
		return d.list(wire, ref, s, f)
	case "map":
		return d.mapValue(wire, ref, s, f)
	}
	raw, ok := d.form[wire]
	if !ok {
		// Only deeper keys (Name.x) exist where a scalar belongs.
		return nil
	}
	d.used[wire] = true
	if len(raw) > 1 {
		return awserr.InvalidParameterValue("Parameter %s is given %d times", wire, len(raw))
	}
	return scalar(wire, ref.Shape, s, raw[0], f)
}

func (d *decoder) list(wire string, ref *awsmodel.Ref, s *awsmodel.Shape, f reflect.Value) error {
	if f.Kind() != reflect.Slice {
		return fmt.Errorf("awsproto: %s: list into %s", wire, f.Type())
	}
	base := wire
	if !d.ec2 && !(s.Flattened || ref.Flattened) {
		item := "member"
		if s.Member.LocationName != "" {
			item = s.Member.LocationName
		}
		base = wire + "." + item
	}
	out := reflect.MakeSlice(f.Type(), 0, 0)
	for i := 1; ; i++ {
		key := base + "." + strconv.Itoa(i)
		if !d.present(key) {
			break
		}
		if i > MaxListItems {
			return awserr.InvalidParameterValue("Parameter %s has more than %d items", wire, MaxListItems)
		}
		elem := reflect.New(f.Type().Elem()).Elem()
		if err := d.value(key, s.Member, elem); err != nil {
			return err
		}
		out = reflect.Append(out, elem)
	}
	// A bare "Name=" is the Query protocol's empty list (botocore sends it
	// for one). The EC2 protocol has no empty list on the wire: its
	// clients send nothing, so there a bare name is a mistake.
	if vals, ok := d.form[wire]; ok {
		d.used[wire] = true
		if d.ec2 || len(vals) != 1 || vals[0] != "" {
			return awserr.InvalidParameterValue("Parameter %s is a list: give it as %s.1, %s.2, …", wire, wire, wire)
		}
	}
	if s.Min != nil && float64(out.Len()) < *s.Min {
		return awserr.InvalidParameterValue("Parameter %s needs at least %v items", wire, *s.Min)
	}
	f.Set(out)
	return nil
}

func (d *decoder) mapValue(wire string, ref *awsmodel.Ref, s *awsmodel.Shape, f reflect.Value) error {
	if f.Kind() != reflect.Map {
		return fmt.Errorf("awsproto: %s: map into %s", wire, f.Type())
	}
	// The EC2 protocol inherits the Query protocol's map form
	// (Name.entry.N.key), as botocore's serializers do.
	base := wire
	if !(s.Flattened || ref.Flattened) {
		base = wire + ".entry"
	}
	keyName, valName := "key", "value"
	if s.Key.LocationName != "" {
		keyName = s.Key.LocationName
	}
	if s.Value.LocationName != "" {
		valName = s.Value.LocationName
	}
	out := reflect.MakeMap(f.Type())
	for i := 1; ; i++ {
		entry := base + "." + strconv.Itoa(i)
		if !d.present(entry) {
			break
		}
		if i > MaxListItems {
			return awserr.InvalidParameterValue("Parameter %s has more than %d entries", wire, MaxListItems)
		}
		k := reflect.New(f.Type().Key()).Elem()
		if err := d.value(entry+"."+keyName, s.Key, k); err != nil {
			return err
		}
		v := reflect.New(f.Type().Elem()).Elem()
		if err := d.value(entry+"."+valName, s.Value, v); err != nil {
			return err
		}
		out.SetMapIndex(k, v)
	}
	f.Set(out)
	return nil
}

func scalar(wire, shapeName string, s *awsmodel.Shape, raw string, f reflect.Value) error {
	bad := func(why string) error {
		return awserr.InvalidParameterValue("Value (%s) for parameter %s is invalid. %s", clip(raw), wire, why)
	}
	switch s.Type {
	case "string":
		if f.Kind() != reflect.String {
			return fmt.Errorf("awsproto: %s: string into %s", wire, f.Type())
		}
		if len(s.Enum) > 0 && !enumExempt[shapeName] && !contains(s.Enum, raw) {
			return bad("Expected one of: " + strings.Join(s.Enum, ", ") + ".")
		}
		if s.Max != nil && float64(len(raw)) > *s.Max {
			return bad(fmt.Sprintf("It is longer than %v characters.", *s.Max))
		}
		f.SetString(raw)
	case "boolean":
		// Only the words the SDKs write: strconv.ParseBool would also
		// take 1, t and F, which AWS does not.
		var b bool
		switch strings.ToLower(raw) {
		case "true":
			b = true
		case "false":
		default:
			return bad("Expected true or false.")
		}
		if f.Kind() != reflect.Bool {
			return fmt.Errorf("awsproto: %s: boolean into %s", wire, f.Type())
		}
		f.SetBool(b)
	case "integer", "long":
		n, err := strconv.ParseInt(raw, 10, 64)
		if err != nil {
			return bad("Expected a whole number.")
		}
		switch f.Kind() {
		case reflect.Int32, reflect.Int64, reflect.Int:
			if f.OverflowInt(n) {
				return bad("It is out of range.")
			}
			f.SetInt(n)
		default:
			return fmt.Errorf("awsproto: %s: integer into %s", wire, f.Type())
		}
	case "double", "float":
		x, err := strconv.ParseFloat(raw, 64)
		if err != nil || (f.Kind() != reflect.Float64 && f.Kind() != reflect.Float32) {
			return bad("Expected a number.")
		}
		f.SetFloat(x)
	case "timestamp":
		t, err := ParseTime(raw)
		if err != nil {
			return bad("Expected an ISO 8601 time.")
		}
		f.Set(reflect.ValueOf(t))
	case "blob":
		b, err := base64.StdEncoding.DecodeString(raw)
		if err != nil {
			return bad("Expected base64.")
		}
		f.SetBytes(b)
	default:
		return fmt.Errorf("awsproto: %s: unhandled shape type %s", wire, s.Type)
	}
	return nil
}

// ParseTime reads the timestamp forms AWS clients send.
func ParseTime(raw string) (time.Time, error) {
	for _, layout := range []string{time.RFC3339Nano, "2006-01-02T15:04:05Z0700", "2006-01-02T15:04:05", "2006-01-02"} {
		if t, err := time.Parse(layout, raw); err == nil {
			return t.UTC(), nil
		}
	}
	if secs, err := strconv.ParseFloat(raw, 64); err == nil {
		return time.Unix(0, int64(secs*1e9)).UTC(), nil
	}
	return time.Time{}, fmt.Errorf("unparseable time %q", raw)
}

func clip(s string) string {
	if len(s) > 64 {
		return s[:64] + "…"
	}
	return s
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}
