package dvimport

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
	"github.com/nodevirt/nodevirt/clusterbrain/api/nodereads"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/reach"
	"github.com/nodevirt/nodevirt/nodeagent/importer"
)

// job is the running work of one DataVolume.
type job struct {
	pvcUID   types.UID
	cancel   context.CancelCauseFunc
	done     chan struct{}
	progress atomic.Value // string, "NN.NN%"
}

func (a *Agent) job(key string) *job {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.jobs[key]
}

// claimJob registers a job for key unless one runs; it returns nil then.
func (a *Agent) claimJob(key string, uid types.UID) (*job, context.Context) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.jobs[key] != nil {
		return nil, nil
	}
	ctx, cancel := context.WithCancelCause(context.Background())
	j := &job{pvcUID: uid, cancel: cancel, done: make(chan struct{})}
	a.jobs[key] = j
	return j, ctx
}

func (a *Agent) releaseJob(key string, j *job) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.jobs[key] == j {
		delete(a.jobs, key)
	}
	close(j.done)
}

// cancel stops the job of key, if any.
func (a *Agent) cancel(key, why string) {
	if j := a.job(key); j != nil {
		a.log.Info("canceling", "datavolume", key, "why", why)
		j.cancel(errors.New(why))
	}
}

// waitJobs cancels every job and waits for them (shutdown).
func (a *Agent) waitJobs() {
	a.mu.Lock()
	jobs := make([]*job, 0, len(a.jobs))
	for _, j := range a.jobs {
		j.cancel(errors.New("agent stopping"))
		jobs = append(jobs, j)
	}
	a.mu.Unlock()
	for _, j := range jobs {
		<-j.done
	}
}

// permanent reasons fail the DataVolume at once: trying again reads the
// same bad source.
var permanent = map[importer.Reason]bool{
	importer.ReasonInvalidRequest: true, importer.ReasonSourceNotFound: true, importer.ReasonUnauthorized: true,
	importer.ReasonChecksumMismatch: true, importer.ReasonTruncated: true, importer.ReasonInvalidImage: true,
	importer.ReasonUnsupportedImage: true, importer.ReasonTooLarge: true, importer.ReasonScratchRequired: true,
	importer.ReasonNetworkNotAllowed: true,
}

// startJob runs the import of t in the background unless one runs.
func (a *Agent) startJob(t *target, rep importstate.Report) {
	j, ctx := a.claimJob(t.key, t.pvc.UID)
	if j == nil {
		return
	}
	go func() {
		defer a.releaseJob(t.key, j)
		a.runJob(ctx, t, j, rep)
	}()
}

// runJob makes attempts until one succeeds, one fails for good, the
// attempts run out or ctx ends.
func (a *Agent) runJob(ctx context.Context, t *target, j *job, prev importstate.Report) {
	log := t.log(a.log)
	attempt := prev.Restarts
	if prev.Phase == corev1.PodRunning {
		attempt++ // an attempt was cut short (agent restart)
	}
	delay := a.cfg.RetryDelay
	for {
		run := importstate.Report{Phase: corev1.PodRunning, Restarts: attempt, Progress: "0.00%", Node: a.cfg.NodeName}
		if !a.reportHard(ctx, t, run) {
			return
		}
		start := time.Now()
		log.Info("import starting", "source", t.kind, "disk", t.disk, "capacity", t.capacity, "attempt", attempt)
		res, err := a.attempt(ctx, t, j)
		t.finished(start, res, err)
		if ctx.Err() != nil || err == nil {
			t.forget() // as CDI's importer pod goes, so does its progress
		}
		if ctx.Err() != nil {
			log.Info("import canceled", "why", context.Cause(ctx))
			return
		}
		if err == nil {
			log.Info("import done", "format", res.Format, "virtualSize", res.VirtualSize, "bytes", res.SourceBytes,
				"streamed", res.Streamed, "took", time.Since(start).Round(time.Millisecond))
			a.reportHard(ctx, t, importstate.Report{Phase: corev1.PodSucceeded, Restarts: attempt, Progress: "100.00%",
				Node: a.cfg.NodeName, Reason: "Completed", Message: "Import Complete"})
			return
		}
		reason := importer.ReasonOf(err)
		log.Warn("import failed", "reason", reason, "err", err, "attempt", attempt)
		if permanent[reason] || a.cfg.MaxRestarts < 0 || int(attempt) >= a.cfg.MaxRestarts {
			a.reportHard(ctx, t, importstate.Report{Phase: corev1.PodFailed, Restarts: attempt, Node: a.cfg.NodeName,
				Reason: string(reason), Message: err.Error()})
			t.forget()
			return
		}
		attempt++
		if !a.reportHard(ctx, t, importstate.Report{Phase: corev1.PodRunning, Restarts: attempt, Node: a.cfg.NodeName,
			Reason: string(reason), Message: err.Error()}) {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(delay):
		}
		delay = min(2*delay, time.Minute)
	}
}

// reportHard retries a report until it lands or ctx ends.
func (a *Agent) reportHard(ctx context.Context, t *target, r importstate.Report) bool {
	err := wait.ExponentialBackoffWithContext(ctx, wait.Backoff{Duration: 200 * time.Millisecond, Factor: 2, Steps: 8, Cap: 10 * time.Second},
		func(ctx context.Context) (bool, error) {
			if err := a.report(ctx, t, r); err != nil {
				a.log.Warn("report failed", "datavolume", t.key, "err", err)
				return false, nil
			}
			return true, nil
		})
	return err == nil
}

// attempt runs one import with progress reports.
func (a *Agent) attempt(ctx context.Context, t *target, j *job) (importer.Result, error) {
	stop := a.reportProgress(t, j)
	defer stop()
	onProgress := func(p importer.Progress) {
		j.progress.Store(p.String())
		t.observe(p)
	}
	if !t.isBlock {
		// An attempt cut short (agent restart) left its temporary files.
		if err := removeLeftovers(t.disk); err != nil {
			t.log(a.log).Warn("removing leftovers of an interrupted import", "err", err)
		}
	}
	if t.kind == importstate.SourcePVC {
		return a.clone(ctx, t, onProgress)
	}
	req, err := a.request(ctx, t)
	if err != nil {
		return importer.Result{}, err
	}
	req.Progress = onProgress
	return importer.Import(ctx, req)
}

// reportProgress writes the job's progress to the PVC every interval while
// it changes; the returned func stops it and waits.
func (a *Agent) reportProgress(t *target, j *job) func() {
	j.progress.Store("0.00%")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		last := "0.00%"
		tick := time.NewTicker(a.cfg.ProgressInterval)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			p := j.progress.Load().(string)
			if p == last {
				continue
			}
			_, err := a.kube.CoreV1().PersistentVolumeClaims(t.pvc.Namespace).Patch(ctx, t.pvc.Name, types.MergePatchType,
				importstate.ProgressPatch(t.pvc.UID, p), metav1.PatchOptions{})
			if err == nil {
				last = p
			}
		}
	}()
	return func() { cancel(); <-done }
}

// baseRequest is the destination part of every import into t.
func baseRequest(t *target) importer.Request {
	return importer.Request{Dest: t.disk, DestIsBlock: t.isBlock, Capacity: t.capacity, ExpandToCapacity: !t.isBlock}
}

// request builds the import of an http, registry or blank source, reading
// the Secrets and ConfigMaps the source names and the CDI configuration.
func (a *Agent) request(ctx context.Context, t *target) (importer.Request, error) {
	req := baseRequest(t)
	req.Logger = t.log(a.log)
	src := t.dv.Spec.Source
	if t.dv.Spec.ContentType == cdiv1.DataVolumeArchive {
		return req, invalid("content type archive is not supported")
	}
	ref := nodereads.Ref{Resource: nodereads.DataVolumes, Namespace: t.dv.Namespace, Name: t.dv.Name}
	switch {
	case t.kind == importstate.SourceBlank:
		req.Blank = true
	case src != nil && src.HTTP != nil:
		h := src.HTTP
		if h.InsecureSkipVerify != nil && *h.InsecureSkipVerify {
			return req, invalid("insecureSkipVerify is not supported: give the server's CA in certConfigMap")
		}
		hs := &importer.HTTPSource{URL: h.URL, ExtraHeaders: h.ExtraHeaders, Checksum: h.Checksum,
			Retries: a.cfg.HTTPRetries, RetryDelay: a.cfg.HTTPRetryDelay}
		var err error
		if hs.CACertPEM, err = a.configMapPEM(ctx, ref, h.CertConfigMap); err != nil {
			return req, err
		}
		if hs.Username, hs.Password, err = a.credentials(ctx, ref, h.SecretRef); err != nil {
			return req, err
		}
		for _, name := range h.SecretExtraHeaders {
			s, err := a.secret(ctx, ref, name)
			if err != nil {
				return req, err
			}
			for _, v := range s.Data {
				hs.SecretExtraHeaders = append(hs.SecretExtraHeaders, strings.TrimSpace(string(v)))
			}
		}
		cfg := a.cdiConfig(ctx)
		if hs.Proxy, err = a.proxy(ctx, ref, cfg); err != nil {
			return req, err
		}
		if hs.AllowedNetworks, err = a.allowedNetworks(ctx); err != nil {
			return req, err
		}
		req.HTTP = hs
	case src != nil && src.Registry != nil:
		r := src.Registry
		if r.URL == nil || *r.URL == "" {
			return req, invalid("registry source without url (image streams are not supported)")
		}
		if r.PullMethod != nil && *r.PullMethod == cdiv1.RegistryPullNode {
			return req, invalid("registry pull method node is not supported")
		}
		rs := &importer.RegistrySource{URL: *r.URL}
		var err error
		if r.CertConfigMap != nil {
			if rs.CACertPEM, err = a.configMapPEM(ctx, ref, *r.CertConfigMap); err != nil {
				return req, err
			}
		}
		if r.SecretRef != nil {
			if rs.Username, rs.Password, err = a.credentials(ctx, ref, *r.SecretRef); err != nil {
				return req, err
			}
		}
		if r.Platform != nil && r.Platform.Architecture != "" {
			rs.Platform = "linux/" + r.Platform.Architecture
		}
		cfg := a.cdiConfig(ctx)
		if cfg != nil {
			rs.InsecureRegistries = cfg.InsecureRegistries
		}
		if rs.Proxy, err = a.proxy(ctx, ref, cfg); err != nil {
			return req, err
		}
		if rs.AllowedNetworks, err = a.allowedNetworks(ctx); err != nil {
			return req, err
		}
		req.Registry = rs
	default:
		return req, invalid("datavolume has no " + t.kind + " source")
	}
	return req, nil
}

func invalid(msg string) error {
	return &importer.Error{Reason: importer.ReasonInvalidRequest, Err: errors.New(msg)}
}

// secret reads the Secret name that the DataVolume ref names.
func (a *Agent) secret(ctx context.Context, ref nodereads.Ref, name string) (*corev1.Secret, error) {
	s, err := a.cfg.Reads.Secret(ctx, ref, name)
	if err != nil {
		return nil, &importer.Error{Reason: importer.ReasonInvalidRequest, Err: fmt.Errorf("secret %s/%s: %w", ref.Namespace, name, err)}
	}
	return s, nil
}

// credentials reads CDI's accessKeyId/secretKey Secret.
func (a *Agent) credentials(ctx context.Context, ref nodereads.Ref, name string) (user, password string, err error) {
	if name == "" {
		return "", "", nil
	}
	s, err := a.secret(ctx, ref, name)
	if err != nil {
		return "", "", err
	}
	return string(s.Data["accessKeyId"]), string(s.Data["secretKey"]), nil
}

// configMapPEM concatenates the values of the CA ConfigMap name that the
// DataVolume ref names.
func (a *Agent) configMapPEM(ctx context.Context, ref nodereads.Ref, name string) ([]byte, error) {
	if name == "" {
		return nil, nil
	}
	cm, err := a.cfg.Reads.ConfigMap(ctx, ref, name)
	if err != nil {
		return nil, &importer.Error{Reason: importer.ReasonInvalidRequest, Err: fmt.Errorf("configmap %s/%s: %w", ref.Namespace, name, err)}
	}
	return pemOf(cm), nil
}

// pemOf concatenates the values of a CA ConfigMap.
func pemOf(cm *corev1.ConfigMap) []byte {
	var out []byte
	for _, v := range cm.Data {
		out = append(append(out, v...), '\n')
	}
	return out
}

// cdiConfig is the CDI CR's configuration, or nil.
func (a *Agent) cdiConfig(ctx context.Context) *cdiv1.CDIConfigSpec {
	cfg, _ := a.virt.CDIConfig(ctx)
	return cfg
}

// allowedNetworks are the addresses imports may reach although the
// importer forbids them by default: the CDI CR's
// importstate.AnnImportAllowedNetworks annotation.
func (a *Agent) allowedNetworks(ctx context.Context) ([]netip.Prefix, error) {
	cdi, err := a.virt.CDI(ctx)
	if err != nil || cdi == nil {
		return nil, nil
	}
	nets, err := reach.ParseNetworks(cdi.Annotations[importstate.AnnImportAllowedNetworks])
	if err != nil {
		return nil, &importer.Error{Reason: importer.ReasonInvalidRequest,
			Err: fmt.Errorf("cdi %s annotation %s: %w", cdi.Name, importstate.AnnImportAllowedNetworks, err)}
	}
	return nets, nil
}

// proxy is the import proxy of the CDI configuration, or nil; its CA is
// read for the DataVolume ref.
func (a *Agent) proxy(ctx context.Context, ref nodereads.Ref, cfg *cdiv1.CDIConfigSpec) (*importer.Proxy, error) {
	if cfg == nil || cfg.ImportProxy == nil {
		return nil, nil
	}
	ip := cfg.ImportProxy
	p := &importer.Proxy{HTTPProxy: deref(ip.HTTPProxy), HTTPSProxy: deref(ip.HTTPSProxy), NoProxy: deref(ip.NoProxy)}
	if p.HTTPProxy == "" && p.HTTPSProxy == "" {
		return nil, nil
	}
	if ca := deref(ip.TrustedCAProxy); ca != "" {
		cm, err := a.cfg.Reads.BrainConfigMap(ctx, ref, ca)
		if err != nil {
			return nil, &importer.Error{Reason: importer.ReasonInvalidRequest,
				Err: fmt.Errorf("import proxy ca configmap %s/%s: %w", a.cfg.BrainNamespace, ca, err)}
		}
		p.TrustedCAPEM = pemOf(cm)
	}
	return p, nil
}

func deref(p *string) string {
	if p == nil {
		return ""
	}
	return *p
}

// clone copies the disk of a volume into t: on this node by reflink when
// the filesystem shares extents, else through the importer, which writes
// only the non-zero blocks; from another node streamed from its endpoint
// (mutual TLS, see ExportPath).
func (a *Agent) clone(ctx context.Context, t *target, onProgress func(importer.Progress)) (importer.Result, error) {
	creq, err := a.cloneRequest(ctx, t.pvc)
	if err != nil {
		return importer.Result{}, err
	}
	ns, name := creq.SourceNamespace, creq.SourceName
	src, err := a.pvcs.PersistentVolumeClaims(ns).Get(name)
	if err != nil {
		return importer.Result{}, &importer.Error{Reason: importer.ReasonSourceNotFound, Err: fmt.Errorf("clone source pvc %s/%s: %w", ns, name, err)}
	}
	if src.Status.Phase != corev1.ClaimBound {
		return importer.Result{}, &importer.Error{Reason: importer.ReasonSourceUnreachable, Err: fmt.Errorf("clone source pvc %s/%s is not bound", ns, name)}
	}
	pv, err := a.pvs.Get(src.Spec.VolumeName)
	if err != nil || pv.Spec.CSI == nil {
		return importer.Result{}, &importer.Error{Reason: importer.ReasonSourceNotFound, Err: fmt.Errorf("clone source pv %s: not a csi volume (%v)", src.Spec.VolumeName, err)}
	}
	if node := importstate.PVNode(pv); node != "" && node != a.cfg.NodeName {
		return a.cloneFromPeer(ctx, t, node, ns, name, onProgress)
	}
	srcDisk, _, _, err := a.cfg.Resolver.VolumeDisk(pv.Spec.CSI.VolumeHandle)
	if err != nil {
		return importer.Result{}, &importer.Error{Reason: importer.ReasonSourceNotFound, Err: fmt.Errorf("clone source volume: %w", err)}
	}
	f, err := os.Open(srcDisk)
	if err != nil {
		return importer.Result{}, &importer.Error{Reason: importer.ReasonSourceNotFound, Err: fmt.Errorf("clone source disk: %w", err)}
	}
	defer f.Close()
	size, err := f.Seek(0, io.SeekEnd)
	if err != nil {
		return importer.Result{}, err
	}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return importer.Result{}, err
	}
	if !t.isBlock {
		if res, ok := reflink(f, t, size); ok {
			onProgress(importer.Progress{Bytes: size, Total: size, Percent: 100})
			return res, nil
		}
	}
	req := baseRequest(t)
	req.Raw = true // the guest's bytes, never interpreted as an image
	req.Progress = onProgress
	return importer.ImportFromReader(ctx, f, size, req)
}

// removeLeftovers removes the temporary files an interrupted import or
// clone into disk left in its directory.
func removeLeftovers(disk string) error {
	err := importer.RemoveLeftovers(disk)
	clones, _ := filepath.Glob(filepath.Join(filepath.Dir(disk), ".clone-*"))
	for _, c := range clones {
		if rerr := os.Remove(c); rerr != nil && !errors.Is(rerr, os.ErrNotExist) {
			err = errors.Join(err, rerr)
		}
	}
	return err
}

// reflink clones src into t's disk file when the filesystem can share
// extents, growing it to the capacity; ok is false when it cannot (and
// nothing was left behind).
func reflink(src *os.File, t *target, size int64) (importer.Result, bool) {
	if size > t.capacity {
		return importer.Result{}, false
	}
	tmp, err := os.CreateTemp(filepath.Dir(t.disk), ".clone-*")
	if err != nil {
		return importer.Result{}, false
	}
	ok := false
	defer func() {
		tmp.Close()
		if !ok {
			os.Remove(tmp.Name())
		}
	}()
	if err := ficlone(tmp, src); err != nil {
		return importer.Result{}, false
	}
	if err := tmp.Truncate(t.capacity); err != nil || tmp.Sync() != nil || os.Rename(tmp.Name(), t.disk) != nil {
		return importer.Result{}, false
	}
	ok = true
	return importer.Result{Format: importer.FormatRaw, VirtualSize: t.capacity, SourceBytes: size, Streamed: true}, true
}
