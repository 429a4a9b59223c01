package admission

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	admissionv1 "k8s.io/api/admission/v1"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// Names of the quota webhooks.
const (
	VMILimitRangeName = "virtualmachineinstances-limitrange.nodevirt.io"
	VMIQuotaName      = "virtualmachineinstances-quota.nodevirt.io"
)

// reservationTTL is how long a VMI admitted by the quota webhook is
// counted before it shows in a list of the namespace's VMIs: past it, a
// create that failed after admission (refused by the API server's own quota
// admission, a name taken, etcd down) no longer holds quota. A retry under
// the same name replaces the reservation at once. (The API server's quota
// admission errs the same way: it charges status.used before the write and
// leaves a failed create's charge to the quota controller's next sync.)
const reservationTTL = 30 * time.Second

// The compute resources of a quota that VMIs are charged for, as pods are:
// the API server's own ResourceQuota admission does not know what a VMI
// requests (it counts count/virtualmachineinstances.kubevirt.io itself).
var computeResources = []corev1.ResourceName{
	corev1.ResourceRequestsCPU, corev1.ResourceRequestsMemory, corev1.ResourceLimitsCPU, corev1.ResourceLimitsMemory,
	corev1.ResourceCPU, corev1.ResourceMemory,
}

// quota enforces the namespace's LimitRanges and ResourceQuotas on VMIs.
//
// What it guarantees: with one webhook server answering, VMIs admitted in a
// namespace never sum past a quota's hard compute limits, however many are
// created at once. Each check runs under the namespace's lock against a
// fresh list of the namespace's VMIs plus the VMIs it admitted that the list
// does not show yet (reservations, kept reservationTTL). What it does not:
// two brains answering at once (for the seconds a webhook registration
// moves between them) check independently; and the quota's status.used is
// the quota controller's, which counts pods, so it does not show VMIs'
// compute usage (the refusal message gives the usage the check found).
type quota struct {
	kube   kubernetes.Interface
	cfg    *clusterConfig
	quotas cache.SharedIndexInformer
	limits cache.SharedIndexInformer
	now    func() time.Time

	mu sync.Mutex
	ns map[string]*ledger
}

// ledger is one namespace's lock and reservations, by VMI name.
type ledger struct {
	mu      sync.Mutex
	pending map[string]reservation
}

type reservation struct {
	vmi   *kubevirtv1.VirtualMachineInstance
	until time.Time
}

func registerQuota(s *Server, cfg *clusterConfig) {
	f := informers.NewSharedInformerFactory(s.deps.Kube, 0)
	q := &quota{kube: s.deps.Kube, cfg: cfg, now: time.Now, ns: map[string]*ledger{},
		quotas: f.Core().V1().ResourceQuotas().Informer(), limits: f.Core().V1().LimitRanges().Informer()}
	s.Go(func(ctx context.Context) error { f.Start(ctx.Done()); <-ctx.Done(); f.Shutdown(); return nil })
	s.Register(Webhook{Name: VMILimitRangeName, Path: "/virtualmachineinstances-limitrange", Mutating: true,
		Rules: rules("virtualmachineinstances", admissionregistrationv1.Create), Admit: q.mutate})
	s.Register(Webhook{Name: VMIQuotaName, Path: "/virtualmachineinstances-quota", SideEffects: true,
		Rules: rules("virtualmachineinstances", admissionregistrationv1.Create), Admit: q.admit})
}

// synced waits up to 5s for the quota and LimitRange informers.
func (q *quota) synced(ctx context.Context) bool {
	if q.quotas.HasSynced() && q.limits.HasSynced() {
		return true
	}
	wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	return cache.WaitForCacheSync(wctx.Done(), q.quotas.HasSynced, q.limits.HasSynced)
}

func byNamespace[T any](inf cache.SharedIndexInformer, ns string) []T {
	objs, _ := inf.GetIndexer().ByIndex(cache.NamespaceIndex, ns)
	out := make([]T, 0, len(objs))
	for _, o := range objs {
		if t, ok := o.(T); ok {
			out = append(out, t)
		}
	}
	return out
}

// mutate applies the namespace's LimitRange container defaults to a VMI's
// resources, as the LimitRanger does to virt-launcher's compute container.
func (q *quota) mutate(ctx context.Context, req *admissionv1.AdmissionRequest) *admissionv1.AdmissionResponse {
	var vmi kubevirtv1.VirtualMachineInstance
	if err := json.Unmarshal(req.Object.Raw, &vmi); err != nil {
		return Denyf("decode virtualmachineinstance: %v", err)
	}
	if !q.synced(ctx) {
		return Deny(http.StatusServiceUnavailable, "limit ranges are not known yet")
	}
	ranges := byNamespace[*corev1.LimitRange](q.limits, req.Namespace)
	changed, err := ApplyLimitRanges(&vmi.Spec, ranges)
	if err != nil {
		return Deny(http.StatusForbidden, err.Error())
	}
	if !changed {
		return Allow()
	}
	return Patch([]PatchOp{{Op: "replace", Path: "/spec/domain/resources", Value: vmi.Spec.Domain.Resources}})
}

// ApplyLimitRanges fills a VMI's missing CPU and memory requests and limits
// from the Container items of ranges (default, defaultRequest) and checks
// their min and max, as the LimitRanger does for a container. It reports
// whether it changed spec.
func ApplyLimitRanges(spec *kubevirtv1.VirtualMachineInstanceSpec, ranges []*corev1.LimitRange) (bool, error) {
	if len(ranges) == 0 {
		return false, nil
	}
	res := &spec.Domain.Resources
	changed := false
	filled := map[corev1.ResourceName]bool{}
	fill := func(list *corev1.ResourceList, from corev1.ResourceList) {
		for _, r := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
			v, ok := from[r]
			if !ok {
				continue
			}
			if _, set := (*list)[r]; set {
				continue
			}
			if *list == nil {
				*list = corev1.ResourceList{}
			}
			(*list)[r] = v.DeepCopy()
			changed, filled[r] = true, true
		}
	}
	for _, lr := range ranges {
		for _, it := range lr.Spec.Limits {
			if it.Type != corev1.LimitTypeContainer {
				continue
			}
			fill(&res.Limits, it.Default)
			fill(&res.Requests, it.DefaultRequest)
		}
	}
	var problems []string
	for _, r := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
		req, hasReq := res.Requests[r]
		lim, hasLim := res.Limits[r]
		// A request above its limit that the user wrote is the validating
		// webhook's to name; one the defaults made is refused here.
		if filled[r] && hasReq && hasLim && req.Cmp(lim) > 0 {
			problems = append(problems, fmt.Sprintf("%s request %s is greater than its limit %s (the LimitRange's default)", r, req.String(), lim.String()))
		}
		for _, lr := range ranges {
			for _, it := range lr.Spec.Limits {
				if it.Type != corev1.LimitTypeContainer {
					continue
				}
				if min, ok := it.Min[r]; ok && hasReq && req.Cmp(min) < 0 {
					problems = append(problems, fmt.Sprintf("minimum %s usage per Container is %s, but request is %s", r, min.String(), req.String()))
				}
				if max, ok := it.Max[r]; ok {
					switch {
					case !hasLim:
						problems = append(problems, fmt.Sprintf("maximum %s usage per Container is %s, but no limit is specified", r, max.String()))
					case lim.Cmp(max) > 0:
						problems = append(problems, fmt.Sprintf("maximum %s usage per Container is %s, but limit is %s", r, max.String(), lim.String()))
					}
				}
			}
		}
	}
	if len(problems) > 0 {
		return changed, fmt.Errorf("%s", strings.Join(problems, ", "))
	}
	return changed, nil
}

// VMIUsage is what a VMI is charged against a quota, as its virt-launcher
// pod is in KubeVirt: the CPU request (else the limit, else vCPUs divided by
// the CPU allocation ratio), the memory request (else the limit, else the
// guest memory), and the limits that are set. A VMI in a final phase uses
// nothing.
func VMIUsage(vmi *kubevirtv1.VirtualMachineInstance, cpuAllocationRatio int) corev1.ResourceList {
	out := corev1.ResourceList{}
	if vmi.Status.Phase == kubevirtv1.Succeeded || vmi.Status.Phase == kubevirtv1.Failed {
		return out
	}
	if cpuAllocationRatio <= 0 {
		cpuAllocationRatio = defaultCPUAllocationRatio
	}
	d := &vmi.Spec.Domain
	cpu, ok := d.Resources.Requests[corev1.ResourceCPU]
	if !ok {
		cpu, ok = d.Resources.Limits[corev1.ResourceCPU]
	}
	if !ok {
		vcpus := int64(1)
		if c := d.CPU; c != nil {
			vcpus = int64(max(c.Sockets, 1)) * int64(max(c.Cores, 1)) * int64(max(c.Threads, 1))
		}
		cpu = *resource.NewMilliQuantity(vcpus*1000/int64(cpuAllocationRatio), resource.DecimalSI)
	}
	mem, ok := d.Resources.Requests[corev1.ResourceMemory]
	if !ok {
		mem, ok = d.Resources.Limits[corev1.ResourceMemory]
	}
	if !ok && d.Memory != nil && d.Memory.Guest != nil {
		mem, ok = *d.Memory.Guest, true
	}
	out[corev1.ResourceRequestsCPU], out[corev1.ResourceCPU] = cpu.DeepCopy(), cpu.DeepCopy()
	if ok {
		out[corev1.ResourceRequestsMemory], out[corev1.ResourceMemory] = mem.DeepCopy(), mem.DeepCopy()
	}
	if v, ok := d.Resources.Limits[corev1.ResourceCPU]; ok {
		out[corev1.ResourceLimitsCPU] = v.DeepCopy()
	}
	if v, ok := d.Resources.Limits[corev1.ResourceMemory]; ok {
		out[corev1.ResourceLimitsMemory] = v.DeepCopy()
	}
	return out
}

// quotaMatches reports whether rq's scopes select vmi, reading a VMI as its
// launcher pod: never best-effort (it always requests memory), never
// terminating (no active deadline), of its priority class.
func quotaMatches(rq *corev1.ResourceQuota, vmi *kubevirtv1.VirtualMachineInstance) bool {
	match := func(scope corev1.ResourceQuotaScope, op corev1.ScopeSelectorOperator, values []string) bool {
		var has bool
		switch scope {
		case corev1.ResourceQuotaScopeNotBestEffort, corev1.ResourceQuotaScopeNotTerminating:
			has = true
		case corev1.ResourceQuotaScopePriorityClass:
			pc := vmi.Spec.PriorityClassName
			switch op {
			case corev1.ScopeSelectorOpIn:
				return slices.Contains(values, pc)
			case corev1.ScopeSelectorOpNotIn:
				return !slices.Contains(values, pc)
			}
			has = pc != ""
		}
		if op == corev1.ScopeSelectorOpDoesNotExist {
			return !has
		}
		return has
	}
	for _, s := range rq.Spec.Scopes {
		if !match(s, corev1.ScopeSelectorOpExists, nil) {
			return false
		}
	}
	if sel := rq.Spec.ScopeSelector; sel != nil {
		for _, e := range sel.MatchExpressions {
			if !match(e.ScopeName, e.Operator, e.Values) {
				return false
			}
		}
	}
	return true
}

func (q *quota) ledger(ns string) *ledger {
	q.mu.Lock()
	defer q.mu.Unlock()
	l := q.ns[ns]
	if l == nil {
		l = &ledger{pending: map[string]reservation{}}
		q.ns[ns] = l
	}
	return l
}

// admit refuses a VMI that would take a quota of its namespace past its
// hard compute limits, with the API server's quota message.
func (q *quota) admit(ctx context.Context, req *admissionv1.AdmissionRequest) *admissionv1.AdmissionResponse {
	var vmi kubevirtv1.VirtualMachineInstance
	if err := json.Unmarshal(req.Object.Raw, &vmi); err != nil {
		return Denyf("decode virtualmachineinstance: %v", err)
	}
	vmi.Namespace = req.Namespace
	if vmi.Name == "" {
		vmi.Name = req.Name
	}
	if !q.synced(ctx) {
		return Deny(http.StatusServiceUnavailable, "resource quotas are not known yet")
	}
	var quotas []*corev1.ResourceQuota
	for _, rq := range byNamespace[*corev1.ResourceQuota](q.quotas, req.Namespace) {
		if constrainsCompute(rq) && quotaMatches(rq, &vmi) {
			quotas = append(quotas, rq)
		}
	}
	if len(quotas) == 0 {
		return Allow()
	}
	ratio := q.cfg.cpuAllocationRatio(ctx)
	l := q.ledger(req.Namespace)
	l.mu.Lock()
	defer l.mu.Unlock()
	list, err := q.listVMIs(ctx, req.Namespace)
	if err != nil {
		return Deny(http.StatusInternalServerError, fmt.Sprintf("list virtualmachineinstances: %v", err))
	}
	others := l.others(list, vmi.Name, q.now())
	if err := CheckQuotas(quotas, &vmi, others, ratio); err != nil {
		return &admissionv1.AdmissionResponse{Result: &metav1.Status{Status: metav1.StatusFailure,
			Code: http.StatusForbidden, Reason: metav1.StatusReasonForbidden, Message: err.Error()}}
	}
	if req.DryRun == nil || !*req.DryRun {
		l.pending[vmi.Name] = reservation{vmi: vmi.DeepCopy(), until: q.now().Add(reservationTTL)}
	}
	return Allow()
}

func (q *quota) listVMIs(ctx context.Context, ns string) ([]kubevirtv1.VirtualMachineInstance, error) {
	if q.cfg == nil || q.cfg.virt == nil {
		return nil, fmt.Errorf("no kubevirt client")
	}
	list, err := q.cfg.virt.VMIs.List(ctx, ns, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	out := make([]kubevirtv1.VirtualMachineInstance, 0, len(list))
	for _, v := range list {
		out = append(out, *v)
	}
	return out, nil
}

// others are the namespace's VMIs besides the one named name: those listed
// and the reservations the list does not show yet. Reservations the list
// shows (by name), or past their time, are dropped.
func (l *ledger) others(list []kubevirtv1.VirtualMachineInstance, name string, now time.Time) []*kubevirtv1.VirtualMachineInstance {
	listed := map[string]bool{}
	var out []*kubevirtv1.VirtualMachineInstance
	for i := range list {
		listed[list[i].Name] = true
		if list[i].Name != name {
			out = append(out, &list[i])
		}
	}
	for k, r := range l.pending {
		switch {
		case listed[k] || now.After(r.until):
			delete(l.pending, k)
		case k != name:
			out = append(out, r.vmi)
		}
	}
	return out
}

func constrainsCompute(rq *corev1.ResourceQuota) bool {
	for _, r := range computeResources {
		if _, ok := rq.Spec.Hard[r]; ok {
			return true
		}
	}
	return false
}

// CheckQuotas refuses vmi when, added to others (the namespace's other
// VMIs), it would exceed a hard compute limit of one of quotas, or when a
// quota limits what vmi does not specify; the errors read as the API
// server's ResourceQuota admission words them for pods.
func CheckQuotas(quotas []*corev1.ResourceQuota, vmi *kubevirtv1.VirtualMachineInstance, others []*kubevirtv1.VirtualMachineInstance, ratio int) error {
	requested := VMIUsage(vmi, ratio)
	for _, rq := range quotas {
		var constrained, missing []corev1.ResourceName
		for _, r := range computeResources {
			if _, ok := rq.Spec.Hard[r]; !ok {
				continue
			}
			constrained = append(constrained, r)
			if _, ok := requested[r]; !ok {
				missing = append(missing, r)
			}
		}
		if len(missing) > 0 {
			names := make([]string, len(missing))
			for i, r := range missing {
				names[i] = string(r)
			}
			sort.Strings(names)
			return fmt.Errorf("failed quota: %s: must specify %s", rq.Name, strings.Join(names, ","))
		}
		used := corev1.ResourceList{}
		for _, o := range others {
			if !quotaMatches(rq, o) {
				continue
			}
			for r, v := range VMIUsage(o, ratio) {
				if !slices.Contains(constrained, r) {
					continue
				}
				sum := used[r]
				sum.Add(v)
				used[r] = sum
			}
		}
		var exceeded []corev1.ResourceName
		for _, r := range constrained {
			total := used[r].DeepCopy()
			total.Add(requested[r])
			if total.Cmp(rq.Spec.Hard[r]) > 0 {
				exceeded = append(exceeded, r)
			}
		}
		if len(exceeded) > 0 {
			return fmt.Errorf("exceeded quota: %s, requested: %s, used: %s, limited: %s", rq.Name,
				pretty(requested, exceeded), pretty(used, exceeded), pretty(rq.Spec.Hard, exceeded))
		}
	}
	return nil
}

// pretty prints the names of list as the quota admission does:
// "name=value" sorted by name, comma-separated, 0 for what is absent.
func pretty(list corev1.ResourceList, names []corev1.ResourceName) string {
	keys := make([]string, len(names))
	for i, r := range names {
		keys[i] = string(r)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		v := list[corev1.ResourceName(k)]
		parts[i] = k + "=" + v.String()
	}
	return strings.Join(parts, ",")
}
