package admission

import (
	"context"
	"log/slog"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/certs"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

func TestMain(m *testing.M) { controlplane.Main(m, controlplane.Config{}) }

type env struct {
	kube kubernetes.Interface
	virt *client.Set
	ns   string
}

func setup(t *testing.T) env {
	t.Helper()
	cp := controlplane.Shared(t)
	testkit.InstallCRDs(t, cp)
	virt, err := client.NewSet(cp.RestConfig)
	if err != nil {
		t.Fatal(err)
	}
	return env{kube: cp.Clientset(t), virt: virt, ns: cp.Namespace(t)}
}

// serve runs a server until the test ends and waits until the apiserver
// calls it.
func serve(t *testing.T, e env, cc certs.Config, contributors ...Contributor) *Server {
	t.Helper()
	return serveConfig(t, e, Config{Addr: "127.0.0.1:0", Namespace: e.ns, Certs: cc}, contributors...)
}

// serveConfig is serve with a whole Config.
func serveConfig(t *testing.T, e env, cfg Config, contributors ...Contributor) *Server {
	t.Helper()
	s, err := NewRole(cfg,
		Deps{Kube: e.kube, Virt: e.virt, Log: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))},
		contributors...)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	t.Cleanup(func() {
		_ = Uninstall(context.Background(), e.kube, e.ns)
		cancel()
		<-done
	})
	select {
	case <-s.Ready():
	case err := <-done:
		t.Fatalf("server: %v", err)
	}
	// The apiserver picks the configuration up asynchronously: wait until a
	// bad VM is refused.
	testkit.PollEvery(t, 100*time.Millisecond, 30*time.Second, "the webhook to take effect", func() (bool, error) {
		ctx := context.Background()
		vm := vmWith(e.ns, "probe", func(s *kubevirtv1.VirtualMachineInstanceSpec) { s.Volumes = nil })
		_, err := e.virt.VMs.Create(ctx, vm)
		if err == nil {
			_ = e.virt.VMs.Delete(ctx, e.ns, "probe", metav1.DeleteOptions{})
		}
		return err != nil && strings.Contains(err.Error(), "denied the request"), err
	})
	return s
}

func vmWith(ns, name string, edit func(*kubevirtv1.VirtualMachineInstanceSpec)) *kubevirtv1.VirtualMachine {
	halted := kubevirtv1.RunStrategyHalted
	mem := resource.MustParse("64Mi")
	spec := kubevirtv1.VirtualMachineInstanceSpec{
		Domain: kubevirtv1.DomainSpec{
			Memory:  &kubevirtv1.Memory{Guest: &mem},
			Devices: kubevirtv1.Devices{Disks: []kubevirtv1.Disk{{Name: "root"}}},
		},
		Volumes: []kubevirtv1.Volume{{Name: "root", VolumeSource: kubevirtv1.VolumeSource{
			ContainerDisk: &kubevirtv1.ContainerDiskSource{Image: "quay.io/containerdisks/fedora"}}}},
	}
	if edit != nil {
		edit(&spec)
	}
	return &kubevirtv1.VirtualMachine{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: kubevirtv1.VirtualMachineSpec{RunStrategy: &halted,
			Template: &kubevirtv1.VirtualMachineInstanceTemplateSpec{Spec: spec}},
	}
}

func TestValidationNamesTheField(t *testing.T) {
	e := setup(t)
	serve(t, e, certs.Config{})
	ctx := context.Background()
	cases := []struct {
		name string
		edit func(*kubevirtv1.VirtualMachineInstanceSpec)
		want string
	}{
		{"missing-volume", func(s *kubevirtv1.VirtualMachineInstanceSpec) { s.Volumes[0].Name = "other" },
			`spec.template.spec.domain.devices.disks[0].name: Not found: "root"`},
		{"duplicate-disk", func(s *kubevirtv1.VirtualMachineInstanceSpec) {
			s.Domain.Devices.Disks = append(s.Domain.Devices.Disks, kubevirtv1.Disk{Name: "root"})
		}, `spec.template.spec.domain.devices.disks[1].name: Duplicate value: "root"`},
		{"iface-without-network", func(s *kubevirtv1.VirtualMachineInstanceSpec) {
			s.Domain.Devices.Interfaces = []kubevirtv1.Interface{{Name: "nic0",
				InterfaceBindingMethod: kubevirtv1.InterfaceBindingMethod{Bridge: &kubevirtv1.InterfaceBridge{}}}}
		}, `spec.template.spec.domain.devices.interfaces[0].name: Not found: "nic0"`},
		{"bad-memory", func(s *kubevirtv1.VirtualMachineInstanceSpec) {
			q := resource.MustParse("1Ki")
			s.Domain.Memory.Guest = &q
		}, `spec.template.spec.domain.memory.guest: Invalid value: "1Ki": must be greater than or equal to 1Mi`},
		{"no-memory", func(s *kubevirtv1.VirtualMachineInstanceSpec) { s.Domain.Memory = nil },
			`spec.template.spec.domain.resources.requests.memory: Required value`},
		{"bad-mac", func(s *kubevirtv1.VirtualMachineInstanceSpec) {
			s.Networks = []kubevirtv1.Network{*kubevirtv1.DefaultPodNetwork()}
			s.Domain.Devices.Interfaces = []kubevirtv1.Interface{{Name: "default", MacAddress: "03:00:00:00:00:01",
				InterfaceBindingMethod: kubevirtv1.InterfaceBindingMethod{Masquerade: &kubevirtv1.InterfaceMasquerade{}}}}
		}, `spec.template.spec.domain.devices.interfaces[0].macAddress: Invalid value: "03:00:00:00:00:01": must be a unicast MAC address`},
		{"sockets-above-max", func(s *kubevirtv1.VirtualMachineInstanceSpec) {
			s.Domain.CPU = &kubevirtv1.CPU{Sockets: 5, MaxSockets: 4}
		}, `spec.template.spec.domain.cpu.sockets: Invalid value: 5: ` + MaxSocketsMessage},
	}
	for _, c := range cases {
		_, err := e.virt.VMs.Create(ctx, vmWith(e.ns, c.name, c.edit))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: got %v, want an error containing %q", c.name, err, c.want)
		}
	}
	if _, err := e.virt.VMs.Create(ctx, vmWith(e.ns, "good", nil)); err != nil {
		t.Errorf("valid vm refused: %v", err)
	}
}

func TestVMIDefaults(t *testing.T) {
	e := setup(t)
	serve(t, e, certs.Config{})
	vm := vmWith(e.ns, "x", nil)
	vmi := &kubevirtv1.VirtualMachineInstance{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "defaults"}, Spec: vm.Spec.Template.Spec}
	got, err := e.virt.VMIs.Create(context.Background(), vmi)
	if err != nil {
		t.Fatal(err)
	}
	d := got.Spec.Domain
	if len(got.Spec.Networks) != 1 || got.Spec.Networks[0].Pod == nil || len(d.Devices.Interfaces) != 1 || d.Devices.Interfaces[0].Masquerade == nil {
		t.Errorf("no default pod network: %+v %+v", got.Spec.Networks, d.Devices.Interfaces)
	}
	if d.Devices.Disks[0].Disk == nil || d.Devices.Disks[0].Disk.Bus != "virtio" {
		t.Errorf("disk not defaulted to virtio: %+v", d.Devices.Disks[0])
	}
	if d.Machine == nil || d.Machine.Type != "q35" || d.CPU == nil || d.CPU.Sockets != 1 {
		t.Errorf("machine/cpu not defaulted: %+v %+v", d.Machine, d.CPU)
	}
	if q := d.Resources.Requests.Memory(); q.String() != "64Mi" {
		t.Errorf("memory request %s, want 64Mi", q)
	}
}

// TestRotationWithoutFailedAdmissions rotates the CA and the serving
// certificate several times while VMs are created without pause; every
// creation must be admitted.
func TestRotationWithoutFailedAdmissions(t *testing.T) {
	e := setup(t)
	s := serve(t, e, certs.Config{Propagation: time.Second, Durations: func(context.Context) certs.Durations {
		return certs.Durations{CA: 12 * time.Second, CARenewBefore: 6 * time.Second, Server: 6 * time.Second, ServerRenewBefore: 3 * time.Second}
	}})
	ctx := context.Background()
	first := s.cm.CABundle()
	servedCerts := map[string]bool{}
	var ok, failed atomic.Int64
	var wg sync.WaitGroup
	stop := make(chan struct{})
	var mu sync.Mutex
	var firstErr error
	for w := 0; w < 3; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				vm := vmWith(e.ns, "", nil)
				vm.GenerateName = "rot-"
				if _, err := e.virt.VMs.Create(ctx, vm); err != nil {
					failed.Add(1)
					mu.Lock()
					if firstErr == nil {
						firstErr = err
					}
					mu.Unlock()
				} else {
					ok.Add(1)
				}
				time.Sleep(20 * time.Millisecond)
			}
		}()
	}
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		if c, err := s.cm.GetCertificate(nil); err == nil {
			servedCerts[string(c.Certificate[0])] = true
		}
		time.Sleep(200 * time.Millisecond)
	}
	close(stop)
	wg.Wait()
	if failed.Load() > 0 {
		t.Errorf("%d of %d admissions failed during rotation; first: %v", failed.Load(), failed.Load()+ok.Load(), firstErr)
	}
	if ok.Load() < 50 {
		t.Errorf("only %d admissions happened", ok.Load())
	}
	if len(servedCerts) < 4 {
		t.Errorf("serving certificate changed only %d times", len(servedCerts))
	}
	if string(s.cm.CABundle()) == string(first) {
		t.Error("ca never rotated")
	}
	mwc, err := e.kube.AdmissionregistrationV1().ValidatingWebhookConfigurations().Get(ctx, ValidatingConfigName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if string(mwc.Webhooks[0].ClientConfig.CABundle) != string(s.cm.CABundle()) {
		t.Error("configuration does not carry the current bundle")
	}
	t.Logf("%d admissions, %d serving certificates", ok.Load(), len(servedCerts))
}

func TestUninstallRemovesConfigurations(t *testing.T) {
	e := setup(t)
	serve(t, e, certs.Config{})
	ctx := context.Background()
	if err := Uninstall(ctx, e.kube, e.ns); err != nil {
		t.Fatal(err)
	}
	if _, err := e.kube.AdmissionregistrationV1().MutatingWebhookConfigurations().Get(ctx, MutatingConfigName, metav1.GetOptions{}); err == nil {
		t.Error("mutating configuration still there")
	}
	if err := Uninstall(ctx, e.kube, e.ns); err != nil {
		t.Errorf("second uninstall: %v", err)
	}
}
