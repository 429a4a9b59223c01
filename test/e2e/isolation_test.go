package e2e

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	kubevirtv1 "kubevirt.io/api/core/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	"github.com/nodevirt/nodevirt/clusterbrain/api/nodereads"
	"github.com/nodevirt/nodevirt/clusterbrain/datavolume"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/uploadtls"
	nodeconsole "github.com/nodevirt/nodevirt/nodeagent/console"
	"github.com/nodevirt/nodevirt/test/testkit"
)

// grant gives user the rules in namespace ns through a Role.
func (n *testNS) grant(ns, user, name string, rules ...rbacv1.PolicyRule) {
	n.t.Helper()
	ctx := context.Background()
	role := &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns}, Rules: rules}
	if _, err := n.e.kube.RbacV1().Roles(ns).Create(ctx, role, metav1.CreateOptions{}); err != nil {
		n.t.Fatalf("role %s/%s: %v", ns, name, err)
	}
	rb := &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: name},
		Subjects: []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: rbacv1.UserKind, Name: user}}}
	if _, err := n.e.kube.RbacV1().RoleBindings(ns).Create(ctx, rb, metav1.CreateOptions{}); err != nil {
		n.t.Fatalf("rolebinding %s/%s: %v", ns, name, err)
	}
	r := rules[0]
	resource, sub, _ := strings.Cut(r.Resources[0], "/")
	testkit.WaitAllowed(n.t, n.e.kube, user, authorizationv1.ResourceAttributes{Namespace: ns, Verb: r.Verbs[0], Group: r.APIGroups[0], Resource: resource, Subresource: sub})
}

// userVirt is a client authenticated as user (a client certificate of the
// suite's control plane).
func (n *testNS) userVirt(user string) *client.Set {
	n.t.Helper()
	kc := filepath.Join(n.t.TempDir(), user+".kubeconfig")
	if err := n.e.cp.WriteKubeconfig(kc, user); err != nil {
		n.t.Fatal(err)
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", kc)
	if err != nil {
		n.t.Fatal(err)
	}
	set, err := client.NewSet(cfg)
	if err != nil {
		n.t.Fatal(err)
	}
	return set
}

func immediateDV(ns, name string, src *cdiv1.DataVolumeSource) *cdiv1.DataVolume {
	return &cdiv1.DataVolume{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns,
			Annotations: map[string]string{"cdi.kubevirt.io/storage.bind.immediate.requested": "true"}},
		Spec: cdiv1.DataVolumeSpec{Source: src, Storage: &cdiv1.StorageSpec{Resources: corev1.VolumeResourceRequirements{
			Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("64Mi")}}}},
	}
}

// TestCrossNamespaceCloneFollowsCDIsRule: a user may clone a volume of
// another namespace only with "create" on datavolumes/source
// (cdi.kubevirt.io) there, checked by a SubjectAccessReview when the
// DataVolume (or a VM's dataVolumeTemplate) is admitted. Refused without
// it, with CDI's message; cloned with it.
// goldenNamespace makes namespace <n>suffix holding DataVolume "golden",
// 4 MiB of random bytes imported on the suite's own node (the image is
// served on this host's loopback); it returns the namespace and the bytes.
func (n *testNS) goldenNamespace(suffix string) (*testNS, []byte) {
	t, e := n.t, n.e
	t.Helper()
	ctx := context.Background()
	src := &testNS{e: e, t: t, name: n.name + suffix}
	srcObj := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: src.name, Labels: map[string]string{"nodevirt.io/e2e": e.run}}}
	if _, err := e.kube.CoreV1().Namespaces().Create(ctx, srcObj, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(src.cleanup)
	image := filepath.Join(t.TempDir(), "golden.raw")
	data := make([]byte, 4<<20)
	_, _ = rand.Read(data)
	if err := os.WriteFile(image, data, 0o644); err != nil {
		t.Fatal(err)
	}
	golden := immediateDV(src.name, "golden", &cdiv1.DataVolumeSource{HTTP: &cdiv1.DataVolumeSourceHTTP{URL: serveFile(t, image)}})
	golden.Annotations["volume.kubernetes.io/selected-node"] = e.nodeName
	if _, err := e.virt.DataVolumes.Create(ctx, golden); err != nil {
		t.Fatal(err)
	}
	src.waitImported("", "golden")
	return src, data
}

func TestCrossNamespaceCloneFollowsCDIsRule(t *testing.T) {
	e := require(t)
	dst := e.namespace(t)
	ctx := context.Background()

	// The source namespace and its volume, imported by the administrator.
	src, _ := dst.goldenNamespace("-src")

	user := "clone-user-" + e.run
	dst.grant(dst.name, user, "dv-author",
		rbacv1.PolicyRule{APIGroups: []string{"cdi.kubevirt.io"}, Resources: []string{"datavolumes"}, Verbs: []string{"get", "list", "create"}},
		rbacv1.PolicyRule{APIGroups: []string{"kubevirt.io"}, Resources: []string{"virtualmachines"}, Verbs: []string{"get", "create"}})
	as := dst.userVirt(user)
	clone := immediateDV(dst.name, "copy", &cdiv1.DataVolumeSource{PVC: &cdiv1.DataVolumeSourcePVC{Namespace: src.name, Name: "golden"}})

	// Without rights in the source namespace: refused at admission.
	_, err := as.DataVolumes.Create(ctx, clone)
	want := fmt.Sprintf("insufficient permissions in clone source namespace %s", src.name)
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("unauthorized cross-namespace clone: %v, want %q", err, want)
	}
	vm := dst.dataVolumeVM("copier", "http://unused.invalid/", kubevirtv1.RunStrategyHalted)
	vm.Spec.DataVolumeTemplates[0].Spec.Source = clone.Spec.Source
	if _, err := as.VMs.Create(ctx, vm); err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("VM cloning another namespace through a dataVolumeTemplate: %v, want %q", err, want)
	}
	// A user cannot stamp an authorization of their own either.
	forged := clone.DeepCopy()
	forged.Annotations[datavolume.AnnAuthorizedSource] = "pvc/" + src.name + "/golden"
	if _, err := as.DataVolumes.Create(ctx, forged); err == nil {
		t.Fatal("a forged authorization stamp was admitted")
	}

	// A DataSource that does not exist yet: admitted unstamped (it waits,
	// and can then only clone from its own namespace).
	waiting := immediateDV(dst.name, "later", nil)
	waiting.Spec.SourceRef = &cdiv1.DataVolumeSourceRef{Kind: cdiv1.DataVolumeDataSource, Name: "not-yet", Namespace: &src.name}
	if got, err := as.DataVolumes.Create(ctx, waiting); err != nil {
		t.Errorf("datavolume from a datasource not there yet: %v", err)
	} else if _, stamped := got.Annotations[datavolume.AnnAuthorizedSource]; stamped {
		t.Errorf("datavolume from a missing datasource was stamped %q", got.Annotations[datavolume.AnnAuthorizedSource])
	}

	// With create on datavolumes/source there: admitted, stamped, cloned.
	dst.grant(src.name, user, "clone-source",
		rbacv1.PolicyRule{APIGroups: []string{"cdi.kubevirt.io"}, Resources: []string{"datavolumes/source"}, Verbs: []string{"create"}})
	var created *cdiv1.DataVolume
	dst.eventually(30*time.Second, "authorized clone admitted", func() (bool, string) {
		created, err = as.DataVolumes.Create(ctx, clone)
		return err == nil, fmt.Sprint(err)
	})
	if got := created.Annotations[datavolume.AnnAuthorizedSource]; got != "pvc/"+src.name+"/golden" {
		t.Errorf("authorization stamp %q", got)
	}
	dst.waitImported("", "copy")

	// The stamp and the source cannot change afterwards.
	cur, err := e.virt.DataVolumes.Get(ctx, dst.name, "copy")
	if err != nil {
		t.Fatal(err)
	}
	cur.Annotations[datavolume.AnnAuthorizedSource] = "pvc/kube-system/anything"
	if _, err := e.virt.DataVolumes.Update(ctx, cur); err == nil {
		t.Error("the authorization stamp was rewritten")
	}
}

// TestAnotherNodesCredentials: with the credentials of another node
// (user system:node:<other>, group nodevirt:nodes, and a certificate from
// the node CA naming it) nothing of this suite's node can be written and
// its console cannot be read: the Node, the claims placed on it, its
// console server. Secrets are never listed, and a Secret only objects of
// the suite's node name is not read.
func TestAnotherNodesCredentials(t *testing.T) {
	e := require(t)
	n := e.namespace(t)
	ctx := context.Background()
	other := "other-" + e.run
	kc := filepath.Join(t.TempDir(), "other.kubeconfig")
	if err := e.cp.WriteKubeconfig(kc, identity.NodeUser(other), identity.NodesGroup); err != nil {
		t.Fatal(err)
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", kc)
	if err != nil {
		t.Fatal(err)
	}
	kube := kubernetes.NewForConfigOrDie(cfg)

	patch := []byte(`{"metadata":{"annotations":{"nodevirt.io/hijacked":"true"}}}`)
	if _, err := kube.CoreV1().Nodes().Patch(ctx, e.nodeName, types.MergePatchType, patch, metav1.PatchOptions{}); err == nil {
		t.Errorf("another node patched node %s", e.nodeName)
	}
	// A claim the suite's node filled.
	dv := immediateDV(n.name, "placed", &cdiv1.DataVolumeSource{Blank: &cdiv1.DataVolumeBlankImage{}})
	dv.Annotations["volume.kubernetes.io/selected-node"] = e.nodeName
	if _, err := e.virt.DataVolumes.Create(ctx, dv); err != nil {
		t.Fatal(err)
	}
	n.waitImported("", "placed")
	report := []byte(`{"metadata":{"annotations":{"cdi.kubevirt.io/storage.pod.phase":"Failed"}}}`)
	if _, err := kube.CoreV1().PersistentVolumeClaims(n.name).Patch(ctx, "placed", types.MergePatchType, report, metav1.PatchOptions{}); err == nil {
		t.Errorf("another node reported on a claim of node %s", e.nodeName)
	}
	if _, err := kube.CoreV1().Secrets(n.name).List(ctx, metav1.ListOptions{}); err == nil {
		t.Error("a node listed the Secrets of a namespace")
	}
	if _, err := kube.CoreV1().Secrets(hcov1beta1.DefaultNamespace).Get(ctx, identity.UploadCASecretName, metav1.GetOptions{}); err == nil {
		t.Error("a node read the node CA's Secret")
	}

	// A Secret an import on the suite's node uses: that node read it (the
	// import ran), the other node cannot, neither through the brain nor
	// directly.
	creds := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "import-creds", Namespace: n.name},
		StringData: map[string]string{"accessKeyId": "user", "secretKey": "password"}}
	if _, err := e.kube.CoreV1().Secrets(n.name).Create(ctx, creds, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	image := filepath.Join(t.TempDir(), "small.raw")
	if err := os.WriteFile(image, make([]byte, 1<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	withCreds := immediateDV(n.name, "with-creds", &cdiv1.DataVolumeSource{HTTP: &cdiv1.DataVolumeSourceHTTP{URL: serveFile(t, image), SecretRef: "import-creds"}})
	withCreds.Annotations["volume.kubernetes.io/selected-node"] = e.nodeName
	if _, err := e.virt.DataVolumes.Create(ctx, withCreds); err != nil {
		t.Fatal(err)
	}
	n.waitImported("", "with-creds")
	reads, err := nodereads.NewClient(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ref := nodereads.Ref{Resource: nodereads.DataVolumes, Namespace: n.name, Name: "with-creds"}
	if _, err := reads.Secret(ctx, ref, "import-creds"); !apierrors.IsForbidden(err) {
		t.Errorf("another node read the secret of an import on node %s through the brain: %v, want forbidden", e.nodeName, err)
	}
	if _, err := kube.CoreV1().Secrets(n.name).Get(ctx, "import-creds", metav1.GetOptions{}); !apierrors.IsForbidden(err) {
		t.Errorf("another node read a secret no object on it uses: %v, want forbidden", err)
	}

	// The suite node's console server refuses another node's certificate.
	node, err := e.kube.CoreV1().Nodes().Get(ctx, e.nodeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	addr := node.Annotations[identity.NodeAddressAnnotation]
	if addr == "" {
		t.Fatalf("node %s publishes no console address", e.nodeName)
	}
	ca, err := uploadtls.EnsureCA(ctx, e.kube, hcov1beta1.DefaultNamespace)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := ca.Issue(identity.NodeUser(other), []string{other, identity.HandlerServerName}, nil, true)
	if err != nil {
		t.Fatal(err)
	}
	tlsCfg := &tls.Config{Certificates: []tls.Certificate{cert}, RootCAs: ca.Pool(), ServerName: e.nodeName, MinVersion: tls.VersionTLS12}
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	conn, err := (&nodeconsole.Client{Addr: addr, TLS: tlsCfg}).Console(cctx, n.name, "any")
	if err == nil {
		conn.Close()
		t.Fatal("another node's certificate opened a console stream")
	}
	if !strings.Contains(err.Error(), "403") && !strings.Contains(err.Error(), "not allowed") {
		t.Errorf("console with another node's certificate: %v, want 403", err)
	}
}
