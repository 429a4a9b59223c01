package controlplane

import (
	"context"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
)

func TestMain(m *testing.M) { Main(m, Config{ControllerManager: true}) }

func TestAPIServerServesAndIsolates(t *testing.T) {
	cp := Shared(t)
	cs := cp.Clientset(t)
	ns := cp.Namespace(t)
	ctx := context.Background()
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "probe"}, Data: map[string]string{"a": "b"}}
	if _, err := cs.CoreV1().ConfigMaps(ns).Create(ctx, cm, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	got, err := cs.CoreV1().ConfigMaps(ns).Get(ctx, "probe", metav1.GetOptions{})
	if err != nil || got.Data["a"] != "b" {
		t.Fatalf("read back configmap: %v %v", got, err)
	}
	groups, err := cs.Discovery().ServerGroups()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, g := range groups.Groups {
		names = append(names, g.Name)
	}
	for _, want := range []string{"apiregistration.k8s.io", "admissionregistration.k8s.io", "rbac.authorization.k8s.io"} {
		if !strings.Contains(strings.Join(names, ","), want) {
			t.Errorf("group %s not served; have %v", want, names)
		}
	}
}

func TestRBACRefusesUnprivilegedUser(t *testing.T) {
	cp := Shared(t)
	ns := cp.Namespace(t)
	path := t.TempDir() + "/kubeconfig"
	if err := cp.WriteKubeconfig(path, "alice"); err != nil {
		t.Fatal(err)
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", path)
	if err != nil {
		t.Fatal(err)
	}
	cs := kubernetes.NewForConfigOrDie(cfg)
	_, err = cs.CoreV1().ConfigMaps(ns).List(context.Background(), metav1.ListOptions{})
	if !apierrors.IsForbidden(err) {
		t.Fatalf("alice listed configmaps without a role: err=%v", err)
	}
}

func TestControllerManagerCreatesDefaultServiceAccount(t *testing.T) {
	cp := Shared(t)
	cs := cp.Clientset(t)
	ns := cp.Namespace(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*1e9)
	defer cancel()
	for {
		if _, err := cs.CoreV1().ServiceAccounts(ns).Get(ctx, "default", metav1.GetOptions{}); err == nil {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatal("kube-controller-manager never created the default service account")
		case <-timeAfter():
		}
	}
}

func timeAfter() <-chan time.Time { return time.After(200 * time.Millisecond) }
