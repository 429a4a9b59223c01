package featuregate

import (
	"slices"
	"testing"

	kubevirtv1 "kubevirt.io/api/core/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"
)

func TestEnabled(t *testing.T) {
	kv := func(on, off []string) *kubevirtv1.KubeVirt {
		return &kubevirtv1.KubeVirt{Spec: kubevirtv1.KubeVirtSpec{Configuration: kubevirtv1.KubeVirtConfiguration{
			DeveloperConfiguration: &kubevirtv1.DeveloperConfiguration{FeatureGates: on, DisabledFeatureGates: off}}}}
	}
	for _, c := range []struct {
		kv   *kubevirtv1.KubeVirt
		want bool
	}{
		{nil, false},
		{&kubevirtv1.KubeVirt{}, false},
		{kv(nil, nil), false},
		{kv([]string{"Sidecar"}, nil), false},
		{kv([]string{HostDisk}, nil), true},
		{kv([]string{HostDisk}, []string{HostDisk}), false},
	} {
		if got := KubeVirtEnabled(c.kv, HostDisk); got != c.want {
			t.Errorf("KubeVirtEnabled(%+v) = %v", c.kv, got)
		}
	}
	if CDIEnabled(nil, HonorWaitForFirstConsumer) || !CDIEnabled(&cdiv1.CDIConfigSpec{FeatureGates: []string{HonorWaitForFirstConsumer}}, HonorWaitForFirstConsumer) {
		t.Error("CDIEnabled")
	}
	if got := Implemented([]string{"CPUManager", VideoConfig, "Snapshot", HostDisk}, KubeVirtImplemented); !slices.Equal(got, []string{VideoConfig, HostDisk}) {
		t.Errorf("Implemented = %v", got)
	}
}
