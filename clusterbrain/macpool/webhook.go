package macpool

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"time"

	admissionv1 "k8s.io/api/admission/v1"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/admission"
)

// WebhookName is the MAC pool's mutating webhook (kubemacpool's name).
const WebhookName = "mutatevirtualmachines.kubemacpool.io"

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
		Name:     WebhookName,
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
// already have, and returns the JSON patch that writes them into vm. All
// of them are persisted by one group commit; on error nothing of this call
// stays allocated beyond what the reconciler frees after the grace.
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
	seen := map[string]string{}
	var wants []want
	var at []int // interface index of each want
	auto := false
	for i := range out {
		iface := &out[i]
		if iface.MacAddress != "" {
			m, err := ParseMAC(iface.MacAddress)
			if err != nil {
				return nil, fmt.Errorf("spec.template.spec.domain.devices.interfaces[%d].macAddress: %q: %w", i, iface.MacAddress, err)
			}
			mac := FormatMAC(m)
			if other, dup := seen[mac]; dup {
				return nil, fmt.Errorf("%w: mac address %s is requested by both interfaces %s and %s", errTaken, mac, other, iface.Name)
			}
			seen[mac] = iface.Name
			if !had[mac] {
				wants, at = append(wants, want{mac: m, iface: iface.Name}), append(at, i)
			}
			continue
		}
		if iface.Bridge != nil || iface.Masquerade != nil {
			wants, at = append(wants, want{iface: iface.Name}), append(at, i)
			auto = true
		}
	}
	if len(wants) == 0 {
		return nil, nil
	}
	var got []uint64
	var err error
	if dryRun {
		got, err = p.dryPlan(ctx, o, wants)
	} else {
		got, err = p.commit(ctx, o, wants)
	}
	if err != nil {
		if errors.Is(err, ErrExhausted) {
			return nil, err
		}
		var taken *takenError
		if errors.As(err, &taken) {
			return nil, fmt.Errorf("%w: %w", errTaken, err)
		}
		return nil, err
	}
	if p.crashAfterPersist != nil && p.crashAfterPersist() {
		return nil, errors.New("simulated crash after persisting allocations")
	}
	if !auto {
		return nil, nil
	}
	for j, i := range at {
		if wants[j].mac == 0 {
			out[i].MacAddress = FormatMAC(got[j])
		}
	}
	return []admission.PatchOp{{Op: "replace", Path: "/spec/template/spec/domain/devices/interfaces", Value: out}}, nil
}

// dryPlan picks addresses for wants as a commit would, persisting nothing.
func (p *Pool) dryPlan(ctx context.Context, o Owner, wants []want) ([]uint64, error) {
	r := &commitReq{owner: o, wants: wants, got: make([]uint64, len(wants))}
	rd := &round{p: p, ctx: ctx, now: metav1.Now(), blocks: map[string]*workBlock{}, setHere: map[uint64]bool{}, dry: true}
	p.mu.Lock()
	rng, cursor := p.rng, p.cursor
	p.mu.Unlock()
	if err := rd.plan(r, rng, &cursor); err != nil {
		return nil, err
	}
	for i, m := range r.next {
		if m != 0 {
			r.got[i] = m
		}
	}
	return r.got, nil
}
