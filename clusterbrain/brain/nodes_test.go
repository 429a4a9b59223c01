package brain

import (
	"bufio"
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"k8s.io/client-go/kubernetes"

	"github.com/nodevirt/nodevirt/test/bench/measure"
	"github.com/nodevirt/nodevirt/test/testkit"
)

// TestLeaderSharesOneNodeWatch: the leader's roles that look at Nodes (the
// scheduler, node failure, evacuation, hco, the HostPathProvisioner
// status) share one informer: the API server holds one watch of the Nodes
// for the brain, and an idle leader lists no Node. With a watch per role,
// every node's heartbeat was decoded three times; with a List per check,
// node failure (every 2 s) and evacuation (every 5 s) read the whole fleet.
//
// It runs on a control plane of its own: the API server's counters are
// every client's, and this test must see only its brain.
func TestLeaderSharesOneNodeWatch(t *testing.T) {
	cp := ownControlPlane(t)
	ns := cp.Namespace(t)
	kube := cp.Clientset(t)
	// The API server's own informers watch the Nodes too (the most seen
	// over a second: one may be between two watches).
	own := 0
	for range 5 {
		own = max(own, nodeWatches(t, kube))
		time.Sleep(200 * time.Millisecond)
	}
	brainRunner(t, cp, ns)("brain-n")
	if h, _ := waitHolder(t, cp, ns, func(h string) bool { return h == "brain-n" }, 90*time.Second); h != "brain-n" {
		t.Fatalf("brain-n does not lead; lease holder %q", h)
	}
	testkit.Until(t, 2*time.Minute, "the brain watching the Nodes", func() bool { return nodeWatches(t, kube) > own })
	before, err := measure.RequestCounts(context.Background(), kube)
	if err != nil {
		t.Fatal(err)
	}
	// The roles start together when the brain leads; over 15 s node
	// failure checks seven times and evacuation three times.
	most := 0
	for end := time.Now().Add(15 * time.Second); time.Now().Before(end); time.Sleep(250 * time.Millisecond) {
		most = max(most, nodeWatches(t, kube)-own)
	}
	after, err := measure.RequestCounts(context.Background(), kube)
	if err != nil {
		t.Fatal(err)
	}
	lists := 0.0
	for k, n := range after {
		if strings.HasPrefix(k, "LIST nodes ") {
			lists += n - before[k]
		}
	}
	if most != 1 || lists != 0 {
		t.Fatalf("over 15 s the leader held up to %d watches of the Nodes and listed them %v times, want one watch and no list", most, lists)
	}
}

// nodeWatches is how many watches of the Nodes the API server holds open
// (apiserver_longrunning_requests).
func nodeWatches(t *testing.T, kube kubernetes.Interface) int {
	t.Helper()
	body, err := kube.CoreV1().RESTClient().Get().AbsPath("/metrics").Stream(context.Background())
	if err != nil {
		t.Fatalf("read apiserver metrics: %v", err)
	}
	defer body.Close()
	n := 0
	sc := bufio.NewScanner(body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "apiserver_longrunning_requests{") || !strings.Contains(line, `resource="nodes"`) ||
			!strings.Contains(line, `verb="WATCH"`) {
			continue
		}
		fields := strings.Fields(line)
		v, err := strconv.ParseFloat(fields[len(fields)-1], 64)
		if err != nil {
			t.Fatalf("metric %q: %v", line, err)
		}
		n += int(v)
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return n
}
