package dvimport

import (
	"context"
	"crypto/tls"
	"fmt"
	"net/http"
	"os"
	"strings"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"

	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
	"github.com/nodevirt/nodevirt/clusterbrain/api/nodereads"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/httperr"
	"github.com/nodevirt/nodevirt/nodeagent/importer"
)

// ExportPath is the path of a volume's disk on the node's upload endpoint,
// for clones across nodes: GET ExportPath + "<namespace>/<claim>" answers
// the disk of that claim's volume (HTTP ranges honoured). Only a node whose
// certificate names it (identity.NodeUserPrefix + node) and that holds a claim
// asking to clone that volume may read it.
const ExportPath = "/v1beta1/exports/"

// export serves the disk of the claim ns/name to the node requester.
func (s *uploadServer) export(w http.ResponseWriter, r *http.Request, requester, ns, name string) error {
	a := s.a
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		return httperr.MethodNotAllowed()
	}
	if !a.cloneWanted(r.Context(), ns, name, requester) {
		return httperr.Forbidden("no claim on node %s clones pvc %s/%s", requester, ns, name)
	}
	disk, err := a.localDisk(ns, name)
	if err != nil {
		return httperr.With(http.StatusNotFound, err)
	}
	f, err := os.Open(disk)
	if err != nil {
		return httperr.NotFound("pvc %s/%s: %v", ns, name, err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return httperr.With(http.StatusInternalServerError, err)
	}
	a.log.Info("exporting volume for a clone", "namespace", ns, "pvc", name, "to", requester, "bytes", fi.Size())
	w.Header().Set("Content-Type", "application/octet-stream")
	http.ServeContent(w, r, "disk.img", fi.ModTime(), f)
	return nil
}

// cloneWanted says whether the brain asked a claim whose volume is on node
// to be cloned from the claim ns/name (its clone request, not the claim's
// annotations, which the claim's owner writes).
func (a *Agent) cloneWanted(ctx context.Context, ns, name, node string) bool {
	claims, err := a.pvcs.List(labels.Everything())
	if err != nil {
		return false
	}
	for _, c := range claims {
		if c.Annotations[importstate.AnnSource] != importstate.SourcePVC || c.DeletionTimestamp != nil || a.claimNode(c) != node {
			continue
		}
		req, err := a.cloneRequest(ctx, c)
		if err == nil && req.SourceKind == importstate.CloneSourceClaim && req.SourceNamespace == ns && req.SourceName == name {
			return true
		}
	}
	return false
}

// cloneRequest is the brain's clone request for the claim pvc, read from
// the brain's namespace.
func (a *Agent) cloneRequest(ctx context.Context, pvc *corev1.PersistentVolumeClaim) (importstate.CloneRequest, error) {
	name := importstate.CloneRequestName(pvc.UID)
	cm, err := a.cfg.Reads.BrainConfigMap(ctx, nodereads.Ref{Resource: nodereads.Claims, Namespace: pvc.Namespace, Name: pvc.Name}, name)
	if apierrors.IsNotFound(err) {
		// The brain writes it just after the claim: retried.
		return importstate.CloneRequest{}, &importer.Error{Reason: importer.ReasonSourceUnreachable,
			Err: fmt.Errorf("pvc %s/%s: the brain has made no clone request (%s/%s)", pvc.Namespace, pvc.Name, a.cfg.BrainNamespace, name)}
	}
	if err != nil {
		return importstate.CloneRequest{}, &importer.Error{Reason: importer.ReasonSourceUnreachable, Err: fmt.Errorf("clone request of pvc %s/%s: %w", pvc.Namespace, pvc.Name, err)}
	}
	req, err := importstate.ReadCloneRequest(cm, pvc)
	if err != nil {
		return importstate.CloneRequest{}, &importer.Error{Reason: importer.ReasonInvalidRequest, Err: err}
	}
	return req, nil
}

// claimNode is the node of a claim's volume: its PV's, else its selected
// node.
func (a *Agent) claimNode(c *corev1.PersistentVolumeClaim) string {
	if c.Spec.VolumeName != "" {
		if pv, err := a.pvs.Get(c.Spec.VolumeName); err == nil {
			if n := importstate.PVNode(pv); n != "" {
				return n
			}
		}
	}
	return c.Annotations[importstate.AnnSelectedNode]
}

// localDisk is the disk of the bound claim ns/name, if its volume is on
// this node.
func (a *Agent) localDisk(ns, name string) (string, error) {
	c, err := a.pvcs.PersistentVolumeClaims(ns).Get(name)
	if err != nil {
		return "", fmt.Errorf("pvc %s/%s: %w", ns, name, err)
	}
	if c.Status.Phase != corev1.ClaimBound {
		return "", fmt.Errorf("pvc %s/%s is not bound", ns, name)
	}
	pv, err := a.pvs.Get(c.Spec.VolumeName)
	if err != nil || pv.Spec.CSI == nil {
		return "", fmt.Errorf("pv %s of pvc %s/%s: not a csi volume (%v)", c.Spec.VolumeName, ns, name, err)
	}
	if n := importstate.PVNode(pv); n != "" && n != a.cfg.NodeName {
		return "", fmt.Errorf("pvc %s/%s is on node %s, not %s", ns, name, n, a.cfg.NodeName)
	}
	disk, _, _, err := a.cfg.Resolver.VolumeDisk(pv.Spec.CSI.VolumeHandle)
	return disk, err
}

// cloneFromPeer streams the disk of the claim ns/name from node, which
// holds its volume, into t.
func (a *Agent) cloneFromPeer(ctx context.Context, t *target, node, ns, name string, onProgress func(importer.Progress)) (importer.Result, error) {
	n, err := a.kube.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
	if err != nil {
		return importer.Result{}, &importer.Error{Reason: importer.ReasonSourceUnreachable, Err: fmt.Errorf("clone source node %s: %w", node, err)}
	}
	endpoint := n.Annotations[importstate.NodeUploadEndpoint]
	if endpoint == "" {
		return importer.Result{}, &importer.Error{Reason: importer.ReasonSourceUnreachable,
			Err: fmt.Errorf("clone source node %s publishes no volume endpoint (%s)", node, importstate.NodeUploadEndpoint)}
	}
	tlsCfg, err := a.peerTLS(ctx)
	if err != nil {
		return importer.Result{}, &importer.Error{Reason: importer.ReasonSourceUnreachable, Err: fmt.Errorf("clone from node %s: %w", node, err)}
	}
	tlsCfg.ServerName = node // the source's own certificate, not any node's
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, endpoint+ExportPath+ns+"/"+name, nil)
	if err != nil {
		return importer.Result{}, &importer.Error{Reason: importer.ReasonInvalidRequest, Err: err}
	}
	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: tlsCfg, DisableCompression: true}}
	defer hc.CloseIdleConnections()
	resp, err := hc.Do(req)
	if err != nil {
		return importer.Result{}, &importer.Error{Reason: importer.ReasonSourceUnreachable, Err: fmt.Errorf("clone from node %s: %w", node, err)}
	}
	defer resp.Body.Close()
	switch {
	case resp.StatusCode == http.StatusForbidden:
		return importer.Result{}, &importer.Error{Reason: importer.ReasonUnauthorized, Err: fmt.Errorf("clone from node %s: %s", node, errorBody(resp))}
	case resp.StatusCode == http.StatusNotFound:
		return importer.Result{}, &importer.Error{Reason: importer.ReasonSourceNotFound, Err: fmt.Errorf("clone from node %s: %s", node, errorBody(resp))}
	case resp.StatusCode != http.StatusOK:
		return importer.Result{}, &importer.Error{Reason: importer.ReasonSourceUnreachable, Err: fmt.Errorf("clone from node %s: %s", node, errorBody(resp))}
	}
	t.log(a.log).Info("cloning across nodes", "from", node, "source", ns+"/"+name, "bytes", resp.ContentLength)
	r := baseRequest(t)
	r.Raw = true // the guest's bytes, never interpreted as an image
	r.Progress = onProgress
	return importer.ImportFromReader(ctx, resp.Body, resp.ContentLength, r)
}

// errorBody is the first line of an error answer.
func errorBody(resp *http.Response) string {
	buf := make([]byte, 512)
	n, _ := resp.Body.Read(buf)
	msg, _, _ := strings.Cut(strings.TrimSpace(string(buf[:n])), "\n")
	return fmt.Sprintf("%s: %s", resp.Status, msg)
}

// peerTLS is the client configuration for other nodes' endpoints (the
// caller sets ServerName): the configured one, else a client certificate
// for this node minted from the node CA, trusting that CA for the peers'
// serving certificates.
func (a *Agent) peerTLS(ctx context.Context) (*tls.Config, error) {
	if a.cfg.PeerTLS != nil {
		return a.cfg.PeerTLS(ctx)
	}
	a.peerMu.Lock()
	defer a.peerMu.Unlock()
	if a.peer != nil {
		return a.peer.Clone(), nil
	}
	ca, err := loadUploadCA(ctx, a.kube, a.cfg.BrainNamespace)
	if err != nil {
		return nil, fmt.Errorf("node ca: %w", err)
	}
	cert, err := ca.Issue(identity.NodeUserPrefix+a.cfg.NodeName, nil, nil, true)
	if err != nil {
		return nil, err
	}
	a.peer = &tls.Config{MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{cert}, RootCAs: ca.Pool()}
	return a.peer.Clone(), nil
}
