package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	nadv1 "github.com/k8snetworkplumbingwg/network-attachment-definition-client/pkg/apis/k8s.cni.cncf.io/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/retry"
	kubevirtv1 "kubevirt.io/api/core/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	nodemetrics "github.com/nodevirt/nodevirt/nodeagent/metrics"
	"github.com/nodevirt/nodevirt/test/lab"
	"github.com/nodevirt/nodevirt/test/netcapture"
)

// Live migration runs between two nodes in namespaces of their own (the
// first node is the host's libvirtd, which is not set up for migration):
// the suite's second node and a third one, started on first use on the same
// fabric, tainted like the second.

// third is the suite's third node, started by the first test that needs it.
var third struct {
	once  sync.Once
	err   error
	agent *daemon
}

// node3 is the run's third node.
func (e *env) node3() lab.Node {
	h := fnv.New32a()
	h.Write([]byte(e.run))
	return lab.NewNode(e.fabric(), e.nodeName+"-3", 3, e.path("node3"), fmt.Sprintf("10.79.%d.0/24", (h.Sum32()+1)%250))
}

// startThirdNode brings the third node up with its agent (once).
func (e *env) startThirdNode() error {
	third.once.Do(func() { third.err = e.bringUpThirdNode() })
	return third.err
}

func (e *env) bringUpThirdNode() error {
	if e.node2Err != nil {
		return fmt.Errorf("second node: %w", e.node2Err)
	}
	n := e.node3()
	if err := os.MkdirAll(n.Dir, 0o755); err != nil {
		return err
	}
	if err := lab.StartNode(n, []lab.Node{e.node2(), n}); err != nil {
		return err
	}
	kc := filepath.Join(n.Dir, "nodeagent.kubeconfig")
	if err := e.cp.WriteKubeconfig(kc, identity.NodeUser(n.Name), identity.NodesGroup); err != nil {
		return err
	}
	server, err := lab.UnderlayServer(e.fabric(), e.cp.URL)
	if err != nil {
		return err
	}
	if err := lab.PointKubeconfig(kc, server); err != nil {
		return err
	}
	if _, err := e.kube.CoreV1().Nodes().Create(context.Background(), &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: n.Name, Labels: map[string]string{"nodevirt.io/nodeagent": "standalone",
			corev1.LabelHostname: n.Name}},
		Spec: corev1.NodeSpec{Taints: []corev1.Taint{{Key: secondNodeTaint, Effect: corev1.TaintEffectNoSchedule}}},
	}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("pre-create node %s: %w", n.Name, err)
	}
	return e.startAgent3()
}

// startAgent3 starts (again) the third node's agent.
func (e *env) startAgent3() error {
	n := e.node3()
	argv := e.extraAgentCommand(n, filepath.Join(n.Dir, "nodeagent.kubeconfig"))
	third.agent = newDaemon(e, "nodeagent-3")
	third.agent.bin, third.agent.args = argv[0], argv[1:]
	return serveLibvirtTLS(n, third.agent)
}

// removeThirdNode stops the third node, if it was started.
func (e *env) removeThirdNode() error {
	if third.agent != nil {
		third.agent.stop()
	}
	n := e.node3()
	if _, err := os.Stat(n.Dir); err != nil {
		return nil
	}
	return lab.RemoveNode(n)
}

// withSharedHostDisks marks every hostDisk of the spec shared (the suite's
// disk directory is the same directory on every node).
func withSharedHostDisks() vmiOption {
	return func(s *kubevirtv1.VirtualMachineInstanceSpec) {
		yes := true
		for i := range s.Volumes {
			if s.Volumes[i].HostDisk != nil {
				s.Volumes[i].HostDisk.Shared = &yes
			}
		}
	}
}

// withLocalDataDisk adds a disk "data" (the guest's vdb) on a blank 64 MiB DataVolume
// (dataVolumeTemplate <vm>-data) of the node-local hostpath-csi class.
func withLocalDataDisk(vm *kubevirtv1.VirtualMachine) *kubevirtv1.VirtualMachine {
	class := "hostpath-csi"
	name := vm.Name + "-data"
	vm.Spec.DataVolumeTemplates = append(vm.Spec.DataVolumeTemplates, kubevirtv1.DataVolumeTemplateSpec{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: cdiv1.DataVolumeSpec{Source: &cdiv1.DataVolumeSource{Blank: &cdiv1.DataVolumeBlankImage{}},
			Storage: &cdiv1.StorageSpec{StorageClassName: &class, Resources: corev1.VolumeResourceRequirements{
				Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("64Mi")}}}},
	})
	s := &vm.Spec.Template.Spec
	// Right after the root disk: the guest's /dev/vdb.
	s.Domain.Devices.Disks = slices.Insert(s.Domain.Devices.Disks, 1, kubevirtv1.Disk{Name: "data",
		DiskDevice: kubevirtv1.DiskDevice{Disk: &kubevirtv1.DiskTarget{Bus: kubevirtv1.DiskBusVirtio}}})
	s.Volumes = append(s.Volumes, kubevirtv1.Volume{Name: "data", VolumeSource: kubevirtv1.VolumeSource{
		DataVolume: &kubevirtv1.DataVolumeSource{Name: name}}})
	return vm
}

// checkClaimOn checks that the VM's data claim (same name) is bound to the
// volume the migration made, pinned to node, and that the DataVolume
// still reports Succeeded; it waits for the source's volume to go.
func (n *testNS) checkClaimOn(mig *kubevirtv1.VirtualMachineInstanceMigration, claim, node, oldPV string) string {
	n.t.Helper()
	ctx := context.Background()
	want := "mig-" + string(mig.UID) + "-data"
	n.eventually(60*time.Second, "claim "+claim+" bound to "+want, func() (bool, string) {
		pvc, err := n.e.kube.CoreV1().PersistentVolumeClaims(n.name).Get(ctx, claim, metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		return pvc.Spec.VolumeName == want && pvc.Status.Phase == corev1.ClaimBound, pvc.Spec.VolumeName + " " + string(pvc.Status.Phase)
	})
	pv, err := n.e.kube.CoreV1().PersistentVolumes().Get(ctx, want, metav1.GetOptions{})
	if err != nil {
		n.t.Fatal(err)
	}
	if a := pv.Spec.NodeAffinity; a == nil || a.Required == nil || len(a.Required.NodeSelectorTerms) != 1 ||
		!slices.Equal(a.Required.NodeSelectorTerms[0].MatchExpressions[0].Values, []string{node}) {
		n.t.Errorf("pv %s is not pinned to %s: %+v", want, node, pv.Spec.NodeAffinity)
	}
	n.eventually(60*time.Second, "datavolume "+claim+" Succeeded, its claim owned", func() (bool, string) {
		dv, err := n.e.virt.DataVolumes.Get(ctx, n.name, claim)
		if err != nil {
			return false, err.Error()
		}
		pvc, err := n.e.kube.CoreV1().PersistentVolumeClaims(n.name).Get(ctx, claim, metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		return dv.Status.Phase == cdiv1.Succeeded && metav1.IsControlledBy(pvc, dv) && dv.Annotations["nodevirt.io/claim-moving"] == "",
			fmt.Sprintf("phase %s, annotations %v", dv.Status.Phase, dv.Annotations)
	})
	n.eventually(60*time.Second, "the source's volume "+oldPV+" deleted", func() (bool, string) {
		_, err := n.e.kube.CoreV1().PersistentVolumes().Get(ctx, oldPV, metav1.GetOptions{})
		return apierrors.IsNotFound(err), fmt.Sprint(err)
	})
	return want
}

func (n *testNS) boundPV(claim string) string {
	n.t.Helper()
	pvc, err := n.e.kube.CoreV1().PersistentVolumeClaims(n.name).Get(context.Background(), claim, metav1.GetOptions{})
	if err != nil {
		n.t.Fatal(err)
	}
	return pvc.Spec.VolumeName
}

// onNodes keeps a VMI on the named nodes.
func onNodes(names ...string) vmiOption {
	return func(s *kubevirtv1.VirtualMachineInstanceSpec) {
		s.Affinity = &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{RequiredDuringSchedulingIgnoredDuringExecution: &corev1.NodeSelector{
			NodeSelectorTerms: []corev1.NodeSelectorTerm{{MatchExpressions: []corev1.NodeSelectorRequirement{{
				Key: corev1.LabelHostname, Operator: corev1.NodeSelectorOpIn, Values: names}}}}}}}
	}
}

// guestFacts are what must survive a live migration.
type guestFacts struct{ bootID, disk, ram string }

var uuidRE = `[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}`

// readFacts logs into the guest's console and reads its boot id, the
// marker on the data disk and the one in RAM.
func (n *testNS) readFacts(vm string) guestFacts {
	n.t.Helper()
	c := n.console(vm)
	c.login()
	// The guest's page cache dropped first: the marker is read from the
	// disk as this node has it.
	c.send("sync; echo 3 > /proc/sys/vm/drop_caches; echo BOOTID=$(cat /proc/sys/kernel/random/boot_id) DISK=$(head -c 24 /dev/vdb) RAM=$(cat /run/e2e-mark 2>/dev/null) END\r")
	m := c.expect(`BOOTID=(`+uuidRE+`) DISK=(\S*) RAM=(\S*) END`, 30*time.Second)
	c.conn.Close()
	return guestFacts{bootID: m[1], disk: m[2], ram: m[3]}
}

// writeMarks writes mark on the guest's data disk (synced) and in its RAM.
func (n *testNS) writeMarks(vm, mark string) {
	n.t.Helper()
	c := n.console(vm)
	c.login()
	c.send(fmt.Sprintf("printf %%-24s %s > /dev/vdb && sync && echo %s > /run/e2e-mark && echo MARKED-$((40+2))\r", mark, mark))
	c.expect(`MARKED-42`, 30*time.Second)
	c.conn.Close()
}

// waitMigration waits until the migration ends and returns it.
func (n *testNS) waitMigration(name string, timeout time.Duration) *kubevirtv1.VirtualMachineInstanceMigration {
	n.t.Helper()
	var mig *kubevirtv1.VirtualMachineInstanceMigration
	n.eventually(timeout, "migration "+name+" ended", func() (bool, string) {
		m, err := n.e.virt.Migrations.Get(context.Background(), n.name, name)
		if err != nil {
			return false, err.Error()
		}
		mig = m
		return m.Status.Phase == kubevirtv1.MigrationSucceeded || m.Status.Phase == kubevirtv1.MigrationFailed, string(m.Status.Phase)
	})
	return mig
}

// checkSucceeded checks a migration's status as KubeVirt shows a
// successful one, and the VMI's.
func (n *testNS) checkSucceeded(mig *kubevirtv1.VirtualMachineInstanceMigration, from, to string) *kubevirtv1.VirtualMachineInstance {
	n.t.Helper()
	st := mig.Status.MigrationState
	if mig.Status.Phase != kubevirtv1.MigrationSucceeded || st == nil {
		n.t.Fatalf("migration %s: phase %s, state %+v", mig.Name, mig.Status.Phase, st)
	}
	if st.SourceNode != from || st.TargetNode != to || !st.Completed || st.Failed || st.StartTimestamp == nil ||
		st.EndTimestamp == nil || st.Mode != kubevirtv1.MigrationPreCopy || st.TargetNodeAddress == "" || st.MigrationUID != mig.UID {
		n.t.Errorf("migration %s state: %+v", mig.Name, st)
	}
	var phases []kubevirtv1.VirtualMachineInstanceMigrationPhase
	for _, p := range mig.Status.PhaseTransitionTimestamps {
		phases = append(phases, p.Phase)
	}
	want := []kubevirtv1.VirtualMachineInstanceMigrationPhase{kubevirtv1.MigrationPending, kubevirtv1.MigrationScheduling,
		kubevirtv1.MigrationScheduled, kubevirtv1.MigrationPreparingTarget, kubevirtv1.MigrationTargetReady,
		kubevirtv1.MigrationRunning, kubevirtv1.MigrationSucceeded}
	if !slices.Equal(phases, want) {
		n.t.Errorf("migration %s phases %v, want %v", mig.Name, phases, want)
	}
	var vmi *kubevirtv1.VirtualMachineInstance
	n.eventually(60*time.Second, "vmi "+mig.Spec.VMIName+" running on "+to, func() (bool, string) {
		v, err := n.e.virt.VMIs.Get(context.Background(), n.name, mig.Spec.VMIName)
		if err != nil {
			return false, err.Error()
		}
		vmi = v
		return v.Status.NodeName == to && v.Labels[kubevirtv1.NodeNameLabel] == to && v.Status.Phase == kubevirtv1.Running &&
				conditionTrue(v, kubevirtv1.VirtualMachineInstanceReady),
			fmt.Sprintf("node %s label %s phase %s", v.Status.NodeName, v.Labels[kubevirtv1.NodeNameLabel], v.Status.Phase)
	})
	if s := vmi.Status.MigrationState; s == nil || s.MigrationUID != mig.UID || !s.Completed || s.Failed || s.TargetNode != to {
		n.t.Errorf("vmi migrationState %+v", s)
	}
	return vmi
}

func conditionTrue(vmi *kubevirtv1.VirtualMachineInstance, t kubevirtv1.VirtualMachineInstanceConditionType) bool {
	for _, c := range vmi.Status.Conditions {
		if c.Type == t {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// domainOn is the state of the VMI's domain on node ("" when none).
func (n *testNS) domainOn(node lab.Node, vmi string) string {
	out, err := nodeVirsh(node, "domstate", domainName(n.name, vmi))
	if err != nil {
		return ""
	}
	return strings.TrimSpace(out)
}

// nodeGauge reads the gauge family of VMI vmi of the namespace from the
// /metrics of node's agent (loopback in the node's namespaces); ok says
// the series is there.
func (n *testNS) nodeGauge(node lab.Node, family, vmi string) (value float64, ok bool) {
	argv := lab.EnterCommand(node, "curl", "-sf", "--max-time", "10", "http://"+nodemetrics.DefaultAddr+"/metrics")
	out, err := exec.Command(argv[0], argv[1:]...).Output()
	if err != nil {
		n.t.Logf("metrics of %s: %v", node.Name, err)
		return 0, false
	}
	for _, line := range strings.Split(string(out), "\n") {
		if !strings.HasPrefix(line, family+"{") || !strings.Contains(line, `namespace="`+n.name+`"`) ||
			!strings.Contains(line, `name="`+vmi+`"`) {
			continue
		}
		v, err := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
		return v, err == nil
	}
	return 0, false
}

// setMigrationBandwidth sets HCO's liveMigrationConfig.bandwidthPerMigration
// ("" for none) and waits until the KubeVirt CR has it.
func (n *testNS) setMigrationBandwidth(q string) {
	n.t.Helper()
	ctx := context.Background()
	val := "null"
	if q != "" {
		val = `"` + q + `"`
	}
	patch := []byte(`{"spec":{"liveMigrationConfig":{"bandwidthPerMigration":` + val + `}}}`)
	if _, err := n.e.virt.HyperConvergeds.Patch(ctx, hcov1beta1.DefaultNamespace, hcov1beta1.Name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		n.t.Fatalf("hco bandwidthPerMigration %s: %v", q, err)
	}
	n.eventually(60*time.Second, "kubevirt bandwidthPerMigration "+q, func() (bool, string) {
		kvs, err := n.e.virt.KubeVirts.List(ctx, metav1.NamespaceAll, metav1.ListOptions{})
		if err != nil || len(kvs) == 0 {
			return false, fmt.Sprint("no kubevirt ", err)
		}
		mc := kvs[0].Spec.Configuration.MigrationConfiguration
		got := ""
		if mc != nil && mc.BandwidthPerMigration != nil && !mc.BandwidthPerMigration.IsZero() {
			got = mc.BandwidthPerMigration.String()
		}
		return got == q, "has " + got
	})
}

// TestLiveMigration: a running VM with a bridged NIC, its root disk on
// storage every node sees and a data disk on a node-local DataVolume is
// migrated by upstream `virtctl migrate` to the other node, then back by a
// VirtualMachineInstanceMigration (a migration of a migration); a third
// migration is cancelled by deleting it; then KubeVirt's drain taint on its
// node evacuates it. The guest keeps its boot id, the marker on its local
// disk and in its RAM, and its MAC; the VMIM goes through KubeVirt's phases;
// the data claim (same name, same DataVolume) ends bound to a volume on the
// new node and the source's volume is deleted; the cancelled migration
// leaves the VM running on its node, its claim untouched, the half-made
// target removed. Not parallel: it uses both namespaced nodes, changes the
// cluster's migration bandwidth and taints a node.
func TestLiveMigration(t *testing.T) {
	e := require(t)
	if err := e.startThirdNode(); err != nil {
		t.Fatalf("third node: %v", err)
	}
	node2, node3 := e.node2(), e.node3()
	nodes := map[string]lab.Node{node2.Name: node2, node3.Name: node3}
	n := e.namespace(t)
	ctx := context.Background()
	for _, nd := range []lab.Node{node2, node3} {
		n.waitNodeReady(nd.Name)
	}
	br := e.fabric().LabBridge
	conf, _ := json.Marshal(map[string]any{"cniVersion": "0.3.1", "name": "mig", "type": "cnv-bridge", "bridge": br, "macspoofchk": true})
	if _, err := e.virt.NADs.Create(ctx, &nadv1.NetworkAttachmentDefinition{
		ObjectMeta: metav1.ObjectMeta{Name: "mig", Namespace: n.name, Annotations: map[string]string{
			"k8s.v1.cni.cncf.io/resourceName": "bridge.network.kubevirt.io/" + br}},
		Spec: nadv1.NetworkAttachmentDefinitionSpec{Config: string(conf)},
	}); err != nil {
		t.Fatalf("create NetworkAttachmentDefinition: %v", err)
	}
	liveMigrate := func(s *kubevirtv1.VirtualMachineInstanceSpec) {
		st := kubevirtv1.EvictionStrategyLiveMigrate
		s.EvictionStrategy = &st
	}
	n.createVM(withLocalDataDisk(n.newVM("mover", kubevirtv1.RunStrategyAlways, withBridge("mig"), onSecondNodeToo(),
		onNodes(node2.Name, node3.Name), withSharedHostDisks(), liveMigrate,
		// A cloud-init seed: a writable node-local disk the migration
		// copies; it gives the guest its address on the bridge.
		withUserData("#!/bin/sh\n# nodevirt.ip="+moverIP+"/24\necho E2E-USERDATA-RAN\n"))))
	// A peer on the first node pings it five times a second.
	n.createVM(n.newVM("pinger", kubevirtv1.RunStrategyAlways, withBridge("mig"), withNodeSelector(e.nodeName),
		withUserData(pongUserData(pingerIP, moverIP))))
	vmi := n.waitVMIOfVM("mover", 3*time.Minute)
	firstPV := n.boundPV("mover-data")
	first := vmi.Status.NodeName
	other := node2.Name
	if first == node2.Name {
		other = node3.Name
	}
	n.serialOn(nodes[first], "mover").expect(`NODEVIRT-GUEST-READY`, bootTimeout)
	n.eventually(30*time.Second, "vmi mover LiveMigratable", func() (bool, string) {
		v, err := e.virt.VMIs.Get(ctx, n.name, "mover")
		return err == nil && conditionTrue(v, kubevirtv1.VirtualMachineInstanceIsMigratable), fmt.Sprintf("%+v %v", v.Status.Conditions, err)
	})
	mac := vmi.Status.Interfaces[0].MAC
	mark := "NVMARK-" + e.run
	n.writeMarks("mover", mark)
	before := n.readFacts("mover")
	if before.disk != mark || before.ram != mark {
		t.Fatalf("marks not written: %+v", before)
	}

	pings := n.serial("pinger")
	pings.expect(`E2E-PONG \S+ \d+ bytes from`, bootTimeout)

	// 1. Upstream virtctl migrate: the migrate subresource makes the VMIM.
	// The underlay of the source node is captured meanwhile: the stream
	// (memory, and the data disk over NBD) must be TLS, the marker in the
	// guest's RAM and on its disk nowhere in clear.
	capture, err := netcapture.Start("/run/netns/"+nodes[first].Netns(), "eth0", []byte(mark))
	if err != nil {
		t.Fatalf("capture on %s: %v", first, err)
	}
	pings.poll()
	pings.cursor = len(pings.out)
	start := time.Now()
	n.upstreamVirtctl().run(60*time.Second, "migrate", "mover")
	var mig *kubevirtv1.VirtualMachineInstanceMigration
	n.eventually(30*time.Second, "the VMIM virtctl migrate made", func() (bool, string) {
		migs, err := e.virt.Migrations.List(ctx, n.name, metav1.ListOptions{})
		if err != nil || len(migs) != 1 {
			return false, fmt.Sprint(len(migs), err)
		}
		mig = migs[0]
		return true, ""
	})
	if !strings.HasPrefix(mig.Name, "kubevirt-migrate-vm-") || mig.Spec.VMIName != "mover" {
		t.Errorf("virtctl's migration: %s for %q", mig.Name, mig.Spec.VMIName)
	}
	mig = n.waitMigration(mig.Name, 2*time.Minute)
	t.Logf("migration %s -> %s: %s wall (VMIM created to Succeeded)", first, other, time.Since(start).Round(100*time.Millisecond))
	capture.Stop().CheckEncrypted(t, nodes[first].IP, nodes[other].IP, 8<<20)
	vmi = n.checkSucceeded(mig, first, other)
	if vmi.Status.Interfaces[0].MAC != mac {
		t.Errorf("MAC %s after the migration, was %s", vmi.Status.Interfaces[0].MAC, mac)
	}
	secondPV := n.checkClaimOn(mig, "mover-data", other, firstPV)
	time.Sleep(2 * time.Second)
	gap, replies, lost := pingGap(pings)
	t.Logf("ping gap seen by a peer on the bridge during the migration: %s (%d replies, %d probes lost)", gap, replies, lost)
	// The gap holds the switchover's downtime, which libvirt itself
	// measures above 1 s on a loaded 2-core TCG machine: the test fails
	// an outage, the 0.6 s target is a figure it reports (README).
	if replies < 20 || gap > maxPingGap {
		t.Errorf("the peer on the bridge saw a gap of %s (%d replies, %d lost), want at most %s", gap, replies, lost, maxPingGap)
	}
	n.eventually(60*time.Second, "source domain removed from "+first, func() (bool, string) {
		st := n.domainOn(nodes[first], "mover")
		return st == "", st
	})
	if st := n.domainOn(nodes[other], "mover"); st != "running" {
		t.Errorf("domain on %s: %q", other, st)
	}
	if after := n.readFacts("mover"); after != before {
		t.Errorf("guest after the migration %+v, before %+v", after, before)
	}
	if vm, err := e.virt.VMs.Get(ctx, n.name, "mover"); err != nil || vm.Status.PrintableStatus != kubevirtv1.VirtualMachineStatusRunning {
		t.Errorf("vm status after the migration: %v %v", vm.Status.PrintableStatus, err)
	}

	// 2. Back to the first node, by a VMIM made directly.
	pings.poll()
	pings.cursor = len(pings.out)
	back, err := e.virt.Migrations.Create(ctx, &kubevirtv1.VirtualMachineInstanceMigration{
		ObjectMeta: metav1.ObjectMeta{Name: "back", Namespace: n.name},
		Spec:       kubevirtv1.VirtualMachineInstanceMigrationSpec{VMIName: "mover"},
	})
	if err != nil {
		t.Fatal(err)
	}
	start = time.Now()
	back = n.waitMigration(back.Name, 2*time.Minute)
	t.Logf("migration back %s -> %s: %s wall", other, first, time.Since(start).Round(100*time.Millisecond))
	vmi = n.checkSucceeded(back, other, first)
	time.Sleep(2 * time.Second)
	gap, replies, lost = pingGap(pings)
	t.Logf("ping gap seen by a peer on the bridge during the migration back: %s (%d replies, %d probes lost)", gap, replies, lost)
	if replies < 20 || gap > maxPingGap {
		t.Errorf("the peer on the bridge saw a gap of %s (%d replies, %d lost) during the migration back, want at most %s", gap, replies, lost, maxPingGap)
	}
	if vmi.Status.Interfaces[0].MAC != mac {
		t.Errorf("MAC %s after migrating back, was %s", vmi.Status.Interfaces[0].MAC, mac)
	}
	thirdPV := n.checkClaimOn(back, "mover-data", first, secondPV)
	if after := n.readFacts("mover"); after != before {
		t.Errorf("guest after migrating back %+v, before %+v", after, before)
	}

	// 3. Cancelled: slowed to 1 MiB/s so that it is still running when
	// its VMIM is deleted.
	n.setMigrationBandwidth("1Mi")
	defer n.setMigrationBandwidth("")
	cancelled, err := e.virt.Migrations.Create(ctx, &kubevirtv1.VirtualMachineInstanceMigration{
		ObjectMeta: metav1.ObjectMeta{Name: "cancelled", Namespace: n.name},
		Spec:       kubevirtv1.VirtualMachineInstanceMigrationSpec{VMIName: "mover"},
	})
	if err != nil {
		t.Fatal(err)
	}
	n.eventually(60*time.Second, "migration cancelled Running", func() (bool, string) {
		m, err := e.virt.Migrations.Get(ctx, n.name, cancelled.Name)
		if err != nil {
			return false, err.Error()
		}
		if m.Status.Phase == kubevirtv1.MigrationSucceeded || m.Status.Phase == kubevirtv1.MigrationFailed {
			t.Fatalf("migration ended before it could be cancelled: %s %+v", m.Status.Phase, m.Status.MigrationState)
		}
		return m.Status.Phase == kubevirtv1.MigrationRunning, string(m.Status.Phase)
	})
	if cfg := mustMigration(t, n, cancelled.Name).Status.MigrationState.VMIMConfigurationOptions; cfg == nil ||
		cfg.BandwidthPerMigration == nil || cfg.BandwidthPerMigration.String() != "1Mi" {
		t.Errorf("effective migration configuration %+v, want bandwidthPerMigration 1Mi", cfg)
	}
	// Its progress, as KubeVirt's gauges on the source node's /metrics.
	n.eventually(30*time.Second, "the migration's progress on "+first+"'s /metrics", func() (bool, string) {
		sent, sentOK := n.nodeGauge(nodes[first], "kubevirt_vmi_migration_data_processed_bytes", "mover")
		total, totalOK := n.nodeGauge(nodes[first], "kubevirt_vmi_migration_data_total_bytes", "mover")
		_, leftOK := n.nodeGauge(nodes[first], "kubevirt_vmi_migration_data_remaining_bytes", "mover")
		return sentOK && totalOK && leftOK && sent > 0 && total >= sent, fmt.Sprintf("processed %v (%v) of %v (%v)", sent, sentOK, total, totalOK)
	})
	// Upstream virtctl finds it by KubeVirt's label and deletes it.
	n.upstreamVirtctl().run(60*time.Second, "migrate-cancel", "mover")
	n.eventually(60*time.Second, "cancelled migration gone", func() (bool, string) {
		_, err := e.virt.Migrations.Get(ctx, n.name, cancelled.Name)
		return apierrors.IsNotFound(err), fmt.Sprint(err)
	})
	n.eventually(30*time.Second, "the ended migration's progress gone from "+first+"'s /metrics", func() (bool, string) {
		v, ok := n.nodeGauge(nodes[first], "kubevirt_vmi_migration_data_processed_bytes", "mover")
		return !ok, fmt.Sprint(v)
	})
	vmi, err = e.virt.VMIs.Get(ctx, n.name, "mover")
	if err != nil {
		t.Fatal(err)
	}
	st := vmi.Status.MigrationState
	if vmi.Status.NodeName != first || st == nil || st.MigrationUID != cancelled.UID || !st.Failed ||
		st.AbortStatus != kubevirtv1.MigrationAbortSucceeded || !st.AbortRequested {
		t.Errorf("after the cancel: vmi on %s, migrationState %+v", vmi.Status.NodeName, st)
	}
	n.eventually(60*time.Second, "half-made target removed from "+other, func() (bool, string) {
		s := n.domainOn(nodes[other], "mover")
		return s == "", s
	})
	if s := n.domainOn(nodes[first], "mover"); s != "running" {
		t.Errorf("domain on %s after the cancel: %q", first, s)
	}
	if pv := n.boundPV("mover-data"); pv != thirdPV {
		t.Errorf("claim bound to %s after the cancel, was %s", pv, thirdPV)
	}
	if after := n.readFacts("mover"); after != before {
		t.Errorf("guest after the cancelled migration %+v, before %+v", after, before)
	}
	if !regexp.MustCompile(`^` + uuidRE + `$`).MatchString(before.bootID) {
		t.Errorf("boot id %q", before.bootID)
	}

	// 4. Evacuation: KubeVirt's drain taint on its node moves the VM
	// (evictionStrategy LiveMigrate) by a migration of its own.
	n.setMigrationBandwidth("")
	drain := corev1.Taint{Key: "kubevirt.io/drain", Effect: corev1.TaintEffectNoSchedule}
	start = time.Now()
	n.taint(first, drain, true)
	defer n.taint(first, drain, false)
	n.eventually(2*time.Minute, "vmi mover evacuated from "+first, func() (bool, string) {
		v, err := e.virt.VMIs.Get(ctx, n.name, "mover")
		if err != nil {
			return false, err.Error()
		}
		return v.Status.NodeName == other && v.Status.Phase == kubevirtv1.Running && v.Status.EvacuationNodeName == "",
			fmt.Sprintf("on %s, evacuationNodeName %q", v.Status.NodeName, v.Status.EvacuationNodeName)
	})
	// The VMI shows its new node before the migration's own status says
	// Succeeded: the migration is waited for, not read once.
	n.eventually(30*time.Second, "a Succeeded evacuation migration", func() (bool, string) {
		migs, err := e.virt.Migrations.List(ctx, n.name, metav1.ListOptions{})
		if err != nil {
			return false, err.Error()
		}
		var seen []string
		for _, m := range migs {
			if m.Annotations[kubevirtv1.EvacuationMigrationAnnotation] == first && m.Status.Phase == kubevirtv1.MigrationSucceeded {
				return true, ""
			}
			seen = append(seen, fmt.Sprintf("%s %s (evacuating %q)", m.Name, m.Status.Phase, m.Annotations[kubevirtv1.EvacuationMigrationAnnotation]))
		}
		return false, strings.Join(seen, ", ")
	})
	t.Logf("evacuation of %s: VM on %s %s after the taint", first, other, time.Since(start).Round(100*time.Millisecond))
	n.logDowntimes()
	if after := n.readFacts("mover"); after != before {
		t.Errorf("guest after the evacuation %+v, before %+v", after, before)
	}

	// 5. Stop and start: the VM runs where its (moved) local disk is, the
	// marker on it intact.
	old, err := e.virt.VMIs.Get(ctx, n.name, "mover")
	if err != nil {
		t.Fatal(err)
	}
	n.setRunStrategy("mover", kubevirtv1.RunStrategyHalted)
	n.eventually(90*time.Second, "vmi mover stopped", func() (bool, string) {
		_, err := e.virt.VMIs.Get(ctx, n.name, "mover")
		return apierrors.IsNotFound(err), fmt.Sprint(err)
	})
	n.setRunStrategy("mover", kubevirtv1.RunStrategyAlways)
	restarted := n.waitVMIOfVM("mover", 3*time.Minute, old.UID)
	if restarted.Status.NodeName != other {
		t.Errorf("after stop/start the VM runs on %s, its local disk is on %s", restarted.Status.NodeName, other)
	}
	if after := n.readFacts("mover"); after.disk != mark || after.bootID == before.bootID {
		t.Errorf("after stop/start: %+v (disk marker %q, boot id must change)", after, mark)
	}
}

// logDowntimes logs the downtime of each migration as the source node's
// Migrated event reports it.
func (n *testNS) logDowntimes() {
	events, err := n.e.kube.CoreV1().Events(n.name).List(context.Background(), metav1.ListOptions{FieldSelector: "reason=Migrated"})
	if err != nil {
		n.t.Logf("events: %v", err)
		return
	}
	for _, ev := range events.Items {
		n.t.Logf("event %s: %s", ev.Reason, ev.Message)
	}
}

// Addresses on the migration test's bridge.
const (
	moverIP  = "10.233.0.2"
	pingerIP = "10.233.0.1"
)

// pongUserData makes a guest at self ping peer every 0.1 s without waiting
// for replies (a lost probe costs 0.1 s of resolution, not a timeout) and
// print E2E-PONG <uptime> <ping's line> as each reply arrives (the shell's
// read builtin: no process per reply).
func pongUserData(self, peer string) string {
	return fmt.Sprintf("#!/bin/sh\n# nodevirt.ip=%s/24\n(ping -i 0.1 %s | while read l; do read up x < /proc/uptime; "+
		"echo \"E2E-PONG $up $l\"; done) &\n", self, peer)
}

// pingGap is the longest time between two replies in the serial log after
// its cursor (the pinger's clock at their arrival), the number of replies
// and of probes lost between the first and the last.
// maxPingGap is the longest silence a peer on the bridge may see while its
// VM migrates before the test calls it an outage.
const maxPingGap = 3 * time.Second

func pingGap(s *serialLog) (gap time.Duration, replies, lost int) {
	s.poll()
	var last float64
	lastSeq := -1
	ms := regexp.MustCompile(`E2E-PONG (\d+\.\d+) \d+ bytes from [0-9.]+: seq=(\d+) `).FindAllStringSubmatch(string(s.out[s.cursor:]), -1)
	for _, m := range ms {
		up, _ := strconv.ParseFloat(m[1], 64)
		seq, _ := strconv.Atoi(m[2])
		if lastSeq >= 0 {
			gap = max(gap, time.Duration((up-last)*float64(time.Second)))
			lost += max(seq-lastSeq-1, 0)
		}
		last, lastSeq = up, seq
	}
	return gap, len(ms), lost
}

// taint adds (on) or removes a taint of node.
func (n *testNS) taint(node string, taint corev1.Taint, on bool) {
	n.t.Helper()
	ctx := context.Background()
	if err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		nd, err := n.e.kube.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
		if err != nil {
			return err
		}
		nd.Spec.Taints = slices.DeleteFunc(nd.Spec.Taints, func(t corev1.Taint) bool { return t.Key == taint.Key })
		if on {
			nd.Spec.Taints = append(nd.Spec.Taints, taint)
		}
		_, err = n.e.kube.CoreV1().Nodes().Update(ctx, nd, metav1.UpdateOptions{})
		return err
	}); err != nil {
		n.t.Errorf("taint %s on %s (%v): %v", taint.Key, node, on, err)
	}
}

func mustMigration(t *testing.T, n *testNS, name string) *kubevirtv1.VirtualMachineInstanceMigration {
	t.Helper()
	m, err := n.e.virt.Migrations.Get(context.Background(), n.name, name)
	if err != nil {
		t.Fatal(err)
	}
	return m
}
