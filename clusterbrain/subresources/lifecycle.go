package subresources

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"

	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/aggregated"
	"github.com/nodevirt/nodevirt/clusterbrain/migration"
)

// Messages as virt-api words them (virtctl users and scripts match them).
const (
	msgVMNotRunning  = "VM is not running"
	msgVMINotRunning = "VMI is not running"
	msgVMINotPaused  = "VMI is not paused"
	msgNoGuestAgent  = "VMI does not have guest agent connected"
	msgUnderway      = "unable to complete request: stop/start already underway"
)

var (
	vmResource  = kubevirtv1.Resource("virtualmachine")
	vmiResource = kubevirtv1.Resource("virtualmachineinstance")
)

// decodeBody reads an optional JSON body into v.
func decodeBody(r *http.Request, v any) error {
	if r.Body == nil {
		return nil
	}
	data, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
	if err != nil {
		return apierrors.NewBadRequest(fmt.Sprintf("read request body: %v", err))
	}
	if len(strings.TrimSpace(string(data))) == 0 {
		return nil
	}
	if err := json.Unmarshal(data, v); err != nil {
		return apierrors.NewBadRequest(fmt.Sprintf("Can not unmarshal Request body to struct, error: %v", err))
	}
	return nil
}

func (s *Server) getVM(ctx context.Context, ns, name string) (*kubevirtv1.VirtualMachine, error) {
	vm, err := s.cfg.Virt.VMs.Get(ctx, ns, name)
	if apierrors.IsNotFound(err) {
		return nil, apierrors.NewNotFound(vmResource, name)
	}
	if err != nil {
		return nil, apierrors.NewInternalError(fmt.Errorf("unable to retrieve vm [%s]: %w", name, err))
	}
	return vm, nil
}

// getVMI returns the VMI, or nil when there is none.
func (s *Server) getVMI(ctx context.Context, ns, name string) (*kubevirtv1.VirtualMachineInstance, error) {
	vmi, err := s.cfg.Virt.VMIs.Get(ctx, ns, name)
	if apierrors.IsNotFound(err) {
		return nil, nil
	}
	if err != nil {
		return nil, apierrors.NewInternalError(fmt.Errorf("unable to retrieve vmi [%s]: %w", name, err))
	}
	return vmi, nil
}

type patchOp struct {
	Op    string `json:"op"`
	Path  string `json:"path"`
	Value any    `json:"value,omitempty"`
}

// testOp is a JSON-patch test; it carries its value even when null.
type testOp struct {
	Op    string `json:"op"`
	Path  string `json:"path"`
	Value any    `json:"value"`
}

// changeRequestPatch adds state change requests to a VM's status the way
// virt-api does: onto an empty list, or a lone Stop replacing what is there;
// anything else races with a request already underway.
func changeRequestPatch(vm *kubevirtv1.VirtualMachine, changes ...kubevirtv1.VirtualMachineStateChangeRequest) ([]byte, error) {
	var ops []any
	if equality.Semantic.DeepEqual(vm.Status, kubevirtv1.VirtualMachineStatus{}) {
		ops = append(ops, patchOp{Op: "add", Path: "/status", Value: kubevirtv1.VirtualMachineStatus{StateChangeRequests: changes}})
	} else {
		switch {
		case len(vm.Status.StateChangeRequests) == 0:
			ops = append(ops, patchOp{Op: "add", Path: "/status/stateChangeRequests", Value: changes})
		case len(changes) == 1 && changes[0].Action == kubevirtv1.StopRequest:
			ops = append(ops, testOp{Op: "test", Path: "/status/stateChangeRequests", Value: vm.Status.StateChangeRequests},
				patchOp{Op: "replace", Path: "/status/stateChangeRequests", Value: changes})
		default:
			return nil, apierrors.NewConflict(vmResource, vm.Name, errors.New(msgUnderway))
		}
		if vm.Status.StartFailure != nil {
			ops = append(ops, patchOp{Op: "remove", Path: "/status/startFailure"})
		}
	}
	return json.Marshal(ops)
}

// runningPatch flips runStrategy (or the legacy running field).
func runningPatch(vm *kubevirtv1.VirtualMachine, running bool) ([]byte, error) {
	strategy := kubevirtv1.RunStrategyHalted
	if running {
		strategy = kubevirtv1.RunStrategyAlways
	}
	switch {
	case vm.Spec.RunStrategy != nil:
		return json.Marshal([]any{testOp{"test", "/spec/runStrategy", *vm.Spec.RunStrategy}, patchOp{Op: "replace", Path: "/spec/runStrategy", Value: strategy}})
	case vm.Spec.Running != nil:
		return json.Marshal([]any{testOp{"test", "/spec/running", *vm.Spec.Running}, patchOp{Op: "replace", Path: "/spec/running", Value: running}})
	default:
		return json.Marshal([]any{patchOp{Op: "add", Path: "/spec/runStrategy", Value: strategy}})
	}
}

// patchVM applies a JSON patch to the VM or its status; a failed test is a
// conflict (someone else changed the VM meanwhile).
func (s *Server) patchVM(ctx context.Context, vm *kubevirtv1.VirtualMachine, data []byte, dryRun []string, status bool) error {
	var sub []string
	if status {
		sub = []string{"status"}
	}
	_, err := s.cfg.Virt.VMs.Patch(ctx, vm.Namespace, vm.Name, types.JSONPatchType, data, metav1.PatchOptions{DryRun: dryRun}, sub...)
	if err == nil {
		return nil
	}
	if strings.Contains(err.Error(), "test operation does not apply") || apierrors.IsConflict(err) {
		return apierrors.NewConflict(vmResource, vm.Name, err)
	}
	if _, ok := err.(apierrors.APIStatus); ok {
		return err
	}
	return apierrors.NewInternalError(err)
}

// patchGracePeriod sets the VMI's termination grace period, returning the
// old one.
func (s *Server) patchGracePeriod(ctx context.Context, vmi *kubevirtv1.VirtualMachineInstance, seconds int64, dryRun []string) (int64, error) {
	var old int64
	var cur any
	if vmi.Spec.TerminationGracePeriodSeconds != nil {
		old = *vmi.Spec.TerminationGracePeriodSeconds
		cur = old
	}
	data, err := json.Marshal([]any{testOp{"test", "/spec/terminationGracePeriodSeconds", cur},
		patchOp{Op: "replace", Path: "/spec/terminationGracePeriodSeconds", Value: seconds}})
	if err != nil {
		return 0, err
	}
	if cur == nil {
		data, _ = json.Marshal([]any{patchOp{Op: "add", Path: "/spec/terminationGracePeriodSeconds", Value: seconds}})
	}
	_, err = s.cfg.Virt.VMIs.Patch(ctx, vmi.Namespace, vmi.Name, types.JSONPatchType, data, metav1.PatchOptions{DryRun: dryRun})
	return old, err
}

func accepted(w http.ResponseWriter) { w.WriteHeader(http.StatusAccepted) }

func (s *Server) startVM(w http.ResponseWriter, r *http.Request, req request, log *slog.Logger) {
	ctx := r.Context()
	opts := &kubevirtv1.StartOptions{}
	if err := decodeBody(r, opts); err != nil {
		aggregated.WriteError(w, err)
		return
	}
	vm, err := s.getVM(ctx, req.namespace, req.name)
	if err != nil {
		aggregated.WriteError(w, err)
		return
	}
	vmi, err := s.getVMI(ctx, req.namespace, req.name)
	if err != nil {
		aggregated.WriteError(w, err)
		return
	}
	if vmi != nil && !vmi.IsFinal() && vmi.Status.Phase != kubevirtv1.Unknown && vmi.Status.Phase != kubevirtv1.VmPhaseUnset {
		aggregated.WriteError(w, apierrors.NewConflict(vmResource, req.name, errors.New("VM is already running")))
		return
	}
	data := map[string]string{}
	if opts.Paused {
		data[kubevirtv1.StartRequestDataPausedKey] = kubevirtv1.StartRequestDataPausedTrue
	}
	strategy, err := vm.RunStrategy()
	if err != nil {
		aggregated.WriteError(w, apierrors.NewInternalError(err))
		return
	}
	var patchErr error
	switch strategy {
	case kubevirtv1.RunStrategyHalted:
		if opts.Paused {
			p, err := changeRequestPatch(vm, kubevirtv1.VirtualMachineStateChangeRequest{Action: kubevirtv1.StartRequest, Data: data})
			if err != nil {
				aggregated.WriteError(w, err)
				return
			}
			patchErr = s.patchVM(ctx, vm, p, opts.DryRun, true)
		} else {
			p, err := runningPatch(vm, true)
			if err != nil {
				aggregated.WriteError(w, apierrors.NewInternalError(err))
				return
			}
			patchErr = s.patchVM(ctx, vm, p, opts.DryRun, false)
		}
	case kubevirtv1.RunStrategyRerunOnFailure, kubevirtv1.RunStrategyManual:
		if strategy == kubevirtv1.RunStrategyRerunOnFailure && vmi != nil && vmi.Status.Phase == kubevirtv1.Failed {
			aggregated.WriteError(w, apierrors.NewConflict(vmResource, req.name, fmt.Errorf("%v does not support starting VM from failed state", strategy)))
			return
		}
		changes := []kubevirtv1.VirtualMachineStateChangeRequest{{Action: kubevirtv1.StartRequest, Data: data}}
		if vmi != nil && ((strategy == kubevirtv1.RunStrategyRerunOnFailure && vmi.Status.Phase == kubevirtv1.Succeeded) ||
			(strategy == kubevirtv1.RunStrategyManual && vmi.IsFinal())) {
			uid := vmi.UID
			changes = append([]kubevirtv1.VirtualMachineStateChangeRequest{{Action: kubevirtv1.StopRequest, UID: &uid}}, changes...)
		}
		p, err := changeRequestPatch(vm, changes...)
		if err != nil {
			aggregated.WriteError(w, err)
			return
		}
		patchErr = s.patchVM(ctx, vm, p, opts.DryRun, true)
	default:
		aggregated.WriteError(w, apierrors.NewConflict(vmResource, req.name, fmt.Errorf("%v does not support manual start requests", strategy)))
		return
	}
	if patchErr != nil {
		aggregated.WriteError(w, patchErr)
		return
	}
	log.Info("vm start requested", "runStrategy", strategy, "paused", opts.Paused)
	accepted(w)
}

func (s *Server) stopVM(w http.ResponseWriter, r *http.Request, req request, log *slog.Logger) {
	ctx := r.Context()
	opts := &kubevirtv1.StopOptions{}
	if err := decodeBody(r, opts); err != nil {
		aggregated.WriteError(w, err)
		return
	}
	vm, err := s.getVM(ctx, req.namespace, req.name)
	if err != nil {
		aggregated.WriteError(w, err)
		return
	}
	strategy, err := vm.RunStrategy()
	if err != nil {
		aggregated.WriteError(w, apierrors.NewInternalError(err))
		return
	}
	vmi, err := s.getVMI(ctx, req.namespace, req.name)
	if err != nil {
		aggregated.WriteError(w, err)
		return
	}
	running := vmi != nil && !vmi.IsFinal()
	var oldGrace int64
	if running && opts.GracePeriod != nil {
		if oldGrace, err = s.patchGracePeriod(ctx, vmi, *opts.GracePeriod, opts.DryRun); err != nil {
			aggregated.WriteError(w, apierrors.NewInternalError(err))
			return
		}
	}
	stopRequest := func() error {
		uid := vmi.UID
		p, err := changeRequestPatch(vm, kubevirtv1.VirtualMachineStateChangeRequest{Action: kubevirtv1.StopRequest, UID: &uid})
		if err != nil {
			return err
		}
		return s.patchVM(ctx, vm, p, opts.DryRun, true)
	}
	var patchErr error
	switch strategy {
	case kubevirtv1.RunStrategyHalted:
		if !running {
			aggregated.WriteError(w, apierrors.NewConflict(vmResource, req.name, errors.New(msgVMNotRunning)))
			return
		}
		if opts.GracePeriod == nil || (vmi.Spec.TerminationGracePeriodSeconds != nil && *opts.GracePeriod >= oldGrace) {
			aggregated.WriteError(w, apierrors.NewConflict(vmResource, req.name, fmt.Errorf("%v only supports manual stop requests with a shorter graceperiod", strategy)))
			return
		}
		patchErr = stopRequest()
	case kubevirtv1.RunStrategyRerunOnFailure, kubevirtv1.RunStrategyManual:
		if !running {
			aggregated.WriteError(w, apierrors.NewConflict(vmResource, req.name, errors.New(msgVMNotRunning)))
			return
		}
		patchErr = stopRequest()
	default: // Always, Once
		p, err := runningPatch(vm, false)
		if err != nil {
			aggregated.WriteError(w, apierrors.NewInternalError(err))
			return
		}
		patchErr = s.patchVM(ctx, vm, p, opts.DryRun, false)
	}
	if patchErr != nil {
		aggregated.WriteError(w, patchErr)
		return
	}
	log.Info("vm stop requested", "runStrategy", strategy, "gracePeriod", opts.GracePeriod)
	accepted(w)
}

func (s *Server) restartVM(w http.ResponseWriter, r *http.Request, req request, log *slog.Logger) {
	ctx := r.Context()
	opts := &kubevirtv1.RestartOptions{}
	if err := decodeBody(r, opts); err != nil {
		aggregated.WriteError(w, err)
		return
	}
	if g := opts.GracePeriodSeconds; g != nil && *g > 0 {
		aggregated.WriteError(w, apierrors.NewBadRequest("For force restart, only gracePeriod=0 is supported for now"))
		return
	} else if g != nil && *g < 0 {
		aggregated.WriteError(w, apierrors.NewBadRequest("gracePeriod has to be greater or equal to 0"))
		return
	}
	vm, err := s.getVM(ctx, req.namespace, req.name)
	if err != nil {
		aggregated.WriteError(w, err)
		return
	}
	strategy, err := vm.RunStrategy()
	if err != nil {
		aggregated.WriteError(w, apierrors.NewInternalError(err))
		return
	}
	if strategy == kubevirtv1.RunStrategyHalted || strategy == kubevirtv1.RunStrategyOnce {
		aggregated.WriteError(w, apierrors.NewConflict(vmResource, req.name, fmt.Errorf("RunStategy %v does not support manual restart requests", strategy)))
		return
	}
	vmi, err := s.getVMI(ctx, req.namespace, req.name)
	if err != nil {
		aggregated.WriteError(w, err)
		return
	}
	if vmi == nil {
		aggregated.WriteError(w, apierrors.NewConflict(vmResource, req.name, fmt.Errorf("VM is not running: %v", kubevirtv1.RunStrategyHalted)))
		return
	}
	force := opts.GracePeriodSeconds != nil && *opts.GracePeriodSeconds == 0
	var oldGrace int64
	if force {
		if oldGrace, err = s.patchGracePeriod(ctx, vmi, 1, opts.DryRun); err != nil {
			aggregated.WriteError(w, apierrors.NewInternalError(err))
			return
		}
		one := int64(1)
		vmi.Spec.TerminationGracePeriodSeconds = &one
	}
	uid := vmi.UID
	p, err := changeRequestPatch(vm,
		kubevirtv1.VirtualMachineStateChangeRequest{Action: kubevirtv1.StopRequest, UID: &uid},
		kubevirtv1.VirtualMachineStateChangeRequest{Action: kubevirtv1.StartRequest})
	if err == nil {
		err = s.patchVM(ctx, vm, p, opts.DryRun, true)
	}
	if err != nil {
		if force {
			if _, rerr := s.patchGracePeriod(ctx, vmi, oldGrace, opts.DryRun); rerr != nil {
				log.Error("roll back termination grace period", "err", rerr)
			}
		}
		aggregated.WriteError(w, err)
		return
	}
	log.Info("vm restart requested", "force", force)
	accepted(w)
}

func (s *Server) migrateVM(w http.ResponseWriter, r *http.Request, req request, log *slog.Logger) {
	ctx := r.Context()
	opts := &kubevirtv1.MigrateOptions{}
	if err := decodeBody(r, opts); err != nil {
		aggregated.WriteError(w, err)
		return
	}
	if _, err := s.getVM(ctx, req.namespace, req.name); err != nil {
		aggregated.WriteError(w, err)
		return
	}
	vmi, err := s.getVMI(ctx, req.namespace, req.name)
	if err != nil {
		aggregated.WriteError(w, err)
		return
	}
	if vmi == nil {
		aggregated.WriteError(w, apierrors.NewNotFound(vmiResource, req.name))
		return
	}
	if vmi.Status.Phase != kubevirtv1.Running {
		aggregated.WriteError(w, apierrors.NewConflict(vmResource, req.name, errors.New(msgVMNotRunning)))
		return
	}
	// Refused before a migration object exists, as KubeVirt's migration
	// webhook refuses it; the migration controller fails migrations
	// created directly for the same reasons.
	if ok, why := migration.Migratable(vmi); !ok {
		log.Info("migration refused", "reason", why)
		aggregated.WriteError(w, apierrors.NewConflict(vmResource, req.name, errors.New(why)))
		return
	}
	// As KubeVirt's virt-api does: a migration object the controller
	// drives, named kubevirt-migrate-vm-*.
	// A dry run stops here: the checks passed, nothing is made.
	if len(opts.DryRun) > 0 {
		accepted(w)
		return
	}
	mig, err := s.cfg.Virt.Migrations.Create(ctx, &kubevirtv1.VirtualMachineInstanceMigration{
		ObjectMeta: metav1.ObjectMeta{GenerateName: "kubevirt-migrate-vm-", Namespace: req.namespace},
		Spec:       kubevirtv1.VirtualMachineInstanceMigrationSpec{VMIName: req.name, AddedNodeSelector: opts.AddedNodeSelector},
	})
	if err != nil {
		aggregated.WriteError(w, err)
		return
	}
	log.Info("migration created", "migration", mig.Name)
	accepted(w)
}
