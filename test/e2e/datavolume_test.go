package e2e

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
	"github.com/nodevirt/nodevirt/test/guest"
)

// serveFile serves one file over HTTP on loopback until the test ends.
func serveFile(t *testing.T, path string) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	name := filepath.Base(path)
	mux := http.NewServeMux()
	mux.HandleFunc("/"+name, func(w http.ResponseWriter, r *http.Request) { http.ServeFile(w, r, path) })
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return fmt.Sprintf("http://%s/%s", ln.Addr(), name)
}

// guestImageURL serves the guest's boot disk as qcow2 over loopback HTTP
// until the test ends.
func (n *testNS) guestImageURL() string {
	n.t.Helper()
	raw, err := bootDisk()
	if err != nil {
		n.t.Fatalf("guest image: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	image, err := guest.QCOW2(ctx, raw)
	if err != nil {
		n.t.Fatalf("guest qcow2 image: %v", err)
	}
	return serveFile(n.t, image)
}

// dataVolumeVM is a VM whose root disk is a dataVolumeTemplate "<name>-root"
// imported from url onto the hostpath-csi class, as KubeVirt's
// documentation writes it.
func (n *testNS) dataVolumeVM(name, url string, rs kubevirtv1.VirtualMachineRunStrategy, opts ...vmiOption) *kubevirtv1.VirtualMachine {
	return n.dvTemplateVM(name, &cdiv1.DataVolumeSource{HTTP: &cdiv1.DataVolumeSourceHTTP{URL: url}}, "128Mi", rs, opts...)
}

// dvTemplateVM is a VM whose root disk is a dataVolumeTemplate "<name>-root"
// of size on the hostpath-csi class, filled from src.
func (n *testNS) dvTemplateVM(name string, src *cdiv1.DataVolumeSource, size string, rs kubevirtv1.VirtualMachineRunStrategy, opts ...vmiOption) *kubevirtv1.VirtualMachine {
	class := "hostpath-csi"
	spec := vmiSpec("unused", opts...)
	spec.Volumes[0].VolumeSource = kubevirtv1.VolumeSource{DataVolume: &kubevirtv1.DataVolumeSource{Name: name + "-root"}}
	return &kubevirtv1.VirtualMachine{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: n.name},
		Spec: kubevirtv1.VirtualMachineSpec{
			RunStrategy: &rs,
			DataVolumeTemplates: []kubevirtv1.DataVolumeTemplateSpec{{
				ObjectMeta: metav1.ObjectMeta{Name: name + "-root"},
				Spec: cdiv1.DataVolumeSpec{
					Source: src,
					Storage: &cdiv1.StorageSpec{StorageClassName: &class,
						Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{
							corev1.ResourceStorage: resource.MustParse(size)}}},
				},
			}},
			Template: &kubevirtv1.VirtualMachineInstanceTemplateSpec{Spec: spec},
		},
	}
}

// waitImported waits until the DataVolume's claim is bound, then until the
// import succeeded, and returns the DataVolume.
func (n *testNS) waitImported(vm, dvName string) *cdiv1.DataVolume {
	n.t.Helper()
	e := n.e
	n.eventually(90*time.Second, "persistentvolumeclaim "+dvName+" Bound", func() (bool, string) {
		pvc, err := e.kube.CoreV1().PersistentVolumeClaims(n.name).Get(context.Background(), dvName, metav1.GetOptions{})
		if err != nil {
			return false, "pvc: " + err.Error() + " (clusterbrain/datavolume creates it); " + n.diagnoseVM(vm, nil)
		}
		return pvc.Status.Phase == corev1.ClaimBound, fmt.Sprintf("pvc phase %s, storage class %v; events: %s",
			pvc.Status.Phase, ptrString(pvc.Spec.StorageClassName), n.events("PersistentVolumeClaim", dvName))
	})
	var out *cdiv1.DataVolume
	n.eventually(2*time.Minute, "datavolume "+dvName+" Succeeded", func() (bool, string) {
		dv, err := e.virt.DataVolumes.Get(context.Background(), n.name, dvName)
		if err != nil {
			return false, "datavolume: " + err.Error() + " (clusterbrain/vmcontroller creates it from dataVolumeTemplates); " + n.diagnoseVM(vm, nil)
		}
		var conds []string
		for _, c := range dv.Status.Conditions {
			conds = append(conds, fmt.Sprintf("%s=%s (%s: %s)", c.Type, c.Status, c.Reason, c.Message))
		}
		why := fmt.Sprintf("phase %q progress %q conditions [%s] (import by nodeagent/dvimport)", dv.Status.Phase, dv.Status.Progress, strings.Join(conds, ", "))
		if dv.Status.Phase == cdiv1.Failed {
			n.t.Fatalf("datavolume failed: %s", why)
		}
		out = dv
		return dv.Status.Phase == cdiv1.Succeeded, why
	})
	return out
}

// TestDataVolumeImport: a VM whose root disk is a dataVolumeTemplate
// imported over HTTP (a qcow2 image on a loopback server) onto the node's
// hostpath-csi storage boots from that disk.
func TestDataVolumeImport(t *testing.T) {
	t.Parallel()
	e := require(t)
	n := e.namespace(t)
	n.createVM(n.dataVolumeVM("imported", n.guestImageURL(), kubevirtv1.RunStrategyAlways))
	n.waitImported("imported", "imported-root")
	n.waitVMIOfVM("imported", 2*time.Minute)
	dom, err := domainXML(n.name, "imported")
	if err != nil {
		t.Fatal(err)
	}
	if src := diskSource(dom.Devices.Disks[0].Source); strings.HasPrefix(src, n.e.path("disks")) || src == "" {
		t.Errorf("the domain's first disk is %q, not the imported volume", src)
	}
	s := n.waitBooted("imported")
	if !s.contains(`NODEVIRT-DISK vda \d+`) {
		t.Errorf("the guest booted from the imported disk but did not report vda")
	}
}

func ptrString(p *string) string {
	if p == nil {
		return "<nil>"
	}
	return *p
}

// events returns the last events about one object of the test's namespace.
func (n *testNS) events(kind, name string) string {
	list, err := n.e.kube.CoreV1().Events(n.name).List(context.Background(), metav1.ListOptions{
		FieldSelector: "involvedObject.kind=" + kind + ",involvedObject.name=" + name})
	if err != nil {
		return err.Error()
	}
	var out []string
	for _, ev := range list.Items {
		out = append(out, fmt.Sprintf("%s %s: %s", ev.Type, ev.Reason, ev.Message))
	}
	if len(out) > 4 {
		out = out[len(out)-4:]
	}
	if len(out) == 0 {
		return "none"
	}
	return strings.Join(out, " | ")
}

// TestImmediatePlainClaimBound: a plain claim (no DataVolume) of an
// Immediate class of the hostpath driver is given a node by the brain, as
// upstream's node-deployed external-provisioners pick one, within the
// class's allowedTopologies; that node's agent provisions it and the claim
// is bound to a volume there.
func TestImmediatePlainClaimBound(t *testing.T) {
	t.Parallel()
	e := require(t)
	n := e.namespace(t)
	ctx := context.Background()
	class := "plain-" + n.name
	immediate := storagev1.VolumeBindingImmediate
	sc := &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: class}, Provisioner: "kubevirt.io.hostpath-provisioner",
		VolumeBindingMode: &immediate, Parameters: map[string]string{"storagePool": poolName()},
		AllowedTopologies: []corev1.TopologySelectorTerm{{MatchLabelExpressions: []corev1.TopologySelectorLabelRequirement{
			{Key: corev1.LabelHostname, Values: []string{e.nodeName}}}}}}
	if _, err := e.kube.StorageV1().StorageClasses().Create(ctx, sc, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = e.kube.StorageV1().StorageClasses().Delete(context.Background(), class, metav1.DeleteOptions{})
	})
	pvc := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: "plain", Namespace: n.name},
		Spec: corev1.PersistentVolumeClaimSpec{StorageClassName: &class, AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("64Mi")}}}}
	if _, err := e.kube.CoreV1().PersistentVolumeClaims(n.name).Create(ctx, pvc, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	n.eventually(2*time.Minute, "plain claim Bound on "+e.nodeName, func() (bool, string) {
		got, err := e.kube.CoreV1().PersistentVolumeClaims(n.name).Get(ctx, "plain", metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		if sel := got.Annotations[importstate.AnnSelectedNode]; sel != "" && sel != e.nodeName {
			t.Fatalf("plain claim placed on %s, outside its class's allowedTopologies (%s)", sel, e.nodeName)
		}
		if got.Status.Phase != corev1.ClaimBound {
			return false, fmt.Sprintf("phase %s, selected node %q; events: %s", got.Status.Phase,
				got.Annotations[importstate.AnnSelectedNode], n.events("PersistentVolumeClaim", "plain"))
		}
		pv, err := e.kube.CoreV1().PersistentVolumes().Get(ctx, got.Spec.VolumeName, metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		if node := importstate.PVNode(pv); node != e.nodeName {
			t.Fatalf("plain claim bound to %s on node %q, want %s", pv.Name, node, e.nodeName)
		}
		return true, ""
	})
}
