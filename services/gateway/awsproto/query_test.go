package awsproto

import (
	"context"
	"errors"
	"net/url"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/ec2"
	ec2types "github.com/aws/aws-sdk-go-v2/service/ec2/types"
	"github.com/aws/aws-sdk-go-v2/service/sts"
	ststypes "github.com/aws/aws-sdk-go-v2/service/sts/types"
	"github.com/google/go-cmp/cmp"

	"hangar.dev/hangar/services/gateway/awserr"
	"hangar.dev/hangar/services/gateway/awsmodel"
)

// decodeRoundTrip sends in through the SDK's serializer and decodes what
// it sent into a fresh value of in's type; the two must be equal.
func decodeRoundTrip[T any](t *testing.T, service, op string, in *T, send func(context.Context, *fakeAWS, *T) error) url.Values {
	t.Helper()
	form := capture(t, func(ctx context.Context, f *fakeAWS) error { return send(ctx, f, in) })
	if form.Get("Action") != op {
		t.Fatalf("the SDK sent Action=%q", form.Get("Action"))
	}
	var got T
	if err := DecodeQuery(awsmodel.MustLoad(service), op, form, &got); err != nil {
		t.Fatalf("DecodeQuery of the SDK's own %s request: %v\nform: %v", op, err, form)
	}
	if d := cmp.Diff(in, &got, sdkEqual...); d != "" {
		t.Fatalf("%s did not survive SDK serialise → DecodeQuery (-sent +decoded):\n%s", op, d)
	}
	return form
}

func TestDecodeRunInstancesNested(t *testing.T) {
	in := &ec2.RunInstancesInput{
		ImageId:      aws.String("ami-0abcdef1234567890"),
		MinCount:     aws.Int32(1),
		MaxCount:     aws.Int32(3),
		InstanceType: ec2types.InstanceTypeT3Micro,
		KeyName:      aws.String("my key"),
		ClientToken:  aws.String("token-1"),
		DryRun:       aws.Bool(false),
		UserData:     aws.String("IyEvYmluL3NoCmVjaG8gaGk="),
		BlockDeviceMappings: []ec2types.BlockDeviceMapping{
			{DeviceName: aws.String("/dev/xvda"), Ebs: &ec2types.EbsBlockDevice{
				VolumeSize: aws.Int32(8), VolumeType: ec2types.VolumeTypeGp3, DeleteOnTermination: aws.Bool(true),
				Encrypted: aws.Bool(false), Iops: aws.Int32(3000), Throughput: aws.Int32(125), SnapshotId: aws.String("snap-1")}},
			{DeviceName: aws.String("/dev/sdb"), VirtualName: aws.String("ephemeral0")},
			{DeviceName: aws.String("/dev/sdc"), NoDevice: aws.String("")},
		},
		TagSpecifications: []ec2types.TagSpecification{
			{ResourceType: ec2types.ResourceTypeInstance, Tags: []ec2types.Tag{
				{Key: aws.String("Name"), Value: aws.String("web & db <1>")},
				{Key: aws.String("env"), Value: aws.String("prod=yes; ünïcode")},
			}},
			{ResourceType: ec2types.ResourceTypeVolume, Tags: []ec2types.Tag{{Key: aws.String("k"), Value: aws.String("")}}},
		},
		SecurityGroupIds: []string{"sg-1", "sg-2", "sg-3"},
		NetworkInterfaces: []ec2types.InstanceNetworkInterfaceSpecification{{
			DeviceIndex: aws.Int32(0), SubnetId: aws.String("subnet-1"), AssociatePublicIpAddress: aws.Bool(true),
			Groups: []string{"sg-a", "sg-b"},
			PrivateIpAddresses: []ec2types.PrivateIpAddressSpecification{
				{Primary: aws.Bool(true), PrivateIpAddress: aws.String("10.0.0.5")},
				{Primary: aws.Bool(false), PrivateIpAddress: aws.String("10.0.0.6")},
			},
		}},
		Placement:          &ec2types.Placement{AvailabilityZone: aws.String("us-east-1a"), Tenancy: ec2types.TenancyDefault},
		IamInstanceProfile: &ec2types.IamInstanceProfileSpecification{Name: aws.String("role")},
		MetadataOptions: &ec2types.InstanceMetadataOptionsRequest{
			HttpTokens: ec2types.HttpTokensStateRequired, HttpPutResponseHopLimit: aws.Int32(2), HttpEndpoint: ec2types.InstanceMetadataEndpointStateEnabled},
		CpuOptions:                        &ec2types.CpuOptionsRequest{CoreCount: aws.Int32(1), ThreadsPerCore: aws.Int32(2)},
		InstanceInitiatedShutdownBehavior: ec2types.ShutdownBehaviorTerminate,
	}
	form := decodeRoundTrip(t, "ec2", "RunInstances", in, func(ctx context.Context, f *fakeAWS, in *ec2.RunInstancesInput) error {
		_, err := f.ec2().RunInstances(ctx, in)
		return err
	})
	// The EC2 protocol's own names, not the model's member names.
	for _, k := range []string{"BlockDeviceMapping.1.Ebs.VolumeSize", "TagSpecification.2.Tag.1.Key",
		"SecurityGroupId.3", "NetworkInterface.1.PrivateIpAddresses.2.PrivateIpAddress", "NetworkInterface.1.SecurityGroupId.2"} {
		if !form.Has(k) {
			t.Errorf("the SDK did not send %s; it sent %v", k, form)
		}
	}
}

func TestDecodeFiltersAndTimestampsAndBlobs(t *testing.T) {
	decodeRoundTrip(t, "ec2", "DescribeInstances", &ec2.DescribeInstancesInput{
		Filters: []ec2types.Filter{
			{Name: aws.String("tag:Name"), Values: []string{"a b", "c*"}},
			{Name: aws.String("instance-state-name"), Values: []string{"running"}},
		},
		InstanceIds: []string{"i-1", "i-2"},
		MaxResults:  aws.Int32(50),
		NextToken:   aws.String("tok+/="),
	}, func(ctx context.Context, f *fakeAWS, in *ec2.DescribeInstancesInput) error {
		_, err := f.ec2().DescribeInstances(ctx, in)
		return err
	})
	start := time.Date(2026, 1, 2, 3, 4, 5, 678e6, time.UTC)
	decodeRoundTrip(t, "ec2", "DescribeSpotPriceHistory", &ec2.DescribeSpotPriceHistoryInput{
		StartTime:     aws.Time(start),
		EndTime:       aws.Time(start.Add(90 * time.Minute)),
		InstanceTypes: []ec2types.InstanceType{ec2types.InstanceTypeM5Large, ec2types.InstanceTypeC5Xlarge},
	}, func(ctx context.Context, f *fakeAWS, in *ec2.DescribeSpotPriceHistoryInput) error {
		_, err := f.ec2().DescribeSpotPriceHistory(ctx, in)
		return err
	})
	decodeRoundTrip(t, "ec2", "ImportKeyPair", &ec2.ImportKeyPairInput{
		KeyName:           aws.String("imported"),
		PublicKeyMaterial: []byte("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIG7 user@host\n\x00\xff"),
		TagSpecifications: []ec2types.TagSpecification{{ResourceType: ec2types.ResourceTypeKeyPair, Tags: []ec2types.Tag{{Key: aws.String("a"), Value: aws.String("b")}}}},
	}, func(ctx context.Context, f *fakeAWS, in *ec2.ImportKeyPairInput) error {
		_, err := f.ec2().ImportKeyPair(ctx, in)
		return err
	})
	decodeRoundTrip(t, "ec2", "AuthorizeSecurityGroupIngress", &ec2.AuthorizeSecurityGroupIngressInput{
		GroupId: aws.String("sg-1"),
		IpPermissions: []ec2types.IpPermission{{
			IpProtocol: aws.String("tcp"), FromPort: aws.Int32(22), ToPort: aws.Int32(22),
			IpRanges:         []ec2types.IpRange{{CidrIp: aws.String("10.0.0.0/8"), Description: aws.String("ssh")}},
			UserIdGroupPairs: []ec2types.UserIdGroupPair{{GroupId: aws.String("sg-2"), UserId: aws.String("123456789012")}},
		}, {
			IpProtocol: aws.String("-1"),
			Ipv6Ranges: []ec2types.Ipv6Range{{CidrIpv6: aws.String("::/0")}},
		}},
	}, func(ctx context.Context, f *fakeAWS, in *ec2.AuthorizeSecurityGroupIngressInput) error {
		_, err := f.ec2().AuthorizeSecurityGroupIngress(ctx, in)
		return err
	})
}

// The Query protocol (STS, IAM) writes lists as Name.member.N.
func TestDecodeQueryMemberLists(t *testing.T) {
	form := decodeRoundTrip(t, "sts", "AssumeRole", &sts.AssumeRoleInput{
		RoleArn:           aws.String("arn:aws:iam::123456789012:role/demo"),
		RoleSessionName:   aws.String("session"),
		DurationSeconds:   aws.Int32(3600),
		ExternalId:        aws.String("ext"),
		Policy:            aws.String(`{"Version":"2012-10-17","Statement":[]}`),
		PolicyArns:        []ststypes.PolicyDescriptorType{{Arn: aws.String("arn:aws:iam::aws:policy/ReadOnlyAccess")}, {Arn: aws.String("arn:aws:iam::aws:policy/Other")}},
		Tags:              []ststypes.Tag{{Key: aws.String("team"), Value: aws.String("infra")}, {Key: aws.String("cost"), Value: aws.String("42")}},
		TransitiveTagKeys: []string{"team"},
		SourceIdentity:    aws.String("me"),
	}, func(ctx context.Context, f *fakeAWS, in *sts.AssumeRoleInput) error {
		_, err := f.sts().AssumeRole(ctx, in)
		return err
	})
	for _, k := range []string{"PolicyArns.member.2.arn", "Tags.member.2.Value", "TransitiveTagKeys.member.1"} {
		if !form.Has(k) {
			t.Errorf("the SDK did not send %s; it sent %v", k, form)
		}
	}

	// IAM's nested member lists, as botocore writes them (a local struct
	// named after the model's members stands in for the SDK's).
	type contextEntry struct {
		ContextKeyName   *string
		ContextKeyValues []string
		ContextKeyType   string
	}
	type simulateInput struct {
		PolicySourceArn *string
		ActionNames     []string
		ResourceArns    []string
		ContextEntries  []contextEntry
		MaxItems        *int32
	}
	iamForm := url.Values{
		"PolicySourceArn":                                   {"arn:aws:iam::123456789012:user/bob"},
		"ActionNames.member.1":                              {"ec2:DescribeVpcs"},
		"ActionNames.member.2":                              {"ec2:CreateVpc"},
		"ResourceArns.member.1":                             {"*"},
		"ContextEntries.member.1.ContextKeyName":            {"aws:SourceIp"},
		"ContextEntries.member.1.ContextKeyType":            {"ipList"},
		"ContextEntries.member.1.ContextKeyValues.member.1": {"10.0.0.1"},
		"ContextEntries.member.1.ContextKeyValues.member.2": {"10.0.0.2"},
		"MaxItems": {"10"},
	}
	var got simulateInput
	if err := DecodeQuery(awsmodel.MustLoad("iam"), "SimulatePrincipalPolicy", iamForm, &got); err != nil {
		t.Fatal(err)
	}
	want := simulateInput{
		PolicySourceArn: aws.String("arn:aws:iam::123456789012:user/bob"),
		ActionNames:     []string{"ec2:DescribeVpcs", "ec2:CreateVpc"},
		ResourceArns:    []string{"*"},
		ContextEntries:  []contextEntry{{ContextKeyName: aws.String("aws:SourceIp"), ContextKeyType: "ipList", ContextKeyValues: []string{"10.0.0.1", "10.0.0.2"}}},
		MaxItems:        aws.Int32(10),
	}
	if d := cmp.Diff(want, got); d != "" {
		t.Fatalf("IAM SimulatePrincipalPolicy (-want +got):\n%s", d)
	}
	// An EC2-style list is not a Query-protocol list.
	if err := DecodeQuery(awsmodel.MustLoad("iam"), "SimulatePrincipalPolicy", url.Values{"PolicySourceArn": {"a"}, "ActionNames.1": {"x"}}, &got); code(err) != "UnknownParameter" {
		t.Fatalf("ActionNames.1 in IAM: %v", err)
	}
}

// mapModel is a Query-protocol model with the map forms botocore writes:
// Name.entry.N.key/value, flattened Name.N.Name/Value, and the EC2
// protocol's (which inherits the Query protocol's .entry).
func mapModel(protocol string) *awsmodel.Model {
	str := &awsmodel.Shape{Type: "string"}
	num := &awsmodel.Shape{Type: "integer"}
	return &awsmodel.Model{
		Metadata:   awsmodel.Metadata{Protocol: protocol, APIVersion: "2020-01-01", EndpointPrefix: "maps"},
		Operations: map[string]awsmodel.Operation{"Put": {Name: "Put", Input: &awsmodel.Ref{Shape: "PutInput"}}},
		Shapes: map[string]*awsmodel.Shape{
			"String":  str,
			"Integer": num,
			"PutInput": {Type: "structure", Members: map[string]*awsmodel.Ref{
				"Plain":     {Shape: "Plain"},
				"Flat":      {Shape: "Flat"},
				"Renamed":   {Shape: "Renamed"},
				"Attribute": {Shape: "Flat"},
			}},
			"Plain":   {Type: "map", Key: &awsmodel.Ref{Shape: "String"}, Value: &awsmodel.Ref{Shape: "Integer"}},
			"Flat":    {Type: "map", Flattened: true, Key: &awsmodel.Ref{Shape: "String", LocationName: "Name"}, Value: &awsmodel.Ref{Shape: "String", LocationName: "Value"}},
			"Renamed": {Type: "map", Key: &awsmodel.Ref{Shape: "String", LocationName: "k"}, Value: &awsmodel.Ref{Shape: "String", LocationName: "v"}},
		},
	}
}

func TestDecodeMaps(t *testing.T) {
	type putInput struct {
		Plain     map[string]int32
		Flat      map[string]string
		Renamed   map[string]*string
		Attribute map[string]string
	}
	for _, protocol := range []string{"query", "ec2"} {
		form := url.Values{
			"Plain.entry.1.key": {"a"}, "Plain.entry.1.value": {"1"},
			"Plain.entry.2.key": {"b"}, "Plain.entry.2.value": {"-2"},
			"Flat.1.Name": {"x"}, "Flat.1.Value": {"y"},
			"Renamed.entry.1.k": {"p"}, "Renamed.entry.1.v": {"q"},
		}
		var got putInput
		if err := DecodeQuery(mapModel(protocol), "Put", form, &got); err != nil {
			t.Fatalf("%s: %v", protocol, err)
		}
		want := putInput{Plain: map[string]int32{"a": 1, "b": -2}, Flat: map[string]string{"x": "y"}, Renamed: map[string]*string{"p": aws.String("q")}}
		if d := cmp.Diff(want, got); d != "" {
			t.Fatalf("%s maps (-want +got):\n%s", protocol, d)
		}
	}
	var got putInput
	if err := DecodeQuery(mapModel("query"), "Put", url.Values{"Plain.entry.1.key": {"a"}, "Plain.entry.1.value": {"one"}}, &got); code(err) != "InvalidParameterValue" {
		t.Fatalf("a map value that is not a number: %v", err)
	}
}

func code(err error) string {
	var e *awserr.Error
	if errors.As(err, &e) {
		return e.Code
	}
	if err != nil {
		return "not an AWS error: " + err.Error()
	}
	return ""
}

func TestDecodeErrors(t *testing.T) {
	base := "ImageId=ami-1&MinCount=1&MaxCount=1"
	cases := []struct {
		op, body, code, mentions string
	}{
		{"RunInstances", base + "&Bogus=1", "UnknownParameter", "Bogus"},
		{"RunInstances", base + "&BlockDeviceMapping.1.Ebs.Bogus=1", "UnknownParameter", "BlockDeviceMapping.1.Ebs.Bogus"},
		{"RunInstances", base + "&Placement.Nope=x", "UnknownParameter", "Placement.Nope"},
		{"RunInstances", "ImageId=ami-1&MaxCount=1", "MissingParameter", "MinCount"},
		{"RunInstances", "ImageId=ami-1&MinCount=x&MaxCount=1", "InvalidParameterValue", "MinCount"},
		{"RunInstances", "ImageId=ami-1&MinCount=99999999999&MaxCount=1", "InvalidParameterValue", "MinCount"},
		{"RunInstances", "ImageId=ami-1&MinCount=1.5&MaxCount=1", "InvalidParameterValue", "MinCount"},
		{"RunInstances", base + "&DryRun=maybe", "InvalidParameterValue", "DryRun"},
		{"RunInstances", base + "&DryRun=1", "InvalidParameterValue", "DryRun"},
		{"RunInstances", base + "&InstanceInitiatedShutdownBehavior=explode", "InvalidParameterValue", "InstanceInitiatedShutdownBehavior"},
		{"RunInstances", base + "&BlockDeviceMapping.1.Ebs.VolumeType=floppy", "InvalidParameterValue", "BlockDeviceMapping.1.Ebs.VolumeType"},
		{"RunInstances", base + "&SecurityGroupId=sg-1", "InvalidParameterValue", "SecurityGroupId"},
		{"RunInstances", base + "&ImageId=ami-2", "InvalidParameterValue", "ImageId"},
		{"RunInstances", base + "&SecurityGroupId.1=a&SecurityGroupId.3=b", "UnknownParameter", "SecurityGroupId.3"},
		{"DescribeSpotPriceHistory", "StartTime=yesterday", "InvalidParameterValue", "StartTime"},
		{"ImportKeyPair", "KeyName=k&PublicKeyMaterial=!!!not-base64", "InvalidParameterValue", "PublicKeyMaterial"},
		{"DescribeVpcs", "Filter.1.Name=cidr&Filter.1.Value=x", "InvalidParameterValue", "Filter.1.Value"},
		{"DescribeVpcs", "Filter.1.Name=cidr&Filter.1.Value=", "InvalidParameterValue", "Filter.1.Value"},
	}
	m := awsmodel.MustLoad("ec2")
	for _, c := range cases {
		form, err := url.ParseQuery(c.body)
		if err != nil {
			t.Fatal(err)
		}
		in := reflect.New(inputType(t, c.op)).Interface()
		err = DecodeQuery(m, c.op, form, in)
		if code(err) != c.code {
			t.Errorf("%s %s: got %v, want %s", c.op, c.body, err, c.code)
			continue
		}
		if !strings.Contains(err.Error(), c.mentions) {
			t.Errorf("%s %s: %q does not name %s", c.op, c.body, err, c.mentions)
		}
	}
}

func inputType(t *testing.T, op string) reflect.Type {
	switch op {
	case "RunInstances":
		return reflect.TypeOf(ec2.RunInstancesInput{})
	case "DescribeSpotPriceHistory":
		return reflect.TypeOf(ec2.DescribeSpotPriceHistoryInput{})
	case "ImportKeyPair":
		return reflect.TypeOf(ec2.ImportKeyPairInput{})
	case "DescribeVpcs":
		return reflect.TypeOf(ec2.DescribeVpcsInput{})
	}
	t.Fatalf("no input type for %s", op)
	return nil
}

func TestParseTime(t *testing.T) {
	want := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	for _, raw := range []string{"2026-01-02T03:04:05Z", "2026-01-02T03:04:05.000Z", "2026-01-02T04:04:05+01:00", "2026-01-02T03:04:05", "1767323045"} {
		got, err := ParseTime(raw)
		if err != nil || !got.Equal(want) {
			t.Errorf("ParseTime(%q) = %v, %v", raw, got, err)
		}
	}
	if _, err := ParseTime("2026-13-45"); err == nil {
		t.Error("accepted a month 13")
	}
}
