package ec2

import (
	"log/slog"
	"net/netip"
	"path/filepath"
	"reflect"
	"testing"

	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"

	"hangar.dev/hangar/services/internal/api"
	"hangar.dev/hangar/services/internal/hostconf"
	"hangar.dev/hangar/services/internal/store"
)

// eipSvc is a Service whose PUBLIC_IP_POOL is pool.
func eipSvc(t *testing.T, pool ...string) *Service {
	t.Helper()
	db, err := store.Open(filepath.Join(t.TempDir(), "state.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	cfg := hostconf.Defaults()
	cfg.AccountID = testAccount
	for _, p := range pool {
		cfg.PublicIPPool = append(cfg.PublicIPPool, netip.MustParsePrefix(p))
	}
	s := New(db, cfg, slog.New(slog.DiscardHandler))
	if err := s.Init(bg); err != nil {
		t.Fatal(err)
	}
	return s
}

// putInterface stores a network interface record the way the interface
// handlers do (the SDK's NetworkInterface shape in the "eni" bucket).
func putInterface(t *testing.T, s *Service, eni, vpc, ip, instance string) {
	t.Helper()
	ni := types.NetworkInterface{NetworkInterfaceId: ptr(eni), VpcId: ptr(vpc), PrivateIpAddress: ptr(ip), OwnerId: ptr(testAccount),
		PrivateIpAddresses: []types.NetworkInterfacePrivateIpAddress{{PrivateIpAddress: ptr(ip), Primary: ptr(true)}}}
	if instance != "" {
		ni.Attachment = &types.NetworkInterfaceAttachment{InstanceId: ptr(instance), DeviceIndex: ptr(int32(0))}
	}
	if err := s.db.Update(func(tx *store.Tx) error { return tx.Put(bucketInterfaces, eni, ni) }); err != nil {
		t.Fatal(err)
	}
}

func TestAllocateAddress(t *testing.T) {
	s := eipSvc(t, "192.0.2.52/31", "192.0.2.48/31")
	a := must[*ec2.AllocateAddressOutput](t)(s.AllocateAddress(bg, &ec2.AllocateAddressInput{Domain: types.DomainTypeVpc,
		TagSpecifications: []types.TagSpecification{{ResourceType: types.ResourceTypeElasticIp, Tags: []types.Tag{{Key: ptr("Name"), Value: ptr("web")}}}}}))
	if *a.PublicIp != "192.0.2.48" || a.Domain != types.DomainTypeVpc || *a.NetworkBorderGroup != "us-east-1" || len(*a.AllocationId) != len("eipalloc-")+17 {
		t.Fatalf("first allocation = %+v", a)
	}
	b := must[*ec2.AllocateAddressOutput](t)(s.AllocateAddress(bg, &ec2.AllocateAddressInput{Address: ptr("192.0.2.53")}))
	if *b.PublicIp != "192.0.2.53" {
		t.Fatalf("asked for .53, got %s", *b.PublicIp)
	}
	before := snapshot(t, s)
	for _, tc := range []struct {
		name string
		in   ec2.AllocateAddressInput
		code string
	}{
		{"an address in use", ec2.AllocateAddressInput{Address: ptr("192.0.2.48")}, "InvalidAddress.InUse"},
		{"an address outside the pool", ec2.AllocateAddressInput{Address: ptr("198.51.100.1")}, "InvalidAddress.NotFound"},
		{"not an address", ec2.AllocateAddressInput{Address: ptr("nope")}, "InvalidParameterValue"},
		{"EC2-Classic", ec2.AllocateAddressInput{Domain: types.DomainTypeStandard}, "InvalidParameterValue"},
		{"another pool", ec2.AllocateAddressInput{PublicIpv4Pool: ptr("ipv4pool-ec2-1")}, "InvalidPublicIpv4PoolID.NotFound"},
		{"another border group", ec2.AllocateAddressInput{NetworkBorderGroup: ptr("us-west-2")}, "InvalidParameterValue"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := s.AllocateAddress(bg, &tc.in)
			wantCode(t, err, tc.code)
		})
	}
	if !reflect.DeepEqual(before, snapshot(t, s)) {
		t.Fatal("a refused AllocateAddress changed the records")
	}
	for _, want := range []string{"192.0.2.49", "192.0.2.52"} {
		c := must[*ec2.AllocateAddressOutput](t)(s.AllocateAddress(bg, &ec2.AllocateAddressInput{}))
		if *c.PublicIp != want {
			t.Fatalf("next free = %s, want %s", *c.PublicIp, want)
		}
	}
	_, err := s.AllocateAddress(bg, &ec2.AllocateAddressInput{})
	wantCode(t, err, "AddressLimitExceeded")
	// A released address is free again; its allocation id is not reused.
	must[*ec2.ReleaseAddressOutput](t)(s.ReleaseAddress(bg, &ec2.ReleaseAddressInput{AllocationId: a.AllocationId}))
	again := must[*ec2.AllocateAddressOutput](t)(s.AllocateAddress(bg, &ec2.AllocateAddressInput{}))
	if *again.PublicIp != "192.0.2.48" || *again.AllocationId == *a.AllocationId {
		t.Fatalf("after release: %+v (old id %s)", again, *a.AllocationId)
	}
	_, err = eipSvc(t).AllocateAddress(bg, &ec2.AllocateAddressInput{})
	wantCode(t, err, "AddressLimitExceeded")
	_, err = s.ReleaseAddress(bg, &ec2.ReleaseAddressInput{AllocationId: a.AllocationId})
	wantCode(t, err, "InvalidAllocationID.NotFound")
	_, err = s.ReleaseAddress(bg, &ec2.ReleaseAddressInput{AllocationId: ptr("eipalloc-zz")})
	wantCode(t, err, "InvalidAllocationID.Malformed")
}

func TestAssociateAddress(t *testing.T) {
	s := eipSvc(t, "192.0.2.48/29")
	vpc := mkVPC(t, s, "10.0.0.0/16")
	putInterface(t, s, "eni-0aaaaaaaaaaaaaaaa", vpc, "10.0.1.10", "i-0aaaaaaaaaaaaaaaa")
	putInterface(t, s, "eni-0bbbbbbbbbbbbbbbb", vpc, "10.0.1.11", "")
	a := must[*ec2.AllocateAddressOutput](t)(s.AllocateAddress(bg, &ec2.AllocateAddressInput{}))
	b := must[*ec2.AllocateAddressOutput](t)(s.AllocateAddress(bg, &ec2.AllocateAddressInput{}))

	before := snapshot(t, s)
	for _, tc := range []struct {
		name string
		in   ec2.AssociateAddressInput
		code string
	}{
		{"no target", ec2.AssociateAddressInput{AllocationId: a.AllocationId}, "MissingParameter"},
		{"both targets", ec2.AssociateAddressInput{AllocationId: a.AllocationId, InstanceId: ptr("i-0aaaaaaaaaaaaaaaa"), NetworkInterfaceId: ptr("eni-0bbbbbbbbbbbbbbbb")}, "InvalidParameterCombination"},
		{"unknown instance", ec2.AssociateAddressInput{AllocationId: a.AllocationId, InstanceId: ptr("i-0cccccccccccccccc")}, "InvalidInstanceID.NotFound"},
		{"unknown interface", ec2.AssociateAddressInput{AllocationId: a.AllocationId, NetworkInterfaceId: ptr("eni-0cccccccccccccccc")}, "InvalidNetworkInterfaceID.NotFound"},
		{"unknown allocation", ec2.AssociateAddressInput{AllocationId: ptr("eipalloc-0cccccccccccccccc"), InstanceId: ptr("i-0aaaaaaaaaaaaaaaa")}, "InvalidAllocationID.NotFound"},
		{"unknown public IP", ec2.AssociateAddressInput{PublicIp: ptr("192.0.2.55"), InstanceId: ptr("i-0aaaaaaaaaaaaaaaa")}, "InvalidAddress.NotFound"},
		{"a private IP not the interface's", ec2.AssociateAddressInput{AllocationId: a.AllocationId, NetworkInterfaceId: ptr("eni-0bbbbbbbbbbbbbbbb"), PrivateIpAddress: ptr("10.0.1.99")}, "InvalidParameterValue"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := s.AssociateAddress(bg, &tc.in)
			wantCode(t, err, tc.code)
		})
	}
	if !reflect.DeepEqual(before, snapshot(t, s)) {
		t.Fatal("a refused AssociateAddress changed the records")
	}

	assoc := must[*ec2.AssociateAddressOutput](t)(s.AssociateAddress(bg, &ec2.AssociateAddressInput{AllocationId: a.AllocationId, InstanceId: ptr("i-0aaaaaaaaaaaaaaaa")}))
	// Repeating the same association is harmless and keeps its id.
	same := must[*ec2.AssociateAddressOutput](t)(s.AssociateAddress(bg, &ec2.AssociateAddressInput{PublicIp: a.PublicIp, NetworkInterfaceId: ptr("eni-0aaaaaaaaaaaaaaaa")}))
	if *same.AssociationId != *assoc.AssociationId {
		t.Errorf("repeating an association gave %s, then %s", *assoc.AssociationId, *same.AssociationId)
	}
	d := must[*ec2.DescribeAddressesOutput](t)(s.DescribeAddresses(bg, &ec2.DescribeAddressesInput{Filters: []types.Filter{filter("instance-id", "i-0aaaaaaaaaaaaaaaa")}}))
	if len(d.Addresses) != 1 || *d.Addresses[0].PublicIp != *a.PublicIp || *d.Addresses[0].PrivateIpAddress != "10.0.1.10" ||
		*d.Addresses[0].NetworkInterfaceId != "eni-0aaaaaaaaaaaaaaaa" || *d.Addresses[0].AssociationId != *assoc.AssociationId || *d.Addresses[0].NetworkInterfaceOwnerId != testAccount {
		t.Fatalf("describe by instance = %+v", d.Addresses)
	}
	// Moving it needs AllowReassociation.
	_, err := s.AssociateAddress(bg, &ec2.AssociateAddressInput{AllocationId: a.AllocationId, NetworkInterfaceId: ptr("eni-0bbbbbbbbbbbbbbbb")})
	wantCode(t, err, "Resource.AlreadyAssociated")
	// So does giving the same private address a second Elastic IP.
	_, err = s.AssociateAddress(bg, &ec2.AssociateAddressInput{AllocationId: b.AllocationId, InstanceId: ptr("i-0aaaaaaaaaaaaaaaa")})
	wantCode(t, err, "Resource.AlreadyAssociated")
	moved := must[*ec2.AssociateAddressOutput](t)(s.AssociateAddress(bg, &ec2.AssociateAddressInput{AllocationId: a.AllocationId, NetworkInterfaceId: ptr("eni-0bbbbbbbbbbbbbbbb"), AllowReassociation: ptr(true)}))
	if *moved.AssociationId == *assoc.AssociationId {
		t.Error("a moved association kept its id")
	}
	// The VPC's network state now carries the mapping for hangar-netd.
	var st api.VPCState
	if err := s.db.View(func(tx *store.Tx) (err error) { st, _, err = vpcState(tx, vpc); return err }); err != nil {
		t.Fatal(err)
	}
	if want := []api.AddressSpec{{PublicIP: *a.PublicIp, EniID: "eni-0bbbbbbbbbbbbbbbb", PrivateIP: "10.0.1.11"}}; !reflect.DeepEqual(st.Addresses, want) {
		t.Fatalf("VPC state addresses = %+v, want %+v", st.Addresses, want)
	}
	_, err = s.ReleaseAddress(bg, &ec2.ReleaseAddressInput{AllocationId: a.AllocationId})
	wantCode(t, err, "InvalidIPAddress.InUse")
	_, err = s.DisassociateAddress(bg, &ec2.DisassociateAddressInput{AssociationId: assoc.AssociationId})
	wantCode(t, err, "InvalidAssociationID.NotFound")
	must[*ec2.DisassociateAddressOutput](t)(s.DisassociateAddress(bg, &ec2.DisassociateAddressInput{AssociationId: moved.AssociationId}))
	if err := s.db.View(func(tx *store.Tx) (err error) { st, _, err = vpcState(tx, vpc); return err }); err != nil {
		t.Fatal(err)
	}
	if len(st.Addresses) != 0 {
		t.Fatalf("addresses after disassociation: %+v", st.Addresses)
	}
	must[*ec2.ReleaseAddressOutput](t)(s.ReleaseAddress(bg, &ec2.ReleaseAddressInput{PublicIp: a.PublicIp}))
	_, err = s.DescribeAddresses(bg, &ec2.DescribeAddressesInput{PublicIps: []string{*a.PublicIp}})
	wantCode(t, err, "InvalidAddress.NotFound")
	all := must[*ec2.DescribeAddressesOutput](t)(s.DescribeAddresses(bg, &ec2.DescribeAddressesInput{PublicIps: []string{*b.PublicIp}}))
	if len(all.Addresses) != 1 || all.Addresses[0].AssociationId != nil {
		t.Fatalf("describe by public IP = %+v", all.Addresses)
	}
	_, err = s.DescribeAddresses(bg, &ec2.DescribeAddressesInput{Filters: []types.Filter{filter("no-such-filter", "x")}})
	wantCode(t, err, "InvalidParameterValue")
}
