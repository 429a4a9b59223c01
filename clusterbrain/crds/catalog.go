package crds

import (
	"context"
	"fmt"
	"reflect"

	nadv1 "github.com/k8snetworkplumbingwg/network-attachment-definition-client/pkg/apis/k8s.cni.cncf.io/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apiextensionsclient "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	clonev1alpha1 "kubevirt.io/api/clone/v1alpha1"
	clonev1beta1 "kubevirt.io/api/clone/v1beta1"
	kubevirtv1 "kubevirt.io/api/core/v1"
	instancetypev1beta1 "kubevirt.io/api/instancetype/v1beta1"
	migrationsv1alpha1 "kubevirt.io/api/migrations/v1alpha1"
	poolv1alpha1 "kubevirt.io/api/pool/v1alpha1"
	poolv1beta1 "kubevirt.io/api/pool/v1beta1"
	vmsnapshotv1alpha1 "kubevirt.io/api/snapshot/v1alpha1"
	vmsnapshotv1beta1 "kubevirt.io/api/snapshot/v1beta1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	hcov1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1"
	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
	hppv1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hostpathprovisioner/v1beta1"
	macv1alpha1 "github.com/nodevirt/nodevirt/clusterbrain/api/macpool/v1alpha1"
	cnaov1 "github.com/nodevirt/nodevirt/clusterbrain/api/networkaddons/v1"
	sspv1beta2 "github.com/nodevirt/nodevirt/clusterbrain/api/ssp/v1beta2"
	snapshotv1 "github.com/nodevirt/nodevirt/clusterbrain/api/volumesnapshot/v1"
	"github.com/nodevirt/nodevirt/clusterbrain/ssp/templates"
)

// Kind describes one served resource.
type Kind struct {
	Group, Version, Kind, Plural, Singular string
	ShortNames                             []string
	Categories                             []string
	Namespaced                             bool
	// Status enables the status subresource.
	Status bool
	// Scale enables the scale subresource (kubectl scale, the HPA).
	Scale   *apiextensionsv1.CustomResourceSubresourceScale
	Columns []apiextensionsv1.CustomResourceColumnDefinition
	// Type is the root Go type of one object.
	Type reflect.Type
	// Annotations go on the CRD (api-approved.kubernetes.io for the
	// protected *.k8s.io groups).
	Annotations map[string]string
	// Served are more versions served beside Version, which stays the
	// stored one. The CRD's spec.conversion is left to the role that
	// serves the conversion webhook (Install never writes it).
	Served []ServedVersion
}

// ServedVersion is a version served, not stored, with its own root type.
type ServedVersion struct {
	Name string
	Type reflect.Type
}

func col(name, typ, path string, priority int32) apiextensionsv1.CustomResourceColumnDefinition {
	return apiextensionsv1.CustomResourceColumnDefinition{Name: name, Type: typ, JSONPath: path, Priority: priority}
}

var age = col("Age", "date", ".metadata.creationTimestamp", 0)

// replicaScale is the scale subresource of a kind with spec.replicas,
// status.replicas and status.labelSelector (a ReplicaSet's shape).
var replicaScale = &apiextensionsv1.CustomResourceSubresourceScale{SpecReplicasPath: ".spec.replicas",
	StatusReplicasPath: ".status.replicas", LabelSelectorPath: ptr(".status.labelSelector")}

var replicaColumns = []apiextensionsv1.CustomResourceColumnDefinition{
	col("Desired", "integer", ".spec.replicas", 0), col("Current", "integer", ".status.replicas", 0),
	col("Ready", "integer", ".status.readyReplicas", 0), age}

// Catalog lists every kind nodevirt installs, with KubeVirt's names, short
// names and printer columns so kubectl output looks as users know it.
func Catalog() []Kind {
	kv, it, cdi, vmSnap := "kubevirt.io", "instancetype.kubevirt.io", "cdi.kubevirt.io", "snapshot.kubevirt.io"
	return []Kind{
		{Group: kv, Version: "v1", Kind: "VirtualMachine", Plural: "virtualmachines", Singular: "virtualmachine",
			ShortNames: []string{"vm", "vms"}, Categories: []string{"all"}, Namespaced: true, Status: true,
			Columns: []apiextensionsv1.CustomResourceColumnDefinition{age,
				col("Status", "string", ".status.printableStatus", 0),
				col("Ready", "string", ".status.conditions[?(@.type=='Ready')].status", 0)},
			Type: reflect.TypeOf(kubevirtv1.VirtualMachine{})},
		{Group: kv, Version: "v1", Kind: "VirtualMachineInstance", Plural: "virtualmachineinstances", Singular: "virtualmachineinstance",
			ShortNames: []string{"vmi", "vmis"}, Categories: []string{"all"}, Namespaced: true, Status: true,
			Columns: []apiextensionsv1.CustomResourceColumnDefinition{age,
				col("Phase", "string", ".status.phase", 0),
				col("IP", "string", ".status.interfaces[0].ipAddress", 0),
				col("NodeName", "string", ".status.nodeName", 0),
				col("Ready", "string", ".status.conditions[?(@.type=='Ready')].status", 0),
				col("Live-Migratable", "string", ".status.conditions[?(@.type=='LiveMigratable')].status", 1)},
			Type: reflect.TypeOf(kubevirtv1.VirtualMachineInstance{})},
		{Group: kv, Version: "v1", Kind: "VirtualMachineInstanceMigration", Plural: "virtualmachineinstancemigrations", Singular: "virtualmachineinstancemigration",
			ShortNames: []string{"vmim", "vmims"}, Categories: []string{"all"}, Namespaced: true, Status: true,
			Columns: []apiextensionsv1.CustomResourceColumnDefinition{
				col("Phase", "string", ".status.phase", 0), col("VMI", "string", ".spec.vmiName", 0)},
			Type: reflect.TypeOf(kubevirtv1.VirtualMachineInstanceMigration{})},
		{Group: kv, Version: "v1", Kind: "VirtualMachineInstanceReplicaSet", Plural: "virtualmachineinstancereplicasets", Singular: "virtualmachineinstancereplicaset",
			ShortNames: []string{"vmirs", "vmirss"}, Categories: []string{"all"}, Namespaced: true, Status: true, Scale: replicaScale,
			Columns: replicaColumns, Type: reflect.TypeOf(kubevirtv1.VirtualMachineInstanceReplicaSet{})},
		// Deprecated upstream, still served; nodevirt stores presets and
		// does not apply them to VMIs.
		{Group: kv, Version: "v1", Kind: "VirtualMachineInstancePreset", Plural: "virtualmachineinstancepresets", Singular: "virtualmachineinstancepreset",
			ShortNames: []string{"vmipreset", "vmipresets"}, Categories: []string{"all"}, Namespaced: true,
			Type: reflect.TypeOf(kubevirtv1.VirtualMachineInstancePreset{})},
		// v1beta1 stored; v1alpha1 (the same schema) still served.
		{Group: "pool.kubevirt.io", Version: "v1beta1", Kind: "VirtualMachinePool", Plural: "virtualmachinepools", Singular: "virtualmachinepool",
			ShortNames: []string{"vmpool", "vmpools"}, Categories: []string{"all"}, Namespaced: true, Status: true, Scale: replicaScale,
			Columns: replicaColumns, Type: reflect.TypeOf(poolv1beta1.VirtualMachinePool{}),
			Served: []ServedVersion{{Name: "v1alpha1", Type: reflect.TypeOf(poolv1alpha1.VirtualMachinePool{})}}},
		// Snapshots, restores and clones: v1beta1 stored, v1alpha1 still
		// served (KubeVirt's columns).
		{Group: vmSnap, Version: "v1beta1", Kind: "VirtualMachineSnapshot", Plural: "virtualmachinesnapshots", Singular: "virtualmachinesnapshot",
			ShortNames: []string{"vmsnapshot", "vmsnapshots"}, Categories: []string{"all"}, Namespaced: true, Status: true,
			Columns: []apiextensionsv1.CustomResourceColumnDefinition{
				col("SourceKind", "string", ".spec.source.kind", 0), col("SourceName", "string", ".spec.source.name", 0),
				col("Phase", "string", ".status.phase", 0), col("ReadyToUse", "boolean", ".status.readyToUse", 0),
				col("CreationTime", "date", ".status.creationTime", 0), col("Error", "string", ".status.error.message", 0)},
			Type:   reflect.TypeOf(vmsnapshotv1beta1.VirtualMachineSnapshot{}),
			Served: []ServedVersion{{Name: "v1alpha1", Type: reflect.TypeOf(vmsnapshotv1alpha1.VirtualMachineSnapshot{})}}},
		{Group: vmSnap, Version: "v1beta1", Kind: "VirtualMachineSnapshotContent", Plural: "virtualmachinesnapshotcontents", Singular: "virtualmachinesnapshotcontent",
			ShortNames: []string{"vmsnapshotcontent", "vmsnapshotcontents"}, Categories: []string{"all"}, Namespaced: true, Status: true,
			Columns: []apiextensionsv1.CustomResourceColumnDefinition{
				col("ReadyToUse", "boolean", ".status.readyToUse", 0), col("CreationTime", "date", ".status.creationTime", 0),
				col("Error", "string", ".status.error.message", 0)},
			Type:   reflect.TypeOf(vmsnapshotv1beta1.VirtualMachineSnapshotContent{}),
			Served: []ServedVersion{{Name: "v1alpha1", Type: reflect.TypeOf(vmsnapshotv1alpha1.VirtualMachineSnapshotContent{})}}},
		{Group: vmSnap, Version: "v1beta1", Kind: "VirtualMachineRestore", Plural: "virtualmachinerestores", Singular: "virtualmachinerestore",
			ShortNames: []string{"vmrestore", "vmrestores"}, Categories: []string{"all"}, Namespaced: true, Status: true,
			Columns: []apiextensionsv1.CustomResourceColumnDefinition{
				col("TargetKind", "string", ".spec.target.kind", 0), col("TargetName", "string", ".spec.target.name", 0),
				col("Complete", "boolean", ".status.complete", 0), col("RestoreTime", "date", ".status.restoreTime", 0)},
			Type:   reflect.TypeOf(vmsnapshotv1beta1.VirtualMachineRestore{}),
			Served: []ServedVersion{{Name: "v1alpha1", Type: reflect.TypeOf(vmsnapshotv1alpha1.VirtualMachineRestore{})}}},
		{Group: "clone.kubevirt.io", Version: "v1beta1", Kind: "VirtualMachineClone", Plural: "virtualmachineclones", Singular: "virtualmachineclone",
			ShortNames: []string{"vmclone", "vmclones"}, Categories: []string{"all"}, Namespaced: true, Status: true,
			Columns: []apiextensionsv1.CustomResourceColumnDefinition{
				col("Phase", "string", ".status.phase", 0), col("SourceVirtualMachine", "string", ".spec.source.name", 0),
				col("TargetVirtualMachine", "string", ".spec.target.name", 0)},
			Type:   reflect.TypeOf(clonev1beta1.VirtualMachineClone{}),
			Served: []ServedVersion{{Name: "v1alpha1", Type: reflect.TypeOf(clonev1alpha1.VirtualMachineClone{})}}},
		{Group: "migrations.kubevirt.io", Version: "v1alpha1", Kind: "MigrationPolicy", Plural: "migrationpolicies", Singular: "migrationpolicy",
			Categories: []string{"all"}, Status: true, Columns: []apiextensionsv1.CustomResourceColumnDefinition{age},
			Type: reflect.TypeOf(migrationsv1alpha1.MigrationPolicy{})},
		{Group: kv, Version: "v1", Kind: "KubeVirt", Plural: "kubevirts", Singular: "kubevirt",
			ShortNames: []string{"kv", "kvs"}, Categories: []string{"all"}, Namespaced: true, Status: true,
			Columns: []apiextensionsv1.CustomResourceColumnDefinition{age, col("Phase", "string", ".status.phase", 0)},
			Type:    reflect.TypeOf(kubevirtv1.KubeVirt{})},
		{Group: it, Version: "v1beta1", Kind: "VirtualMachineInstancetype", Plural: "virtualmachineinstancetypes", Singular: "virtualmachineinstancetype",
			ShortNames: []string{"vminstancetype", "vminstancetypes", "vmf", "vmfs"}, Namespaced: true,
			Type: reflect.TypeOf(instancetypev1beta1.VirtualMachineInstancetype{})},
		{Group: it, Version: "v1beta1", Kind: "VirtualMachineClusterInstancetype", Plural: "virtualmachineclusterinstancetypes", Singular: "virtualmachineclusterinstancetype",
			ShortNames: []string{"vmclusterinstancetype", "vmclusterinstancetypes", "vmcf", "vmcfs"},
			Type:       reflect.TypeOf(instancetypev1beta1.VirtualMachineClusterInstancetype{})},
		{Group: it, Version: "v1beta1", Kind: "VirtualMachinePreference", Plural: "virtualmachinepreferences", Singular: "virtualmachinepreference",
			ShortNames: []string{"vmpref", "vmprefs", "vmp", "vmps"}, Namespaced: true,
			Type: reflect.TypeOf(instancetypev1beta1.VirtualMachinePreference{})},
		{Group: it, Version: "v1beta1", Kind: "VirtualMachineClusterPreference", Plural: "virtualmachineclusterpreferences", Singular: "virtualmachineclusterpreference",
			ShortNames: []string{"vmclusterpref", "vmclusterprefs", "vmcp", "vmcps"},
			Type:       reflect.TypeOf(instancetypev1beta1.VirtualMachineClusterPreference{})},
		{Group: cdi, Version: "v1beta1", Kind: "DataVolume", Plural: "datavolumes", Singular: "datavolume",
			ShortNames: []string{"dv", "dvs"}, Categories: []string{"all"}, Namespaced: true, Status: true,
			Columns: []apiextensionsv1.CustomResourceColumnDefinition{
				col("Phase", "string", ".status.phase", 0), col("Progress", "string", ".status.progress", 0),
				col("Restarts", "integer", ".status.restartCount", 0), age},
			Type: reflect.TypeOf(cdiv1.DataVolume{})},
		{Group: cdi, Version: "v1beta1", Kind: "DataSource", Plural: "datasources", Singular: "datasource",
			ShortNames: []string{"das"}, Categories: []string{"all"}, Namespaced: true, Status: true,
			Columns: []apiextensionsv1.CustomResourceColumnDefinition{age},
			Type:    reflect.TypeOf(cdiv1.DataSource{})},
		{Group: cdi, Version: "v1beta1", Kind: "DataImportCron", Plural: "dataimportcrons", Singular: "dataimportcron",
			ShortNames: []string{"dic", "dics"}, Categories: []string{"all"}, Namespaced: true, Status: true,
			Columns: []apiextensionsv1.CustomResourceColumnDefinition{age},
			Type:    reflect.TypeOf(cdiv1.DataImportCron{})},
		{Group: cdi, Version: "v1beta1", Kind: "CDI", Plural: "cdis", Singular: "cdi",
			ShortNames: []string{"cdi", "cdis"}, Status: true,
			Columns: []apiextensionsv1.CustomResourceColumnDefinition{age, col("Phase", "string", ".status.phase", 0)},
			Type:    reflect.TypeOf(cdiv1.CDI{})},
		{Group: cdi, Version: "v1beta1", Kind: "StorageProfile", Plural: "storageprofiles", Singular: "storageprofile",
			Status: true, Type: reflect.TypeOf(cdiv1.StorageProfile{})},
		{Group: cdi, Version: "v1beta1", Kind: "CDIConfig", Plural: "cdiconfigs", Singular: "cdiconfig",
			Status: true, Type: reflect.TypeOf(cdiv1.CDIConfig{})},
		{Group: "hco.kubevirt.io", Version: "v1beta1", Kind: "HyperConverged", Plural: "hyperconvergeds", Singular: "hyperconverged",
			ShortNames: []string{"hco", "hcos"}, Namespaced: true, Status: true,
			Columns: []apiextensionsv1.CustomResourceColumnDefinition{age,
				col("Available", "string", ".status.conditions[?(@.type=='Available')].status", 0),
				col("Degraded", "string", ".status.conditions[?(@.type=='Degraded')].status", 0)},
			Type:   reflect.TypeOf(hcov1beta1.HyperConverged{}),
			Served: []ServedVersion{{Name: "v1", Type: reflect.TypeOf(hcov1.HyperConverged{})}}},
		{Group: "k8s.cni.cncf.io", Version: "v1", Kind: "NetworkAttachmentDefinition", Plural: "network-attachment-definitions", Singular: "network-attachment-definition",
			ShortNames: []string{"net-attach-def"}, Namespaced: true,
			Type: reflect.TypeOf(nadv1.NetworkAttachmentDefinition{})},
		{Group: "networkaddonsoperator.network.kubevirt.io", Version: "v1", Kind: "NetworkAddonsConfig", Plural: "networkaddonsconfigs", Singular: "networkaddonsconfig",
			Status: true, Type: reflect.TypeOf(cnaov1.NetworkAddonsConfig{})},
		{Group: "hostpathprovisioner.kubevirt.io", Version: "v1beta1", Kind: "HostPathProvisioner", Plural: "hostpathprovisioners", Singular: "hostpathprovisioner",
			Status: true, Type: reflect.TypeOf(hppv1beta1.HostPathProvisioner{})},
		{Group: "ssp.kubevirt.io", Version: "v1beta2", Kind: "SSP", Plural: "ssps", Singular: "ssp",
			Namespaced: true, Status: true, Type: reflect.TypeOf(sspv1beta2.SSP{})},
		// template.openshift.io/v1 Templates as stored (the brain's
		// aggregated API serves them under their own group).
		{Group: templates.StorageGroup, Version: templates.StorageVersion, Kind: templates.StorageKind, Plural: templates.StorageResource,
			Singular: "storedtemplate", Namespaced: true, Columns: []apiextensionsv1.CustomResourceColumnDefinition{age},
			Type: reflect.TypeOf(templates.StoredTemplate{})},
		{Group: "nodevirt.io", Version: "v1alpha1", Kind: "MACAllocation", Plural: "macallocations", Singular: "macallocation",
			ShortNames: []string{"macalloc"}, Columns: []apiextensionsv1.CustomResourceColumnDefinition{
				// A record is a block of addresses (the block's first MAC,
				// its taken addresses under entries) or, from before blocks,
				// one address with its owner.
				col("MAC", "string", ".spec.mac", 0), col("Taken", "string", ".spec.entries[*].mac", 0),
				col("Namespace", "string", ".spec.namespace", 1), col("VM", "string", ".spec.vmName", 1), age},
			Type: reflect.TypeOf(macv1alpha1.MACAllocation{})},
	}
}

// Definition renders the CRD of k.
func (k Kind) Definition() *apiextensionsv1.CustomResourceDefinition {
	scope := apiextensionsv1.ClusterScoped
	if k.Namespaced {
		scope = apiextensionsv1.NamespaceScoped
	}
	v := apiextensionsv1.CustomResourceDefinitionVersion{
		Name: k.Version, Served: true, Storage: true,
		Schema:                   &apiextensionsv1.CustomResourceValidation{OpenAPIV3Schema: Schema(k.Type)},
		AdditionalPrinterColumns: k.Columns,
	}
	if k.Status || k.Scale != nil {
		v.Subresources = &apiextensionsv1.CustomResourceSubresources{Scale: k.Scale}
		if k.Status {
			v.Subresources.Status = &apiextensionsv1.CustomResourceSubresourceStatus{}
		}
	}
	versions := []apiextensionsv1.CustomResourceDefinitionVersion{v}
	for _, sv := range k.Served {
		o := v
		o.Name, o.Storage = sv.Name, false
		o.Schema = &apiextensionsv1.CustomResourceValidation{OpenAPIV3Schema: Schema(sv.Type)}
		versions = append(versions, o)
	}
	return &apiextensionsv1.CustomResourceDefinition{
		TypeMeta: metav1.TypeMeta{APIVersion: "apiextensions.k8s.io/v1", Kind: "CustomResourceDefinition"},
		ObjectMeta: metav1.ObjectMeta{Name: k.Plural + "." + k.Group, Labels: map[string]string{"app.kubernetes.io/managed-by": "nodevirt"},
			Annotations: k.Annotations},
		Spec: apiextensionsv1.CustomResourceDefinitionSpec{
			Group: k.Group, Scope: scope,
			Names: apiextensionsv1.CustomResourceDefinitionNames{Kind: k.Kind, ListKind: k.Kind + "List",
				Plural: k.Plural, Singular: k.Singular, ShortNames: k.ShortNames, Categories: k.Categories},
			Versions: versions,
		},
	}
}

// SnapshotCatalog lists the CSI snapshot kinds (snapshot.storage.k8s.io/v1)
// with external-snapshotter's names and columns. A cluster that runs
// external-snapshotter already has them: install them with InstallAbsent,
// never over the existing ones.
func SnapshotCatalog() []Kind {
	g, v := snapshotv1.GroupName, "v1"
	approved := map[string]string{"api-approved.kubernetes.io": "https://github.com/kubernetes-csi/external-snapshotter"}
	return []Kind{
		{Group: g, Version: v, Kind: "VolumeSnapshot", Plural: "volumesnapshots", Singular: "volumesnapshot",
			ShortNames: []string{"vs"}, Namespaced: true, Status: true, Annotations: approved,
			Columns: []apiextensionsv1.CustomResourceColumnDefinition{
				col("ReadyToUse", "boolean", ".status.readyToUse", 0),
				col("SourcePVC", "string", ".spec.source.persistentVolumeClaimName", 0),
				col("SourceSnapshotContent", "string", ".spec.source.volumeSnapshotContentName", 0),
				col("RestoreSize", "string", ".status.restoreSize", 0),
				col("SnapshotClass", "string", ".spec.volumeSnapshotClassName", 0),
				col("SnapshotContent", "string", ".status.boundVolumeSnapshotContentName", 0),
				col("CreationTime", "date", ".status.creationTime", 0), age},
			Type: reflect.TypeOf(snapshotv1.VolumeSnapshot{})},
		{Group: g, Version: v, Kind: "VolumeSnapshotContent", Plural: "volumesnapshotcontents", Singular: "volumesnapshotcontent",
			ShortNames: []string{"vsc", "vscs"}, Status: true, Annotations: approved,
			Columns: []apiextensionsv1.CustomResourceColumnDefinition{
				col("ReadyToUse", "boolean", ".status.readyToUse", 0),
				col("RestoreSize", "integer", ".status.restoreSize", 0),
				col("DeletionPolicy", "string", ".spec.deletionPolicy", 0),
				col("Driver", "string", ".spec.driver", 0),
				col("VolumeSnapshotClass", "string", ".spec.volumeSnapshotClassName", 0),
				col("VolumeSnapshot", "string", ".spec.volumeSnapshotRef.name", 0),
				col("VolumeSnapshotNamespace", "string", ".spec.volumeSnapshotRef.namespace", 0), age},
			Type: reflect.TypeOf(snapshotv1.VolumeSnapshotContent{})},
		{Group: g, Version: v, Kind: "VolumeSnapshotClass", Plural: "volumesnapshotclasses", Singular: "volumesnapshotclass",
			ShortNames: []string{"vsclass", "vsclasses"}, Annotations: approved,
			Columns: []apiextensionsv1.CustomResourceColumnDefinition{
				col("Driver", "string", ".driver", 0), col("DeletionPolicy", "string", ".deletionPolicy", 0), age},
			Type: reflect.TypeOf(snapshotv1.VolumeSnapshotClass{})},
	}
}

// InstallAbsent installs those of kinds whose CRD does not exist yet and
// leaves existing ones (another installer's) untouched.
func InstallAbsent(ctx context.Context, client apiextensionsclient.Interface, kinds []Kind) error {
	var missing []Kind
	for _, k := range kinds {
		name := k.Plural + "." + k.Group
		_, err := client.ApiextensionsV1().CustomResourceDefinitions().Get(ctx, name, metav1.GetOptions{})
		switch {
		case apierrors.IsNotFound(err):
			missing = append(missing, k)
		case err != nil:
			return fmt.Errorf("get crd %s: %w", name, err)
		}
	}
	return Install(ctx, client, missing)
}
