package testkit

import (
	"net/http"
	"sync"

	"k8s.io/client-go/rest"
)

// Requests counts the API requests made through a rest.Config that
// CountRequests returned, so a test can assert against a real API server
// how often its client lists or watches a collection (a cost that grows
// with the cluster), not only what it ends up writing.
type Requests struct {
	mu   sync.Mutex
	seen []countedRequest
}

type countedRequest struct {
	path  string
	watch bool
}

// CountRequests returns a copy of rc whose requests r counts.
func CountRequests(rc *rest.Config) (*rest.Config, *Requests) {
	r := &Requests{}
	rc = rest.CopyConfig(rc)
	rc.Wrap(func(next http.RoundTripper) http.RoundTripper {
		return roundTripper(func(req *http.Request) (*http.Response, error) {
			if req.Method == http.MethodGet {
				w := req.URL.Query().Get("watch")
				r.mu.Lock()
				r.seen = append(r.seen, countedRequest{path: req.URL.Path, watch: w == "true" || w == "1"})
				r.mu.Unlock()
			}
			return next.RoundTrip(req)
		})
	})
	return rc, r
}

// Lists is how many times the collection at path (e.g. /api/v1/nodes)
// was read whole: GETs of path itself that are not watches.
func (r *Requests) Lists(path string) int { return r.count(path, false) }

// Watches is how many watches of the collection at path were opened.
func (r *Requests) Watches(path string) int { return r.count(path, true) }

func (r *Requests) count(path string, watch bool) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, s := range r.seen {
		if s.path == path && s.watch == watch {
			n++
		}
	}
	return n
}

type roundTripper func(*http.Request) (*http.Response, error)

func (f roundTripper) RoundTrip(req *http.Request) (*http.Response, error) { return f(req) }
