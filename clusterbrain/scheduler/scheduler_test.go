package scheduler

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	nadv1 "github.com/k8snetworkplumbingwg/network-attachment-definition-client/pkg/apis/k8s.cni.cncf.io/v1"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	snapshotv1 "github.com/nodevirt/nodevirt/clusterbrain/api/volumesnapshot/v1"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

func TestMain(m *testing.M) { controlplane.Main(m, controlplane.Config{}) }

type env struct {
	kube  kubernetes.Interface
	virt  *client.Set
	ns    string
	t     *testing.T
	sched *Scheduler
}

func setup(t *testing.T) env { t.Helper(); return setupWith(t, nil) }

// setupWith is setup with edit applied to the scheduler's Config.
func setupWith(t *testing.T, edit func(*Config)) env {
	t.Helper()
	cp := controlplane.Shared(t)
	testkit.InstallCRDs(t, cp)
	testkit.InstallSnapshotCRDs(t, cp)
	rc := rest.CopyConfig(cp.RestConfig)
	rc.QPS, rc.Burst = 500, 1000
	virt, err := client.NewSet(rc)
	if err != nil {
		t.Fatal(err)
	}
	kube := kubernetes.NewForConfigOrDie(rc)
	e := env{kube: kube, virt: virt, ns: cp.Namespace(t), t: t}
	t.Cleanup(func() { // no controller manager here to empty the namespace
		vmis, _ := virt.VMIs.List(context.Background(), e.ns, metav1.ListOptions{})
		for _, v := range vmis {
			_ = virt.VMIs.Delete(context.Background(), e.ns, v.Name, metav1.DeleteOptions{})
		}
	})
	cfg := Config{Kube: kube, Virt: virt, Retry: time.Second, Snapshots: snapshotv1.NewClient(dynamic.NewForConfigOrDie(rc)),
		Log: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))}
	if edit != nil {
		edit(&cfg)
	}
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	e.sched = s
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = s.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return e
}

type nodeSpec struct {
	cpu, mem    string
	labels      map[string]string
	ext         map[string]string
	taints      []corev1.Taint
	unscheduled bool // without kubevirt.io/schedulable=true
}

func (e env) node(name string, s nodeSpec) {
	e.t.Helper()
	ctx := context.Background()
	lbl := map[string]string{"kubernetes.io/hostname": name}
	if !s.unscheduled {
		lbl[SchedulableLabel] = "true"
	}
	for k, v := range s.labels {
		lbl[k] = v
	}
	res := corev1.ResourceList{corev1.ResourceCPU: resource.MustParse(s.cpu), corev1.ResourceMemory: resource.MustParse(s.mem)}
	for k, v := range s.ext {
		res[corev1.ResourceName(k)] = resource.MustParse(v)
	}
	n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: lbl}, Spec: corev1.NodeSpec{Taints: s.taints},
		Status: corev1.NodeStatus{Capacity: res, Allocatable: res,
			Conditions: []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue}}}}
	cur, err := e.kube.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		if cur, err = e.kube.CoreV1().Nodes().Create(ctx, n, metav1.CreateOptions{}); err != nil {
			e.t.Fatal(err)
		}
		e.t.Cleanup(func() { _ = e.kube.CoreV1().Nodes().Delete(context.Background(), name, metav1.DeleteOptions{}) })
	}
	{ // also drops the not-ready taint the apiserver puts on new nodes
		cur.Labels, cur.Spec.Taints = lbl, s.taints
		if cur, err = e.kube.CoreV1().Nodes().Update(ctx, cur, metav1.UpdateOptions{}); err != nil {
			e.t.Fatal(err)
		}
	}
	cur.Status = n.Status
	if _, err := e.kube.CoreV1().Nodes().UpdateStatus(ctx, cur, metav1.UpdateOptions{}); err != nil {
		e.t.Fatal(err)
	}
}

func (e env) vmi(name, mem string, edit func(*kubevirtv1.VirtualMachineInstance)) {
	e.t.Helper()
	vmi := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name}}
	vmi.Spec.Domain.Resources.Requests = corev1.ResourceList{corev1.ResourceMemory: resource.MustParse(mem)}
	if edit != nil {
		edit(vmi)
	}
	if _, err := e.virt.VMIs.Create(context.Background(), vmi); err != nil {
		e.t.Fatal(err)
	}
}

// outcome waits until the VMI is bound or marked unschedulable and
// returns the node or the message.
func (e env) outcome(name string) (node, msg string) {
	e.t.Helper()
	err := testkit.Wait(testkit.Interval, 20*time.Second, "vmi "+name+" bound or unschedulable", func() (bool, error) {
		v, err := e.virt.VMIs.Get(context.Background(), e.ns, name)
		if err != nil {
			return false, nil
		}
		if v.Status.NodeName != "" {
			if v.Status.Phase != kubevirtv1.Scheduled {
				return false, testkit.Stop(fmt.Errorf("bound with phase %s", v.Status.Phase))
			}
			node = v.Status.NodeName
			return v.Labels[kubevirtv1.NodeNameLabel] == node, nil
		}
		for _, c := range v.Status.Conditions {
			if string(c.Type) == "PodScheduled" && c.Reason == "Unschedulable" {
				msg = c.Message
				return true, nil
			}
		}
		return false, nil
	})
	if err != nil {
		e.t.Fatal(err)
	}
	return node, msg
}

// waitBound waits until the VMI is bound (past an earlier Unschedulable).
func (e env) waitBound(name string) string {
	e.t.Helper()
	var node, msg string
	_ = testkit.Wait(testkit.Interval, 20*time.Second, "vmi "+name+" bound", func() (bool, error) {
		node, msg = e.outcome(name)
		return node != "", nil
	})
	if node == "" {
		e.t.Errorf("vmi %s never bound: %s", name, msg)
	}
	return node
}

func (e env) wantNode(name string, nodes ...string) {
	e.t.Helper()
	got, msg := e.outcome(name)
	for _, n := range nodes {
		if got == n {
			return
		}
	}
	e.t.Errorf("vmi %s on %q (%s), want one of %v", name, got, msg, nodes)
}

func (e env) wantUnschedulable(name, want string) {
	e.t.Helper()
	got, msg := e.outcome(name)
	if got != "" || msg != want {
		e.t.Errorf("vmi %s: node %q message %q, want %q", name, got, msg, want)
	}
}

func TestResourcesSelectorsTaints(t *testing.T) {
	e := setup(t)
	taint := corev1.Taint{Key: "dedicated", Value: "db", Effect: corev1.TaintEffectNoSchedule}
	e.node("rst-1", nodeSpec{cpu: "4", mem: "4Gi", labels: map[string]string{"zone": "a"}})
	e.node("rst-2", nodeSpec{cpu: "4", mem: "8Gi", labels: map[string]string{"zone": "b"}, taints: []corev1.Taint{taint}})
	e.node("rst-3", nodeSpec{cpu: "2", mem: "2Gi", labels: map[string]string{"zone": "a"}, unscheduled: true})
	tolerate := func(v *kubevirtv1.VirtualMachineInstance) {
		v.Spec.Tolerations = []corev1.Toleration{{Key: "dedicated", Operator: corev1.TolerationOpEqual, Value: "db", Effect: corev1.TaintEffectNoSchedule}}
	}

	e.vmi("big", "6Gi", nil)
	e.wantUnschedulable("big", "0/3 nodes are available: 1 insufficient memory, 1 not schedulable, 1 untolerated taint {dedicated: db}.")
	e.vmi("big-tolerating", "6Gi", tolerate)
	e.wantNode("big-tolerating", "rst-2")
	e.vmi("zone-b", "1Gi", func(v *kubevirtv1.VirtualMachineInstance) {
		tolerate(v)
		v.Spec.NodeSelector = map[string]string{"zone": "b"}
	})
	e.wantNode("zone-b", "rst-2")
	e.vmi("zone-a", "1Gi", func(v *kubevirtv1.VirtualMachineInstance) {
		tolerate(v)
		v.Spec.Affinity = &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{RequiredDuringSchedulingIgnoredDuringExecution: &corev1.NodeSelector{
			NodeSelectorTerms: []corev1.NodeSelectorTerm{{MatchExpressions: []corev1.NodeSelectorRequirement{{Key: "zone", Operator: corev1.NodeSelectorOpIn, Values: []string{"a"}}}}}}}}
	})
	e.wantNode("zone-a", "rst-1")
	e.vmi("too-many-cpus", "1Gi", func(v *kubevirtv1.VirtualMachineInstance) {
		v.Spec.Domain.Resources.Requests[corev1.ResourceCPU] = resource.MustParse("5")
	})
	e.wantUnschedulable("too-many-cpus", "0/3 nodes are available: 1 insufficient cpu, 1 not schedulable, 1 untolerated taint {dedicated: db}.")

	// A node that grows and becomes schedulable takes the waiting VMI.
	e.node("rst-3", nodeSpec{cpu: "8", mem: "16Gi", labels: map[string]string{"zone": "a"}})
	if n := e.waitBound("big"); n != "rst-3" {
		t.Errorf("big on %s, want rst-3", n)
	}
}

func (e env) nad(name, res string) {
	e.t.Helper()
	n := &nadv1.NetworkAttachmentDefinition{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name,
		Annotations: map[string]string{NADResourceName: res}},
		Spec: nadv1.NetworkAttachmentDefinitionSpec{Config: `{"cniVersion":"0.3.1","type":"cnv-bridge","bridge":"br1"}`}}
	if _, err := e.virt.NADs.Create(context.Background(), n); err != nil {
		e.t.Fatal(err)
	}
}

func onNAD(nad string) func(*kubevirtv1.VirtualMachineInstance) {
	return func(v *kubevirtv1.VirtualMachineInstance) {
		v.Spec.Networks = []kubevirtv1.Network{{Name: "br", NetworkSource: kubevirtv1.NetworkSource{Multus: &kubevirtv1.MultusNetwork{NetworkName: nad}}}}
		v.Spec.Domain.Devices.Interfaces = []kubevirtv1.Interface{{Name: "br", InterfaceBindingMethod: kubevirtv1.InterfaceBindingMethod{Bridge: &kubevirtv1.InterfaceBridge{}}}}
	}
}

func TestBridgeResources(t *testing.T) {
	e := setup(t)
	br := map[string]string{BridgePrefix + "br1": "1k"}
	e.node("brg-a", nodeSpec{cpu: "4", mem: "1Gi", ext: br})
	e.node("brg-b", nodeSpec{cpu: "4", mem: "1Gi", ext: br})
	e.node("brg-c", nodeSpec{cpu: "4", mem: "8Gi"})
	e.nad("br1-net", BridgePrefix+"br1")
	e.vmi("large", "4Gi", onNAD("br1-net"))
	e.wantUnschedulable("large", "0/3 nodes are available: 2 insufficient memory, 1 lacks bridge br1.")
	e.vmi("small", "512Mi", onNAD(e.ns+"/br1-net"))
	e.wantNode("small", "brg-a", "brg-b")
	e.vmi("no-nad", "512Mi", onNAD("missing"))
	e.wantUnschedulable("no-nad", "0/3 nodes are available: network-attachment-definition "+e.ns+"/missing not found.")
	e.vmi("plain", "4Gi", nil)
	e.wantNode("plain", "brg-c")
}

func TestAntiAffinityAndBurst(t *testing.T) {
	e := setup(t)
	for _, n := range []string{"aff-1", "aff-2", "aff-3"} {
		e.node(n, nodeSpec{cpu: "2", mem: "4Gi"})
	}
	anti := func(v *kubevirtv1.VirtualMachineInstance) {
		v.Labels = map[string]string{"app": "web"}
		v.Spec.Affinity = &corev1.Affinity{PodAntiAffinity: &corev1.PodAntiAffinity{RequiredDuringSchedulingIgnoredDuringExecution: []corev1.PodAffinityTerm{{
			LabelSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "web"}}, TopologyKey: "kubernetes.io/hostname"}}}}
	}
	seen := map[string]bool{}
	for i := 0; i < 3; i++ {
		name := fmt.Sprintf("web-%d", i)
		e.vmi(name, "256Mi", anti)
		node, msg := e.outcome(name)
		if node == "" || seen[node] {
			t.Errorf("%s on %q (%s) with others on %v", name, node, msg, seen)
		}
		seen[node] = true
	}
	e.vmi("web-3", "256Mi", anti)
	e.wantUnschedulable("web-3", "0/3 nodes are available: 3 didn't match VMI anti-affinity rules.")
	e.vmi("friend", "256Mi", func(v *kubevirtv1.VirtualMachineInstance) {
		v.Spec.Affinity = &corev1.Affinity{PodAffinity: &corev1.PodAffinity{RequiredDuringSchedulingIgnoredDuringExecution: []corev1.PodAffinityTerm{{
			LabelSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "web"}}, TopologyKey: "kubernetes.io/hostname"}}}}
	})
	if node, msg := e.outcome("friend"); !seen[node] {
		t.Errorf("friend on %q (%s)", node, msg)
	}

	// Burst: 3 nodes × 4Gi minus what is placed take exactly as many 1Gi
	// VMIs as fit; no node is overbooked.
	var wg sync.WaitGroup
	for i := 0; i < 15; i++ {
		wg.Add(1)
		go func() { defer wg.Done(); e.vmi(fmt.Sprintf("burst-%02d", i), "1Gi", nil) }()
	}
	wg.Wait()
	bound := 0
	for i := 0; i < 15; i++ {
		if node, _ := e.outcome(fmt.Sprintf("burst-%02d", i)); node != "" {
			bound++
		}
	}
	// Each node holds 256Mi or 512Mi already, so three 1Gi VMIs fit on each.
	if bound != 9 {
		t.Errorf("%d of 15 bound, want 9", bound)
	}
	vmis, _ := e.virt.VMIs.List(context.Background(), e.ns, metav1.ListOptions{})
	used := map[string]int64{}
	for _, v := range vmis {
		if v.Status.NodeName != "" {
			used[v.Status.NodeName] += v.Spec.Domain.Resources.Requests.Memory().Value()
		}
	}
	for n, u := range used {
		if u > 4<<30 {
			t.Errorf("node %s overbooked: %d bytes", n, u)
		}
	}
}

func TestVolumeLocality(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	e.node("vol-x", nodeSpec{cpu: "4", mem: "4Gi"})
	e.node("vol-y", nodeSpec{cpu: "4", mem: "4Gi"})
	pv := &corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: e.ns + "-pv"}, Spec: corev1.PersistentVolumeSpec{
		Capacity:               corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
		AccessModes:            []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
		PersistentVolumeSource: corev1.PersistentVolumeSource{Local: &corev1.LocalVolumeSource{Path: "/var/lib/x"}},
		NodeAffinity: &corev1.VolumeNodeAffinity{Required: &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{{
			MatchExpressions: []corev1.NodeSelectorRequirement{{Key: "kubernetes.io/hostname", Operator: corev1.NodeSelectorOpIn, Values: []string{"vol-y"}}}}}}},
	}}
	if _, err := e.kube.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.kube.CoreV1().PersistentVolumes().Delete(ctx, pv.Name, metav1.DeleteOptions{}) })
	none := ""
	claim := func(name string, sc *string, volume string) {
		pvc := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name}, Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}},
			StorageClassName: sc, VolumeName: volume}}
		if _, err := e.kube.CoreV1().PersistentVolumeClaims(e.ns).Create(ctx, pvc, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	claim("bound", &none, pv.Name)
	e.vmi("on-pv", "1Gi", func(v *kubevirtv1.VirtualMachineInstance) {
		v.Spec.Volumes = []kubevirtv1.Volume{{Name: "d", VolumeSource: kubevirtv1.VolumeSource{PersistentVolumeClaim: &kubevirtv1.PersistentVolumeClaimVolumeSource{
			PersistentVolumeClaimVolumeSource: corev1.PersistentVolumeClaimVolumeSource{ClaimName: "bound"}}}}}
	})
	e.wantNode("on-pv", "vol-y")

	wffc := storagev1.VolumeBindingWaitForFirstConsumer
	scName := e.ns + "-wffc"
	sc := &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: scName}, Provisioner: "kubevirt.io.hostpath-provisioner", VolumeBindingMode: &wffc}
	if _, err := e.kube.StorageV1().StorageClasses().Create(ctx, sc, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.kube.StorageV1().StorageClasses().Delete(ctx, scName, metav1.DeleteOptions{}) })
	dv := func(name string) func(*kubevirtv1.VirtualMachineInstance) {
		return func(v *kubevirtv1.VirtualMachineInstance) {
			v.Spec.Volumes = []kubevirtv1.Volume{{Name: "d", VolumeSource: kubevirtv1.VolumeSource{DataVolume: &kubevirtv1.DataVolumeSource{Name: name}}}}
		}
	}
	e.vmi("on-missing-dv", "1Gi", dv("later"))
	e.wantUnschedulable("on-missing-dv", "0/2 nodes are available: datavolume later has no persistentvolumeclaim yet.")
	claim("later", &scName, "")
	node := e.waitBound("on-missing-dv") // the claim's arrival retries it
	if node == "" {
		nodes, _ := e.kube.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
		for _, n := range nodes.Items {
			t.Logf("%s %v", n.Name, n.Status.Allocatable)
		}
		t.FailNow()
	}
	pvc, err := e.kube.CoreV1().PersistentVolumeClaims(e.ns).Get(ctx, "later", metav1.GetOptions{})
	if err != nil || pvc.Annotations[SelectedNodeAnno] != node {
		t.Errorf("claim not given the selected node %s: %v %v", node, err, pvc.Annotations)
	}
	if !strings.HasPrefix(node, "vol-") {
		t.Errorf("node %s", node)
	}
}

func TestKVMRequiredUnlessEmulation(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	e.node("kvm-no", nodeSpec{cpu: "4", mem: "4Gi", labels: map[string]string{KVMLabel: "false"}})
	e.node("kvm-yes", nodeSpec{cpu: "4", mem: "1Gi", labels: map[string]string{KVMLabel: "true"}})
	kv := &kubevirtv1.KubeVirt{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "kubevirt"}}
	if _, err := e.virt.KubeVirts.Create(ctx, kv); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond) // let the informer see it
	e.vmi("needs-kvm", "512Mi", nil)
	e.wantNode("needs-kvm", "kvm-yes")
	e.vmi("too-big-for-kvm", "2Gi", nil)
	e.wantUnschedulable("too-big-for-kvm", "0/2 nodes are available: 1 insufficient memory, 1 lacks kvm.")
	kv, _ = e.virt.KubeVirts.Get(ctx, e.ns, "kubevirt")
	kv.Spec.Configuration.DeveloperConfiguration = &kubevirtv1.DeveloperConfiguration{UseEmulation: true}
	if _, err := e.virt.KubeVirts.Update(ctx, kv); err != nil {
		t.Fatal(err)
	}
	if n := e.waitBound("too-big-for-kvm"); n != "kvm-no" {
		t.Errorf("with emulation allowed the vmi went to %q", n)
	}
	_ = e.virt.KubeVirts.Delete(ctx, e.ns, "kubevirt", metav1.DeleteOptions{})
}
