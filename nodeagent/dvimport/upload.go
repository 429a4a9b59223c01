package dvimport

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"mime"
	"net"
	"net/http"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/httperr"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/uploadtls"
	"github.com/nodevirt/nodevirt/nodeagent/importer"
	"github.com/nodevirt/nodevirt/nodeagent/kube"
)

// UploadPath is the path of the node's upload endpoint:
// POST UploadPath + "<namespace>/<claim>?form=true|false". The body is the
// image, or a multipart form with the image in the field "file".
const UploadPath = "/v1beta1/claims/"

// uploadServer is the node's upload endpoint: HTTPS, accepting uploads
// only from the brain's upload proxy (client certificate from the upload
// CA) and volume reads for clones only from other nodes (see ExportPath).
type uploadServer struct {
	a        *Agent
	listener net.Listener
	srv      *http.Server
}

// start listens (with the configured TLS, else a serving certificate
// minted from the node CA, waiting for the brain to create it) and
// publishes the endpoint on the Node.
func (s *uploadServer) start(ctx context.Context) error {
	cfg := s.a.cfg
	ln, err := net.Listen("tcp", cfg.UploadAddr)
	if err != nil {
		return fmt.Errorf("upload endpoint: %w", err)
	}
	ip, err := s.advertiseIP(ln)
	if err != nil {
		ln.Close()
		return err
	}
	tlsCfg := cfg.UploadTLS
	if tlsCfg == nil {
		if tlsCfg, err = s.mintTLS(ctx, ip); err != nil {
			ln.Close()
			return err
		}
	}
	s.listener = tls.NewListener(ln, cfg.UploadTLSProfile.Server(tlsCfg))
	s.srv = &http.Server{Handler: s, ReadHeaderTimeout: 30 * time.Second, IdleTimeout: 2 * time.Minute, ErrorLog: nil}
	_, port, _ := net.SplitHostPort(ln.Addr().String())
	url := "https://" + net.JoinHostPort(ip.String(), port)
	s.a.log.Info("upload endpoint listening", "url", url)
	go s.publish(ctx, url)
	return nil
}

// mintTLS loads the node CA (waiting for the brain to create it) and mints
// the endpoint's serving certificate for this node's name and ip.
func (s *uploadServer) mintTLS(ctx context.Context, ip net.IP) (*tls.Config, error) {
	cfg := s.a.cfg
	var ca *uploadtls.CA
	err := waitFor(ctx, func(ctx context.Context) (bool, error) {
		var err error
		ca, err = loadUploadCA(ctx, s.a.kube, cfg.BrainNamespace)
		if apierrors.IsNotFound(err) {
			s.a.log.Info("waiting for the upload ca", "secret", cfg.BrainNamespace+"/"+identity.UploadCASecretName)
			return false, nil
		}
		return err == nil, err
	})
	if err != nil {
		return nil, fmt.Errorf("upload ca: %w", err)
	}
	cert, err := ca.Issue(cfg.NodeName, []string{identity.UploadServerName, cfg.NodeName}, []net.IP{ip, net.IPv4(127, 0, 0, 1)}, false)
	if err != nil {
		return nil, err
	}
	return &tls.Config{
		MinVersion:   tls.VersionTLS12,
		Certificates: []tls.Certificate{cert},
		ClientAuth:   tls.RequireAndVerifyClientCert,
		ClientCAs:    ca.Pool(),
	}, nil
}

// publish writes the endpoint's URL on this node's Node object, retrying
// while the Node does not exist yet; the brain places uploads only on
// nodes that published one.
func (s *uploadServer) publish(ctx context.Context, url string) {
	name := s.a.cfg.NodeName
	patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:%q}}}`, importstate.NodeUploadEndpoint, url)
	_ = waitFor(ctx, func(ctx context.Context) (bool, error) {
		_, err := s.a.kube.CoreV1().Nodes().Patch(ctx, name, types.MergePatchType, []byte(patch), metav1.PatchOptions{})
		if err != nil {
			s.a.log.Warn("cannot publish the upload endpoint yet", "err", err)
			return false, nil
		}
		return true, nil
	})
}

func (s *uploadServer) advertiseIP(ln net.Listener) (net.IP, error) {
	if s.a.cfg.UploadAdvertiseIP != "" {
		ip := net.ParseIP(s.a.cfg.UploadAdvertiseIP)
		if ip == nil {
			return nil, fmt.Errorf("upload advertise ip %q is not an ip", s.a.cfg.UploadAdvertiseIP)
		}
		return ip, nil
	}
	if tcp, ok := ln.Addr().(*net.TCPAddr); ok && !tcp.IP.IsUnspecified() {
		return tcp.IP, nil
	}
	return uploadtls.HostIP()
}

func (s *uploadServer) serve(ctx context.Context) error {
	go func() {
		<-ctx.Done()
		shut, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = s.srv.Shutdown(shut)
	}()
	if err := s.srv.Serve(s.listener); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

func (s *uploadServer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	httperr.TextHandler(s.route).ServeHTTP(w, r)
}

// route answers an export to a node or an upload from the proxy.
func (s *uploadServer) route(w http.ResponseWriter, r *http.Request) error {
	cn := ""
	if r.TLS != nil && len(r.TLS.VerifiedChains) > 0 {
		cn = r.TLS.VerifiedChains[0][0].Subject.CommonName
	}
	if rest, ok := strings.CutPrefix(r.URL.Path, ExportPath); ok {
		node, isNode := strings.CutPrefix(cn, identity.NodeUserPrefix)
		ns, name, ok := strings.Cut(rest, "/")
		switch {
		case !isNode || node == "":
			return httperr.Forbidden("only nodes may read volumes")
		case !ok || ns == "" || name == "" || strings.Contains(name, "/"):
			return errPageNotFound
		}
		return s.export(w, r, node, ns, name)
	}
	if cn != identity.UploadProxyClientName {
		return httperr.Forbidden("only the upload proxy may upload")
	}
	rest, ok := strings.CutPrefix(r.URL.Path, UploadPath)
	ns, name, ok2 := strings.Cut(rest, "/")
	if !ok || !ok2 || ns == "" || name == "" || strings.Contains(name, "/") {
		return errPageNotFound
	}
	if r.Method != http.MethodPost && r.Method != http.MethodPut {
		return httperr.MethodNotAllowed()
	}
	if err := s.upload(r, ns, name, r.URL.Query().Get("form") == "true"); err != nil {
		return err
	}
	w.WriteHeader(http.StatusOK)
	return nil
}

// errPageNotFound answers a path the server does not serve, as
// http.NotFound does.
var errPageNotFound = httperr.NotFound("404 page not found")

// upload imports the request's body into the claim ns/name; its errors
// say their HTTP status (httperr).
func (s *uploadServer) upload(r *http.Request, ns, name string, form bool) error {
	a := s.a
	key := ns + "/" + name
	t, gone, err := a.targetOf(key)
	if gone {
		return httperr.NotFound("no datavolume or upload claim %s", key)
	}
	if err != nil {
		return httperr.With(http.StatusServiceUnavailable, err)
	}
	if t == nil || t.kind != importstate.SourceUpload {
		return httperr.NotFound("pvc %s is not an upload target on node %s", key, a.cfg.NodeName)
	}
	rep := importstate.Read(t.pvc)
	switch {
	case rep.Phase == corev1.PodSucceeded:
		return httperr.Conflict("pvc %s already holds its upload", key)
	case rep.Phase != corev1.PodRunning || !rep.Ready:
		return httperr.Unavailable("pvc %s is not ready for an upload", key)
	}
	j, ctx := a.claimJob(key, t.pvc.UID)
	if j == nil {
		return httperr.Conflict("an upload into pvc %s is already running", key)
	}
	defer a.releaseJob(key, j)
	stopWatch := context.AfterFunc(r.Context(), func() { j.cancel(errors.New("client went away")) })
	defer stopWatch()

	body, size := io.Reader(r.Body), r.ContentLength
	if form {
		part, err := filePart(r)
		if err != nil {
			return httperr.With(http.StatusBadRequest, err)
		}
		body, size = part, -1
	}
	log := t.log(a.log)
	log.Info("upload starting", "disk", t.disk, "capacity", t.capacity, "size", size)
	stop := a.reportProgress(t, j)
	req := baseRequest(t)
	req.Progress = func(p importer.Progress) {
		j.progress.Store(p.String())
		t.observe(p)
	}
	start := time.Now()
	res, err := importer.ImportFromReader(ctx, body, size, req)
	stop()
	t.finished(start, res, err)
	t.forget()
	if err != nil {
		reason := importer.ReasonOf(err)
		log.Warn("upload failed", "reason", reason, "err", err)
		// The target stays ready: the user may upload again.
		a.reportHard(context.Background(), t, importstate.Report{Phase: corev1.PodRunning, Ready: true, Restarts: rep.Restarts,
			Node: a.cfg.NodeName, Reason: string(reason), Message: err.Error()})
		if permanent[reason] {
			return httperr.With(http.StatusBadRequest, err)
		}
		return httperr.With(http.StatusInternalServerError, err)
	}
	log.Info("upload done", "format", res.Format, "virtualSize", res.VirtualSize, "bytes", res.SourceBytes,
		"took", time.Since(start).Round(time.Millisecond))
	a.reportHard(context.Background(), t, importstate.Report{Phase: corev1.PodSucceeded, Restarts: rep.Restarts,
		Progress: "100.00%", Node: a.cfg.NodeName, Reason: "Completed", Message: "Upload Complete"})
	return nil
}

// filePart is the "file" field of a multipart upload.
func filePart(r *http.Request) (io.Reader, error) {
	if mt, _, err := mime.ParseMediaType(r.Header.Get("Content-Type")); err != nil || !strings.HasPrefix(mt, "multipart/") {
		return nil, errors.New("form upload without a multipart body")
	}
	mr, err := r.MultipartReader()
	if err != nil {
		return nil, fmt.Errorf("form upload: %w", err)
	}
	for {
		p, err := mr.NextPart()
		if err != nil {
			return nil, errors.New("form upload without a file field")
		}
		if p.FormName() == "file" {
			return p, nil
		}
	}
}

// waitFor polls cond every second until it is done or fails.
func waitFor(ctx context.Context, cond func(context.Context) (bool, error)) error {
	for {
		ok, err := cond(ctx)
		if err != nil || ok {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Second):
		}
	}
}

// loadUploadCA reads the brain's upload CA (uploadtls.LoadCA through the
// node's narrow client); the error is a NotFound API error while the brain
// has not created it.
func loadUploadCA(ctx context.Context, kc kube.Interface, namespace string) (*uploadtls.CA, error) {
	s, err := kc.CoreV1().Secrets(namespace).Get(ctx, identity.UploadCASecretName, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	return uploadtls.ParseCA(s.Data[corev1.TLSCertKey], s.Data[corev1.TLSPrivateKeyKey])
}
