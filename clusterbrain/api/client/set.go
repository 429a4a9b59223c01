package client

import (
	"context"
	"reflect"

	nadv1 "github.com/k8snetworkplumbingwg/network-attachment-definition-client/pkg/apis/k8s.cni.cncf.io/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/rest"
	clonev1beta1 "kubevirt.io/api/clone/v1beta1"
	kubevirtv1 "kubevirt.io/api/core/v1"
	instancetypev1beta1 "kubevirt.io/api/instancetype/v1beta1"
	poolv1beta1 "kubevirt.io/api/pool/v1beta1"
	vmsnapshotv1beta1 "kubevirt.io/api/snapshot/v1beta1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
	hppv1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hostpathprovisioner/v1beta1"
	cnaov1 "github.com/nodevirt/nodevirt/clusterbrain/api/networkaddons/v1"
	sspv1beta2 "github.com/nodevirt/nodevirt/clusterbrain/api/ssp/v1beta2"
)

// Set holds a typed client for every nodevirt resource.
type Set struct {
	VMs                  Resource[*kubevirtv1.VirtualMachine]
	VMIs                 Resource[*kubevirtv1.VirtualMachineInstance]
	Migrations           Resource[*kubevirtv1.VirtualMachineInstanceMigration]
	VMIReplicaSets       Resource[*kubevirtv1.VirtualMachineInstanceReplicaSet]
	VMPools              Resource[*poolv1beta1.VirtualMachinePool]
	VMSnapshots          Resource[*vmsnapshotv1beta1.VirtualMachineSnapshot]
	VMSnapshotContents   Resource[*vmsnapshotv1beta1.VirtualMachineSnapshotContent]
	VMRestores           Resource[*vmsnapshotv1beta1.VirtualMachineRestore]
	VMClones             Resource[*clonev1beta1.VirtualMachineClone]
	KubeVirts            Resource[*kubevirtv1.KubeVirt]
	Instancetypes        Resource[*instancetypev1beta1.VirtualMachineInstancetype]
	ClusterInstancetypes Resource[*instancetypev1beta1.VirtualMachineClusterInstancetype]
	Preferences          Resource[*instancetypev1beta1.VirtualMachinePreference]
	ClusterPreferences   Resource[*instancetypev1beta1.VirtualMachineClusterPreference]
	DataVolumes          Resource[*cdiv1.DataVolume]
	DataSources          Resource[*cdiv1.DataSource]
	DataImportCrons      Resource[*cdiv1.DataImportCron]
	CDIs                 Resource[*cdiv1.CDI]
	StorageProfiles      Resource[*cdiv1.StorageProfile]
	NADs                 Resource[*nadv1.NetworkAttachmentDefinition]
	HyperConvergeds      Resource[*hcov1beta1.HyperConverged]
	NetworkAddonsConfigs Resource[*cnaov1.NetworkAddonsConfig]
	HostPathProvisioners Resource[*hppv1beta1.HostPathProvisioner]
	SSPs                 Resource[*sspv1beta2.SSP]
}

// NewSet builds every typed client from one rest config.
func NewSet(cfg *rest.Config) (*Set, error) {
	b := builder{cfg: cfg, scheme: NewScheme()}
	kv, it, cdi := kubevirtv1.GroupVersion, instancetypev1beta1.SchemeGroupVersion, cdiv1.SchemeGroupVersion
	set := &Set{
		VMs:                  build[*kubevirtv1.VirtualMachine, *kubevirtv1.VirtualMachineList](&b, kv, "virtualmachines"),
		VMIs:                 build[*kubevirtv1.VirtualMachineInstance, *kubevirtv1.VirtualMachineInstanceList](&b, kv, "virtualmachineinstances"),
		Migrations:           build[*kubevirtv1.VirtualMachineInstanceMigration, *kubevirtv1.VirtualMachineInstanceMigrationList](&b, kv, "virtualmachineinstancemigrations"),
		VMIReplicaSets:       build[*kubevirtv1.VirtualMachineInstanceReplicaSet, *kubevirtv1.VirtualMachineInstanceReplicaSetList](&b, kv, "virtualmachineinstancereplicasets"),
		VMPools:              build[*poolv1beta1.VirtualMachinePool, *poolv1beta1.VirtualMachinePoolList](&b, poolv1beta1.SchemeGroupVersion, "virtualmachinepools"),
		VMSnapshots:          build[*vmsnapshotv1beta1.VirtualMachineSnapshot, *vmsnapshotv1beta1.VirtualMachineSnapshotList](&b, vmsnapshotv1beta1.SchemeGroupVersion, "virtualmachinesnapshots"),
		VMSnapshotContents:   build[*vmsnapshotv1beta1.VirtualMachineSnapshotContent, *vmsnapshotv1beta1.VirtualMachineSnapshotContentList](&b, vmsnapshotv1beta1.SchemeGroupVersion, "virtualmachinesnapshotcontents"),
		VMRestores:           build[*vmsnapshotv1beta1.VirtualMachineRestore, *vmsnapshotv1beta1.VirtualMachineRestoreList](&b, vmsnapshotv1beta1.SchemeGroupVersion, "virtualmachinerestores"),
		VMClones:             build[*clonev1beta1.VirtualMachineClone, *clonev1beta1.VirtualMachineCloneList](&b, clonev1beta1.SchemeGroupVersion, "virtualmachineclones"),
		KubeVirts:            build[*kubevirtv1.KubeVirt, *kubevirtv1.KubeVirtList](&b, kv, "kubevirts"),
		Instancetypes:        build[*instancetypev1beta1.VirtualMachineInstancetype, *instancetypev1beta1.VirtualMachineInstancetypeList](&b, it, "virtualmachineinstancetypes"),
		ClusterInstancetypes: build[*instancetypev1beta1.VirtualMachineClusterInstancetype, *instancetypev1beta1.VirtualMachineClusterInstancetypeList](&b, it, "virtualmachineclusterinstancetypes"),
		Preferences:          build[*instancetypev1beta1.VirtualMachinePreference, *instancetypev1beta1.VirtualMachinePreferenceList](&b, it, "virtualmachinepreferences"),
		ClusterPreferences:   build[*instancetypev1beta1.VirtualMachineClusterPreference, *instancetypev1beta1.VirtualMachineClusterPreferenceList](&b, it, "virtualmachineclusterpreferences"),
		DataVolumes:          build[*cdiv1.DataVolume, *cdiv1.DataVolumeList](&b, cdi, "datavolumes"),
		DataSources:          build[*cdiv1.DataSource, *cdiv1.DataSourceList](&b, cdi, "datasources"),
		DataImportCrons:      build[*cdiv1.DataImportCron, *cdiv1.DataImportCronList](&b, cdi, "dataimportcrons"),
		CDIs:                 build[*cdiv1.CDI, *cdiv1.CDIList](&b, cdi, "cdis"),
		StorageProfiles:      build[*cdiv1.StorageProfile, *cdiv1.StorageProfileList](&b, cdi, "storageprofiles"),
		NADs:                 build[*nadv1.NetworkAttachmentDefinition, *nadv1.NetworkAttachmentDefinitionList](&b, nadv1.SchemeGroupVersion, "network-attachment-definitions"),
		HyperConvergeds:      build[*hcov1beta1.HyperConverged, *hcov1beta1.HyperConvergedList](&b, hcov1beta1.SchemeGroupVersion, "hyperconvergeds"),
		NetworkAddonsConfigs: build[*cnaov1.NetworkAddonsConfig, *cnaov1.NetworkAddonsConfigList](&b, cnaov1.SchemeGroupVersion, "networkaddonsconfigs"),
		HostPathProvisioners: build[*hppv1beta1.HostPathProvisioner, *hppv1beta1.HostPathProvisionerList](&b, hppv1beta1.SchemeGroupVersion, "hostpathprovisioners"),
		SSPs:                 build[*sspv1beta2.SSP, *sspv1beta2.SSPList](&b, sspv1beta2.SchemeGroupVersion, "ssps"),
	}
	if b.err != nil {
		return nil, b.err
	}
	return set, nil
}

// builder keeps the first error of a series of constructions.
type builder struct {
	cfg    *rest.Config
	scheme *runtime.Scheme
	err    error
}

// build makes the client of one resource whose object and list types are
// the pointer types T and L.
func build[T Object, L runtime.Object](b *builder, gv schema.GroupVersion, resource string) Resource[T] {
	r, err := newResource(b.cfg, b.scheme, gv, resource, newOf[T], func() runtime.Object { return newOf[L]() })
	if err != nil && b.err == nil {
		b.err = err
	}
	return r
}

// newOf allocates the value a pointer type P points to.
func newOf[P any]() P {
	var zero P
	return reflect.New(reflect.TypeOf(zero).Elem()).Interface().(P)
}

// CDIConfig is the cluster's CDI configuration: spec.config of the CDI CR
// (there is one, rendered from the HyperConverged). It is nil when there is
// no CR or it has no config; err is the API's.
func (s *Set) CDIConfig(ctx context.Context) (*cdiv1.CDIConfigSpec, error) {
	cdi, err := s.CDI(ctx)
	if err != nil || cdi == nil {
		return nil, err
	}
	return cdi.Spec.Config, nil
}

// CDI is the cluster's CDI CR, nil when there is none.
func (s *Set) CDI(ctx context.Context) (*cdiv1.CDI, error) {
	cdis, err := s.CDIs.List(ctx, "", metav1.ListOptions{})
	if err != nil || len(cdis) == 0 {
		return nil, err
	}
	return cdis[0], nil
}
