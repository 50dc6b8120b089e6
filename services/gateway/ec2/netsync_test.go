package ec2

import (
	"context"
	"log/slog"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"

	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/internal/hostconf"
	"hangar.dev/hangar/services/internal/store"
)

// fakeNet is hangar-netd as the gateway sees it: the last state pushed for
// each VPC.
type fakeNet struct {
	mu      sync.Mutex
	vpcs    map[string]api.VPCState
	syncs   int
	fail    bool
	ifaces  map[string]api.InterfaceSpec
	md      map[string]api.InstanceMetadata
	changed chan struct{}
}

func newFakeNet() *fakeNet {
	return &fakeNet{vpcs: map[string]api.VPCState{}, ifaces: map[string]api.InterfaceSpec{}, md: map[string]api.InstanceMetadata{}, changed: make(chan struct{}, 100)}
}

func (f *fakeNet) note() {
	select {
	case f.changed <- struct{}{}:
	default:
	}
}

func (f *fakeNet) SyncVPC(_ context.Context, s api.VPCState) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fail {
		return &api.Error{Name: api.ErrUnavailable, Message: "netd is down"}
	}
	f.vpcs[s.VPC.VpcID] = s
	f.syncs++
	f.note()
	return nil
}

func (f *fakeNet) DeleteVPC(_ context.Context, id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fail {
		return &api.Error{Name: api.ErrUnavailable, Message: "netd is down"}
	}
	delete(f.vpcs, id)
	f.note()
	return nil
}

func (f *fakeNet) ListVPCs(context.Context) ([]string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for id := range f.vpcs {
		out = append(out, id)
	}
	return out, nil
}

func (f *fakeNet) AllocateInterface(_ context.Context, s api.InterfaceSpec) (api.InterfaceInfo, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fail {
		return api.InterfaceInfo{}, &api.Error{Name: api.ErrUnavailable, Message: "netd is down"}
	}
	f.ifaces[s.EniID] = s
	return api.InterfaceInfo{EniID: s.EniID, VpcID: s.VpcID, SubnetID: s.SubnetID, Tap: "tap-" + s.EniID[4:12], Namespace: "hangar-" + s.VpcID, MAC: s.MAC, PrivateIP: s.PrivateIP}, nil
}

func (f *fakeNet) ReleaseInterface(_ context.Context, id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.ifaces, id)
	return nil
}

func (f *fakeNet) SetInstanceMetadata(_ context.Context, id string, md api.InstanceMetadata) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.md[id] = md
	return nil
}

func (f *fakeNet) ClearInstanceMetadata(_ context.Context, id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.md, id)
	return nil
}

func (f *fakeNet) state(id string) (api.VPCState, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	s, ok := f.vpcs[id]
	return s, ok
}

// newNetSvc is a Service wired to a fake netd, with its push loop running.
func newNetSvc(t *testing.T) (*Service, *fakeNet) {
	t.Helper()
	db, err := store.Open(filepath.Join(t.TempDir(), "state.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	cfg := hostconf.Defaults()
	cfg.AccountID = testAccount
	s := New(db, cfg, slog.New(slog.DiscardHandler))
	fn := newFakeNet()
	s.SetNetwork(fn)
	if err := s.Init(bg); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(bg)
	t.Cleanup(cancel)
	s.StartNetwork(ctx)
	s.NetworkAppeared(ctx)
	return s, fn
}

// eventually waits for cond, named, as the push is asynchronous.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestNetSyncPushesEveryChangeAndFlipsToAvailable(t *testing.T) {
	s, fn := newNetSvc(t)
	vpc := must[*ec2.CreateVpcOutput](t)(s.CreateVpc(bg, &ec2.CreateVpcInput{CidrBlock: ptr("10.20.0.0/16")})).Vpc
	if vpc.State != types.VpcStatePending {
		t.Fatalf("a new VPC is %s before netd built it, want pending as AWS answers", vpc.State)
	}
	id := *vpc.VpcId
	eventually(t, "the VPC pushed and available", func() bool {
		st, ok := fn.state(id)
		if !ok || st.VPC.CIDR != "10.20.0.0/16" || len(st.SecurityGroups) != 1 || len(st.RouteTables) != 1 {
			return false
		}
		out, err := s.DescribeVpcs(bg, &ec2.DescribeVpcsInput{VpcIds: []string{id}})
		return err == nil && out.Vpcs[0].State == types.VpcStateAvailable
	})

	sn := must[*ec2.CreateSubnetOutput](t)(s.CreateSubnet(bg, &ec2.CreateSubnetInput{VpcId: &id, CidrBlock: ptr("10.20.1.0/24")})).Subnet
	sg := must[*ec2.CreateSecurityGroupOutput](t)(s.CreateSecurityGroup(bg, &ec2.CreateSecurityGroupInput{VpcId: &id, GroupName: ptr("web"), Description: ptr("web")}))
	must[*ec2.AuthorizeSecurityGroupIngressOutput](t)(s.AuthorizeSecurityGroupIngress(bg, &ec2.AuthorizeSecurityGroupIngressInput{
		GroupId:       sg.GroupId,
		IpPermissions: []types.IpPermission{{IpProtocol: ptr("tcp"), FromPort: ptr(int32(22)), ToPort: ptr(int32(22)), IpRanges: []types.IpRange{{CidrIp: ptr("10.20.1.0/24")}}, Ipv6Ranges: []types.Ipv6Range{{CidrIpv6: ptr("::/0")}}}},
	}))
	igw := must[*ec2.CreateInternetGatewayOutput](t)(s.CreateInternetGateway(bg, &ec2.CreateInternetGatewayInput{})).InternetGateway
	must[*ec2.AttachInternetGatewayOutput](t)(s.AttachInternetGateway(bg, &ec2.AttachInternetGatewayInput{InternetGatewayId: igw.InternetGatewayId, VpcId: &id}))
	rt := must[*ec2.CreateRouteTableOutput](t)(s.CreateRouteTable(bg, &ec2.CreateRouteTableInput{VpcId: &id})).RouteTable
	must[*ec2.CreateRouteOutput](t)(s.CreateRoute(bg, &ec2.CreateRouteInput{RouteTableId: rt.RouteTableId, DestinationCidrBlock: ptr("0.0.0.0/0"), GatewayId: igw.InternetGatewayId}))
	must[*ec2.AssociateRouteTableOutput](t)(s.AssociateRouteTable(bg, &ec2.AssociateRouteTableInput{RouteTableId: rt.RouteTableId, SubnetId: sn.SubnetId}))

	eventually(t, "subnet, group rules, gateway and routes pushed", func() bool {
		st, _ := fn.state(id)
		if len(st.Subnets) != 1 || st.InternetGateway != *igw.InternetGatewayId || len(st.RouteTables) != 2 {
			return false
		}
		var web *api.SecurityGroupSpec
		for i := range st.SecurityGroups {
			if st.SecurityGroups[i].GroupID == *sg.GroupId {
				web = &st.SecurityGroups[i]
			}
		}
		// The IPv6 rule has no traffic to match in netd and is left out;
		// the default egress rule is sent like any other.
		if web == nil || len(web.Rules) != 2 {
			return false
		}
		for _, t := range st.RouteTables {
			if t.RouteTableID == *rt.RouteTableId {
				return len(t.SubnetIDs) == 1 && len(t.Routes) == 1 && t.Routes[0].Target == *igw.InternetGatewayId
			}
		}
		return false
	})
	out := must[*ec2.DescribeSubnetsOutput](t)(s.DescribeSubnets(bg, &ec2.DescribeSubnetsInput{SubnetIds: []string{*sn.SubnetId}}))
	if out.Subnets[0].State != types.SubnetStateAvailable {
		t.Fatalf("subnet is %s after the push", out.Subnets[0].State)
	}

	// Revoking the rule reaches netd: live traffic follows within a second.
	must[*ec2.RevokeSecurityGroupIngressOutput](t)(s.RevokeSecurityGroupIngress(bg, &ec2.RevokeSecurityGroupIngressInput{
		GroupId:       sg.GroupId,
		IpPermissions: []types.IpPermission{{IpProtocol: ptr("tcp"), FromPort: ptr(int32(22)), ToPort: ptr(int32(22)), IpRanges: []types.IpRange{{CidrIp: ptr("10.20.1.0/24")}}}},
	}))
	eventually(t, "the revoke pushed", func() bool {
		st, _ := fn.state(id)
		for _, g := range st.SecurityGroups {
			if g.GroupID == *sg.GroupId {
				return len(g.Rules) == 1 && g.Rules[0].Egress
			}
		}
		return false
	})

	// Teardown: netd forgets the VPC when its record goes.
	must[*ec2.DisassociateRouteTableOutput](t)(s.DisassociateRouteTable(bg, &ec2.DisassociateRouteTableInput{AssociationId: func() *string {
		r := must[*ec2.DescribeRouteTablesOutput](t)(s.DescribeRouteTables(bg, &ec2.DescribeRouteTablesInput{RouteTableIds: []string{*rt.RouteTableId}}))
		return r.RouteTables[0].Associations[0].RouteTableAssociationId
	}()}))
	must[*ec2.DeleteRouteTableOutput](t)(s.DeleteRouteTable(bg, &ec2.DeleteRouteTableInput{RouteTableId: rt.RouteTableId}))
	must[*ec2.DetachInternetGatewayOutput](t)(s.DetachInternetGateway(bg, &ec2.DetachInternetGatewayInput{InternetGatewayId: igw.InternetGatewayId, VpcId: &id}))
	must[*ec2.DeleteSecurityGroupOutput](t)(s.DeleteSecurityGroup(bg, &ec2.DeleteSecurityGroupInput{GroupId: sg.GroupId}))
	must[*ec2.DeleteSubnetOutput](t)(s.DeleteSubnet(bg, &ec2.DeleteSubnetInput{SubnetId: sn.SubnetId}))
	must[*ec2.DeleteVpcOutput](t)(s.DeleteVpc(bg, &ec2.DeleteVpcInput{VpcId: &id}))
	eventually(t, "the VPC gone from netd", func() bool { _, ok := fn.state(id); return !ok })
}

func TestNetSyncRetriesWhileNetdIsDown(t *testing.T) {
	s, fn := newNetSvc(t)
	fn.mu.Lock()
	fn.fail = true
	fn.mu.Unlock()
	id := *must[*ec2.CreateVpcOutput](t)(s.CreateVpc(bg, &ec2.CreateVpcInput{CidrBlock: ptr("10.30.0.0/16")})).Vpc.VpcId
	time.Sleep(100 * time.Millisecond)
	out := must[*ec2.DescribeVpcsOutput](t)(s.DescribeVpcs(bg, &ec2.DescribeVpcsInput{VpcIds: []string{id}}))
	if out.Vpcs[0].State != types.VpcStatePending {
		t.Fatalf("VPC is %s while netd refuses it, want pending", out.Vpcs[0].State)
	}
	fn.mu.Lock()
	fn.fail = false
	fn.mu.Unlock()
	eventually(t, "the retry to succeed", func() bool { _, ok := fn.state(id); return ok })
}

func TestNetSyncResyncDeletesWhatHasNoRecord(t *testing.T) {
	s, fn := newNetSvc(t)
	fn.mu.Lock()
	fn.vpcs["vpc-0123456789abcdef0"] = api.VPCState{VPC: api.VPCSpec{VpcID: "vpc-0123456789abcdef0"}}
	fn.mu.Unlock()
	s.NetworkAppeared(bg)
	eventually(t, "the stray VPC deleted", func() bool { _, ok := fn.state("vpc-0123456789abcdef0"); return !ok })
	var def string
	_ = s.db.View(func(tx *store.Tx) error { def = defaultVPC(tx); return nil })
	if _, ok := fn.state(def); !ok {
		t.Fatal("the default VPC was not pushed on resync")
	}
}
