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
	"github.com/nodevirt/nodevirt/clusterbrain/kit/httperr"
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
		mux.Handle(path, httperr.TextHandler(func(w http.ResponseWriter, r *http.Request) error { return s.proxyUpload(w, r, form) }))
	}
	return mux
}

// proxyUpload checks the token and the target and streams the body to the
// node holding the volume.
func (s *Server) proxyUpload(w http.ResponseWriter, r *http.Request, form bool) error {
	switch r.Method {
	case http.MethodPost, http.MethodPut, http.MethodHead:
	default:
		return httperr.MethodNotAllowed()
	}
	h := r.Header.Get("Authorization")
	if h == "" {
		return httperr.Unauthorized("missing upload token: send it as Authorization: Bearer <token>")
	}
	m := bearer.FindStringSubmatch(h)
	if m == nil {
		return httperr.Unauthorized("malformed authorization header: want Bearer <token>")
	}
	claims, err := s.signer.Verify(m[1])
	if err != nil {
		return httperr.With(http.StatusUnauthorized, err)
	}
	log := s.log.With("namespace", claims.Namespace, "pvc", claims.Name)
	node, err := s.uploadTarget(r.Context(), claims.Namespace, claims.Name)
	if err != nil {
		log.Info("upload refused", "code", httperr.Code(err), "err", err)
		return err
	}
	if r.Method == http.MethodHead {
		w.WriteHeader(http.StatusOK) // virtctl probes the async path this way
		return nil
	}
	endpoint, err := s.nodeEndpoint(r.Context(), node)
	if err != nil {
		return httperr.With(http.StatusServiceUnavailable, err)
	}
	target := endpoint + nodeUploadPath + url.PathEscape(claims.Namespace) + "/" + url.PathEscape(claims.Name) +
		"?form=" + strconv.FormatBool(form)
	out, err := http.NewRequestWithContext(r.Context(), http.MethodPost, target, r.Body)
	if err != nil {
		return err
	}
	out.ContentLength = r.ContentLength
	if ct := r.Header.Get("Content-Type"); ct != "" {
		out.Header.Set("Content-Type", ct)
	}
	start := time.Now()
	resp, err := s.toNode(node).Do(out)
	if err != nil {
		log.Warn("proxying upload failed", "node", node, "err", err)
		return httperr.BadGateway("upload to node %s failed: %v", node, err)
	}
	defer resp.Body.Close()
	log.Info("upload proxied", "node", node, "status", resp.StatusCode, "bytes", r.ContentLength,
		"took", time.Since(start).Round(time.Millisecond))
	if ct := resp.Header.Get("Content-Type"); ct != "" {
		w.Header().Set("Content-Type", ct)
	}
	w.WriteHeader(resp.StatusCode)
	_, _ = io.Copy(w, io.LimitReader(resp.Body, 1<<20))
	return nil
}

// uploadTarget checks that ns/name waits for an upload and returns the
// node holding it, waiting up to ReadyWait for the node to be ready; its
// errors say their HTTP status (httperr).
func (s *Server) uploadTarget(ctx context.Context, ns, name string) (string, error) {
	deadline := time.Now().Add(s.cfg.ReadyWait)
	for {
		pvc, err := s.kube.CoreV1().PersistentVolumeClaims(ns).Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return "", httperr.NotFound("pvc %s/%s not found", ns, name)
		}
		if err != nil {
			return "", httperr.Unavailable("pvc %s/%s: %w", ns, name, err)
		}
		if _, ok := pvc.Annotations[importstate.AnnUploadTarget]; !ok {
			return "", httperr.Forbidden("pvc %s/%s is not an upload target", ns, name)
		}
		rep := importstate.Read(pvc)
		switch {
		case rep.Phase == corev1.PodSucceeded:
			return "", httperr.Conflict("pvc %s/%s already finished uploading", ns, name)
		case rep.Phase == corev1.PodFailed:
			return "", httperr.Conflict("pvc %s/%s failed: %s", ns, name, rep.Message)
		case rep.Phase == corev1.PodRunning && rep.Ready && rep.Node != "":
			return rep.Node, nil
		}
		if time.Now().After(deadline) {
			return "", httperr.Unavailable("pvc %s/%s is not ready for an upload yet", ns, name)
		}
		select {
		case <-ctx.Done():
			return "", httperr.With(http.StatusServiceUnavailable, ctx.Err())
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
