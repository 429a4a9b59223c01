// Package vmcontroller is the virt-controller role of the brain: it turns
// each VirtualMachine into its VirtualMachineInstance according to the
// run strategy and the state-change requests the start/stop/restart
// subresources write, creates the VM's DataVolumes, freezes instance types
// and preferences into ControllerRevisions and applies them, restarts
// failed VMIs with back-off, and reports printableStatus, ready and
// conditions.
package vmcontroller

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	kubevirtv1 "kubevirt.io/api/core/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/api/cpumodel"
	"github.com/nodevirt/nodevirt/clusterbrain/api/live"
	"github.com/nodevirt/nodevirt/clusterbrain/api/overcommit"
	"github.com/nodevirt/nodevirt/clusterbrain/api/rollout"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/controller"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/metrics"
)

// Config configures the controller.
type Config struct {
	Kube kubernetes.Interface
	Virt *client.Set
	// RestConfig, when set, replaces Kube and Virt with clients of the
	// controller's own, so its writes do not share the brain's client-side
	// rate limit (500 QPS, burst 1000).
	RestConfig *rest.Config
	Log        *slog.Logger
	// Workers is the number of VMs synced at once (default 128; a sync
	// mostly waits for the API server).
	Workers int
	// VMInformer and VMIInformer, when set, are informers of all VMs and
	// VMIs shared with other roles: the caller runs them (after New), the
	// controller waits for their sync. Nil: the controller makes and runs
	// its own.
	VMInformer, VMIInformer cache.SharedIndexInformer
	// Placer, when set, picks each VMI's node before the VMI is created.
	Placer Placer
	// CPUModels is the KubeVirt CR's default and obsolete CPU models,
	// applied to the VMIs the controller creates (nil: none).
	CPUModels *live.Value[cpumodel.Cluster]
	// MemoryOvercommit is the KubeVirt CR's memory overcommit, applied to
	// the VMIs the controller creates (nil: none).
	MemoryOvercommit *live.Value[overcommit.Memory]
	// Rollout is the KubeVirt CR's hotplug gates: whether hotpluggable
	// volume changes of a running VM's template reach its VMI (nil: no
	// KubeVirt CR, see rollout.FromKubeVirt).
	Rollout *live.Value[rollout.Cluster]
	// BackoffBase and BackoffMax bound the delay before a failed VMI is
	// started again: base·2^(failures-1), at most max (default 10s, 5m,
	// like KubeVirt).
	BackoffBase, BackoffMax time.Duration
}

// Placer decides where a VMI goes before it is created, so it is created
// with its kubevirt.io/nodeName label and bound by one status write (the
// scheduler's Reserve). Without one, or when it returns "", the VMI is
// created without a node and the scheduler places it when it appears.
type Placer interface {
	// Reserve returns the node held for vmi (which has no UID yet), or "".
	Reserve(vmi *kubevirtv1.VirtualMachineInstance) string
	// Unreserve releases the node held for a VMI that was not created.
	Unreserve(namespace, name string)
}

// Controller reconciles VirtualMachines.
type Controller struct {
	cfg      Config
	vms      cache.SharedIndexInformer
	vmis     cache.SharedIndexInformer
	dvs      cache.SharedIndexInformer
	own      []cache.SharedIndexInformer // the informers this controller runs
	queue    *controller.Queue
	recorder *controller.Recorder
	now      func() time.Time

	// failures remembers each VM's latest start failure until its status
	// shows it, so a sync that reads a stale cache cannot skip a back-off.
	failures sync.Map // types.UID → *kubevirtv1.VirtualMachineStartFailure
	// written holds the VM this controller's latest status write returned
	// until the cache shows it, so the next sync does not compute from the
	// older copy and write with its stale resourceVersion (a conflict and
	// a retry per VM during bursts).
	written sync.Map // key → writtenVM
	// creating remembers VMIs created but not yet in the cache, so a sync
	// in between does not create again nor report the VM stopped.
	creating sync.Map // key → creation
}

// writtenVM is a status write: the resourceVersion it replaced and the
// object the API server returned.
type writtenVM struct {
	from string
	vm   *kubevirtv1.VirtualMachine
}

// creation is a VMI this controller created for the VM with that UID.
type creation struct {
	vmUID types.UID
	at    time.Time
}

// creationWait bounds how long a created VMI may take to reach the cache
// before the controller looks again without it.
const creationWait = 30 * time.Second

// missingRefRetry is how often a VM naming a missing instance type or
// preference looks for it again (the controller does not watch them).
const missingRefRetry = 5 * time.Second

// New builds the controller.
func New(cfg Config) (*Controller, error) {
	if cfg.RestConfig != nil {
		var err error
		if cfg.Kube, cfg.Virt, err = ownClients(cfg.RestConfig); err != nil {
			return nil, err
		}
	}
	if cfg.Kube == nil || cfg.Virt == nil {
		return nil, errors.New("vmcontroller: clients are required")
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.Workers == 0 {
		cfg.Workers = 128
	}
	if cfg.BackoffBase == 0 {
		cfg.BackoffBase = 10 * time.Second
	}
	if cfg.BackoffMax == 0 {
		cfg.BackoffMax = 5 * time.Minute
	}
	c := &Controller{
		cfg:      cfg,
		vms:      cfg.VMInformer,
		vmis:     cfg.VMIInformer,
		dvs:      cfg.Virt.DataVolumes.Informer("", 0, nil),
		recorder: controller.NewRecorder(client.NewScheme(), "nodevirt-vm-controller"),
		now:      time.Now,
	}
	var err error
	c.queue, err = controller.New(controller.Config{Name: "virtualmachines", Sync: c.Sync, Backoff: controller.BackoffAPI,
		Workers: cfg.Workers, Log: cfg.Log, KeyAttr: "vm",
		Observe: func(err error) { metrics.Reconciled("vm", err) }})
	if err != nil {
		return nil, err
	}
	if c.vms == nil {
		c.vms = cfg.Virt.VMs.Informer("", 0, nil)
		c.own = append(c.own, c.vms)
	}
	if c.vmis == nil {
		c.vmis = cfg.Virt.VMIs.Informer("", 0, nil)
		c.own = append(c.own, c.vmis)
	}
	c.own = append(c.own, c.dvs)
	_, _ = c.vms.AddEventHandler(controller.OnChange(c.queue.Enqueue))
	owner := func(obj any) {
		key, ok := controller.OwnerKey(obj, "VirtualMachine")
		if !ok {
			return
		}
		if _, ok := obj.(*kubevirtv1.VirtualMachineInstance); ok {
			c.creating.Delete(key) // the cache has seen it (or its end)
		}
		c.queue.Add(key)
	}
	for _, inf := range []cache.SharedIndexInformer{c.vmis, c.dvs} {
		_, _ = inf.AddEventHandler(controller.OnChange(owner))
	}
	return c, nil
}

// Name implements the brain's Role.
func (c *Controller) Name() string { return "vm-controller" }

// Run reconciles until ctx ends.
func (c *Controller) Run(ctx context.Context) error {
	defer utilruntime.HandleCrash()
	defer c.queue.ShutDown()
	defer c.recorder.Start(c.cfg.Kube)()
	if !c.startInformers(ctx) {
		return ctx.Err()
	}
	c.cfg.Log.Info("vm controller started")
	return c.queue.Run(ctx)
}

// startInformers fills the caches Sync reads; it reports false when ctx
// ended first.
func (c *Controller) startInformers(ctx context.Context) bool {
	for _, inf := range c.own {
		go inf.RunWithContext(ctx)
	}
	return cache.WaitForCacheSync(ctx.Done(), c.vms.HasSynced, c.vmis.HasSynced, c.dvs.HasSynced)
}

// Sync reconciles the VM named key ("namespace/name") and returns when it
// wants to be looked at again (0: on the next change).
func (c *Controller) Sync(ctx context.Context, key string) (time.Duration, error) {
	ns, name, err := cache.SplitMetaNamespaceKey(key)
	if err != nil {
		return 0, nil
	}
	orig, ok := c.cachedVM(key)
	if !ok {
		c.creating.Delete(key)
		return 0, nil // gone: the garbage collector removes what it owned
	}
	vm := orig.DeepCopy()
	log := c.cfg.Log.With("namespace", ns, "name", name)

	var vmi *kubevirtv1.VirtualMachineInstance
	if o, ok, _ := c.vmis.GetStore().GetByKey(key); ok {
		vmi = o.(*kubevirtv1.VirtualMachineInstance)
		if ref := metav1.GetControllerOf(vmi); ref == nil || ref.UID != vm.UID {
			if ref != nil || vm.DeletionTimestamp != nil {
				vmi = nil // someone else's, or an orphan of an earlier VM of that name
			}
		}
	}
	if v, ok := c.creating.Load(key); ok {
		cr := v.(creation)
		switch wait := creationWait - c.now().Sub(cr.at); {
		case vmi != nil || cr.vmUID != vm.UID || wait <= 0:
			c.creating.Delete(key)
		case vm.DeletionTimestamp == nil:
			return wait, nil // the VMI's arrival in the cache brings us back
		}
	}
	st := &state{vm: vm, orig: orig, vmi: vmi, rs: runStrategy(vm)}

	if vm.DeletionTimestamp != nil {
		if vmi != nil && vmi.DeletionTimestamp == nil {
			c.deleteVMI(ctx, vm, vmi, "the virtual machine is being deleted")
		}
		return 0, c.writeStatus(ctx, st)
	}
	if vm.Spec.Template == nil {
		return 0, nil
	}
	if changed, err := c.ensureRevisions(ctx, vm); err != nil {
		var m missingRef
		if errors.As(err, &m) {
			// As KubeVirt: the VM stays stopped with the reason on its
			// Failure condition, and starts once the type is created.
			st.failure, st.failureReason = err, m.reason
			return missingRefRetry, c.writeStatus(ctx, st)
		}
		st.failure = fmt.Errorf("failed to store instance type or preference: %w", err)
		return 0, errors.Join(err, c.writeStatus(ctx, st))
	} else if changed {
		return 0, nil // the update brings us back
	}
	if err := c.ensureDataVolumes(ctx, st); err != nil {
		st.failure = err
		return 0, errors.Join(err, c.writeStatus(ctx, st))
	}
	after, err := c.runStrategy(ctx, st, log)
	if err != nil {
		st.failure = err
	}
	var perm permanent
	if errors.As(err, &perm) {
		err = nil
	}
	again, liveErr := c.liveUpdate(ctx, st)
	if again > 0 && (after == 0 || again < after) {
		after = again
	}
	return after, errors.Join(err, liveErr, c.writeStatus(ctx, st))
}

// cachedVM is the VM named key as the cache has it, or as this
// controller's last status write returned it while the cache still shows
// the version that write replaced.
func (c *Controller) cachedVM(key string) (*kubevirtv1.VirtualMachine, bool) {
	obj, ok, _ := c.vms.GetStore().GetByKey(key)
	if !ok {
		c.written.Delete(key)
		return nil, false
	}
	vm := obj.(*kubevirtv1.VirtualMachine)
	if v, ok := c.written.Load(key); ok {
		w := v.(writtenVM)
		if w.vm.UID == vm.UID && w.from == vm.ResourceVersion {
			return w.vm, true
		}
		c.written.CompareAndDelete(key, v)
	}
	return vm, true
}

// state is what one sync learns and decides about a VM.
type state struct {
	vm       *kubevirtv1.VirtualMachine
	orig     *kubevirtv1.VirtualMachine // as read, not to be modified
	vmi      *kubevirtv1.VirtualMachineInstance
	rs       kubevirtv1.VirtualMachineRunStrategy
	dvsReady bool   // every DataVolume is usable (or waits for its first consumer)
	dvFailed string // a DataVolume failed
	// wantsStart: the VM should run but has no VMI yet (waiting for volumes
	// or back-off).
	wantsStart bool
	backoff    bool
	created    bool // a VMI was created in this sync
	deleted    bool // the VMI was deleted in this sync
	failure    error
	// failureReason is the Failure condition's reason (default FailedCreate).
	failureReason string
	popped        int // state-change requests handled
	// restartRequired says why the running VMI cannot follow its VM
	// without a restart ("": it can); restartKnown is false when that is
	// not known (no running VMI, or one created before it was recorded).
	restartRequired string
	restartKnown    bool
}

func runStrategy(vm *kubevirtv1.VirtualMachine) kubevirtv1.VirtualMachineRunStrategy {
	if vm.Spec.RunStrategy != nil {
		return *vm.Spec.RunStrategy
	}
	if vm.Spec.Running != nil && *vm.Spec.Running {
		return kubevirtv1.RunStrategyAlways
	}
	return kubevirtv1.RunStrategyHalted
}

// ensureDataVolumes creates the VM's dataVolumeTemplates as DataVolumes
// it controls and records whether they are ready.
func (c *Controller) ensureDataVolumes(ctx context.Context, st *state) error {
	vm := st.vm
	st.dvsReady = true
	for _, t := range vm.Spec.DataVolumeTemplates {
		key := vm.Namespace + "/" + t.Name
		obj, ok, _ := c.dvs.GetStore().GetByKey(key)
		if !ok {
			dv := &cdiv1.DataVolume{
				ObjectMeta: metav1.ObjectMeta{Name: t.Name, Namespace: vm.Namespace, Labels: t.Labels, Annotations: t.Annotations,
					OwnerReferences: []metav1.OwnerReference{*metav1.NewControllerRef(vm, kubevirtv1.VirtualMachineGroupVersionKind)}},
				Spec: *t.Spec.DeepCopy(),
			}
			if _, err := c.cfg.Virt.DataVolumes.Create(ctx, dv); err != nil && !apierrors.IsAlreadyExists(err) {
				c.recorder.Eventf(vm, corev1.EventTypeWarning, "FailedDataVolumeCreate", "Error creating DataVolume %s: %v", t.Name, err)
				return fmt.Errorf("create datavolume %s: %w", t.Name, err)
			}
			c.recorder.Eventf(vm, corev1.EventTypeNormal, "SuccessfulDataVolumeCreate", "Created DataVolume %s", t.Name)
			st.dvsReady = false
			continue
		}
		dv := obj.(*cdiv1.DataVolume)
		if ref := metav1.GetControllerOf(dv); ref == nil || ref.UID != vm.UID {
			return fmt.Errorf("datavolume %s exists and is not controlled by this virtual machine", t.Name)
		}
		switch dv.Status.Phase {
		case cdiv1.Succeeded, cdiv1.WaitForFirstConsumer, cdiv1.PendingPopulation:
		case cdiv1.Failed:
			st.dvFailed = fmt.Sprintf("datavolume %s failed", t.Name)
			st.dvsReady = false
		default:
			st.dvsReady = false
		}
	}
	return nil
}

// ownClients builds clients with a rate limit of their own.
func ownClients(rc *rest.Config) (kubernetes.Interface, *client.Set, error) {
	rc = rest.CopyConfig(rc)
	rc.QPS, rc.Burst = 500, 1000
	kube, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, nil, err
	}
	virt, err := client.NewSet(rc)
	if err != nil {
		return nil, nil, err
	}
	return kube, virt, nil
}
