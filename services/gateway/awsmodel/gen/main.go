// Command gen copies the AWS API models hangar serves from botocore's data
// into services/gateway/awsmodel/models, without their documentation, so
// builds never need botocore installed.
//
//	go run ./services/gateway/awsmodel/gen [-botocore DIR]
//
// Use a botocore at least as new as the aws-sdk-go-v2 service packages in
// go.mod (pip's botocore 1.43 here): the SDK sends members an older model
// lacks (CreateRouteTable's ClientToken), which the decoder would refuse as
// UnknownParameter. Debian's awscli 2.9 ships a 2023 model under
// /usr/lib/python3/dist-packages/awscli/botocore/data; it is older than
// the SDK and only good enough for the CLI itself.
package main

import (
	"bytes"
	"compress/gzip"
	"encoding/json"
	"flag"
	"fmt"
	"io"
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
	dir := flag.String("botocore", "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/botocore/data", "botocore data directory")
	out := flag.String("out", "services/gateway/awsmodel/models", "output directory")
	flag.Parse()
	for svc, ver := range services {
		raw, err := readModel(filepath.Join(*dir, svc, ver, "service-2.json"))
		if err != nil {
			fmt.Fprintf(os.Stderr, "gen: %v (point -botocore at a botocore data directory)\n", err)
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

// readModel reads service-2.json, or the service-2.json.gz newer botocore
// releases ship.
func readModel(path string) ([]byte, error) {
	if raw, err := os.ReadFile(path); err == nil {
		return raw, nil
	}
	gz, err := os.ReadFile(path + ".gz")
	if err != nil {
		return nil, err
	}
	r, err := gzip.NewReader(bytes.NewReader(gz))
	if err != nil {
		return nil, fmt.Errorf("%s.gz: %w", path, err)
	}
	return io.ReadAll(r)
}
