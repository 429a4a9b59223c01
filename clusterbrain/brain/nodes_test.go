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

// TestLeaderSharesOneWatchOfEach: the leader's roles that look at Nodes
// (the scheduler, node failure, evacuation, hco, the HostPathProvisioner
// status) share one informer, and so do its roles that look at VMIs with
// the metrics server: the API server holds one watch of the Nodes, one of
// the node Leases and one of the VMIs for the brain, and an idle leader
// lists neither Nodes nor Leases. With a watch per role, every node's
// heartbeat was decoded three times; with a List per check, node failure
// (every 2 s) and evacuation (every 5 s) read the whole fleet; and the
// metrics server kept a second cache of every VMI.
//
// It runs on a control plane of its own: the API server's counters are
// every client's, and this test must see only its brain.
func TestLeaderSharesOneWatchOfEach(t *testing.T) {
	cp := ownControlPlane(t)
	ns := cp.Namespace(t)
	kube := cp.Clientset(t)
	resources := []string{"nodes", "leases", "virtualmachineinstances"}
	// The control plane's own informers watch some of them too (the most
	// seen over a second: one may be between two watches).
	own := map[string]int{}
	for range 5 {
		for _, r := range resources {
			own[r] = max(own[r], watches(t, kube, r))
		}
		time.Sleep(200 * time.Millisecond)
	}
	brainRunner(t, cp, ns)("brain-n")
	if h, _ := waitHolder(t, cp, ns, func(h string) bool { return h == "brain-n" }, 90*time.Second); h != "brain-n" {
		t.Fatalf("brain-n does not lead; lease holder %q", h)
	}
	for _, r := range resources {
		testkit.Until(t, 2*time.Minute, "the brain watching the "+r, func() bool { return watches(t, kube, r) > own[r] })
	}
	before, err := measure.RequestCounts(context.Background(), kube)
	if err != nil {
		t.Fatal(err)
	}
	// The roles start together when the brain leads; over 15 s node
	// failure checks seven times and evacuation three times.
	most := map[string]int{}
	for end := time.Now().Add(15 * time.Second); time.Now().Before(end); time.Sleep(250 * time.Millisecond) {
		for _, r := range resources {
			most[r] = max(most[r], watches(t, kube, r)-own[r])
		}
	}
	after, err := measure.RequestCounts(context.Background(), kube)
	if err != nil {
		t.Fatal(err)
	}
	lists := map[string]float64{}
	for k, n := range after {
		for _, r := range resources {
			if strings.HasPrefix(k, "LIST "+r+" ") {
				lists[r] += n - before[k]
			}
		}
	}
	for _, r := range resources {
		if most[r] != 1 || lists[r] != 0 {
			t.Errorf("over 15 s the leader held up to %d watches of the %s and listed them %v times, want one watch and no list",
				most[r], r, lists[r])
		}
	}
}

// watches is how many watches of resource (plural, any group) the API
// server holds open (apiserver_longrunning_requests).
func watches(t *testing.T, kube kubernetes.Interface, resource string) int {
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
		if !strings.HasPrefix(line, "apiserver_longrunning_requests{") || !strings.Contains(line, `resource="`+resource+`"`) ||
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
