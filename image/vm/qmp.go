package vm

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"time"
)

// QMP is a minimal QEMU Machine Protocol client: enough to power a guest
// down and to quit. Each message is one JSON object; events may arrive
// between a command and its reply and are skipped.
type QMP struct {
	conn net.Conn
	r    *bufio.Reader
}

type qmpMessage struct {
	QMP    json.RawMessage `json:"QMP"`
	Return json.RawMessage `json:"return"`
	Error  *struct {
		Class string `json:"class"`
		Desc  string `json:"desc"`
	} `json:"error"`
	Event string `json:"event"`
}

// DialQMP connects and negotiates capabilities.
func DialQMP(ctx context.Context, path string) (*QMP, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		return nil, fmt.Errorf("connecting to QMP at %s: %w", path, err)
	}
	q := &QMP{conn: conn, r: bufio.NewReader(conn)}
	var greeting qmpMessage
	if err := q.read(ctx, &greeting); err != nil || greeting.QMP == nil {
		conn.Close()
		return nil, fmt.Errorf("reading the QMP greeting: %v", err)
	}
	if _, err := q.Execute(ctx, "qmp_capabilities", nil); err != nil {
		conn.Close()
		return nil, err
	}
	return q, nil
}

func (q *QMP) read(ctx context.Context, m *qmpMessage) error {
	deadline := time.Now().Add(10 * time.Second)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	_ = q.conn.SetReadDeadline(deadline)
	line, err := q.r.ReadBytes('\n')
	if err != nil {
		return err
	}
	*m = qmpMessage{}
	return json.Unmarshal(line, m)
}

// Execute runs a command and returns its "return" value.
func (q *QMP) Execute(ctx context.Context, command string, args any) (json.RawMessage, error) {
	req := map[string]any{"execute": command}
	if args != nil {
		req["arguments"] = args
	}
	raw, _ := json.Marshal(req)
	if _, err := q.conn.Write(append(raw, '\n')); err != nil {
		return nil, fmt.Errorf("QMP %s: %w", command, err)
	}
	for {
		var m qmpMessage
		if err := q.read(ctx, &m); err != nil {
			return nil, fmt.Errorf("QMP %s: %w", command, err)
		}
		switch {
		case m.Event != "":
			continue
		case m.Error != nil:
			return nil, fmt.Errorf("QMP %s: %s: %s", command, m.Error.Class, m.Error.Desc)
		case m.Return != nil:
			return m.Return, nil
		}
	}
}

// Close ends the session.
func (q *QMP) Close() error { return q.conn.Close() }
