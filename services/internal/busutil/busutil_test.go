package busutil

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/godbus/dbus/v5"
	"github.com/godbus/dbus/v5/prop"

	"hangar.dev/hangar/tests/harness"
)

// connect opens a connection to a private bus as the system bus.
func connect(t *testing.T, addr string) *dbus.Conn {
	t.Helper()
	t.Setenv("DBUS_SYSTEM_BUS_ADDRESS", addr)
	conn, err := Connect(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func TestExportIntrospectPropertiesAndName(t *testing.T) {
	addr := harness.StartBus(t)
	conn := connect(t, addr)
	srv := NewServer(conn)
	const (
		name  = "dev.hangar.Test1"
		iface = "dev.hangar.Test1"
	)
	root := dbus.ObjectPath("/dev/hangar/Test1")
	err := srv.Export(&Object{
		Path: root, Interface: iface,
		Methods: map[string]any{
			"Echo": func(s string, n uint32) (string, *dbus.Error) { return strings.Repeat(s, int(n)), nil },
			"Who":  func(sender dbus.Sender) (string, *dbus.Error) { return string(sender), nil },
		},
		Props: map[string]*prop.Prop{"Count": {Value: uint32(1), Emit: prop.EmitTrue}, "Names": {Value: map[string]string{}, Emit: prop.EmitTrue}},
	})
	if err != nil {
		t.Fatal(err)
	}
	child := root + "/thing/t_1"
	if err := srv.Export(&Object{Path: child, Interface: iface + ".Thing", Methods: map[string]any{}}); err != nil {
		t.Fatal(err)
	}
	if err := srv.ClaimName(name); err != nil {
		t.Fatal(err)
	}

	client := connect(t, addr)
	// A second owner is refused, not queued.
	if err := NewServer(client).ClaimName(name); err == nil {
		t.Fatal("a second process claimed the name")
	}
	obj := client.Object(name, root)
	var xml string
	if err := obj.Call("org.freedesktop.DBus.Introspectable.Introspect", 0).Store(&xml); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`<method name="Echo">`, `type="u" direction="in"`, `<property name="Count" type="u" access="read">`, `<node name="thing">`, "org.freedesktop.DBus.Properties"} {
		if !strings.Contains(xml, want) {
			t.Errorf("introspection lacks %s:\n%s", want, xml)
		}
	}
	who := xml[strings.Index(xml, `<method name="Who">`):]
	who = who[:strings.Index(who, "</method>")]
	if strings.Contains(who, `direction="in"`) {
		t.Errorf("the dbus.Sender parameter shows as an argument: %s", who)
	}
	var got string
	if err := obj.Call(iface+".Echo", 0, "ab", uint32(3)).Store(&got); err != nil || got != "ababab" {
		t.Fatalf("Echo = %q, %v", got, err)
	}

	// Set emits PropertiesChanged.
	if err := client.AddMatchSignal(dbus.WithMatchInterface("org.freedesktop.DBus.Properties"), dbus.WithMatchObjectPath(root)); err != nil {
		t.Fatal(err)
	}
	sigs := make(chan *dbus.Signal, 4)
	client.Signal(sigs)
	if err := srv.Set(root, "Count", uint32(2)); err != nil {
		t.Fatal(err)
	}
	if err := srv.Set(root, "Nope", uint32(2)); err == nil {
		t.Error("setting an unknown property succeeded")
	}
	select {
	case s := <-sigs:
		if s.Name != "org.freedesktop.DBus.Properties.PropertiesChanged" || !strings.Contains(s.Body[1].(map[string]dbus.Variant)["Count"].String(), "2") {
			t.Fatalf("signal %+v", s)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no PropertiesChanged")
	}
	v, err := obj.GetProperty(iface + ".Count")
	if err != nil || v.Value().(uint32) != 2 {
		t.Fatalf("Count = %v, %v", v, err)
	}

	// A map property is replaced, not merged: a key that goes is gone
	// (godbus's own Set would keep it), and the other properties stay.
	for _, m := range []map[string]string{{"a": "1", "b": "2"}, {"b": "3"}} {
		if err := srv.Set(root, "Names", m); err != nil {
			t.Fatal(err)
		}
	}
	var names map[string]string
	if v, err := obj.GetProperty(iface + ".Names"); err != nil || v.Store(&names) != nil || len(names) != 1 || names["b"] != "3" {
		t.Fatalf("Names = %v, %v; want map[b:3]", v, err)
	}
	if v, err := obj.GetProperty(iface + ".Count"); err != nil || v.Value().(uint32) != 2 {
		t.Fatalf("Count after a map update = %v, %v", v, err)
	}
	deadline := time.After(5 * time.Second)
	for seen := false; !seen; {
		select {
		case s := <-sigs:
			if v, ok := s.Body[1].(map[string]dbus.Variant)["Names"]; ok && strings.Contains(v.String(), `"b": "3"`) {
				seen = true
			}
		case <-deadline:
			t.Fatal("no PropertiesChanged for the map")
		}
	}

	srv.Unexport(child)
	if srv.Exported(child) {
		t.Fatal("child still exported")
	}
}

func TestWatchNameSeesOwnersComeAndGo(t *testing.T) {
	addr := harness.StartBus(t)
	watcher := connect(t, addr)
	events := make(chan bool, 10)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := WatchName(ctx, watcher, "dev.hangar.Peer1", func(up bool) { events <- up }); err != nil {
		t.Fatal(err)
	}
	next := func(want bool) {
		t.Helper()
		select {
		case got := <-events:
			if got != want {
				t.Fatalf("appeared(%v), want %v", got, want)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("no appeared(%v)", want)
		}
	}
	peer := connect(t, addr)
	if err := NewServer(peer).ClaimName("dev.hangar.Peer1"); err != nil {
		t.Fatal(err)
	}
	next(true)
	peer.Close()
	next(false)

	// A watcher started after the peer hears it at once.
	again := connect(t, addr)
	if err := NewServer(again).ClaimName("dev.hangar.Peer1"); err != nil {
		t.Fatal(err)
	}
	late := make(chan bool, 1)
	if err := WatchName(ctx, connect(t, addr), "dev.hangar.Peer1", func(up bool) { late <- up }); err != nil {
		t.Fatal(err)
	}
	select {
	case up := <-late:
		if !up {
			t.Fatal("a late watcher was told the name is gone")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a late watcher was not told the name has an owner")
	}
}
