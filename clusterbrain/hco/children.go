package hco

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"log/slog"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
	hppv1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hostpathprovisioner/v1beta1"
	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
	cnaov1 "github.com/nodevirt/nodevirt/clusterbrain/api/networkaddons/v1"
	sspv1beta2 "github.com/nodevirt/nodevirt/clusterbrain/api/ssp/v1beta2"
)

// managedAnnotations are the child annotations whose presence the HCO
// decides (KubeVirt's emulator-thread parity, CDI's config authority, the
// networks imports may reach).
var managedAnnotations = []string{kubevirtv1.EmulatorThreadCompleteToEvenParity, cdiConfigAuthorityAnnotation,
	importstate.AnnImportAllowedNetworks}

// reconcileChildren makes every child match its rendering, then writes
// each child's status; it returns the related objects and the components'
// health.
func (c *Controller) reconcileChildren(ctx context.Context, hc *hcov1beta1.HyperConverged, want *Children, nodes nodeHealth) ([]corev1.ObjectReference, []componentHealth, error) {
	v, ver := c.cfg.Virt, c.cfg.Version
	kinds := []string{kindKubeVirt, kindCDI, kindCNAO, kindSSP}
	if want.HPP != nil {
		kinds = append(kinds, kindHPP)
	}
	failures := probeAll(ctx, c.cfg.Probes)
	c.mu.Lock()
	c.probesFailing = len(failures) > 0
	c.mu.Unlock()
	health := judge(kinds, nodes, failures)
	byKind := map[string]componentHealth{}
	for _, h := range health {
		byKind[h.Kind] = h
	}
	var related []corev1.ObjectReference
	ref := func(obj client.Object) {
		gvk := obj.GetObjectKind().GroupVersionKind()
		related = append(related, corev1.ObjectReference{APIVersion: gvk.GroupVersion().String(), Kind: gvk.Kind,
			Namespace: obj.GetNamespace(), Name: obj.GetName(), UID: obj.GetUID(), ResourceVersion: obj.GetResourceVersion()})
	}

	kv, err := ensureChild(ctx, c, hc, kindKubeVirt, v.KubeVirts, want.KubeVirt, func(o *kubevirtv1.KubeVirt) any { return &o.Spec })
	if err != nil {
		return nil, nil, err
	}
	kv.Status = kubeVirtStatus(kv, byKind[kindKubeVirt], ver)
	if kv, err = writeChildStatus(ctx, v.KubeVirts, kv, func(o *kubevirtv1.KubeVirt) any { return &o.Status }); err != nil {
		return nil, nil, err
	}
	kv.SetGroupVersionKind(kubevirtv1.GroupVersion.WithKind("KubeVirt"))
	ref(kv)

	cdi, err := ensureChild(ctx, c, hc, kindCDI, v.CDIs, want.CDI, func(o *cdiv1.CDI) any { return &o.Spec })
	if err != nil {
		return nil, nil, err
	}
	cdi.Status = cdiStatus(cdi, byKind[kindCDI], ver)
	if cdi, err = writeChildStatus(ctx, v.CDIs, cdi, func(o *cdiv1.CDI) any { return &o.Status }); err != nil {
		return nil, nil, err
	}
	cdi.SetGroupVersionKind(cdiv1.SchemeGroupVersion.WithKind("CDI"))
	ref(cdi)

	nac, err := ensureChild(ctx, c, hc, kindCNAO, v.NetworkAddonsConfigs, want.CNAO, func(o *cnaov1.NetworkAddonsConfig) any { return &o.Spec })
	if err != nil {
		return nil, nil, err
	}
	nac.Status = operatorStatus(nac.Status, nac.Generation, byKind[kindCNAO], ver)
	if nac, err = writeChildStatus(ctx, v.NetworkAddonsConfigs, nac, func(o *cnaov1.NetworkAddonsConfig) any { return &o.Status }); err != nil {
		return nil, nil, err
	}
	nac.SetGroupVersionKind(cnaov1.SchemeGroupVersion.WithKind("NetworkAddonsConfig"))
	ref(nac)

	ssp, err := ensureChild(ctx, c, hc, kindSSP, v.SSPs, want.SSP, func(o *sspv1beta2.SSP) any { return &o.Spec })
	if err != nil {
		return nil, nil, err
	}
	ssp.Status = operatorStatus(ssp.Status, ssp.Generation, byKind[kindSSP], ver)
	if ssp, err = writeChildStatus(ctx, v.SSPs, ssp, func(o *sspv1beta2.SSP) any { return &o.Status }); err != nil {
		return nil, nil, err
	}
	ssp.SetGroupVersionKind(sspv1beta2.SchemeGroupVersion.WithKind("SSP"))
	ref(ssp)

	if want.HPP == nil {
		if err := deleteOwned(ctx, v.HostPathProvisioners, "", HPPName, hc); err != nil {
			return nil, nil, err
		}
		return related, health, nil
	}
	hpp, err := ensureChild(ctx, c, hc, kindHPP, v.HostPathProvisioners, want.HPP, func(o *hppv1beta1.HostPathProvisioner) any { return &o.Spec })
	if err != nil {
		return nil, nil, err
	}
	// The HostPathProvisioner's status is its own controller's (package
	// hostpathprovisioner, from the node agents' pool reports): the child
	// is judged from it.
	for i := range health {
		if health[i].Kind == kindHPP {
			health[i] = hppHealth(hpp)
		}
	}
	hpp.SetGroupVersionKind(hppv1beta1.SchemeGroupVersion.WithKind("HostPathProvisioner"))
	ref(hpp)
	return related, health, nil
}

// ensureChild creates the child or brings its spec, labels, managed
// annotations and owner back to the rendering. A difference on a child
// whose rendering has not changed since the brain last wrote it is a
// manual edit: it is reverted, counted and reported as an event.
func ensureChild[T client.Object](ctx context.Context, c *Controller, hc *hcov1beta1.HyperConverged, kind string, res client.Resource[T], desired T, specOf func(T) any) (T, error) {
	log := c.cfg.Log.With("kind", kind, "namespace", desired.GetNamespace(), "name", desired.GetName())
	want := normalize(desired)
	hash := specHash(specOf(want))
	existing, err := res.Get(ctx, desired.GetNamespace(), desired.GetName())
	if apierrors.IsNotFound(err) {
		created, err := res.Create(ctx, want)
		if err != nil {
			return created, fmt.Errorf("create %s %s: %w", kind, desired.GetName(), err)
		}
		c.remember(kind, hash)
		log.Info("created child")
		return created, nil
	}
	if err != nil {
		return existing, fmt.Errorf("get %s %s: %w", kind, desired.GetName(), err)
	}
	specSame := apiequality.Semantic.DeepEqual(specOf(want), specOf(existing))
	if specSame && metaMatches(want, existing) {
		c.remember(kind, hash)
		return existing, nil
	}
	updated := existing.DeepCopyObject().(T)
	data, _ := json.Marshal(specOf(want))
	if err := replaceJSON(specOf(updated), data); err != nil {
		return existing, err
	}
	mergeMeta(want, updated)
	out, err := res.Update(ctx, updated)
	if err != nil {
		return existing, fmt.Errorf("update %s %s: %w", kind, desired.GetName(), err)
	}
	if c.lastHash(kind) == hash {
		c.countRevert(kind)
		c.recorder.Eventf(hc, corev1.EventTypeWarning, "Overwritten", "Overwritten %s %s", kind, desired.GetName())
		log.Warn("reverted manual edit of child", "spec", !specSame)
	} else {
		log.Info("updated child to its rendering")
	}
	c.remember(kind, hash)
	return out, nil
}

// metaMatches reports whether existing carries want's labels, managed
// annotations and owner references.
func metaMatches(want, existing client.Object) bool {
	for k, v := range want.GetLabels() {
		if got, ok := existing.GetLabels()[k]; !ok || got != v {
			return false
		}
	}
	for _, k := range managedAnnotations {
		w, wok := want.GetAnnotations()[k]
		e, eok := existing.GetAnnotations()[k]
		if wok != eok || w != e {
			return false
		}
	}
	for _, ref := range want.GetOwnerReferences() {
		if !slices.ContainsFunc(existing.GetOwnerReferences(), func(r metav1.OwnerReference) bool {
			return r.UID == ref.UID && r.Controller != nil && *r.Controller
		}) {
			return false
		}
	}
	return true
}

// mergeMeta puts want's labels, managed annotations and owner into obj,
// keeping what others added.
func mergeMeta(want, obj client.Object) {
	labels := obj.GetLabels()
	if labels == nil {
		labels = map[string]string{}
	}
	for k, v := range want.GetLabels() {
		labels[k] = v
	}
	obj.SetLabels(labels)
	ann := obj.GetAnnotations()
	if ann == nil {
		ann = map[string]string{}
	}
	for _, k := range managedAnnotations {
		if v, ok := want.GetAnnotations()[k]; ok {
			ann[k] = v
		} else {
			delete(ann, k)
		}
	}
	obj.SetAnnotations(ann)
	if refs := want.GetOwnerReferences(); len(refs) > 0 {
		obj.SetOwnerReferences(refs)
	}
}

// writeChildStatus writes obj's status when it differs from the stored one.
func writeChildStatus[T client.Object](ctx context.Context, res client.Resource[T], obj T, statusOf func(T) any) (T, error) {
	stored, err := res.Get(ctx, obj.GetNamespace(), obj.GetName())
	if err != nil {
		return obj, fmt.Errorf("get %s: %w", obj.GetName(), err)
	}
	if jsonEqual(statusOf(stored), statusOf(obj)) {
		return stored, nil
	}
	data, _ := json.Marshal(statusOf(obj))
	if err := replaceJSON(statusOf(stored), data); err != nil {
		return obj, err
	}
	out, err := res.UpdateStatus(ctx, stored)
	if err != nil {
		return obj, fmt.Errorf("update status of %s: %w", obj.GetName(), err)
	}
	return out, nil
}

// deleteOwned deletes a child if it exists and belongs to hc.
func deleteOwned[T client.Object](ctx context.Context, res client.Resource[T], ns, name string, hc *hcov1beta1.HyperConverged) error {
	obj, err := res.Get(ctx, ns, name)
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("get %s: %w", name, err)
	}
	owned := obj.GetLabels()[LabelApp] == hc.Name && obj.GetLabels()[LabelManagedBy] == ManagedBy
	if !owned {
		return nil
	}
	if err := res.Delete(ctx, ns, name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete %s: %w", name, err)
	}
	return nil
}

func (c *Controller) remember(kind, hash string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.lastApplied[kind] = hash
}

func (c *Controller) lastHash(kind string) string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.lastApplied[kind]
}

func (c *Controller) countRevert(kind string) {
	c.mu.Lock()
	c.reverts[kind]++
	c.mu.Unlock()
	c.overwritten.With(kind).Inc()
}

func specHash(spec any) string {
	data, _ := json.Marshal(spec)
	sum := sha256.Sum256(data)
	return hex.EncodeToString(sum[:])
}

func jsonEqual(a, b any) bool {
	x, err1 := json.Marshal(a)
	y, err2 := json.Marshal(b)
	return err1 == nil && err2 == nil && bytes.Equal(x, y)
}

// Workloads counts what blocks an uninstall: VMs, VMIs and DataVolumes in
// every namespace (one of each is enough to know).
func Workloads(ctx context.Context, v *client.Set) (vms, vmis, dvs int, err error) {
	one := metav1.ListOptions{Limit: 1}
	l1, err := v.VMs.List(ctx, "", one)
	if err != nil {
		return 0, 0, 0, fmt.Errorf("list vms: %w", err)
	}
	l2, err := v.VMIs.List(ctx, "", one)
	if err != nil {
		return 0, 0, 0, fmt.Errorf("list vmis: %w", err)
	}
	l3, err := v.DataVolumes.List(ctx, "", one)
	if err != nil {
		return 0, 0, 0, fmt.Errorf("list datavolumes: %w", err)
	}
	return len(l1), len(l2), len(l3), nil
}

// RemoveWorkloads deletes every VM, VMI and DataVolume (the
// RemoveWorkloads uninstall strategy).
func RemoveWorkloads(ctx context.Context, v *client.Set) error {
	vms, err := v.VMs.List(ctx, "", metav1.ListOptions{})
	if err != nil {
		return fmt.Errorf("list vms: %w", err)
	}
	for _, o := range vms {
		if err := v.VMs.Delete(ctx, o.Namespace, o.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("delete vm %s/%s: %w", o.Namespace, o.Name, err)
		}
	}
	vmis, err := v.VMIs.List(ctx, "", metav1.ListOptions{})
	if err != nil {
		return fmt.Errorf("list vmis: %w", err)
	}
	for _, o := range vmis {
		if err := v.VMIs.Delete(ctx, o.Namespace, o.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("delete vmi %s/%s: %w", o.Namespace, o.Name, err)
		}
	}
	dvs, err := v.DataVolumes.List(ctx, "", metav1.ListOptions{})
	if err != nil {
		return fmt.Errorf("list datavolumes: %w", err)
	}
	for _, o := range dvs {
		if err := v.DataVolumes.Delete(ctx, o.Namespace, o.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("delete datavolume %s/%s: %w", o.Namespace, o.Name, err)
		}
	}
	return nil
}

// uninstall runs when the HyperConverged is being deleted: under
// BlockUninstallIfWorkloadsExist it waits while workloads exist (the
// webhook normally refuses the deletion before this); under
// RemoveWorkloads it deletes them; then it deletes the children and drops
// the finalizer.
func (c *Controller) uninstall(ctx context.Context, hc *hcov1beta1.HyperConverged, log *slog.Logger) (time.Duration, error) {
	if !slices.Contains(hc.Finalizers, Finalizer) {
		return 0, nil
	}
	v := c.cfg.Virt
	if hc.Spec.UninstallStrategy == hcov1beta1.RemoveWorkloads {
		if err := RemoveWorkloads(ctx, v); err != nil {
			return 0, err
		}
	} else {
		vms, vmis, dvs, err := Workloads(ctx, v)
		if err != nil {
			return 0, err
		}
		if msg := blockingMessage(vms, vmis, dvs); msg != "" {
			log.Warn("uninstall blocked", "reason", msg)
			return 10 * time.Second, c.writeStatus(ctx, hc, failedReconcile(reasonUninstallBlocked, msg), nil)
		}
	}
	for _, del := range []func() error{
		func() error { return deleteOwned(ctx, v.KubeVirts, hc.Namespace, KubeVirtName, hc) },
		func() error { return deleteOwned(ctx, v.CDIs, "", CDIName, hc) },
		func() error { return deleteOwned(ctx, v.NetworkAddonsConfigs, "", CNAOName, hc) },
		func() error { return deleteOwned(ctx, v.SSPs, hc.Namespace, SSPName, hc) },
		func() error { return deleteOwned(ctx, v.HostPathProvisioners, "", HPPName, hc) },
	} {
		if err := del(); err != nil {
			return 0, err
		}
	}
	upd := hc.DeepCopyObject().(*hcov1beta1.HyperConverged)
	upd.Finalizers = slices.DeleteFunc(upd.Finalizers, func(f string) bool { return f == Finalizer })
	if _, err := v.HyperConvergeds.Update(ctx, upd); err != nil && !apierrors.IsNotFound(err) {
		return 0, fmt.Errorf("remove finalizer: %w", err)
	}
	log.Info("uninstalled")
	return 0, nil
}
