package hco

import (
	"fmt"
	"reflect"
	"runtime"
	"sort"
	"strings"

	conditionsv1 "github.com/openshift/custom-resource-status/conditions/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"
	kubevirtv1 "kubevirt.io/api/core/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api"
	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
	hppv1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hostpathprovisioner/v1beta1"
)

// Reasons and messages of the HyperConverged conditions (upstream's).
const (
	reasonInit              = "Init"
	reasonCompleted         = "ReconcileCompleted"
	messageCompleted        = "Reconcile completed successfully"
	reasonInvalidRequest    = "InvalidRequest"
	messageInvalidRequest   = "Request does not match expected name (%v) and namespace (%v)"
	reasonDegraded          = "HCODegraded"
	reasonProgressing       = "HCOProgressing"
	reasonTainted           = "UnsupportedFeatureAnnotation"
	messageTainted          = "Unsupported feature was activated via an HCO annotation"
	reasonInvalidConfig     = "InvalidConfiguration"
	reasonUninstallBlocked  = "UninstallBlocked"
	healthHealthy           = "healthy"
	healthWarning           = "warning"
	healthError             = "error"
	phaseDeployed           = "Deployed"
	phaseDeploying          = "Deploying"
	componentBrain          = "ClusterBrain"
	componentNodeAgents     = "NodeAgents"
	schedulableLabel        = "kubevirt.io/schedulable"
	messageNoReadyNodeAgent = "no nodeagent is ready"
)

// Component kinds as they appear in the HCO conditions' reasons.
const (
	kindKubeVirt = "KubeVirt"
	kindCDI      = "CDI"
	kindCNAO     = "NetworkAddonsConfig"
	kindSSP      = "SSP"
	kindHPP      = "HostPathProvisioner"
)

// componentHealth is the state of one child as the brain judges it.
type componentHealth struct {
	Kind        string
	Available   bool
	Progressing bool
	Degraded    bool
	// Message explains a false Available or a true Degraded.
	Message string
}

// nodeHealth summarises the nodeagents, seen through the Nodes they
// register (label kubevirt.io/schedulable, condition Ready).
type nodeHealth struct {
	Ready   []string
	Failing []string // "node: why"
}

// isNodeAgent says whether obj is a node agent's Node (it carries the
// schedulable label).
func isNodeAgent(obj any) bool {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	n, ok := obj.(*corev1.Node)
	if !ok {
		return false
	}
	_, agent := n.Labels[schedulableLabel]
	return agent
}

// nodeHealthOf judges the node agents among nodes (an informer cache's
// objects: read, never written).
func nodeHealthOf(nodes []*corev1.Node) nodeHealth {
	var h nodeHealth
	for _, n := range nodes {
		if !isNodeAgent(n) {
			continue
		}
		why := ""
		ready := false
		for _, c := range n.Status.Conditions {
			if c.Type == corev1.NodeReady {
				ready = c.Status == corev1.ConditionTrue
				why = c.Message
				if why == "" {
					why = c.Reason
				}
			}
		}
		switch {
		case !ready && why == "":
			h.Failing = append(h.Failing, n.Name+": not ready")
		case !ready:
			h.Failing = append(h.Failing, n.Name+": "+why)
		case n.Labels[schedulableLabel] != "true":
			h.Failing = append(h.Failing, n.Name+": not schedulable")
		default:
			h.Ready = append(h.Ready, n.Name)
		}
	}
	sort.Strings(h.Ready)
	sort.Strings(h.Failing)
	return h
}

// nodeHealthChanged says whether a Node update changes what nodeHealthOf
// reads of it. A node agent's heartbeat (every node, every 10 s) changes
// nothing of it; were each one a sync, a few hundred nodes would keep the
// HyperConverged syncing back to back, listing every Node each time.
func nodeHealthChanged(old, cur any) bool {
	o, ok1 := old.(*corev1.Node)
	n, ok2 := cur.(*corev1.Node)
	if !ok1 || !ok2 {
		return true
	}
	return !reflect.DeepEqual(nodeHealthOf([]*corev1.Node{o}), nodeHealthOf([]*corev1.Node{n}))
}

// judge decides each child's health from what it stands for: the parts
// the node agents run for it (at least one ready node agent; KubeVirt is
// also degraded by every failing one) and the probes of the brain's parts
// (failures by kind). A child with a failing probe is not available, with
// the failures as its reason.
func judge(kinds []string, nodes nodeHealth, failures map[string][]string) []componentHealth {
	var out []componentHealth
	for _, k := range kinds {
		h := componentHealth{Kind: k, Available: true}
		var missing []string
		if roles, onNodes := nodeRoles[k]; onNodes && len(nodes.Ready) == 0 {
			msg := messageNoReadyNodeAgent
			if roles != "" {
				msg += " (" + roles + ")"
			}
			if len(nodes.Failing) > 0 {
				msg += ": " + strings.Join(nodes.Failing, "; ")
			}
			missing = append(missing, msg)
		}
		missing = append(missing, failures[k]...)
		if len(missing) > 0 {
			h.Available = false
			h.Message = strings.Join(missing, "; ")
		}
		if k == kindKubeVirt && len(nodes.Failing) > 0 {
			h.Degraded = true
			if h.Available {
				h.Message = "nodeagent not ready on " + strings.Join(nodes.Failing, "; ")
			}
		}
		out = append(out, h)
	}
	return out
}

// standsFor says what a child's Available means: these parts run (the
// brain's are probed, the node agents' judged from their Nodes).
var standsFor = map[string]string{
	kindKubeVirt: "the brain's VM controller, scheduler and admission webhooks; the virt-handler role of the ready node agents",
	kindCDI:      "the brain's DataVolume controller, upload proxy and DataVolume webhook; the importer and upload server of the ready node agents",
	kindCNAO:     "the brain's MAC pool and its webhook; the bridge CNI and bridge-marker of the ready node agents",
	kindSSP:      "the brain's common templates (reconciled), template validator webhook and boot-source import crons",
	kindHPP:      "the storage pools of the node agents its workload placement selects",
}

// hppHealth judges the HostPathProvisioner child from the status its own
// controller writes (the node agents' pool reports).
func hppHealth(hpp *hppv1beta1.HostPathProvisioner) componentHealth {
	h := componentHealth{Kind: kindHPP, Message: "HostPathProvisioner " + hpp.Name + " has no status yet"}
	for _, c := range hpp.Status.Conditions {
		switch c.Type {
		case "Available":
			h.Available = c.Status == "True"
			if !h.Available {
				h.Message = "HostPathProvisioner " + hpp.Name + ": " + c.Message
			}
		case "Progressing":
			h.Progressing = c.Status == "True"
		case "Degraded":
			if c.Status == "True" {
				h.Degraded = true
				if h.Available {
					h.Message = "HostPathProvisioner " + hpp.Name + ": " + c.Message
				}
			}
		}
	}
	if h.Available && !h.Degraded {
		h.Message = ""
	}
	return h
}

func boolStatus(b bool) metav1.ConditionStatus {
	if b {
		return metav1.ConditionTrue
	}
	return metav1.ConditionFalse
}

// childConditions renders one child's Available/Progressing/Degraded.
func childConditions(h componentHealth) []metav1.Condition {
	avail := metav1.Condition{Type: "Available", Status: boolStatus(h.Available), Reason: "Available", Message: "Running: " + standsFor[h.Kind]}
	if !h.Available {
		avail.Reason, avail.Message = "NotAvailable", h.Message
	}
	deg := metav1.Condition{Type: "Degraded", Status: boolStatus(h.Degraded), Reason: "AsExpected"}
	if h.Degraded {
		deg.Reason, deg.Message = "Degraded", h.Message
	}
	prog := metav1.Condition{Type: "Progressing", Status: boolStatus(h.Progressing), Reason: "Reconciled"}
	return []metav1.Condition{avail, prog, deg}
}

func phaseOf(h componentHealth) string {
	if h.Available {
		return phaseDeployed
	}
	return phaseDeploying
}

// kubeVirtStatus returns kv's status as the brain reports it, keeping
// transition times of unchanged conditions.
func kubeVirtStatus(kv *kubevirtv1.KubeVirt, h componentHealth, version string) kubevirtv1.KubeVirtStatus {
	st := kv.Status
	st.Phase = kubevirtv1.KubeVirtPhase(phaseOf(h))
	now := metav1.Now()
	var conds []kubevirtv1.KubeVirtCondition
	for _, c := range childConditions(h) {
		nc := kubevirtv1.KubeVirtCondition{Type: kubevirtv1.KubeVirtConditionType(c.Type), Status: corev1.ConditionStatus(c.Status),
			Reason: c.Reason, Message: c.Message, LastProbeTime: now, LastTransitionTime: now}
		for _, old := range kv.Status.Conditions {
			if old.Type == nc.Type && old.Status == nc.Status && old.Reason == nc.Reason && old.Message == nc.Message {
				nc = old
			}
		}
		conds = append(conds, nc)
	}
	st.Conditions = conds
	st.OperatorVersion, st.TargetKubeVirtVersion, st.ObservedKubeVirtVersion = version, version, version
	st.ObservedGeneration = ptrTo(kv.Generation)
	st.DefaultArchitecture = runtime.GOARCH
	return st
}

func cdiStatus(cdi *cdiv1.CDI, h componentHealth, version string) cdiv1.CDIStatus {
	st := cdi.Status
	st.Phase = "Deployed"
	if !h.Available {
		st.Phase = "Deploying"
	}
	var conds []conditionsv1.Condition
	for _, c := range childConditions(h) {
		nc := conditionsv1.Condition{Type: conditionsv1.ConditionType(c.Type), Status: corev1.ConditionStatus(c.Status),
			Reason: c.Reason, Message: c.Message, LastHeartbeatTime: metav1.Now(), LastTransitionTime: metav1.Now()}
		for _, old := range cdi.Status.Conditions {
			if old.Type == nc.Type && old.Status == nc.Status && old.Reason == nc.Reason && old.Message == nc.Message {
				nc = old
			}
		}
		conds = append(conds, nc)
	}
	st.Conditions = conds
	st.OperatorVersion, st.TargetVersion, st.ObservedVersion = version, version, version
	return st
}

func operatorStatus(old api.OperatorStatus, generation int64, h componentHealth, version string) api.OperatorStatus {
	st := old
	st.Phase = phaseOf(h)
	var conds []api.Condition
	for _, c := range childConditions(h) {
		nc := api.Condition{Type: c.Type, Status: string(c.Status), Reason: c.Reason, Message: c.Message,
			LastHeartbeatTime: metav1.Now(), LastTransitionTime: metav1.Now()}
		for _, o := range old.Conditions {
			if o.Type == nc.Type && o.Status == nc.Status && o.Reason == nc.Reason && o.Message == nc.Message {
				nc = o
			}
		}
		conds = append(conds, nc)
	}
	st.Conditions = conds
	st.OperatorVersion, st.TargetVersion, st.ObservedVersion = version, version, version
	st.ObservedGeneration = generation
	return st
}

// conditionSet collects the HCO conditions of one reconcile; a message of
// every failing component is kept (joined), unlike upstream which keeps the
// last one only.
type conditionSet map[string]metav1.Condition

func (s conditionSet) add(typ string, status metav1.ConditionStatus, reason, msg string) {
	if old, ok := s[typ]; ok && old.Status == status {
		old.Message += "; " + msg
		s[typ] = old
		return
	}
	s[typ] = metav1.Condition{Type: typ, Status: status, Reason: reason, Message: msg}
}

func (s conditionSet) setIfUnset(typ string, status metav1.ConditionStatus, reason, msg string) {
	if _, ok := s[typ]; !ok {
		s[typ] = metav1.Condition{Type: typ, Status: status, Reason: reason, Message: msg}
	}
}

// aggregate turns the components' health into the HCO conditions, following
// upstream's decision chart: a degraded component makes the platform
// degraded, not upgradeable and (unless said otherwise) unavailable; a
// progressing one makes it not upgradeable.
func aggregate(components []componentHealth, brainErr error) conditionSet {
	s := conditionSet{}
	for _, c := range components {
		if !c.Available {
			s.add(hcov1beta1.ConditionAvailable, metav1.ConditionFalse, c.Kind+"NotAvailable",
				fmt.Sprintf("%s is not available: %s", c.Kind, c.Message))
		}
		if c.Progressing {
			s.add(hcov1beta1.ConditionProgressing, metav1.ConditionTrue, c.Kind+"Progressing",
				fmt.Sprintf("%s is progressing: %s", c.Kind, c.Message))
		}
		if c.Degraded {
			s.add(hcov1beta1.ConditionDegraded, metav1.ConditionTrue, c.Kind+"Degraded",
				fmt.Sprintf("%s is degraded: %s", c.Kind, c.Message))
		}
	}
	if brainErr != nil {
		s.add(hcov1beta1.ConditionDegraded, metav1.ConditionTrue, componentBrain+"Degraded",
			fmt.Sprintf("%s is degraded: %v", componentBrain, brainErr))
	}
	s[hcov1beta1.ConditionReconcileComplete] = metav1.Condition{Type: hcov1beta1.ConditionReconcileComplete,
		Status: metav1.ConditionTrue, Reason: reasonCompleted, Message: messageCompleted}
	if _, degraded := s[hcov1beta1.ConditionDegraded]; degraded {
		s.setIfUnset(hcov1beta1.ConditionProgressing, metav1.ConditionFalse, reasonCompleted, messageCompleted)
		s.setIfUnset(hcov1beta1.ConditionUpgradeable, metav1.ConditionFalse, reasonDegraded, "HCO is not Upgradeable due to degraded components")
		s.setIfUnset(hcov1beta1.ConditionAvailable, metav1.ConditionFalse, reasonDegraded, "HCO is not available due to degraded components")
		return s
	}
	s[hcov1beta1.ConditionDegraded] = metav1.Condition{Type: hcov1beta1.ConditionDegraded,
		Status: metav1.ConditionFalse, Reason: reasonCompleted, Message: messageCompleted}
	if _, progressing := s[hcov1beta1.ConditionProgressing]; progressing {
		s.setIfUnset(hcov1beta1.ConditionUpgradeable, metav1.ConditionFalse, reasonProgressing, "HCO is not Upgradeable due to progressing components")
	} else {
		s[hcov1beta1.ConditionProgressing] = metav1.Condition{Type: hcov1beta1.ConditionProgressing,
			Status: metav1.ConditionFalse, Reason: reasonCompleted, Message: messageCompleted}
		s.setIfUnset(hcov1beta1.ConditionUpgradeable, metav1.ConditionTrue, reasonCompleted, messageCompleted)
	}
	s.setIfUnset(hcov1beta1.ConditionAvailable, metav1.ConditionTrue, reasonCompleted, messageCompleted)
	return s
}

// failedReconcile is the condition set of a reconcile that could not
// render or apply the children.
func failedReconcile(reason, msg string) conditionSet {
	s := conditionSet{}
	s[hcov1beta1.ConditionReconcileComplete] = metav1.Condition{Type: hcov1beta1.ConditionReconcileComplete,
		Status: metav1.ConditionFalse, Reason: reason, Message: msg}
	s[hcov1beta1.ConditionDegraded] = metav1.Condition{Type: hcov1beta1.ConditionDegraded,
		Status: metav1.ConditionTrue, Reason: reason, Message: msg}
	return s
}

// hcoConditionTypes are the conditions every HCO status carries.
var hcoConditionTypes = []string{
	hcov1beta1.ConditionReconcileComplete, hcov1beta1.ConditionAvailable, hcov1beta1.ConditionProgressing,
	hcov1beta1.ConditionDegraded, hcov1beta1.ConditionUpgradeable,
}

// applyConditions writes s into hc's status: unknown for every missing
// type, TaintedConfiguration when a JSON-patch annotation is in use, and
// the system health summary.
func applyConditions(hc *hcov1beta1.HyperConverged, s conditionSet) {
	for _, t := range hcoConditionTypes {
		c, ok := s[t]
		if !ok {
			c = metav1.Condition{Type: t, Status: metav1.ConditionUnknown, Reason: "StatusUnknown", Message: "Unknown Status"}
		}
		c.ObservedGeneration = hc.Generation
		meta.SetStatusCondition(&hc.Status.Conditions, c)
	}
	if len(TaintedBy(hc)) > 0 {
		meta.SetStatusCondition(&hc.Status.Conditions, metav1.Condition{Type: hcov1beta1.ConditionTaintedConfiguration,
			Status: metav1.ConditionTrue, Reason: reasonTainted, Message: messageTainted, ObservedGeneration: hc.Generation})
	} else {
		meta.RemoveStatusCondition(&hc.Status.Conditions, hcov1beta1.ConditionTaintedConfiguration)
	}
	conds := hc.Status.Conditions
	switch {
	case !meta.IsStatusConditionTrue(conds, hcov1beta1.ConditionAvailable) || meta.IsStatusConditionTrue(conds, hcov1beta1.ConditionDegraded):
		hc.Status.SystemHealthStatus = healthError
	case !meta.IsStatusConditionTrue(conds, hcov1beta1.ConditionReconcileComplete) || meta.IsStatusConditionTrue(conds, hcov1beta1.ConditionProgressing):
		hc.Status.SystemHealthStatus = healthWarning
	default:
		hc.Status.SystemHealthStatus = healthHealthy
	}
}

// sameConditions compares condition lists ignoring heartbeat times.
func sameConditions(a, b []metav1.Condition) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		x, y := a[i], b[i]
		x.LastTransitionTime, y.LastTransitionTime = metav1.Time{}, metav1.Time{}
		if x != y {
			return false
		}
	}
	return true
}
