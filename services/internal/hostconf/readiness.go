package hostconf

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
)

// Reason codes of the readiness report.
const (
	ReasonKVMUnavailable        = "KVMUnavailable"
	ReasonSoftwareEmulationOnly = "SoftwareEmulationOnly"
	ReasonStorageMissing        = "StorageMissing"
	ReasonConfigInvalid         = "ConfigInvalid"
	ReasonConfigMissing         = "ConfigMissing"
	ReasonCredentialsMissing    = "CredentialsMissing"
	ReasonConfigWarning         = "ConfigWarning"
	ReasonTLSUnavailable        = "TLSUnavailable"
	ReasonStarterAMIMissing     = "StarterAMIMissing"
)

// Reason is one line of the readiness report: a prerequisite that is
// missing, in words.
type Reason struct {
	Code    string `json:"code"`
	Message string `json:"message"`
	// Fatal reasons keep the host from serving; others degrade it.
	Fatal bool `json:"fatal"`
}

func (r Reason) String() string { return r.Code + ": " + r.Message }

// Readiness is the report hangar-firstboot writes and `hangar status` reads.
type Readiness struct {
	Ready   bool     `json:"ready"`
	Reasons []Reason `json:"reasons"`
}

// Add appends a reason; a fatal one makes the host not ready.
func (r *Readiness) Add(code string, fatal bool, format string, args ...any) {
	r.Reasons = append(r.Reasons, Reason{Code: code, Message: fmt.Sprintf(format, args...), Fatal: fatal})
	if fatal {
		r.Ready = false
	}
}

// Has reports whether a reason with the code is present.
func (r Readiness) Has(code string) bool {
	for _, x := range r.Reasons {
		if x.Code == code {
			return true
		}
	}
	return false
}

// DefaultReadinessPath is where hangar-firstboot writes the report.
const DefaultReadinessPath = "/run/hangar/readiness.json"

// SaveReadiness writes the report.
func SaveReadiness(path string, r Readiness) error {
	raw, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, append(raw, '\n'), 0o644); err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	return os.Rename(tmp, path)
}

// LoadReadiness reads the report.
func LoadReadiness(path string) (Readiness, error) {
	var r Readiness
	raw, err := os.ReadFile(path)
	if err != nil {
		return r, fmt.Errorf("reading readiness report: %w", err)
	}
	if err := json.Unmarshal(raw, &r); err != nil {
		return r, fmt.Errorf("parsing readiness report %s: %w", path, err)
	}
	return r, nil
}
