package datavolume

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"
)

const (
	// HostpathClass is the StorageClass the brain creates for the hostpath
	// CSI driver.
	HostpathClass = "hostpath-csi"
	// HostpathProvisioner is the CSI driver's name.
	HostpathProvisioner = "kubevirt.io.hostpath-provisioner"
	// LegacyHostpathProvisioner provisions hostPath PVs on the same pools.
	LegacyHostpathProvisioner = "kubevirt.io/hostpath-provisioner"

	defaultClassAnnotation = "storageclass.kubernetes.io/is-default-class"
)

var (
	filesystemMode = corev1.PersistentVolumeFilesystem
	blockMode      = corev1.PersistentVolumeBlock
	rwo            = []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce}

	// defaultPropertySets apply when a class's profile says nothing.
	defaultPropertySets = []cdiv1.ClaimPropertySet{{AccessModes: rwo, VolumeMode: &filesystemMode}}

	// knownProvisioners are the claim properties of provisioners CDI knows.
	knownProvisioners = map[string][]cdiv1.ClaimPropertySet{
		HostpathProvisioner:       {{AccessModes: rwo, VolumeMode: &filesystemMode}, {AccessModes: rwo, VolumeMode: &blockMode}},
		LegacyHostpathProvisioner: {{AccessModes: rwo, VolumeMode: &filesystemMode}},
	}
)

// ensureStorageClass creates the hostpath-csi class if it is missing. It is
// made the default class only when no other class is.
func (c *Controller) ensureStorageClass(ctx context.Context) error {
	_, err := c.kube.StorageV1().StorageClasses().Get(ctx, HostpathClass, metav1.GetOptions{})
	if err == nil {
		return nil
	}
	if !apierrors.IsNotFound(err) {
		return fmt.Errorf("get storageclass %s: %w", HostpathClass, err)
	}
	classes, err := c.kube.StorageV1().StorageClasses().List(ctx, metav1.ListOptions{})
	if err != nil {
		return fmt.Errorf("list storageclasses: %w", err)
	}
	isDefault := "true"
	for _, sc := range classes.Items {
		if sc.Annotations[defaultClassAnnotation] == "true" {
			isDefault = "false"
		}
	}
	wffc := storagev1.VolumeBindingWaitForFirstConsumer
	reclaim := corev1.PersistentVolumeReclaimDelete
	expand := true
	sc := &storagev1.StorageClass{
		ObjectMeta: metav1.ObjectMeta{Name: HostpathClass, Annotations: map[string]string{defaultClassAnnotation: isDefault},
			Labels: map[string]string{"app.kubernetes.io/managed-by": "nodevirt"}},
		Provisioner:          HostpathProvisioner,
		ReclaimPolicy:        &reclaim,
		VolumeBindingMode:    &wffc,
		AllowVolumeExpansion: &expand,
		Parameters:           map[string]string{"storagePool": "default"},
	}
	if _, err := c.kube.StorageV1().StorageClasses().Create(ctx, sc, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create storageclass %s: %w", HostpathClass, err)
	}
	c.log.Info("created storageclass", "storageclass", HostpathClass, "default", isDefault)
	return nil
}

// syncProfile keeps the StorageProfile of one StorageClass.
func (c *Controller) syncProfile(ctx context.Context, name string) error {
	sc, err := c.classes.Get(name)
	if apierrors.IsNotFound(err) {
		err := c.virt.StorageProfiles.Delete(ctx, "", name, metav1.DeleteOptions{})
		if err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("delete storageprofile %s: %w", name, err)
		}
		return nil
	}
	if err != nil {
		return err
	}
	profile, err := c.virt.StorageProfiles.Get(ctx, "", name)
	if apierrors.IsNotFound(err) {
		profile = &cdiv1.StorageProfile{ObjectMeta: metav1.ObjectMeta{Name: name,
			Labels: map[string]string{"app.kubernetes.io/managed-by": "nodevirt"},
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "storage.k8s.io/v1", Kind: "StorageClass",
				Name: sc.Name, UID: sc.UID}}}}
		if profile, err = c.virt.StorageProfiles.Create(ctx, profile); err != nil {
			return fmt.Errorf("create storageprofile %s: %w", name, err)
		}
	} else if err != nil {
		return fmt.Errorf("get storageprofile %s: %w", name, err)
	}
	want := profileStatus(sc, &profile.Spec)
	if apiequality.Semantic.DeepEqual(profile.Status, want) {
		return nil
	}
	profile.Status = want
	if _, err := c.virt.StorageProfiles.UpdateStatus(ctx, profile); err != nil && !apierrors.IsConflict(err) {
		return fmt.Errorf("update storageprofile %s status: %w", name, err)
	}
	return nil
}

// profileStatus is what a StorageProfile reports for sc: the spec's claim
// properties, else those known for the provisioner.
func profileStatus(sc *storagev1.StorageClass, spec *cdiv1.StorageProfileSpec) cdiv1.StorageProfileStatus {
	name, prov := sc.Name, sc.Provisioner
	st := cdiv1.StorageProfileStatus{StorageClass: &name, Provisioner: &prov,
		CloneStrategy: spec.CloneStrategy, DataImportCronSourceFormat: spec.DataImportCronSourceFormat, SnapshotClass: spec.SnapshotClass}
	switch {
	case len(spec.ClaimPropertySets) > 0:
		st.ClaimPropertySets = spec.ClaimPropertySets
	case knownProvisioners[prov] != nil:
		st.ClaimPropertySets = knownProvisioners[prov]
	}
	if st.CloneStrategy == nil && prov == HostpathProvisioner {
		copyStrategy := cdiv1.CloneStrategyHostAssisted
		st.CloneStrategy = &copyStrategy
	}
	return st
}
