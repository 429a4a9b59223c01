package upload

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"regexp"
	"strconv"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
)

// The upload proxy's paths, as virtctl image-upload and CDI's clients use
// them. The async variants answer like the sync ones: the node streams the
// image as it arrives, so the upload ends when the import does.
const (
	PathUpload          = "/v1beta1/upload"
	PathUploadAsync     = "/v1beta1/upload-async"
	PathUploadForm      = "/v1beta1/upload-form"
	PathUploadFormAsync = "/v1beta1/upload-form-async"

	nodeUploadPath = "/v1beta1/claims/" // nodeagent/dvimport.UploadPath
)

var bearer = regexp.MustCompile(`(?i)^Bearer\s+([A-Za-z0-9\-._~+/]+=*)$`)

func (s *Server) proxyHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "OK") })
	for path, form := range map[string]bool{PathUpload: false, PathUploadAsync: false, PathUploadForm: true, PathUploadFormAsync: true} {
		mux.HandleFunc(path, func(w http.ResponseWriter, r *http.Request) { s.proxyUpload(w, r, form) })
	}
	return mux
}

// proxyUpload checks the token and the target and streams the body to the
// node holding the volume.
func (s *Server) proxyUpload(w http.ResponseWriter, r *http.Request, form bool) {
	switch r.Method {
	case http.MethodPost, http.MethodPut, http.MethodHead:
	default:
		http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
		return
	}
	h := r.Header.Get("Authorization")
	if h == "" {
		http.Error(w, "missing upload token: send it as Authorization: Bearer <token>", http.StatusUnauthorized)
		return
	}
	m := bearer.FindStringSubmatch(h)
	if m == nil {
		http.Error(w, "malformed authorization header: want Bearer <token>", http.StatusUnauthorized)
		return
	}
	claims, err := s.signer.Verify(m[1])
	if err != nil {
		http.Error(w, err.Error(), http.StatusUnauthorized)
		return
	}
	log := s.log.With("namespace", claims.Namespace, "pvc", claims.Name)
	node, code, err := s.uploadTarget(r.Context(), claims.Namespace, claims.Name)
	if err != nil {
		log.Info("upload refused", "code", code, "err", err)
		http.Error(w, err.Error(), code)
		return
	}
	if r.Method == http.MethodHead {
		w.WriteHeader(http.StatusOK) // virtctl probes the async path this way
		return
	}
	endpoint, err := s.nodeEndpoint(r.Context(), node)
	if err != nil {
		http.Error(w, err.Error(), http.StatusServiceUnavailable)
		return
	}
	target := endpoint + nodeUploadPath + url.PathEscape(claims.Namespace) + "/" + url.PathEscape(claims.Name) +
		"?form=" + strconv.FormatBool(form)
	out, err := http.NewRequestWithContext(r.Context(), http.MethodPost, target, r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	out.ContentLength = r.ContentLength
	if ct := r.Header.Get("Content-Type"); ct != "" {
		out.Header.Set("Content-Type", ct)
	}
	start := time.Now()
	resp, err := s.toNode(node).Do(out)
	if err != nil {
		log.Warn("proxying upload failed", "node", node, "err", err)
		http.Error(w, fmt.Sprintf("upload to node %s failed: %v", node, err), http.StatusBadGateway)
		return
	}
	defer resp.Body.Close()
	log.Info("upload proxied", "node", node, "status", resp.StatusCode, "bytes", r.ContentLength,
		"took", time.Since(start).Round(time.Millisecond))
	if ct := resp.Header.Get("Content-Type"); ct != "" {
		w.Header().Set("Content-Type", ct)
	}
	w.WriteHeader(resp.StatusCode)
	_, _ = io.Copy(w, io.LimitReader(resp.Body, 1<<20))
}

// uploadTarget checks that ns/name waits for an upload and returns the
// node holding it, waiting up to ReadyWait for the node to be ready.
func (s *Server) uploadTarget(ctx context.Context, ns, name string) (string, int, error) {
	deadline := time.Now().Add(s.cfg.ReadyWait)
	for {
		pvc, err := s.kube.CoreV1().PersistentVolumeClaims(ns).Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return "", http.StatusNotFound, fmt.Errorf("pvc %s/%s not found", ns, name)
		}
		if err != nil {
			return "", http.StatusServiceUnavailable, fmt.Errorf("pvc %s/%s: %w", ns, name, err)
		}
		if _, ok := pvc.Annotations[importstate.AnnUploadTarget]; !ok {
			return "", http.StatusForbidden, fmt.Errorf("pvc %s/%s is not an upload target", ns, name)
		}
		rep := importstate.Read(pvc)
		switch {
		case rep.Phase == corev1.PodSucceeded:
			return "", http.StatusConflict, fmt.Errorf("pvc %s/%s already finished uploading", ns, name)
		case rep.Phase == corev1.PodFailed:
			return "", http.StatusConflict, fmt.Errorf("pvc %s/%s failed: %s", ns, name, rep.Message)
		case rep.Phase == corev1.PodRunning && rep.Ready && rep.Node != "":
			return rep.Node, 0, nil
		}
		if time.Now().After(deadline) {
			return "", http.StatusServiceUnavailable, fmt.Errorf("pvc %s/%s is not ready for an upload yet", ns, name)
		}
		select {
		case <-ctx.Done():
			return "", http.StatusServiceUnavailable, ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// nodeEndpoint is the upload URL a nodeagent published on its Node.
func (s *Server) nodeEndpoint(ctx context.Context, node string) (string, error) {
	n, err := s.kube.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
	if err != nil {
		return "", fmt.Errorf("node %s: %w", node, err)
	}
	ep := n.Annotations[importstate.NodeUploadEndpoint]
	if ep == "" {
		return "", errors.New("node " + node + " publishes no upload endpoint")
	}
	return ep, nil
}
