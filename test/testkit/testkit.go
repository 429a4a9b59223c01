// Package testkit is what the tests of every package share on top of
// test/controlplane: one way to wait for a condition (Eventually, Until,
// Poll: the same loop for the three shapes a condition takes; PollEvery
// for a costly one) and one way to put nodevirt's CRDs on a control plane
// (InstallCRDs, InstallSnapshotCRDs).
package testkit

import (
	"context"
	"fmt"
	"testing"
	"time"

	apiextensionsclient "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset"

	"github.com/nodevirt/nodevirt/clusterbrain/crds"
	"github.com/nodevirt/nodevirt/test/controlplane"
)

// Interval is how often a condition is evaluated again.
const Interval = 50 * time.Millisecond

// Poll evaluates cond every Interval until it reports true, and fails t
// after within, saying what it waited for and cond's last error.
func Poll(t testing.TB, within time.Duration, what string, cond func() (bool, error)) {
	t.Helper()
	PollEvery(t, Interval, within, what, cond)
}

// PollEvery is Poll evaluating cond every interval: for a condition that
// is costly to evaluate (a scrape, a command, a diagnosis of the cluster).
func PollEvery(t testing.TB, interval, within time.Duration, what string, cond func() (bool, error)) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		ok, err := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			if err != nil {
				t.Fatalf("timed out after %v waiting for %s: %v", within, what, err)
			}
			t.Fatalf("timed out after %v waiting for %s", within, what)
		}
		time.Sleep(interval)
	}
}

// Eventually waits until cond returns nil (Poll).
func Eventually(t testing.TB, within time.Duration, what string, cond func() error) {
	t.Helper()
	Poll(t, within, what, func() (bool, error) {
		err := cond()
		return err == nil, err
	})
}

// Until waits until cond returns true (Poll).
func Until(t testing.TB, within time.Duration, what string, cond func() bool) {
	t.Helper()
	Poll(t, within, what, func() (bool, error) { return cond(), nil })
}

// InstallCRDs applies nodevirt's CRDs (crds.Catalog) to cp and waits until
// they are established.
func InstallCRDs(t testing.TB, cp *controlplane.ControlPlane) {
	t.Helper()
	if err := crds.Install(context.Background(), apiextensions(t, cp), crds.Catalog()); err != nil {
		t.Fatal(fmt.Errorf("install crds: %w", err))
	}
}

// InstallSnapshotCRDs creates the snapshot.storage.k8s.io CRDs on cp
// unless they exist (a cluster's own snapshot controller owns them).
func InstallSnapshotCRDs(t testing.TB, cp *controlplane.ControlPlane) {
	t.Helper()
	if err := crds.InstallAbsent(context.Background(), apiextensions(t, cp), crds.SnapshotCatalog()); err != nil {
		t.Fatal(fmt.Errorf("install snapshot crds: %w", err))
	}
}

func apiextensions(t testing.TB, cp *controlplane.ControlPlane) apiextensionsclient.Interface {
	t.Helper()
	c, err := apiextensionsclient.NewForConfig(cp.RestConfig)
	if err != nil {
		t.Fatal(err)
	}
	return c
}
