// Package qmp is vmd's adapter to a QEMU monitor: it connects to a QMP
// unix socket (through digitalocean/go-qemu), runs commands with a context,
// and delivers events until the connection ends. It knows nothing about
// instances; the manager decides what an event means.
package qmp

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"sync"
	"time"

	goqmp "github.com/digitalocean/go-qemu/qmp"
)

// Event is one QMP event.
type Event struct {
	Name string
	Data map[string]any
	Time time.Time
}

// Monitor is one QMP connection.
type Monitor interface {
	// Execute runs a command; out, when not nil, receives the "return"
	// value.
	Execute(ctx context.Context, command string, args any, out any) error
	// ExecuteWithFile runs a command with a file descriptor passed along
	// (SCM_RIGHTS), as getfd and add-fd want it. QEMU keeps its own copy;
	// the caller still owns file.
	ExecuteWithFile(ctx context.Context, command string, args any, file *os.File, out any) error
	// Events are delivered in order; the channel is closed when the
	// connection ends (QEMU exited, or Close).
	Events() <-chan Event
	Close() error
}

// Dialer opens a monitor; the manager takes one so tests can fake QEMU.
type Dialer func(ctx context.Context, socket string) (Monitor, error)

// CommandError is an error QEMU returned for a command.
type CommandError struct {
	Command string
	Err     error
}

func (e *CommandError) Error() string { return fmt.Sprintf("qmp %s: %v", e.Command, e.Err) }
func (e *CommandError) Unwrap() error { return e.Err }

type monitor struct {
	mon    *goqmp.SocketMonitor
	events chan Event
	once   sync.Once
	closed chan struct{}
}

// Dial connects to the QMP socket and negotiates capabilities.
func Dial(ctx context.Context, socket string) (Monitor, error) {
	timeout := 5 * time.Second
	if d, ok := ctx.Deadline(); ok {
		timeout = time.Until(d)
	}
	mon, err := goqmp.NewSocketMonitor("unix", socket, timeout)
	if err != nil {
		return nil, fmt.Errorf("connecting to qmp socket %s: %w", socket, err)
	}
	done := make(chan error, 1)
	go func() { done <- mon.Connect() }()
	select {
	case err := <-done:
		if err != nil {
			_ = mon.Disconnect()
			return nil, fmt.Errorf("qmp handshake on %s: %w", socket, err)
		}
	case <-ctx.Done():
		_ = mon.Disconnect()
		<-done
		return nil, fmt.Errorf("qmp handshake on %s: %w", socket, ctx.Err())
	}
	raw, err := mon.Events(ctx)
	if err != nil {
		_ = mon.Disconnect()
		return nil, fmt.Errorf("qmp events on %s: %w", socket, err)
	}
	m := &monitor{mon: mon, events: make(chan Event, 256), closed: make(chan struct{})}
	go func() {
		// go-qemu blocks its reader until an event is taken, so events are
		// always drained here, also after Close.
		defer close(m.events)
		for e := range raw {
			ev := Event{Name: e.Event, Data: e.Data, Time: time.Unix(e.Timestamp.Seconds, e.Timestamp.Microseconds*1000)}
			select {
			case m.events <- ev:
			case <-m.closed:
			}
		}
	}()
	return m, nil
}

func (m *monitor) Events() <-chan Event { return m.events }

func (m *monitor) Close() error {
	var err error
	m.once.Do(func() {
		close(m.closed)
		err = m.mon.Disconnect()
	})
	return err
}

func (m *monitor) Execute(ctx context.Context, command string, args any, out any) error {
	return m.ExecuteWithFile(ctx, command, args, nil, out)
}

func (m *monitor) ExecuteWithFile(ctx context.Context, command string, args any, file *os.File, out any) error {
	cmd := map[string]any{"execute": command}
	if args != nil {
		cmd["arguments"] = args
	}
	b, err := json.Marshal(cmd)
	if err != nil {
		return fmt.Errorf("encoding qmp %s: %w", command, err)
	}
	type result struct {
		raw []byte
		err error
	}
	done := make(chan result, 1)
	go func() {
		raw, err := m.mon.RunWithFile(b, file)
		done <- result{raw, err}
	}()
	select {
	case r := <-done:
		if r.err != nil {
			return &CommandError{Command: command, Err: r.err}
		}
		if out == nil {
			return nil
		}
		var resp struct {
			Return json.RawMessage `json:"return"`
		}
		if err := json.Unmarshal(r.raw, &resp); err != nil {
			return fmt.Errorf("decoding qmp %s reply: %w", command, err)
		}
		if err := json.Unmarshal(resp.Return, out); err != nil {
			return fmt.Errorf("decoding qmp %s return: %w", command, err)
		}
		return nil
	case <-ctx.Done():
		// A reply that nobody reads would wedge go-qemu's reader, so a
		// command given up on costs the connection; the manager reconnects.
		_ = m.Close()
		if file != nil {
			// The caller closes file once we return: the send must be
			// over by then (closing the connection ends it), or a reused
			// descriptor number could reach QEMU.
			<-done
		}
		return fmt.Errorf("qmp %s: %w", command, ctx.Err())
	}
}
