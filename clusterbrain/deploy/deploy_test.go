// Package deploy holds nodevirt's manifests for an existing Kubernetes
// cluster: the kustomize base (base/), the one-file rendering
// (nodevirt.yaml) and the HyperConverged CR applied last
// (hyperconverged.yaml). The tests keep them honest: the generated RBAC
// and node restriction files are what clusterbrain/rbac installs, the
// rendering is the base's, every object decodes strictly into its type and
// the API server accepts them (server-side dry run).
//
// After changing clusterbrain/rbac: go test ./clusterbrain/deploy -run TestGenerated -update;
// after changing base/: make manifests.
package deploy

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/yaml"

	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
	"github.com/nodevirt/nodevirt/clusterbrain/hco"
	"github.com/nodevirt/nodevirt/clusterbrain/rbac"
	"github.com/nodevirt/nodevirt/csi"
	"github.com/nodevirt/nodevirt/test/controlplane"
)

var update = flag.Bool("update", false, "rewrite the generated manifests in base/")

func TestMain(m *testing.M) { controlplane.Main(m, controlplane.Config{}) }

const generatedHeader = "# Generated from clusterbrain/rbac by `go test ./clusterbrain/deploy -run TestGenerated -update`; do not edit.\n"

// toYAML renders API objects as one YAML stream, without the empty fields
// a Go struct marshals (creationTimestamp: null).
func toYAML(t *testing.T, objs ...runtime.Object) []byte {
	t.Helper()
	var out bytes.Buffer
	out.WriteString(generatedHeader)
	for i, o := range objs {
		j, err := json.Marshal(o)
		if err != nil {
			t.Fatal(err)
		}
		var m map[string]any
		if err := json.Unmarshal(j, &m); err != nil {
			t.Fatal(err)
		}
		if md, ok := m["metadata"].(map[string]any); ok {
			delete(md, "creationTimestamp")
		}
		delete(m, "status")
		y, err := yaml.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		if i > 0 {
			out.WriteString("---\n")
		}
		out.Write(y)
	}
	return out.Bytes()
}

func checkGenerated(t *testing.T, file string, want []byte) {
	t.Helper()
	if *update {
		if err := os.WriteFile(file, want, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	have, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(have, want) {
		t.Errorf("%s is not what clusterbrain/rbac installs: go test ./clusterbrain/deploy -run TestGenerated -update", file)
	}
}

// The RBAC and the node restriction policies in the base are exactly what
// clusterbrain/rbac installs and the brain repairs, so that applying the
// manifests and the brain never fight.
func TestGeneratedRBACAndNodeRestriction(t *testing.T) {
	var objs []runtime.Object
	for _, r := range rbac.DaemonClusterRoles() {
		r.TypeMeta = metav1.TypeMeta{APIVersion: "rbac.authorization.k8s.io/v1", Kind: "ClusterRole"}
		objs = append(objs, r)
	}
	for _, b := range rbac.DaemonClusterRoleBindings() {
		b.TypeMeta = metav1.TypeMeta{APIVersion: "rbac.authorization.k8s.io/v1", Kind: "ClusterRoleBinding"}
		objs = append(objs, b)
	}
	lease := rbac.NodeLeaseRoleBinding()
	lease.TypeMeta = metav1.TypeMeta{APIVersion: "rbac.authorization.k8s.io/v1", Kind: "RoleBinding"}
	objs = append(objs, lease)
	checkGenerated(t, "base/rbac.yaml", toYAML(t, objs...))

	objs = nil
	pols, binds := rbac.NodeRestrictionPolicies()
	for _, p := range pols {
		p.TypeMeta = metav1.TypeMeta{APIVersion: "admissionregistration.k8s.io/v1", Kind: "ValidatingAdmissionPolicy"}
		objs = append(objs, p)
	}
	for _, b := range binds {
		b.TypeMeta = metav1.TypeMeta{APIVersion: "admissionregistration.k8s.io/v1", Kind: "ValidatingAdmissionPolicyBinding"}
		objs = append(objs, b)
	}
	checkGenerated(t, "base/node-restriction.yaml", toYAML(t, objs...))
}

// nodevirt.yaml is the base rendered by kustomize (kubectl kustomize).
func TestRenderedIsTheBase(t *testing.T) {
	if _, err := exec.LookPath("kubectl"); err != nil {
		t.Skip("kubectl not installed")
	}
	out, err := exec.Command("kubectl", "kustomize", "base").Output()
	if err != nil {
		t.Fatalf("kubectl kustomize base: %v", err)
	}
	have, err := os.ReadFile("nodevirt.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(have, out) {
		t.Error("nodevirt.yaml is not the rendered base: make manifests")
	}
}

// docs splits a YAML stream into documents.
func docs(t *testing.T, file string) [][]byte {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var out [][]byte
	for _, d := range bytes.Split(b, []byte("\n---\n")) {
		if len(bytes.TrimSpace(d)) > 0 {
			out = append(out, d)
		}
	}
	return out
}

// Every object decodes strictly into its Go type, and the install keeps the
// promises the README makes about it.
func TestManifestsKeepTheirPromises(t *testing.T) {
	objs := map[string]any{}
	var subjects []rbacv1.Subject
	for _, d := range docs(t, "nodevirt.yaml") {
		var tm struct {
			metav1.TypeMeta `json:",inline"`
			Metadata        metav1.ObjectMeta `json:"metadata"`
		}
		if err := yaml.Unmarshal(d, &tm); err != nil {
			t.Fatal(err)
		}
		var obj any
		switch tm.Kind {
		case "Namespace":
			obj = &corev1.Namespace{}
		case "ServiceAccount":
			obj = &corev1.ServiceAccount{}
		case "ClusterRole":
			obj = &rbacv1.ClusterRole{}
		case "ClusterRoleBinding":
			obj = &rbacv1.ClusterRoleBinding{}
		case "RoleBinding":
			obj = &rbacv1.RoleBinding{}
		case "ValidatingAdmissionPolicy":
			obj = &admissionregistrationv1.ValidatingAdmissionPolicy{}
		case "ValidatingAdmissionPolicyBinding":
			obj = &admissionregistrationv1.ValidatingAdmissionPolicyBinding{}
		case "CSIDriver":
			obj = &storagev1.CSIDriver{}
		case "Deployment":
			obj = &appsv1.Deployment{}
		case "PodDisruptionBudget":
			obj = &policyv1.PodDisruptionBudget{}
		case "DaemonSet":
			obj = &appsv1.DaemonSet{}
		default:
			t.Fatalf("unexpected kind %q", tm.Kind)
		}
		if err := yaml.UnmarshalStrict(d, obj); err != nil {
			t.Fatalf("%s %s: %v", tm.Kind, tm.Metadata.Name, err)
		}
		objs[tm.Kind+"/"+tm.Metadata.Name] = obj
		switch o := obj.(type) {
		case *rbacv1.ClusterRoleBinding:
			subjects = append(subjects, o.Subjects...)
		case *rbacv1.RoleBinding:
			subjects = append(subjects, o.Subjects...)
		}
	}
	// Bindings name ServiceAccounts (and the groups of the systemd
	// install), never users.
	accounts := map[string]bool{}
	for _, s := range subjects {
		switch s.Kind {
		case rbacv1.UserKind:
			t.Errorf("binding to user %s", s.Name)
		case rbacv1.ServiceAccountKind:
			accounts[s.Namespace+"/"+s.Name] = true
		}
	}
	for _, sa := range []string{rbac.BrainServiceAccount, rbac.NodeAgentServiceAccount} {
		if !accounts[rbac.InstallNamespace+"/"+sa] {
			t.Errorf("service account %s is bound to nothing", sa)
		}
		if objs["ServiceAccount/"+sa] == nil {
			t.Errorf("service account %s missing", sa)
		}
	}
	var hc hcov1beta1.HyperConverged
	if b, err := os.ReadFile("hyperconverged.yaml"); err != nil {
		t.Fatal(err)
	} else if err := yaml.UnmarshalStrict(b, &hc); err != nil {
		t.Fatalf("hyperconverged.yaml: %v", err)
	}
	if hc.Name != hcov1beta1.Name || hc.Namespace != hcov1beta1.DefaultNamespace || rbac.InstallNamespace != hcov1beta1.DefaultNamespace {
		t.Errorf("HyperConverged %s/%s", hc.Namespace, hc.Name)
	}
	if objs["Namespace/"+rbac.InstallNamespace] == nil {
		t.Errorf("namespace %s missing", rbac.InstallNamespace)
	}
	if d, ok := objs["CSIDriver/"+csi.DriverName].(*storagev1.CSIDriver); !ok || d.Spec.StorageCapacity == nil || *d.Spec.StorageCapacity {
		t.Errorf("csi driver %s missing, or waiting for capacity objects nobody writes", csi.DriverName)
	}

	brain, ok := objs["Deployment/nodevirt-clusterbrain"].(*appsv1.Deployment)
	if !ok {
		t.Fatal("no brain Deployment")
	}
	if brain.Namespace != rbac.InstallNamespace || brain.Spec.Replicas == nil || *brain.Spec.Replicas != 2 ||
		brain.Spec.Template.Spec.ServiceAccountName != rbac.BrainServiceAccount {
		t.Errorf("brain deployment: namespace %s, replicas %v, account %s", brain.Namespace, brain.Spec.Replicas, brain.Spec.Template.Spec.ServiceAccountName)
	}
	bc := brain.Spec.Template.Spec.Containers[0]
	probe(t, "brain", bc, 8480)
	if bc.SecurityContext == nil || bc.SecurityContext.ReadOnlyRootFilesystem == nil || !*bc.SecurityContext.ReadOnlyRootFilesystem ||
		bc.SecurityContext.Capabilities == nil || !slices.Equal(bc.SecurityContext.Capabilities.Drop, []corev1.Capability{"ALL"}) {
		t.Errorf("brain runs with more than it needs: %+v", bc.SecurityContext)
	}
	if !slices.Contains(bc.Args, "--identity=$(POD_NAME)") {
		t.Error("brain replicas would share a leader-election identity")
	}
	if !slices.Contains(bc.Args, "--capacity-pods") {
		t.Error("kube-scheduler would not see the VMs' capacity (--capacity-pods)")
	}
	// The brain places its own Deployment (spec.infra.nodePlacement)
	// onto the template's own placement, which the annotation repeats.
	if brain.Name != rbac.BrainDeployment || !slices.Contains(bc.Args, "--deployment="+brain.Name) {
		t.Errorf("brain deployment %s, args %q: the brain would not place itself", brain.Name, bc.Args)
	}
	var base struct {
		NodeSelector map[string]string   `json:"nodeSelector,omitempty"`
		Affinity     *corev1.Affinity    `json:"affinity,omitempty"`
		Tolerations  []corev1.Toleration `json:"tolerations,omitempty"`
	}
	bs := brain.Spec.Template.Spec
	if err := json.Unmarshal([]byte(brain.Annotations[hco.PlacementBaseAnnotation]), &base); err != nil {
		t.Errorf("brain deployment annotation %s: %v", hco.PlacementBaseAnnotation, err)
	} else if !equality.Semantic.DeepEqual(base.NodeSelector, bs.NodeSelector) || !equality.Semantic.DeepEqual(base.Affinity, bs.Affinity) ||
		!equality.Semantic.DeepEqual(base.Tolerations, bs.Tolerations) {
		t.Errorf("brain deployment annotation %s is %+v; the template's own placement is %v %+v %v",
			hco.PlacementBaseAnnotation, base, bs.NodeSelector, bs.Affinity, bs.Tolerations)
	}
	pdb, ok := objs["PodDisruptionBudget/nodevirt-clusterbrain"].(*policyv1.PodDisruptionBudget)
	if !ok || pdb.Spec.MinAvailable == nil || pdb.Spec.MinAvailable.IntValue() != 1 ||
		pdb.Spec.Selector.MatchLabels["app.kubernetes.io/name"] != brain.Spec.Selector.MatchLabels["app.kubernetes.io/name"] {
		t.Errorf("brain PDB: %+v", pdb)
	}

	ds, ok := objs["DaemonSet/nodevirt-nodeagent"].(*appsv1.DaemonSet)
	if !ok {
		t.Fatal("no node agent DaemonSet")
	}
	ps := ds.Spec.Template.Spec
	if !ps.HostNetwork || !ps.HostPID || ps.ServiceAccountName != rbac.NodeAgentServiceAccount {
		t.Errorf("node agent: hostNetwork %v hostPID %v account %s", ps.HostNetwork, ps.HostPID, ps.ServiceAccountName)
	}
	ac := ps.Containers[0]
	probe(t, "node agent", ac, 8481)
	mounts := map[string]corev1.VolumeMount{}
	for _, m := range ac.VolumeMounts {
		mounts[m.MountPath] = m
	}
	hostPaths := map[string]string{}
	for _, v := range ps.Volumes {
		if v.HostPath != nil {
			hostPaths[v.Name] = v.HostPath.Path
		}
	}
	// Paths QEMU, libvirt and kubelet use are the same inside and out.
	for _, p := range []string{"/var/lib/nodevirt", "/run/libvirt", "/var/lib/kubelet/plugins_registry", "/var/lib/kubelet/pods",
		strings.TrimSuffix(csiSocketDir(), "/")} {
		m, ok := mounts[p]
		if !ok || hostPaths[m.Name] != p {
			t.Errorf("node agent: %s is not the host's %s", p, p)
		}
	}
	for _, p := range []string{"/var/lib/nodevirt", "/var/lib/kubelet/pods"} {
		if mp := mounts[p].MountPropagation; mp == nil || *mp != corev1.MountPropagationBidirectional {
			t.Errorf("node agent: mounts under %s would not reach the host", p)
		}
	}
	if len(ps.InitContainers) != 1 || hostPaths[ps.InitContainers[0].VolumeMounts[0].Name] != "/opt/cni/bin" {
		t.Error("no init container installing the CNI plugin into /opt/cni/bin")
	}
	for _, c := range append(append([]corev1.Container{}, ps.InitContainers...), append(ps.Containers, brain.Spec.Template.Spec.InitContainers...)...) {
		if !strings.HasPrefix(c.Image, "localhost/nodevirt/") || c.ImagePullPolicy != corev1.PullIfNotPresent {
			t.Errorf("container %s: image %s (%s), want localhost/nodevirt/… IfNotPresent (overlays rename)", c.Name, c.Image, c.ImagePullPolicy)
		}
	}
}

func csiSocketDir() string {
	return "/var/lib/kubelet/plugins/" + csi.DriverName
}

func probe(t *testing.T, who string, c corev1.Container, port int) {
	t.Helper()
	for name, p := range map[string]*corev1.Probe{"readiness": c.ReadinessProbe, "liveness": c.LivenessProbe} {
		if p == nil || p.HTTPGet == nil || p.HTTPGet.Port.IntValue() != port {
			t.Errorf("%s: %s probe not on its health port %d", who, name, port)
		}
	}
}

// The API server accepts every object of the rendering (server-side dry
// run: schema, defaults, validation, admission).
func TestAPIServerAcceptsTheManifests(t *testing.T) {
	if _, err := exec.LookPath("kubectl"); err != nil {
		t.Skip("kubectl not installed")
	}
	cp := controlplane.Shared(t)
	ctx := context.Background()
	// A dry run creates no namespace for the namespaced objects to go in.
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: rbac.InstallNamespace}}
	if _, err := cp.Clientset(t).CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	for _, f := range []string{"nodevirt.yaml"} {
		cmd := exec.CommandContext(ctx, "kubectl", "--kubeconfig", cp.Kubeconfig, "apply", "--dry-run=server", "-f", f)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("kubectl apply --dry-run=server -f %s: %v\n%s", f, err, out)
		}
	}
}
