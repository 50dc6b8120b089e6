package tests

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/ec2"
	"github.com/aws/aws-sdk-go-v2/service/ec2/types"
	"github.com/aws/smithy-go"

	"hangar.dev/hangar/tests/harness"
)

// cli runs the aws CLI with --output json and decodes the answer into v.
func cli(t *testing.T, d *harness.Dev, v any, args ...string) {
	t.Helper()
	out := d.MustAWS(append(args, "--output", "json")...)
	if v == nil {
		return
	}
	if err := json.Unmarshal([]byte(out), v); err != nil {
		t.Fatalf("aws %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

// cliText runs the aws CLI with --output text and returns the trimmed answer.
func cliText(t *testing.T, d *harness.Dev, args ...string) string {
	t.Helper()
	return strings.TrimSpace(d.MustAWS(append(args, "--output", "text")...))
}

// cliFails runs the aws CLI and checks it fails with the AWS error code.
func cliFails(t *testing.T, d *harness.Dev, code string, args ...string) {
	t.Helper()
	_, err := d.AWS(args...)
	if err == nil {
		t.Fatalf("aws %s succeeded; want %s", strings.Join(args, " "), code)
	}
	if !strings.Contains(err.Error(), "("+code+")") {
		t.Fatalf("aws %s: %v; want %s", strings.Join(args, " "), err, code)
	}
}

// shell runs a pipeline of local tools (openssl, ssh-keygen) the test
// cross-checks against.
func shell(t *testing.T, script string) string {
	t.Helper()
	out, err := exec.Command("sh", "-c", script).CombinedOutput()
	if err != nil {
		t.Fatalf("%s: %v\n%s", script, err, out)
	}
	return strings.TrimSpace(string(out))
}

// digest extracts "ab:cd:…" from openssl's "(stdin)= ab:cd:…".
func digest(out string) string {
	_, after, _ := strings.Cut(out, "= ")
	return strings.TrimSpace(after)
}

// TestEC2NetworkFlowCLI is issue 2's networking story with the real aws
// CLI: a VPC with a subnet, security groups that reference each other, key
// pairs, an internet gateway and a route table, described with filters,
// --query and --output table; DeleteVpc refused while anything is left;
// everything survives a restart; then a clean teardown.
func TestEC2NetworkFlowCLI(t *testing.T) {
	harness.Require(t, harness.AWSCLI, "openssl", "ssh-keygen")
	d := harness.StartDev(t, harness.Options{})
	dir := t.TempDir()

	// VPC and subnet.
	var vpc struct{ Vpc struct{ VpcId string } }
	cli(t, d, &vpc, "ec2", "create-vpc", "--cidr-block", "10.20.0.0/16",
		"--tag-specifications", "ResourceType=vpc,Tags=[{Key=Name,Value=flow}]")
	vpcID := vpc.Vpc.VpcId
	var sn struct {
		Subnet struct {
			SubnetId                string
			AvailableIpAddressCount int
			AvailabilityZone        string
			Tags                    []struct{ Key, Value string }
		}
	}
	cli(t, d, &sn, "ec2", "create-subnet", "--vpc-id", vpcID, "--cidr-block", "10.20.1.0/24",
		"--tag-specifications", "ResourceType=subnet,Tags=[{Key=Name,Value=flow-public},{Key=tier,Value=web}]")
	subnetID := sn.Subnet.SubnetId
	if sn.Subnet.AvailableIpAddressCount != 251 || sn.Subnet.AvailabilityZone != "us-east-1a" || len(sn.Subnet.Tags) != 2 {
		t.Fatalf("create-subnet = %+v", sn.Subnet)
	}
	cliFails(t, d, "InvalidSubnet.Conflict", "ec2", "create-subnet", "--vpc-id", vpcID, "--cidr-block", "10.20.1.128/25")
	cliFails(t, d, "InvalidSubnet.Range", "ec2", "create-subnet", "--vpc-id", vpcID, "--cidr-block", "10.20.2.0/29")
	cliFails(t, d, "InvalidParameterValue", "ec2", "create-subnet", "--vpc-id", vpcID, "--cidr-block", "10.20.2.0/33")
	cliFails(t, d, "DryRunOperation", "ec2", "create-subnet", "--vpc-id", vpcID, "--cidr-block", "10.20.2.0/24", "--dry-run")
	if got := cliText(t, d, "ec2", "describe-subnets", "--filters", "Name=vpc-id,Values="+vpcID, "--query", "length(Subnets)"); got != "1" {
		t.Fatalf("a dry run or a failed create left a subnet: %s", got)
	}
	d.MustAWS("ec2", "modify-subnet-attribute", "--subnet-id", subnetID, "--map-public-ip-on-launch")

	// Security groups: web open on 443, db open to web on 5432.
	var web, db struct{ GroupId string }
	cli(t, d, &web, "ec2", "create-security-group", "--group-name", "web", "--description", "web tier", "--vpc-id", vpcID,
		"--tag-specifications", "ResourceType=security-group,Tags=[{Key=tier,Value=web}]")
	cli(t, d, &db, "ec2", "create-security-group", "--group-name", "db", "--description", "database tier", "--vpc-id", vpcID)
	cliFails(t, d, "InvalidGroup.Duplicate", "ec2", "create-security-group", "--group-name", "web", "--description", "again", "--vpc-id", vpcID)
	var auth struct {
		Return             bool
		SecurityGroupRules []struct{ SecurityGroupRuleId, CidrIpv4 string }
	}
	cli(t, d, &auth, "ec2", "authorize-security-group-ingress", "--group-id", web.GroupId, "--protocol", "tcp", "--port", "443", "--cidr", "0.0.0.0/0")
	if !auth.Return || len(auth.SecurityGroupRules) != 1 || !strings.HasPrefix(auth.SecurityGroupRules[0].SecurityGroupRuleId, "sgr-") {
		t.Fatalf("authorize = %+v", auth)
	}
	d.MustAWS("ec2", "authorize-security-group-ingress", "--group-id", db.GroupId, "--ip-permissions",
		"IpProtocol=tcp,FromPort=5432,ToPort=5432,UserIdGroupPairs=[{GroupId="+web.GroupId+",Description=from web}]",
		"IpProtocol=icmp,FromPort=8,ToPort=-1,IpRanges=[{CidrIp=10.20.0.0/16}]")
	cliFails(t, d, "InvalidPermission.Duplicate", "ec2", "authorize-security-group-ingress", "--group-id", web.GroupId, "--protocol", "tcp", "--port", "443", "--cidr", "0.0.0.0/0")
	cliFails(t, d, "InvalidParameterValue", "ec2", "authorize-security-group-ingress", "--group-id", web.GroupId, "--protocol", "tcp", "--port", "70000", "--cidr", "0.0.0.0/0")
	cliFails(t, d, "InvalidParameterValue", "ec2", "authorize-security-group-ingress", "--group-id", web.GroupId, "--protocol", "tcp", "--port", "22", "--cidr", "10.0.0.300/8")
	if got := cliText(t, d, "ec2", "describe-security-groups", "--filters", "Name=ip-permission.group-id,Values="+web.GroupId, "--query", "SecurityGroups[].GroupName"); got != "db" {
		t.Fatalf("groups referencing web: %q", got)
	}
	if got := cliText(t, d, "ec2", "describe-security-group-rules", "--filters", "Name=group-id,Values="+db.GroupId,
		"--query", "SecurityGroupRules[?IsEgress==`false` && IpProtocol=='tcp'].ReferencedGroupInfo.GroupId"); got != web.GroupId {
		t.Fatalf("db's rule references %q, want %s", got, web.GroupId)
	}
	var sgs struct {
		SecurityGroups []struct {
			GroupName     string
			IpPermissions []struct {
				IpProtocol       string
				FromPort, ToPort *int
				UserIdGroupPairs []struct{ GroupId, Description string }
				IpRanges         []struct{ CidrIp string }
			}
		}
	}
	cli(t, d, &sgs, "ec2", "describe-security-groups", "--group-ids", db.GroupId)
	if p := sgs.SecurityGroups[0].IpPermissions; len(p) != 2 || p[0].UserIdGroupPairs[0].Description != "from web" || *p[0].FromPort != 5432 || *p[1].FromPort != 8 || *p[1].ToPort != -1 {
		t.Fatalf("db permissions = %+v", p)
	}

	// Key pairs, with fingerprints checked by the tools EC2's guide names.
	rsaPEM := filepath.Join(dir, "k-rsa.pem")
	if err := os.WriteFile(rsaPEM, []byte(cliText(t, d, "ec2", "create-key-pair", "--key-name", "k-rsa", "--query", "KeyMaterial")+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	want := digest(shell(t, "openssl pkcs8 -in "+rsaPEM+" -inform PEM -outform DER -topk8 -nocrypt | openssl sha1 -c"))
	if got := cliText(t, d, "ec2", "describe-key-pairs", "--key-names", "k-rsa", "--query", "KeyPairs[0].KeyFingerprint"); got != want {
		t.Fatalf("created RSA fingerprint %s, openssl %s", got, want)
	}
	edPEM := filepath.Join(dir, "k-ed.pem")
	var ed struct{ KeyMaterial, KeyFingerprint, KeyPairId string }
	cli(t, d, &ed, "ec2", "create-key-pair", "--key-name", "k-ed", "--key-type", "ed25519",
		"--tag-specifications", "ResourceType=key-pair,Tags=[{Key=owner,Value=ops}]")
	if err := os.WriteFile(edPEM, []byte(ed.KeyMaterial), 0o600); err != nil {
		t.Fatal(err)
	}
	if fields := strings.Fields(shell(t, "ssh-keygen -l -E sha256 -f "+edPEM)); strings.TrimPrefix(fields[1], "SHA256:")+"=" != ed.KeyFingerprint {
		t.Fatalf("ED25519 fingerprint %s, ssh-keygen %s", ed.KeyFingerprint, fields[1])
	}
	shell(t, "ssh-keygen -q -t rsa -b 2048 -N '' -C me@laptop -f "+filepath.Join(dir, "id_rsa"))
	var imp struct{ KeyFingerprint, KeyPairId string }
	cli(t, d, &imp, "ec2", "import-key-pair", "--key-name", "k-imported", "--public-key-material", "fileb://"+filepath.Join(dir, "id_rsa.pub"))
	want = digest(shell(t, "ssh-keygen -e -m PKCS8 -f "+filepath.Join(dir, "id_rsa.pub")+" | openssl pkey -pubin -outform DER | openssl md5 -c"))
	if imp.KeyFingerprint != want {
		t.Fatalf("imported RSA fingerprint %s, openssl %s", imp.KeyFingerprint, want)
	}
	pub, _ := os.ReadFile(filepath.Join(dir, "id_rsa.pub"))
	if got := cliText(t, d, "ec2", "describe-key-pairs", "--include-public-key", "--filters", "Name=key-name,Values=k-imp*", "--query", "KeyPairs[0].PublicKey"); got != strings.TrimSpace(string(pub)) {
		t.Fatalf("public key %q, imported %q", got, pub)
	}
	cliFails(t, d, "InvalidKeyPair.Duplicate", "ec2", "create-key-pair", "--key-name", "k-rsa")
	cliFails(t, d, "InvalidKeyPair.Format", "ec2", "import-key-pair", "--key-name", "junk", "--public-key-material", "fileb://"+rsaPEM)
	d.MustAWS("ec2", "delete-key-pair", "--key-name", "never-existed")

	// Internet gateway and a route table with a default route.
	var igw struct {
		InternetGateway struct{ InternetGatewayId string }
	}
	cli(t, d, &igw, "ec2", "create-internet-gateway", "--tag-specifications", "ResourceType=internet-gateway,Tags=[{Key=Name,Value=flow}]")
	igwID := igw.InternetGateway.InternetGatewayId
	d.MustAWS("ec2", "attach-internet-gateway", "--internet-gateway-id", igwID, "--vpc-id", vpcID)
	cliFails(t, d, "Resource.AlreadyAssociated", "ec2", "attach-internet-gateway", "--internet-gateway-id", igwID, "--vpc-id", vpcID)
	var rtb struct{ RouteTable struct{ RouteTableId string } }
	cli(t, d, &rtb, "ec2", "create-route-table", "--vpc-id", vpcID)
	rtbID := rtb.RouteTable.RouteTableId
	d.MustAWS("ec2", "create-route", "--route-table-id", rtbID, "--destination-cidr-block", "0.0.0.0/0", "--gateway-id", igwID)
	cliFails(t, d, "RouteAlreadyExists", "ec2", "create-route", "--route-table-id", rtbID, "--destination-cidr-block", "0.0.0.0/0", "--gateway-id", igwID)
	var assoc struct{ AssociationId string }
	cli(t, d, &assoc, "ec2", "associate-route-table", "--route-table-id", rtbID, "--subnet-id", subnetID)
	cliFails(t, d, "Resource.AlreadyAssociated", "ec2", "associate-route-table", "--route-table-id", rtbID, "--subnet-id", subnetID)
	if got := cliText(t, d, "ec2", "describe-route-tables", "--filters", "Name=association.subnet-id,Values="+subnetID,
		"--query", "RouteTables[].Routes[?GatewayId=='"+igwID+"'].[DestinationCidrBlock,State][]"); got != "0.0.0.0/0\tactive" {
		t.Fatalf("route to the gateway: %q", got)
	}
	if got := cliText(t, d, "ec2", "describe-route-tables", "--filters", "Name=vpc-id,Values="+vpcID, "Name=association.main,Values=true",
		"--query", "RouteTables[].Routes[].GatewayId"); got != "local" {
		t.Fatalf("main table routes: %q", got)
	}

	// --output table, as people read it.
	table := d.MustAWS("ec2", "describe-subnets", "--subnet-ids", subnetID, "--output", "table")
	for _, want := range []string{"DescribeSubnets", subnetID, "10.20.1.0/24", "MapPublicIpOnLaunch", "True", "flow-public"} {
		if !strings.Contains(table, want) {
			t.Fatalf("--output table lacks %q:\n%s", want, table)
		}
	}

	// Tag filters.
	if got := cliText(t, d, "ec2", "describe-subnets", "--filters", "Name=tag:Name,Values=flow-*", "--query", "Subnets[].SubnetId"); got != subnetID {
		t.Fatalf("tag:Name filter: %q", got)
	}
	if got := cliText(t, d, "ec2", "describe-security-groups", "--filters", "Name=tag-key,Values=tier", "--query", "SecurityGroups[].GroupId"); got != web.GroupId {
		t.Fatalf("tag-key filter: %q", got)
	}
	if got := cliText(t, d, "ec2", "describe-key-pairs", "--filters", "Name=tag:owner,Values=ops", "--query", "KeyPairs[].KeyName"); got != "k-ed" {
		t.Fatalf("key pair tag filter: %q", got)
	}
	cliFails(t, d, "InvalidParameterValue", "ec2", "describe-subnets", "--filters", "Name=colour,Values=blue")

	// DeleteVpc is refused while anything is in it.
	cliFails(t, d, "DependencyViolation", "ec2", "delete-vpc", "--vpc-id", vpcID)

	// Everything survives a restart.
	d.Restart()
	if got := cliText(t, d, "ec2", "describe-key-pairs", "--key-names", "k-ed", "--query", "KeyPairs[0].KeyFingerprint"); got != ed.KeyFingerprint {
		t.Fatalf("after restart the fingerprint is %q", got)
	}
	if got := cliText(t, d, "ec2", "describe-route-tables", "--route-table-ids", rtbID, "--query", "RouteTables[0].Associations[0].SubnetId"); got != subnetID {
		t.Fatalf("after restart the association is %q", got)
	}
	if got := cliText(t, d, "ec2", "describe-security-group-rules", "--filters", "Name=group-id,Values="+db.GroupId, "--query", "length(SecurityGroupRules)"); got != "3" {
		t.Fatalf("after restart db has %s rules", got)
	}
	if got := cliText(t, d, "ec2", "describe-subnets", "--subnet-ids", subnetID, "--query", "Subnets[0].[MapPublicIpOnLaunch,Tags[?Key=='Name'].Value|[0]]"); got != "True\tflow-public" {
		t.Fatalf("after restart the subnet is %q", got)
	}

	// Clean teardown, in the order AWS requires.
	d.MustAWS("ec2", "disassociate-route-table", "--association-id", assoc.AssociationId)
	d.MustAWS("ec2", "delete-route-table", "--route-table-id", rtbID)
	cliFails(t, d, "DependencyViolation", "ec2", "delete-internet-gateway", "--internet-gateway-id", igwID)
	d.MustAWS("ec2", "detach-internet-gateway", "--internet-gateway-id", igwID, "--vpc-id", vpcID)
	d.MustAWS("ec2", "delete-internet-gateway", "--internet-gateway-id", igwID)
	cliFails(t, d, "DependencyViolation", "ec2", "delete-security-group", "--group-id", web.GroupId)
	d.MustAWS("ec2", "revoke-security-group-ingress", "--group-id", db.GroupId, "--ip-permissions",
		"IpProtocol=tcp,FromPort=5432,ToPort=5432,UserIdGroupPairs=[{GroupId="+web.GroupId+"}]")
	cliFails(t, d, "InvalidPermission.NotFound", "ec2", "revoke-security-group-ingress", "--group-id", db.GroupId, "--protocol", "tcp", "--port", "5432", "--source-group", web.GroupId)
	d.MustAWS("ec2", "delete-security-group", "--group-id", web.GroupId)
	d.MustAWS("ec2", "delete-security-group", "--group-id", db.GroupId)
	d.MustAWS("ec2", "delete-subnet", "--subnet-id", subnetID)
	for _, k := range []string{"k-rsa", "k-ed", "k-imported"} {
		d.MustAWS("ec2", "delete-key-pair", "--key-name", k)
	}
	d.MustAWS("ec2", "delete-vpc", "--vpc-id", vpcID)
	cliFails(t, d, "InvalidVpcID.NotFound", "ec2", "describe-vpcs", "--vpc-ids", vpcID)
	if got := cliText(t, d, "ec2", "describe-key-pairs", "--query", "length(KeyPairs)"); got != "0" {
		t.Fatalf("key pairs left: %s", got)
	}
}

// TestEC2InstanceTypesCLI reads the instance type table the way users do.
func TestEC2InstanceTypesCLI(t *testing.T) {
	harness.Require(t, harness.AWSCLI)
	d := harness.StartDev(t, harness.Options{})
	var out struct {
		InstanceTypes []struct {
			InstanceType     string
			FreeTierEligible bool
			VCpuInfo         struct{ DefaultVCpus, DefaultCores int }
			MemoryInfo       struct{ SizeInMiB int }
			ProcessorInfo    struct {
				SupportedArchitectures   []string
				SustainedClockSpeedInGhz float64
			}
			NetworkInfo struct{ NetworkPerformance string }
			Hypervisor  string
		}
	}
	cli(t, d, &out, "ec2", "describe-instance-types", "--instance-types", "t3.micro", "m5.large")
	sort.Slice(out.InstanceTypes, func(i, j int) bool { return out.InstanceTypes[i].InstanceType < out.InstanceTypes[j].InstanceType })
	m5, micro := out.InstanceTypes[0], out.InstanceTypes[1]
	if micro.InstanceType != "t3.micro" || !micro.FreeTierEligible || micro.VCpuInfo.DefaultVCpus != 2 || micro.MemoryInfo.SizeInMiB != 1024 || micro.Hypervisor != "nitro" {
		t.Fatalf("t3.micro = %+v", micro)
	}
	if m5.VCpuInfo.DefaultCores != 1 || m5.MemoryInfo.SizeInMiB != 8192 || m5.ProcessorInfo.SustainedClockSpeedInGhz != 3.1 || m5.NetworkInfo.NetworkPerformance != "Up to 10 Gigabit" || m5.ProcessorInfo.SupportedArchitectures[0] != "x86_64" {
		t.Fatalf("m5.large = %+v", m5)
	}
	if got := cliText(t, d, "ec2", "describe-instance-types", "--filters", "Name=vcpu-info.default-vcpus,Values=96", "Name=bare-metal,Values=false",
		"--query", "sort(InstanceTypes[].InstanceType)"); got != "c5.24xlarge\tm5.24xlarge\tr5.24xlarge" {
		t.Fatalf("96 vCPU types: %q", got)
	}
	// The CLI follows NextToken through every page.
	var names []string
	cli(t, d, &names, "ec2", "describe-instance-types", "--page-size", "5", "--query", "InstanceTypes[].InstanceType")
	if len(names) != 34 {
		t.Fatalf("all types over pages of 5: %d", len(names))
	}
	cliFails(t, d, "InvalidInstanceType", "ec2", "describe-instance-types", "--instance-types", "m5.enormous")
	if got := cliText(t, d, "ec2", "describe-instance-type-offerings", "--location-type", "availability-zone", "--filters", "Name=instance-type,Values=c5.*",
		"--query", "InstanceTypeOfferings[?InstanceType=='c5.large'].Location"); got != "us-east-1a" {
		t.Fatalf("c5.large offering: %q", got)
	}
	if got := cliText(t, d, "ec2", "describe-instance-type-offerings", "--location-type", "availability-zone-id", "--query", "InstanceTypeOfferings[0].Location"); got != "use1-az1" {
		t.Fatalf("zone id offering: %q", got)
	}
	table := d.MustAWS("ec2", "describe-instance-types", "--instance-types", "r5.large", "--query", "InstanceTypes[].[InstanceType,VCpuInfo.DefaultVCpus,MemoryInfo.SizeInMiB]", "--output", "table")
	for _, want := range []string{"r5.large", "2", "16384"} {
		if !strings.Contains(table, want) {
			t.Fatalf("table lacks %q:\n%s", want, table)
		}
	}
}

// TestEC2NetworkSDK drives the same records with aws-sdk-go-v2: its
// paginators, its parsing of every output, its error codes.
func TestEC2NetworkSDK(t *testing.T) {
	d := harness.StartDev(t, harness.Options{})
	ctx := context.Background()
	c := ec2.NewFromConfig(d.SDK())
	vpc, err := c.CreateVpc(ctx, &ec2.CreateVpcInput{CidrBlock: aws.String("10.30.0.0/16")})
	if err != nil {
		t.Fatal(err)
	}
	vpcID := *vpc.Vpc.VpcId
	for i := range 7 {
		_, err := c.CreateSubnet(ctx, &ec2.CreateSubnetInput{VpcId: &vpcID, CidrBlock: aws.String("10.30." + string(rune('0'+i)) + ".0/24"),
			TagSpecifications: []types.TagSpecification{{ResourceType: types.ResourceTypeSubnet, Tags: []types.Tag{{Key: aws.String("n"), Value: aws.String(string(rune('a' + i)))}}}}})
		if err != nil {
			t.Fatal(err)
		}
	}
	pages, n := 0, 0
	p := ec2.NewDescribeSubnetsPaginator(c, &ec2.DescribeSubnetsInput{MaxResults: aws.Int32(5), Filters: []types.Filter{{Name: aws.String("vpc-id"), Values: []string{vpcID}}}})
	for p.HasMorePages() {
		page, err := p.NextPage(ctx)
		if err != nil {
			t.Fatal(err)
		}
		pages++
		n += len(page.Subnets)
		for _, s := range page.Subnets {
			if *s.AvailableIpAddressCount != 251 || len(s.Tags) != 1 {
				t.Fatalf("subnet = %+v", s)
			}
		}
	}
	if n != 7 || pages != 2 {
		t.Fatalf("%d subnets over %d pages", n, pages)
	}

	web, err := c.CreateSecurityGroup(ctx, &ec2.CreateSecurityGroupInput{VpcId: &vpcID, GroupName: aws.String("web"), Description: aws.String("web")})
	if err != nil {
		t.Fatal(err)
	}
	app, err := c.CreateSecurityGroup(ctx, &ec2.CreateSecurityGroupInput{VpcId: &vpcID, GroupName: aws.String("app"), Description: aws.String("app")})
	if err != nil {
		t.Fatal(err)
	}
	auth, err := c.AuthorizeSecurityGroupIngress(ctx, &ec2.AuthorizeSecurityGroupIngressInput{GroupId: app.GroupId, IpPermissions: []types.IpPermission{
		{IpProtocol: aws.String("tcp"), FromPort: aws.Int32(8080), ToPort: aws.Int32(8080), UserIdGroupPairs: []types.UserIdGroupPair{{GroupId: web.GroupId}}},
		{IpProtocol: aws.String("-1"), UserIdGroupPairs: []types.UserIdGroupPair{{GroupId: app.GroupId}}},
	}})
	if err != nil || len(auth.SecurityGroupRules) != 2 {
		t.Fatalf("authorize: %v %+v", err, auth)
	}
	_, err = c.AuthorizeSecurityGroupIngress(ctx, &ec2.AuthorizeSecurityGroupIngressInput{GroupId: app.GroupId, IpPermissions: []types.IpPermission{
		{IpProtocol: aws.String("tcp"), FromPort: aws.Int32(0), ToPort: aws.Int32(65536), IpRanges: []types.IpRange{{CidrIp: aws.String("0.0.0.0/0")}}}}})
	if got := apiCode(err); got != "InvalidParameterValue" {
		t.Fatalf("port 65536: %s", got)
	}
	rules, err := c.DescribeSecurityGroupRules(ctx, &ec2.DescribeSecurityGroupRulesInput{Filters: []types.Filter{{Name: aws.String("group-id"), Values: []string{*app.GroupId}}}})
	if err != nil || len(rules.SecurityGroupRules) != 3 {
		t.Fatalf("rules: %v %+v", err, rules)
	}
	_, err = c.DeleteSecurityGroup(ctx, &ec2.DeleteSecurityGroupInput{GroupId: web.GroupId})
	if got := apiCode(err); got != "DependencyViolation" {
		t.Fatalf("deleting a referenced group: %s", got)
	}

	kp, err := c.CreateKeyPair(ctx, &ec2.CreateKeyPairInput{KeyName: aws.String("sdk"), KeyType: types.KeyTypeEd25519, KeyFormat: types.KeyFormatPem})
	if err != nil || !strings.Contains(*kp.KeyMaterial, "OPENSSH PRIVATE KEY") {
		t.Fatalf("create key pair: %v", err)
	}
	keys, err := c.DescribeKeyPairs(ctx, &ec2.DescribeKeyPairsInput{KeyPairIds: []string{*kp.KeyPairId}, IncludePublicKey: aws.Bool(true)})
	if err != nil || len(keys.KeyPairs) != 1 || keys.KeyPairs[0].KeyType != types.KeyTypeEd25519 || *keys.KeyPairs[0].KeyFingerprint != *kp.KeyFingerprint || keys.KeyPairs[0].CreateTime == nil {
		t.Fatalf("describe key pairs: %v %+v", err, keys)
	}
	imp, err := c.ImportKeyPair(ctx, &ec2.ImportKeyPairInput{KeyName: aws.String("sdk-import"), PublicKeyMaterial: []byte(*keys.KeyPairs[0].PublicKey)})
	if err != nil || *imp.KeyFingerprint != *kp.KeyFingerprint {
		t.Fatalf("re-importing a created ED25519 key keeps its fingerprint: %v %+v", err, imp)
	}
	_, err = c.DescribeKeyPairs(ctx, &ec2.DescribeKeyPairsInput{KeyNames: []string{"nope"}})
	if got := apiCode(err); got != "InvalidKeyPair.NotFound" {
		t.Fatalf("unknown key: %s", got)
	}

	igw, err := c.CreateInternetGateway(ctx, &ec2.CreateInternetGatewayInput{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.AttachInternetGateway(ctx, &ec2.AttachInternetGatewayInput{InternetGatewayId: igw.InternetGateway.InternetGatewayId, VpcId: &vpcID}); err != nil {
		t.Fatal(err)
	}
	tables, err := c.DescribeRouteTables(ctx, &ec2.DescribeRouteTablesInput{Filters: []types.Filter{{Name: aws.String("vpc-id"), Values: []string{vpcID}}}})
	if err != nil || len(tables.RouteTables) != 1 || !*tables.RouteTables[0].Associations[0].Main {
		t.Fatalf("main route table: %v %+v", err, tables)
	}
	mainID := tables.RouteTables[0].RouteTableId
	if _, err := c.CreateRoute(ctx, &ec2.CreateRouteInput{RouteTableId: mainID, DestinationCidrBlock: aws.String("0.0.0.0/0"), GatewayId: igw.InternetGateway.InternetGatewayId}); err != nil {
		t.Fatal(err)
	}
	_, err = c.CreateRoute(ctx, &ec2.CreateRouteInput{RouteTableId: mainID, DestinationCidrBlock: aws.String("0.0.0.0/0"), GatewayId: igw.InternetGateway.InternetGatewayId})
	if got := apiCode(err); got != "RouteAlreadyExists" {
		t.Fatalf("duplicate route: %s", got)
	}
	_, err = c.DeleteVpc(ctx, &ec2.DeleteVpcInput{VpcId: &vpcID})
	if got := apiCode(err); got != "DependencyViolation" {
		t.Fatalf("delete-vpc with dependents: %s", got)
	}

	types_, err := c.DescribeInstanceTypes(ctx, &ec2.DescribeInstanceTypesInput{Filters: []types.Filter{{Name: aws.String("instance-type"), Values: []string{"t3.*"}}}})
	if err != nil || len(types_.InstanceTypes) != 7 || !*types_.InstanceTypes[0].BurstablePerformanceSupported {
		t.Fatalf("t3 family: %v %d", err, len(types_.InstanceTypes))
	}
	offers := ec2.NewDescribeInstanceTypeOfferingsPaginator(c, &ec2.DescribeInstanceTypeOfferingsInput{LocationType: types.LocationTypeRegion, MaxResults: aws.Int32(10)})
	n = 0
	for offers.HasMorePages() {
		page, err := offers.NextPage(ctx)
		if err != nil {
			t.Fatal(err)
		}
		n += len(page.InstanceTypeOfferings)
	}
	if n != 34 {
		t.Fatalf("%d offerings", n)
	}

	t.Run("CreateRouteTable with the ClientToken the SDK fills in", func(t *testing.T) {
		// aws-sdk-go-v2 fills in a ClientToken that Debian's 2023 model
		// lacks; the gateway's model is newer (see awsmodel/gen).
		rt, err := c.CreateRouteTable(ctx, &ec2.CreateRouteTableInput{VpcId: &vpcID})
		if err != nil || len(rt.RouteTable.Routes) != 1 {
			t.Fatalf("create route table: %v", err)
		}
	})
}

// apiCode is the AWS error code the SDK parsed from a response.
func apiCode(err error) string {
	var ae smithy.APIError
	if errors.As(err, &ae) {
		return ae.ErrorCode()
	}
	if err != nil {
		return err.Error()
	}
	return ""
}
