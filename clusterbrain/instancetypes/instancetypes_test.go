package instancetypes

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	kubevirtv1 "kubevirt.io/api/core/v1"
	instancetypev1beta1 "kubevirt.io/api/instancetype/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

func TestMain(m *testing.M) { controlplane.Main(m, controlplane.Config{}) }

func TestCatalogHasUpstreamSeriesAndSizes(t *testing.T) {
	its := ClusterInstancetypes()
	by := map[string]*instancetypev1beta1.VirtualMachineClusterInstancetype{}
	perSeries := map[string]int{}
	for _, it := range its {
		if by[it.Name] != nil {
			t.Errorf("duplicate %s", it.Name)
		}
		by[it.Name] = it
		perSeries[strings.SplitN(it.Name, ".", 2)[0]]++
	}
	want := map[string]int{"u1": 10, "o1": 9, "cx1": 12, "m1": 10, "n1": 6}
	for s, n := range want {
		if perSeries[s] != n {
			t.Errorf("%s has %d sizes, want %d", s, perSeries[s], n)
		}
	}
	check := func(name string, cpu uint32, mem string) *instancetypev1beta1.VirtualMachineClusterInstancetype {
		it := by[name]
		if it == nil {
			t.Fatalf("%s missing", name)
		}
		if it.Spec.CPU.Guest != cpu || it.Spec.Memory.Guest.String() != mem {
			t.Errorf("%s = %d vCPU %s, want %d %s", name, it.Spec.CPU.Guest, it.Spec.Memory.Guest.String(), cpu, mem)
		}
		if it.Labels[LabelCPU] != fmt.Sprint(cpu) || it.Labels[LabelMemory] != mem || it.Labels[LabelVendor] != Vendor {
			t.Errorf("%s labels = %v", name, it.Labels)
		}
		return it
	}
	check("u1.nano", 1, "512Mi")
	check("u1.medium", 1, "4Gi")
	check("u1.2xmedium", 2, "4Gi")
	check("u1.8xlarge", 32, "128Gi")
	if o := check("o1.small", 1, "2Gi"); o.Spec.Memory.OvercommitPercent != 50 {
		t.Errorf("o1 overcommit = %d", o.Spec.Memory.OvercommitPercent)
	}
	cx := check("cx1.2xlarge1gi", 8, "16Gi")
	if cx.Spec.Memory.Hugepages.PageSize != "1Gi" || *cx.Spec.CPU.MaxSockets != 8 || !*cx.Spec.CPU.DedicatedCPUPlacement ||
		cx.Spec.CPU.NUMA.GuestMappingPassthrough == nil || *cx.Spec.IOThreadsPolicy != kubevirtv1.IOThreadsPolicyAuto || cx.Labels[LabelSize] != "2xlarge" {
		t.Errorf("cx1.2xlarge1gi = %+v labels %v", cx.Spec, cx.Labels)
	}
	if m := check("m1.large", 2, "16Gi"); m.Spec.Memory.Hugepages.PageSize != "2Mi" {
		t.Errorf("m1.large pages = %+v", m.Spec.Memory.Hugepages)
	}
	n := check("n1.medium", 4, "4Gi")
	if n.Spec.Memory.Hugepages.PageSize != "1Gi" || !*n.Spec.CPU.IsolateEmulatorThread || n.Spec.Annotations["cpu-quota.crio.io"] != "disable" {
		t.Errorf("n1.medium = %+v", n.Spec)
	}
}

func TestPreferencesComposeFromKnownFields(t *testing.T) {
	prefs, err := ClusterPreferences()
	if err != nil {
		t.Fatal(err)
	}
	// Every component names real fields of the preference spec.
	for _, p := range catalogPreferences {
		for _, c := range p.components {
			dec := json.NewDecoder(bytes.NewReader([]byte(c)))
			dec.DisallowUnknownFields()
			var spec instancetypev1beta1.VirtualMachinePreferenceSpec
			if err := dec.Decode(&spec); err != nil {
				t.Errorf("%s: component %s: %v", p.name, c, err)
			}
		}
	}
	by := map[string]*instancetypev1beta1.VirtualMachineClusterPreference{}
	for _, p := range prefs {
		by[p.Name] = p
	}
	w := by["windows.11"]
	if w == nil {
		t.Fatal("windows.11 missing")
	}
	s := w.Spec
	if s.Requirements.CPU.Guest != 2 || s.Requirements.Memory.Guest.String() != "4Gi" || !*s.Devices.PreferredTPM.Persistent ||
		!*s.Firmware.PreferredEfi.SecureBoot || !*s.Firmware.PreferredEfi.Persistent || s.Features.PreferredSmm == nil ||
		s.Devices.PreferredDiskBus != "sata" || s.Features.PreferredHyperv.Spinlocks == nil || *s.CPU.PreferredCPUTopology != instancetypev1beta1.Cores {
		t.Errorf("windows.11 = %+v", s)
	}
	f := by["fedora"].Spec
	if *f.PreferredArchitecture != "amd64" || *f.Requirements.Architecture != "amd64" || f.Devices.PreferredDiskBus != "virtio" ||
		f.Devices.PreferredInterfaceModel != "virtio" || f.Devices.PreferredRng == nil || !*f.Firmware.PreferredEfi.SecureBoot {
		t.Errorf("fedora = %+v", f)
	}
	if d := by["debian"].Spec; *d.Firmware.PreferredEfi.SecureBoot || d.Requirements.Memory.Guest.String() != "512Mi" {
		t.Errorf("debian = %+v", d)
	}
	if c := by["centos.stream9"]; !*c.Spec.Devices.PreferredDiskDedicatedIoThread || c.Labels[LabelReqMemory] != "1.5Gi" {
		t.Errorf("centos.stream9 = %+v %v", c.Spec, c.Labels)
	}
}

func TestRoleInstallsRestoresAndHonoursTheSwitch(t *testing.T) {
	cp := controlplane.Shared(t)
	ctx := context.Background()
	testkit.InstallCRDs(t, cp)
	rc := rest.CopyConfig(cp.RestConfig)
	rc.QPS, rc.Burst = 200, 400 // as the brain sets it
	virt, err := client.NewSet(rc)
	if err != nil {
		t.Fatal(err)
	}
	ns := cp.Namespace(t)
	r, err := New(Config{Virt: virt, Namespace: ns, Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	n, err := r.Sync(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("first sync wrote %d objects in %v", n, time.Since(start).Round(time.Millisecond))
	prefs, _ := ClusterPreferences()
	if want := len(ClusterInstancetypes()) + len(prefs); n != want {
		t.Errorf("first sync wrote %d, want %d", n, want)
	}
	if n, err := r.Sync(ctx); err != nil || n != 0 {
		t.Fatalf("second sync wrote %d (%v), want nothing", n, err)
	}

	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = r.Run(runCtx) }()
	defer func() { cancel(); <-done }()

	if _, err := virt.ClusterInstancetypes.Patch(ctx, "", "u1.medium", types.MergePatchType, []byte(`{"spec":{"cpu":{"guest":7}}}`), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := virt.ClusterPreferences.Delete(ctx, "", "rhel.9", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 20*time.Second, "the expected catalog", func() error {
		it, err := virt.ClusterInstancetypes.Get(ctx, "", "u1.medium")
		if err != nil {
			return err
		}
		if it.Spec.CPU.Guest != 1 {
			return fmt.Errorf("u1.medium cpu %d", it.Spec.CPU.Guest)
		}
		_, err = virt.ClusterPreferences.Get(ctx, "", "rhel.9")
		return err
	})

	off := false
	kv := &kubevirtv1.KubeVirt{ObjectMeta: metav1.ObjectMeta{Name: "kubevirt", Namespace: ns},
		Spec: kubevirtv1.KubeVirtSpec{Configuration: kubevirtv1.KubeVirtConfiguration{
			CommonInstancetypesDeployment: &kubevirtv1.CommonInstancetypesDeployment{Enabled: &off}}}}
	if _, err := virt.KubeVirts.Create(ctx, kv); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 20*time.Second, "the expected catalog", func() error {
		its, err := virt.ClusterInstancetypes.List(ctx, "", metav1.ListOptions{LabelSelector: LabelManagedBy + "=" + ManagedBy})
		if err != nil {
			return err
		}
		if len(its) > 0 {
			return fmt.Errorf("%d instance types left with the deployment disabled", len(its))
		}
		return nil
	})
}
