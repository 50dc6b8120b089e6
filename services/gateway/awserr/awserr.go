// Package awserr is the error every gateway handler returns: an AWS error
// code, a message in AWS's words, and the HTTP status AWS sends with it. The
// protocol codecs turn it into each service's wire form.
package awserr

import (
	"errors"
	"fmt"
	"net/http"
)

// Error is an AWS API error.
type Error struct {
	Code    string
	Message string
	Status  int
	// Sender is false for server faults (the <Type>Receiver</Type> of the
	// Query protocol).
	Sender bool
}

func (e *Error) Error() string { return e.Code + ": " + e.Message }

// New makes a client error (HTTP 400 unless status says otherwise).
func New(status int, code, format string, args ...any) *Error {
	if status == 0 {
		status = http.StatusBadRequest
	}
	return &Error{Code: code, Message: fmt.Sprintf(format, args...), Status: status, Sender: status < 500}
}

// As returns err as *Error, or an InternalError that hides the detail (which
// the gateway logs) from the caller.
func As(err error) *Error {
	var e *Error
	if errors.As(err, &e) {
		return e
	}
	return &Error{Code: "InternalError", Message: "An internal error has occurred.", Status: http.StatusInternalServerError}
}

// Common errors, worded as EC2 words them.

func InvalidParameterValue(format string, args ...any) *Error {
	return New(400, "InvalidParameterValue", format, args...)
}

func InvalidParameter(format string, args ...any) *Error {
	return New(400, "InvalidParameter", format, args...)
}

func InvalidParameterCombination(format string, args ...any) *Error {
	return New(400, "InvalidParameterCombination", format, args...)
}

func MissingParameter(name string) *Error {
	return New(400, "MissingParameter", "The request must contain the parameter %s", name)
}

func UnknownParameter(name string) *Error {
	return New(400, "UnknownParameter", "The parameter %s is not recognized", name)
}

func DependencyViolation(format string, args ...any) *Error {
	return New(400, "DependencyViolation", format, args...)
}

func UnsupportedOperation(format string, args ...any) *Error {
	return New(400, "UnsupportedOperation", format, args...)
}

func InvalidAction(action, service string) *Error {
	return New(400, "InvalidAction", "The action %s is not valid for this web service.", action)
}

func DryRunOperation() *Error {
	return New(http.StatusPreconditionFailed, "DryRunOperation", "Request would have succeeded, but DryRun flag is set.")
}

func UnauthorizedOperation(format string, args ...any) *Error {
	return New(http.StatusForbidden, "UnauthorizedOperation", format, args...)
}
