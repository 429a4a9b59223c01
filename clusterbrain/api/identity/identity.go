// Package identity names who is who between nodevirt's daemons: the user
// and group a node agent or a brain authenticates as, the signer of node
// certificates, the TLS names the brain's clients verify on a node and the
// ones a node accepts from the brain, and where a node publishes the
// address of its server. Both daemons compile these names in, so a change
// here is a change of the wire contract between them.
//
// Who uses which name:
//
//   - A node agent authenticates as NodeUser(<node name>) in NodesGroup;
//     with a client certificate CN is the user and O the group. It asks for
//     its certificate with a CertificateSigningRequest for NodeSignerName,
//     which the brain's signer (clusterbrain/nodecerts) approves for the
//     node's own name plus NodeSharedNames.
//   - A brain authenticates as any user in BrainGroup (BrainUser by
//     convention).
//   - The node agent's subresource server (console, VNC, guest agent)
//     publishes host:port in the Node annotation NodeAddressAnnotation,
//     serves a certificate carrying HandlerServerName and accepts only the
//     client certificate named SubresourcesClientName.
//   - The node agent's upload receiver serves a certificate carrying
//     UploadServerName, issued from the upload CA kept in the brain
//     namespace's Secret UploadCASecretName, and accepts the upload proxy
//     (UploadProxyClientName) and other nodes' agents
//     (NodeUserPrefix + <node>).
package identity

// The daemons' users and groups.
const (
	NodeUserPrefix = "system:node:"
	NodesGroup     = "nodevirt:nodes"
	BrainUser      = "nodevirt:clusterbrain"
	BrainGroup     = "nodevirt:clusterbrains"
)

// NodeUser is the user name of node's agent.
func NodeUser(node string) string { return NodeUserPrefix + node }

// NodeSignerName is the signerName of node certificate requests.
const NodeSignerName = "nodevirt.io/node"

// The names of the node agent's subresource server.
const (
	// NodeAddressAnnotation on a Node holds host:port of its nodeagent's
	// console server; without it the Node's InternalIP and HandlerPort
	// are used.
	NodeAddressAnnotation = "nodevirt.io/console-server"
	// HandlerPort is the console server's default port (virt-handler's).
	HandlerPort = 8186
	// HandlerServerName is the DNS name the nodeagents' console server
	// certificates carry and the brain verifies.
	HandlerServerName = "nodevirt-handler"
	// SubresourcesClientName is the common name of the brain's client
	// certificate; nodeagents accept only it.
	SubresourcesClientName = "nodevirt-subresources"
)

// The names of the node agent's upload receiver.
const (
	// UploadCASecretName is the Secret (type kubernetes.io/tls) holding
	// the upload CA.
	UploadCASecretName = "nodevirt-upload-ca"
	// UploadProxyClientName is the common name of the upload proxy's
	// client certificate; nodeagents accept no other proxy.
	UploadProxyClientName = "nodevirt-upload-proxy"
	// UploadServerName is the DNS name every nodeagent's upload
	// certificate carries and the proxy verifies.
	UploadServerName = "nodevirt-dvimport"
)

// NodeSharedNames are the DNS names the brain's clients verify today on
// every node (console: HandlerServerName, uploads: UploadServerName); a
// node certificate may carry them besides the node's own name.
var NodeSharedNames = []string{HandlerServerName, UploadServerName}
