package awsproto

// The REST-JSON protocol (EBS, EKS): the operation is chosen by method and
// path against the model's requestUri templates; members travel in the URI
// path, the query string, headers, a raw payload (a blob, streamed) or a
// JSON body; errors are a JSON body {"message": …} with the code in the
// x-amzn-ErrorType header.

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/url"
	"reflect"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"hangar.dev/hangar/services/gateway/awserr"
	"hangar.dev/hangar/services/gateway/awsmodel"
)

// RESTError is an AWS error with the extra members REST-JSON services put
// beside the message (EBS's Reason, for one).
type RESTError struct {
	Err    *awserr.Error
	Fields map[string]any
}

func (e *RESTError) Error() string { return e.Err.Error() }

// Unwrap lets awserr.As find the code and status.
func (e *RESTError) Unwrap() error { return e.Err }

// ValidationError is the REST services' ValidationException with a reason.
func ValidationError(reason, format string, args ...any) *RESTError {
	return &RESTError{Err: awserr.New(400, "ValidationException", format, args...), Fields: map[string]any{"Reason": reason}}
}

// MatchREST finds the operation whose requestUri matches method and path,
// and the values of its {labels}. Of several matches the one with the most
// literal segments wins.
func MatchREST(m *awsmodel.Model, method, path string) (string, map[string]string, bool) {
	segs := splitPath(path)
	best, bestLit := "", -1
	var bestLabels map[string]string
	for name, op := range m.Operations {
		if !strings.EqualFold(op.HTTP.Method, method) {
			continue
		}
		uri, _, _ := strings.Cut(op.HTTP.RequestURI, "?")
		tmpl := splitPath(uri)
		labels, lit, ok := matchTemplate(tmpl, segs)
		if ok && lit > bestLit {
			best, bestLit, bestLabels = name, lit, labels
		}
	}
	return best, bestLabels, best != ""
}

func splitPath(p string) []string {
	p = strings.Trim(p, "/")
	if p == "" {
		return nil
	}
	return strings.Split(p, "/")
}

func matchTemplate(tmpl, segs []string) (map[string]string, int, bool) {
	labels := map[string]string{}
	lit := 0
	for i, t := range tmpl {
		if strings.HasPrefix(t, "{") && strings.HasSuffix(t, "+}") { // greedy
			if i >= len(segs) {
				return nil, 0, false
			}
			v, err := url.PathUnescape(strings.Join(segs[i:], "/"))
			if err != nil {
				return nil, 0, false
			}
			labels[t[1:len(t)-2]] = v
			return labels, lit, true
		}
		if i >= len(segs) {
			return nil, 0, false
		}
		if strings.HasPrefix(t, "{") && strings.HasSuffix(t, "}") {
			v, err := url.PathUnescape(segs[i])
			if err != nil || v == "" {
				return nil, 0, false
			}
			labels[t[1:len(t)-1]] = v
			continue
		}
		if t != segs[i] {
			return nil, 0, false
		}
		lit++
	}
	return labels, lit, len(tmpl) == len(segs)
}

func wireName(member string, ref *awsmodel.Ref) string {
	if ref.LocationName != "" {
		return ref.LocationName
	}
	return member
}

// DecodeREST fills in (a pointer to an SDK input struct) from a REST-JSON
// request: labels from MatchREST, the query string, headers and the body.
// Missing required members and values the model forbids are
// ValidationExceptions worded as AWS words them.
func DecodeREST(m *awsmodel.Model, op string, r *http.Request, labels map[string]string, body []byte, in any) error {
	o, ok := m.Operations[op]
	if !ok {
		return fmt.Errorf("awsproto: %s model has no operation %s", m.Metadata.EndpointPrefix, op)
	}
	if o.Input == nil {
		return nil
	}
	v := reflect.ValueOf(in)
	if v.Kind() != reflect.Pointer || v.Elem().Kind() != reflect.Struct {
		return fmt.Errorf("awsproto: DecodeREST needs a pointer to a struct, got %T", in)
	}
	v = v.Elem()
	s := m.Shape(o.Input.Shape)
	query := r.URL.Query()
	var jsonBody map[string]json.RawMessage
	if s.Payload == "" && len(bytes.TrimSpace(body)) > 0 {
		if err := json.Unmarshal(body, &jsonBody); err != nil {
			return &RESTError{Err: awserr.New(400, "SerializationException", "The request body is not a JSON object: %v", err)}
		}
	}
	var problems []string
	names := sortedMembers(s)
	for _, name := range names {
		ref := s.Members[name]
		f := field(v, name)
		if !f.IsValid() {
			continue
		}
		ms := m.Shape(ref.Shape)
		wire := wireName(name, ref)
		var (
			raw     string
			present bool
		)
		switch ref.Location {
		case "uri":
			raw, present = labels[wire]
		case "querystring":
			if vals, ok := query[wire]; ok && len(vals) > 0 {
				raw, present = vals[0], true
			}
		case "header":
			if vals := r.Header.Values(wire); len(vals) > 0 {
				raw, present = vals[0], true
			}
		case "headers", "statusCode":
			continue
		default:
			if name == s.Payload {
				present = len(body) > 0 || ms.Type == "blob"
				if present {
					if err := setPayload(m, ms, f, body); err != nil {
						return err
					}
				}
				if !present && s.IsRequired(name) {
					problems = append(problems, fmt.Sprintf("Value null at '%s' failed to satisfy constraint: Member must not be null", lowerFirst(name)))
				}
				continue
			}
			rawJSON, ok := jsonBody[wire]
			if ok && string(rawJSON) != "null" {
				var x any
				dec := json.NewDecoder(bytes.NewReader(rawJSON))
				dec.UseNumber()
				if err := dec.Decode(&x); err != nil {
					return &RESTError{Err: awserr.New(400, "SerializationException", "%s is not valid JSON", wire)}
				}
				if p := setJSON(m, ref.Shape, ms, lowerFirst(name), f, x); p != "" {
					problems = append(problems, p)
				}
			} else if s.IsRequired(name) {
				problems = append(problems, fmt.Sprintf("Value null at '%s' failed to satisfy constraint: Member must not be null", lowerFirst(name)))
			}
			continue
		}
		if !present {
			if s.IsRequired(name) {
				problems = append(problems, fmt.Sprintf("Value null at '%s' failed to satisfy constraint: Member must not be null", lowerFirst(name)))
			}
			continue
		}
		if p := setText(m, ref.Shape, ms, lowerFirst(name), f, raw); p != "" {
			problems = append(problems, p)
		}
	}
	if len(problems) > 0 {
		sort.Strings(problems)
		word := "error"
		if len(problems) > 1 {
			word = "errors"
		}
		return ValidationError("INVALID_PARAMETER_VALUE", "%d validation %s detected: %s", len(problems), word, strings.Join(problems, "; "))
	}
	return nil
}

func lowerFirst(s string) string {
	if s == "" {
		return s
	}
	return strings.ToLower(s[:1]) + s[1:]
}

func sortedMembers(s *awsmodel.Shape) []string {
	names := make([]string, 0, len(s.Members))
	for n := range s.Members {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// Payload is a request body handed to a handler as the SDK's io.Reader. It
// also gives the bytes themselves, already read once by the server, so a
// handler that needs them whole (PutSnapshotBlock's 512 KiB) need not copy.
type Payload struct {
	*bytes.Reader
	data []byte
}

// Bytes returns the whole body; the handler must not modify it.
func (p *Payload) Bytes() []byte { return p.data }

func setPayload(m *awsmodel.Model, s *awsmodel.Shape, f reflect.Value, body []byte) error {
	switch s.Type {
	case "blob":
		switch {
		case f.Type() == reflect.TypeOf([]byte(nil)):
			f.SetBytes(body)
		case f.Type().Implements(reflect.TypeOf((*io.Reader)(nil)).Elem()) || reflect.TypeOf((*Payload)(nil)).AssignableTo(f.Type()):
			f.Set(reflect.ValueOf(&Payload{Reader: bytes.NewReader(body), data: body}))
		default:
			return fmt.Errorf("awsproto: blob payload into %s", f.Type())
		}
	case "structure":
		var x any
		dec := json.NewDecoder(bytes.NewReader(body))
		dec.UseNumber()
		if err := dec.Decode(&x); err != nil {
			return &RESTError{Err: awserr.New(400, "SerializationException", "The request body is not valid JSON: %v", err)}
		}
		if f.Kind() == reflect.Pointer {
			f.Set(reflect.New(f.Type().Elem()))
		}
		if p := setJSON(m, "", s, "body", f, x); p != "" {
			return ValidationError("INVALID_PARAMETER_VALUE", "1 validation error detected: %s", p)
		}
	default:
		return fmt.Errorf("awsproto: %s payload", s.Type)
	}
	return nil
}

var (
	patternMu sync.Mutex
	patterns  = map[string]*regexp.Regexp{}
)

func pattern(p string) *regexp.Regexp {
	patternMu.Lock()
	defer patternMu.Unlock()
	if re, ok := patterns[p]; ok {
		return re
	}
	re, err := regexp.Compile(p)
	if err != nil {
		re = nil // a Java-only pattern: not checked here
	}
	patterns[p] = re
	return re
}

// checkString applies the model's length, pattern and enum constraints.
func checkString(s *awsmodel.Shape, path, v string) string {
	n := float64(len([]rune(v)))
	if s.Min != nil && n < *s.Min {
		return fmt.Sprintf("Value '%s' at '%s' failed to satisfy constraint: Member must have length greater than or equal to %v", clip(v), path, *s.Min)
	}
	if s.Max != nil && n > *s.Max {
		return fmt.Sprintf("Value '%s' at '%s' failed to satisfy constraint: Member must have length less than or equal to %v", clip(v), path, *s.Max)
	}
	if len(s.Enum) > 0 && !contains(s.Enum, v) {
		return fmt.Sprintf("Value '%s' at '%s' failed to satisfy constraint: Member must satisfy enum value set: [%s]", clip(v), path, strings.Join(s.Enum, ", "))
	}
	if s.Pattern != "" {
		if re := pattern(s.Pattern); re != nil && !re.MatchString(v) {
			return fmt.Sprintf("Value '%s' at '%s' failed to satisfy constraint: Member must satisfy regular expression pattern: %s", clip(v), path, s.Pattern)
		}
	}
	return ""
}

func checkNumber(s *awsmodel.Shape, path string, n float64) string {
	if s.Min != nil && n < *s.Min {
		return fmt.Sprintf("Value '%v' at '%s' failed to satisfy constraint: Member must have value greater than or equal to %v", n, path, *s.Min)
	}
	if s.Max != nil && n > *s.Max {
		return fmt.Sprintf("Value '%v' at '%s' failed to satisfy constraint: Member must have value less than or equal to %v", n, path, *s.Max)
	}
	return ""
}

// alloc makes f settable as its element: a nil pointer gets a new value.
func alloc(f reflect.Value) reflect.Value {
	if f.Kind() == reflect.Pointer {
		if f.IsNil() {
			f.Set(reflect.New(f.Type().Elem()))
		}
		return f.Elem()
	}
	return f
}

// setText sets a scalar from its text form (URI, query string, header).
func setText(m *awsmodel.Model, shapeName string, s *awsmodel.Shape, path string, f reflect.Value, raw string) string {
	switch s.Type {
	case "string":
		if p := checkString(s, path, raw); p != "" {
			return p
		}
		alloc(f).SetString(raw)
	case "integer", "long":
		n, err := strconv.ParseInt(strings.TrimSpace(raw), 10, 64)
		if err != nil {
			return fmt.Sprintf("Value '%s' at '%s' failed to satisfy constraint: Member must be a whole number", clip(raw), path)
		}
		if p := checkNumber(s, path, float64(n)); p != "" {
			return p
		}
		e := alloc(f)
		if e.OverflowInt(n) {
			return fmt.Sprintf("Value '%s' at '%s' failed to satisfy constraint: Member must be within range", clip(raw), path)
		}
		e.SetInt(n)
	case "boolean":
		switch strings.ToLower(raw) {
		case "true":
			alloc(f).SetBool(true)
		case "false":
			alloc(f).SetBool(false)
		default:
			return fmt.Sprintf("Value '%s' at '%s' failed to satisfy constraint: Member must be true or false", clip(raw), path)
		}
	case "timestamp":
		t, err := ParseTime(raw)
		if err != nil {
			if t2, err2 := http.ParseTime(raw); err2 == nil {
				t, err = t2.UTC(), nil
			}
		}
		if err != nil {
			return fmt.Sprintf("Value '%s' at '%s' failed to satisfy constraint: Member must be a timestamp", clip(raw), path)
		}
		alloc(f).Set(reflect.ValueOf(t))
	default:
		return fmt.Sprintf("Value at '%s' of type %s cannot travel as text", path, s.Type)
	}
	return ""
}

// setJSON sets f from a decoded JSON value following shape s.
func setJSON(m *awsmodel.Model, shapeName string, s *awsmodel.Shape, path string, f reflect.Value, x any) string {
	bad := func(want string) string {
		return fmt.Sprintf("Value at '%s' failed to satisfy constraint: Member must be %s", path, want)
	}
	switch s.Type {
	case "structure":
		obj, ok := x.(map[string]any)
		if !ok {
			return bad("an object")
		}
		e := alloc(f)
		for _, name := range sortedMembers(s) {
			ref := s.Members[name]
			val, ok := obj[wireName(name, ref)]
			if !ok || val == nil {
				if s.IsRequired(name) {
					return fmt.Sprintf("Value null at '%s.%s' failed to satisfy constraint: Member must not be null", path, lowerFirst(name))
				}
				continue
			}
			sf := field(e, name)
			if !sf.IsValid() {
				continue
			}
			if p := setJSON(m, ref.Shape, m.Shape(ref.Shape), path+"."+lowerFirst(name), sf, val); p != "" {
				return p
			}
		}
	case "list":
		arr, ok := x.([]any)
		if !ok {
			return bad("a list")
		}
		if len(arr) > MaxListItems {
			return bad(fmt.Sprintf("a list of at most %d items", MaxListItems))
		}
		if p := checkNumber(&awsmodel.Shape{Min: s.Min, Max: s.Max}, path+" length", float64(len(arr))); p != "" {
			return p
		}
		out := reflect.MakeSlice(f.Type(), len(arr), len(arr))
		for i, it := range arr {
			if p := setJSON(m, s.Member.Shape, m.Shape(s.Member.Shape), fmt.Sprintf("%s.%d", path, i+1), out.Index(i), it); p != "" {
				return p
			}
		}
		f.Set(out)
	case "map":
		obj, ok := x.(map[string]any)
		if !ok {
			return bad("an object")
		}
		out := reflect.MakeMapWithSize(f.Type(), len(obj))
		for k, it := range obj {
			val := reflect.New(f.Type().Elem()).Elem()
			if p := setJSON(m, s.Value.Shape, m.Shape(s.Value.Shape), path+"."+k, val, it); p != "" {
				return p
			}
			out.SetMapIndex(reflect.ValueOf(k).Convert(f.Type().Key()), val)
		}
		f.Set(out)
	case "string":
		str, ok := x.(string)
		if !ok {
			return bad("a string")
		}
		return setText(m, shapeName, s, path, f, str)
	case "integer", "long":
		num, ok := x.(json.Number)
		if !ok {
			return bad("a number")
		}
		return setText(m, shapeName, s, path, f, num.String())
	case "double", "float":
		num, ok := x.(json.Number)
		if !ok {
			return bad("a number")
		}
		v, err := num.Float64()
		if err != nil {
			return bad("a number")
		}
		if p := checkNumber(s, path, v); p != "" {
			return p
		}
		alloc(f).SetFloat(v)
	case "boolean":
		b, ok := x.(bool)
		if !ok {
			return bad("true or false")
		}
		alloc(f).SetBool(b)
	case "timestamp":
		switch t := x.(type) {
		case json.Number:
			secs, err := t.Float64()
			if err != nil {
				return bad("a timestamp")
			}
			sec, frac := math.Modf(secs)
			alloc(f).Set(reflect.ValueOf(time.Unix(int64(sec), int64(frac*1e9)).UTC()))
		case string:
			return setText(m, shapeName, s, path, f, t)
		default:
			return bad("a timestamp")
		}
	case "blob":
		str, ok := x.(string)
		if !ok {
			return bad("base64 text")
		}
		b, err := base64.StdEncoding.DecodeString(str)
		if err != nil {
			return bad("base64 text")
		}
		f.SetBytes(b)
	default:
		return bad("of a supported type, not " + s.Type)
	}
	return ""
}

// RESTResponse is an encoded REST-JSON response.
type RESTResponse struct {
	Status int
	Header http.Header
	Body   io.Reader
	Length int64 // -1 when unknown
}

// EncodeREST encodes out (an SDK output struct) for op: header members as
// headers, a blob payload as the raw body, the rest as a JSON object.
func EncodeREST(m *awsmodel.Model, op string, out any) (*RESTResponse, error) {
	o, ok := m.Operations[op]
	if !ok {
		return nil, fmt.Errorf("awsproto: %s model has no operation %s", m.Metadata.EndpointPrefix, op)
	}
	res := &RESTResponse{Status: http.StatusOK, Header: http.Header{}, Length: -1}
	if o.HTTP.ResponseCode != 0 {
		res.Status = o.HTTP.ResponseCode
	}
	if o.Output == nil {
		res.Body, res.Length = bytes.NewReader(nil), 0
		return res, nil
	}
	v := reflect.ValueOf(out)
	for v.Kind() == reflect.Pointer {
		if v.IsNil() {
			return nil, fmt.Errorf("awsproto: nil output for %s", op)
		}
		v = v.Elem()
	}
	s := m.Shape(o.Output.Shape)
	obj := map[string]any{}
	for _, name := range sortedMembers(s) {
		ref := s.Members[name]
		f := field(v, name)
		if !f.IsValid() || isUnset(f) {
			continue
		}
		ms := m.Shape(ref.Shape)
		switch ref.Location {
		case "header":
			res.Header.Set(wireName(name, ref), textOf(ms, f))
			continue
		case "statusCode":
			res.Status = int(reflect.Indirect(f).Int())
			continue
		case "headers", "uri", "querystring":
			continue
		}
		if name == s.Payload {
			switch ms.Type {
			case "blob":
				switch b := f.Interface().(type) {
				case []byte:
					res.Body, res.Length = bytes.NewReader(b), int64(len(b))
				case io.Reader:
					res.Body = b
				}
				res.Header.Set("Content-Type", "application/octet-stream")
			default:
				raw, err := json.Marshal(jsonOf(m, ms, f))
				if err != nil {
					return nil, err
				}
				res.Body, res.Length = bytes.NewReader(raw), int64(len(raw))
				res.Header.Set("Content-Type", "application/json")
			}
			continue
		}
		obj[wireName(name, ref)] = jsonOf(m, ms, f)
	}
	if res.Body == nil {
		raw, err := json.Marshal(obj)
		if err != nil {
			return nil, err
		}
		res.Body, res.Length = bytes.NewReader(raw), int64(len(raw))
		res.Header.Set("Content-Type", "application/json")
	}
	return res, nil
}

func isUnset(f reflect.Value) bool {
	switch f.Kind() {
	case reflect.Pointer, reflect.Interface, reflect.Slice, reflect.Map:
		return f.IsNil()
	case reflect.String:
		return f.String() == "" // SDK enums: "" means unset
	}
	return false
}

func textOf(s *awsmodel.Shape, f reflect.Value) string {
	f = reflect.Indirect(f)
	switch s.Type {
	case "timestamp":
		return f.Interface().(time.Time).UTC().Format(http.TimeFormat)
	case "integer", "long":
		return strconv.FormatInt(f.Int(), 10)
	case "boolean":
		return strconv.FormatBool(f.Bool())
	default:
		return f.String()
	}
}

// jsonOf renders f following shape s as a value encoding/json writes as
// REST-JSON: unset members left out, timestamps as epoch seconds.
func jsonOf(m *awsmodel.Model, s *awsmodel.Shape, f reflect.Value) any {
	if f.Kind() == reflect.Pointer || f.Kind() == reflect.Interface {
		if f.IsNil() {
			return nil
		}
		f = f.Elem()
	}
	switch s.Type {
	case "structure":
		obj := map[string]any{}
		for _, name := range sortedMembers(s) {
			ref := s.Members[name]
			sf := field(f, name)
			if !sf.IsValid() || isUnset(sf) {
				continue
			}
			obj[wireName(name, ref)] = jsonOf(m, m.Shape(ref.Shape), sf)
		}
		return obj
	case "list":
		out := make([]any, f.Len())
		for i := range out {
			out[i] = jsonOf(m, m.Shape(s.Member.Shape), f.Index(i))
		}
		return out
	case "map":
		out := map[string]any{}
		it := f.MapRange()
		for it.Next() {
			out[fmt.Sprint(it.Key().Interface())] = jsonOf(m, m.Shape(s.Value.Shape), it.Value())
		}
		return out
	case "timestamp":
		t := f.Interface().(time.Time)
		return json.Number(strconv.FormatFloat(float64(t.UnixMilli())/1000, 'f', -1, 64))
	case "blob":
		return base64.StdEncoding.EncodeToString(f.Bytes())
	case "string":
		return f.String()
	case "integer", "long":
		return f.Int()
	case "double", "float":
		return f.Float()
	case "boolean":
		return f.Bool()
	}
	return nil
}

// WriteRESTError writes err as REST-JSON services do: the code in
// x-amzn-ErrorType, {"message": …} plus the error's extra fields.
func WriteRESTError(w http.ResponseWriter, requestID string, err error) {
	e := awserr.As(err)
	body := map[string]any{"message": e.Message}
	var re *RESTError
	if errors.As(err, &re) {
		for k, v := range re.Fields {
			body[k] = v
		}
	}
	raw, _ := json.Marshal(body)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("x-amzn-ErrorType", e.Code)
	if requestID != "" {
		w.Header().Set("x-amzn-RequestId", requestID)
	}
	w.Header().Set("Content-Length", strconv.Itoa(len(raw)))
	w.WriteHeader(e.Status)
	_, _ = w.Write(raw)
}
