package subresources

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apiextensionsclient "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/tools/clientcmd"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	"github.com/nodevirt/nodevirt/clusterbrain/api/live"
	"github.com/nodevirt/nodevirt/clusterbrain/api/rollout"
	"github.com/nodevirt/nodevirt/clusterbrain/client/virtctl"
	"github.com/nodevirt/nodevirt/clusterbrain/crds"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/uploadtls"
	"github.com/nodevirt/nodevirt/clusterbrain/rbac"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

func TestMain(m *testing.M) { controlplane.Main(m, controlplane.Config{}) }

const nodeName = "standin-node"

// env is one subresource server per test binary (the APIService is
// cluster-wide), a stand-in nodeagent and the API types installed.
var env struct {
	once  sync.Once
	err   error
	srv   *Server
	node  *standin
	virt  *client.Set
	admin *virtctl.Client
	// rollout is the server's view of the KubeVirt CR's hotplug gates
	// (none: KubeVirt's defaults); a test that changes it restores it.
	rollout live.Value[rollout.Cluster]
}

func setup(t *testing.T) {
	t.Helper()
	cp := controlplane.Shared(t)
	env.once.Do(func() { env.err = start(t, cp) })
	if env.err != nil {
		t.Fatal(env.err)
	}
}

func start(t *testing.T, cp *controlplane.ControlPlane) error {
	ctx := context.Background()
	kube := cp.Clientset(t)
	ext, err := apiextensionsclient.NewForConfig(cp.RestConfig)
	if err != nil {
		return err
	}
	if err := crds.Install(ctx, ext, crds.Catalog()); err != nil {
		return err
	}
	if err := rbac.Ensure(ctx, kube); err != nil {
		return err
	}
	ns := "nodevirt-subresources-test"
	if _, err := kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		return err
	}
	ca, err := uploadtls.EnsureCA(ctx, kube, ns)
	if err != nil {
		return err
	}
	env.node = startStandin(t, ca, nodeName)
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: nodeName, Annotations: map[string]string{identity.NodeAddressAnnotation: env.node.addr}}}
	if _, err := kube.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{}); err != nil {
		return err
	}
	nodeTLS, err := NodeTLS(ca)
	if err != nil {
		return err
	}
	dyn, err := dynamic.NewForConfig(cp.RestConfig)
	if err != nil {
		return err
	}
	if env.virt, err = client.NewSet(cp.RestConfig); err != nil {
		return err
	}
	env.srv, err = New(Config{Kube: kube, Dynamic: dyn, Virt: env.virt, Namespace: ns, Addr: ":0", NodeTLS: nodeTLS, Rollout: &env.rollout})
	if err != nil {
		return err
	}
	errc := make(chan error, 1)
	go func() { errc <- env.srv.Run(context.Background()) }() // lives as long as the test binary
	select {
	case <-env.srv.Ready():
	case err := <-errc:
		return err
	case <-time.After(60 * time.Second):
		return errors.New("subresource server not ready")
	}
	if env.admin, err = virtctl.NewClient(cp.RestConfig, ""); err != nil {
		return err
	}
	var info Info
	return testkit.Wait(200*time.Millisecond, 60*time.Second, "the subresource API's version", func() (bool, error) {
		err := env.admin.Version(ctx, &info)
		return err == nil, err
	})
}

// as returns a client for ns acting as a user with the given cluster role
// bound in ns (no role: no binding at all).
func as(t *testing.T, ns, user, clusterRole string) *virtctl.Client {
	t.Helper()
	cp := controlplane.Shared(t)
	kc := filepath.Join(t.TempDir(), user+".kubeconfig")
	if err := cp.WriteKubeconfig(kc, user); err != nil {
		t.Fatal(err)
	}
	if clusterRole != "" {
		rb := &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: user, Namespace: ns},
			RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: clusterRole},
			Subjects: []rbacv1.Subject{{Kind: rbacv1.UserKind, APIGroup: rbacv1.GroupName, Name: user}}}
		if _, err := cp.Clientset(t).RbacV1().RoleBindings(ns).Create(context.Background(), rb, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		testkit.WaitAllowed(t, cp.Clientset(t), user, authorizationv1.ResourceAttributes{Namespace: ns, Verb: "get", Group: "kubevirt.io", Resource: "virtualmachines"})
	}
	rc, err := clientcmd.BuildConfigFromFlags("", kc)
	if err != nil {
		t.Fatal(err)
	}
	c, err := virtctl.NewClient(rc, ns)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func adminIn(t *testing.T, ns string) *virtctl.Client {
	c := *env.admin
	c.Namespace = ns
	return &c
}

func newVM(t *testing.T, ns, name string, strategy kubevirtv1.VirtualMachineRunStrategy) *kubevirtv1.VirtualMachine {
	t.Helper()
	vm := &kubevirtv1.VirtualMachine{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: kubevirtv1.VirtualMachineSpec{RunStrategy: &strategy, Template: &kubevirtv1.VirtualMachineInstanceTemplateSpec{
			Spec: kubevirtv1.VirtualMachineInstanceSpec{Domain: kubevirtv1.DomainSpec{
				Resources: kubevirtv1.ResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("128Mi")}},
			}},
		}},
	}
	vm, err := env.virt.VMs.Create(context.Background(), vm)
	if err != nil {
		t.Fatal(err)
	}
	return vm
}

// newVMI makes a VMI that looks run by the stand-in node.
func newVMI(t *testing.T, ns, name string, phase kubevirtv1.VirtualMachineInstancePhase, conds ...kubevirtv1.VirtualMachineInstanceConditionType) *kubevirtv1.VirtualMachineInstance {
	t.Helper()
	ctx := context.Background()
	grace := int64(180)
	vmi := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: kubevirtv1.VirtualMachineInstanceSpec{TerminationGracePeriodSeconds: &grace, Domain: kubevirtv1.DomainSpec{
			Resources: kubevirtv1.ResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("128Mi")}},
		}}}
	vmi, err := env.virt.VMIs.Create(ctx, vmi)
	if err != nil {
		t.Fatal(err)
	}
	vmi.Status.Phase, vmi.Status.NodeName = phase, nodeName
	for _, c := range conds {
		vmi.Status.Conditions = append(vmi.Status.Conditions, kubevirtv1.VirtualMachineInstanceCondition{Type: c, Status: corev1.ConditionTrue})
	}
	if vmi, err = env.virt.VMIs.UpdateStatus(ctx, vmi); err != nil {
		t.Fatal(err)
	}
	return vmi
}

// wantStatus checks err is an API error with code whose message holds msg.
func wantStatus(t *testing.T, what string, err error, code int32, msg string) {
	t.Helper()
	var st apierrors.APIStatus
	if !errors.As(err, &st) || st.Status().Code != code || !strings.Contains(st.Status().Message, msg) {
		t.Fatalf("%s: got %v, want %d containing %q", what, err, code, msg)
	}
}

func TestDiscoveryAndVersion(t *testing.T) {
	setup(t)
	cp := controlplane.Shared(t)
	for _, v := range Versions {
		list, err := cp.Clientset(t).Discovery().ServerResourcesForGroupVersion(Group + "/" + v)
		if err != nil {
			t.Fatal(err)
		}
		names := map[string]bool{}
		for _, r := range list.APIResources {
			names[r.Name] = true
		}
		for _, want := range []string{"virtualmachines/start", "virtualmachines/stop", "virtualmachineinstances/console",
			"virtualmachineinstances/vnc", "virtualmachineinstances/guestosinfo", "expand-vm-spec",
			"virtualmachineinstances/portforward", "virtualmachines/portforward", "virtualmachineinstances/reset",
			"virtualmachines/addvolume", "virtualmachines/removevolume", "virtualmachineinstances/addvolume", "virtualmachineinstances/removevolume",
			"virtualmachineinstances/freeze", "virtualmachineinstances/unfreeze",
			"virtualmachines/objectgraph", "virtualmachineinstances/objectgraph",
			"virtualmachines/evacuate/cancel", "virtualmachineinstances/evacuate/cancel"} {
			if !names[want] {
				t.Errorf("%s discovery lacks %s", v, want)
			}
		}
		// What is not served is not advertised (virtctl would find it and
		// get a 404).
		for _, absent := range []string{"virtualmachineinstances/backup", "virtualmachineinstances/sev/fetchcertchain",
			"virtualmachineinstances/redefine-checkpoint"} {
			if names[absent] {
				t.Errorf("%s discovery advertises %s, which is not served", v, absent)
			}
		}
		for name := range names {
			parts := strings.SplitN(name, "/", 2)
			sub := ""
			if len(parts) == 2 {
				sub = parts[1]
			}
			method := http.MethodPut
			if h, _, _ := env.srv.route(request{resource: parts[0], subresource: sub + "/1"}, http.MethodGet); h != nil {
				continue // parameterized
			}
			if h, _, _ := env.srv.route(request{resource: parts[0], subresource: sub}, http.MethodGet); h != nil {
				method = http.MethodGet
			}
			if h, _, _ := env.srv.route(request{resource: parts[0], subresource: sub}, method); h == nil {
				t.Errorf("%s discovery advertises %s, which has no route", v, name)
			}
		}
	}
	var info Info
	if err := env.admin.Version(context.Background(), &info); err != nil || info.GitVersion == "" || info.GoVersion == "" {
		t.Fatalf("version: %+v %v", info, err)
	}
	body, err := cp.Clientset(t).Discovery().RESTClient().Get().AbsPath("/apis", Group, "v1", "healthz").DoRaw(context.Background())
	if err != nil || !strings.Contains(string(body), `"apiserver":"ok"`) {
		t.Fatalf("healthz: %s %v", body, err)
	}
}

func TestStartStopRestart(t *testing.T) {
	setup(t)
	ctx := context.Background()
	ns := controlplane.Shared(t).Namespace(t)
	c := adminIn(t, ns)

	t.Run("halted: start and stop flip runStrategy", func(t *testing.T) {
		newVM(t, ns, "halted", kubevirtv1.RunStrategyHalted)
		if err := c.VM(ctx, "halted", "start", &kubevirtv1.StartOptions{}); err != nil {
			t.Fatal(err)
		}
		vm, _ := env.virt.VMs.Get(ctx, ns, "halted")
		if *vm.Spec.RunStrategy != kubevirtv1.RunStrategyAlways {
			t.Fatalf("after start runStrategy %s", *vm.Spec.RunStrategy)
		}
		vmi := newVMI(t, ns, "halted", kubevirtv1.Running)
		wantStatus(t, "second start", c.VM(ctx, "halted", "start", nil), http.StatusConflict, "VM is already running")
		grace := int64(7)
		if err := c.VM(ctx, "halted", "stop", &kubevirtv1.StopOptions{GracePeriod: &grace}); err != nil {
			t.Fatal(err)
		}
		vm, _ = env.virt.VMs.Get(ctx, ns, "halted")
		vmi, _ = env.virt.VMIs.Get(ctx, ns, vmi.Name)
		if *vm.Spec.RunStrategy != kubevirtv1.RunStrategyHalted || *vmi.Spec.TerminationGracePeriodSeconds != 7 {
			t.Fatalf("after stop: runStrategy %s, vmi grace %d", *vm.Spec.RunStrategy, *vmi.Spec.TerminationGracePeriodSeconds)
		}
	})
	t.Run("manual: start and restart are state change requests", func(t *testing.T) {
		newVM(t, ns, "manual", kubevirtv1.RunStrategyManual)
		if err := c.VM(ctx, "manual", "start", nil); err != nil {
			t.Fatal(err)
		}
		vm, _ := env.virt.VMs.Get(ctx, ns, "manual")
		if r := vm.Status.StateChangeRequests; len(r) != 1 || r[0].Action != kubevirtv1.StartRequest {
			t.Fatalf("after manual start: %+v", r)
		}
		wantStatus(t, "start while a start is pending", c.VM(ctx, "manual", "restart", nil), http.StatusConflict, "")
		vm.Status.StateChangeRequests = nil
		if _, err := env.virt.VMs.UpdateStatus(ctx, vm); err != nil {
			t.Fatal(err)
		}
		mvmi := newVMI(t, ns, "manual", kubevirtv1.Running)
		five := int64(5)
		wantStatus(t, "restart with grace 5", c.VM(ctx, "manual", "restart", &kubevirtv1.RestartOptions{GracePeriodSeconds: &five}),
			http.StatusBadRequest, "only gracePeriod=0")
		zero := int64(0)
		if err := c.VM(ctx, "manual", "restart", &kubevirtv1.RestartOptions{GracePeriodSeconds: &zero}); err != nil {
			t.Fatal(err)
		}
		vm, _ = env.virt.VMs.Get(ctx, ns, "manual")
		r := vm.Status.StateChangeRequests
		if len(r) != 2 || r[0].Action != kubevirtv1.StopRequest || r[0].UID == nil || *r[0].UID != mvmi.UID || r[1].Action != kubevirtv1.StartRequest {
			t.Fatalf("after restart: %+v", r)
		}
		mvmi, _ = env.virt.VMIs.Get(ctx, ns, "manual")
		if *mvmi.Spec.TerminationGracePeriodSeconds != 1 {
			t.Fatalf("forced restart left grace %d, want 1", *mvmi.Spec.TerminationGracePeriodSeconds)
		}
		// A stop request replaces the pending ones.
		if err := c.VM(ctx, "manual", "stop", nil); err != nil {
			t.Fatal(err)
		}
		vm, _ = env.virt.VMs.Get(ctx, ns, "manual")
		if r := vm.Status.StateChangeRequests; len(r) != 1 || r[0].Action != kubevirtv1.StopRequest {
			t.Fatalf("after stop: %+v", r)
		}
	})
	t.Run("start of a missing vm", func(t *testing.T) {
		wantStatus(t, "start of a missing vm", c.VM(ctx, "nope", "start", nil), http.StatusNotFound, "nope")
	})
	t.Run("dry run changes nothing", func(t *testing.T) {
		newVM(t, ns, "dry", kubevirtv1.RunStrategyHalted)
		if err := c.VM(ctx, "dry", "start", &kubevirtv1.StartOptions{DryRun: []string{metav1.DryRunAll}}); err != nil {
			t.Fatal(err)
		}
		if vm, _ := env.virt.VMs.Get(ctx, ns, "dry"); *vm.Spec.RunStrategy != kubevirtv1.RunStrategyHalted {
			t.Fatalf("dry-run start changed runStrategy to %s", *vm.Spec.RunStrategy)
		}
	})
}

func TestMigrateAndExpand(t *testing.T) {
	setup(t)
	ctx := context.Background()
	ns := controlplane.Shared(t).Namespace(t)
	c := adminIn(t, ns)
	newVM(t, ns, "mig", kubevirtv1.RunStrategyAlways)
	wantStatus(t, "migrate without vmi", c.VM(ctx, "mig", "migrate", nil), http.StatusNotFound, "")
	vmi := newVMI(t, ns, "mig", kubevirtv1.Running)
	// A dry run checks and makes nothing.
	if err := c.VM(ctx, "mig", "migrate", &kubevirtv1.MigrateOptions{DryRun: []string{metav1.DryRunAll}}); err != nil {
		t.Fatalf("dry-run migrate: %v", err)
	}
	if migs, err := env.virt.Migrations.List(ctx, ns, metav1.ListOptions{}); err != nil || len(migs) != 0 {
		t.Fatalf("migrations after a dry run: %+v %v", migs, err)
	}
	// A VMI that can migrate: a migration object, as KubeVirt's virt-api
	// makes it, for the migration controller to drive.
	if err := c.VM(ctx, "mig", "migrate", &kubevirtv1.MigrateOptions{AddedNodeSelector: map[string]string{"zone": "b"}}); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	migs, err := env.virt.Migrations.List(ctx, ns, metav1.ListOptions{})
	if err != nil || len(migs) != 1 || !strings.HasPrefix(migs[0].Name, "kubevirt-migrate-vm-") || migs[0].Spec.VMIName != "mig" ||
		migs[0].Spec.AddedNodeSelector["zone"] != "b" {
		t.Fatalf("migrations: %+v %v", migs, err)
	}
	if err := env.virt.Migrations.Delete(ctx, ns, migs[0].Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	// One on node-local disks: KubeVirt's refusal, word for word.
	vmi.Status.Conditions = append(vmi.Status.Conditions, kubevirtv1.VirtualMachineInstanceCondition{
		Type: kubevirtv1.VirtualMachineInstanceIsMigratable, Status: corev1.ConditionFalse,
		Reason: kubevirtv1.VirtualMachineInstanceReasonDisksNotMigratable, Message: "PVC disk is not shared"})
	if _, err := env.virt.VMIs.UpdateStatus(ctx, vmi); err != nil {
		t.Fatal(err)
	}
	wantStatus(t, "migrate on local disks", c.VM(ctx, "mig", "migrate", nil), http.StatusConflict,
		"Cannot migrate VMI, Reason: "+kubevirtv1.VirtualMachineInstanceReasonDisksNotMigratable+", Message: PVC disk is not shared")
	if migs, err := env.virt.Migrations.List(ctx, ns, metav1.ListOptions{}); err != nil || len(migs) != 0 {
		t.Fatalf("migrations: %+v %v", migs, err)
	}

	var vm kubevirtv1.VirtualMachine
	if err := c.ExpandSpec(ctx, "mig", &vm); err != nil || vm.Name != "mig" {
		t.Fatalf("expand-spec: %+v %v", vm.ObjectMeta, err)
	}
}

func TestInstanceActionsReachTheNode(t *testing.T) {
	setup(t)
	ctx := context.Background()
	ns := controlplane.Shared(t).Namespace(t)
	c := adminIn(t, ns)
	newVMI(t, ns, "run", kubevirtv1.Running)
	newVMI(t, ns, "paused", kubevirtv1.Running, kubevirtv1.VirtualMachineInstancePaused)
	newVMI(t, ns, "agent", kubevirtv1.Running, kubevirtv1.VirtualMachineInstanceAgentConnected)
	newVMI(t, ns, "broken", kubevirtv1.Running)
	newVMI(t, ns, "pending", kubevirtv1.Pending)

	for _, a := range []struct{ vmi, action string }{{"run", "pause"}, {"paused", "unpause"}, {"run", "softreboot"}} {
		if err := c.VMI(ctx, a.vmi, a.action, nil); err != nil {
			t.Fatalf("%s %s: %v", a.action, a.vmi, err)
		}
	}
	calls := strings.Join(env.node.called(), ",")
	for _, want := range []string{"PUT " + ns + "/run/pause", "PUT " + ns + "/paused/unpause", "PUT " + ns + "/run/softreboot"} {
		if !strings.Contains(calls, want) {
			t.Errorf("node saw %s, missing %s", calls, want)
		}
	}
	env.node.mu.Lock()
	peers := strings.Join(env.node.peers, ",")
	env.node.mu.Unlock()
	if !strings.Contains(peers, identity.SubresourcesClientName) {
		t.Errorf("node saw client certificates %q, want %s", peers, identity.SubresourcesClientName)
	}
	wantStatus(t, "pause paused", c.VMI(ctx, "paused", "pause", nil), http.StatusConflict, "VMI is already paused")
	wantStatus(t, "unpause running", c.VMI(ctx, "run", "unpause", nil), http.StatusConflict, "VMI is not paused")
	wantStatus(t, "pause pending", c.VMI(ctx, "pending", "pause", nil), http.StatusConflict, "VM is not running")
	wantStatus(t, "pause on a failing node", c.VMI(ctx, "broken", "pause", nil), http.StatusInternalServerError, "domain is gone")
	wantStatus(t, "pause missing", c.VMI(ctx, "nope", "pause", nil), http.StatusNotFound, "nope")

	wantStatus(t, "guestosinfo without agent", c.GuestInfo(ctx, "run", "guestosinfo", &kubevirtv1.VirtualMachineInstanceGuestAgentInfo{}),
		http.StatusConflict, "VMI does not have guest agent connected")
	var info kubevirtv1.VirtualMachineInstanceGuestAgentInfo
	if err := c.GuestInfo(ctx, "agent", "guestosinfo", &info); err != nil || info.Hostname != "agent.standin" || info.OS.ID != "debian" {
		t.Fatalf("guestosinfo: %+v %v", info, err)
	}
	var users kubevirtv1.VirtualMachineInstanceGuestOSUserList
	if err := c.GuestInfo(ctx, "agent", "userlist", &users); err != nil || len(users.Items) != 1 || users.Items[0].UserName != "root" {
		t.Fatalf("userlist: %+v %v", users, err)
	}
	var fs kubevirtv1.VirtualMachineInstanceFileSystemList
	if err := c.GuestInfo(ctx, "agent", "filesystemlist", &fs); err != nil || len(fs.Items) != 1 || fs.Items[0].MountPoint != "/" {
		t.Fatalf("filesystemlist: %+v %v", fs, err)
	}
}

// readUntil reads from r until want appears or d passes.
func readUntil(t *testing.T, r interface{ Read([]byte) (int, error) }, want string, d time.Duration) string {
	t.Helper()
	got := make(chan string, 1)
	go func() {
		var buf []byte
		p := make([]byte, 4096)
		for {
			n, err := r.Read(p)
			buf = append(buf, p[:n]...)
			if strings.Contains(string(buf), want) || err != nil {
				got <- string(buf)
				return
			}
		}
	}()
	select {
	case s := <-got:
		if !strings.Contains(s, want) {
			t.Fatalf("stream ended without %q; read %q", want, s)
		}
		return s
	case <-time.After(d):
		t.Fatalf("no %q within %s", want, d)
		return ""
	}
}

func TestConsoleAndVNC(t *testing.T) {
	setup(t)
	ctx := context.Background()
	ns := controlplane.Shared(t).Namespace(t)
	c := adminIn(t, ns)
	newVMI(t, ns, "con", kubevirtv1.Running)
	newVMI(t, ns, "pending", kubevirtv1.Pending)

	t0 := time.Now()
	first, err := c.Stream(ctx, "con", "console", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer first.Close()
	readUntil(t, first, "standin console ready", 10*time.Second)
	t.Logf("console open in %s", time.Since(t0).Round(time.Millisecond))
	t0 = time.Now()
	if _, err := first.Write([]byte("echo $((6*7))-from-the-guest\n")); err != nil {
		t.Fatal(err)
	}
	readUntil(t, first, "42-from-the-guest", 10*time.Second)
	t.Logf("command round trip %s", time.Since(t0).Round(time.Millisecond))

	// A second console connection replaces the first.
	second, err := c.Stream(ctx, "con", "console", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer second.Close()
	readUntil(t, second, "standin console ready", 10*time.Second)
	ended := make(chan error, 1)
	go func() {
		_, err := first.Read(make([]byte, 1024))
		for err == nil {
			_, err = first.Read(make([]byte, 1024))
		}
		ended <- err
	}()
	select {
	case <-ended:
	case <-time.After(10 * time.Second):
		t.Fatal("first console still open after a second one connected")
	}
	if _, err := second.Write([]byte("echo second-$((1+1))\n")); err != nil {
		t.Fatal(err)
	}
	readUntil(t, second, "second-2", 10*time.Second)

	vnc, err := c.Stream(ctx, "con", "vnc", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer vnc.Close()
	readUntil(t, vnc, "RFB 003.008", 10*time.Second)
	if _, err := vnc.Write([]byte("client-init")); err != nil {
		t.Fatal(err)
	}
	readUntil(t, vnc, "client-init", 10*time.Second)

	_, err = c.Stream(ctx, "pending", "console", nil)
	var se *virtctl.StreamError
	if !errors.As(err, &se) || se.Code != http.StatusBadRequest || !strings.Contains(se.Error(), "VMI is not running") {
		t.Fatalf("console of a pending vmi: %v", err)
	}
}

func TestRBAC(t *testing.T) {
	setup(t)
	ctx := context.Background()
	cp := controlplane.Shared(t)
	ns := cp.Namespace(t)
	newVM(t, ns, "vm", kubevirtv1.RunStrategyAlways)
	newVMI(t, ns, "vm", kubevirtv1.Running, kubevirtv1.VirtualMachineInstanceAgentConnected)

	nobody := as(t, ns, "nobody-"+ns, "")
	wantStatus(t, "start without roles", nobody.VM(ctx, "vm", "start", nil), http.StatusForbidden, "virtualmachines/start")
	wantStatus(t, "pause without roles", nobody.VMI(ctx, "vm", "pause", nil), http.StatusForbidden, "virtualmachineinstances/pause")
	_, err := nobody.Stream(ctx, "vm", "console", nil)
	var se *virtctl.StreamError
	if !errors.As(err, &se) || se.Code != http.StatusForbidden {
		t.Fatalf("console without roles: %v", err)
	}

	viewer := as(t, ns, "viewer-"+ns, rbac.View)
	var info kubevirtv1.VirtualMachineInstanceGuestAgentInfo
	if err := viewer.GuestInfo(ctx, "vm", "guestosinfo", &info); err != nil {
		t.Fatalf("view may read guestosinfo: %v", err)
	}
	wantStatus(t, "start as viewer", viewer.VM(ctx, "vm", "start", nil), http.StatusForbidden, "virtualmachines/start")
	if _, err := viewer.Stream(ctx, "vm", "console", nil); !errors.As(err, &se) || se.Code != http.StatusForbidden {
		t.Fatalf("console as viewer: %v", err)
	}

	editor := as(t, ns, "editor-"+ns, rbac.Edit)
	if err := editor.VM(ctx, "vm", "stop", nil); err != nil {
		t.Fatalf("edit may stop: %v", err)
	}
	if vm, _ := env.virt.VMs.Get(ctx, ns, "vm"); *vm.Spec.RunStrategy != kubevirtv1.RunStrategyHalted {
		t.Fatalf("editor's stop left runStrategy %s", *vm.Spec.RunStrategy)
	}
	wantStatus(t, "migrate as editor", editor.VM(ctx, "vm", "migrate", nil), http.StatusForbidden, "virtualmachines/migrate")

	// The server trusts only the aggregator: a direct call claiming to be
	// the admin is refused.
	req, _ := http.NewRequest(http.MethodPut, "https://"+env.srv.Endpoint()+"/apis/"+Group+"/v1/namespaces/"+ns+"/virtualmachines/vm/start", nil)
	req.Header.Set("X-Remote-User", "nodevirt-admin")
	req.Header.Add("X-Remote-Group", "system:masters")
	resp, err := insecureClient().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var st metav1.Status
	_ = json.NewDecoder(resp.Body).Decode(&st)
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("direct call with forged headers: %d %s", resp.StatusCode, st.Message)
	}
}

// syncBuffer is a bytes.Buffer safe for a writer and a polling reader.
type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestCLI drives nodevirt's virtctl verbs with a kubeconfig file, as a user
// would.
func TestCLI(t *testing.T) {
	setup(t)
	ctx := context.Background()
	cp := controlplane.Shared(t)
	ns := cp.Namespace(t)
	newVM(t, ns, "cli", kubevirtv1.RunStrategyHalted)
	virtctlRun := func(stdin io.Reader, args ...string) (string, string, int) {
		var out, errb syncBuffer
		if stdin == nil {
			stdin = strings.NewReader("")
		}
		code := virtctl.Run(ctx, append([]string{"--kubeconfig", cp.Kubeconfig}, args...), virtctl.IO{In: stdin, Out: &out, Err: &errb})
		return out.String(), errb.String(), code
	}
	if out, errs, code := virtctlRun(nil, "start", "cli", "-n", ns); code != 0 || !strings.Contains(out, "VM cli was scheduled to start") {
		t.Fatalf("start: %d %q %q", code, out, errs)
	}
	newVMI(t, ns, "cli", kubevirtv1.Running, kubevirtv1.VirtualMachineInstanceAgentConnected)
	if _, errs, code := virtctlRun(nil, "start", "cli", "-n", ns); code != 1 || !strings.Contains(errs, "VM is already running") {
		t.Fatalf("second start: %d %q", code, errs)
	}
	if out, errs, code := virtctlRun(nil, "-n", ns, "pause", "vmi", "cli"); code != 0 || !strings.Contains(out, "VMI cli was scheduled to pause") {
		t.Fatalf("pause: %d %q %q", code, out, errs)
	}
	if out, errs, code := virtctlRun(nil, "guestosinfo", "--namespace="+ns, "cli"); code != 0 || !strings.Contains(out, `"hostname": "cli.standin"`) {
		t.Fatalf("guestosinfo: %d %q %q", code, out, errs)
	}
	if out, errs, code := virtctlRun(nil, "version"); code != 0 || !strings.Contains(out, "Server Version: {") {
		t.Fatalf("version: %d %q %q", code, out, errs)
	}
	if out, errs, code := virtctlRun(nil, "stop", "cli", "-n", ns, "--force", "--grace-period", "0"); code != 0 || !strings.Contains(out, "scheduled to stop") {
		t.Fatalf("stop --force: %d %q %q", code, out, errs)
	}
	vmi, _ := env.virt.VMIs.Get(ctx, ns, "cli")
	if *vmi.Spec.TerminationGracePeriodSeconds != 0 {
		t.Fatalf("stop --force --grace-period 0 left grace %d", *vmi.Spec.TerminationGracePeriodSeconds)
	}

	// console: type a command, read its output, leave with Ctrl+].
	inR, inW := io.Pipe()
	var out, errb syncBuffer
	code := make(chan int, 1)
	go func() {
		code <- virtctl.Run(ctx, []string{"--kubeconfig", cp.Kubeconfig, "-n", ns, "console", "cli"}, virtctl.IO{In: inR, Out: &out, Err: &errb})
	}()
	testkit.Until(t, 10*time.Second, "console banner", func() bool { return strings.Contains(out.String(), "standin console ready") })
	if !strings.Contains(errb.String(), "Successfully connected to cli console") {
		t.Fatalf("console banner: %q", errb.String())
	}
	_, _ = inW.Write([]byte("echo cli-$((2+3))\n"))
	testkit.Until(t, 10*time.Second, "command output", func() bool { return strings.Contains(out.String(), "cli-5") })
	_, _ = inW.Write([]byte{29})
	select {
	case c := <-code:
		if c != 0 {
			t.Fatalf("console exit %d: %s", c, errb.String())
		}
	case <-time.After(10 * time.Second):
		t.Fatal("console did not end on Ctrl+]")
	}
}

// TestCLIVNCProxyOnly runs "virtctl vnc --proxy-only" and speaks through the
// printed port.
func TestCLIVNCProxyOnly(t *testing.T) {
	setup(t)
	cp := controlplane.Shared(t)
	ns := cp.Namespace(t)
	newVMI(t, ns, "v", kubevirtv1.Running)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var out, errb syncBuffer
	code := make(chan int, 1)
	go func() {
		code <- virtctl.Run(ctx, []string{"--kubeconfig", cp.Kubeconfig, "-n", ns, "vnc", "v", "--proxy-only"}, virtctl.IO{In: strings.NewReader(""), Out: &out, Err: &errb})
	}()
	testkit.Until(t, 10*time.Second, "proxy port", func() bool { return strings.Contains(out.String(), `{"port":`) })
	var p struct{ Port int }
	if err := json.Unmarshal([]byte(strings.TrimSpace(out.String())), &p); err != nil || p.Port == 0 {
		t.Fatalf("proxy-only output %q: %v", out.String(), err)
	}
	conn, err := net.Dial("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p.Port)))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	readUntil(t, conn, "RFB 003.008", 10*time.Second)
	cancel()
	select {
	case c := <-code:
		if c != 0 {
			t.Fatalf("vnc exit %d: %s", c, errb.String())
		}
	case <-time.After(10 * time.Second):
		t.Fatal("vnc proxy did not stop")
	}
}
