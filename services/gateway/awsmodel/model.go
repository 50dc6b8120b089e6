// Package awsmodel holds the AWS API models the gateway serves (botocore's
// service-2.json, documentation stripped) and answers the questions the
// protocol codecs ask of them: an operation's input and output shapes, a
// member's wire name, whether a list is flattened.
//
// The models are data copied from AWS; regenerate with `go generate`.
package awsmodel

//go:generate go run ./gen -out models

import (
	"embed"
	"encoding/json"
	"fmt"
	"sync"
)

//go:embed models/*.json
var files embed.FS

// Model is one service's API model.
type Model struct {
	Metadata   Metadata             `json:"metadata"`
	Operations map[string]Operation `json:"operations"`
	Shapes     map[string]*Shape    `json:"shapes"`
}

// Metadata is the model's header.
type Metadata struct {
	APIVersion       string `json:"apiVersion"`
	EndpointPrefix   string `json:"endpointPrefix"`
	Protocol         string `json:"protocol"`
	ServiceID        string `json:"serviceId"`
	SigningName      string `json:"signingName"`
	XMLNamespace     string `json:"xmlNamespace"`
	JSONVersion      string `json:"jsonVersion"`
	ServiceFullName  string `json:"serviceFullName"`
	TargetPrefix     string `json:"targetPrefix"`
	SignatureVersion string `json:"signatureVersion"`
}

// Operation is one API action.
type Operation struct {
	Name   string `json:"name"`
	HTTP   HTTP   `json:"http"`
	Input  *Ref   `json:"input"`
	Output *Ref   `json:"output"`
	Errors []Ref  `json:"errors"`
}

// HTTP is an operation's REST binding.
type HTTP struct {
	Method       string `json:"method"`
	RequestURI   string `json:"requestUri"`
	ResponseCode int    `json:"responseCode"`
}

// Ref points at a shape, with the wire details of that use of it.
type Ref struct {
	Shape            string `json:"shape"`
	LocationName     string `json:"locationName"`
	QueryName        string `json:"queryName"`
	Location         string `json:"location"` // uri, querystring, header, headers, statusCode
	Flattened        bool   `json:"flattened"`
	ResultWrapper    string `json:"resultWrapper"`
	Streaming        bool   `json:"streaming"`
	IdempotencyToken bool   `json:"idempotencyToken"`
	XMLNamespace     any    `json:"xmlNamespace"`
}

// Shape is a type in the model.
type Shape struct {
	Type            string          `json:"type"`
	Members         map[string]*Ref `json:"members"`
	Required        []string        `json:"required"`
	Member          *Ref            `json:"member"` // list element
	Key             *Ref            `json:"key"`    // map key
	Value           *Ref            `json:"value"`  // map value
	Flattened       bool            `json:"flattened"`
	LocationName    string          `json:"locationName"`
	Enum            []string        `json:"enum"`
	Min             *float64        `json:"min"`
	Max             *float64        `json:"max"`
	Pattern         string          `json:"pattern"`
	Payload         string          `json:"payload"`
	Streaming       bool            `json:"streaming"`
	Exception       bool            `json:"exception"`
	Sensitive       bool            `json:"sensitive"`
	TimestampFormat string          `json:"timestampFormat"`
	Error           *struct {
		Code           string `json:"code"`
		HTTPStatusCode int    `json:"httpStatusCode"`
		SenderFault    bool   `json:"senderFault"`
	} `json:"error"`
}

var (
	mu     sync.Mutex
	loaded = map[string]*Model{}
)

// Load returns the model of a service ("ec2", "sts", "ebs", "eks", "iam").
func Load(service string) (*Model, error) {
	mu.Lock()
	defer mu.Unlock()
	if m := loaded[service]; m != nil {
		return m, nil
	}
	raw, err := files.ReadFile("models/" + service + ".json")
	if err != nil {
		return nil, fmt.Errorf("no API model for service %q", service)
	}
	m := &Model{}
	if err := json.Unmarshal(raw, m); err != nil {
		return nil, fmt.Errorf("parsing the %s model: %w", service, err)
	}
	loaded[service] = m
	return m, nil
}

// MustLoad is Load for models that ship with the binary.
func MustLoad(service string) *Model {
	m, err := Load(service)
	if err != nil {
		panic(err)
	}
	return m
}

// Shape returns the named shape or panics: a model that names a shape it
// does not define is a broken build, not bad input.
func (m *Model) Shape(name string) *Shape {
	s := m.Shapes[name]
	if s == nil {
		panic(fmt.Sprintf("awsmodel: %s model has no shape %q", m.Metadata.EndpointPrefix, name))
	}
	return s
}

// IsRequired reports whether member is required in s.
func (s *Shape) IsRequired(member string) bool {
	for _, r := range s.Required {
		if r == member {
			return true
		}
	}
	return false
}
