package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/insomniacslk/dhcp/dhcpv4/nclient4"
	"github.com/miekg/dns"

	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/internal/awsid"
)

// TestBenchNetd measures netd as VPCs accumulate (1, 10, 50): the time to
// build a VPC with 3 subnets and 100 interfaces, DHCP DISCOVER→ACK
// latency, DNS queries/s and IMDS requests/s from a guest namespace. Each
// figure is also given as a ratio to the same figure with 1 VPC, measured
// in the same run. make bench runs it (HANGAR_BENCH=1).
func TestBenchNetd(t *testing.T) {
	if os.Getenv("HANGAR_BENCH") == "" {
		t.Skip("skipping: a benchmark; make bench sets HANGAR_BENCH=1")
	}
	w := newWorld(t, "us-east-1")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	n := w.net

	type row struct {
		vpcs                int
		build               time.Duration
		dhcp                time.Duration
		dnsQPS, imdsQPS     float64
		leaseP99, buildPerI time.Duration
	}
	var rows []row
	background := 0
	addBackground := func() {
		vpc, sn, sg := awsid.New("vpc"), awsid.New("subnet"), awsid.New("sg")
		must(t, "background VPC", n.EnsureVPC(ctx, api.VPCSpec{VpcID: vpc, CIDR: "10.0.0.0/16", DNSSupport: true}))
		must(t, "background subnet", n.EnsureSubnet(ctx, vpc, api.SubnetSpec{SubnetID: sn, CIDR: "10.0.1.0/24"}))
		must(t, "background sg", n.SetSecurityGroup(ctx, vpc, api.SecurityGroupSpec{GroupID: sg, Rules: []api.SGRule{allOut("-1")}}))
		for i := 0; i < 2; i++ {
			_, err := n.AllocateInterface(ctx, api.InterfaceSpec{SubnetID: sn, EniID: awsid.New("eni"), MAC: fmt.Sprintf("02:bb:%02x:00:00:%02x", background, i+10), PrivateIP: fmt.Sprintf("10.0.1.%d", i+10), SecurityGroupIDs: []string{sg}})
			must(t, "background interface", err)
		}
		background++
	}
	for _, level := range []int{1, 10, 50} {
		for background < level-1 {
			addBackground()
		}
		// The measured VPC: 3 subnets, 100 interfaces.
		start := time.Now()
		vpc, sg := awsid.New("vpc"), awsid.New("sg")
		must(t, "EnsureVPC", n.EnsureVPC(ctx, api.VPCSpec{VpcID: vpc, CIDR: "10.0.0.0/16", DNSSupport: true}))
		must(t, "sg", n.SetSecurityGroup(ctx, vpc, api.SecurityGroupSpec{GroupID: sg, Rules: []api.SGRule{allOut("-1"), {Protocol: "-1", GroupID: sg}}}))
		var subnets []string
		for s := 0; s < 3; s++ {
			sn := awsid.New("subnet")
			must(t, "subnet", n.EnsureSubnet(ctx, vpc, api.SubnetSpec{SubnetID: sn, CIDR: fmt.Sprintf("10.0.%d.0/24", s+1)}))
			subnets = append(subnets, sn)
		}
		var enis []string
		for i := 0; i < 100; i++ {
			eni := awsid.New("eni")
			_, err := n.AllocateInterface(ctx, api.InterfaceSpec{SubnetID: subnets[i%3], EniID: eni, MAC: fmt.Sprintf("02:aa:%02x:00:%02x:%02x", level, i%3, i), PrivateIP: fmt.Sprintf("10.0.%d.%d", i%3+1, 10+i), SecurityGroupIDs: []string{sg}})
			must(t, "interface", err)
			enis = append(enis, eni)
		}
		build := time.Since(start)
		must(t, "metadata", n.SetInstanceMetadata(ctx, enis[0], api.InstanceMetadata{InstanceID: "i-0bench", HttpTokens: "optional"}))
		g := w.newGuest(ctx, fmt.Sprintf("bench%d", level), enis[0], fmt.Sprintf("02:aa:%02x:00:00:00", level))
		g.dhcp(t, w.dir)

		// DHCP: full DISCOVER→OFFER→REQUEST→ACK exchanges from the guest.
		var lat []time.Duration
		err := withNS(g.ns, func() error {
			c, err := nclient4.New("eth0", nclient4.WithTimeout(2*time.Second), nclient4.WithRetry(3))
			if err != nil {
				return err
			}
			defer c.Close()
			for i := 0; i < 50; i++ {
				t0 := time.Now()
				if _, err := c.Request(ctx); err != nil {
					return err
				}
				lat = append(lat, time.Since(t0))
			}
			return nil
		})
		must(t, "DHCP exchanges", err)
		sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })

		dnsQPS := rate(2*time.Second, 4, func() func() error {
			var conn *dns.Conn
			must(t, "DNS socket", withNS(g.ns, func() error {
				var err error
				conn, err = dns.DialTimeout("udp", "10.0.0.2:53", 2*time.Second)
				return err
			}))
			m := new(dns.Msg)
			m.SetQuestion("ip-10-0-2-11.ec2.internal.", dns.TypeA)
			return func() error {
				m.Id = dns.Id()
				_ = conn.SetDeadline(time.Now().Add(2 * time.Second))
				if err := conn.WriteMsg(m); err != nil {
					return err
				}
				r, err := conn.ReadMsg()
				if err == nil && len(r.Answer) != 1 {
					err = fmt.Errorf("answer %v", r)
				}
				return err
			}
		})
		imdsQPS := rate(2*time.Second, 4, func() func() error {
			tr := &http.Transport{DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
				var c net.Conn
				err := withNS(g.ns, func() error {
					var err error
					c, err = (&net.Dialer{}).DialContext(ctx, network, addr)
					return err
				})
				return c, err
			}}
			client := &http.Client{Transport: tr, Timeout: 2 * time.Second}
			return func() error {
				resp, err := client.Get("http://169.254.169.254/latest/meta-data/instance-id")
				if err != nil {
					return err
				}
				body, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if string(body) != "i-0bench" {
					return fmt.Errorf("IMDS said %q", body)
				}
				return nil
			}
		})
		rows = append(rows, row{vpcs: level, build: build, buildPerI: build / 100, dhcp: lat[len(lat)/2], leaseP99: lat[len(lat)*99/100], dnsQPS: dnsQPS, imdsQPS: imdsQPS})

		g.close()
		for _, e := range enis {
			must(t, "release", n.ReleaseInterface(ctx, e))
		}
		must(t, "DeleteVPC", n.DeleteVPC(ctx, vpc))
		background++ // the measured VPC is gone; keep the count of VPCs right
		addBackground()
	}
	var b strings.Builder
	base := rows[0]
	fmt.Fprintf(&b, "\nhangar-netd, namespace guests through real taps (2 cores); ratios are to the 1-VPC row of this run\n")
	fmt.Fprintf(&b, "%-5s %-26s %-26s %-22s %-22s\n", "VPCs", "build 3 subnets+100 ENIs", "DHCP DISCOVER→ACK p50/p99", "DNS queries/s", "IMDS requests/s")
	for _, r := range rows {
		fmt.Fprintf(&b, "%-5d %-26s %-26s %-22s %-22s\n", r.vpcs,
			fmt.Sprintf("%.2fs (x%.2f)", r.build.Seconds(), r.build.Seconds()/base.build.Seconds()),
			fmt.Sprintf("%.2fms/%.2fms (x%.2f)", ms(r.dhcp), ms(r.leaseP99), ms(r.dhcp)/ms(base.dhcp)),
			fmt.Sprintf("%.0f (x%.2f)", r.dnsQPS, r.dnsQPS/base.dnsQPS),
			fmt.Sprintf("%.0f (x%.2f)", r.imdsQPS, r.imdsQPS/base.imdsQPS))
	}
	t.Log(b.String())
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// rate runs workers callers of one operation for d and returns how many
// succeeded per second; any failure fails the figure (returns 0).
func rate(d time.Duration, workers int, mk func() func() error) float64 {
	var ok, failed atomic.Int64
	var wg sync.WaitGroup
	deadline := time.Now().Add(d)
	for i := 0; i < workers; i++ {
		op := mk()
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(deadline) {
				if err := op(); err != nil {
					failed.Add(1)
					return
				}
				ok.Add(1)
			}
		}()
	}
	wg.Wait()
	if failed.Load() > 0 {
		return 0
	}
	return float64(ok.Load()) / d.Seconds()
}
