// Package httperr maps an error to its HTTP answer in one place, so that a
// handler returns errors and reads as its happy path (the incus API
// pattern):
//
//	func (s *Server) get(w http.ResponseWriter, r *http.Request) error {
//		vm, err := s.lookup(r)
//		if err != nil {
//			return err // a NotFound from lookup answers 404
//		}
//		return httperr.WriteJSON(w, http.StatusOK, vm)
//	}
//
// The status of an error is decided by the outermost error of its %w chain
// that says one: a Kubernetes status (apierrors.APIStatus, what the
// aggregated APIs answer with and virtctl reads) or an *Error (NotFound,
// Conflict, ... below). An error with neither is a 500.
//
// Two writers answer with it: WriteStatus as a Kubernetes Status object
// (aggregated APIs), WriteText as http.Error's plain text (node and upload
// endpoints).
package httperr

import (
	"encoding/json"
	"fmt"
	"net/http"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Error is an error answered with Code.
type Error struct {
	Code int
	Err  error
}

func (e *Error) Error() string { return e.Err.Error() }
func (e *Error) Unwrap() error { return e.Err }

// New returns an error answered with code and message fmt.Sprintf(format, args...)
// (%w wraps as in fmt.Errorf).
func New(code int, format string, args ...any) error {
	return &Error{Code: code, Err: fmt.Errorf(format, args...)}
}

// With returns err answered with code; nil stays nil.
func With(code int, err error) error {
	if err == nil {
		return nil
	}
	return &Error{Code: code, Err: err}
}

// BadRequest: the request is malformed (400).
func BadRequest(format string, args ...any) error {
	return New(http.StatusBadRequest, format, args...)
}

// Unauthorized: the caller is not authenticated (401).
func Unauthorized(format string, args ...any) error {
	return New(http.StatusUnauthorized, format, args...)
}

// Forbidden: the caller may not do this (403).
func Forbidden(format string, args ...any) error {
	return New(http.StatusForbidden, format, args...)
}

// NotFound: what the request names does not exist (404).
func NotFound(format string, args ...any) error {
	return New(http.StatusNotFound, format, args...)
}

// MethodNotAllowed: the method is not served on the path (405, "method not allowed").
func MethodNotAllowed() error {
	return New(http.StatusMethodNotAllowed, "method not allowed")
}

// Conflict: the object's state refuses the request (409).
func Conflict(format string, args ...any) error {
	return New(http.StatusConflict, format, args...)
}

// NotImplemented: nodevirt does not do this (501).
func NotImplemented(format string, args ...any) error {
	return New(http.StatusNotImplemented, format, args...)
}

// BadGateway: the node the request was forwarded to failed (502).
func BadGateway(format string, args ...any) error {
	return New(http.StatusBadGateway, format, args...)
}

// Unavailable: what the request needs is not there yet (503).
func Unavailable(format string, args ...any) error {
	return New(http.StatusServiceUnavailable, format, args...)
}

// Code is the HTTP status err answers with (200 for nil).
func Code(err error) int {
	if err == nil {
		return http.StatusOK
	}
	switch c := classify(err).(type) {
	case apierrors.APIStatus:
		if code := int(c.Status().Code); code != 0 {
			return code
		}
	case *Error:
		return c.Code
	}
	return http.StatusInternalServerError
}

// classify returns the outermost error of err's chain that says how it is
// answered (an *Error or an apierrors.APIStatus), or nil: the context a
// caller wraps around an error decides over what the error said.
func classify(err error) error {
	for err != nil {
		switch err.(type) {
		case *Error, apierrors.APIStatus:
			return err
		}
		switch u := err.(type) {
		case interface{ Unwrap() error }:
			err = u.Unwrap()
		case interface{ Unwrap() []error }:
			for _, e := range u.Unwrap() {
				if c := classify(e); c != nil {
					return c
				}
			}
			return nil
		default:
			return nil
		}
	}
	return nil
}

// Status is the Kubernetes Status object err answers with: the one it
// carries (as it is: a status without a code keeps none, answered as 500
// by WriteStatus), else one made from its code and message (an untyped
// error is an InternalError, its message prefixed as apierrors does).
func Status(err error) metav1.Status {
	var st metav1.Status
	switch c := classify(err).(type) {
	case apierrors.APIStatus:
		st = c.Status()
	case *Error:
		st = metav1.Status{Status: metav1.StatusFailure, Code: int32(c.Code), Message: err.Error(), Reason: reasonOf(c.Code)}
	default:
		st = apierrors.NewInternalError(err).Status()
	}
	st.Kind, st.APIVersion = "Status", "v1"
	if st.Status == "" {
		st.Status = metav1.StatusFailure
	}
	return st
}

// reasonOf is the Kubernetes reason of an HTTP code.
func reasonOf(code int) metav1.StatusReason {
	switch code {
	case http.StatusBadRequest:
		return metav1.StatusReasonBadRequest
	case http.StatusUnauthorized:
		return metav1.StatusReasonUnauthorized
	case http.StatusForbidden:
		return metav1.StatusReasonForbidden
	case http.StatusNotFound:
		return metav1.StatusReasonNotFound
	case http.StatusMethodNotAllowed:
		return metav1.StatusReasonMethodNotAllowed
	case http.StatusConflict:
		return metav1.StatusReasonConflict
	case http.StatusUnprocessableEntity:
		return metav1.StatusReasonInvalid
	case http.StatusServiceUnavailable:
		return metav1.StatusReasonServiceUnavailable
	case http.StatusInternalServerError:
		return metav1.StatusReasonInternalError
	}
	return metav1.StatusReasonUnknown
}

// WriteStatus answers with err as a Kubernetes Status object.
func WriteStatus(w http.ResponseWriter, err error) {
	st := Status(err)
	_ = WriteJSON(w, Code(err), &st)
}

// WriteText answers with err as plain text (http.Error), the message being
// err's.
func WriteText(w http.ResponseWriter, err error) {
	http.Error(w, err.Error(), Code(err))
}

// WriteJSON answers with v as JSON and code. It returns nil: the answer is
// written (as a 500 when v does not marshal), so a handler can end with it.
func WriteJSON(w http.ResponseWriter, code int, v any) error {
	data, err := json.Marshal(v)
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return nil
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_, _ = w.Write(data)
	return nil
}

// StatusHandler is a handler that returns its error, answered as a
// Kubernetes Status.
type StatusHandler func(w http.ResponseWriter, r *http.Request) error

func (h StatusHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if err := h(w, r); err != nil {
		WriteStatus(w, err)
	}
}

// TextHandler is a handler that returns its error, answered as plain text.
type TextHandler func(w http.ResponseWriter, r *http.Request) error

func (h TextHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if err := h(w, r); err != nil {
		WriteText(w, err)
	}
}
