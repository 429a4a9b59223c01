package daemon_test

import (
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/nodevirt/nodevirt/clusterbrain/kit/daemon"
)

func get(t *testing.T, h http.Handler, path string) (int, string) {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
	body, _ := io.ReadAll(rec.Result().Body)
	return rec.Code, string(body)
}

// TestHealthEndpoints: /healthz answers while the process does; /readyz is
// 503 with every failing check named until all are ready.
func TestHealthEndpoints(t *testing.T) {
	h := daemon.NewHealth("api", "libvirt")
	srv := h.Handler()
	if code, body := get(t, srv, "/healthz"); code != http.StatusOK || body != "ok\n" {
		t.Fatalf("/healthz = %d %q", code, body)
	}
	h.Set("api", nil)
	h.Set("libvirt", errors.New("no socket"))
	if code, body := get(t, srv, "/readyz"); code != http.StatusServiceUnavailable || body != "libvirt: no socket\n" {
		t.Fatalf("/readyz with a failing check = %d %q", code, body)
	}
	h.Set("libvirt", nil)
	if code, body := get(t, srv, "/readyz"); code != http.StatusOK || body != "ok\n" {
		t.Fatalf("/readyz when ready = %d %q", code, body)
	}
}
