package rbac_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/nodevirt/nodevirt/clusterbrain/rbac"
	"github.com/nodevirt/nodevirt/test/controlplane"
)

// tokenClient is a client with a token of the node agents' ServiceAccount,
// bound to pod when it is not nil (what kubelet mounts into a DaemonSet
// pod), else unbound.
func tokenClient(t *testing.T, cp *controlplane.ControlPlane, admin kubernetes.Interface, pod *corev1.Pod) kubernetes.Interface {
	t.Helper()
	req := &authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: ptr(int64(600))}}
	if pod != nil {
		req.Spec.BoundObjectRef = &authenticationv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID}
	}
	tok, err := admin.CoreV1().ServiceAccounts(rbac.InstallNamespace).CreateToken(context.Background(), rbac.NodeAgentServiceAccount, req, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cfg := rest.AnonymousClientConfig(cp.RestConfig)
	cfg.BearerToken = tok.Status.Token
	kube, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return kube
}

func ptr[T any](v T) *T { return &v }

// A node agent installed by the manifests authenticates with its pod's
// ServiceAccount token: the API server names the pod's node in the user's
// extra, rbac.NodeOf reads it, and the node restriction lets that token
// write its node's objects only. A token not bound to a pod is no node.
func TestNodeAgentServiceAccountIsItsPodsNode(t *testing.T) {
	cp := controlplane.Shared(t)
	ctx := context.Background()
	admin := cp.Clientset(t)
	if err := rbac.EnsureDaemons(ctx, admin); err != nil {
		t.Fatal(err)
	}
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: rbac.InstallNamespace}}
	if _, err := admin.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: rbac.NodeAgentServiceAccount, Namespace: rbac.InstallNamespace}}
	if _, err := admin.CoreV1().ServiceAccounts(rbac.InstallNamespace).Create(ctx, sa, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	suffix := fmt.Sprint(time.Now().UnixNano() % 100000)
	mine, other := "sa-mine-"+suffix, "sa-other-"+suffix
	for _, n := range []string{mine, other} {
		if _, err := admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = admin.CoreV1().Nodes().Delete(context.Background(), n, metav1.DeleteOptions{}) })
	}
	// A pod of the DaemonSet, bound to its node (no kubelet runs it).
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "nodeagent-" + suffix, Namespace: rbac.InstallNamespace},
		Spec: corev1.PodSpec{ServiceAccountName: rbac.NodeAgentServiceAccount, NodeName: mine,
			Containers: []corev1.Container{{Name: "nodeagent", Image: "localhost/nodevirt/nodeagent:test"}}}}
	pod, err := admin.CoreV1().Pods(rbac.InstallNamespace).Create(ctx, pod, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = admin.CoreV1().Pods(rbac.InstallNamespace).Delete(context.Background(), pod.Name, metav1.DeleteOptions{GracePeriodSeconds: ptr(int64(0))})
	})

	kube := tokenClient(t, cp, admin, pod)
	who, err := kube.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	u := who.Status.UserInfo
	extra := map[string][]string{}
	for k, v := range u.Extra {
		extra[k] = v
	}
	if node, ok := rbac.NodeOf(u.Username, u.Groups, extra); !ok || node != mine {
		t.Fatalf("NodeOf(%s, %v, %v) = %q, %v; want %s", u.Username, u.Groups, extra, node, ok, mine)
	}

	waitRefused(t, "patch another Node with a pod-bound token", func() error {
		_, err := kube.CoreV1().Nodes().Patch(ctx, other, types.MergePatchType, annotate("x", "1"), metav1.PatchOptions{})
		return err
	})
	_, err = kube.CoreV1().Nodes().Patch(ctx, mine, types.MergePatchType, annotate("x", "1"), metav1.PatchOptions{})
	allowed(t, "patch its pod's Node", err)

	unbound := tokenClient(t, cp, admin, nil)
	_, err = unbound.CoreV1().Nodes().Patch(ctx, mine, types.MergePatchType, annotate("x", "2"), metav1.PatchOptions{})
	refused(t, "patch a Node with a token bound to no pod", err)
}
