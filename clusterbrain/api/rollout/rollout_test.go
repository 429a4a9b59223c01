package rollout

import (
	"testing"

	kubevirtv1 "kubevirt.io/api/core/v1"
)

func TestFromKubeVirt(t *testing.T) {
	kv := func(strategy *kubevirtv1.VMRolloutStrategy, lu *kubevirtv1.LiveUpdateConfiguration, gates ...string) *kubevirtv1.KubeVirt {
		return &kubevirtv1.KubeVirt{Spec: kubevirtv1.KubeVirtSpec{Configuration: kubevirtv1.KubeVirtConfiguration{VMRolloutStrategy: strategy,
			LiveUpdateConfiguration: lu, DeveloperConfiguration: &kubevirtv1.DeveloperConfiguration{FeatureGates: gates}}}}
	}
	stage, live := kubevirtv1.VMRolloutStrategyStage, kubevirtv1.VMRolloutStrategyLiveUpdate
	six := uint32(6)
	for _, c := range []struct {
		name string
		kv   *kubevirtv1.KubeVirt
		want Cluster
	}{
		{"no CR", nil, Cluster{}},
		{"no gate", kv(nil, nil), Cluster{}},
		{"stage", kv(&stage, nil, "DeclarativeHotplugVolumes"), Cluster{DeclarativeHotplug: true, Stage: true}},
		{"live update", kv(&live, nil, "DeclarativeHotplugVolumes"), Cluster{DeclarativeHotplug: true}},
		{"older gate wins", kv(&live, nil, "DeclarativeHotplugVolumes", "HotplugVolumes"), Cluster{}},
		{"live update configuration", kv(nil, &kubevirtv1.LiveUpdateConfiguration{MaxCpuSockets: &six, MaxHotplugRatio: 2}),
			Cluster{MaxCPUSockets: 6, MaxHotplugRatio: 2}},
	} {
		if got := FromKubeVirt(c.kv); got != c.want {
			t.Errorf("%s: %+v, want %+v", c.name, got, c.want)
		}
	}
	// The zero Cluster (an unset live.Value) is the settings without a CR.
	if FromKubeVirt(nil) != (Cluster{}) {
		t.Error("no CR is not the zero Cluster")
	}
	if !FromKubeVirt(kv(nil, nil)).LiveUpdate() || FromKubeVirt(kv(&stage, nil)).LiveUpdate() {
		t.Error("LiveUpdate is not KubeVirt's default, or Stage does not turn it off")
	}
}

func TestSetupCPUHotplug(t *testing.T) {
	spec := func(sockets, cores, maxSockets uint32) *kubevirtv1.VirtualMachineInstanceSpec {
		return &kubevirtv1.VirtualMachineInstanceSpec{Domain: kubevirtv1.DomainSpec{CPU: &kubevirtv1.CPU{
			Sockets: sockets, Cores: cores, Threads: 1, MaxSockets: maxSockets}}}
	}
	for _, c := range []struct {
		name    string
		cluster Cluster
		spec    *kubevirtv1.VirtualMachineInstanceSpec
		want    uint32
	}{
		{"default ratio", Cluster{}, spec(2, 1, 0), 8},
		{"cluster ratio", Cluster{MaxHotplugRatio: 3}, spec(2, 1, 0), 6},
		{"cluster maximum", Cluster{MaxCPUSockets: 5}, spec(2, 1, 0), 5},
		{"cluster maximum below the sockets", Cluster{MaxCPUSockets: 2}, spec(3, 1, 0), 3},
		{"own maximum kept", Cluster{MaxCPUSockets: 5}, spec(2, 1, 3), 3},
		{"bounded by the vCPUs q35 takes", Cluster{}, spec(16, 8, 0), 31},
		{"never below the sockets", Cluster{}, spec(64, 8, 0), 64},
		{"stage", Cluster{Stage: true}, spec(2, 1, 0), 0},
	} {
		c.cluster.SetupCPUHotplug(c.spec)
		if got := c.spec.Domain.CPU.MaxSockets; got != c.want {
			t.Errorf("%s: maxSockets %d, want %d", c.name, got, c.want)
		}
	}
}
