package e2e

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// TestVMStartStop: a VM started and stopped several times gets a new VMI
// each time, always with the MAC the pool gave it at creation, which the
// guest sees on its NIC.
func TestVMStartStop(t *testing.T) {
	t.Parallel()
	e := require(t)
	n := e.namespace(t)
	nad, _ := n.bridgeNetwork("cycle-net")
	vm := n.createVM(n.newVM("cycler", kubevirtv1.RunStrategyHalted, withBridge(nad), withGracePeriod(5)))
	poolMAC := vm.Spec.Template.Spec.Domain.Devices.Interfaces[0].MacAddress
	if poolMAC == "" {
		t.Errorf("the VM got no MAC at admission (clusterbrain/macpool)")
	}
	var uids []types.UID
	for i := 1; i <= 3; i++ {
		n.setRunStrategy("cycler", kubevirtv1.RunStrategyAlways)
		vmi := n.waitVMIOfVM("cycler", 2*time.Minute, uids...)
		uids = append(uids, vmi.UID)
		statusMAC, specMAC := interfaceMAC(vmi)
		dom, err := domainXML(n.name, "cycler")
		if err != nil {
			t.Fatal(err)
		}
		domMAC := ""
		if dom.Devices != nil && len(dom.Devices.Interfaces) > 0 && dom.Devices.Interfaces[0].MAC != nil {
			domMAC = dom.Devices.Interfaces[0].MAC.Address
		}
		if poolMAC == "" {
			poolMAC = specMAC
		}
		for what, mac := range map[string]string{"vmi spec": specMAC, "vmi status": statusMAC, "domain": domMAC} {
			if !strings.EqualFold(mac, poolMAC) {
				t.Errorf("start %d: %s MAC %q, want the VM's %q", i, what, mac, poolMAC)
			}
		}
		if i != 2 {
			s := n.serial("cycler")
			m := s.expect(`NODEVIRT-NIC eth0 (\S+)`, bootTimeout)
			if !strings.EqualFold(m[1], poolMAC) {
				t.Errorf("start %d: the guest sees MAC %s, want %s", i, m[1], poolMAC)
			}
			s.expect(`NODEVIRT-GUEST-READY`, 30*time.Second)
		}
		n.setRunStrategy("cycler", kubevirtv1.RunStrategyHalted)
		n.waitGone("cycler", 90*time.Second)
		n.eventually(30*time.Second, "vm printableStatus Stopped", func() (bool, string) {
			vm, err := n.getVM("cycler")
			if err != nil {
				return false, err.Error()
			}
			return vm.Status.PrintableStatus == kubevirtv1.VirtualMachineStatusStopped, n.diagnoseVM("cycler", nil)
		})
	}
}

// TestVMIRecreatedUnderRunningVM: deleting the VMI of a VM that should run
// makes the VM controller start a new one.
func TestVMIRecreatedUnderRunningVM(t *testing.T) {
	t.Parallel()
	e := require(t)
	n := e.namespace(t)
	n.createVM(n.newVM("phoenix", kubevirtv1.RunStrategyAlways, withGracePeriod(5)))
	first := n.waitVMIOfVM("phoenix", 2*time.Minute)
	n.deleteVMI("phoenix", nil)
	second := n.waitVMIOfVM("phoenix", 2*time.Minute, first.UID)
	if len(second.OwnerReferences) == 0 || second.OwnerReferences[0].Kind != "VirtualMachine" {
		t.Errorf("the new VMI is not owned by its VM: %v", second.OwnerReferences)
	}
}

// phaseRecorder watches a namespace's VMIs and records the phases each VMI
// (by UID) went through, and which VMIs were deleted. A watch the server
// ends is resumed from the last resource version seen.
type phaseRecorder struct {
	mu      sync.Mutex
	phases  map[types.UID][]kubevirtv1.VirtualMachineInstancePhase
	deleted map[types.UID]bool
	errs    []string
}

func (n *testNS) recordPhases() *phaseRecorder {
	n.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	r := &phaseRecorder{phases: map[types.UID][]kubevirtv1.VirtualMachineInstancePhase{}, deleted: map[types.UID]bool{}}
	done := make(chan struct{})
	started := make(chan error, 1)
	go func() {
		defer close(done)
		rv := ""
		for ctx.Err() == nil {
			// The control plane cannot serve a watch without a resource
			// version (its etcd has no watch progress notifications):
			// list, record, then watch from the list's version.
			if rv == "" {
				var err error
				if rv, err = r.list(ctx, n); err != nil {
					if started != nil {
						started <- err
						started = nil
					}
					r.note("list: " + err.Error())
					time.Sleep(time.Second)
					continue
				}
			}
			w, err := n.e.virt.VMIs.Watch(ctx, n.name, metav1.ListOptions{ResourceVersion: rv})
			if started != nil {
				started <- err
				started = nil
			}
			if err != nil {
				r.note("watch: " + err.Error())
				rv = ""
				time.Sleep(time.Second)
				continue
			}
			for ev := range w.ResultChan() {
				if ev.Type == watch.Error {
					r.note(fmt.Sprintf("watch error event: %v", ev.Object))
					rv = "" // start over from a list
					break
				}
				vmi, ok := ev.Object.(*kubevirtv1.VirtualMachineInstance)
				if !ok {
					continue
				}
				rv = vmi.ResourceVersion
				if ev.Type == watch.Bookmark {
					continue
				}
				r.mu.Lock()
				p := r.phases[vmi.UID]
				if len(p) == 0 || p[len(p)-1] != vmi.Status.Phase {
					r.phases[vmi.UID] = append(p, vmi.Status.Phase)
				}
				if ev.Type == watch.Deleted {
					r.deleted[vmi.UID] = true
				}
				r.mu.Unlock()
			}
			w.Stop()
		}
	}()
	if err := <-started; err != nil {
		cancel()
		n.t.Fatalf("watch vmis in %s: %v", n.name, err)
	}
	n.t.Cleanup(func() {
		cancel()
		<-done
		if n.t.Failed() && len(r.errs) > 0 {
			n.t.Logf("vmi watch in %s: %s", n.name, strings.Join(r.errs, "; "))
		}
	})
	return r
}

// list records the VMIs' current phases and returns a resource version to
// watch from.
func (r *phaseRecorder) list(ctx context.Context, n *testNS) (string, error) {
	// A list of any kind in the namespace tells etcd's current revision.
	cms, err := n.e.kube.CoreV1().ConfigMaps(n.name).List(ctx, metav1.ListOptions{Limit: 1})
	if err != nil {
		return "", err
	}
	vmis, err := n.e.virt.VMIs.List(ctx, n.name, metav1.ListOptions{})
	if err != nil {
		return "", err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	present := map[types.UID]bool{}
	for _, vmi := range vmis {
		present[vmi.UID] = true
		p := r.phases[vmi.UID]
		if len(p) == 0 || p[len(p)-1] != vmi.Status.Phase {
			r.phases[vmi.UID] = append(p, vmi.Status.Phase)
		}
	}
	for uid := range r.phases {
		if !present[uid] {
			r.deleted[uid] = true
		}
	}
	return cms.ResourceVersion, nil
}

func (r *phaseRecorder) note(s string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.errs = append(r.errs, s)
}

func (r *phaseRecorder) of(uid types.UID) []kubevirtv1.VirtualMachineInstancePhase {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]kubevirtv1.VirtualMachineInstancePhase(nil), r.phases[uid]...)
}

// TestGuestShutdown: a guest that powers itself off (poweroff typed on its
// console) ends its VMI Succeeded; runStrategy Always starts a new VMI,
// RerunOnFailure leaves the VM Stopped.
func TestGuestShutdown(t *testing.T) {
	t.Parallel()
	e := require(t)
	for _, rs := range []kubevirtv1.VirtualMachineRunStrategy{kubevirtv1.RunStrategyAlways, kubevirtv1.RunStrategyRerunOnFailure} {
		t.Run(string(rs), func(t *testing.T) {
			t.Parallel()
			n := e.namespace(t)
			rec := n.recordPhases()
			n.createVM(n.newVM("halter", rs, withGracePeriod(5)))
			first := n.waitVMIOfVM("halter", 2*time.Minute)
			n.waitBooted("halter")
			c := n.console("halter")
			c.login()
			c.send("poweroff\r")
			n.eventually(60*time.Second, "the powered-off guest's VMI Succeeded", func() (bool, string) {
				p := rec.of(first.UID)
				return containsPhase(p, kubevirtv1.Succeeded), "phases seen: " + phasesString(p) + "; domain state " + domainState(n.name, "halter")
			})
			if rs == kubevirtv1.RunStrategyAlways {
				n.waitVMIOfVM("halter", 2*time.Minute, first.UID)
				return
			}
			n.eventually(60*time.Second, "vm printableStatus Stopped", func() (bool, string) {
				vm, err := n.getVM("halter")
				if err != nil {
					return false, err.Error()
				}
				return vm.Status.PrintableStatus == kubevirtv1.VirtualMachineStatusStopped, n.diagnoseVM("halter", nil)
			})
			time.Sleep(10 * time.Second)
			vmi, err := n.getVMI("halter")
			switch {
			case apierrors.IsNotFound(err):
			case err != nil:
				t.Fatal(err)
			case vmi.UID != first.UID:
				t.Errorf("RerunOnFailure restarted a guest that shut itself down (new VMI %s, phase %s)", vmi.UID, vmi.Status.Phase)
			}
		})
	}
}

func phasesString(p []kubevirtv1.VirtualMachineInstancePhase) string {
	var s []string
	for _, q := range p {
		s = append(s, string(q))
	}
	return "[" + strings.Join(s, " ") + "]"
}
