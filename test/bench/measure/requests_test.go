package measure

import (
	"strings"
	"testing"
)

func TestParseRequestCountsAndDelta(t *testing.T) {
	before, err := ParseRequestCounts(strings.NewReader(`# HELP apiserver_request_total x
apiserver_request_total{code="201",component="apiserver",group="kubevirt.io",resource="virtualmachines",scope="resource",subresource="",verb="POST",version="v1"} 10
apiserver_request_total{code="200",component="apiserver",group="",resource="nodes",scope="cluster",subresource="",verb="LIST",version="v1"} 3
`))
	if err != nil {
		t.Fatal(err)
	}
	after, err := ParseRequestCounts(strings.NewReader(`apiserver_request_total{code="201",component="apiserver",group="kubevirt.io",resource="virtualmachines",scope="resource",subresource="",verb="POST",version="v1"} 25
apiserver_request_total{code="200",component="apiserver",group="kubevirt.io",resource="virtualmachineinstances",scope="resource",subresource="status",verb="PUT",version="v1"} 15
apiserver_request_total{code="200",component="apiserver",group="",resource="nodes",scope="cluster",subresource="",verb="LIST",version="v1"} 4
apiserver_request_total{code="200",component="apiserver",group="",resource="nodes",scope="cluster",subresource="",verb="WATCH",version="v1"} 9
`))
	if err != nil {
		t.Fatal(err)
	}
	rows, writes := Delta(before, after)
	if writes != 30 {
		t.Errorf("writes = %v, want 30 (15 VM POSTs + 15 VMI status PUTs)", writes)
	}
	want := []Count{{"POST virtualmachines 201", 15}, {"PUT virtualmachineinstances/status 200", 15}, {"LIST nodes 200", 1}}
	if len(rows) != len(want) {
		t.Fatalf("rows = %v, want %v", rows, want)
	}
	for i := range want {
		if rows[i] != want[i] {
			t.Errorf("row %d = %v, want %v", i, rows[i], want[i])
		}
	}
}
