package rollout

import (
	"testing"

	kubevirtv1 "kubevirt.io/api/core/v1"
)

func TestFromKubeVirt(t *testing.T) {
	kv := func(strategy *kubevirtv1.VMRolloutStrategy, gates ...string) *kubevirtv1.KubeVirt {
		return &kubevirtv1.KubeVirt{Spec: kubevirtv1.KubeVirtSpec{Configuration: kubevirtv1.KubeVirtConfiguration{VMRolloutStrategy: strategy,
			DeveloperConfiguration: &kubevirtv1.DeveloperConfiguration{FeatureGates: gates}}}}
	}
	stage, live := kubevirtv1.VMRolloutStrategyStage, kubevirtv1.VMRolloutStrategyLiveUpdate
	for _, c := range []struct {
		name string
		kv   *kubevirtv1.KubeVirt
		want Cluster
	}{
		{"no CR", nil, Cluster{}},
		{"no gate", kv(nil), Cluster{}},
		{"stage", kv(&stage, "DeclarativeHotplugVolumes"), Cluster{DeclarativeHotplug: true}},
		{"live update", kv(&live, "DeclarativeHotplugVolumes"), Cluster{DeclarativeHotplug: true}},
		{"older gate wins", kv(&live, "DeclarativeHotplugVolumes", "HotplugVolumes"), Cluster{}},
	} {
		if got := FromKubeVirt(c.kv); got != c.want {
			t.Errorf("%s: %+v, want %+v", c.name, got, c.want)
		}
	}
	// The zero Cluster (an unset live.Value) is the settings without a CR.
	if FromKubeVirt(nil) != (Cluster{}) {
		t.Error("no CR is not the zero Cluster")
	}
}
