// Package api is the D-Bus contract between hangar's services: bus names,
// object paths, interface and method names, error names, and the Go types
// that travel as method arguments. Both sides use these definitions (the
// service exports method tables keyed by these names; callers call through
// the typed clients here), so no method name is typed twice.
//
// This package must stay free of service logic: it may marshal, never decide.
package api

import (
	"context"
	"errors"
	"fmt"

	"github.com/godbus/dbus/v5"
)

// Service names one service's place on the bus.
type Service struct {
	Name      string          // well-known bus name
	Path      dbus.ObjectPath // root object
	Interface string          // root interface
	Unit      string          // systemd unit
}

// The services, as ARCHITECTURE.md lists them.
var (
	Gateway    = Service{"dev.hangar.Gateway1", "/dev/hangar/Gateway1", "dev.hangar.Gateway1", "hangar-gateway.service"}
	Network    = Service{"dev.hangar.Network1", "/dev/hangar/Network1", "dev.hangar.Network1", "hangar-netd.service"}
	Compute    = Service{"dev.hangar.Compute1", "/dev/hangar/Compute1", "dev.hangar.Compute1", "hangar-vmd.service"}
	Storage    = Service{"dev.hangar.Storage1", "/dev/hangar/Storage1", "dev.hangar.Storage1", "hangar-ebsd.service"}
	Kubernetes = Service{"dev.hangar.Kubernetes1", "/dev/hangar/Kubernetes1", "dev.hangar.Kubernetes1", "hangar-k3sd.service"}
)

// Services lists every long-running service, in start order.
var Services = []Service{Network, Storage, Compute, Kubernetes, Gateway}

// Method returns the fully qualified name of a method of the service's root
// interface.
func (s Service) Method(name string) string { return s.Interface + "." + name }

// Object returns the bus object of the service's root path.
func (s Service) Object(conn *dbus.Conn) dbus.BusObject { return conn.Object(s.Name, s.Path) }

// Methods every service's root interface has.
const (
	// MethodStatus returns a ServiceStatus.
	MethodStatus = "Status"
)

// ServiceStatus is what Status returns: enough for `hangar status` to print
// one line per service without knowing its internals.
type ServiceStatus struct {
	State    string            // "running", "degraded", "starting"
	Detail   string            // the STATUS= line systemd shows
	Version  string            // build version
	Started  int64             // unix seconds
	Counts   map[string]uint32 // records or objects the service holds, by kind
	Problems []string          // readiness problems in words, empty when healthy
}

// Properties every service's root interface exposes.
const (
	PropVersion = "Version"
	PropStarted = "Started"
	PropState   = "State"
)

// Error names, mapped by the gateway to AWS error codes.
const (
	ErrNotFound             = "dev.hangar.Error.NotFound"
	ErrInvalidArgument      = "dev.hangar.Error.InvalidArgument"
	ErrInsufficientCapacity = "dev.hangar.Error.InsufficientCapacity"
	ErrConflict             = "dev.hangar.Error.Conflict" // exists with other settings, or in use
	ErrInUse                = "dev.hangar.Error.InUse"    // cannot remove: something depends on it
	ErrUnavailable          = "dev.hangar.Error.Unavailable"
	ErrFailed               = "dev.hangar.Error.Failed"
)

// Errorf makes a named D-Bus error for a method to return.
func Errorf(name, format string, args ...any) *dbus.Error {
	return dbus.NewError(name, []any{fmt.Sprintf(format, args...)})
}

// Error is a named error as a caller sees it.
type Error struct {
	Name    string
	Message string
}

func (e *Error) Error() string { return e.Message + " (" + e.Name + ")" }

// AsError turns an error from a call into *Error when it is a named D-Bus
// error, so callers can switch on Name.
func AsError(err error) (*Error, bool) {
	var pe *Error
	if errors.As(err, &pe) {
		return pe, true
	}
	var de dbus.Error
	if errors.As(err, &de) {
		return &Error{Name: de.Name, Message: bodyText(de.Body)}, true
	}
	var dp *dbus.Error
	if errors.As(err, &dp) {
		return &Error{Name: dp.Name, Message: bodyText(dp.Body)}, true
	}
	return nil, false
}

// IsName reports whether err is the named D-Bus error.
func IsName(err error, name string) bool {
	e, ok := AsError(err)
	return ok && e.Name == name
}

func bodyText(body []any) string {
	if len(body) > 0 {
		if s, ok := body[0].(string); ok {
			return s
		}
	}
	return "no message"
}

// Call calls method on the service's root object and stores the results in
// out. A named error comes back as *Error.
func Call(ctx context.Context, conn *dbus.Conn, s Service, method string, out []any, args ...any) error {
	return CallPath(ctx, conn, s, s.Path, s.Interface, method, out, args...)
}

// CallPath calls a method of iface on any object of the service.
func CallPath(ctx context.Context, conn *dbus.Conn, s Service, path dbus.ObjectPath, iface, method string, out []any, args ...any) error {
	call := conn.Object(s.Name, path).CallWithContext(ctx, iface+"."+method, 0, args...)
	if call.Err != nil {
		if e, ok := AsError(call.Err); ok {
			return e
		}
		return fmt.Errorf("calling %s.%s: %w", s.Name, method, call.Err)
	}
	if len(out) > 0 {
		if err := call.Store(out...); err != nil {
			return fmt.Errorf("decoding reply of %s.%s: %w", s.Name, method, err)
		}
	}
	return nil
}

// Status calls Status on a service.
func Status(ctx context.Context, conn *dbus.Conn, s Service) (ServiceStatus, error) {
	var st ServiceStatus
	err := Call(ctx, conn, s, MethodStatus, []any{&st})
	return st, err
}
