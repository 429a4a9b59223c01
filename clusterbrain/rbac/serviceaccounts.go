package rbac

import (
	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	"slices"

	rbacv1 "k8s.io/api/rbac/v1"
)

// In-cluster identities. Installed by the manifests (clusterbrain/deploy),
// the daemons run as ServiceAccounts of InstallNamespace instead of users
// with hand-issued credentials:
//
//   - the brain as BrainServiceAccount, with the same rights as BrainGroup;
//   - each node agent as NodeAgentServiceAccount, with the token kubelet
//     mounts into its DaemonSet pod. The API server writes the node of the
//     pod a token is bound to into the request's user extra NodeNameExtra
//     (Kubernetes 1.32+, ServiceAccountTokenPodNodeInfo); that node is the
//     agent's identity wherever a certificate's system:node:<node> is
//     (node restriction policies, VMI admission, node certificates). A
//     token of that account not bound to a pod names no node and can write
//     none of a node's objects.
const (
	InstallNamespace    = "kubevirt-hyperconverged"
	BrainServiceAccount = "nodevirt-clusterbrain"
	// BrainDeployment is the brain's Deployment in the manifests (its
	// --deployment), which it may read and update to place itself.
	BrainDeployment         = "nodevirt-clusterbrain"
	NodeAgentServiceAccount = "nodevirt-nodeagent"
	NodeNameExtra           = "authentication.kubernetes.io/node-name"
)

// ServiceAccountUser is the user name of a ServiceAccount's tokens.
func ServiceAccountUser(namespace, name string) string {
	return "system:serviceaccount:" + namespace + ":" + name
}

var (
	brainAccountUser = ServiceAccountUser(InstallNamespace, BrainServiceAccount)
	nodeAccountUser  = ServiceAccountUser(InstallNamespace, NodeAgentServiceAccount)
)

// IsBrain says whether the user is a brain: BrainUser, in BrainGroup, or
// the brain's ServiceAccount.
func IsBrain(user string, groups []string) bool {
	return user == identity.BrainUser || user == brainAccountUser || slices.Contains(groups, identity.BrainGroup)
}

// NodeOf returns the node whose agent the user is: NodeUser(node) in
// NodesGroup, or the node agents' ServiceAccount with a pod-bound token of
// that node. ok is false for anyone else.
func NodeOf(user string, groups []string, extra map[string][]string) (node string, ok bool) {
	if n, isNode := cutNodeUser(user); isNode && slices.Contains(groups, identity.NodesGroup) {
		return n, true
	}
	if user == nodeAccountUser {
		if v := extra[NodeNameExtra]; len(v) == 1 && v[0] != "" {
			return v[0], true
		}
	}
	return "", false
}

// IsNodeAgent says whether the user is a node agent (of any node, or of
// none yet: the agents' ServiceAccount).
func IsNodeAgent(user string, groups []string) bool {
	return slices.Contains(groups, identity.NodesGroup) || user == nodeAccountUser
}

func cutNodeUser(user string) (string, bool) {
	if len(user) > len(identity.NodeUserPrefix) && user[:len(identity.NodeUserPrefix)] == identity.NodeUserPrefix {
		return user[len(identity.NodeUserPrefix):], true
	}
	return "", false
}

// serviceAccountSubject is the binding subject of an install's account.
func serviceAccountSubject(name string) rbacv1.Subject {
	return rbacv1.Subject{Kind: rbacv1.ServiceAccountKind, Namespace: InstallNamespace, Name: name}
}

// celNodeAccount is the CEL condition "the request is the node agents'
// ServiceAccount".
var celNodeAccount = "request.userInfo.username == '" + nodeAccountUser + "'"

// NodeLeaseRoleBinding lets the node agents keep their Leases in
// NodeLeaseNamespace.
func NodeLeaseRoleBinding() *rbacv1.RoleBinding {
	m, r, s := groupBinding(NodeAgentLeaseRole, NodeAgentLeaseRole, identity.NodesGroup)
	m.Namespace = NodeLeaseNamespace
	return &rbacv1.RoleBinding{ObjectMeta: m, RoleRef: r, Subjects: s}
}
