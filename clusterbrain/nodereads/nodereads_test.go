package nodereads_test

import (
	"context"
	"fmt"
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
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	kubevirtv1 "kubevirt.io/api/core/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/aggregated"
	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
	api "github.com/nodevirt/nodevirt/clusterbrain/api/nodereads"
	"github.com/nodevirt/nodevirt/clusterbrain/nodereads"
	"github.com/nodevirt/nodevirt/clusterbrain/rbac"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

func TestMain(m *testing.M) { controlplane.Main(m, controlplane.Config{}) }

// as is a kubeconfig for user in group, and its clients.
func as(t *testing.T, cp *controlplane.ControlPlane, user, group string) (kubernetes.Interface, *api.Client) {
	t.Helper()
	kc := filepath.Join(t.TempDir(), "kubeconfig")
	if err := cp.WriteKubeconfig(kc, user, group); err != nil {
		t.Fatal(err)
	}
	rc, err := clientcmd.BuildConfigFromFlags("", kc)
	if err != nil {
		t.Fatal(err)
	}
	kube, err := kubernetes.NewForConfig(rc)
	if err != nil {
		t.Fatal(err)
	}
	reads, err := api.NewClient(rc)
	if err != nil {
		t.Fatal(err)
	}
	return kube, reads
}

func forbidden(t *testing.T, what string, err error) {
	t.Helper()
	if !apierrors.IsForbidden(err) {
		t.Errorf("%s: %v, want forbidden", what, err)
	}
}

// A node reads, with its own credentials against the real API server, the
// Secrets and ConfigMaps that the VMIs and DataVolumes placed on it name,
// and nothing else: not directly, not what another node's objects name,
// not what its own objects do not name.
func TestNodeReadsOnlyWhatItsObjectsName(t *testing.T) {
	cp := controlplane.Shared(t)
	ctx := context.Background()
	admin := cp.Clientset(t)
	testkit.InstallCRDs(t, cp)
	if err := rbac.EnsureDaemons(ctx, admin); err != nil {
		t.Fatal(err)
	}
	virt, err := client.NewSet(cp.RestConfig)
	if err != nil {
		t.Fatal(err)
	}
	dyn, err := dynamic.NewForConfig(cp.RestConfig)
	if err != nil {
		t.Fatal(err)
	}
	brainNS, ns := cp.Namespace(t), cp.Namespace(t)
	srv, err := nodereads.New(nodereads.Config{Kube: admin, Dynamic: dyn, Virt: virt, Namespace: brainNS, Addr: ":0"})
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- srv.Run(rctx) }()
	t.Cleanup(func() {
		cancel()
		<-done
		_ = aggregated.Unregister(context.Background(), admin, dyn, aggregated.Registration{Group: api.Group, Versions: []string{api.Version},
			Namespace: brainNS, Service: nodereads.ServiceName})
	})
	select {
	case <-srv.Ready():
	case err := <-done:
		t.Fatal(err)
	case <-time.After(60 * time.Second):
		t.Fatal("nodereads not ready")
	}

	suffix := fmt.Sprint(time.Now().UnixNano() % 100000)
	mine, other := "nr-mine-"+suffix, "nr-other-"+suffix
	mkSecret := func(name string) {
		t.Helper()
		if _, err := admin.CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: name},
			StringData: map[string]string{"userdata": "#cloud-config " + name}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	mkConfigMap := func(namespace, name string, data map[string]string) {
		t.Helper()
		if _, err := admin.CoreV1().ConfigMaps(namespace).Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: name},
			Data: data}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	for _, s := range []string{"mine-userdata", "mine-pull", "other-userdata", "unnamed", "mine-import", "other-import"} {
		mkSecret(s)
	}
	mkConfigMap(ns, "mine-ca", map[string]string{"ca.pem": "PEM"})
	mkConfigMap(ns, "mine-files", map[string]string{"a": "b"})

	// VMIs bound to each node.
	vmi := func(name, node, secret string, extra ...kubevirtv1.Volume) {
		t.Helper()
		v := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
			Spec: kubevirtv1.VirtualMachineInstanceSpec{Domain: kubevirtv1.DomainSpec{Resources: kubevirtv1.ResourceRequirements{
				Requests: corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("64Mi")}}},
				Volumes: append([]kubevirtv1.Volume{{Name: "ci", VolumeSource: kubevirtv1.VolumeSource{CloudInitNoCloud: &kubevirtv1.CloudInitNoCloudSource{
					UserDataSecretRef: &corev1.LocalObjectReference{Name: secret}}}}}, extra...)}}
		v, err := virt.VMIs.Create(ctx, v)
		if err != nil {
			t.Fatal(err)
		}
		v.Status.NodeName, v.Status.Phase = node, kubevirtv1.Scheduled
		if _, err := virt.VMIs.UpdateStatus(ctx, v); err != nil {
			t.Fatal(err)
		}
	}
	vmi("vm-mine", mine, "mine-userdata",
		kubevirtv1.Volume{Name: "cd", VolumeSource: kubevirtv1.VolumeSource{ContainerDisk: &kubevirtv1.ContainerDiskSource{Image: "x", ImagePullSecret: "mine-pull"}}},
		kubevirtv1.Volume{Name: "files", VolumeSource: kubevirtv1.VolumeSource{ConfigMap: &kubevirtv1.ConfigMapVolumeSource{
			LocalObjectReference: corev1.LocalObjectReference{Name: "mine-files"}}}})
	vmi("vm-other", other, "other-userdata")

	// DataVolumes whose claims are placed on each node.
	dv := func(name, node, secret string) {
		t.Helper()
		ca := "mine-ca"
		d := &cdiv1.DataVolume{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
			Spec: cdiv1.DataVolumeSpec{Source: &cdiv1.DataVolumeSource{HTTP: &cdiv1.DataVolumeSourceHTTP{URL: "http://x/disk.img",
				SecretRef: secret, CertConfigMap: ca}},
				Storage: &cdiv1.StorageSpec{Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}}}}}
		if _, err := virt.DataVolumes.Create(ctx, d); err != nil {
			t.Fatal(err)
		}
		claim(t, admin, ns, name, node)
	}
	dv("dv-mine", mine, "mine-import")
	dv("dv-other", other, "other-import")

	nodeKube, reads := as(t, cp, identity.NodeUser(mine), identity.NodesGroup)
	vmiRef := func(name string) api.Ref { return api.Ref{Resource: api.VMIs, Namespace: ns, Name: name} }
	dvRef := func(name string) api.Ref { return api.Ref{Resource: api.DataVolumes, Namespace: ns, Name: name} }

	// The API is registered in the background: wait for the first answer.
	var sec *corev1.Secret
	testkit.Until(t, 60*time.Second, "node reads its VMI's cloud-init secret", func() bool {
		sec, err = reads.Secret(ctx, vmiRef("vm-mine"), "mine-userdata")
		return err == nil
	})
	if got := string(sec.Data["userdata"]); got != "#cloud-config mine-userdata" {
		t.Errorf("secret data %q", got)
	}
	if _, err := reads.Secret(ctx, vmiRef("vm-mine"), "mine-pull"); err != nil {
		t.Errorf("its VMI's pull secret: %v", err)
	}
	if cm, err := reads.ConfigMap(ctx, vmiRef("vm-mine"), "mine-files"); err != nil || cm.Data["a"] != "b" {
		t.Errorf("its VMI's configMap volume: %v %v", cm, err)
	}
	if s, err := reads.Secret(ctx, dvRef("dv-mine"), "mine-import"); err != nil || string(s.Data["userdata"]) == "" {
		t.Errorf("its DataVolume's import secret: %v", err)
	}
	if cm, err := reads.ConfigMap(ctx, dvRef("dv-mine"), "mine-ca"); err != nil || cm.Data["ca.pem"] != "PEM" {
		t.Errorf("its DataVolume's CA configmap: %v %v", cm, err)
	}

	_, err = reads.Secret(ctx, vmiRef("vm-mine"), "unnamed")
	forbidden(t, "a secret its VMI does not name", err)
	_, err = reads.Secret(ctx, vmiRef("vm-mine"), "other-userdata")
	forbidden(t, "another node's VMI's secret through its own VMI", err)
	_, err = reads.Secret(ctx, vmiRef("vm-other"), "other-userdata")
	forbidden(t, "the secret of a VMI on another node", err)
	_, err = reads.Secret(ctx, dvRef("dv-other"), "other-import")
	forbidden(t, "the secret of a DataVolume on another node", err)
	_, err = reads.Secret(ctx, dvRef("dv-mine"), "other-import")
	forbidden(t, "a secret its DataVolume does not name", err)
	_, err = reads.ConfigMap(ctx, vmiRef("vm-mine"), "mine-ca")
	forbidden(t, "a configmap its VMI does not name", err)
	if _, err := reads.Secret(ctx, vmiRef("vm-absent"), "unnamed"); !apierrors.IsNotFound(err) {
		t.Errorf("through a VMI that does not exist: %v, want not found", err)
	}
	_, err = nodeKube.CoreV1().Secrets(ns).Get(ctx, "mine-userdata", metav1.GetOptions{})
	forbidden(t, "get its VMI's secret directly", err)
	_, err = nodeKube.CoreV1().Secrets(ns).Get(ctx, "unnamed", metav1.GetOptions{})
	forbidden(t, "get a secret no VMI on it uses directly", err)
	_, err = nodeKube.CoreV1().ConfigMaps(ns).Get(ctx, "mine-ca", metav1.GetOptions{})
	forbidden(t, "get a configmap directly", err)

	// A VMI moving to it by a live migration is its while that runs.
	mig, err := virt.Migrations.Create(ctx, &kubevirtv1.VirtualMachineInstanceMigration{ObjectMeta: metav1.ObjectMeta{Name: "to-mine", Namespace: ns},
		Spec: kubevirtv1.VirtualMachineInstanceMigrationSpec{VMIName: "vm-other"}})
	if err != nil {
		t.Fatal(err)
	}
	mig.Status.MigrationState = &kubevirtv1.VirtualMachineInstanceMigrationState{SourceNode: other, TargetNode: mine}
	if mig, err = virt.Migrations.UpdateStatus(ctx, mig); err != nil {
		t.Fatal(err)
	}
	if _, err := reads.Secret(ctx, vmiRef("vm-other"), "other-userdata"); err != nil {
		t.Errorf("the secret of a VMI migrating to it: %v", err)
	}
	mig.Status.MigrationState.Completed = true
	if _, err := virt.Migrations.UpdateStatus(ctx, mig); err != nil {
		t.Fatal(err)
	}
	_, err = reads.Secret(ctx, vmiRef("vm-other"), "other-userdata")
	forbidden(t, "the secret of a VMI whose migration to it ended", err)

	// Clone requests in the brain's namespace: the target's node and the
	// source's node read them, no other.
	cloneRequest := func(target, source string) string {
		t.Helper()
		pvc, err := admin.CoreV1().PersistentVolumeClaims(ns).Get(ctx, target, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		name := importstate.CloneRequestName(pvc.UID)
		mkConfigMap(brainNS, name, importstate.CloneRequest{TargetNamespace: ns, TargetName: target, SourceNamespace: ns, SourceName: source}.Data())
		return name
	}
	claim(t, admin, ns, "clone-to-mine", mine)
	claim(t, admin, ns, "clone-to-other", other)
	claim(t, admin, ns, "clone-elsewhere", other)
	toMine := cloneRequest("clone-to-mine", "dv-other")
	fromMine := cloneRequest("clone-to-other", "dv-mine")
	elsewhere := cloneRequest("clone-elsewhere", "dv-other")
	claimRef := func(name string) api.Ref { return api.Ref{Resource: api.Claims, Namespace: ns, Name: name} }
	if _, err := reads.BrainConfigMap(ctx, claimRef("clone-to-mine"), toMine); err != nil {
		t.Errorf("the clone request of its claim: %v", err)
	}
	if _, err := reads.BrainConfigMap(ctx, claimRef("clone-to-other"), fromMine); err != nil {
		t.Errorf("the clone request whose source it holds: %v", err)
	}
	_, err = reads.BrainConfigMap(ctx, claimRef("clone-elsewhere"), elsewhere)
	forbidden(t, "a clone request of other nodes", err)
	_, err = reads.BrainConfigMap(ctx, claimRef("clone-to-mine"), elsewhere)
	forbidden(t, "another claim's clone request through its claim", err)
	_, err = reads.BrainConfigMap(ctx, dvRef("dv-mine"), toMine)
	forbidden(t, "a brain configmap that is not the import proxy's CA", err)

	// Anyone but a node agent is refused by the brain, even when RBAC lets
	// it reach the API.
	grant(t, admin, "nr-user-"+suffix)
	_, userReads := as(t, cp, "nr-user-"+suffix, "testers")
	_, err = userReads.Secret(ctx, vmiRef("vm-mine"), "mine-userdata")
	forbidden(t, "a user who is not a node", err)
	// A node with no objects reads nothing.
	_, strangerReads := as(t, cp, identity.NodeUser("nr-stranger-"+suffix), identity.NodesGroup)
	_, err = strangerReads.Secret(ctx, vmiRef("vm-mine"), "mine-userdata")
	forbidden(t, "a node that runs no VMI", err)
}

// claim makes a claim placed on node.
func claim(t *testing.T, kube kubernetes.Interface, ns, name, node string) {
	t.Helper()
	pvc := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns,
		Annotations: map[string]string{importstate.AnnSelectedNode: node}},
		Spec: corev1.PersistentVolumeClaimSpec{AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}}}}
	if _, err := kube.CoreV1().PersistentVolumeClaims(ns).Create(context.Background(), pvc, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// grant lets user get every nodereads subresource (as RBAC lets nodes).
func grant(t *testing.T, kube kubernetes.Interface, user string) {
	t.Helper()
	ctx := context.Background()
	role := &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: user},
		Rules: []rbacv1.PolicyRule{{APIGroups: []string{api.Group}, Resources: api.Subresources, Verbs: []string{"get"}}}}
	if _, err := kube.RbacV1().ClusterRoles().Create(ctx, role, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	binding := &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: user},
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: user},
		Subjects: []rbacv1.Subject{{Kind: rbacv1.UserKind, APIGroup: rbacv1.GroupName, Name: user}}}
	if _, err := kube.RbacV1().ClusterRoleBindings().Create(ctx, binding, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	resource, sub, _ := strings.Cut(api.Subresources[0], "/")
	testkit.WaitAllowed(t, kube, user, authorizationv1.ResourceAttributes{Verb: "get", Group: api.Group, Resource: resource, Subresource: sub})
	t.Cleanup(func() {
		_ = kube.RbacV1().ClusterRoleBindings().Delete(context.Background(), user, metav1.DeleteOptions{})
		_ = kube.RbacV1().ClusterRoles().Delete(context.Background(), user, metav1.DeleteOptions{})
	})
}
