package lab

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	nadv1 "github.com/k8snetworkplumbingwg/network-attachment-definition-client/pkg/apis/k8s.cni.cncf.io/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	kubevirtv1 "kubevirt.io/api/core/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"
	"sigs.k8s.io/yaml"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/client/virtctl"
	"github.com/nodevirt/nodevirt/test/guest"
)

// The demo's names.
const (
	demoNamespace = "nodevirt-demo"
	hostBridge    = "br-demo"
	demoNAD       = "demo-bridge"
	demoVM        = "demo"
	demoVLAN      = 100
)

// Demo runs the golden path on a lab that is up: a VM whose disk is imported
// over HTTP from a guest image built here, on a bridge network with a MAC
// from the pool, and shows its console.
func Demo(ctx context.Context, cfg Config) error {
	if err := cfg.defaults(); err != nil {
		return err
	}
	rc, err := clientcmd.BuildConfigFromFlags("", cfg.Kubeconfig())
	if err != nil {
		return fmt.Errorf("step lab: no kubeconfig at %s (run make lab): %w", cfg.Kubeconfig(), err)
	}
	kube, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return err
	}
	virt, err := client.NewSet(rc)
	if err != nil {
		return err
	}
	if status := readiness(ctx, cfg, kube, virt); status != "" {
		return fmt.Errorf("step lab: %s", status)
	}

	step(cfg.Out, "guest image (Debian cloud kernel + busybox, built here, no download)")
	raw, err := guest.BootDisk(ctx, guest.DiskSpec{Initramfs: guest.Spec{GuestAgent: true}})
	if err != nil {
		return fmt.Errorf("step guest image: %w", err)
	}
	image, err := guest.QCOW2(ctx, raw)
	if err != nil {
		return fmt.Errorf("step guest image: %w", err)
	}
	// Nodes in namespaces of their own reach the host at the underlay
	// gateway; the one-node lab's agent runs on the host.
	serveAddr := "127.0.0.1:0"
	if cfg.NodeCount > 1 {
		serveAddr = UnderlayGateway + ":0"
	}
	url, stopServer, err := serveFile(image, serveAddr)
	if err != nil {
		return fmt.Errorf("step image server: %w", err)
	}
	defer stopServer()
	fmt.Fprintf(cfg.Out, "    serving %s at %s\n", filepath.Base(image), url)

	demoBridge := cfg.demoBridge()
	step(cfg.Out, "bridge "+demoBridge+" and NetworkAttachmentDefinition "+demoNamespace+"/"+demoNAD)
	vlan, err := ensureBridge(cfg)
	if err != nil {
		return fmt.Errorf("step bridge: %w", err)
	}
	if err := ensureNamespace(ctx, kube, demoNamespace); err != nil {
		return fmt.Errorf("step namespace: %w", err)
	}
	if err := applyNAD(ctx, virt, demoBridge, vlan); err != nil {
		return fmt.Errorf("step network attachment: %w", err)
	}
	if vlan == 0 {
		fmt.Fprintln(cfg.Out, "    this kernel has no bridge VLAN filtering: the demo network is untagged")
	} else {
		fmt.Fprintf(cfg.Out, "    VLAN %d\n", vlan)
	}

	step(cfg.Out, "VirtualMachine "+demoNamespace+"/"+demoVM+" with a DataVolume imported from "+url)
	vm := demoVirtualMachine(url)
	if _, err := virt.VMs.Create(ctx, vm); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("step create vm: %w", err)
	}
	vmi, err := watchUntilRunning(ctx, cfg, virt)
	if err != nil {
		return err
	}
	mac := ""
	if len(vmi.Status.Interfaces) > 0 {
		mac = vmi.Status.Interfaces[0].MAC
	}
	fmt.Fprintf(cfg.Out, "    running on node %s, NIC MAC %s\n", vmi.Status.NodeName, mac)

	step(cfg.Out, "console of "+demoVM)
	if err := showConsole(ctx, cfg, rc, mac); err != nil {
		return fmt.Errorf("step console: %w", err)
	}
	step(cfg.Out, "guest agent of "+demoVM)
	if err := showGuestInfo(ctx, cfg, rc, virt); err != nil {
		return fmt.Errorf("step guest agent: %w", err)
	}
	fmt.Fprintf(cfg.Out, "\nThe demo VM runs. Go further:\n"+
		"  export KUBECONFIG=%s\n"+
		"  kubectl get vm,vmi,dv -n %s\n"+
		"  %s/virtctl console %s -n %s       # Ctrl+] to leave\n"+
		"  %s/virtctl guestosinfo %s -n %s   # from the guest agent\n"+
		"  %s/virtctl stop %s -n %s; %s/virtctl start %s -n %s\n"+
		"  %s         # the domain as an administrator sees it\n"+
		"Tear down: make lab-down\n",
		cfg.Kubeconfig(), demoNamespace, cfg.BinDir, demoVM, demoNamespace, cfg.BinDir, demoVM, demoNamespace,
		cfg.BinDir, demoVM, demoNamespace, cfg.BinDir, demoVM, demoNamespace, virshHint(cfg, vmi.Status.NodeName))
	return nil
}

// serveFile serves one file over HTTP on addr.
func serveFile(path, addr string) (string, func(), error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return "", nil, err
	}
	name := filepath.Base(path)
	mux := http.NewServeMux()
	mux.HandleFunc("/"+name, func(w http.ResponseWriter, r *http.Request) { http.ServeFile(w, r, path) })
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 2 * time.Minute}
	go srv.Serve(ln)
	return fmt.Sprintf("http://%s/%s", ln.Addr(), name), func() { srv.Close() }, nil
}

// demoBridge is the bridge of the demo network: one the demo creates on the
// host for a one-node lab, the lab's br-lab (on every node, joined across
// them) otherwise.
func (c Config) demoBridge() string {
	if c.NodeCount > 1 {
		return LabBridge
	}
	return hostBridge
}

// ensureBridge creates the demo bridge (recorded for lab-down) and tells
// which VLAN the demo network can use: 0 when the kernel cannot filter VLANs.
func ensureBridge(cfg Config) (int, error) {
	if cfg.NodeCount > 1 {
		// br-lab exists on every node; the kernel is the host's.
		if _, err := os.Stat("/sys/class/net/" + SwitchBridge + "/bridge/vlan_filtering"); err != nil {
			return 0, nil
		}
		return demoVLAN, nil
	}
	demoBridge := hostBridge
	if _, err := os.Stat("/sys/class/net/" + demoBridge); err != nil {
		if out, err := exec.Command("ip", "link", "add", demoBridge, "type", "bridge").CombinedOutput(); err != nil {
			return 0, fmt.Errorf("create bridge %s: %s", demoBridge, out)
		}
		if err := Remember(cfg.Dir, demoBridge); err != nil {
			return 0, err
		}
	}
	if out, err := exec.Command("ip", "link", "set", demoBridge, "up").CombinedOutput(); err != nil {
		return 0, fmt.Errorf("bring up %s: %s", demoBridge, out)
	}
	if _, err := os.Stat("/sys/class/net/" + demoBridge + "/bridge/vlan_filtering"); err != nil {
		return 0, nil
	}
	return demoVLAN, nil
}

func ensureNamespace(ctx context.Context, kube kubernetes.Interface, name string) error {
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}
	if _, err := kube.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	return nil
}

func applyNAD(ctx context.Context, virt *client.Set, demoBridge string, vlan int) error {
	conf := map[string]any{"cniVersion": "0.3.1", "name": demoNAD, "type": "cnv-bridge", "bridge": demoBridge, "macspoofchk": true}
	if vlan != 0 {
		conf["vlan"] = vlan
	}
	data, _ := json.Marshal(conf)
	nad := &nadv1.NetworkAttachmentDefinition{
		ObjectMeta: metav1.ObjectMeta{Name: demoNAD, Namespace: demoNamespace, Annotations: map[string]string{
			"k8s.v1.cni.cncf.io/resourceName": "bridge.network.kubevirt.io/" + demoBridge}},
		Spec: nadv1.NetworkAttachmentDefinitionSpec{Config: string(data)},
	}
	if _, err := virt.NADs.Create(ctx, nad); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	return nil
}

// demoManifest is the VM as a user would write it, KubeVirt-style.
const demoManifest = `
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata:
  name: demo
  namespace: nodevirt-demo
spec:
  runStrategy: Always
  dataVolumeTemplates:
  - metadata:
      name: demo-rootdisk
    spec:
      source:
        http:
          url: IMAGE_URL
      storage:
        storageClassName: hostpath-csi
        resources:
          requests:
            storage: 256Mi
  template:
    spec:
      domain:
        resources:
          requests:
            memory: 128Mi
        devices:
          disks:
          - name: rootdisk
            disk:
              bus: virtio
          - name: cloudinit
            disk:
              bus: virtio
          interfaces:
          - name: demo
            bridge: {}
      networks:
      - name: demo
        multus:
          networkName: demo-bridge
      volumes:
      - name: rootdisk
        dataVolume:
          name: demo-rootdisk
      - name: cloudinit
        cloudInitNoCloud:
          userData: |
            #!/bin/sh
            echo "hello from cloud-init on $(hostname)"
`

func demoVirtualMachine(url string) *kubevirtv1.VirtualMachine {
	vm := &kubevirtv1.VirtualMachine{}
	if err := yaml.Unmarshal([]byte(strings.Replace(demoManifest, "IMAGE_URL", url, 1)), vm); err != nil {
		panic(err) // the manifest is a constant
	}
	return vm
}

// watchUntilRunning prints the DataVolume's and the VM's progress until the
// VMI runs, and fails naming the object and the reason when something does.
func watchUntilRunning(ctx context.Context, cfg Config, virt *client.Set) (*kubevirtv1.VirtualMachineInstance, error) {
	ctx, cancel := context.WithTimeout(ctx, 6*time.Minute)
	defer cancel()
	last := ""
	for {
		line, vmi, err := demoStatus(ctx, virt)
		if err != nil {
			return nil, err
		}
		if line != last {
			fmt.Fprintf(cfg.Out, "    %s\n", line)
			last = line
		}
		if vmi != nil && vmi.Status.Phase == kubevirtv1.Running {
			return vmi, nil
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("step wait for vm: %s/%s not running after 6m: %s", demoNamespace, demoVM, last)
		case <-time.After(500 * time.Millisecond):
		}
	}
}

func demoStatus(ctx context.Context, virt *client.Set) (string, *kubevirtv1.VirtualMachineInstance, error) {
	parts := []string{}
	dv, err := virt.DataVolumes.Get(ctx, demoNamespace, "demo-rootdisk")
	switch {
	case err == nil:
		parts = append(parts, fmt.Sprintf("datavolume %s %s", dv.Status.Phase, dv.Status.Progress))
		if dv.Status.Phase == cdiv1.Failed {
			return "", nil, fmt.Errorf("step import: datavolume %s/%s failed: %s", demoNamespace, dv.Name, conditionMessages(dv.Status.Conditions))
		}
	case apierrors.IsNotFound(err):
		parts = append(parts, "datavolume not created yet")
	default:
		return "", nil, err
	}
	vm, err := virt.VMs.Get(ctx, demoNamespace, demoVM)
	if err != nil {
		return "", nil, err
	}
	parts = append(parts, "vm "+string(vm.Status.PrintableStatus))
	for _, c := range vm.Status.Conditions {
		if c.Status == corev1.ConditionFalse && c.Message != "" && c.Type != kubevirtv1.VirtualMachineReady {
			parts = append(parts, fmt.Sprintf("(%s: %s)", c.Type, c.Message))
		}
	}
	vmi, err := virt.VMIs.Get(ctx, demoNamespace, demoVM)
	if apierrors.IsNotFound(err) {
		return strings.Join(parts, ", "), nil, nil
	}
	if err != nil {
		return "", nil, err
	}
	parts = append(parts, "vmi "+string(vmi.Status.Phase))
	if vmi.Status.Phase == kubevirtv1.Failed {
		return "", nil, fmt.Errorf("step start vm: vmi %s/%s failed: %s", demoNamespace, demoVM, vmiReason(vmi))
	}
	return strings.Join(parts, ", "), vmi, nil
}

func conditionMessages(cs []cdiv1.DataVolumeCondition) string {
	var out []string
	for _, c := range cs {
		if c.Message != "" {
			out = append(out, fmt.Sprintf("%s: %s", c.Reason, c.Message))
		}
	}
	return strings.Join(out, "; ")
}

func vmiReason(vmi *kubevirtv1.VirtualMachineInstance) string {
	var out []string
	for _, c := range vmi.Status.Conditions {
		if c.Message != "" {
			out = append(out, fmt.Sprintf("%s: %s", c.Reason, c.Message))
		}
	}
	return strings.Join(out, "; ")
}

// showGuestInfo waits for the guest agent to connect and shows what it
// tells through the guestosinfo subresource, as `virtctl guestosinfo` reads it.
func showGuestInfo(ctx context.Context, cfg Config, rc *rest.Config, virt *client.Set) error {
	deadline := time.Now().Add(60 * time.Second)
	for {
		vmi, err := virt.VMIs.Get(ctx, demoNamespace, demoVM)
		if err != nil {
			return err
		}
		if hasAgent(vmi) {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("vmi %s/%s: no AgentConnected condition within 60s", demoNamespace, demoVM)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Second):
		}
	}
	c, err := virtctl.NewClient(rc, demoNamespace)
	if err != nil {
		return err
	}
	var info kubevirtv1.VirtualMachineInstanceGuestAgentInfo
	if err := c.GuestInfo(ctx, demoVM, "guestosinfo", &info); err != nil {
		return fmt.Errorf("guestosinfo of %s/%s: %w", demoNamespace, demoVM, err)
	}
	fmt.Fprintf(cfg.Out, "    agent| %s, kernel %s, hostname %s, agent %s\n",
		info.OS.PrettyName, info.OS.KernelRelease, info.Hostname, info.GAVersion)
	return nil
}

func hasAgent(vmi *kubevirtv1.VirtualMachineInstance) bool {
	for _, c := range vmi.Status.Conditions {
		if c.Type == kubevirtv1.VirtualMachineInstanceAgentConnected && c.Status == "True" {
			return true
		}
	}
	return false
}

// showConsole types commands on the VM's serial console through the
// subresource API, exactly as `virtctl console` reaches it (kube-apiserver →
// brain → node agent), and shows the answers: the kernel that booted, the
// NIC with its pooled MAC and the imported disk.
func showConsole(ctx context.Context, cfg Config, rc *rest.Config, mac string) error {
	c, err := virtctl.NewClient(rc, demoNamespace)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	stream, err := c.Stream(ctx, demoVM, "console", nil)
	if err != nil {
		return fmt.Errorf("open console of %s/%s: %w", demoNamespace, demoVM, err)
	}
	defer stream.Close()
	con := newConsoleReader(stream)
	// The guest may still be booting: poke until its shell prompt answers.
	for !con.waitFor(ctx, guestPrompt, 3*time.Second) {
		if ctx.Err() != nil {
			return fmt.Errorf("no shell prompt on the console of %s/%s: %q", demoNamespace, demoVM, con.tail())
		}
		if _, err := stream.Write([]byte("\n")); err != nil {
			return err
		}
	}
	for _, cmd := range []string{
		"echo booted: $(uname -sr), up $(cut -d' ' -f1 /proc/uptime)s",
		"echo nic: eth0 $(cat /sys/class/net/eth0/address)",
		"echo disk: vda $(( $(cat /sys/block/vda/size) * 512 )) bytes",
	} {
		mark := con.len()
		if _, err := stream.Write([]byte(cmd + "\n")); err != nil {
			return err
		}
		if !con.waitFor(ctx, guestPrompt, 20*time.Second) {
			return fmt.Errorf("console of %s/%s did not answer %q", demoNamespace, demoVM, cmd)
		}
		for _, line := range con.linesSince(mark) {
			if strings.HasPrefix(line, "booted:") || strings.HasPrefix(line, "nic:") || strings.HasPrefix(line, "disk:") {
				fmt.Fprintf(cfg.Out, "    console| %s\n", line)
				if strings.HasPrefix(line, "nic:") && mac != "" && !strings.Contains(line, strings.ToLower(mac)) {
					return fmt.Errorf("guest NIC shows %q, the VMI says %s", line, mac)
				}
			}
		}
	}
	return nil
}

// guestPrompt is the test guest's shell prompt (see test/guest).
const guestPrompt = "nodevirt# "

// consoleReader collects a console stream's output for line-based waits.
type consoleReader struct {
	mu  sync.Mutex
	buf strings.Builder
}

func newConsoleReader(r io.Reader) *consoleReader {
	c := &consoleReader{}
	go func() {
		b := make([]byte, 4096)
		for {
			n, err := r.Read(b)
			c.mu.Lock()
			c.buf.Write(b[:n])
			c.mu.Unlock()
			if err != nil {
				return
			}
		}
	}()
	return c
}

func (c *consoleReader) len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.buf.Len()
}

func (c *consoleReader) since(mark int) string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.buf.String()[mark:]
}

func (c *consoleReader) linesSince(mark int) []string {
	var out []string
	for _, l := range strings.Split(c.since(mark), "\n") {
		out = append(out, strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(l), guestPrompt)))
	}
	return out
}

func (c *consoleReader) tail() string {
	s := c.since(0)
	if len(s) > 300 {
		s = s[len(s)-300:]
	}
	return s
}

// waitFor reports whether text appears in output arriving from now on
// within d.
func (c *consoleReader) waitFor(ctx context.Context, text string, d time.Duration) bool {
	mark := c.len()
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		if strings.Contains(c.since(mark), text) {
			return true
		}
		time.Sleep(50 * time.Millisecond)
	}
	return false
}

// virshHint is how an administrator lists the domains of node.
func virshHint(cfg Config, node string) string {
	if cfg.NodeCount > 1 {
		return fmt.Sprintf("%s/nodevirt-lab exec %s -- virsh -c qemu:///system list", cfg.BinDir, node)
	}
	return "virsh -c qemu:///system list"
}
