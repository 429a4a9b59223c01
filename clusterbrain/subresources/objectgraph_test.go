package subresources

import (
	"context"
	"net/http"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/featuregate"
	"github.com/nodevirt/nodevirt/clusterbrain/scheduler"
	"github.com/nodevirt/nodevirt/test/controlplane"
)

// TestObjectGraph: a VM's and a VMI's objectgraph name what they depend on
// as KubeVirt's virt-api does (VMI with its capacity pod, DataVolume with
// its claim, claims, ConfigMaps, Secrets of volumes and credentials, the
// instance type, its revision, network definitions), filtered by the
// request's options; refused while the ObjectGraph gate is off.
func TestObjectGraph(t *testing.T) {
	setup(t)
	ctx := context.Background()
	ns := controlplane.Shared(t).Namespace(t)
	c := adminIn(t, ns)

	vm := newVM(t, ns, "graphed", kubevirtv1.RunStrategyHalted)
	var got kubevirtv1.ObjectGraphNode
	wantStatus(t, "objectgraph without the gate", c.ObjectGraph(ctx, "virtualmachines", vm.Name, nil, &got),
		http.StatusBadRequest, "ObjectGraph feature gate not enabled")

	kv := &kubevirtv1.KubeVirt{ObjectMeta: metav1.ObjectMeta{Name: "kubevirt", Namespace: ns},
		Spec: kubevirtv1.KubeVirtSpec{Configuration: kubevirtv1.KubeVirtConfiguration{
			DeveloperConfiguration: &kubevirtv1.DeveloperConfiguration{FeatureGates: []string{featuregate.ObjectGraph}}}}}
	if _, err := env.virt.KubeVirts.Create(ctx, kv); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = env.virt.KubeVirts.Delete(context.Background(), ns, kv.Name, metav1.DeleteOptions{}) })

	vm.Spec.Instancetype = &kubevirtv1.InstancetypeMatcher{Name: "u1.small"}
	vm.Spec.Template.Spec.AccessCredentials = []kubevirtv1.AccessCredential{{SSHPublicKey: &kubevirtv1.SSHPublicKeyAccessCredential{
		Source: kubevirtv1.SSHPublicKeyAccessCredentialSource{Secret: &kubevirtv1.AccessCredentialSecretSource{SecretName: "keys"}},
		PropagationMethod: kubevirtv1.SSHPublicKeyAccessCredentialPropagationMethod{
			NoCloud: &kubevirtv1.NoCloudSSHPublicKeyAccessCredentialPropagation{}}}}}
	vm.Spec.Template.Spec.Volumes = []kubevirtv1.Volume{
		{Name: "root", VolumeSource: kubevirtv1.VolumeSource{DataVolume: &kubevirtv1.DataVolumeSource{Name: "root-dv"}}},
		{Name: "data", VolumeSource: kubevirtv1.VolumeSource{PersistentVolumeClaim: &kubevirtv1.PersistentVolumeClaimVolumeSource{
			PersistentVolumeClaimVolumeSource: corev1.PersistentVolumeClaimVolumeSource{ClaimName: "data-pvc"}}}},
		{Name: "conf", VolumeSource: kubevirtv1.VolumeSource{ConfigMap: &kubevirtv1.ConfigMapVolumeSource{
			LocalObjectReference: corev1.LocalObjectReference{Name: "app-conf"}}}},
		{Name: "init", VolumeSource: kubevirtv1.VolumeSource{CloudInitNoCloud: &kubevirtv1.CloudInitNoCloudSource{
			UserDataSecretRef: &corev1.LocalObjectReference{Name: "userdata"}}}},
	}
	vm.Spec.Template.Spec.Networks = []kubevirtv1.Network{{Name: "lab", NetworkSource: kubevirtv1.NetworkSource{
		Multus: &kubevirtv1.MultusNetwork{NetworkName: "other/br-lab"}}}}
	vm, err := env.virt.VMs.Update(ctx, vm)
	if err != nil {
		t.Fatal(err)
	}
	vm.Status.Created = true
	vm.Status.InstancetypeRef = &kubevirtv1.InstancetypeStatusRef{Name: "u1.small", Kind: "VirtualMachineClusterInstancetype",
		ControllerRevisionRef: &kubevirtv1.ControllerRevisionRef{Name: "graphed-u1.small-1"}}
	if _, err := env.virt.VMs.UpdateStatus(ctx, vm); err != nil {
		t.Fatal(err)
	}
	vmi := newVMI(t, ns, "graphed", kubevirtv1.Running)
	yes, no := true, false
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "capacity-graphed", Namespace: ns,
		Labels: map[string]string{scheduler.CapacityPodLabel: "true"},
		OwnerReferences: []metav1.OwnerReference{{APIVersion: kubevirtv1.SchemeGroupVersion.String(), Kind: "VirtualMachineInstance",
			Name: vmi.Name, UID: vmi.UID, Controller: &yes}}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "pause", Image: "pause"}}, AutomountServiceAccountToken: &no}}
	kube := controlplane.Shared(t).Clientset(t)
	// No controller-manager here makes the namespace's default account.
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default", Namespace: ns}}
	if _, err := kube.CoreV1().ServiceAccounts(ns).Create(ctx, sa, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := kube.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	t.Run("vm", func(t *testing.T) {
		var g kubevirtv1.ObjectGraphNode
		if err := c.ObjectGraph(ctx, "virtualmachines", vm.Name, nil, &g); err != nil {
			t.Fatal(err)
		}
		want := []string{
			"VirtualMachine " + ns + "/graphed compute",
			"  VirtualMachineInstance " + ns + "/graphed compute",
			"    Pod " + ns + "/capacity-graphed compute",
			"  VirtualMachineClusterInstancetype /u1.small config optional",
			"  ControllerRevision " + ns + "/graphed-u1.small-1 config",
			"  Secret " + ns + "/keys config",
			"  DataVolume " + ns + "/root-dv storage",
			"    PersistentVolumeClaim " + ns + "/root-dv storage",
			"  PersistentVolumeClaim " + ns + "/data-pvc storage",
			"  ConfigMap " + ns + "/app-conf config",
			"  Secret " + ns + "/userdata config",
			"  NetworkAttachmentDefinition other/br-lab network optional",
		}
		if lines := flatten(g, ""); !slices.Equal(lines, want) {
			t.Errorf("graph\n%q\nwant\n%q", lines, want)
		}
	})
	t.Run("filtered", func(t *testing.T) {
		var g kubevirtv1.ObjectGraphNode
		opts := &kubevirtv1.ObjectGraphOptions{IncludeOptionalNodes: &no,
			LabelSelector: &metav1.LabelSelector{MatchLabels: map[string]string{dependencyLabel: "storage"}}}
		if err := c.ObjectGraph(ctx, "virtualmachines", vm.Name, opts, &g); err != nil {
			t.Fatal(err)
		}
		want := []string{
			"VirtualMachine " + ns + "/graphed compute",
			"  DataVolume " + ns + "/root-dv storage",
			"    PersistentVolumeClaim " + ns + "/root-dv storage",
			"  PersistentVolumeClaim " + ns + "/data-pvc storage",
		}
		if lines := flatten(g, ""); !slices.Equal(lines, want) {
			t.Errorf("storage graph\n%q\nwant\n%q", lines, want)
		}
	})
	t.Run("vmi", func(t *testing.T) {
		var g kubevirtv1.ObjectGraphNode
		if err := c.ObjectGraph(ctx, "virtualmachineinstances", vmi.Name, nil, &g); err != nil {
			t.Fatal(err)
		}
		want := []string{
			"VirtualMachineInstance " + ns + "/graphed compute",
			"  Pod " + ns + "/capacity-graphed compute",
		}
		if lines := flatten(g, ""); !slices.Equal(lines, want) {
			t.Errorf("vmi graph\n%q\nwant\n%q", lines, want)
		}
	})
	t.Run("refused", func(t *testing.T) {
		wantStatus(t, "objectgraph of a missing vm", c.ObjectGraph(ctx, "virtualmachines", "nope", nil, &got), http.StatusNotFound, "nope")
		bad := &kubevirtv1.ObjectGraphOptions{LabelSelector: &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{
			{Key: dependencyLabel, Operator: "Sometimes"}}}}
		wantStatus(t, "objectgraph with a bad selector", c.ObjectGraph(ctx, "virtualmachines", vm.Name, bad, &got),
			http.StatusBadRequest, "invalid labelSelector")
	})
}

// flatten writes g as one line per node, "Kind namespace/name dependency
// [optional]", indented by depth.
func flatten(g kubevirtv1.ObjectGraphNode, indent string) []string {
	ref := g.ObjectReference
	ns := ""
	if ref.Namespace != nil {
		ns = *ref.Namespace
	}
	line := indent + ref.Kind + " " + ns + "/" + ref.Name + " " + g.Labels[dependencyLabel]
	if g.Optional != nil && *g.Optional {
		line += " optional"
	}
	out := []string{line}
	for _, ch := range g.Children {
		out = append(out, flatten(ch, indent+"  ")...)
	}
	return out
}
