package handler

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	k8sv1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	v1 "kubevirt.io/api/core/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/registry/registrytest"
	"github.com/nodevirt/nodevirt/test/testkit"
)

// A containerDisk image the registry does not have fails the pull: the
// VMI's Synchronized condition says ErrImagePull (then ImagePullBackOff)
// and a Warning Event on the VMI names the image and the error, so
// `kubectl describe vmi` explains why it does not start.
func TestFailedPullEmitsEvent(t *testing.T) {
	ctx := context.Background()
	n := newNode(t)
	reg := registrytest.New()
	host, stop := reg.Serve()
	defer stop()
	cdi := &cdiv1.CDI{ObjectMeta: metav1.ObjectMeta{Name: "cdi",
		Annotations: map[string]string{importstate.AnnImportAllowedNetworks: "127.0.0.0/8"}},
		Spec: cdiv1.CDISpec{Config: &cdiv1.CDIConfigSpec{InsecureRegistries: []string{host}}}}
	if _, err := n.virt.CDIs.Create(ctx, cdi); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	defer n.virt.CDIs.Delete(context.Background(), "", "cdi", metav1.DeleteOptions{})

	h, err := New(Config{
		NodeName: n.name, StateDir: n.stateDir, LibvirtURI: n.uri, Emulation: true,
		Kube: n.kube, Virt: n.virt, ShutdownRetry: 2 * time.Second,
		Log: slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn})).With("node", n.name),
	})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- h.Run(runCtx) }()
	defer func() {
		cancel()
		<-done
	}()

	image := host + "/nowhere/nothing:v1"
	n.schedule(ctx, containerDiskVMI("nopull", image))
	n.waitVMI(ctx, "nopull", 60*time.Second, "a failed pull on Synchronized", func(v *v1.VirtualMachineInstance) bool {
		c := condition(v, v1.VirtualMachineInstanceSynchronized)
		return c != nil && (c.Reason == "ErrImagePull" || c.Reason == "ImagePullBackOff") && v.Status.Phase == v1.Scheduled
	})
	vmi, err := n.virt.VMIs.Get(ctx, n.ns, "nopull")
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	testkit.PollEvery(t, 200*time.Millisecond, 30*time.Second, "an ErrImagePull event naming "+image+" and the error on the vmi", func() (bool, error) {
		evs, err := n.kube.CoreV1().Events(n.ns).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=nopull"})
		if err != nil {
			return false, err
		}
		got = got[:0]
		for _, e := range evs.Items {
			got = append(got, e.Type+" "+e.Reason+" "+e.Message+" on "+e.InvolvedObject.Kind+" from "+e.Source.Host)
			if e.Type == k8sv1.EventTypeWarning && e.Reason == "ErrImagePull" && e.InvolvedObject.UID == vmi.UID &&
				e.InvolvedObject.Kind == "VirtualMachineInstance" && e.Source.Host == n.name &&
				strings.Contains(e.Message, `"`+image+`"`) && strings.Contains(e.Message, "SourceNotFound") {
				return true, nil
			}
		}
		return false, fmt.Errorf("events: %q", got)
	})
}
