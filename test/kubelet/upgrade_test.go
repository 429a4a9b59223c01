package kubelet

import (
	"context"
	"fmt"

	"strings"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// upgradeWatch samples, while a newer build rolls out, how many node
// agents are unavailable at once and how long the brains' lease has no
// valid holder (none, or its renewal older than its duration).
type upgradeWatch struct {
	mu             sync.Mutex
	maxUnavailable int32
	leaderless     time.Duration // longest stretch without a valid holder
	holders        []string      // in the order they held the lease
	since          time.Time     // start of the current stretch; zero while held
	leaseDuration  time.Duration // the longest a holder asked for
	samples        int
}

func (w *upgradeWatch) run(ctx context.Context, kube kubernetes.Interface) {
	for {
		if ds, err := kube.AppsV1().DaemonSets(nodevirtNS).Get(ctx, "nodevirt-nodeagent", metav1.GetOptions{}); err == nil {
			down := ds.Status.NumberUnavailable
			if notReady := ds.Status.DesiredNumberScheduled - ds.Status.NumberReady; notReady > down {
				down = notReady
			}
			w.mu.Lock()
			w.maxUnavailable = max(w.maxUnavailable, down)
			w.mu.Unlock()
		}
		if l, err := kube.CoordinationV1().Leases(nodevirtNS).Get(ctx, "nodevirt-clusterbrain", metav1.GetOptions{}); err == nil {
			now := time.Now()
			holder := ""
			if l.Spec.HolderIdentity != nil {
				holder = *l.Spec.HolderIdentity
			}
			valid := false
			if holder != "" && l.Spec.RenewTime != nil && l.Spec.LeaseDurationSeconds != nil {
				d := time.Duration(*l.Spec.LeaseDurationSeconds) * time.Second
				valid = now.Before(l.Spec.RenewTime.Add(d))
				w.mu.Lock()
				w.leaseDuration = max(w.leaseDuration, d)
				w.mu.Unlock()
			}
			w.mu.Lock()
			w.samples++
			if holder != "" && (len(w.holders) == 0 || w.holders[len(w.holders)-1] != holder) {
				w.holders = append(w.holders, holder)
			}
			switch {
			case !valid && w.since.IsZero():
				w.since = now
			case valid && !w.since.IsZero():
				w.leaderless = max(w.leaderless, now.Sub(w.since))
				w.since = time.Time{}
			}
			w.mu.Unlock()
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// result closes an open leaderless stretch at now.
func (w *upgradeWatch) result() (maxUnavailable int32, leaderless, lease time.Duration, holders []string, samples int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	leaderless = w.leaderless
	if !w.since.IsZero() {
		leaderless = max(leaderless, time.Since(w.since))
	}
	return w.maxUnavailable, leaderless, w.leaseDuration, append([]string(nil), w.holders...), w.samples
}

// upgrade applies the manifests of a newer build (bin/images-next, `make
// images VERSION=<version>-next`, imported into the node first) under the
// running guest: the node agents roll one node at a time onto the new image
// and re-adopt the guest (same QEMU, console answers through the new
// agent), and the brains' lease never goes without a valid holder for
// longer than its duration.
func upgrade(t *testing.T, ctx context.Context, kube kubernetes.Interface, kubectl func(...string) (string, error),
	node *Node, next Build, virtctl, kubeconfig string, step func(string)) {
	if err := node.Import(ctx, next.Archives...); err != nil {
		t.Fatal(err)
	}
	step("newer build's images imported")
	ds, err := kube.AppsV1().DaemonSets(nodevirtNS).Get(ctx, "nodevirt-nodeagent", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	oldImage := ds.Spec.Template.Spec.Containers[0].Image
	pid := qemuPid(t)

	w := &upgradeWatch{}
	wctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { w.run(wctx, kube); close(done) }()
	defer func() { stop(); <-done }()

	if out, err := kubectl("apply", "-f", next.Manifest); err != nil {
		t.Fatalf("kubectl apply of the newer build: %v\n%s", err, out)
	}
	step("newer build's manifest applied")
	if out, err := kubectl("rollout", "status", "--timeout=10m", "-n", nodevirtNS, "daemonset/nodevirt-nodeagent"); err != nil {
		t.Fatalf("node agents' rollout: %v\n%s", err, out)
	}
	step("node agents rolled out")
	ds, err = kube.AppsV1().DaemonSets(nodevirtNS).Get(ctx, "nodevirt-nodeagent", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	newImage := ds.Spec.Template.Spec.Containers[0].Image
	if newImage == oldImage {
		t.Fatalf("the newer build's agent image is the old one (%s)", oldImage)
	}
	pods, err := kube.CoreV1().Pods(nodevirtNS).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=nodevirt-nodeagent"})
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range pods.Items {
		for _, cs := range p.Status.ContainerStatuses {
			if cs.Name == ds.Spec.Template.Spec.Containers[0].Name && (!sameImage(cs.Image, newImage) || !cs.Ready) {
				t.Errorf("agent pod %s runs %s (ready %v), want %s", p.Name, cs.Image, cs.Ready, newImage)
			}
		}
	}
	// The brains roll with maxSurge 0, one per node: let the Deployment
	// act, and keep watching the lease over two of its durations after.
	wait(t, ctx, 5*time.Minute, "brain Deployment takes the newer build", func() error {
		d, err := kube.AppsV1().Deployments(nodevirtNS).Get(ctx, "nodevirt-clusterbrain", metav1.GetOptions{})
		if err != nil {
			return err
		}
		if d.Status.ObservedGeneration < d.Generation || d.Status.UpdatedReplicas < 1 {
			return fmt.Errorf("generation %d observed %d, %d updated", d.Generation, d.Status.ObservedGeneration, d.Status.UpdatedReplicas)
		}
		return nil
	})
	time.Sleep(20 * time.Second)
	if out, err := kubectl("get", "-n", nodevirtNS, "pods", "-l", "app.kubernetes.io/name=nodevirt-clusterbrain",
		"-o", "custom-columns=NAME:.metadata.name,IMAGE:.spec.containers[0].image,PHASE:.status.phase,NODE:.spec.nodeName"); err == nil {
		t.Logf("brains after the upgrade:\n%s", out)
	}
	stop()
	<-done
	maxDown, leaderless, lease, holders, samples := w.result()
	if samples == 0 {
		t.Fatal("the brains' lease was never read during the upgrade")
	}
	t.Logf("upgrade: at most %d node agent(s) unavailable at once; lease holders %v; longest stretch without a valid holder %s",
		maxDown, holders, leaderless.Round(100*time.Millisecond))
	if maxDown > 1 {
		t.Errorf("%d node agents unavailable at once during the upgrade, want one node at a time", maxDown)
	}
	// A quarter second of sampling.
	if leaderless > lease+250*time.Millisecond {
		t.Errorf("the brains' lease had no valid holder for %s during the upgrade, more than a lease (%s)", leaderless, lease)
	}

	if after := qemuPid(t); after != pid {
		t.Errorf("guest QEMU pid %s after the upgrade, was %s", after, pid)
	}
	if out, err := kubectl("get", "-n", vmNamespace, "vmi/vm", "-o", "jsonpath={.status.phase}"); err != nil || out != "Running" {
		t.Errorf("VMI after the upgrade: %q %v", out, err)
	}
	consoleAnswers(t, virtctl, kubeconfig, "upgraded")
	step("upgraded under the running guest: same QEMU, console answers")
}

// sameImage tells whether a container status's image is ref (the runtime
// may report it fully qualified).
func sameImage(status, ref string) bool {
	return status == ref || strings.HasSuffix(status, "/"+ref)
}
