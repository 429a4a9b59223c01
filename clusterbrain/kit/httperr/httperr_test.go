package httperr

import (
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

func TestMapping(t *testing.T) {
	vm := schema.GroupResource{Group: "kubevirt.io", Resource: "virtualmachine"}
	for _, tc := range []struct {
		name   string
		err    error
		code   int
		reason metav1.StatusReason
		status string // the Status body WriteStatus writes
		text   string // the body WriteText writes
	}{
		{
			name: "kubernetes not found", err: apierrors.NewNotFound(vm, "vm1"), code: 404, reason: metav1.StatusReasonNotFound,
			status: `{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"virtualmachine.kubevirt.io \"vm1\" not found","reason":"NotFound","details":{"name":"vm1","group":"kubevirt.io","kind":"virtualmachine"},"code":404}`,
			text:   "virtualmachine.kubevirt.io \"vm1\" not found\n",
		},
		{
			name: "kubernetes conflict wrapped", err: fmt.Errorf("start: %w", apierrors.NewConflict(vm, "vm1", errors.New("VM is not running"))),
			code: 409, reason: metav1.StatusReasonConflict,
			status: `{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"Operation cannot be fulfilled on virtualmachine.kubevirt.io \"vm1\": VM is not running","reason":"Conflict","details":{"name":"vm1","group":"kubevirt.io","kind":"virtualmachine"},"code":409}`,
			text:   "start: Operation cannot be fulfilled on virtualmachine.kubevirt.io \"vm1\": VM is not running\n",
		},
		{
			name: "kubernetes status without a code", err: &apierrors.StatusError{ErrStatus: metav1.Status{Message: "odd"}}, code: 500,
			status: `{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"odd"}`,
			text:   "odd\n",
		},
		{
			name: "hand-made not implemented", err: &apierrors.StatusError{ErrStatus: metav1.Status{Status: metav1.StatusFailure, Code: 501, Message: "not yet"}},
			code:   501,
			status: `{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"not yet","code":501}`,
			text:   "not yet\n",
		},
		{
			name: "untyped", err: errors.New("disk gone"), code: 500, reason: metav1.StatusReasonInternalError,
			status: `{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"Internal error occurred: disk gone","reason":"InternalError","details":{"causes":[{"message":"disk gone"}]},"code":500}`,
			text:   "disk gone\n",
		},
		{
			name: "typed conflict", err: Conflict("vmi %s is paused", "a"), code: 409, reason: metav1.StatusReasonConflict,
			status: `{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"vmi a is paused","reason":"Conflict","code":409}`,
			text:   "vmi a is paused\n",
		},
		{
			name: "typed unprocessable", err: New(http.StatusUnprocessableEntity, "spec.pvcName is required"), code: 422,
			reason: metav1.StatusReasonInvalid,
			status: `{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"spec.pvcName is required","reason":"Invalid","code":422}`,
			text:   "spec.pvcName is required\n",
		},
		{
			name: "typed, wrapped with context", err: fmt.Errorf("upload: %w", Unavailable("node %s has no endpoint", "n1")), code: 503,
			reason: metav1.StatusReasonServiceUnavailable,
			status: `{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"upload: node n1 has no endpoint","reason":"ServiceUnavailable","code":503}`,
			text:   "upload: node n1 has no endpoint\n",
		},
		{
			name: "typed around a kubernetes error", err: Unavailable("pvc a/b: %w", apierrors.NewForbidden(vm, "b", errors.New("rbac"))),
			code: 503, reason: metav1.StatusReasonServiceUnavailable,
			text: "pvc a/b: virtualmachine.kubevirt.io \"b\" is forbidden: rbac\n",
		},
		{
			name: "kubernetes error around a typed one", err: apierrors.NewInternalError(NotFound("gone")), code: 500,
			reason: metav1.StatusReasonInternalError, text: "Internal error occurred: gone\n",
		},
		{
			name: "joined", err: errors.Join(errors.New("first"), Conflict("second")), code: 409,
			reason: metav1.StatusReasonConflict, text: "first\nsecond\n",
		},
		{name: "bad request", err: BadRequest("bad"), code: 400, reason: metav1.StatusReasonBadRequest, text: "bad\n"},
		{name: "unauthorized", err: Unauthorized("who"), code: 401, reason: metav1.StatusReasonUnauthorized, text: "who\n"},
		{name: "forbidden", err: Forbidden("no"), code: 403, reason: metav1.StatusReasonForbidden, text: "no\n"},
		{name: "not found", err: NotFound("gone"), code: 404, reason: metav1.StatusReasonNotFound, text: "gone\n"},
		{name: "method", err: MethodNotAllowed(), code: 405, reason: metav1.StatusReasonMethodNotAllowed, text: "method not allowed\n"},
		{name: "not implemented", err: NotImplemented("later"), code: 501, text: "later\n"},
		{name: "bad gateway", err: BadGateway("node failed"), code: 502, text: "node failed\n"},
		{name: "with", err: With(http.StatusTeapot, errors.New("tea")), code: 418, text: "tea\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Code(tc.err); got != tc.code {
				t.Errorf("Code = %d, want %d", got, tc.code)
			}
			st := Status(tc.err)
			if code := int(st.Code); code != tc.code && code != 0 || st.Reason != tc.reason || st.Kind != "Status" || st.Status != metav1.StatusFailure {
				t.Errorf("Status = %+v, want code %d reason %q", st, tc.code, tc.reason)
			}
			rec := httptest.NewRecorder()
			WriteStatus(rec, tc.err)
			if rec.Code != tc.code || rec.Header().Get("Content-Type") != "application/json" {
				t.Errorf("WriteStatus answered %d %q", rec.Code, rec.Header().Get("Content-Type"))
			}
			if tc.status != "" && strings.TrimSpace(rec.Body.String()) != tc.status {
				t.Errorf("WriteStatus body\n got %s\nwant %s", rec.Body, tc.status)
			}
			rec = httptest.NewRecorder()
			WriteText(rec, tc.err)
			if rec.Code != tc.code || rec.Body.String() != tc.text {
				t.Errorf("WriteText answered %d %q, want %d %q", rec.Code, rec.Body, tc.code, tc.text)
			}
		})
	}
}

func TestNilAndHandlers(t *testing.T) {
	if Code(nil) != http.StatusOK || With(500, nil) != nil {
		t.Error("nil is not a success")
	}
	for _, tc := range []struct {
		name string
		h    http.Handler
		code int
		body string
	}{
		{"status error", StatusHandler(func(http.ResponseWriter, *http.Request) error { return NotFound("x") }), 404, `"reason":"NotFound"`},
		{"text error", TextHandler(func(http.ResponseWriter, *http.Request) error { return Forbidden("nope") }), 403, "nope\n"},
		{"happy path", StatusHandler(func(w http.ResponseWriter, _ *http.Request) error {
			return WriteJSON(w, http.StatusOK, map[string]int{"a": 1})
		}), 200, `{"a":1}`},
		{"nothing written", TextHandler(func(http.ResponseWriter, *http.Request) error { return nil }), 200, ""},
	} {
		rec := httptest.NewRecorder()
		tc.h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/", nil))
		if rec.Code != tc.code || !strings.Contains(rec.Body.String(), tc.body) {
			t.Errorf("%s: answered %d %q, want %d with %q", tc.name, rec.Code, rec.Body, tc.code, tc.body)
		}
	}
}
