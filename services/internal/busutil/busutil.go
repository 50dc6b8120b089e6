// Package busutil exports hangar's objects on D-Bus the way every hangar
// service must: each object with its methods, its properties (through
// org.freedesktop.DBus.Properties, with PropertiesChanged) and an
// Introspectable that lists its interfaces and child objects, all exported
// before the service claims its name, so no caller ever sees a name without
// its methods.
//
// Method tables are keyed by the method names in package api, so no method
// name is typed twice.
package busutil

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"sort"
	"strings"
	"sync"

	"github.com/godbus/dbus/v5"
	"github.com/godbus/dbus/v5/introspect"
	"github.com/godbus/dbus/v5/prop"
)

// Object is one object to export.
type Object struct {
	Path      dbus.ObjectPath
	Interface string
	// Methods maps method names to funcs whose last result is *dbus.Error.
	// A first parameter of type dbus.Sender receives the caller's unique name.
	Methods map[string]any
	// Props are the interface's properties; nil for none.
	Props map[string]*prop.Prop
	// Signals are declared for introspection only; emit with Server.Emit.
	Signals []introspect.Signal

	props *prop.Properties
}

// Server tracks what a connection exports, so introspection can list child
// objects that come and go (instances, volumes).
type Server struct {
	conn  *dbus.Conn
	mu    sync.Mutex
	objs  map[dbus.ObjectPath]*Object
	setMu sync.Mutex // serialises Export, Unexport and Set, which may re-export an object's props
}

// NewServer wraps a connection.
func NewServer(conn *dbus.Conn) *Server {
	return &Server{conn: conn, objs: map[dbus.ObjectPath]*Object{}}
}

// Conn returns the underlying connection.
func (s *Server) Conn() *dbus.Conn { return s.conn }

// Export exports o. Exporting a path again replaces the earlier object.
func (s *Server) Export(o *Object) error {
	s.setMu.Lock()
	defer s.setMu.Unlock()
	if err := s.conn.ExportMethodTable(o.Methods, o.Path, o.Interface); err != nil {
		return fmt.Errorf("exporting %s on %s: %w", o.Interface, o.Path, err)
	}
	if o.Props != nil {
		props, err := prop.Export(s.conn, o.Path, prop.Map{o.Interface: o.Props})
		if err != nil {
			return fmt.Errorf("exporting properties of %s: %w", o.Path, err)
		}
		o.props = props
	}
	s.mu.Lock()
	s.objs[o.Path] = o
	s.mu.Unlock()
	path := o.Path
	err := s.conn.ExportMethodTable(map[string]any{
		"Introspect": func() (string, *dbus.Error) { return s.introspect(path), nil },
	}, o.Path, "org.freedesktop.DBus.Introspectable")
	if err != nil {
		return fmt.Errorf("exporting introspection of %s: %w", o.Path, err)
	}
	return nil
}

// Unexport removes the object at path.
func (s *Server) Unexport(path dbus.ObjectPath) {
	s.setMu.Lock()
	defer s.setMu.Unlock()
	s.mu.Lock()
	o := s.objs[path]
	delete(s.objs, path)
	s.mu.Unlock()
	if o == nil {
		return
	}
	_ = s.conn.Export(nil, path, o.Interface)
	_ = s.conn.Export(nil, path, "org.freedesktop.DBus.Properties")
	_ = s.conn.Export(nil, path, "org.freedesktop.DBus.Introspectable")
}

// Exported reports whether path is exported.
func (s *Server) Exported(path dbus.ObjectPath) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.objs[path] != nil
}

// Set updates a property of the object at path, emitting PropertiesChanged
// as the property's Emit says. Setting an unknown property is an error.
func (s *Server) Set(path dbus.ObjectPath, name string, v any) error {
	s.setMu.Lock()
	defer s.setMu.Unlock()
	s.mu.Lock()
	o := s.objs[path]
	s.mu.Unlock()
	if o == nil || o.props == nil {
		return fmt.Errorf("no properties exported at %s", path)
	}
	if _, ok := o.Props[name]; !ok {
		return fmt.Errorf("%s has no property %s", path, name)
	}
	if reflect.ValueOf(v).Kind() == reflect.Map {
		return s.setMap(o, name, v)
	}
	// SetMust bypasses the Writable check, which guards callers on the bus,
	// not the service itself; it panics only on unknown names, checked above.
	o.props.SetMust(o.Interface, name, v)
	return nil
}

// setMap replaces a map-valued property. godbus's prop stores a new value
// into the old one, and for a map that adds the new keys to the old map:
// a key once set would never go (netd's VPC Interfaces kept every released
// interface). So the object's properties are exported anew, with the
// current values and this map, and the change is signalled as prop would.
// s.setMu is held.
func (s *Server) setMap(o *Object, name string, v any) error {
	cur := make(map[string]*prop.Prop, len(o.Props))
	for n, p := range o.Props {
		cp := *p
		cp.Value = o.props.GetMust(o.Interface, n)
		cur[n] = &cp
	}
	cur[name].Value = v
	props, err := prop.Export(s.conn, o.Path, prop.Map{o.Interface: cur})
	if err != nil {
		return fmt.Errorf("updating %s of %s: %w", name, o.Path, err)
	}
	o.props = props
	switch o.Props[name].Emit {
	case prop.EmitTrue:
		return s.conn.Emit(o.Path, "org.freedesktop.DBus.Properties.PropertiesChanged",
			o.Interface, map[string]dbus.Variant{name: dbus.MakeVariant(v)}, []string{})
	case prop.EmitInvalidates:
		return s.conn.Emit(o.Path, "org.freedesktop.DBus.Properties.PropertiesChanged",
			o.Interface, map[string]dbus.Variant{}, []string{name})
	}
	return nil
}

// Emit sends a signal from path.
func (s *Server) Emit(path dbus.ObjectPath, iface, name string, args ...any) error {
	return s.conn.Emit(path, iface+"."+name, args...)
}

// ClaimName requests the well-known name, refusing to queue behind another
// owner: a second copy of a service must fail loudly, not wait.
func (s *Server) ClaimName(name string) error {
	reply, err := s.conn.RequestName(name, dbus.NameFlagDoNotQueue)
	if err != nil {
		return fmt.Errorf("requesting bus name %s: %w", name, err)
	}
	if reply != dbus.RequestNameReplyPrimaryOwner && reply != dbus.RequestNameReplyAlreadyOwner {
		return fmt.Errorf("bus name %s is owned by another process", name)
	}
	return nil
}

var (
	senderType  = reflect.TypeOf(dbus.Sender(""))
	messageType = reflect.TypeOf(dbus.Message{})
)

// Methods builds introspection data from a method table.
func Methods(table map[string]any) []introspect.Method {
	names := make([]string, 0, len(table))
	for n := range table {
		names = append(names, n)
	}
	sort.Strings(names)
	var out []introspect.Method
	for _, n := range names {
		t := reflect.TypeOf(table[n])
		if t == nil || t.Kind() != reflect.Func {
			continue
		}
		m := introspect.Method{Name: n}
		for i := 0; i < t.NumIn(); i++ {
			in := t.In(i)
			if in == senderType || in == messageType {
				continue
			}
			m.Args = append(m.Args, introspect.Arg{Name: fmt.Sprintf("arg%d", len(m.Args)), Type: dbus.SignatureOfType(in).String(), Direction: "in"})
		}
		for i := 0; i < t.NumOut()-1; i++ {
			m.Args = append(m.Args, introspect.Arg{Name: fmt.Sprintf("out%d", i), Type: dbus.SignatureOfType(t.Out(i)).String(), Direction: "out"})
		}
		out = append(out, m)
	}
	return out
}

func (s *Server) introspect(path dbus.ObjectPath) string {
	s.mu.Lock()
	o := s.objs[path]
	children := map[string]bool{}
	prefix := string(path) + "/"
	if path == "/" {
		prefix = "/"
	}
	for p := range s.objs {
		if rest, ok := strings.CutPrefix(string(p), prefix); ok && rest != "" {
			name, _, _ := strings.Cut(rest, "/")
			children[name] = true
		}
	}
	s.mu.Unlock()

	node := introspect.Node{Interfaces: []introspect.Interface{introspect.IntrospectData, prop.IntrospectData}}
	if o != nil {
		iface := introspect.Interface{Name: o.Interface, Methods: Methods(o.Methods), Signals: o.Signals}
		if o.props != nil {
			iface.Properties = o.props.Introspection(o.Interface)
		}
		node.Interfaces = append(node.Interfaces, iface)
	}
	names := make([]string, 0, len(children))
	for c := range children {
		names = append(names, c)
	}
	sort.Strings(names)
	for _, c := range names {
		node.Children = append(node.Children, introspect.Node{Name: c})
	}
	return string(introspect.NewIntrospectable(&node))
}

// Connect opens the system bus (DBUS_SYSTEM_BUS_ADDRESS when set, as in
// `hangar dev` and tests), giving up when ctx ends.
func Connect(ctx context.Context) (*dbus.Conn, error) {
	conn, err := dbus.ConnectSystemBus(dbus.WithContext(ctx))
	if err != nil {
		return nil, fmt.Errorf("connecting to the system bus: %w", err)
	}
	return conn, nil
}

// ErrorName returns the D-Bus error name of err, or "" when err is not a
// D-Bus error.
func ErrorName(err error) string {
	var dErr dbus.Error
	if errors.As(err, &dErr) {
		return dErr.Name
	}
	var pErr *dbus.Error
	if errors.As(err, &pErr) {
		return pErr.Name
	}
	return ""
}

// ErrorMessage returns the human text of a D-Bus error.
func ErrorMessage(err error) string {
	var dErr dbus.Error
	if errors.As(err, &dErr) && len(dErr.Body) > 0 {
		if s, ok := dErr.Body[0].(string); ok {
			return s
		}
	}
	return err.Error()
}
