package brain

import (
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/runtime"
	coreinformers "k8s.io/client-go/informers/core/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"

	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

// TestFleetInformersReadProtobuf: the Node informer the leader's roles
// share, on fleetClient, gets its list and its watch from a real API
// server as protobuf, not JSON (at 500 nodes, decoding their heartbeats
// from JSON was a good part of the idle brain's CPU).
func TestFleetInformersReadProtobuf(t *testing.T) {
	cp := controlplane.Shared(t)
	rc := rest.CopyConfig(cp.RestConfig)
	var mu sync.Mutex
	types := map[string]string{} // "list" and "watch": the responses' Content-Type
	rc.Wrap(func(next http.RoundTripper) http.RoundTripper {
		return roundTripFunc(func(req *http.Request) (*http.Response, error) {
			resp, err := next.RoundTrip(req)
			if err == nil && req.URL.Path == "/api/v1/nodes" {
				kind := "list"
				if req.URL.Query().Get("watch") == "true" {
					kind = "watch"
				}
				mu.Lock()
				types[kind] = resp.Header.Get("Content-Type")
				mu.Unlock()
			}
			return resp, err
		})
	})
	fleet, err := fleetClient(rc)
	if err != nil {
		t.Fatal(err)
	}
	inf := coreinformers.NewNodeInformer(fleet, 0, cache.Indexers{})
	go inf.RunWithContext(t.Context())
	testkit.Until(t, time.Minute, "the node informer's list and watch", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return types["list"] != "" && types["watch"] != ""
	})
	mu.Lock()
	defer mu.Unlock()
	for kind, ct := range types {
		if !strings.HasPrefix(ct, runtime.ContentTypeProtobuf) {
			t.Errorf("the Nodes' %s came as %q, want %s", kind, ct, runtime.ContentTypeProtobuf)
		}
	}
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(req *http.Request) (*http.Response, error) { return f(req) }
