package hco

import (
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	apis "github.com/nodevirt/nodevirt/clusterbrain/api"
	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
)

// bootSource is one of HCO's default golden images (its
// assets/dataImportCronTemplates): imported from a container disk every 12
// hours into the DataSource the common templates name.
type bootSource struct {
	dataSource, image, size, architectures string
}

var defaultBootSources = []bootSource{
	{"centos-stream9", "quay.io/containerdisks/centos-stream:9", "10Gi", "amd64,arm64,s390x"},
	{"centos-stream10", "quay.io/containerdisks/centos-stream:10", "10Gi", "amd64,arm64,s390x"},
	{"fedora", "quay.io/containerdisks/fedora:latest", "5Gi", "arm64,s390x,amd64"},
}

// bootImportSchedule is the default sources' schedule.
const bootImportSchedule = "0 */12 * * *"

// dataImportCronTemplates returns what the SSP child imports: HCO's
// default boot sources when enableCommonBootImageImport is on (a user
// template of the same name replaces a default one), then the user's;
// those without a namespace go to commonBootImageNamespace when set.
func dataImportCronTemplates(s *hcov1beta1.HyperConvergedSpec) []hcov1beta1.DataImportCronTemplate {
	var out []hcov1beta1.DataImportCronTemplate
	if s.EnableCommonBootImageImport == nil || *s.EnableCommonBootImageImport {
		user := map[string]bool{}
		for _, t := range s.DataImportCronTemplates {
			user[t.Name] = true
		}
		for _, b := range defaultBootSources {
			name := b.dataSource + "-image-cron"
			if user[name] {
				continue
			}
			url := "docker://" + b.image
			gc := cdiv1.DataImportCronGarbageCollectOutdated
			out = append(out, hcov1beta1.DataImportCronTemplate{
				ObjectMeta: metav1.ObjectMeta{Name: name, Annotations: map[string]string{
					"cdi.kubevirt.io/storage.bind.immediate.requested": "true",
					"ssp.kubevirt.io/dict.architectures":               b.architectures}},
				Spec: &cdiv1.DataImportCronSpec{Schedule: bootImportSchedule, ManagedDataSource: b.dataSource, GarbageCollect: &gc,
					Template: cdiv1.DataVolume{Spec: cdiv1.DataVolumeSpec{
						Source: &cdiv1.DataVolumeSource{Registry: &cdiv1.DataVolumeSourceRegistry{URL: &url}},
						Storage: &cdiv1.StorageSpec{Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{
							corev1.ResourceStorage: resource.MustParse(b.size)}}}}}},
			})
		}
	}
	for _, t := range s.DataImportCronTemplates {
		var c hcov1beta1.DataImportCronTemplate
		apis.DeepCopyJSON(&t, &c)
		out = append(out, c)
	}
	if s.CommonBootImageNamespace != nil && *s.CommonBootImageNamespace != "" {
		for i := range out {
			if out[i].Namespace == "" {
				out[i].Namespace = *s.CommonBootImageNamespace
			}
		}
	}
	return out
}
