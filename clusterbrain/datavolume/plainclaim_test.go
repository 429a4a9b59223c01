package datavolume

import (
	"context"
	"testing"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"

	hppv1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hostpathprovisioner/v1beta1"
	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
)

// TestImmediatePlainClaimPlaced: a plain claim (of no DataVolume, no
// upload) of an Immediate class of the hostpath driver gets a node, as
// upstream's node-deployed external-provisioners give it one: only a node
// of the class's allowedTopologies whose taints the HostPathProvisioner
// serving the class's pool tolerates (its spec.workload). While no node
// can take it the claim stays unplaced, with a warning event saying why;
// it is placed once the workload tolerates the taint. A claim cloning
// another goes to its source's node. Claims of a WaitForFirstConsumer
// class or of another driver are left alone.
//
// Not parallel: its nodes must not take the other tests' volumes.
func TestImmediatePlainClaimPlaced(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	tainted := corev1.Taint{Key: "dedicated", Value: "vms", Effect: corev1.TaintEffectNoSchedule}
	e.placementNode(t, "plain-a", map[string]string{"rack": "p1"})
	e.placementNode(t, "plain-b", map[string]string{"rack": "p2"}, tainted)

	pool := "plain-" + e.ns
	hpp := e.poolProvisioner(t, "plain-"+e.ns, pool)
	immediate, wffc := storagev1.VolumeBindingImmediate, storagev1.VolumeBindingWaitForFirstConsumer
	onlyB := e.poolClass(t, "plain-rack-"+e.ns, HostpathProvisioner, immediate, pool, "rack", "p2")
	anywhere := e.poolClass(t, "plain-any-"+e.ns, HostpathProvisioner, immediate, pool, "", "")
	waiting := e.poolClass(t, "plain-wffc-"+e.ns, HostpathProvisioner, wffc, pool, "", "")
	foreign := e.poolClass(t, "plain-foreign-"+e.ns, "example.com/other", immediate, pool, "", "")

	e.createClaim(t, "late", waiting, nil)
	e.createClaim(t, "other", foreign, nil)

	// The only allowed node is tainted and the pool's provisioner does
	// not tolerate it: unplaced, saying why.
	e.createClaim(t, "held", onlyB, nil)
	wants := []string{"not in storage class " + onlyB + "'s allowedTopologies",
		"1 taint dedicated:NoSchedule not tolerated by hostpathprovisioner " + hpp + " spec.workload.tolerations"}
	e.waitWarning(t, "held", "NoNodeAvailable", wants...)
	if n := e.selectedNode(t, "held"); n != "" {
		t.Fatalf("claim held placed on %s while no node may take it", n)
	}

	// The pool's provisioner tolerates the taint: the claim goes there.
	e.setProvisionerTolerations(t, hpp, []corev1.Toleration{{Key: "dedicated", Operator: corev1.TolerationOpEqual, Value: "vms", Effect: corev1.TaintEffectNoSchedule}})
	e.waitPlaced(t, "held", "plain-b", "its class's allowedTopologies")

	// A clone follows its source, here a claim the user pinned to plain-a.
	e.createClaim(t, "source", anywhere, map[string]string{importstate.AnnSelectedNode: "plain-a"})
	copyClaim := e.newClaim("copy", anywhere, nil)
	copyClaim.Spec.DataSource = &corev1.TypedLocalObjectReference{Kind: "PersistentVolumeClaim", Name: "source"}
	if _, err := e.kube.CoreV1().PersistentVolumeClaims(e.ns).Create(ctx, copyClaim, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	e.waitPlaced(t, "copy", "plain-a", "its source's node plain-a")

	// Created before the others were placed: never placed.
	for _, name := range []string{"late", "other"} {
		if n := e.selectedNode(t, name); n != "" {
			t.Errorf("claim %s placed on %s: its class is not an Immediate class of the hostpath driver", name, n)
		}
	}
}

// poolProvisioner makes a HostPathProvisioner defining pool, with an empty
// workload; it is deleted at the end of the test.
func (e env) poolProvisioner(t *testing.T, name, pool string) string {
	t.Helper()
	hpp := &hppv1beta1.HostPathProvisioner{ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: hppv1beta1.HostPathProvisionerSpec{StoragePools: []hppv1beta1.StoragePool{{Name: pool, Path: "/var/lib/" + pool}}}}
	if _, err := e.virt.HostPathProvisioners.Create(context.Background(), hpp); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = e.virt.HostPathProvisioners.Delete(context.Background(), "", name, metav1.DeleteOptions{})
	})
	return name
}

// setProvisionerTolerations sets a HostPathProvisioner's
// spec.workload.tolerations.
func (e env) setProvisionerTolerations(t *testing.T, name string, tols []corev1.Toleration) {
	t.Helper()
	ctx := context.Background()
	if err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		hpp, err := e.virt.HostPathProvisioners.Get(ctx, "", name)
		if err != nil {
			return err
		}
		hpp.Spec.Workload.Tolerations = tols
		_, err = e.virt.HostPathProvisioners.Update(ctx, hpp)
		return err
	}); err != nil {
		t.Fatal(err)
	}
}

// newClaim is a 64 MiB claim of class with the given annotations.
func (e env) newClaim(name, class string, ann map[string]string) *corev1.PersistentVolumeClaim {
	return &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: e.ns, Annotations: ann},
		Spec: corev1.PersistentVolumeClaimSpec{StorageClassName: &class, AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("64Mi")}}}}
}

func (e env) createClaim(t *testing.T, name, class string, ann map[string]string) {
	t.Helper()
	if _, err := e.kube.CoreV1().PersistentVolumeClaims(e.ns).Create(context.Background(), e.newClaim(name, class, ann), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// selectedNode is the node claim name was placed on, "" when none.
func (e env) selectedNode(t *testing.T, name string) string {
	t.Helper()
	pvc, err := e.kube.CoreV1().PersistentVolumeClaims(e.ns).Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return pvc.Annotations[importstate.AnnSelectedNode]
}
