// Package migration answers VirtualMachineInstanceMigrations (what `virtctl
// migrate` and `kubectl create` of a migration ask for).
//
// nodevirt does not move running guests between nodes yet. Rather than leave
// a migration Pending for ever, the controller settles every new one as
// Failed, with the reason a user can act on: the VMI does not exist or does
// not run, the VMI cannot be migrated (its LiveMigratable condition, as
// KubeVirt words it: node-local disks, the bridge binding on the pod
// network), or, for a VMI KubeVirt could migrate, that live migration is not
// implemented. The guest is never touched.
package migration

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/controller"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/metrics"
)

// ReasonFailed is the reason of the Warning event a failed migration gets
// (KubeVirt's word for it).
const ReasonFailed = "FailedMigration"

// NotImplemented is how a migration of a migratable VMI fails.
const NotImplemented = "live migration is not implemented by nodevirt yet; the VMI keeps running on its node"

// Config configures the controller.
type Config struct {
	Kube kubernetes.Interface
	Virt *client.Set
	Log  *slog.Logger
	// Resync re-reads every migration this often (default 10 minutes).
	Resync time.Duration
}

func (c *Config) defaults() {
	if c.Resync == 0 {
		c.Resync = 10 * time.Minute
	}
	if c.Log == nil {
		c.Log = slog.Default()
	}
}

func (c *Config) validate() error {
	if c.Kube == nil || c.Virt == nil {
		return errors.New("migration: Kube and Virt clients are required")
	}
	return nil
}

// Controller settles VirtualMachineInstanceMigrations.
type Controller struct {
	cfg      Config
	log      *slog.Logger
	informer cache.SharedIndexInformer
	queue    *controller.Queue
	recorder *controller.Recorder
}

// New validates cfg and builds the controller; Run starts it.
func New(cfg Config) (*Controller, error) {
	cfg.defaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	c := &Controller{
		cfg: cfg, log: cfg.Log.With("role", "migration"),
		informer: cfg.Virt.Migrations.Informer("", cfg.Resync, nil),
		recorder: controller.NewRecorder(client.NewScheme(), "nodevirt-migration"),
	}
	var err error
	c.queue, err = controller.New(controller.Config{Name: "migrations", Sync: controller.NoRequeue(c.sync),
		Backoff: controller.BackoffAPI, Log: c.log, KeyAttr: "migration",
		Observe: func(err error) { metrics.Reconciled("migration", err) }})
	if err != nil {
		return nil, err
	}
	_, _ = c.informer.AddEventHandler(controller.OnAddOrUpdate(c.queue.Enqueue))
	return c, nil
}

// Name names the role.
func (c *Controller) Name() string { return "migration" }

// Run serves until ctx ends.
func (c *Controller) Run(ctx context.Context) error {
	defer utilruntime.HandleCrash()
	defer c.recorder.Start(c.cfg.Kube)()
	go c.informer.RunWithContext(ctx)
	c.log.Info("started")
	return c.queue.Run(ctx, c.informer.HasSynced)
}

func (c *Controller) sync(ctx context.Context, key string) error {
	obj, exists, err := c.informer.GetIndexer().GetByKey(key)
	if err != nil || !exists {
		return err
	}
	mig := obj.(*kubevirtv1.VirtualMachineInstanceMigration)
	if mig.DeletionTimestamp != nil || settled(mig.Status.Phase) {
		return nil
	}
	vmi, err := c.cfg.Virt.VMIs.Get(ctx, mig.Namespace, mig.Spec.VMIName)
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("vmi %s/%s: %w", mig.Namespace, mig.Spec.VMIName, err)
	}
	if apierrors.IsNotFound(err) {
		vmi = nil
	}
	failed := mig.DeepCopy()
	why := Refusal(vmi, mig.Spec.VMIName)
	fail(failed, vmi, why)
	if _, err := c.cfg.Virt.Migrations.UpdateStatus(ctx, failed); err != nil {
		return fmt.Errorf("migration %s status: %w", key, err)
	}
	c.recorder.Event(mig, corev1.EventTypeWarning, ReasonFailed, why)
	c.log.Info("migration failed", "migration", key, "vmi", mig.Namespace+"/"+mig.Spec.VMIName, "reason", why)
	return nil
}

// Refusal says why a migration of vmi (nil when it does not exist) fails:
// KubeVirt's reasons first, then that nodevirt cannot move a guest.
func Refusal(vmi *kubevirtv1.VirtualMachineInstance, name string) string {
	if why := kubevirtRefusal(vmi, name); why != "" {
		return why
	}
	return NotImplemented
}

// Migratable reports whether KubeVirt would migrate vmi (running, and not
// LiveMigratable=False); when not, it returns KubeVirt's refusal.
func Migratable(vmi *kubevirtv1.VirtualMachineInstance) (bool, string) {
	why := kubevirtRefusal(vmi, vmi.Name)
	return why == "", why
}

// kubevirtRefusal is why KubeVirt would refuse to migrate vmi, "" when it
// would not.
func kubevirtRefusal(vmi *kubevirtv1.VirtualMachineInstance, name string) string {
	switch {
	case vmi == nil:
		return fmt.Sprintf("the VMI %q does not exist", name)
	case vmi.Status.Phase != kubevirtv1.Running:
		return fmt.Sprintf("cannot migrate VMI %q: it is %s, not Running", name, phaseOf(vmi))
	}
	for _, cond := range vmi.Status.Conditions {
		if cond.Type == kubevirtv1.VirtualMachineInstanceIsMigratable && cond.Status == corev1.ConditionFalse {
			return fmt.Sprintf("Cannot migrate VMI, Reason: %s, Message: %s", cond.Reason, cond.Message)
		}
	}
	return ""
}

func phaseOf(vmi *kubevirtv1.VirtualMachineInstance) kubevirtv1.VirtualMachineInstancePhase {
	if vmi.Status.Phase == "" {
		return kubevirtv1.Pending
	}
	return vmi.Status.Phase
}

func settled(p kubevirtv1.VirtualMachineInstanceMigrationPhase) bool {
	return p == kubevirtv1.MigrationSucceeded || p == kubevirtv1.MigrationFailed
}

// fail marks mig Failed with why, as KubeVirt's status would show it.
func fail(mig *kubevirtv1.VirtualMachineInstanceMigration, vmi *kubevirtv1.VirtualMachineInstance, why string) {
	now := metav1.Now()
	mig.Status.Phase = kubevirtv1.MigrationFailed
	mig.Status.PhaseTransitionTimestamps = append(mig.Status.PhaseTransitionTimestamps,
		kubevirtv1.VirtualMachineInstanceMigrationPhaseTransitionTimestamp{Phase: kubevirtv1.MigrationFailed, PhaseTransitionTimestamp: now})
	state := &kubevirtv1.VirtualMachineInstanceMigrationState{
		MigrationUID: mig.UID, StartTimestamp: &now, EndTimestamp: &now,
		Completed: true, Failed: true, FailureReason: why,
	}
	if vmi != nil {
		state.SourceNode = vmi.Status.NodeName
	}
	mig.Status.MigrationState = state
}
