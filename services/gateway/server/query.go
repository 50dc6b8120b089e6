package server

import (
	"context"
	"fmt"
	"reflect"
	"strings"

	"hangar.dev/hangar/services/gateway/awsmodel"
)

// Handler is one operation's implementation: a method of a service value
// with the signature func(context.Context, *XInput) (*XOutput, error).
type Handler struct {
	Op   string
	In   reflect.Type // the input struct type (not a pointer)
	Out  reflect.Type // the output struct type (not a pointer)
	call reflect.Value
}

// Call runs the handler on in (a pointer to In).
func (h Handler) Call(ctx context.Context, in any) (any, error) {
	res := h.call.Call([]reflect.Value{reflect.ValueOf(ctx), reflect.ValueOf(in)})
	if err, _ := res[1].Interface().(error); err != nil {
		return nil, err
	}
	return res[0].Interface(), nil
}

var (
	ctxType = reflect.TypeOf((*context.Context)(nil)).Elem()
	errType = reflect.TypeOf((*error)(nil)).Elem()
)

// HandlersOf collects the methods of svc that are operations of model m:
// every exported method named after an operation, with the handler
// signature. The operation name is the method name, so it is written once.
// A method named after an operation with the wrong signature is a
// programming error and panics at start.
func HandlersOf(svc any, m *awsmodel.Model) map[string]Handler {
	out := map[string]Handler{}
	v := reflect.ValueOf(svc)
	t := v.Type()
	for i := 0; i < t.NumMethod(); i++ {
		meth := t.Method(i)
		if _, ok := m.Operations[meth.Name]; !ok {
			continue
		}
		ft := meth.Type // includes the receiver
		ok := ft.NumIn() == 3 && ft.In(1) == ctxType && ft.In(2).Kind() == reflect.Pointer && ft.In(2).Elem().Kind() == reflect.Struct &&
			ft.NumOut() == 2 && ft.Out(1) == errType
		if !ok {
			panic(fmt.Sprintf("server: %T.%s is named after an operation but is not func(context.Context, *Input) (*Output, error)", svc, meth.Name))
		}
		if ft.Out(0).Kind() != reflect.Pointer || ft.Out(0).Elem().Kind() != reflect.Struct {
			panic(fmt.Sprintf("server: %T.%s must return a pointer to an output struct", svc, meth.Name))
		}
		out[meth.Name] = Handler{Op: meth.Name, In: ft.In(2).Elem(), Out: ft.Out(0).Elem(), call: v.Method(i)}
	}
	return out
}

// readOnlyOp reports whether an operation only reads, by AWS's naming
// convention, which IAM's read-only policies also rely on.
func readOnlyOp(op string) bool {
	for _, p := range []string{"Describe", "Get", "List"} {
		if strings.HasPrefix(op, p) {
			return true
		}
	}
	return false
}

// dryRun reports whether in (a pointer to an input struct) has DryRun set.
func dryRun(in any) bool {
	v := reflect.ValueOf(in).Elem().FieldByName("DryRun")
	if !v.IsValid() {
		return false
	}
	if v.Kind() == reflect.Pointer {
		return !v.IsNil() && v.Elem().Bool()
	}
	return v.Kind() == reflect.Bool && v.Bool()
}
