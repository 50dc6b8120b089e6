package awsproto

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/url"
	"reflect"
	"strings"
	"testing"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/sts"
	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"hangar.dev/hangar/services/gateway/awserr"
	"hangar.dev/hangar/services/gateway/awsmodel"
)

// formCapture is an in-process http client that keeps the form the SDK
// sends and answers with an error, so the SDK's serializer runs without a
// socket.
type formCapture struct{ form url.Values }

func (c *formCapture) Do(r *http.Request) (*http.Response, error) {
	raw, err := io.ReadAll(r.Body)
	if err != nil {
		return nil, err
	}
	c.form, err = url.ParseQuery(string(raw))
	if err != nil {
		return nil, err
	}
	body := `<?xml version="1.0"?><Response><Errors><Error><Code>Captured</Code><Message>c</Message></Error></Errors><RequestID>r</RequestID></Response>`
	return &http.Response{StatusCode: 400, Header: http.Header{"Content-Type": {"text/xml"}}, Body: io.NopCloser(strings.NewReader(body)), Request: r}, nil
}

// fuzzOp is an operation the fuzzer decodes into, with the SDK call that
// serialises its input.
type fuzzOp struct {
	service, op string
	in          reflect.Type
	send        func(ctx context.Context, c *formCapture, in any) error
}

var fuzzOps = []fuzzOp{
	{"ec2", "RunInstances", reflect.TypeOf(ec2.RunInstancesInput{}), func(ctx context.Context, c *formCapture, in any) error {
		_, err := ec2Over(c).RunInstances(ctx, in.(*ec2.RunInstancesInput))
		return err
	}},
	{"ec2", "DescribeInstances", reflect.TypeOf(ec2.DescribeInstancesInput{}), func(ctx context.Context, c *formCapture, in any) error {
		_, err := ec2Over(c).DescribeInstances(ctx, in.(*ec2.DescribeInstancesInput))
		return err
	}},
	{"ec2", "AuthorizeSecurityGroupIngress", reflect.TypeOf(ec2.AuthorizeSecurityGroupIngressInput{}), func(ctx context.Context, c *formCapture, in any) error {
		_, err := ec2Over(c).AuthorizeSecurityGroupIngress(ctx, in.(*ec2.AuthorizeSecurityGroupIngressInput))
		return err
	}},
	{"sts", "AssumeRole", reflect.TypeOf(sts.AssumeRoleInput{}), func(ctx context.Context, c *formCapture, in any) error {
		_, err := sts.New(sts.Options{Region: "us-east-1", BaseEndpoint: aws.String("http://capture"), Credentials: testCreds, HTTPClient: c, RetryMaxAttempts: 1}).
			AssumeRole(ctx, in.(*sts.AssumeRoleInput))
		return err
	}},
}

func ec2Over(c *formCapture) *ec2.Client {
	return ec2.New(ec2.Options{Region: "us-east-1", BaseEndpoint: aws.String("http://capture"), Credentials: testCreds, HTTPClient: c, RetryMaxAttempts: 1})
}

// FuzzDecodeQuery decodes arbitrary forms into rich inputs (RunInstances
// nests lists of structures of lists; AssumeRole uses .member.N lists).
// Every rejection must be a 4xx AWS error naming the parameter, never an
// internal error; every acceptance must mean what the SDK means: the
// decoded input, serialised again by aws-sdk-go-v2, decodes to the same
// value.
func FuzzDecodeQuery(f *testing.F) {
	f.Add(uint8(0), "ImageId=ami-1&MinCount=1&MaxCount=1&TagSpecification.1.ResourceType=instance&TagSpecification.1.Tag.1.Key=a&TagSpecification.1.Tag.1.Value=b")
	f.Add(uint8(0), "MinCount=99999999999999&MaxCount=x")
	f.Add(uint8(0), "MinCount=1&MaxCount=2&BlockDeviceMapping.1.Ebs.VolumeSize=8&BlockDeviceMapping.2.DeviceName=/dev/sdb&SecurityGroupId.1=sg-1&SecurityGroupId.3=sg-2")
	f.Add(uint8(1), "Filter.1.Name=a&Filter.1.Value.1=b&Filter.1.Value=c")
	f.Add(uint8(1), "Filter.1.Name=tag%3AName&Filter.1.Value.1=x+y&Filter.2.Name=vpc-id&Filter.2.Value.1=vpc-1&MaxResults=5&DryRun=TRUE")
	f.Add(uint8(2), "GroupId=sg-1&IpPermissions.1.IpProtocol=tcp&IpPermissions.1.FromPort=22&IpPermissions.1.ToPort=22&IpPermissions.1.IpRanges.1.CidrIp=0.0.0.0%2F0")
	f.Add(uint8(3), "RoleArn=arn&RoleSessionName=s&PolicyArns.member.1.arn=a&Tags.member.1.Key=k&Tags.member.1.Value=v&TransitiveTagKeys.member.1=k&DurationSeconds=900")
	captured := &formCapture{}
	f.Fuzz(func(t *testing.T, which uint8, body string) {
		form, err := url.ParseQuery(body)
		if err != nil {
			return
		}
		op := fuzzOps[int(which)%len(fuzzOps)]
		m := awsmodel.MustLoad(op.service)
		in := reflect.New(op.in).Interface()
		if err := DecodeQuery(m, op.op, form, in); err != nil {
			var ae *awserr.Error
			if !errors.As(err, &ae) || ae.Status != 400 {
				t.Fatalf("%s: rejected with %v, not a 400 AWS error", op.op, err)
			}
			return
		}
		captured.form = nil
		if err := op.send(context.Background(), captured, in); captured.form == nil {
			return // the SDK's own validation refused it before sending
		} else if err == nil {
			t.Fatalf("the capture answered with an error; the SDK saw none")
		}
		again := reflect.New(op.in).Interface()
		if err := DecodeQuery(m, op.op, captured.form, again); err != nil {
			t.Fatalf("%s: the SDK's form of a decoded input does not decode: %v\nfirst form: %v\nSDK form: %v", op.op, err, form, captured.form)
		}
		opts := append([]cmp.Option{}, sdkEqual...)
		if f := reflect.ValueOf(in).Elem().FieldByName("ClientToken"); f.IsValid() && f.IsNil() {
			// The SDK fills in a ClientToken of its own.
			opts = append(opts, cmpopts.IgnoreFields(ec2.RunInstancesInput{}, "ClientToken"))
		}
		if d := cmp.Diff(in, again, opts...); d != "" {
			t.Fatalf("%s: decoding is not what the SDK means (-first +after SDK):\n%s\nform: %q", op.op, d, body)
		}
	})
}
