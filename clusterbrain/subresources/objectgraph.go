package subresources

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"strings"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/featuregate"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/httperr"
	"github.com/nodevirt/nodevirt/clusterbrain/scheduler"
)

// dependencyLabel is the label KubeVirt puts on every node of an object
// graph: what kind of dependency the object is.
const dependencyLabel = "kubevirt.io/dependency-type"

// graphKinds are the objects a graph names, by resource: their API group,
// kind and dependency type (KubeVirt's table).
var graphKinds = map[string]struct{ group, kind, dependency string }{
	"virtualmachines":                    {"kubevirt.io", "VirtualMachine", "compute"},
	"virtualmachineinstances":            {"kubevirt.io", "VirtualMachineInstance", "compute"},
	"pods":                               {"", "Pod", "compute"},
	"datavolumes":                        {"cdi.kubevirt.io", "DataVolume", "storage"},
	"persistentvolumeclaims":             {"", "PersistentVolumeClaim", "storage"},
	"configmaps":                         {"", "ConfigMap", "config"},
	"secrets":                            {"", "Secret", "config"},
	"controllerrevisions":                {"apps", "ControllerRevision", "config"},
	"virtualmachineinstancetypes":        {"instancetype.kubevirt.io", "VirtualMachineInstancetype", "config"},
	"virtualmachineclusterinstancetypes": {"instancetype.kubevirt.io", "VirtualMachineClusterInstancetype", "config"},
	"virtualmachinepreferences":          {"instancetype.kubevirt.io", "VirtualMachinePreference", "config"},
	"virtualmachineclusterpreferences":   {"instancetype.kubevirt.io", "VirtualMachineClusterPreference", "config"},
	"networkattachmentdefinitions":       {"k8s.cni.cncf.io", "NetworkAttachmentDefinition", "network"},
}

// graphNode is one object of a graph; optional objects are those a VM
// can be rebuilt without (its instance type and preference objects, its
// networks' definitions).
func graphNode(resource, namespace, name string, optional bool, children ...kubevirtv1.ObjectGraphNode) kubevirtv1.ObjectGraphNode {
	k := graphKinds[resource]
	n := kubevirtv1.ObjectGraphNode{
		ObjectReference: corev1.TypedObjectReference{APIGroup: &k.group, Kind: k.kind, Name: name, Namespace: &namespace},
		Labels:          map[string]string{dependencyLabel: k.dependency},
		Children:        children,
	}
	if optional {
		n.Optional = &optional
	}
	return n
}

// objectGraph answers {resource}/{name}/objectgraph with the graph build
// makes of the named object, filtered by the request's options.
func (s *Server) objectGraph(build func(ctx context.Context, ns, name string) (kubevirtv1.ObjectGraphNode, error)) handler {
	return func(w http.ResponseWriter, r *http.Request, req request, _ *slog.Logger) error {
		opts, err := s.graphRequest(r)
		if err != nil {
			return err
		}
		root, err := build(r.Context(), req.namespace, req.name)
		if err != nil {
			return err
		}
		return writeGraph(w, root, opts)
	}
}

// vmGraph is what a VM depends on, as KubeVirt's virt-api finds it.
func (s *Server) vmGraph(ctx context.Context, ns, name string) (kubevirtv1.ObjectGraphNode, error) {
	vm, err := s.getVM(ctx, ns, name)
	if err != nil {
		return kubevirtv1.ObjectGraphNode{}, err
	}
	var children []kubevirtv1.ObjectGraphNode
	if vm.Status.Created {
		vmi := graphNode("virtualmachineinstances", ns, name, false)
		if vmi.Children, err = s.capacityPods(ctx, ns, name); err != nil {
			return kubevirtv1.ObjectGraphNode{}, err
		}
		children = append(children, vmi)
	}
	if m := vm.Spec.Instancetype; m != nil {
		children = append(children, matcherNodes(m, "virtualmachineclusterinstancetypes", vm.Status.InstancetypeRef, ns)...)
	}
	if m := vm.Spec.Preference; m != nil {
		children = append(children, matcherNodes(m, "virtualmachineclusterpreferences", vm.Status.PreferenceRef, ns)...)
	}
	if t := vm.Spec.Template; t != nil {
		children = append(children, specNodes(&t.Spec, ns)...)
	}
	return graphNode("virtualmachines", ns, name, false, children...), nil
}

// vmiGraph is what a VMI depends on.
func (s *Server) vmiGraph(ctx context.Context, ns, name string) (kubevirtv1.ObjectGraphNode, error) {
	vmi, err := s.fetchVMI(ctx, ns, name)
	if err != nil {
		return kubevirtv1.ObjectGraphNode{}, err
	}
	children, err := s.capacityPods(ctx, ns, name)
	if err != nil {
		return kubevirtv1.ObjectGraphNode{}, err
	}
	children = append(children, specNodes(&vmi.Spec, ns)...)
	return graphNode("virtualmachineinstances", ns, name, false, children...), nil
}

// graphRequest refuses the request unless the KubeVirt CR turns the
// ObjectGraph gate on, as virt-api does, and reads its options.
func (s *Server) graphRequest(r *http.Request) (*kubevirtv1.ObjectGraphOptions, error) {
	kvs, err := s.cfg.Virt.KubeVirts.List(r.Context(), metav1.NamespaceAll, metav1.ListOptions{})
	if err != nil {
		return nil, apierrors.NewInternalError(fmt.Errorf("read the KubeVirt CR: %w", err))
	}
	var kv *kubevirtv1.KubeVirt
	if len(kvs) > 0 {
		kv = kvs[0]
	}
	if !featuregate.KubeVirtEnabled(kv, featuregate.ObjectGraph) {
		return nil, apierrors.NewBadRequest("ObjectGraph feature gate not enabled: Unable to return object graph.")
	}
	opts := &kubevirtv1.ObjectGraphOptions{}
	if err := decodeBody(r, opts); err != nil {
		return nil, err
	}
	if opts.LabelSelector != nil {
		if _, err := metav1.LabelSelectorAsSelector(opts.LabelSelector); err != nil {
			return nil, apierrors.NewBadRequest(fmt.Sprintf("invalid labelSelector: %v", err))
		}
	}
	return opts, nil
}

// capacityPods are the pods that hold the VMI's capacity on a kubelet
// cluster (package capacitypods): nodevirt's stand-in for virt-launcher.
func (s *Server) capacityPods(ctx context.Context, ns, vmi string) ([]kubevirtv1.ObjectGraphNode, error) {
	pods, err := s.cfg.Kube.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: scheduler.CapacityPodLabel + "=true"})
	if err != nil {
		return nil, apierrors.NewInternalError(fmt.Errorf("list the capacity pods of %s: %w", vmi, err))
	}
	var out []kubevirtv1.ObjectGraphNode
	for _, p := range pods.Items {
		if owner := metav1.GetControllerOf(&p); owner != nil && owner.Kind == "VirtualMachineInstance" && owner.Name == vmi {
			out = append(out, graphNode("pods", ns, p.Name, false))
		}
	}
	return out, nil
}

// matcherNodes are an instance type's or preference's object (optional:
// the VM keeps its revision; a matcher naming no kind names the cluster
// kind, resource unnamed) and the ControllerRevision the VM runs by.
func matcherNodes(m kubevirtv1.Matcher, unnamed string, ref *kubevirtv1.InstancetypeStatusRef, ns string) []kubevirtv1.ObjectGraphNode {
	var out []kubevirtv1.ObjectGraphNode
	resource := strings.ToLower(m.GetKind()) + "s"
	if m.GetKind() == "" {
		resource = unnamed
	}
	switch resource {
	case "virtualmachineclusterinstancetypes", "virtualmachineclusterpreferences":
		out = append(out, graphNode(resource, "", m.GetName(), true))
	case "virtualmachineinstancetypes", "virtualmachinepreferences":
		out = append(out, graphNode(resource, ns, m.GetName(), true))
	}
	switch {
	case ref != nil && ref.ControllerRevisionRef != nil:
		out = append(out, graphNode("controllerrevisions", ns, ref.ControllerRevisionRef.Name, false))
	case ref == nil && m.GetRevisionName() != "":
		out = append(out, graphNode("controllerrevisions", ns, m.GetRevisionName(), false))
	}
	return out
}

// specNodes are what a VMI spec names: access credential secrets, its
// volumes' DataVolumes (with their claims), claims, ConfigMaps and
// Secrets, and its Multus networks' definitions (optional).
func specNodes(spec *kubevirtv1.VirtualMachineInstanceSpec, ns string) []kubevirtv1.ObjectGraphNode {
	var out []kubevirtv1.ObjectGraphNode
	secret := func(name string) { out = append(out, graphNode("secrets", ns, name, false)) }
	for _, ac := range spec.AccessCredentials {
		switch {
		case ac.SSHPublicKey != nil && ac.SSHPublicKey.Source.Secret != nil:
			secret(ac.SSHPublicKey.Source.Secret.SecretName)
		case ac.UserPassword != nil && ac.UserPassword.Source.Secret != nil:
			secret(ac.UserPassword.Source.Secret.SecretName)
		}
	}
	for _, v := range spec.Volumes {
		switch {
		case v.DataVolume != nil:
			out = append(out, graphNode("datavolumes", ns, v.DataVolume.Name, false,
				graphNode("persistentvolumeclaims", ns, v.DataVolume.Name, false)))
		case v.PersistentVolumeClaim != nil:
			out = append(out, graphNode("persistentvolumeclaims", ns, v.PersistentVolumeClaim.ClaimName, false))
		case v.ConfigMap != nil:
			out = append(out, graphNode("configmaps", ns, v.ConfigMap.Name, false))
		case v.Secret != nil:
			secret(v.Secret.SecretName)
		case v.CloudInitNoCloud != nil:
			cloudInitSecrets(v.CloudInitNoCloud.UserDataSecretRef, v.CloudInitNoCloud.NetworkDataSecretRef, secret)
		case v.CloudInitConfigDrive != nil:
			cloudInitSecrets(v.CloudInitConfigDrive.UserDataSecretRef, v.CloudInitConfigDrive.NetworkDataSecretRef, secret)
		}
	}
	for _, n := range spec.Networks {
		if n.Multus == nil || n.Multus.NetworkName == "" {
			continue
		}
		nadNS, name := ns, n.Multus.NetworkName
		if before, after, ok := strings.Cut(name, "/"); ok {
			nadNS, name = before, after
		}
		out = append(out, graphNode("networkattachmentdefinitions", nadNS, name, true))
	}
	return out
}

func cloudInitSecrets(user, network *corev1.LocalObjectReference, secret func(string)) {
	for _, ref := range []*corev1.LocalObjectReference{user, network} {
		if ref != nil {
			secret(ref.Name)
		}
	}
}

// writeGraph answers root with its descendants filtered by opts: optional
// nodes dropped when includeOptionalNodes is false, nodes whose labels the
// selector does not match dropped with their children. The root stays.
func writeGraph(w http.ResponseWriter, root kubevirtv1.ObjectGraphNode, opts *kubevirtv1.ObjectGraphOptions) error {
	var sel labels.Selector
	if opts.LabelSelector != nil {
		sel, _ = metav1.LabelSelectorAsSelector(opts.LabelSelector) // checked by graphRequest
	}
	var filter func([]kubevirtv1.ObjectGraphNode) []kubevirtv1.ObjectGraphNode
	filter = func(nodes []kubevirtv1.ObjectGraphNode) []kubevirtv1.ObjectGraphNode {
		out := make([]kubevirtv1.ObjectGraphNode, 0, len(nodes))
		for _, n := range nodes {
			if n.Optional != nil && *n.Optional && opts.IncludeOptionalNodes != nil && !*opts.IncludeOptionalNodes {
				continue
			}
			if sel != nil && !sel.Matches(labels.Set(n.Labels)) {
				continue
			}
			n.Children = filter(n.Children)
			out = append(out, n)
		}
		return out
	}
	root.Children = filter(root.Children)
	return httperr.WriteJSON(w, http.StatusOK, root)
}
