package kube

import (
	"context"
	"errors"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"

	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

func TestMain(m *testing.M) { controlplane.Main(m, controlplane.Config{}) }

// TestClientsetReachesEveryGroup: each typed client of the narrow clientset
// talks to the real API server.
func TestClientsetReachesEveryGroup(t *testing.T) {
	cp := controlplane.Shared(t)
	c, err := NewForConfig(cp.RestConfig)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	ns := cp.Namespace(t)
	if _, err := c.CoreV1().ConfigMaps(ns).Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "probe"},
		Data: map[string]string{"k": "v"}}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("core/v1: %v", err)
	}
	got, err := c.CoreV1().ConfigMaps(ns).Get(ctx, "probe", metav1.GetOptions{})
	if err != nil || got.Data["k"] != "v" {
		t.Fatalf("core/v1 read back %v, %v", got, err)
	}
	if _, err := c.CoordinationV1().Leases(ns).List(ctx, metav1.ListOptions{}); err != nil {
		t.Errorf("coordination/v1: %v", err)
	}
	if _, err := c.CertificatesV1().CertificateSigningRequests().List(ctx, metav1.ListOptions{}); err != nil {
		t.Errorf("certificates/v1: %v", err)
	}
	if _, err := c.StorageV1().StorageClasses().List(ctx, metav1.ListOptions{}); err != nil {
		t.Errorf("storage/v1: %v", err)
	}
}

// TestFactorySharesOneInformerPerKind: two users of one Factory get the
// same informer, and its lister sees objects created after it started.
func TestFactorySharesOneInformerPerKind(t *testing.T) {
	cp := controlplane.Shared(t)
	c, err := NewForConfig(cp.RestConfig)
	if err != nil {
		t.Fatal(err)
	}
	ns := cp.Namespace(t)
	f := NewFactory(c, 0)
	if f.Claims().Informer() != f.Claims().Informer() {
		t.Fatal("Claims made two informers")
	}
	if f.Volumes().Informer() == nil || f.StorageClasses().Informer() == nil {
		t.Fatal("no volume or class informer")
	}
	ctx, cancel := context.WithCancel(context.Background())
	f.Start(ctx.Done())
	f.Start(ctx.Done()) // a second role starting the same factory
	for typ, ok := range f.WaitForCacheSync(ctx.Done()) {
		if !ok {
			t.Fatalf("%v did not sync", typ)
		}
	}
	if n := len(f.WaitForCacheSync(ctx.Done())); n != 3 {
		t.Errorf("%d informers started, want 3", n)
	}
	class := &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: "kube-test-" + ns}, Provisioner: "example.com/none"}
	if _, err := c.StorageV1().StorageClasses().Create(ctx, class, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = c.StorageV1().StorageClasses().Delete(context.Background(), class.Name, metav1.DeleteOptions{})
	})
	claim := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: "claim", Namespace: ns},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{
				corev1.ResourceStorage: resource.MustParse("1Mi")}},
		}}
	if _, err := c.CoreV1().PersistentVolumeClaims(ns).Create(ctx, claim, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 10*time.Second, "the caches to see the claim and the class", func() error {
		_, claimErr := f.Claims().Lister().PersistentVolumeClaims(ns).Get("claim")
		_, classErr := f.StorageClasses().Lister().Get(class.Name)
		return errors.Join(claimErr, classErr)
	})
	if pvs, err := f.Volumes().Lister().List(labels.Everything()); err != nil {
		t.Errorf("volume lister: %v (%d)", err, len(pvs))
	}
	cancel()
	done := make(chan struct{})
	go func() { f.Shutdown(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Shutdown did not return after the stop channel closed")
	}
}
