package admission

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	kubevirtv1 "kubevirt.io/api/core/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/api/featuregate"
	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/certs"
	"github.com/nodevirt/nodevirt/clusterbrain/rbac"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

func vmiWith(ns, name string, mem string, edit func(*kubevirtv1.VirtualMachineInstance)) *kubevirtv1.VirtualMachineInstance {
	q := resource.MustParse(mem)
	vmi := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: kubevirtv1.VirtualMachineInstanceSpec{
			Domain: kubevirtv1.DomainSpec{Memory: &kubevirtv1.Memory{Guest: &q},
				Devices: kubevirtv1.Devices{Disks: []kubevirtv1.Disk{{Name: "root"}}}},
			Volumes: []kubevirtv1.Volume{{Name: "root", VolumeSource: kubevirtv1.VolumeSource{
				ContainerDisk: &kubevirtv1.ContainerDiskSource{Image: "quay.io/containerdisks/fedora:41"}}}},
		}}
	if edit != nil {
		edit(vmi)
	}
	return vmi
}

func hostDiskVMI(vmi *kubevirtv1.VirtualMachineInstance) {
	vmi.Spec.Domain.Devices.Disks = append(vmi.Spec.Domain.Devices.Disks, kubevirtv1.Disk{Name: "host"})
	vmi.Spec.Volumes = append(vmi.Spec.Volumes, kubevirtv1.Volume{Name: "host", VolumeSource: kubevirtv1.VolumeSource{
		HostDisk: &kubevirtv1.HostDisk{Path: "/etc/shadow", Type: kubevirtv1.HostDiskExists}}})
}

// as returns clients acting as user in groups (the test's administrator
// impersonates them).
func as(t *testing.T, user string, groups ...string) *client.Set {
	t.Helper()
	rc := rest.CopyConfig(controlplane.Shared(t).RestConfig)
	rc.Impersonate = rest.ImpersonationConfig{UserName: user, Groups: groups}
	s, err := client.NewSet(rc)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// A hostDisk (here /etc/shadow) is refused with KubeVirt's message while
// the KubeVirt CR does not turn the HostDisk gate on, on VMIs and VMs, and
// admitted once it does.
func TestHostDiskNeedsTheFeatureGate(t *testing.T) {
	e := setup(t)
	serve(t, e, certs.Config{})
	ctx := context.Background()

	_, err := e.virt.VMIs.Create(ctx, vmiWith(e.ns, "shadow", "64Mi", hostDiskVMI))
	if err == nil || !strings.Contains(err.Error(), "spec.volumes[1]: Forbidden: "+HostDiskGateMessage) {
		t.Fatalf("hostDisk vmi without the gate: %v", err)
	}
	vm := vmWith(e.ns, "shadow-vm", func(s *kubevirtv1.VirtualMachineInstanceSpec) {
		v := &kubevirtv1.VirtualMachineInstance{Spec: *s}
		hostDiskVMI(v)
		*s = v.Spec
	})
	if _, err := e.virt.VMs.Create(ctx, vm); err == nil || !strings.Contains(err.Error(), "spec.template.spec.volumes[1]: Forbidden: "+HostDiskGateMessage) {
		t.Fatalf("hostDisk vm without the gate: %v", err)
	}

	// A KubeVirt CR listing the gate as disabled too keeps it off.
	kv := &kubevirtv1.KubeVirt{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "kubevirt"},
		Spec: kubevirtv1.KubeVirtSpec{Configuration: kubevirtv1.KubeVirtConfiguration{DeveloperConfiguration: &kubevirtv1.DeveloperConfiguration{
			FeatureGates: []string{featuregate.HostDisk}, DisabledFeatureGates: []string{featuregate.HostDisk}}}}}
	kv, err = e.virt.KubeVirts.Create(ctx, kv)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.virt.KubeVirts.Delete(context.Background(), e.ns, kv.Name, metav1.DeleteOptions{}) })
	time.Sleep(time.Second) // the informer's view of the CR
	if _, err := e.virt.VMIs.Create(ctx, vmiWith(e.ns, "shadow", "64Mi", hostDiskVMI)); err == nil {
		t.Fatal("hostDisk admitted with the gate disabled")
	}
	kv.Spec.Configuration.DeveloperConfiguration.DisabledFeatureGates = nil
	if _, err := e.virt.KubeVirts.Update(ctx, kv); err != nil {
		t.Fatal(err)
	}
	testkit.PollEvery(t, 100*time.Millisecond, 15*time.Second, "hostDisk admitted with the gate on", func() (bool, error) {
		_, err := e.virt.VMIs.Create(ctx, vmiWith(e.ns, "shadow", "64Mi", hostDiskVMI))
		return err == nil, err
	})
}

// Users cannot change a VMI's spec or its reserved labels, nor create one
// bound to a node; the brain and the node agents can.
func TestVMIUpdatesByUsers(t *testing.T) {
	e := setup(t)
	serve(t, e, certs.Config{})
	ctx := context.Background()
	if err := rbac.EnsureDaemons(ctx, e.kube); err != nil {
		t.Fatal(err)
	}

	pinned := vmiWith(e.ns, "pinned", "64Mi", func(v *kubevirtv1.VirtualMachineInstance) {
		v.Labels = map[string]string{kubevirtv1.NodeNameLabel: "node-a"}
	})
	if _, err := e.virt.VMIs.Create(ctx, pinned.DeepCopy()); err == nil || !strings.Contains(err.Error(), LabelsCreationMessage) {
		t.Fatalf("user's vmi with %s: %v", kubevirtv1.NodeNameLabel, err)
	}
	brain := as(t, identity.BrainUser, identity.BrainGroup)
	if _, err := brain.VMIs.Create(ctx, pinned.DeepCopy()); err != nil {
		t.Fatalf("the brain's vmi with %s: %v", kubevirtv1.NodeNameLabel, err)
	}

	// Nor through a VM's template, whose labels the brain copies.
	vm := vmWith(e.ns, "pinned-vm", nil)
	vm.Spec.Template.ObjectMeta.Labels = map[string]string{kubevirtv1.NodeNameLabel: "node-a"}
	if _, err := e.virt.VMs.Create(ctx, vm); err == nil || !strings.Contains(err.Error(), "spec.template.metadata.labels: Forbidden: "+LabelsCreationMessage) {
		t.Errorf("user's vm template with %s: %v", kubevirtv1.NodeNameLabel, err)
	}

	vmi, err := e.virt.VMIs.Create(ctx, vmiWith(e.ns, "mine", "64Mi", nil))
	if err != nil {
		t.Fatal(err)
	}
	update := func(c *client.Set, edit func(*kubevirtv1.VirtualMachineInstance)) error {
		cur, err := c.VMIs.Get(ctx, e.ns, vmi.Name)
		if err != nil {
			return err
		}
		edit(cur)
		_, err = c.VMIs.Update(ctx, cur)
		return err
	}
	bigger := func(v *kubevirtv1.VirtualMachineInstance) {
		q := resource.MustParse("4Gi")
		v.Spec.Domain.Memory.Guest = &q
	}
	bind := func(v *kubevirtv1.VirtualMachineInstance) {
		if v.Labels == nil {
			v.Labels = map[string]string{}
		}
		v.Labels[kubevirtv1.NodeNameLabel] = "node-b"
	}
	if err := update(e.virt, bigger); err == nil || !strings.Contains(err.Error(), SpecUpdateMessage) || !apierrors.IsInvalid(err) {
		t.Errorf("user's spec change: %v", err)
	}
	if err := update(e.virt, bind); err == nil || !strings.Contains(err.Error(), LabelsUpdateMessage) {
		t.Errorf("user's node label: %v", err)
	}
	if err := update(e.virt, func(v *kubevirtv1.VirtualMachineInstance) {
		v.Labels = map[string]string{"app": "web"}
		v.Annotations = map[string]string{"note": "mine"}
	}); err != nil {
		t.Errorf("user's own label and annotation: %v", err)
	}
	if err := update(brain, bind); err != nil {
		t.Errorf("the brain binding the vmi: %v", err)
	}
	// Once bound, the user cannot move it or unbind it.
	if err := update(e.virt, func(v *kubevirtv1.VirtualMachineInstance) { delete(v.Labels, kubevirtv1.NodeNameLabel) }); err == nil ||
		!strings.Contains(err.Error(), LabelsUpdateMessage) {
		t.Errorf("user removing the node label: %v", err)
	}
	node := as(t, identity.NodeUser("node-b"), identity.NodesGroup)
	if err := update(node, func(v *kubevirtv1.VirtualMachineInstance) { v.Finalizers = append(v.Finalizers, "nodevirt.io/test") }); err != nil {
		t.Errorf("node agent update: %v", err)
	}
	_ = update(node, func(v *kubevirtv1.VirtualMachineInstance) { v.Finalizers = nil })
}

func quotaOf(ns, name string, hard corev1.ResourceList) *corev1.ResourceQuota {
	return &corev1.ResourceQuota{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, Spec: corev1.ResourceQuotaSpec{Hard: hard}}
}

// waitRefused creates vmi until it is refused with want (the informers see
// a new quota or LimitRange after a moment), deleting what it created
// meanwhile, and returns the refusal.
func waitRefused(t *testing.T, e env, vmi *kubevirtv1.VirtualMachineInstance, want string) error {
	t.Helper()
	var last error
	ctx := context.Background()
	err := testkit.Wait(100*time.Millisecond, 15*time.Second, "a refusal", func() (bool, error) {
		_, last = e.virt.VMIs.Create(ctx, vmi.DeepCopy())
		if last == nil {
			_ = e.virt.VMIs.Delete(ctx, vmi.Namespace, vmi.Name, metav1.DeleteOptions{})
			return false, nil
		}
		return strings.Contains(last.Error(), want), nil
	})
	if err != nil {
		return fmt.Errorf("never refused with %q (last: %v)", want, last)
	}
	return last
}

// VMIs count against the namespace's ResourceQuota as their launcher pods
// would, refused with the quota's message, and never past it when created
// at once.
func TestVMIsCountAgainstResourceQuota(t *testing.T) {
	e := setup(t)
	serve(t, e, certs.Config{})
	ctx := context.Background()

	if _, err := e.kube.CoreV1().ResourceQuotas(e.ns).Create(ctx, quotaOf(e.ns, "vms", corev1.ResourceList{
		corev1.ResourceRequestsMemory: resource.MustParse("1Gi"), corev1.ResourceRequestsCPU: resource.MustParse("2")}), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	big := vmiWith(e.ns, "big", "1536Mi", nil)
	err := waitRefused(t, e, big, "exceeded quota")
	if err == nil || !strings.Contains(err.Error(), "exceeded quota: vms, requested: requests.memory=1536Mi, used: requests.memory=0, limited: requests.memory=1Gi") ||
		!apierrors.IsForbidden(err) {
		t.Fatalf("over-quota vmi: %v", err)
	}

	// Ten VMIs of 256Mi at once: exactly four fit.
	var wg sync.WaitGroup
	errs := make([]error, 10)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = e.virt.VMIs.Create(ctx, vmiWith(e.ns, fmt.Sprintf("vm-%d", i), "256Mi", nil))
		}()
	}
	wg.Wait()
	admitted := 0
	for _, err := range errs {
		switch {
		case err == nil:
			admitted++
		case !strings.Contains(err.Error(), "exceeded quota: vms, requested: requests.memory=256Mi, used: requests.memory=1Gi, limited: requests.memory=1Gi"):
			t.Errorf("unexpected refusal: %v", err)
		}
	}
	if admitted != 4 {
		t.Fatalf("%d of 10 VMIs of 256Mi admitted under a 1Gi quota, want 4", admitted)
	}
	// A VMI that ended frees its share.
	done, err := e.virt.VMIs.Get(ctx, e.ns, firstAdmitted(errs))
	if err != nil {
		t.Fatal(err)
	}
	done.Status.Phase = kubevirtv1.Succeeded
	if _, err := e.virt.VMIs.UpdateStatus(ctx, done); err != nil {
		t.Fatal(err)
	}
	if _, err := e.virt.VMIs.Create(ctx, vmiWith(e.ns, "after", "256Mi", nil)); err != nil {
		t.Fatalf("vmi after one ended: %v", err)
	}
	// CPU: a vCPU without a request is charged 100m (allocation ratio 10),
	// so the four live VMIs use 400m; an explicit request counts as is.
	cpu := vmiWith(e.ns, "cpu", "16Mi", func(v *kubevirtv1.VirtualMachineInstance) {
		v.Spec.Domain.Resources.Requests = corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("1900m")}
	})
	if _, err := e.virt.VMIs.Create(ctx, cpu); err == nil || !strings.Contains(err.Error(),
		"exceeded quota: vms, requested: requests.cpu=1900m,requests.memory=16Mi, used: requests.cpu=400m,requests.memory=1Gi, limited: requests.cpu=2,requests.memory=1Gi") {
		t.Fatalf("cpu over quota: %v", err)
	}
}

func firstAdmitted(errs []error) string {
	for i, err := range errs {
		if err == nil {
			return fmt.Sprintf("vm-%d", i)
		}
	}
	return ""
}

// LimitRange container defaults fill a VMI's limits, and a quota on limits
// refuses a VMI without them, as for pods.
func TestLimitRangeDefaultsAndLimitQuotas(t *testing.T) {
	e := setup(t)
	serve(t, e, certs.Config{})
	ctx := context.Background()

	if _, err := e.kube.CoreV1().ResourceQuotas(e.ns).Create(ctx, quotaOf(e.ns, "limits", corev1.ResourceList{
		corev1.ResourceLimitsMemory: resource.MustParse("1Gi")}), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := waitRefused(t, e, vmiWith(e.ns, "nolimit", "64Mi", nil), "failed quota"); err == nil ||
		!strings.Contains(err.Error(), "failed quota: limits: must specify limits.memory") {
		t.Fatalf("vmi without a limit: %v", err)
	}
	lr := &corev1.LimitRange{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "defaults"}, Spec: corev1.LimitRangeSpec{
		Limits: []corev1.LimitRangeItem{{Type: corev1.LimitTypeContainer,
			Default: corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("512Mi"), corev1.ResourceCPU: resource.MustParse("1")},
			Max:     corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("768Mi")}}}}}
	if _, err := e.kube.CoreV1().LimitRanges(e.ns).Create(ctx, lr, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var got *kubevirtv1.VirtualMachineInstance
	testkit.PollEvery(t, 100*time.Millisecond, 15*time.Second, "the vmi admitted with the LimitRange's default limit", func() (bool, error) {
		var err error
		got, err = e.virt.VMIs.Create(ctx, vmiWith(e.ns, "defaulted", "64Mi", nil))
		return err == nil, err
	})
	if l := got.Spec.Domain.Resources.Limits; l.Memory().String() != "512Mi" || l.Cpu().String() != "1" {
		t.Errorf("limits %v, want the LimitRange's defaults", l)
	}
	// 512Mi + 512Mi fits 1Gi exactly; a third does not.
	if _, err := e.virt.VMIs.Create(ctx, vmiWith(e.ns, "second", "64Mi", nil)); err != nil {
		t.Fatalf("second vmi: %v", err)
	}
	_, err := e.virt.VMIs.Create(ctx, vmiWith(e.ns, "third", "64Mi", nil))
	if err == nil || !strings.Contains(err.Error(), "exceeded quota: limits, requested: limits.memory=512Mi, used: limits.memory=1Gi, limited: limits.memory=1Gi") {
		t.Fatalf("third vmi: %v", err)
	}
	huge := vmiWith(e.ns, "huge", "64Mi", func(v *kubevirtv1.VirtualMachineInstance) {
		v.Spec.Domain.Resources.Limits = corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("900Mi")}
	})
	if _, err := e.virt.VMIs.Create(ctx, huge); err == nil || !strings.Contains(err.Error(), "maximum memory usage per Container is 768Mi, but limit is 900Mi") {
		t.Fatalf("vmi over the LimitRange max: %v", err)
	}
}

// A create the API server refuses after the quota webhook admitted it (here
// its own quota admission, for a quota whose status lacks the object
// count) does not keep holding quota against a retry of the same VMI.
func TestRefusedCreateRetriedUnderQuota(t *testing.T) {
	e := setup(t)
	serve(t, e, certs.Config{})
	ctx := context.Background()
	hard := corev1.ResourceList{corev1.ResourceRequestsMemory: resource.MustParse("200Mi"),
		"count/virtualmachineinstances.kubevirt.io": resource.MustParse("5")}
	rq, err := e.kube.CoreV1().ResourceQuotas(e.ns).Create(ctx, quotaOf(e.ns, "both", hard), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// What a quota controller that has not counted VMIs yet leaves.
	rq.Status = corev1.ResourceQuotaStatus{Hard: hard, Used: corev1.ResourceList{corev1.ResourceRequestsMemory: resource.MustParse("0")}}
	if _, err := e.kube.CoreV1().ResourceQuotas(e.ns).UpdateStatus(ctx, rq, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := waitRefused(t, e, vmiWith(e.ns, "retried", "1536Mi", nil), "exceeded quota: both"); err == nil {
		t.Fatal("the quota never took effect")
	}
	for i := range 3 {
		_, err := e.virt.VMIs.Create(ctx, vmiWith(e.ns, "retried", "128Mi", nil))
		if err == nil || !strings.Contains(err.Error(), "status unknown for quota: both") {
			t.Fatalf("attempt %d: %v, want the API server's own refusal", i, err)
		}
	}
}

// DataVolumes are validated at admission as CDI's webhook does: a
// DataVolume with two sources or an http source that is not http(s) is
// refused, naming the field; a valid one is created.
func TestDataVolumeValidation(t *testing.T) {
	e := setup(t)
	serve(t, e, certs.Config{}, RegisterDataVolumes)
	ctx := context.Background()
	size := corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}
	dv := func(name string, src *cdiv1.DataVolumeSource) *cdiv1.DataVolume {
		return &cdiv1.DataVolume{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name},
			Spec: cdiv1.DataVolumeSpec{Source: src, Storage: &cdiv1.StorageSpec{Resources: corev1.VolumeResourceRequirements{Requests: size}}}}
	}
	cases := []struct {
		dv   *cdiv1.DataVolume
		want string
	}{
		{dv("two", &cdiv1.DataVolumeSource{Blank: &cdiv1.DataVolumeBlankImage{}, Upload: &cdiv1.DataVolumeSourceUpload{}}),
			"spec.source: Invalid value: 2: exactly one data volume source must be set"},
		{dv("file", &cdiv1.DataVolumeSource{HTTP: &cdiv1.DataVolumeSourceHTTP{URL: "file:///etc/shadow"}}),
			`spec.source.http.url.scheme: Unsupported value: "file"`},
	}
	var err error
	for _, c := range cases {
		err = testkit.Wait(100*time.Millisecond, 15*time.Second, c.dv.Name+" refused", func() (bool, error) {
			_, err := e.virt.DataVolumes.Create(ctx, c.dv)
			if err == nil {
				_ = e.virt.DataVolumes.Delete(ctx, e.ns, c.dv.Name, metav1.DeleteOptions{})
				return false, nil
			}
			return strings.Contains(err.Error(), c.want), nil
		})
		if err != nil {
			t.Errorf("%s never refused with %q", c.dv.Name, c.want)
		}
	}
	if _, err := e.virt.DataVolumes.Create(ctx, dv("blank", &cdiv1.DataVolumeSource{Blank: &cdiv1.DataVolumeBlankImage{}})); err != nil {
		t.Errorf("valid datavolume: %v", err)
	}
}
