package awsproto

import (
	"bytes"
	"encoding/base64"
	"encoding/xml"
	"fmt"
	"net/http"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"hangar.dev/hangar/services/gateway/awserr"
	"hangar.dev/hangar/services/gateway/awsmodel"
)

// TimeFormat is how AWS's XML protocols write timestamps.
const TimeFormat = "2006-01-02T15:04:05.000Z"

// EncodeXML writes the XML response of an EC2- or Query-protocol operation
// from out (an SDK output struct or a pointer to one).
func EncodeXML(m *awsmodel.Model, op, requestID string, out any) ([]byte, error) {
	o, ok := m.Operations[op]
	if !ok {
		return nil, fmt.Errorf("awsproto: %s model has no operation %s", m.Metadata.EndpointPrefix, op)
	}
	e := &encoder{m: m, ec2: m.Metadata.Protocol == "ec2"}
	ns := strings.TrimSuffix(m.Metadata.XMLNamespace, "/") + "/"
	if ns == "/" {
		ns = fmt.Sprintf("https://%s.amazonaws.com/doc/%s/", m.Metadata.EndpointPrefix, m.Metadata.APIVersion)
	}
	e.b.WriteString(xml.Header)
	fmt.Fprintf(&e.b, `<%sResponse xmlns="%s">`, op, ns)
	v := reflect.ValueOf(out)
	for v.Kind() == reflect.Pointer && !v.IsNil() {
		v = v.Elem()
	}
	if e.ec2 {
		e.elem("requestId", requestID)
		if o.Output != nil && v.IsValid() && v.Kind() == reflect.Struct {
			if err := e.members(m.Shape(o.Output.Shape), v, true); err != nil {
				return nil, err
			}
		}
	} else {
		if o.Output != nil && v.IsValid() && v.Kind() == reflect.Struct {
			wrapper := o.Output.ResultWrapper
			if wrapper == "" {
				wrapper = op + "Result"
			}
			e.open(wrapper)
			if err := e.members(m.Shape(o.Output.Shape), v, true); err != nil {
				return nil, err
			}
			e.close(wrapper)
		}
		e.b.WriteString("<ResponseMetadata>")
		e.elem("RequestId", requestID)
		e.b.WriteString("</ResponseMetadata>")
	}
	fmt.Fprintf(&e.b, "</%sResponse>", op)
	return e.b.Bytes(), nil
}

type encoder struct {
	m   *awsmodel.Model
	ec2 bool
	b   bytes.Buffer
}

func (e *encoder) open(name string) {
	e.b.WriteByte('<')
	e.b.WriteString(name)
	e.b.WriteByte('>')
}

func (e *encoder) close(name string) {
	e.b.WriteString("</")
	e.b.WriteString(name)
	e.b.WriteByte('>')
}

func (e *encoder) elem(name, text string) {
	e.open(name)
	escapeText(&e.b, text)
	e.close(name)
}

// escapeText writes s as XML character data: text with nothing to escape
// (ids, CIDRs, states: nearly all of a Describe response) is copied as it
// is; anything else goes through encoding/xml's escaper.
func escapeText(b *bytes.Buffer, s string) {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c < 0x20 || c > 0x7e || c == '&' || c == '<' || c == '>' || c == '"' || c == '\'' {
			_ = xml.EscapeText(b, []byte(s))
			return
		}
	}
	b.WriteString(s)
}

// memberPlan is how one member of a structure shape is written from one Go
// struct type: its element name and where its field is.
type memberPlan struct {
	wire  string
	ref   *awsmodel.Ref
	shape *awsmodel.Shape
	index []int
}

type planKey struct {
	shape *awsmodel.Shape
	typ   reflect.Type
}

// plans caches, per shape and Go type, the members in wire order with their
// field indexes: found once instead of by name for every value written.
var plans sync.Map // planKey → []memberPlan

func (e *encoder) plan(s *awsmodel.Shape, t reflect.Type) []memberPlan {
	key := planKey{s, t}
	if p, ok := plans.Load(key); ok {
		return p.([]memberPlan)
	}
	names := make([]string, 0, len(s.Members))
	for n := range s.Members {
		names = append(names, n)
	}
	sort.Strings(names)
	out := make([]memberPlan, 0, len(names))
	for _, name := range names {
		ref := s.Members[name]
		if ref.Location != "" && ref.Location != "body" {
			continue
		}
		index, ok := fieldIndex(t, name)
		if !ok {
			continue
		}
		out = append(out, memberPlan{wire: e.memberName(name, ref), ref: ref, shape: e.m.Shape(ref.Shape), index: index})
	}
	plans.Store(key, out)
	return out
}

func (e *encoder) memberName(name string, ref *awsmodel.Ref) string {
	if ref.LocationName != "" {
		return ref.LocationName
	}
	return name
}

// members writes the members of structure s from v. At the top level of a
// response, lists are written even when empty, as AWS writes <vpcSet/>.
func (e *encoder) members(s *awsmodel.Shape, v reflect.Value, top bool) error {
	for _, p := range e.plan(s, v.Type()) {
		f, err := v.FieldByIndexErr(p.index)
		if err != nil {
			continue // a nil embedded pointer: nothing to write
		}
		if p.shape.Type == "list" && top && f.Kind() == reflect.Slice && f.IsNil() {
			f = reflect.MakeSlice(f.Type(), 0, 0)
		}
		if err := e.value(p.wire, p.ref, f); err != nil {
			return err
		}
	}
	return nil
}

func (e *encoder) value(name string, ref *awsmodel.Ref, v reflect.Value) error {
	s := e.m.Shape(ref.Shape)
	for v.Kind() == reflect.Pointer || v.Kind() == reflect.Interface {
		if v.IsNil() {
			return nil
		}
		v = v.Elem()
	}
	switch s.Type {
	case "structure":
		e.open(name)
		if err := e.members(s, v, false); err != nil {
			return err
		}
		e.close(name)
	case "list":
		if v.Kind() != reflect.Slice || v.IsNil() {
			return nil
		}
		flat := ref.Flattened || s.Flattened
		item := "member"
		if e.ec2 {
			item = "item"
		}
		if s.Member.LocationName != "" {
			item = s.Member.LocationName
		}
		if flat {
			item = name
		} else {
			e.open(name)
		}
		for i := 0; i < v.Len(); i++ {
			if err := e.value(item, s.Member, v.Index(i)); err != nil {
				return err
			}
		}
		if !flat {
			e.close(name)
		}
	case "map":
		if v.Kind() != reflect.Map || v.IsNil() {
			return nil
		}
		keys := v.MapKeys()
		sort.Slice(keys, func(i, j int) bool { return fmt.Sprint(keys[i]) < fmt.Sprint(keys[j]) })
		flat := ref.Flattened || s.Flattened
		if !flat {
			e.open(name)
		}
		for _, k := range keys {
			entry := "entry"
			if flat {
				entry = name
			}
			e.open(entry)
			kn, vn := "key", "value"
			if s.Key.LocationName != "" {
				kn = s.Key.LocationName
			}
			if s.Value.LocationName != "" {
				vn = s.Value.LocationName
			}
			if err := e.value(kn, s.Key, k); err != nil {
				return err
			}
			if err := e.value(vn, s.Value, v.MapIndex(k)); err != nil {
				return err
			}
			e.close(entry)
		}
		if !flat {
			e.close(name)
		}
	default:
		text, ok := scalarText(s.Type, v)
		if !ok {
			return fmt.Errorf("awsproto: cannot write %s (%s) from %s", name, s.Type, v.Type())
		}
		e.elem(name, text)
	}
	return nil
}

func scalarText(typ string, v reflect.Value) (string, bool) {
	switch typ {
	case "string":
		if v.Kind() == reflect.String {
			return v.String(), true
		}
	case "boolean":
		if v.Kind() == reflect.Bool {
			return strconv.FormatBool(v.Bool()), true
		}
	case "integer", "long":
		switch v.Kind() {
		case reflect.Int, reflect.Int32, reflect.Int64:
			return strconv.FormatInt(v.Int(), 10), true
		}
	case "double", "float":
		// The shortest text that reads back as the same value at the
		// field's own width (a float32 0.1 is "0.1", not 0.100000001…).
		switch v.Kind() {
		case reflect.Float64:
			return strconv.FormatFloat(v.Float(), 'f', -1, 64), true
		case reflect.Float32:
			return strconv.FormatFloat(v.Float(), 'f', -1, 32), true
		}
	case "timestamp":
		if t, ok := v.Interface().(time.Time); ok {
			return t.UTC().Format(TimeFormat), true
		}
	case "blob":
		if v.Kind() == reflect.Slice && v.Type().Elem().Kind() == reflect.Uint8 {
			return base64.StdEncoding.EncodeToString(v.Bytes()), true
		}
	}
	return "", false
}

// ErrorXML writes an error in the protocol's XML form and returns the HTTP
// status to send with it.
func ErrorXML(protocol, requestID string, err *awserr.Error) (int, []byte) {
	var b bytes.Buffer
	b.WriteString(xml.Header)
	esc := func(s string) string {
		var x bytes.Buffer
		_ = xml.EscapeText(&x, []byte(s))
		return x.String()
	}
	status := err.Status
	if status == 0 {
		status = http.StatusBadRequest
	}
	if protocol == "ec2" {
		fmt.Fprintf(&b, "<Response><Errors><Error><Code>%s</Code><Message>%s</Message></Error></Errors><RequestID>%s</RequestID></Response>",
			esc(err.Code), esc(err.Message), esc(requestID))
		return status, b.Bytes()
	}
	typ := "Sender"
	if !err.Sender {
		typ = "Receiver"
	}
	fmt.Fprintf(&b, "<ErrorResponse><Error><Type>%s</Type><Code>%s</Code><Message>%s</Message></Error><RequestId>%s</RequestId></ErrorResponse>",
		typ, esc(err.Code), esc(err.Message), esc(requestID))
	return status, b.Bytes()
}
