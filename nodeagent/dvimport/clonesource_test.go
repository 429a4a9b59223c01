package dvimport_test

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
	"github.com/nodevirt/nodevirt/nodeagent/dvimport/dvimporttest"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

// fill makes a blank DataVolume name in ns and writes content at the start
// of its disk.
func (e env) fill(t *testing.T, ns, name string, content []byte) {
	t.Helper()
	dv := newDV(ns, name, "16Mi", cdiv1.DataVolumeSource{Blank: &cdiv1.DataVolumeBlankImage{}}, true)
	if _, err := e.virt.DataVolumes.Create(context.Background(), dv); err != nil {
		t.Fatal(err)
	}
	o := e
	o.ns = ns
	o.waitPhase(t, name, cdiv1.Succeeded, 60*time.Second)
	f, err := os.OpenFile(e.resolver.Disk(o.pvc(t, name)), os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(content, 0); err != nil {
		t.Fatal(err)
	}
}

// A user who can annotate the claim of their clone cannot make the node
// clone a volume of another namespace: the node takes the source from the
// brain's clone request, never from k8s.io/CloneRequest on the claim.
func TestCloneSourceIsNotTakenFromClaimAnnotations(t *testing.T) {
	t.Parallel()
	e := setup(t)
	victimNS := controlplane.Shared(t).Namespace(t)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	dvimporttest.Provision(ctx, t, e.kube, victimNS, node)
	secret := bytes.Repeat([]byte("VICTIM-SECRET-"), 64)
	mine := bytes.Repeat([]byte("my-own-golden--"), 64)
	e.fill(t, victimNS, "secret", secret)
	e.fill(t, e.ns, "golden", mine)

	// The clone waits for a consumer (no immediate binding): time for the
	// user to rewrite the claim's annotations before a node takes it.
	clone := newDV(e.ns, "sneaky", "16Mi", cdiv1.DataVolumeSource{PVC: &cdiv1.DataVolumeSourcePVC{Name: "golden"}}, false)
	e.create(t, clone)
	var pvc *corev1.PersistentVolumeClaim
	testkit.Eventually(t, 30*time.Second, "a claim for the clone", func() (err error) {
		pvc, err = e.kube.CoreV1().PersistentVolumeClaims(e.ns).Get(context.Background(), "sneaky", metav1.GetOptions{})
		return err
	})
	forged, _ := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": map[string]string{
		importstate.AnnCloneRequest: victimNS + "/secret"}}})
	if _, err := e.kube.CoreV1().PersistentVolumeClaims(e.ns).Patch(context.Background(), pvc.Name, types.MergePatchType, forged, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	place, _ := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": map[string]string{importstate.AnnSelectedNode: node}}})
	if _, err := e.kube.CoreV1().PersistentVolumeClaims(e.ns).Patch(context.Background(), pvc.Name, types.MergePatchType, place, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	e.waitPhase(t, "sneaky", cdiv1.Succeeded, 60*time.Second)
	got, err := os.ReadFile(e.resolver.Disk(e.pvc(t, "sneaky")))
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(got, []byte("VICTIM-SECRET-")) {
		t.Fatalf("the clone holds the other namespace's volume: the node followed the claim's annotation")
	}
	if !bytes.HasPrefix(got, mine) {
		t.Fatalf("the clone does not hold its authorized source (first bytes %q)", got[:32])
	}
}
