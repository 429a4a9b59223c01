// Package testkit is what the tests of every package share on top of
// test/controlplane: one way to wait for a condition (Eventually, Until,
// Poll: the same loop for the three shapes a condition takes; PollEvery
// and EventuallyEvery for a costly one; Wait, the loop itself, for code
// that judges the outcome or cannot fail a test: setup returning an
// error, a non-fatal check, cleanup before failing; Stop for a condition
// that knows the wait is lost) and one way to put nodevirt's CRDs on a
// control plane (InstallCRDs, InstallSnapshotCRDs), WaitAllowed for a
// role binding to take effect, and CountRequests for how often a client
// lists or watches a collection.
package testkit

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	authorizationv1 "k8s.io/api/authorization/v1"
	apiextensionsclient "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/nodevirt/nodevirt/clusterbrain/crds"
	"github.com/nodevirt/nodevirt/test/controlplane"
)

// Interval is how often a condition is evaluated again.
const Interval = 50 * time.Millisecond

// Poll evaluates cond every Interval until it reports true, and fails t
// after within, saying what it waited for and cond's last error (at once
// when cond's error is wrapped by Stop).
func Poll(t testing.TB, within time.Duration, what string, cond func() (bool, error)) {
	t.Helper()
	PollEvery(t, Interval, within, what, cond)
}

// PollEvery is Poll evaluating cond every interval: for a condition that
// is costly to evaluate (a scrape, a command, a diagnosis of the cluster).
func PollEvery(t testing.TB, interval, within time.Duration, what string, cond func() (bool, error)) {
	t.Helper()
	if err := Wait(interval, within, what, cond); err != nil {
		t.Fatal(err)
	}
}

// Wait is the loop under Poll, returning what Poll would fail with: it
// evaluates cond every interval until cond reports true (nil), and after
// within returns an error saying what it waited for and cond's last
// error. An error cond returns is only remembered, unless it is wrapped by
// Stop: then the wait ends at once with it. Wait is for code that cannot
// or should not fail the test itself: setup returning an error before any
// test runs, a wait whose caller reports with t.Errorf and goes on, or one
// that cleans up before failing.
func Wait(interval, within time.Duration, what string, cond func() (bool, error)) error {
	deadline := time.Now().Add(within)
	for {
		ok, err := cond()
		var stop stopped
		if errors.As(err, &stop) {
			return fmt.Errorf("waiting for %s: %w", what, stop.err)
		}
		if ok {
			return nil
		}
		if time.Now().After(deadline) {
			if err != nil {
				return fmt.Errorf("timed out after %v waiting for %s: %w", within, what, err)
			}
			return fmt.Errorf("timed out after %v waiting for %s", within, what)
		}
		time.Sleep(interval)
	}
}

// Stop marks err as ending the wait (Poll, Wait and the others) at once
// instead of being retried until the timeout: for a condition that sees
// the awaited state can no longer come. Stop(nil) is nil, so a condition
// may return Stop(err) unchecked.
func Stop(err error) error {
	if err == nil {
		return nil
	}
	return stopped{err}
}

type stopped struct{ err error }

func (s stopped) Error() string { return s.err.Error() }
func (s stopped) Unwrap() error { return s.err }

// Eventually waits until cond returns nil (Poll).
func Eventually(t testing.TB, within time.Duration, what string, cond func() error) {
	t.Helper()
	Poll(t, within, what, func() (bool, error) {
		err := cond()
		return err == nil, err
	})
}

// EventuallyEvery is Eventually evaluating cond every interval (PollEvery).
func EventuallyEvery(t testing.TB, interval, within time.Duration, what string, cond func() error) {
	t.Helper()
	PollEvery(t, interval, within, what, func() (bool, error) {
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

// WaitAllowed waits until kube-apiserver's authorizer lets user do what
// attrs names: a role binding just created takes effect a moment later,
// when the authorizer's cache has it.
func WaitAllowed(t testing.TB, kube kubernetes.Interface, user string, attrs authorizationv1.ResourceAttributes) {
	t.Helper()
	review := &authorizationv1.SubjectAccessReview{Spec: authorizationv1.SubjectAccessReviewSpec{User: user, ResourceAttributes: &attrs}}
	Eventually(t, 30*time.Second, fmt.Sprintf("%s allowed to %s %s/%s", user, attrs.Verb, attrs.Group, attrs.Resource), func() error {
		got, err := kube.AuthorizationV1().SubjectAccessReviews().Create(context.Background(), review, metav1.CreateOptions{})
		if err != nil {
			return err
		}
		if !got.Status.Allowed {
			return fmt.Errorf("not yet: %s", got.Status.Reason)
		}
		return nil
	})
}
