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

// accepted answers 202, the answer of a state change request.
func accepted(w http.ResponseWriter) error {
	w.WriteHeader(http.StatusAccepted)
	return nil
}

func (s *Server) startVM(w http.ResponseWriter, r *http.Request, req request, log *slog.Logger) error {
	ctx := r.Context()
	opts := &kubevirtv1.StartOptions{}
	if err := decodeBody(r, opts); err != nil {
		return err
	}
	vm, err := s.getVM(ctx, req.namespace, req.name)
	if err != nil {
		return err
	}
	vmi, err := s.getVMI(ctx, req.namespace, req.name)
	if err != nil {
		return err
	}
	if vmi != nil && !vmi.IsFinal() && vmi.Status.Phase != kubevirtv1.Unknown && vmi.Status.Phase != kubevirtv1.VmPhaseUnset {
		return apierrors.NewConflict(vmResource, req.name, errors.New("VM is already running"))
	}
	data := map[string]string{}
	if opts.Paused {
		data[kubevirtv1.StartRequestDataPausedKey] = kubevirtv1.StartRequestDataPausedTrue
	}
	strategy, err := vm.RunStrategy()
	if err != nil {
		return apierrors.NewInternalError(err)
	}
	var patchErr error
	switch strategy {
	case kubevirtv1.RunStrategyHalted:
		if opts.Paused {
			p, err := changeRequestPatch(vm, kubevirtv1.VirtualMachineStateChangeRequest{Action: kubevirtv1.StartRequest, Data: data})
			if err != nil {
				return err
			}
			patchErr = s.patchVM(ctx, vm, p, opts.DryRun, true)
		} else {
			p, err := runningPatch(vm, true)
			if err != nil {
				return apierrors.NewInternalError(err)
			}
			patchErr = s.patchVM(ctx, vm, p, opts.DryRun, false)
		}
	case kubevirtv1.RunStrategyRerunOnFailure, kubevirtv1.RunStrategyManual:
		if strategy == kubevirtv1.RunStrategyRerunOnFailure && vmi != nil && vmi.Status.Phase == kubevirtv1.Failed {
			return apierrors.NewConflict(vmResource, req.name, fmt.Errorf("%v does not support starting VM from failed state", strategy))
		}
		changes := []kubevirtv1.VirtualMachineStateChangeRequest{{Action: kubevirtv1.StartRequest, Data: data}}
		if vmi != nil && ((strategy == kubevirtv1.RunStrategyRerunOnFailure && vmi.Status.Phase == kubevirtv1.Succeeded) ||
			(strategy == kubevirtv1.RunStrategyManual && vmi.IsFinal())) {
			uid := vmi.UID
			changes = append([]kubevirtv1.VirtualMachineStateChangeRequest{{Action: kubevirtv1.StopRequest, UID: &uid}}, changes...)
		}
		p, err := changeRequestPatch(vm, changes...)
		if err != nil {
			return err
		}
		patchErr = s.patchVM(ctx, vm, p, opts.DryRun, true)
	default:
		return apierrors.NewConflict(vmResource, req.name, fmt.Errorf("%v does not support manual start requests", strategy))
	}
	if patchErr != nil {
		return patchErr
	}
	log.Info("vm start requested", "runStrategy", strategy, "paused", opts.Paused)
	return accepted(w)
}

func (s *Server) stopVM(w http.ResponseWriter, r *http.Request, req request, log *slog.Logger) error {
	ctx := r.Context()
	opts := &kubevirtv1.StopOptions{}
	if err := decodeBody(r, opts); err != nil {
		return err
	}
	vm, err := s.getVM(ctx, req.namespace, req.name)
	if err != nil {
		return err
	}
	strategy, err := vm.RunStrategy()
	if err != nil {
		return apierrors.NewInternalError(err)
	}
	vmi, err := s.getVMI(ctx, req.namespace, req.name)
	if err != nil {
		return err
	}
	running := vmi != nil && !vmi.IsFinal()
	var oldGrace int64
	if running && opts.GracePeriod != nil {
		if oldGrace, err = s.patchGracePeriod(ctx, vmi, *opts.GracePeriod, opts.DryRun); err != nil {
			return apierrors.NewInternalError(err)
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
			return apierrors.NewConflict(vmResource, req.name, errors.New(msgVMNotRunning))
		}
		if opts.GracePeriod == nil || (vmi.Spec.TerminationGracePeriodSeconds != nil && *opts.GracePeriod >= oldGrace) {
			return apierrors.NewConflict(vmResource, req.name, fmt.Errorf("%v only supports manual stop requests with a shorter graceperiod", strategy))
		}
		patchErr = stopRequest()
	case kubevirtv1.RunStrategyRerunOnFailure, kubevirtv1.RunStrategyManual:
		if !running {
			return apierrors.NewConflict(vmResource, req.name, errors.New(msgVMNotRunning))
		}
		patchErr = stopRequest()
	default: // Always, Once
		p, err := runningPatch(vm, false)
		if err != nil {
			return apierrors.NewInternalError(err)
		}
		patchErr = s.patchVM(ctx, vm, p, opts.DryRun, false)
	}
	if patchErr != nil {
		return patchErr
	}
	log.Info("vm stop requested", "runStrategy", strategy, "gracePeriod", opts.GracePeriod)
	return accepted(w)
}

func (s *Server) restartVM(w http.ResponseWriter, r *http.Request, req request, log *slog.Logger) error {
	ctx := r.Context()
	opts := &kubevirtv1.RestartOptions{}
	if err := decodeBody(r, opts); err != nil {
		return err
	}
	if g := opts.GracePeriodSeconds; g != nil && *g > 0 {
		return apierrors.NewBadRequest("For force restart, only gracePeriod=0 is supported for now")
	} else if g != nil && *g < 0 {
		return apierrors.NewBadRequest("gracePeriod has to be greater or equal to 0")
	}
	vm, err := s.getVM(ctx, req.namespace, req.name)
	if err != nil {
		return err
	}
	strategy, err := vm.RunStrategy()
	if err != nil {
		return apierrors.NewInternalError(err)
	}
	if strategy == kubevirtv1.RunStrategyHalted || strategy == kubevirtv1.RunStrategyOnce {
		return apierrors.NewConflict(vmResource, req.name, fmt.Errorf("RunStategy %v does not support manual restart requests", strategy))
	}
	vmi, err := s.getVMI(ctx, req.namespace, req.name)
	if err != nil {
		return err
	}
	if vmi == nil {
		return apierrors.NewConflict(vmResource, req.name, fmt.Errorf("VM is not running: %v", kubevirtv1.RunStrategyHalted))
	}
	force := opts.GracePeriodSeconds != nil && *opts.GracePeriodSeconds == 0
	var oldGrace int64
	if force {
		if oldGrace, err = s.patchGracePeriod(ctx, vmi, 1, opts.DryRun); err != nil {
			return apierrors.NewInternalError(err)
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
		return err
	}
	log.Info("vm restart requested", "force", force)
	return accepted(w)
}

func (s *Server) migrateVM(w http.ResponseWriter, r *http.Request, req request, log *slog.Logger) error {
	ctx := r.Context()
	opts := &kubevirtv1.MigrateOptions{}
	if err := decodeBody(r, opts); err != nil {
		return err
	}
	if _, err := s.getVM(ctx, req.namespace, req.name); err != nil {
		return err
	}
	vmi, err := s.getVMI(ctx, req.namespace, req.name)
	if err != nil {
		return err
	}
	if vmi == nil {
		return apierrors.NewNotFound(vmiResource, req.name)
	}
	if vmi.Status.Phase != kubevirtv1.Running {
		return apierrors.NewConflict(vmResource, req.name, errors.New(msgVMNotRunning))
	}
	// Refused before a migration object exists, as KubeVirt's migration
	// webhook refuses it; the migration controller fails migrations
	// created directly for the same reasons.
	if ok, why := migration.Migratable(vmi); !ok {
		log.Info("migration refused", "reason", why)
		return apierrors.NewConflict(vmResource, req.name, errors.New(why))
	}
	// As KubeVirt's virt-api does: a migration object the controller
	// drives, named kubevirt-migrate-vm-*.
	// A dry run stops here: the checks passed, nothing is made.
	if len(opts.DryRun) > 0 {
		return accepted(w)
	}
	mig, err := s.cfg.Virt.Migrations.Create(ctx, &kubevirtv1.VirtualMachineInstanceMigration{
		ObjectMeta: metav1.ObjectMeta{GenerateName: "kubevirt-migrate-vm-", Namespace: req.namespace},
		Spec:       kubevirtv1.VirtualMachineInstanceMigrationSpec{VMIName: req.name, AddedNodeSelector: opts.AddedNodeSelector},
	})
	if err != nil {
		return err
	}
	log.Info("migration created", "migration", mig.Name)
	return accepted(w)
}
