package macpool

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"time"

	admissionv1 "k8s.io/api/admission/v1"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/admission"
	macv1alpha1 "github.com/nodevirt/nodevirt/clusterbrain/macpool/api/v1alpha1"
)

// WebhookPath is where the brain serves the MAC webhook.
const WebhookPath = "/mutate-virtualmachines-mac"

// Register is the admission.Contributor of the pool: it builds a Pool from
// the server's clients, runs it beside the server and registers its
// webhook. cfg's clients default to the server's.
func Register(cfg Config) admission.Contributor {
	return func(s *admission.Server) error {
		d := s.Deps()
		if cfg.Virt == nil {
			cfg.Virt = d.Virt
		}
		if cfg.Log == nil {
			cfg.Log = d.Log
		}
		p, err := New(cfg)
		if err != nil {
			return err
		}
		s.Go(p.Run)
		s.Register(p.Webhook())
		return nil
	}
}

// Webhook is the pool's mutating webhook on VirtualMachine create and
// update, skipping namespaces labelled mutatevirtualmachines.kubemacpool.io=ignore.
func (p *Pool) Webhook() admission.Webhook {
	return admission.Webhook{
		Name:     "mutatevirtualmachines.kubemacpool.io",
		Path:     WebhookPath,
		Mutating: true,
		Rules: []admissionregistrationv1.RuleWithOperations{{
			Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Create, admissionregistrationv1.Update},
			Rule: admissionregistrationv1.Rule{APIGroups: []string{"kubevirt.io"}, APIVersions: []string{"v1"},
				Resources: []string{"virtualmachines"}},
		}},
		NamespaceSelector: &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{{
			Key: OptOutLabel, Operator: metav1.LabelSelectorOpNotIn, Values: []string{"ignore"}}}},
		SideEffects: true,
		Timeout:     10 * time.Second,
		Admit:       p.admit,
	}
}

func (p *Pool) admit(ctx context.Context, req *admissionv1.AdmissionRequest) *admissionv1.AdmissionResponse {
	var vm, old kubevirtv1.VirtualMachine
	if err := json.Unmarshal(req.Object.Raw, &vm); err != nil {
		return admission.Denyf("decode virtualmachine: %v", err)
	}
	if req.Operation == admissionv1.Update {
		if err := json.Unmarshal(req.OldObject.Raw, &old); err != nil {
			return admission.Denyf("decode old virtualmachine: %v", err)
		}
		if vm.DeletionTimestamp != nil {
			return admission.Allow()
		}
	}
	if vm.Namespace == "" {
		vm.Namespace = req.Namespace
	}
	select {
	case <-p.synced:
	case <-ctx.Done():
		return admission.Deny(http.StatusServiceUnavailable, "mac pool is not ready")
	}
	dry := req.DryRun != nil && *req.DryRun
	ops, err := p.Assign(ctx, &vm, &old, dry)
	if err != nil {
		code := int32(http.StatusUnprocessableEntity)
		if !errors.Is(err, ErrExhausted) && !errors.Is(err, errTaken) {
			code = http.StatusInternalServerError
		}
		return admission.Deny(code, err.Error())
	}
	return admission.Patch(ops)
}

var errTaken = errors.New("mac address taken")

// Assign persists an address for every bridge or masquerade interface of
// vm without one and for every explicitly requested address old did not
// already have, and returns the JSON patch that writes them into vm. On
// error nothing of this call stays allocated.
func (p *Pool) Assign(ctx context.Context, vm, old *kubevirtv1.VirtualMachine, dryRun bool) ([]admission.PatchOp, error) {
	if vm.Spec.Template == nil {
		return nil, nil
	}
	had := map[string]bool{}
	if old != nil {
		for _, m := range vmMACs(old) {
			had[m] = true
		}
	}
	o := Owner{Namespace: vm.Namespace, Name: vm.Name}
	ifaces := vm.Spec.Template.Spec.Domain.Devices.Interfaces
	out := make([]kubevirtv1.Interface, len(ifaces))
	copy(out, ifaces)
	var made []*macv1alpha1.MACAllocation
	fail := func(err error) ([]admission.PatchOp, error) {
		if !dryRun {
			p.release(context.WithoutCancel(ctx), made)
		}
		return nil, err
	}
	seen := map[string]string{}
	var auto []int // interfaces that get a fresh address
	for i := range out {
		iface := &out[i]
		if iface.MacAddress != "" {
			m, err := ParseMAC(iface.MacAddress)
			if err != nil {
				return fail(fmt.Errorf("spec.template.spec.domain.devices.interfaces[%d].macAddress: %q: %w", i, iface.MacAddress, err))
			}
			mac := FormatMAC(m)
			if other, dup := seen[mac]; dup {
				return fail(fmt.Errorf("%w: mac address %s is requested by both interfaces %s and %s", errTaken, mac, other, iface.Name))
			}
			seen[mac] = iface.Name
			if had[mac] {
				continue
			}
			a, err := p.claim(ctx, m, o, iface.Name, dryRun)
			if err != nil {
				return fail(fmt.Errorf("%w: %w", errTaken, err))
			}
			if a != nil && !dryRun {
				made = append(made, a)
			}
			continue
		}
		if iface.Bridge != nil || iface.Masquerade != nil {
			auto = append(auto, i)
		}
	}
	// Fresh addresses are persisted in parallel: one round trip per VM.
	got := make([]*macv1alpha1.MACAllocation, len(auto))
	errs := make([]error, len(auto))
	var wg sync.WaitGroup
	for j, i := range auto {
		wg.Add(1)
		go func() {
			defer wg.Done()
			got[j], errs[j] = p.allocate(ctx, o, out[i].Name, dryRun)
		}()
	}
	wg.Wait()
	for j, i := range auto {
		if got[j] != nil && !dryRun {
			made = append(made, got[j])
		}
		if errs[j] == nil {
			out[i].MacAddress = got[j].Spec.MAC
		}
	}
	for j, i := range auto {
		if errs[j] != nil {
			return fail(fmt.Errorf("interface %s: %w", out[i].Name, errs[j]))
		}
	}
	changed := len(auto) > 0
	if p.crashAfterPersist != nil && p.crashAfterPersist() {
		return nil, errors.New("simulated crash after persisting allocations")
	}
	if !changed {
		return nil, nil
	}
	return []admission.PatchOp{{Op: "replace", Path: "/spec/template/spec/domain/devices/interfaces", Value: out}}, nil
}
