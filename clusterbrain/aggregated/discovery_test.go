package aggregated

import (
	"net/http/httptest"
	"testing"
)

// Discovery lets through only what kube-apiserver reads without a user:
// the root, the group and its served versions, health and OpenAPI.
func TestDiscoveryPaths(t *testing.T) {
	r := Registration{Group: "nodereads.nodevirt.io", Versions: []string{"v1"}}
	for path, want := range map[string]bool{
		"/": true, "/apis": true, "/apis/": true, "/healthz": true, "/openapi/v2": true, "/openapi/v3": true,
		"/apis/nodereads.nodevirt.io":     true,
		"/apis/nodereads.nodevirt.io/v1/": true,
		"/apis/nodereads.nodevirt.io/v2":  false,
		"/apis/other.io/v1":               false,
		"/apis/nodereads.nodevirt.io/v1/namespaces/a/virtualmachineinstances/b/secrets/c": false,
		"/apis/nodereads.nodevirt.io/v1/../../healthz":                                    false,
	} {
		if got := r.Discovery(httptest.NewRequest("GET", "https://x"+path, nil)); got != want {
			t.Errorf("%s: public %v, want %v", path, got, want)
		}
	}
}
