// Command yaml2json turns a stream of YAML documents (kustomize build's
// output) into one JSON array, for tests that check rendered objects with
// encoding/json.
package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"

	"sigs.k8s.io/kustomize/kyaml/kio"
	"sigs.k8s.io/yaml"
)

func main() {
	in, err := io.ReadAll(os.Stdin)
	if err != nil {
		fail(err)
	}
	nodes, err := (&kio.ByteReader{Reader: bytes.NewReader(in), OmitReaderAnnotations: true}).Read()
	if err != nil {
		fail(err)
	}
	docs := make([]json.RawMessage, 0, len(nodes))
	for _, n := range nodes {
		s, err := n.String()
		if err != nil {
			fail(err)
		}
		j, err := yaml.YAMLToJSON([]byte(s))
		if err != nil {
			fail(err)
		}
		docs = append(docs, j)
	}
	out, _ := json.MarshalIndent(docs, "", "  ")
	os.Stdout.Write(append(out, '\n'))
}

func fail(err error) {
	fmt.Fprintf(os.Stderr, "yaml2json: %v\n", err)
	os.Exit(1)
}
