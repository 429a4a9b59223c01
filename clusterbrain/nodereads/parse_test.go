package nodereads

import "testing"

func TestParse(t *testing.T) {
	good := "/apis/nodereads.nodevirt.io/v1/namespaces/ns/virtualmachineinstances/vm/secrets/s"
	r, ok := parse(good)
	if !ok || r.ref.Namespace != "ns" || r.ref.Resource != "virtualmachineinstances" || r.ref.Name != "vm" || r.what != "secrets" || r.object != "s" {
		t.Fatalf("parse(%q) = %+v, %v", good, r, ok)
	}
	for _, bad := range []string{
		"/apis/nodereads.nodevirt.io/v1/namespaces/ns/virtualmachineinstances/vm/secrets",
		"/apis/nodereads.nodevirt.io/v1/namespaces/ns/virtualmachineinstances/vm/secrets/a/b",
		"/apis/nodereads.nodevirt.io/v1/namespaces/ns/virtualmachineinstances/../secrets/s",
		"/apis/nodereads.nodevirt.io/v1/namespaces//virtualmachineinstances/vm/secrets/s",
		"/apis/other.io/v1/namespaces/ns/virtualmachineinstances/vm/secrets/s",
		"/apis/nodereads.nodevirt.io/v2/namespaces/ns/virtualmachineinstances/vm/secrets/s",
	} {
		if r, ok := parse(bad); ok {
			t.Errorf("parse(%q) = %+v, want refused", bad, r)
		}
	}
}
