package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/ssp/templates"
	"github.com/nodevirt/nodevirt/test/testkit"
)

// TestVMFromCatalogue is the "create a VM from the OS catalogue" flow: a
// DataImportCron imports the image a (loopback) registry serves for its
// tag and its DataSource turns Ready; the common template
// centos-stream9-server-tiny, processed through template.openshift.io with
// DATA_SOURCE_NAME/DATA_SOURCE_NAMESPACE naming that DataSource, makes a
// VM the template validator admits; its disk is cloned from the golden
// image and the guest boots. The template's 30Gi disk request is lowered
// to 1Gi here to spare the shared machine's disk, and the serial console is
// logged for the suite to read.
func TestVMFromCatalogue(t *testing.T) {
	t.Parallel()
	e := require(t)
	n := e.namespace(t)
	ctx := context.Background()
	_, host := serveContainerDisk(t, "e2e/os", "latest", "", "")
	e.allowInsecureRegistry(t, host)

	url := "docker://" + host + "/e2e/os:latest"
	// Bound at once, as HCO's boot sources ask: nothing consumes the
	// golden image's claim itself.
	cron := &cdiv1.DataImportCron{ObjectMeta: metav1.ObjectMeta{Name: "os-image-cron", Namespace: n.name,
		Annotations: map[string]string{"cdi.kubevirt.io/storage.bind.immediate.requested": "true"}},
		Spec: cdiv1.DataImportCronSpec{Schedule: "0 */12 * * *", ManagedDataSource: "os",
			Template: cdiv1.DataVolume{Spec: cdiv1.DataVolumeSpec{
				Source: &cdiv1.DataVolumeSource{Registry: &cdiv1.DataVolumeSourceRegistry{URL: &url}},
				Storage: &cdiv1.StorageSpec{Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{
					corev1.ResourceStorage: resource.MustParse("1Gi")}}}}}}}
	if _, err := e.virt.DataImportCrons.Create(ctx, cron); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	n.eventually(3*time.Minute, "the DataSource os is Ready", func() (bool, string) {
		ds, err := e.virt.DataSources.Get(ctx, n.name, "os")
		if err != nil {
			return false, err.Error()
		}
		for _, c := range ds.Status.Conditions {
			if c.Type == cdiv1.DataSourceReady && c.Status == corev1.ConditionTrue {
				return true, ""
			}
		}
		dic, _ := e.virt.DataImportCrons.Get(ctx, n.name, "os-image-cron")
		return false, fmt.Sprintf("datasource %+v; cron status %+v", ds.Status, dic.Status)
	})
	t.Logf("golden image imported and its DataSource Ready after %s", time.Since(t0).Round(time.Millisecond))

	// The template, as `oc process` does it.
	rc := e.kube.CoreV1().RESTClient()
	const name = "centos-stream9-server-tiny"
	var raw []byte
	n.eventually(2*time.Minute, "the common template "+name+" is served", func() (bool, string) {
		var err error
		raw, err = rc.Get().AbsPath("/apis/template.openshift.io/v1/namespaces/openshift/templates/" + name).DoRaw(ctx)
		if err != nil {
			return false, err.Error()
		}
		return true, ""
	})
	var tmpl map[string]any
	if err := json.Unmarshal(raw, &tmpl); err != nil {
		t.Fatal(err)
	}
	for _, p := range tmpl["parameters"].([]any) {
		pm := p.(map[string]any)
		switch pm["name"] {
		case "NAME":
			pm["value"] = "catalogue"
		case "DATA_SOURCE_NAME":
			pm["value"] = "os"
		case "DATA_SOURCE_NAMESPACE":
			pm["value"] = n.name
		}
	}
	body, _ := json.Marshal(tmpl)
	raw, err := rc.Post().AbsPath("/apis/template.openshift.io/v1/namespaces/"+n.name+"/processedtemplates").
		Body(body).SetHeader("Content-Type", "application/json").DoRaw(ctx)
	if err != nil {
		t.Fatalf("process %s: %v: %s", name, err, raw)
	}
	var processed struct {
		Objects []json.RawMessage `json:"objects"`
	}
	if err := json.Unmarshal(raw, &processed); err != nil || len(processed.Objects) != 1 {
		t.Fatalf("processed template: %v %s", err, raw)
	}
	vm := &kubevirtv1.VirtualMachine{}
	if err := json.Unmarshal(processed.Objects[0], vm); err != nil {
		t.Fatal(err)
	}
	vm.Namespace = n.name
	vm.Spec.DataVolumeTemplates[0].Spec.Storage.Resources.Requests[corev1.ResourceStorage] = resource.MustParse("1Gi")

	// Below the template's minimum memory the validator refuses it.
	small := vm.DeepCopy()
	small.Name = "catalogue-small"
	small.Spec.DataVolumeTemplates[0].Name = small.Name
	small.Spec.Template.Spec.Volumes[0].DataVolume.Name = small.Name
	q := resource.MustParse("512Mi")
	small.Spec.Template.Spec.Domain.Memory.Guest = &q
	n.eventually(30*time.Second, "the template validator refuses a VM below the template's minimum memory", func() (bool, string) {
		_, err := e.virt.VMs.Create(ctx, small)
		if err == nil { // admitted before the brain published the validator
			_ = e.virt.VMs.Delete(ctx, n.name, small.Name, metav1.DeleteOptions{})
			_ = testkit.Wait(200*time.Millisecond, 20*time.Second, "the admitted VM gone", func() (bool, error) {
				_, err := e.virt.VMs.Get(ctx, n.name, small.Name)
				return apierrors.IsNotFound(err), nil
			})
			return false, "admitted"
		}
		return strings.Contains(err.Error(), "This VM requires more memory.: value 536870912 is lower than minimum [1610612736]"), err.Error()
	})

	always := kubevirtv1.RunStrategyAlways
	vm.Spec.RunStrategy = &always
	// How this suite reads a guest's serial console.
	logSerial := true
	vm.Spec.Template.Spec.Domain.Devices.LogSerialConsole = &logSerial
	n.createVM(vm)
	if vm.Labels[templates.LabelVMTemplate] != name {
		t.Errorf("vm labels %v", vm.Labels)
	}
	n.waitVMIOfVM("catalogue", 3*time.Minute)
	s := n.waitBooted("catalogue")
	if !s.contains("NODEVIRT-DISK vda") {
		t.Errorf("the guest did not see its cloned root disk as vda")
	}
	t.Logf("VM from the catalogue: DataImportCron → guest READY in %s", time.Since(t0).Round(time.Millisecond))
}
