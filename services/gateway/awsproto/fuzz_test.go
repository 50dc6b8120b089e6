package awsproto

import (
	"net/url"
	"testing"

	"github.com/aws/aws-sdk-go-v2/service/ec2"

	"hangar.dev/hangar/services/gateway/awsmodel"
)

// FuzzDecodeQuery decodes arbitrary form bodies into a rich input shape
// (RunInstances nests lists of structures of lists): it must never panic,
// and anything it rejects must be an AWS-shaped error.
func FuzzDecodeQuery(f *testing.F) {
	m := awsmodel.MustLoad("ec2")
	f.Add("Action=RunInstances&ImageId=ami-1&MinCount=1&MaxCount=1&TagSpecification.1.ResourceType=instance&TagSpecification.1.Tag.1.Key=a")
	f.Add("Action=RunInstances&MinCount=99999999999999&MaxCount=x")
	f.Add("BlockDeviceMapping.1.Ebs.VolumeSize=8&BlockDeviceMapping.2.DeviceName=/dev/sdb&SecurityGroupId.1=sg-1&SecurityGroupId.3=sg-2")
	f.Add("Filter.1.Name=a&Filter.1.Value.1=b&Filter.1.Value=c")
	f.Fuzz(func(t *testing.T, body string) {
		form, err := url.ParseQuery(body)
		if err != nil {
			return
		}
		var in ec2.RunInstancesInput
		if err := DecodeQuery(m, "RunInstances", form, &in); err != nil {
			if _, ok := err.(interface{ Error() string }); !ok {
				t.Fatalf("non-error %v", err)
			}
		}
	})
}
