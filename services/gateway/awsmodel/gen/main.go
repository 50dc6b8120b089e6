// Command gen copies the AWS API models hangar serves from botocore's data
// (Debian's awscli ships them) into services/gateway/awsmodel/models,
// without their documentation, so builds never need awscli installed.
//
//	go run ./services/gateway/awsmodel/gen [-botocore DIR]
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
)

var services = map[string]string{
	"ec2": "2016-11-15",
	"sts": "2011-06-15",
	"ebs": "2019-11-02",
	"eks": "2017-11-01",
	"iam": "2010-05-08",
}

var drop = map[string]bool{"documentation": true, "documentationUrl": true, "examples": true, "deprecatedMessage": true}

func strip(v any) any {
	switch v := v.(type) {
	case map[string]any:
		out := map[string]any{}
		for k, x := range v {
			if !drop[k] {
				out[k] = strip(x)
			}
		}
		return out
	case []any:
		for i := range v {
			v[i] = strip(v[i])
		}
		return v
	}
	return v
}

func main() {
	dir := flag.String("botocore", "/usr/lib/python3/dist-packages/awscli/botocore/data", "botocore data directory")
	out := flag.String("out", "services/gateway/awsmodel/models", "output directory")
	flag.Parse()
	for svc, ver := range services {
		raw, err := os.ReadFile(filepath.Join(*dir, svc, ver, "service-2.json"))
		if err != nil {
			fmt.Fprintf(os.Stderr, "gen: %v (apt-get install awscli)\n", err)
			os.Exit(1)
		}
		var m any
		if err := json.Unmarshal(raw, &m); err != nil {
			fmt.Fprintf(os.Stderr, "gen: %s: %v\n", svc, err)
			os.Exit(1)
		}
		b, err := json.Marshal(strip(m))
		if err != nil {
			panic(err)
		}
		if err := os.WriteFile(filepath.Join(*out, svc+".json"), append(b, '\n'), 0o644); err != nil {
			fmt.Fprintf(os.Stderr, "gen: %v\n", err)
			os.Exit(1)
		}
	}
}
