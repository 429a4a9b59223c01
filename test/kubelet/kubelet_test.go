package kubelet

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/nodevirt/nodevirt/clusterbrain/capacitypods"
	"github.com/nodevirt/nodevirt/clusterbrain/scheduler"
	"github.com/nodevirt/nodevirt/nodeagent/libvirttls"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/guest"
)

// TestKubeletInstall installs nodevirt as a user would on a cluster with a
// real kubelet: the images of `make images` imported into containerd, the
// rendered manifest applied unchanged, and then the node agent DaemonSet
// Ready, the brain Deployment Available, the node's labels and bridge
// resources, the CSI driver registered with kubelet and the HyperConverged
// Available; a VM from a DataVolume answers on its console, survives a
// restart of the DaemonSet and the upgrade to a newer build; a pod and a VM
// asking together for more memory than the node has are not both placed.
// `make test-kubelet` runs it (NODEVIRT_KUBELET=1) after building both
// builds' images; it needs root, containerd, runc and the host's libvirtd.
func TestKubeletInstall(t *testing.T) {
	if os.Getenv("NODEVIRT_KUBELET") == "" {
		t.Skip("make test-kubelet runs this test (NODEVIRT_KUBELET=1)")
	}
	root, err := controlplane.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	build, err := FindBuild(filepath.Join(root, "bin", "images"))
	if err != nil {
		t.Fatal(err)
	}
	// The newer build the upgrade applies, and the build's own virtctl.
	next, err := FindBuild(filepath.Join(root, "bin", "images-next"))
	if err != nil {
		t.Fatalf("no newer build: make test-kubelet builds it (%v)", err)
	}
	virtctl := filepath.Join(build.Dir, "virtctl", "virtctl-linux-amd64")
	if _, err := os.Stat(virtctl); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat("/run/libvirt/libvirt-sock"); err != nil {
		t.Fatalf("the node agents use the host's libvirtd: %v", err)
	}
	for _, l := range []string{"nodevirt0"} {
		if _, err := net.InterfaceByName(l); err == nil {
			t.Fatalf("%s exists: a lab runs on this host (make lab-down)", l)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 35*time.Minute)
	defer cancel()
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	dir := t.TempDir()
	nodeIP, err := HostIP()
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	step := func(what string) { t.Logf("%6.1fs %s", time.Since(start).Seconds(), what) }

	cp, err := controlplane.Start(ctx, controlplane.Config{Dir: filepath.Join(dir, "cp"), ControllerManager: true,
		NodeAuthorizer: true, BindAddress: "0.0.0.0", Log: log})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cp.Stop)
	u, err := url.Parse(cp.URL)
	if err != nil {
		t.Fatal(err)
	}
	var port int
	fmt.Sscan(u.Port(), &port)
	step("control plane up")
	bins, err := controlplane.EnsureNodeBinaries(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	step("kubelet and kube-scheduler built")
	name := "kubelet-test"
	node, err := Start(ctx, Config{Dir: filepath.Join(dir, "node"), NodeName: name, NodeIP: nodeIP, ControlPlane: cp,
		APIServerPort: port, Bins: bins, Log: log})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := node.Stop(); err != nil {
			t.Errorf("undo the node: %v", err)
		}
	})
	step("node Ready")
	kubectl := func(args ...string) (string, error) { return Kubectl(cp.Kubeconfig, args...) }
	kube, err := kubernetes.NewForConfig(cp.RestConfig)
	if err != nil {
		t.Fatal(err)
	}
	const ns = Namespace
	defer func() {
		if t.Failed() {
			dumpPods(t, kube, ns)
		}
	}()
	// The HyperConverged goes while the brains that own its finalizer run;
	// then the agents and brains stop, before the node does.
	t.Cleanup(func() {
		if err := Uninstall(cp.Kubeconfig, build); err != nil {
			t.Errorf("uninstall: %v", err)
		}
		// The host's libvirtd must start again after nodevirt went.
		for _, f := range []string{"/etc/libvirt/libvirtd.conf", "/etc/libvirt/qemu.conf"} {
			if b, err := os.ReadFile(f); err == nil && strings.Contains(string(b), "BEGIN "+libvirttls.Tag) {
				t.Errorf("uninstall left the agent's block in %s", f)
			}
		}
	})
	if err := Install(ctx, node, build, step); err != nil {
		t.Fatal(err)
	}
	wait(t, ctx, 3*time.Minute, "CSI driver registered with kubelet", func() error {
		cn, err := kube.StorageV1().CSINodes().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		for _, d := range cn.Spec.Drivers {
			if d.Name == "kubevirt.io.hostpath-provisioner" && d.NodeID == name {
				return nil
			}
		}
		return fmt.Errorf("drivers %v", cn.Spec.Drivers)
	})
	step("CSI driver registered with kubelet")
	n, err := kube.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if n.Labels["kubevirt.io/schedulable"] != "true" || n.Labels["nodevirt.io/nodeagent"] == "standalone" {
		t.Errorf("node labels %v: want kubevirt.io/schedulable and a kubelet-managed node", n.Labels)
	}
	advertisesBridges(t, ctx, kube, name)
	step("node advertises its labels and a new bridge as a resource")

	// Nodes import from nowhere private unless the HyperConverged allows
	// it: the test's image server listens on the node's address.
	if err := CreateHyperConverged(cp.Kubeconfig, root, nodeIP+"/32"); err != nil {
		t.Fatal(err)
	}
	step("HyperConverged Available")
	webhooksBehindService(t, ctx, kube, kubectl, nodeIP)
	step("webhook configurations name the Service; the API server calls the brain through it")

	console := func(word string) { consoleAnswers(t, virtctl, cp.Kubeconfig, word) }
	runVM(t, ctx, kubectl, nodeIP, console, step)
	upgrade(t, ctx, kube, kubectl, node, next, virtctl, cp.Kubeconfig, step)
	podsAndVMsShare(t, ctx, kube, kubectl, name, step)
}

// podsAndVMsShare fills the node's memory with a pod (as kubelet and
// kube-scheduler count it) and asks for a VM: the brain's scheduler counts
// the pod and does not place the VM; once the pod goes, it does.
func podsAndVMsShare(t *testing.T, ctx context.Context, kube kubernetes.Interface, kubectl func(...string) (string, error), node string, step func(string)) {
	n, err := kube.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	free := n.Status.Allocatable.Memory().Value()
	pods, err := kube.CoreV1().Pods("").List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + node})
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range pods.Items {
		if p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed {
			continue
		}
		for _, c := range p.Spec.Containers {
			free -= c.Resources.Requests.Memory().Value()
		}
	}
	// kubelet admits the filler: it leaves 64 Mi of what pods hold.
	filler := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "filler", Namespace: "kubelet-test-vm"},
		Spec: corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "pause", Image: PauseImage,
			ImagePullPolicy: corev1.PullNever, Resources: corev1.ResourceRequirements{Requests: corev1.ResourceList{
				corev1.ResourceMemory: *resource.NewQuantity(free-64<<20, resource.BinarySI)}}}}}}
	if _, err := kube.CoreV1().Pods("kubelet-test-vm").Create(ctx, filler, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if out, err := kubectl("wait", "--for=condition=Ready", "--timeout=2m", "-n", "kubelet-test-vm", "pod/filler"); err != nil {
		t.Fatalf("filler pod: %v\n%s", err, out)
	}
	vmi := `apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata:
  name: too-big
  namespace: kubelet-test-vm
spec:
  domain:
    resources:
      requests:
        memory: 128Mi
    devices:
      autoattachPodInterface: false
`
	f := filepath.Join(t.TempDir(), "vmi.yaml")
	if err := os.WriteFile(f, []byte(vmi), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := kubectl("apply", "-f", f); err != nil {
		t.Fatalf("apply vmi: %v\n%s", err, out)
	}
	if out, err := kubectl("wait", "--for=condition=PodScheduled=false", "--timeout=1m", "-n", "kubelet-test-vm", "vmi/too-big"); err != nil {
		t.Fatalf("a VMI that does not fit beside the pod: %v\n%s", err, out)
	}
	if out, _ := kubectl("get", "-n", "kubelet-test-vm", "vmi/too-big", "-o", "jsonpath={.status.nodeName} {.status.conditions[?(@.type=='PodScheduled')].message}"); !strings.Contains(out, "insufficient memory") {
		t.Errorf("VMI beside the filler pod: %q, want unschedulable for memory", out)
	}
	step("a VMI asking for memory a pod holds is not placed")
	zero := int64(0)
	if err := kube.CoreV1().Pods("kubelet-test-vm").Delete(ctx, "filler", metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil {
		t.Fatal(err)
	}
	if out, err := kubectl("wait", "--for=jsonpath={.status.nodeName}="+node, "--timeout=2m", "-n", "kubelet-test-vm", "vmi/too-big"); err != nil {
		t.Fatalf("the VMI once the pod went: %v\n%s", err, out)
	}
	step("placed once the pod went")

	// The other way round: a pod that would fit if VMs were not counted
	// stays Pending, since each VM's capacity pod holds what it takes.
	if out, err := kubectl("wait", "--for=create", "--timeout=1m", "-n", "kubelet-test-vm", "pod/"+capacitypods.PodName("too-big")); err != nil {
		t.Fatalf("capacity pod of the second VM: %v\n%s", err, out)
	}
	free = n.Status.Allocatable.Memory().Value()
	if pods, err = kube.CoreV1().Pods("").List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + node,
		LabelSelector: "!" + scheduler.CapacityPodLabel}); err != nil {
		t.Fatal(err)
	}
	for _, p := range pods.Items {
		if p.Status.Phase != corev1.PodSucceeded && p.Status.Phase != corev1.PodFailed {
			for _, c := range p.Spec.Containers {
				free -= c.Resources.Requests.Memory().Value()
			}
		}
	}
	late := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "late", Namespace: "kubelet-test-vm"},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "pause", Image: PauseImage,
			ImagePullPolicy: corev1.PullNever, Resources: corev1.ResourceRequirements{Requests: corev1.ResourceList{
				corev1.ResourceMemory: *resource.NewQuantity(free-64<<20, resource.BinarySI)}}}}}}
	if _, err := kube.CoreV1().Pods("kubelet-test-vm").Create(ctx, late, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if out, err := kubectl("wait", "--for=jsonpath={.status.conditions[?(@.type=='PodScheduled')].reason}=Unschedulable",
		"--timeout=1m", "-n", "kubelet-test-vm", "pod/late"); err != nil {
		t.Fatalf("a pod asking for memory VMs hold: %v\n%s", err, out)
	}
	step("a pod asking for memory VMs hold is not placed by kube-scheduler")
}

// vmManifest is a VM whose disk is imported over HTTP by the node agent,
// with a pod beside it on the same node.
const vmManifest = `apiVersion: v1
kind: Namespace
metadata:
  name: kubelet-test-vm
---
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata:
  name: vm
  namespace: kubelet-test-vm
spec:
  runStrategy: Always
  dataVolumeTemplates:
  - metadata:
      name: vm-rootdisk
    spec:
      source:
        http:
          url: IMAGE_URL
      storage:
        storageClassName: hostpath-csi
        resources:
          requests:
            storage: 128Mi
  template:
    spec:
      domain:
        resources:
          requests:
            memory: 96Mi
        devices:
          autoattachPodInterface: false
          disks:
          - name: rootdisk
            disk:
              bus: virtio
      volumes:
      - name: rootdisk
        dataVolume:
          name: vm-rootdisk
---
apiVersion: v1
kind: Pod
metadata:
  name: beside
  namespace: kubelet-test-vm
spec:
  containers:
  - name: pause
    image: ` + PauseImage + `
    imagePullPolicy: Never
`

// volumePodManifest is a pod with a claim of nodevirt's storage class.
const volumePodManifest = `apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: pod-volume
  namespace: kubelet-test-vm
spec:
  storageClassName: hostpath-csi
  accessModes: [ReadWriteOnce]
  resources:
    requests:
      storage: 16Mi
---
apiVersion: v1
kind: Pod
metadata:
  name: with-volume
  namespace: kubelet-test-vm
spec:
  containers:
  - name: pause
    image: ` + PauseImage + `
    imagePullPolicy: Never
    volumeMounts:
    - name: data
      mountPath: /data
  volumes:
  - name: data
    persistentVolumeClaim:
      claimName: pod-volume
`

// runVM runs a VM through the DaemonSet's node agent (TCG), with a pod
// beside it, checks its console answers, and restarts the DaemonSet under
// the running guest: the guest keeps its QEMU and its console answers
// through the new agent.
func runVM(t *testing.T, ctx context.Context, kubectl func(...string) (string, error), nodeIP string, console func(string), step func(string)) {
	// Every boot disk skips the guest kernel's IO-APIC timer check (a
	// panic under TCG on a loaded host), as cloud images do.
	raw, err := guest.BootDisk(ctx, guest.DiskSpec{})
	if err != nil {
		t.Fatalf("guest disk: %v", err)
	}
	ln, err := net.Listen("tcp", nodeIP+":0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 2 * time.Minute,
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { http.ServeFile(w, r, raw) })}
	go srv.Serve(ln)
	defer srv.Close()
	manifest := filepath.Join(t.TempDir(), "vm.yaml")
	url := "http://" + ln.Addr().String() + "/disk.img"
	if err := os.WriteFile(manifest, []byte(strings.Replace(vmManifest, "IMAGE_URL", url, 1)), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := kubectl("apply", "-f", manifest); err != nil {
		t.Fatalf("apply vm: %v\n%s", err, out)
	}
	t.Cleanup(func() {
		if out, err := kubectl("delete", "--ignore-not-found", "--wait", "--timeout=3m", "namespace", "kubelet-test-vm"); err != nil {
			t.Errorf("delete the VM's namespace: %v\n%s", err, out)
		}
	})
	defer func() {
		if t.Failed() {
			out, _ := kubectl("get", "-n", "kubelet-test-vm", "vm,vmi,dv,pvc,pod", "-o", "wide")
			t.Logf("%s", out)
			out, _ = kubectl("get", "-n", "kubelet-test-vm", "events")
			t.Logf("%s", out)
		}
	}()
	if out, err := kubectl("wait", "--for=jsonpath={.status.phase}=Running", "--timeout=8m", "-n", "kubelet-test-vm", "vmi/vm"); err != nil {
		t.Fatalf("VMI running: %v\n%s", err, out)
	}
	step("VM running")
	console("console")
	step("the guest answers on virtctl console through the API server")
	if out, err := kubectl("wait", "--for=condition=Ready", "--timeout=2m", "-n", "kubelet-test-vm", "pod/beside"); err != nil {
		t.Fatalf("pod beside the VM: %v\n%s", err, out)
	}
	step("pod beside it Ready")
	// kubelet mounts a hostpath-csi volume into a pod through the driver
	// the node agent registered with it.
	volPod := filepath.Join(t.TempDir(), "volpod.yaml")
	if err := os.WriteFile(volPod, []byte(volumePodManifest), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := kubectl("apply", "-f", volPod); err != nil {
		t.Fatalf("apply pod with a volume: %v\n%s", err, out)
	}
	if out, err := kubectl("wait", "--for=condition=Ready", "--timeout=3m", "-n", "kubelet-test-vm", "pod/with-volume"); err != nil {
		t.Fatalf("pod with a hostpath-csi volume: %v\n%s", err, out)
	}
	step("pod with a hostpath-csi volume (mounted by kubelet through the agent's driver) Ready")

	before := qemuPid(t)
	if out, err := kubectl("rollout", "restart", "-n", "kubevirt-hyperconverged", "daemonset/nodevirt-nodeagent"); err != nil {
		t.Fatalf("rollout restart: %v\n%s", err, out)
	}
	if out, err := kubectl("rollout", "status", "--timeout=5m", "-n", "kubevirt-hyperconverged", "daemonset/nodevirt-nodeagent"); err != nil {
		t.Fatalf("rollout status: %v\n%s", err, out)
	}
	if after := qemuPid(t); after != before {
		t.Errorf("guest QEMU pid %s after the agents' restart, was %s", after, before)
	}
	if out, err := kubectl("get", "-n", "kubelet-test-vm", "vmi/vm", "-o", "jsonpath={.status.phase}"); err != nil || out != "Running" {
		t.Errorf("VMI after the agents' restart: %q %v", out, err)
	}
	console("restarted")
	step("DaemonSet restarted under the running guest; same QEMU pid, console answers")
}

func wait(t *testing.T, ctx context.Context, timeout time.Duration, what string, f func() error) {
	t.Helper()
	if err := waitFor(ctx, timeout, what, f); err != nil {
		t.Fatal(err)
	}
}

func dumpPods(t *testing.T, kube kubernetes.Interface, ns string) {
	pods, err := kube.CoreV1().Pods(ns).List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Logf("pods: %v", err)
		return
	}
	for _, p := range pods.Items {
		t.Logf("pod %s on %q: %s %v", p.Name, p.Spec.NodeName, p.Status.Phase, p.Status.Conditions)
		for _, cs := range append(p.Status.InitContainerStatuses, p.Status.ContainerStatuses...) {
			t.Logf("  container %s ready=%v restarts=%d state=%+v last=%+v", cs.Name, cs.Ready, cs.RestartCount, cs.State, cs.LastTerminationState)
		}
	}
	logs, _ := filepath.Glob("/var/log/pods/" + ns + "_*/*/*.log")
	for _, l := range logs {
		b, _ := os.ReadFile(l)
		lines := strings.Split(strings.TrimSpace(string(b)), "\n")
		if len(lines) > 25 {
			lines = lines[len(lines)-25:]
		}
		t.Logf("--- %s\n%s", l, strings.Join(lines, "\n"))
	}
}
