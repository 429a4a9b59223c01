package rbac

import (
	"context"
	"fmt"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	snapshotv1 "github.com/nodevirt/nodevirt/clusterbrain/api/volumesnapshot/v1"
)

// Node restriction: what NodeRestriction does for kubelets, for nodevirt's
// nodes. RBAC gives every node the same verbs on a kind; these
// ValidatingAdmissionPolicies (CEL, evaluated by the API server itself)
// narrow each write of a node agent — a user named identity.NodeUser(<node>) in
// identity.NodesGroup — to the objects of that node:
// narrow each write of a node agent — a user named NodeUser(<node>) in
// NodesGroup, or the agents' ServiceAccount with a token bound to a pod on
// <node> (NodeOf) — to the objects of that node:
//
//   - Nodes (and their status): only its own, by name.
//   - Leases: only its own, by name.
//   - VirtualMachineInstances (and their status): only those bound to it
//     (status.nodeName, or before that the kubevirt.io/nodeName label), and
//     it cannot bind one to itself or hand one to another node.
//   - VirtualMachineInstanceMigrations' status: only of migrations whose
//     status.migrationState names it as source or target node, and it
//     cannot change those two (package migstate).
//   - PersistentVolumes: only those whose required node affinity
//     (topology.hostpath.csi/node or kubernetes.io/hostname) names it in
//     every term.
//   - PersistentVolumeClaims (and their status): only claims placed on it
//     (volume.kubernetes.io/selected-node or kubevirt.io/provisionOnNode),
//     and it cannot change that placement.
//   - VolumeSnapshotContents (and their status): only those annotated
//     snapshot.nodevirt.io/node=<node> (it may claim a pre-provisioned one
//     no node has claimed yet, as its snapshotter does for handles its
//     driver holds).
//   - Events: only those whose source.host is the node (its recorders set
//     it); it deletes none.
//
// A node agent whose user name does not carry the prefix, or whose token
// names no node, can write none of these. Reads cannot be guarded by admission; see NodeAgentRules.
const NodeRestrictionPolicy = "nodevirt-node-restriction"

// The CEL pieces the policies share: the request is a node agent's, and
// its node's name ("" for a user name without the prefix).
var (
	celIsNode = "(has(request.userInfo.groups) && request.userInfo.groups.exists(g, g == '" + identity.NodesGroup + "')) || " + celNodeAccount
	// A certificate's system:node:<node>, else the pod-bound token's node
	// (see NodeOf).
	celNodeName = fmt.Sprintf("request.userInfo.username.startsWith('%s') ? request.userInfo.username.substring(%d) : "+
		"((%s) && has(request.userInfo.extra) && '%s' in request.userInfo.extra && size(request.userInfo.extra['%s']) == 1 ? "+
		"request.userInfo.extra['%s'][0] : '')",
		identity.NodeUserPrefix, len(identity.NodeUserPrefix), celNodeAccount, NodeNameExtra, NodeNameExtra, NodeNameExtra)
)

// nodePolicy is one policy of the node restriction.
type nodePolicy struct {
	name        string
	rules       []admissionregistrationv1.NamedRuleWithOperations
	variables   []admissionregistrationv1.Variable
	validations []admissionregistrationv1.Validation
}

func ops(o ...admissionregistrationv1.OperationType) []admissionregistrationv1.OperationType {
	return o
}

func ruleFor(group, version string, resources []string, o []admissionregistrationv1.OperationType) admissionregistrationv1.NamedRuleWithOperations {
	scope := admissionregistrationv1.AllScopes
	return admissionregistrationv1.NamedRuleWithOperations{RuleWithOperations: admissionregistrationv1.RuleWithOperations{
		Operations: o, Rule: admissionregistrationv1.Rule{APIGroups: []string{group}, APIVersions: []string{version},
			Resources: resources, Scope: &scope}}}
}

var (
	create = admissionregistrationv1.Create
	update = admissionregistrationv1.Update
	del    = admissionregistrationv1.Delete
)

// named is the object's name on create and update, the old object's on
// delete.
const named = "(request.operation == 'DELETE' ? oldObject.metadata.name : object.metadata.name) == variables.nodeName"

func nodePolicies() []nodePolicy {
	// bound says a VMI belongs to the node: its status.nodeName, or while
	// that is empty, its node label.
	bound := func(o string) string {
		return "(has(" + o + ".status) && has(" + o + ".status.nodeName) && " + o + ".status.nodeName != '') ? " +
			o + ".status.nodeName == variables.nodeName : (has(" + o + ".metadata.labels) && 'kubevirt.io/nodeName' in " +
			o + ".metadata.labels && " + o + ".metadata.labels['kubevirt.io/nodeName'] == variables.nodeName)"
	}
	// pvNode says every term of a PV's required node affinity names the
	// node alone.
	pvNode := func(o string) string {
		return "has(" + o + ".spec.nodeAffinity) && has(" + o + ".spec.nodeAffinity.required) && " +
			"size(" + o + ".spec.nodeAffinity.required.nodeSelectorTerms) > 0 && " +
			o + ".spec.nodeAffinity.required.nodeSelectorTerms.all(t, has(t.matchExpressions) && t.matchExpressions.exists(e, " +
			"(e.key == 'topology.hostpath.csi/node' || e.key == 'kubernetes.io/hostname') && e.operator == 'In' && " +
			"has(e.values) && e.values == [variables.nodeName]))"
	}
	// placement is the node a claim was placed on.
	placement := func(o string) string {
		return "has(" + o + ".metadata.annotations) ? (" +
			"'volume.kubernetes.io/selected-node' in " + o + ".metadata.annotations ? " + o + ".metadata.annotations['volume.kubernetes.io/selected-node'] : " +
			"('kubevirt.io/provisionOnNode' in " + o + ".metadata.annotations ? " + o + ".metadata.annotations['kubevirt.io/provisionOnNode'] : '')) : ''"
	}
	// migrationNodes is a migration's [source, target] node.
	migrationNodes := func(o string) string {
		return "(has(" + o + ".status) && has(" + o + ".status.migrationState) ? [" +
			"has(" + o + ".status.migrationState.sourceNode) ? " + o + ".status.migrationState.sourceNode : '', " +
			"has(" + o + ".status.migrationState.targetNode) ? " + o + ".status.migrationState.targetNode : ''] : ['', ''])"
	}
	// snapNode is the node a VolumeSnapshotContent is on (the snapshotter's
	// annotation; '' while no node has claimed a pre-provisioned one).
	snapNode := func(o string) string {
		return "(has(" + o + ".metadata.annotations) && '" + snapshotv1.AnnNode + "' in " + o + ".metadata.annotations ? " +
			o + ".metadata.annotations['" + snapshotv1.AnnNode + "'] : '')"
	}
	migrationParty := func(o string) string {
		return "(variables.nodeName != '' && variables.nodeName in " + migrationNodes(o) + ")"
	}
	return []nodePolicy{
		{name: NodeRestrictionPolicy + "-nodes",
			rules: []admissionregistrationv1.NamedRuleWithOperations{
				ruleFor("", "v1", []string{"nodes", "nodes/status"}, ops(create, update, del))},
			validations: []admissionregistrationv1.Validation{{Expression: named,
				MessageExpression: "'node ' + variables.nodeName + ' may write only its own Node'"}}},
		{name: NodeRestrictionPolicy + "-leases",
			rules: []admissionregistrationv1.NamedRuleWithOperations{
				ruleFor("coordination.k8s.io", "*", []string{"leases"}, ops(create, update, del))},
			validations: []admissionregistrationv1.Validation{{Expression: named,
				MessageExpression: "'node ' + variables.nodeName + ' may write only its own Lease'"}}},
		{name: NodeRestrictionPolicy + "-vmis",
			rules: []admissionregistrationv1.NamedRuleWithOperations{
				ruleFor("kubevirt.io", "*", []string{"virtualmachineinstances", "virtualmachineinstances/status"}, ops(update, del))},
			validations: []admissionregistrationv1.Validation{{
				Expression:        "(" + bound("oldObject") + ") && (request.operation == 'DELETE' || (" + bound("object") + "))",
				MessageExpression: "'node ' + variables.nodeName + ' may write only the VirtualMachineInstances bound to it'"}}},
		{name: NodeRestrictionPolicy + "-migrations",
			rules: []admissionregistrationv1.NamedRuleWithOperations{
				ruleFor("kubevirt.io", "*", []string{"virtualmachineinstancemigrations", "virtualmachineinstancemigrations/status"}, ops(create, update, del))},
			validations: []admissionregistrationv1.Validation{{
				Expression: "request.operation == 'UPDATE' && " + migrationParty("oldObject") + " && " +
					migrationNodes("object") + " == " + migrationNodes("oldObject"),
				MessageExpression: "'node ' + variables.nodeName + ' may write only the status of migrations it takes part in'"}}},
		{name: NodeRestrictionPolicy + "-pvs",
			rules: []admissionregistrationv1.NamedRuleWithOperations{
				ruleFor("", "v1", []string{"persistentvolumes", "persistentvolumes/status"}, ops(create, update, del))},
			validations: []admissionregistrationv1.Validation{{
				Expression:        "(request.operation == 'CREATE' || (" + pvNode("oldObject") + ")) && (request.operation == 'DELETE' || (" + pvNode("object") + "))",
				MessageExpression: "'node ' + variables.nodeName + ' may write only the PersistentVolumes of its own volumes'"}}},
		{name: NodeRestrictionPolicy + "-snapshotcontents",
			rules: []admissionregistrationv1.NamedRuleWithOperations{
				ruleFor(snapshotv1.GroupName, "*", []string{"volumesnapshotcontents", "volumesnapshotcontents/status"}, ops(create, update, del))},
			validations: []admissionregistrationv1.Validation{{
				Expression: "(request.operation == 'CREATE' || " + snapNode("oldObject") + " == variables.nodeName || " +
					"(request.operation == 'UPDATE' && " + snapNode("oldObject") + " == '')) && " +
					"(request.operation == 'DELETE' || " + snapNode("object") + " == variables.nodeName)",
				MessageExpression: "'node ' + variables.nodeName + ' may write only the VolumeSnapshotContents of its own snapshots'"}}},
		{name: NodeRestrictionPolicy + "-events",
			rules: []admissionregistrationv1.NamedRuleWithOperations{
				ruleFor("", "v1", []string{"events"}, ops(create, update, del))},
			validations: []admissionregistrationv1.Validation{{
				Expression: "request.operation != 'DELETE' && has(object.source) && has(object.source.host) && object.source.host == variables.nodeName && " +
					"(request.operation == 'CREATE' || (has(oldObject.source) && has(oldObject.source.host) && oldObject.source.host == variables.nodeName))",
				MessageExpression: "'node ' + variables.nodeName + ' may write only events whose source host is itself'"}}},
		{name: NodeRestrictionPolicy + "-claims",
			rules: []admissionregistrationv1.NamedRuleWithOperations{
				ruleFor("", "v1", []string{"persistentvolumeclaims", "persistentvolumeclaims/status"}, ops(update))},
			variables: []admissionregistrationv1.Variable{{Name: "placed", Expression: placement("oldObject")}},
			validations: []admissionregistrationv1.Validation{{
				Expression:        "variables.placed == variables.nodeName && (" + placement("object") + ") == variables.placed",
				MessageExpression: "'node ' + variables.nodeName + ' may write only the claims placed on it, and not move them'"}}},
	}
}

// NodeRestrictionPolicies are the ValidatingAdmissionPolicies of the node
// restriction and their bindings (one each, denying).
func NodeRestrictionPolicies() ([]*admissionregistrationv1.ValidatingAdmissionPolicy, []*admissionregistrationv1.ValidatingAdmissionPolicyBinding) {
	fail := admissionregistrationv1.Fail
	labels := map[string]string{"app.kubernetes.io/managed-by": "nodevirt"}
	var pols []*admissionregistrationv1.ValidatingAdmissionPolicy
	var binds []*admissionregistrationv1.ValidatingAdmissionPolicyBinding
	for _, p := range nodePolicies() {
		vars := append([]admissionregistrationv1.Variable{{Name: "nodeName", Expression: celNodeName}}, p.variables...)
		pols = append(pols, &admissionregistrationv1.ValidatingAdmissionPolicy{
			ObjectMeta: metav1.ObjectMeta{Name: p.name, Labels: labels},
			Spec: admissionregistrationv1.ValidatingAdmissionPolicySpec{
				FailurePolicy:    &fail,
				MatchConstraints: &admissionregistrationv1.MatchResources{ResourceRules: p.rules},
				MatchConditions:  []admissionregistrationv1.MatchCondition{{Name: "is-node-agent", Expression: celIsNode}},
				Variables:        vars,
				Validations:      p.validations,
			},
		})
		binds = append(binds, &admissionregistrationv1.ValidatingAdmissionPolicyBinding{
			ObjectMeta: metav1.ObjectMeta{Name: p.name, Labels: labels},
			Spec: admissionregistrationv1.ValidatingAdmissionPolicyBindingSpec{PolicyName: p.name,
				ValidationActions: []admissionregistrationv1.ValidationAction{admissionregistrationv1.Deny}},
		})
	}
	return pols, binds
}

// EnsureNodeRestriction installs the node restriction policies and their
// bindings, or brings drifted ones back.
func EnsureNodeRestriction(ctx context.Context, kube kubernetes.Interface) error {
	pols, binds := NodeRestrictionPolicies()
	api := kube.AdmissionregistrationV1()
	for _, w := range pols {
		cur, err := api.ValidatingAdmissionPolicies().Get(ctx, w.Name, metav1.GetOptions{})
		switch {
		case apierrors.IsNotFound(err):
			if _, err := api.ValidatingAdmissionPolicies().Create(ctx, w, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
				return fmt.Errorf("create validatingadmissionpolicy %s: %w", w.Name, err)
			}
		case err != nil:
			return fmt.Errorf("read validatingadmissionpolicy %s: %w", w.Name, err)
		case !samePolicy(cur.Spec, w.Spec):
			cur = cur.DeepCopy()
			cur.Spec = w.Spec
			if _, err := api.ValidatingAdmissionPolicies().Update(ctx, cur, metav1.UpdateOptions{}); err != nil {
				return fmt.Errorf("update validatingadmissionpolicy %s: %w", w.Name, err)
			}
		}
	}
	for _, w := range binds {
		cur, err := api.ValidatingAdmissionPolicyBindings().Get(ctx, w.Name, metav1.GetOptions{})
		switch {
		case apierrors.IsNotFound(err):
			if _, err := api.ValidatingAdmissionPolicyBindings().Create(ctx, w, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
				return fmt.Errorf("create validatingadmissionpolicybinding %s: %w", w.Name, err)
			}
		case err != nil:
			return fmt.Errorf("read validatingadmissionpolicybinding %s: %w", w.Name, err)
		case cur.Spec.PolicyName != w.Spec.PolicyName || cur.Spec.ParamRef != nil || cur.Spec.MatchResources != nil ||
			!equality.Semantic.DeepEqual(cur.Spec.ValidationActions, w.Spec.ValidationActions):
			cur = cur.DeepCopy()
			cur.Spec = w.Spec
			if _, err := api.ValidatingAdmissionPolicyBindings().Update(ctx, cur, metav1.UpdateOptions{}); err != nil {
				return fmt.Errorf("update validatingadmissionpolicybinding %s: %w", w.Name, err)
			}
		}
	}
	return nil
}

// samePolicy compares what nodevirt sets (the server defaults the rest).
func samePolicy(cur, want admissionregistrationv1.ValidatingAdmissionPolicySpec) bool {
	return equality.Semantic.DeepEqual(cur.Validations, want.Validations) &&
		equality.Semantic.DeepEqual(cur.Variables, want.Variables) &&
		equality.Semantic.DeepEqual(cur.MatchConditions, want.MatchConditions) &&
		cur.MatchConstraints != nil && len(cur.MatchConstraints.ResourceRules) == len(want.MatchConstraints.ResourceRules) &&
		equality.Semantic.DeepEqual(cur.MatchConstraints.ResourceRules, want.MatchConstraints.ResourceRules)
}
