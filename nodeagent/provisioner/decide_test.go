package provisioner

import (
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	hostpath "github.com/nodevirt/nodevirt/csi"
)

func class(name, provisioner string) *storagev1.StorageClass {
	wffc := storagev1.VolumeBindingWaitForFirstConsumer
	return &storagev1.StorageClass{
		ObjectMeta:        metav1.ObjectMeta{Name: name},
		Provisioner:       provisioner,
		VolumeBindingMode: &wffc,
		Parameters:        map[string]string{"storagePool": "fast", "csi.storage.k8s.io/fstype": "ext4"},
	}
}

func claim(mut ...func(*corev1.PersistentVolumeClaim)) *corev1.PersistentVolumeClaim {
	sc := "hostpath-csi"
	pvc := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{
			Namespace: "ns", Name: "disk", UID: "1234",
			Annotations: map[string]string{AnnSelectedNode: "node-a"},
		},
		Spec: corev1.PersistentVolumeClaimSpec{
			StorageClassName: &sc,
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{
				corev1.ResourceStorage: resource.MustParse("64Mi"),
			}},
		},
		Status: corev1.PersistentVolumeClaimStatus{Phase: corev1.ClaimPending},
	}
	for _, m := range mut {
		m(pvc)
	}
	return pvc
}

func TestPlanClaim(t *testing.T) {
	block := corev1.PersistentVolumeBlock
	now := metav1.Now()
	csiClass := class("hostpath-csi", CSIProvisionerName)
	legacyClass := class("hostpath-csi", LegacyProvisionerName)
	for _, tc := range []struct {
		name      string
		pvc       *corev1.PersistentVolumeClaim
		sc        *storagev1.StorageClass
		provision bool
		kind      kind
		errLike   string
	}{
		{name: "selected for this node", pvc: claim(), sc: csiClass, provision: true, kind: kindCSI},
		{name: "legacy class", pvc: claim(), sc: legacyClass, provision: true, kind: kindLegacy},
		{name: "other node", pvc: claim(func(c *corev1.PersistentVolumeClaim) { c.Annotations[AnnSelectedNode] = "node-b" }), sc: csiClass},
		{name: "no node yet", pvc: claim(func(c *corev1.PersistentVolumeClaim) { delete(c.Annotations, AnnSelectedNode) }), sc: csiClass},
		{name: "legacy provisionOnNode", sc: legacyClass, provision: true, kind: kindLegacy, pvc: claim(func(c *corev1.PersistentVolumeClaim) {
			c.Annotations = map[string]string{AnnLegacyProvisionOnNode: "node-a"}
		})},
		{name: "provisionOnNode is legacy only", sc: csiClass, pvc: claim(func(c *corev1.PersistentVolumeClaim) {
			c.Annotations = map[string]string{AnnLegacyProvisionOnNode: "node-a"}
		})},
		{name: "foreign class", pvc: claim(), sc: class("hostpath-csi", "ebs.csi.aws.com")},
		{name: "missing class", pvc: claim(), sc: nil},
		{name: "bound", pvc: claim(func(c *corev1.PersistentVolumeClaim) { c.Spec.VolumeName = "pv-1" }), sc: csiClass},
		{name: "being deleted", pvc: claim(func(c *corev1.PersistentVolumeClaim) { c.DeletionTimestamp = &now }), sc: csiClass},
		{name: "lost", pvc: claim(func(c *corev1.PersistentVolumeClaim) { c.Status.Phase = corev1.ClaimLost }), sc: csiClass},
		{name: "no size", sc: csiClass, provision: true, kind: kindCSI, errLike: "no storage size", pvc: claim(func(c *corev1.PersistentVolumeClaim) {
			c.Spec.Resources.Requests = nil
		})},
		{name: "read-write-many", sc: csiClass, provision: true, kind: kindCSI, errLike: "ReadWriteMany", pvc: claim(func(c *corev1.PersistentVolumeClaim) {
			c.Spec.AccessModes = []corev1.PersistentVolumeAccessMode{corev1.ReadWriteMany}
		})},
		{name: "block on csi", sc: csiClass, provision: true, kind: kindCSI, pvc: claim(func(c *corev1.PersistentVolumeClaim) { c.Spec.VolumeMode = &block })},
		{name: "block on legacy", sc: legacyClass, provision: true, kind: kindLegacy, errLike: "filesystem volumes only", pvc: claim(func(c *corev1.PersistentVolumeClaim) {
			c.Spec.VolumeMode = &block
		})},
		{name: "snapshot source", sc: csiClass, provision: true, kind: kindCSI, pvc: claim(func(c *corev1.PersistentVolumeClaim) {
			g := "snapshot.storage.k8s.io"
			c.Spec.DataSource = &corev1.TypedLocalObjectReference{APIGroup: &g, Kind: "VolumeSnapshot", Name: "s"}
		})},
		{name: "snapshot source on legacy", sc: legacyClass, provision: true, kind: kindLegacy, errLike: "does not restore snapshots", pvc: claim(func(c *corev1.PersistentVolumeClaim) {
			g := "snapshot.storage.k8s.io"
			c.Spec.DataSource = &corev1.TypedLocalObjectReference{APIGroup: &g, Kind: "VolumeSnapshot", Name: "s"}
		})},
		{name: "snapshot in another namespace", sc: csiClass, provision: true, kind: kindCSI, errLike: "another namespace", pvc: claim(func(c *corev1.PersistentVolumeClaim) {
			g, other := "snapshot.storage.k8s.io", "elsewhere"
			c.Spec.DataSourceRef = &corev1.TypedObjectReference{APIGroup: &g, Kind: "VolumeSnapshot", Name: "s", Namespace: &other}
		})},
		{name: "foreign data source", sc: csiClass, provision: true, kind: kindCSI, errLike: "not supported", pvc: claim(func(c *corev1.PersistentVolumeClaim) {
			g := "cdi.kubevirt.io"
			c.Spec.DataSourceRef = &corev1.TypedObjectReference{APIGroup: &g, Kind: "VolumeImportSource", Name: "s"}
		})},
		{name: "clone source", sc: csiClass, provision: true, kind: kindCSI, pvc: claim(func(c *corev1.PersistentVolumeClaim) {
			c.Spec.DataSource = &corev1.TypedLocalObjectReference{Kind: "PersistentVolumeClaim", Name: "golden"}
		})},
	} {
		t.Run(tc.name, func(t *testing.T) {
			plan := planClaim(tc.pvc, tc.sc, "node-a")
			if plan.Provision != tc.provision {
				t.Fatalf("provision = %v (%s), want %v", plan.Provision, plan.Reason, tc.provision)
			}
			if !plan.Provision {
				if plan.Reason == "" {
					t.Error("a skipped claim needs a reason")
				}
				return
			}
			if plan.Kind != tc.kind {
				t.Errorf("kind %v, want %v", plan.Kind, tc.kind)
			}
			switch {
			case tc.errLike == "" && plan.Err != nil:
				t.Errorf("unexpected error %v", plan.Err)
			case tc.errLike != "" && (plan.Err == nil || !strings.Contains(plan.Err.Error(), tc.errLike)):
				t.Errorf("error %v, want one mentioning %q", plan.Err, tc.errLike)
			}
		})
	}
}

func TestCreateRequest(t *testing.T) {
	block := corev1.PersistentVolumeBlock
	pvc := claim(func(c *corev1.PersistentVolumeClaim) { c.Spec.VolumeMode = &block })
	req, err := createRequest(pvc, class("c", CSIProvisionerName), "node-a", "src-vol", "")
	if err != nil {
		t.Fatal(err)
	}
	if req.GetName() != "pvc-1234" || req.GetCapacityRange().GetRequiredBytes() != 64<<20 {
		t.Errorf("name %q size %d", req.GetName(), req.GetCapacityRange().GetRequiredBytes())
	}
	if req.GetVolumeCapabilities()[0].GetBlock() == nil {
		t.Error("block claim did not ask for a block volume")
	}
	if _, leaked := req.GetParameters()["csi.storage.k8s.io/fstype"]; leaked || req.GetParameters()["storagePool"] != "fast" {
		t.Errorf("parameters %v: want the pool and no sidecar parameters", req.GetParameters())
	}
	if got := req.GetAccessibilityRequirements().GetRequisite()[0].GetSegments()[hostpath.TopologyKey]; got != "node-a" {
		t.Errorf("requisite topology %q", got)
	}
	if req.GetVolumeContentSource().GetVolume().GetVolumeId() != "src-vol" {
		t.Errorf("content source %v", req.GetVolumeContentSource())
	}
}

func TestBuildPV(t *testing.T) {
	retain := corev1.PersistentVolumeReclaimRetain
	sc := class("hostpath-csi", CSIProvisionerName)
	sc.ReclaimPolicy = &retain
	pvc := claim()
	pv := buildPV(pvc, sc, "node-a", kindCSI, madeVolume{ID: "vol-1", CapacityBytes: 64 << 20, Context: map[string]string{"storagePool": "fast"}})

	if pv.Name != "pvc-1234" || pv.Spec.ClaimRef.UID != "1234" || pv.Spec.ClaimRef.Name != "disk" || pv.Spec.ClaimRef.Namespace != "ns" {
		t.Errorf("pv %s pre-bound to %+v", pv.Name, pv.Spec.ClaimRef)
	}
	if got := pv.Spec.Capacity[corev1.ResourceStorage]; got.Value() != 64<<20 {
		t.Errorf("capacity %s, want the requested 64Mi", got.String())
	}
	if pv.Spec.CSI == nil || pv.Spec.CSI.VolumeHandle != "vol-1" || pv.Spec.CSI.Driver != hostpath.DriverName || pv.Spec.CSI.FSType != "ext4" {
		t.Errorf("csi source %+v", pv.Spec.CSI)
	}
	if pv.Spec.PersistentVolumeReclaimPolicy != retain || pv.Spec.StorageClassName != "hostpath-csi" {
		t.Errorf("reclaim %s class %s", pv.Spec.PersistentVolumeReclaimPolicy, pv.Spec.StorageClassName)
	}
	if pinnedNode(pv) != "node-a" || pv.Spec.NodeAffinity.Required.NodeSelectorTerms[0].MatchExpressions[0].Key != hostpath.TopologyKey {
		t.Errorf("node affinity %+v", pv.Spec.NodeAffinity)
	}
	if id, ours := pvVolume(pv, "node-a"); !ours || id != "vol-1" {
		t.Errorf("pvVolume = %q %v", id, ours)
	}
	if _, ours := pvVolume(pv, "node-b"); ours {
		t.Error("another node claims the PV")
	}

	legacy := buildPV(pvc, class("hp", LegacyProvisionerName), "node-a", kindLegacy, madeVolume{ID: "vol-2", CapacityBytes: 1 << 30, Path: "/pools/a/volumes/vol-2"})
	if legacy.Spec.HostPath == nil || legacy.Spec.HostPath.Path != "/pools/a/volumes/vol-2" || legacy.Spec.CSI != nil {
		t.Errorf("legacy source %+v", legacy.Spec.PersistentVolumeSource)
	}
	if legacy.Spec.PersistentVolumeReclaimPolicy != corev1.PersistentVolumeReclaimDelete {
		t.Errorf("default reclaim policy %s", legacy.Spec.PersistentVolumeReclaimPolicy)
	}
	if legacy.Spec.NodeAffinity.Required.NodeSelectorTerms[0].MatchExpressions[0].Key != hostnameKey {
		t.Errorf("legacy affinity %+v", legacy.Spec.NodeAffinity)
	}
	if id, ours := pvVolume(legacy, "node-a"); !ours || id != "vol-2" {
		t.Errorf("legacy pvVolume = %q %v", id, ours)
	}
	foreign := legacy.DeepCopy()
	foreign.Annotations[AnnProvisionedBy] = "someone-else"
	if _, ours := pvVolume(foreign, "node-a"); ours {
		t.Error("a PV of another provisioner is taken as ours")
	}
}

func TestPlanVolume(t *testing.T) {
	now := metav1.Now()
	pv := func(phase corev1.PersistentVolumePhase, policy corev1.PersistentVolumeReclaimPolicy, deleting, finalizer bool) *corev1.PersistentVolume {
		v := &corev1.PersistentVolume{
			Spec:   corev1.PersistentVolumeSpec{PersistentVolumeReclaimPolicy: policy},
			Status: corev1.PersistentVolumeStatus{Phase: phase},
		}
		if deleting {
			v.DeletionTimestamp = &now
		}
		if finalizer {
			v.Finalizers = []string{Finalizer}
		}
		return v
	}
	del, ret := corev1.PersistentVolumeReclaimDelete, corev1.PersistentVolumeReclaimRetain
	for _, tc := range []struct {
		name string
		pv   *corev1.PersistentVolume
		want volumeAction
	}{
		{"bound", pv(corev1.VolumeBound, del, false, true), keepVolume},
		{"bound and being deleted waits for the claim", pv(corev1.VolumeBound, del, true, true), keepVolume},
		{"available", pv(corev1.VolumeAvailable, del, false, true), keepVolume},
		{"released, delete", pv(corev1.VolumeReleased, del, false, true), deleteVolume},
		{"released, retain", pv(corev1.VolumeReleased, ret, false, true), keepVolume},
		{"deleted unbound, delete", pv(corev1.VolumeAvailable, del, true, true), deleteVolume},
		{"deleted, delete, finalizer gone", pv(corev1.VolumeReleased, del, true, false), keepVolume},
		{"deleted, retain", pv(corev1.VolumeReleased, ret, true, true), releaseFinalizer},
	} {
		if got := planVolume(tc.pv); got != tc.want {
			t.Errorf("%s: got %v, want %v", tc.name, got, tc.want)
		}
	}
}
