package awsproto

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/ec2"
	ec2types "github.com/aws/aws-sdk-go-v2/service/ec2/types"
	"github.com/aws/aws-sdk-go-v2/service/sts"
	ststypes "github.com/aws/aws-sdk-go-v2/service/sts/types"
	"github.com/aws/smithy-go"
	"github.com/aws/smithy-go/middleware"
	"github.com/google/go-cmp/cmp"

	"hangar.dev/hangar/services/gateway/awserr"
	"hangar.dev/hangar/services/gateway/awsmodel"
)

// encodeRoundTrip encodes want with EncodeXML, serves the bytes to the
// SDK's client, and requires the SDK to read back exactly want.
func encodeRoundTrip[T any](t *testing.T, service, op string, want *T, call func(context.Context, *fakeAWS) (*T, error)) []byte {
	t.Helper()
	body, err := EncodeXML(awsmodel.MustLoad(service), op, "8e6f5c1a-round-trip", want)
	if err != nil {
		t.Fatalf("EncodeXML %s: %v", op, err)
	}
	f := newFakeAWS(t)
	f.reply(http.StatusOK, body)
	got, err := call(context.Background(), f)
	if err != nil {
		t.Fatalf("the SDK could not read the %s response: %v\n%s", op, err, body)
	}
	if d := cmp.Diff(want, got, append(sdkEqual, cmp.Comparer(func(a, b middleware.Metadata) bool { return true }))...); d != "" {
		t.Fatalf("%s did not survive EncodeXML → SDK deserialise (-encoded +read back):\n%s\n%s", op, d, body)
	}
	return body
}

var (
	t0   = time.Date(2026, 2, 3, 4, 5, 6, 789e6, time.UTC)
	tags = []ec2types.Tag{{Key: aws.String("Name"), Value: aws.String(`a <b> & "c" 'd'`)}, {Key: aws.String("multi\nline"), Value: aws.String("ünïcode\ttab")}}
)

func TestEncodeDescribeVpcs(t *testing.T) {
	want := &ec2.DescribeVpcsOutput{
		Vpcs: []ec2types.Vpc{{
			VpcId: aws.String("vpc-0123456789abcdef0"), CidrBlock: aws.String("10.0.0.0/16"), State: ec2types.VpcStateAvailable,
			OwnerId: aws.String("123456789012"), InstanceTenancy: ec2types.TenancyDefault, IsDefault: aws.Bool(false),
			DhcpOptionsId: aws.String("dopt-1"),
			CidrBlockAssociationSet: []ec2types.VpcCidrBlockAssociation{
				{AssociationId: aws.String("vpc-cidr-assoc-1"), CidrBlock: aws.String("10.0.0.0/16"), CidrBlockState: &ec2types.VpcCidrBlockState{State: ec2types.VpcCidrBlockStateCodeAssociated}},
				{AssociationId: aws.String("vpc-cidr-assoc-2"), CidrBlock: aws.String("10.1.0.0/16"), CidrBlockState: &ec2types.VpcCidrBlockState{State: ec2types.VpcCidrBlockStateCodeFailed, StatusMessage: aws.String("overlaps")}},
			},
			Ipv6CidrBlockAssociationSet: []ec2types.VpcIpv6CidrBlockAssociation{{AssociationId: aws.String("a6"), Ipv6CidrBlock: aws.String("2600:1f18::/56"),
				Ipv6CidrBlockState: &ec2types.VpcCidrBlockState{State: ec2types.VpcCidrBlockStateCodeAssociated}, NetworkBorderGroup: aws.String("us-east-1")}},
			Tags: tags,
		}, {
			VpcId: aws.String("vpc-default"), CidrBlock: aws.String("172.31.0.0/16"), State: ec2types.VpcStatePending, IsDefault: aws.Bool(true),
		}},
		NextToken: aws.String("aGFuZ2FyMTp2cGMtMQ"),
	}
	body := encodeRoundTrip(t, "ec2", "DescribeVpcs", want, func(ctx context.Context, f *fakeAWS) (*ec2.DescribeVpcsOutput, error) {
		return f.ec2().DescribeVpcs(ctx, &ec2.DescribeVpcsInput{})
	})
	for _, s := range []string{`<DescribeVpcsResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/">`, "<requestId>8e6f5c1a-round-trip</requestId>", "<vpcSet><item>", "<isDefault>false</isDefault>"} {
		if !strings.Contains(string(body), s) {
			t.Errorf("response lacks %s:\n%s", s, body)
		}
	}
	// An empty result is still an empty set, as EC2 writes it.
	empty, err := EncodeXML(awsmodel.MustLoad("ec2"), "DescribeVpcs", "r", &ec2.DescribeVpcsOutput{})
	if err != nil || !strings.Contains(string(empty), "<vpcSet></vpcSet>") {
		t.Fatalf("empty DescribeVpcs: %v\n%s", err, empty)
	}
}

func TestEncodeDescribeSecurityGroups(t *testing.T) {
	perm := func(proto string, from, to int32) ec2types.IpPermission {
		return ec2types.IpPermission{
			IpProtocol: aws.String(proto), FromPort: aws.Int32(from), ToPort: aws.Int32(to),
			IpRanges:      []ec2types.IpRange{{CidrIp: aws.String("0.0.0.0/0")}, {CidrIp: aws.String("10.0.0.0/8"), Description: aws.String("office")}},
			Ipv6Ranges:    []ec2types.Ipv6Range{{CidrIpv6: aws.String("::/0"), Description: aws.String("v6")}},
			PrefixListIds: []ec2types.PrefixListId{{PrefixListId: aws.String("pl-1"), Description: aws.String("s3")}},
			UserIdGroupPairs: []ec2types.UserIdGroupPair{
				{GroupId: aws.String("sg-2"), UserId: aws.String("123456789012"), Description: aws.String("peer"), VpcId: aws.String("vpc-1")},
				{GroupId: aws.String("sg-3"), GroupName: aws.String("other"), PeeringStatus: aws.String("active"), VpcPeeringConnectionId: aws.String("pcx-1")},
			},
		}
	}
	want := &ec2.DescribeSecurityGroupsOutput{SecurityGroups: []ec2types.SecurityGroup{{
		GroupId: aws.String("sg-1"), GroupName: aws.String("web"), Description: aws.String("web servers"),
		OwnerId: aws.String("123456789012"), VpcId: aws.String("vpc-1"),
		IpPermissions:       []ec2types.IpPermission{perm("tcp", 22, 22), perm("udp", 0, 65535), {IpProtocol: aws.String("icmp"), FromPort: aws.Int32(-1), ToPort: aws.Int32(-1)}},
		IpPermissionsEgress: []ec2types.IpPermission{{IpProtocol: aws.String("-1"), IpRanges: []ec2types.IpRange{{CidrIp: aws.String("0.0.0.0/0")}}}},
		Tags:                tags,
	}, {
		GroupId: aws.String("sg-default"), GroupName: aws.String("default"), Description: aws.String("default VPC security group"),
	}}}
	encodeRoundTrip(t, "ec2", "DescribeSecurityGroups", want, func(ctx context.Context, f *fakeAWS) (*ec2.DescribeSecurityGroupsOutput, error) {
		return f.ec2().DescribeSecurityGroups(ctx, &ec2.DescribeSecurityGroupsInput{})
	})
}

func TestEncodeDescribeInstancesNested(t *testing.T) {
	group := []ec2types.GroupIdentifier{{GroupId: aws.String("sg-1"), GroupName: aws.String("web")}, {GroupId: aws.String("sg-2"), GroupName: aws.String("db")}}
	inst := func(id string, code int32, name ec2types.InstanceStateName) ec2types.Instance {
		return ec2types.Instance{
			InstanceId: aws.String(id), ImageId: aws.String("ami-1"), InstanceType: ec2types.InstanceTypeT3Micro,
			AmiLaunchIndex: aws.Int32(0), Architecture: ec2types.ArchitectureValuesX8664, LaunchTime: aws.Time(t0),
			KeyName: aws.String("key"), ClientToken: aws.String("tok"), EbsOptimized: aws.Bool(false), EnaSupport: aws.Bool(true),
			Hypervisor: ec2types.HypervisorTypeXen, VirtualizationType: ec2types.VirtualizationTypeHvm,
			RootDeviceName: aws.String("/dev/xvda"), RootDeviceType: ec2types.DeviceTypeEbs,
			PrivateDnsName: aws.String("ip-10-0-1-5.ec2.internal"), PrivateIpAddress: aws.String("10.0.1.5"),
			PublicDnsName: aws.String(""), PublicIpAddress: aws.String("192.0.2.10"),
			State:                 &ec2types.InstanceState{Code: aws.Int32(code), Name: name},
			StateReason:           &ec2types.StateReason{Code: aws.String("Client.UserInitiatedShutdown"), Message: aws.String("Client.UserInitiatedShutdown: User initiated shutdown")},
			StateTransitionReason: aws.String("User initiated (2026-02-03 04:05:06 GMT)"),
			SubnetId:              aws.String("subnet-1"), VpcId: aws.String("vpc-1"), SourceDestCheck: aws.Bool(true),
			Placement:          &ec2types.Placement{AvailabilityZone: aws.String("us-east-1a"), Tenancy: ec2types.TenancyDefault, GroupName: aws.String("")},
			Monitoring:         &ec2types.Monitoring{State: ec2types.MonitoringStateDisabled},
			CpuOptions:         &ec2types.CpuOptions{CoreCount: aws.Int32(1), ThreadsPerCore: aws.Int32(2)},
			MetadataOptions:    &ec2types.InstanceMetadataOptionsResponse{HttpTokens: ec2types.HttpTokensStateRequired, HttpPutResponseHopLimit: aws.Int32(2), HttpEndpoint: ec2types.InstanceMetadataEndpointStateEnabled, State: ec2types.InstanceMetadataOptionsStateApplied},
			IamInstanceProfile: &ec2types.IamInstanceProfile{Arn: aws.String("arn:aws:iam::123456789012:instance-profile/p"), Id: aws.String("AIPA1")},
			SecurityGroups:     group,
			Tags:               tags,
			BlockDeviceMappings: []ec2types.InstanceBlockDeviceMapping{
				{DeviceName: aws.String("/dev/xvda"), Ebs: &ec2types.EbsInstanceBlockDevice{AttachTime: aws.Time(t0), DeleteOnTermination: aws.Bool(true), Status: ec2types.AttachmentStatusAttached, VolumeId: aws.String("vol-1")}},
				{DeviceName: aws.String("/dev/sdb"), Ebs: &ec2types.EbsInstanceBlockDevice{AttachTime: aws.Time(t0.Add(time.Second)), DeleteOnTermination: aws.Bool(false), Status: ec2types.AttachmentStatusAttaching, VolumeId: aws.String("vol-2")}},
			},
			NetworkInterfaces: []ec2types.InstanceNetworkInterface{{
				NetworkInterfaceId: aws.String("eni-1"), MacAddress: aws.String("02:00:00:00:00:01"), OwnerId: aws.String("123456789012"),
				Description: aws.String("primary"), Status: ec2types.NetworkInterfaceStatusInUse, SubnetId: aws.String("subnet-1"), VpcId: aws.String("vpc-1"),
				PrivateDnsName: aws.String("ip-10-0-1-5.ec2.internal"), PrivateIpAddress: aws.String("10.0.1.5"), SourceDestCheck: aws.Bool(true),
				InterfaceType: aws.String("interface"), Groups: group,
				Association: &ec2types.InstanceNetworkInterfaceAssociation{IpOwnerId: aws.String("amazon"), PublicIp: aws.String("192.0.2.10"), PublicDnsName: aws.String("")},
				Attachment:  &ec2types.InstanceNetworkInterfaceAttachment{AttachTime: aws.Time(t0), AttachmentId: aws.String("eni-attach-1"), DeleteOnTermination: aws.Bool(true), DeviceIndex: aws.Int32(0), NetworkCardIndex: aws.Int32(0), Status: ec2types.AttachmentStatusAttached},
				PrivateIpAddresses: []ec2types.InstancePrivateIpAddress{
					{Primary: aws.Bool(true), PrivateIpAddress: aws.String("10.0.1.5"), PrivateDnsName: aws.String("ip-10-0-1-5.ec2.internal"),
						Association: &ec2types.InstanceNetworkInterfaceAssociation{IpOwnerId: aws.String("amazon"), PublicIp: aws.String("192.0.2.10")}},
					{Primary: aws.Bool(false), PrivateIpAddress: aws.String("10.0.1.6")},
				},
			}},
		}
	}
	want := &ec2.DescribeInstancesOutput{
		Reservations: []ec2types.Reservation{
			{ReservationId: aws.String("r-1"), OwnerId: aws.String("123456789012"), Groups: group,
				Instances: []ec2types.Instance{inst("i-1", 16, ec2types.InstanceStateNameRunning), inst("i-2", 80, ec2types.InstanceStateNameStopped)}},
			{ReservationId: aws.String("r-2"), OwnerId: aws.String("123456789012"), RequesterId: aws.String("940372691376"),
				Instances: []ec2types.Instance{inst("i-3", 0, ec2types.InstanceStateNamePending)}},
		},
		NextToken: aws.String("next"),
	}
	encodeRoundTrip(t, "ec2", "DescribeInstances", want, func(ctx context.Context, f *fakeAWS) (*ec2.DescribeInstancesOutput, error) {
		return f.ec2().DescribeInstances(ctx, &ec2.DescribeInstancesInput{})
	})
}

func TestEncodeNumbersAndScalarLists(t *testing.T) {
	want := &ec2.DescribeInstanceTypesOutput{InstanceTypes: []ec2types.InstanceTypeInfo{{
		InstanceType: ec2types.InstanceTypeM5Large, CurrentGeneration: aws.Bool(true), Hypervisor: ec2types.InstanceTypeHypervisorNitro,
		VCpuInfo:   &ec2types.VCpuInfo{DefaultVCpus: aws.Int32(2), DefaultCores: aws.Int32(1), DefaultThreadsPerCore: aws.Int32(2), ValidCores: []int32{1}, ValidThreadsPerCore: []int32{1, 2}},
		MemoryInfo: &ec2types.MemoryInfo{SizeInMiB: aws.Int64(8192)},
		ProcessorInfo: &ec2types.ProcessorInfo{SupportedArchitectures: []ec2types.ArchitectureType{ec2types.ArchitectureTypeX8664},
			SustainedClockSpeedInGhz: aws.Float64(3.1)},
		NetworkInfo: &ec2types.NetworkInfo{NetworkPerformance: aws.String("Up to 10 Gigabit"), MaximumNetworkInterfaces: aws.Int32(3),
			Ipv4AddressesPerInterface: aws.Int32(10), Ipv6Supported: aws.Bool(true), EnaSupport: ec2types.EnaSupportRequired},
		SupportedUsageClasses:    []ec2types.UsageClassType{ec2types.UsageClassTypeOnDemand, ec2types.UsageClassTypeSpot},
		SupportedRootDeviceTypes: []ec2types.RootDeviceType{ec2types.RootDeviceTypeEbs},
	}}}
	encodeRoundTrip(t, "ec2", "DescribeInstanceTypes", want, func(ctx context.Context, f *fakeAWS) (*ec2.DescribeInstanceTypesOutput, error) {
		return f.ec2().DescribeInstanceTypes(ctx, &ec2.DescribeInstanceTypesInput{})
	})
}

func TestEncodeSTS(t *testing.T) {
	body := encodeRoundTrip(t, "sts", "AssumeRole", &sts.AssumeRoleOutput{
		AssumedRoleUser: &ststypes.AssumedRoleUser{Arn: aws.String("arn:aws:sts::123456789012:assumed-role/demo/session"), AssumedRoleId: aws.String("AROA1:session")},
		Credentials: &ststypes.Credentials{AccessKeyId: aws.String("ASIAEXAMPLE"), SecretAccessKey: aws.String("secret/+="),
			SessionToken: aws.String("FwoGZXIvYXdzE<&>"), Expiration: aws.Time(t0.Add(time.Hour))},
		PackedPolicySize: aws.Int32(6),
		SourceIdentity:   aws.String("me"),
	}, func(ctx context.Context, f *fakeAWS) (*sts.AssumeRoleOutput, error) {
		return f.sts().AssumeRole(ctx, &sts.AssumeRoleInput{RoleArn: aws.String("arn"), RoleSessionName: aws.String("s")})
	})
	for _, s := range []string{`<AssumeRoleResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">`, "<AssumeRoleResult>", "<ResponseMetadata><RequestId>8e6f5c1a-round-trip</RequestId></ResponseMetadata>"} {
		if !strings.Contains(string(body), s) {
			t.Errorf("response lacks %s:\n%s", s, body)
		}
	}
	encodeRoundTrip(t, "sts", "GetCallerIdentity", &sts.GetCallerIdentityOutput{
		Account: aws.String("123456789012"), Arn: aws.String("arn:aws:iam::123456789012:user/bob"), UserId: aws.String("AIDAEXAMPLE"),
	}, func(ctx context.Context, f *fakeAWS) (*sts.GetCallerIdentityOutput, error) {
		return f.sts().GetCallerIdentity(ctx, &sts.GetCallerIdentityInput{})
	})
	encodeRoundTrip(t, "sts", "GetSessionToken", &sts.GetSessionTokenOutput{
		Credentials: &ststypes.Credentials{AccessKeyId: aws.String("ASIA2"), SecretAccessKey: aws.String("s"), SessionToken: aws.String("t"), Expiration: aws.Time(t0)},
	}, func(ctx context.Context, f *fakeAWS) (*sts.GetSessionTokenOutput, error) {
		return f.sts().GetSessionToken(ctx, &sts.GetSessionTokenInput{})
	})
}

// IAM's GetAccountSummary answers with a map; no SDK for IAM is linked
// here, so the bytes are checked against the Query protocol's map form.
func TestEncodeMap(t *testing.T) {
	type summary struct{ SummaryMap map[string]int32 }
	body, err := EncodeXML(awsmodel.MustLoad("iam"), "GetAccountSummary", "r", &summary{SummaryMap: map[string]int32{"Users": 3, "Groups": 0}})
	if err != nil {
		t.Fatal(err)
	}
	const want = "<GetAccountSummaryResult><SummaryMap><entry><key>Groups</key><value>0</value></entry><entry><key>Users</key><value>3</value></entry></SummaryMap></GetAccountSummaryResult>"
	if !strings.Contains(string(body), want) {
		t.Fatalf("map encoding:\n%s\nwant it to contain\n%s", body, want)
	}
}

// Each protocol's error shape, parsed by the SDK into the code it carries.
func TestErrorXMLParsedBySDK(t *testing.T) {
	for _, c := range []struct {
		service string
		err     *awserr.Error
	}{
		{"ec2", awserr.New(400, "InvalidVpcID.NotFound", "The vpc ID 'vpc-1' does not exist")},
		{"ec2", awserr.DryRunOperation()},
		{"ec2", awserr.New(401, "AuthFailure", "AWS was not able to validate the provided access credentials")},
		{"ec2", &awserr.Error{Code: "InternalError", Message: "An internal error has occurred.", Status: 500}},
		{"sts", awserr.New(403, "SignatureDoesNotMatch", "The request signature we calculated does not match <&>")},
		{"sts", awserr.New(400, "InvalidAction", "Could not find operation")},
	} {
		m := awsmodel.MustLoad(c.service)
		status, body := ErrorXML(m.Metadata.Protocol, "req-err", c.err)
		f := newFakeAWS(t)
		f.reply(status, body)
		var err error
		if c.service == "ec2" {
			_, err = f.ec2().DescribeVpcs(context.Background(), &ec2.DescribeVpcsInput{})
		} else {
			_, err = f.sts().GetCallerIdentity(context.Background(), &sts.GetCallerIdentityInput{})
		}
		var api smithy.APIError
		if !errors.As(err, &api) {
			t.Fatalf("%s %s: the SDK did not see an API error: %v", c.service, c.err.Code, err)
		}
		if api.ErrorCode() != c.err.Code || api.ErrorMessage() != c.err.Message {
			t.Errorf("%s: the SDK read %q %q, want %q %q", c.service, api.ErrorCode(), api.ErrorMessage(), c.err.Code, c.err.Message)
		}
		// The SDK does not read <Type>; botocore does (Sender/Receiver).
		wantType := "<Type>Sender</Type>"
		if c.err.Status >= 500 {
			wantType = "<Type>Receiver</Type>"
		}
		if c.service == "sts" && !strings.Contains(string(body), wantType) {
			t.Errorf("%s: no %s in %s", c.err.Code, wantType, body)
		}
		if status != c.err.Status {
			t.Errorf("%s: status %d, want %d", c.err.Code, status, c.err.Status)
		}
	}
}
