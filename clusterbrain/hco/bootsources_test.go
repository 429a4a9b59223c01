package hco

import (
	"testing"

	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"
)

func TestBootSourcesFollowEnableCommonBootImageImport(t *testing.T) {
	hc := hcoFrom(t, `{"spec":{"commonBootImageNamespace":"golden","dataImportCronTemplates":[
		{"metadata":{"name":"fedora-image-cron"},"spec":{"managedDataSource":"fedora","schedule":"1 1 * * *","template":{"spec":{}}}},
		{"metadata":{"name":"mine","namespace":"elsewhere"},"spec":{"managedDataSource":"mine","schedule":"1 1 * * *","template":{"spec":{}}}}]}}`)
	SetDefaults(hc)
	got := map[string]string{}
	var fedoraSchedule string
	for _, d := range dataImportCronTemplates(&hc.Spec) {
		got[d.Name] = d.Namespace
		if d.Name == "fedora-image-cron" {
			fedoraSchedule = d.Spec.Schedule
		}
		if d.Name == "centos-stream9-image-cron" && (d.Spec.Template.Spec.Source.Registry.URL == nil ||
			*d.Spec.Template.Spec.Source.Registry.URL != "docker://quay.io/containerdisks/centos-stream:9" ||
			*d.Spec.GarbageCollect != cdiv1.DataImportCronGarbageCollectOutdated) {
			t.Errorf("centos-stream9 default: %+v", d.Spec)
		}
	}
	want := map[string]string{"centos-stream9-image-cron": "golden", "centos-stream10-image-cron": "golden",
		"fedora-image-cron": "golden", "mine": "elsewhere"}
	if len(got) != len(want) {
		t.Errorf("templates %v, want %v", got, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s in %q, want %q", k, got[k], v)
		}
	}
	if fedoraSchedule != "1 1 * * *" {
		t.Errorf("the user's fedora template does not replace the default: schedule %q", fedoraSchedule)
	}
	off := false
	hc.Spec.EnableCommonBootImageImport = &off
	if n := len(dataImportCronTemplates(&hc.Spec)); n != 2 {
		t.Errorf("with enableCommonBootImageImport off: %d templates, want the user's 2", n)
	}
}

func TestV1OnlyFieldsWarn(t *testing.T) {
	hc := hcoFrom(t, `{"metadata":{"annotations":{"hco.kubevirt.io/v1-only-fields":"{\"deployment\":{\"deployNetworkResourcesInjector\":true}}"}}}`)
	w, err := Validate(hc, nil)
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, s := range w {
		found = found || s == "spec.deployment.deployNetworkResourcesInjector (hco.kubevirt.io/v1) has no effect in nodevirt"
	}
	if !found {
		t.Errorf("warnings %q", w)
	}
	if w, _ := Validate(hc, hc); len(w) != 0 {
		t.Errorf("unchanged v1-only field warned again: %q", w)
	}
}
