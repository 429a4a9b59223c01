package virtctl

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"path"
	"strings"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"
	uploadv1beta1 "kubevirt.io/containerized-data-importer-api/pkg/apis/upload/v1beta1"
)

// CDI's upload protocol, as upstream virtctl speaks it.
const (
	UploadPath      = "/v1beta1/upload"
	UploadAsyncPath = "/v1beta1/upload-async"
	// PodPhaseAnnotation on the PVC says the upload's processing phase.
	PodPhaseAnnotation = "cdi.kubevirt.io/storage.pod.phase"
)

// UploadOptions are image-upload's flags.
type UploadOptions struct {
	Kind           string // "dv" (the only kind nodevirt creates)
	Name           string
	Size           string
	ImagePath      string
	StorageClass   string
	UploadProxyURL string
	Insecure       bool
	NoCreate       bool
	WaitSecs       uint
	// Progress receives the progress bar (nil: none).
	Progress io.Writer
	// Out receives status lines.
	Out io.Writer
}

// ImageUpload creates the upload DataVolume (unless NoCreate), waits until
// it accepts data, gets an upload token and streams the image to the upload
// proxy, then waits for processing to finish.
func (c *Client) ImageUpload(ctx context.Context, o UploadOptions) error {
	if o.Kind != "dv" {
		return fmt.Errorf("image-upload %s: only dv uploads are supported", o.Kind)
	}
	if o.ImagePath == "" {
		return fmt.Errorf("image-upload: --image-path is required")
	}
	if o.Out == nil {
		o.Out = io.Discard
	}
	if o.WaitSecs == 0 {
		o.WaitSecs = 300
	}
	f, err := os.Open(o.ImagePath)
	if err != nil {
		return fmt.Errorf("image-upload: %w", err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	if !o.NoCreate {
		if o.Size == "" {
			return fmt.Errorf("image-upload: when creating a resource, the size must be specified")
		}
		q, err := resource.ParseQuantity(o.Size)
		if err != nil {
			return fmt.Errorf("validation failed for size=%s: %w", o.Size, err)
		}
		spec := &cdiv1.StorageSpec{Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: q}}}
		if o.StorageClass != "" {
			if _, err := c.Kube.StorageV1().StorageClasses().Get(ctx, o.StorageClass, metav1.GetOptions{}); err != nil {
				return err
			}
			spec.StorageClassName = &o.StorageClass
		}
		dv := &cdiv1.DataVolume{
			ObjectMeta: metav1.ObjectMeta{Name: o.Name, Namespace: c.Namespace},
			Spec: cdiv1.DataVolumeSpec{Source: &cdiv1.DataVolumeSource{Upload: &cdiv1.DataVolumeSourceUpload{}},
				ContentType: cdiv1.DataVolumeKubeVirt, Storage: spec},
		}
		if _, err := c.Virt.DataVolumes.Create(ctx, dv); err != nil {
			return err
		}
		fmt.Fprintf(o.Out, "DataVolume %s/%s created\n", c.Namespace, o.Name)
	}
	if err := c.waitUploadReady(ctx, o); err != nil {
		return err
	}
	if o.UploadProxyURL == "" {
		if o.UploadProxyURL, err = c.uploadProxyURL(ctx); err != nil {
			return err
		}
	}
	if !strings.Contains(o.UploadProxyURL, "://") {
		o.UploadProxyURL = "https://" + o.UploadProxyURL
	}
	fmt.Fprintf(o.Out, "Uploading data to %s\n", o.UploadProxyURL)
	token, err := c.UploadToken(ctx, o.Name)
	if err != nil {
		return err
	}
	if err := upload(ctx, o, token, f, fi.Size()); err != nil {
		return err
	}
	fmt.Fprintln(o.Out, "Uploading data completed successfully, waiting for processing to complete, you can hit ctrl-c without interrupting the progress")
	if err := c.waitProcessed(ctx, o.Name, time.Duration(o.WaitSecs)*time.Second); err != nil {
		return err
	}
	fmt.Fprintf(o.Out, "Uploading %s completed successfully\n", o.ImagePath)
	return nil
}

func (c *Client) waitUploadReady(ctx context.Context, o UploadOptions) error {
	deadline := time.Now().Add(time.Duration(o.WaitSecs) * time.Second)
	logged := false
	for {
		dv, err := c.Virt.DataVolumes.Get(ctx, c.Namespace, o.Name)
		switch {
		case apierrors.IsNotFound(err):
		case err != nil:
			return err
		case dv.Status.Phase == cdiv1.UploadReady:
			if logged {
				fmt.Fprintln(o.Out, "Pod now ready")
			}
			return nil
		case dv.Status.Phase == cdiv1.WaitForFirstConsumer || dv.Status.Phase == cdiv1.PendingPopulation:
			return fmt.Errorf("cannot upload to DataVolume in %s phase, make sure the PVC is Bound, or use force-bind flag", dv.Status.Phase)
		case dv.Status.Phase == cdiv1.Failed:
			return fmt.Errorf("DataVolume %s failed", o.Name)
		}
		if !logged {
			fmt.Fprintf(o.Out, "Waiting for PVC %s upload pod to be ready...\n", o.Name)
			logged = true
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("timed out waiting for DataVolume %s to be ready for upload", o.Name)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(2 * time.Second):
		}
	}
}

// uploadProxyURL reads CDIConfig "config" status.uploadProxyURL.
func (c *Client) uploadProxyURL(ctx context.Context) (string, error) {
	raw, err := c.Kube.Discovery().RESTClient().Get().AbsPath("/apis/cdi.kubevirt.io/v1beta1/cdiconfigs/config").DoRaw(ctx)
	if err != nil {
		return "", fmt.Errorf("read cdiconfig to find the upload proxy (or pass --uploadproxy-url): %w", err)
	}
	var cfg cdiv1.CDIConfig
	if err := json.Unmarshal(raw, &cfg); err != nil {
		return "", err
	}
	if cfg.Status.UploadProxyURL == nil || *cfg.Status.UploadProxyURL == "" {
		return "", fmt.Errorf("uploadproxy URL not found")
	}
	return *cfg.Status.UploadProxyURL, nil
}

// UploadToken asks the upload API for a token to upload into pvc.
func (c *Client) UploadToken(ctx context.Context, pvc string) (string, error) {
	req := &uploadv1beta1.UploadTokenRequest{
		TypeMeta:   metav1.TypeMeta{APIVersion: "upload.cdi.kubevirt.io/v1beta1", Kind: "UploadTokenRequest"},
		ObjectMeta: metav1.ObjectMeta{GenerateName: "token-for-virtctl-", Namespace: c.Namespace},
		Spec:       uploadv1beta1.UploadTokenRequestSpec{PvcName: pvc},
	}
	body, err := json.Marshal(req)
	if err != nil {
		return "", err
	}
	u, _ := url.Parse(c.Config.Host)
	u.Path = path.Join("/", u.Path, "apis/upload.cdi.kubevirt.io/v1beta1/namespaces", c.Namespace, "uploadtokenrequests")
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, u.String(), bytes.NewReader(body))
	if err != nil {
		return "", err
	}
	hr.Header.Set("Content-Type", "application/json")
	resp, err := c.http.Do(hr)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if resp.StatusCode/100 != 2 {
		return "", statusError(resp.StatusCode, data)
	}
	var out uploadv1beta1.UploadTokenRequest
	if err := json.Unmarshal(data, &out); err != nil {
		return "", err
	}
	if out.Status.Token == "" {
		return "", fmt.Errorf("upload token request returned no token")
	}
	return out.Status.Token, nil
}

func uploadClient(insecure bool) *http.Client {
	if !insecure {
		return &http.Client{}
	}
	return &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}} // #nosec: the user asked for --insecure
}

// upload posts the image to the proxy, preferring the async endpoint when
// the proxy offers it (HEAD answers 200), as upstream virtctl does.
func upload(ctx context.Context, o UploadOptions, token string, f *os.File, size int64) error {
	hc := uploadClient(o.Insecure)
	base, err := url.Parse(o.UploadProxyURL)
	if err != nil {
		return err
	}
	target := *base
	target.Path = path.Join("/", base.Path, UploadAsyncPath)
	head, _ := http.NewRequestWithContext(ctx, http.MethodHead, target.String(), nil)
	head.Header.Set("Authorization", "Bearer "+token)
	if resp, err := hc.Do(head); err != nil || resp.StatusCode != http.StatusOK {
		target.Path = path.Join("/", base.Path, UploadPath)
		if resp != nil {
			resp.Body.Close()
		}
	} else {
		resp.Body.Close()
	}
	bar := newProgress(o.Progress, size)
	defer bar.finish()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, target.String(), io.NopCloser(&countingReader{r: f, bar: bar}))
	if err != nil {
		return err
	}
	req.ContentLength = size
	req.Header.Set("Authorization", "Bearer "+token)
	req.Header.Set("Content-Type", "application/octet-stream")
	resp, err := hc.Do(req)
	if err != nil {
		return fmt.Errorf("upload to %s: %w", target.String(), err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<16))
		return fmt.Errorf("unexpected return value %d, %s", resp.StatusCode, strings.TrimSpace(string(body)))
	}
	return nil
}

func (c *Client) waitProcessed(ctx context.Context, pvc string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		p, err := c.Kube.CoreV1().PersistentVolumeClaims(c.Namespace).Get(ctx, pvc, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if p.Annotations[PodPhaseAnnotation] == string(corev1.PodSucceeded) {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("timed out waiting for post upload processing to complete")
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Second):
		}
	}
}

type countingReader struct {
	r   io.Reader
	bar *progress
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.bar.add(int64(n))
	return n, err
}

// progress draws "NN.NN MiB / NN.NN MiB [=====>    ] 42.00% 12.3 MiB/s" on
// one line, at most ten times a second.
type progress struct {
	w     io.Writer
	total int64
	done  atomic.Int64
	start time.Time
	last  atomic.Int64 // unix nanos of the last draw
}

func newProgress(w io.Writer, total int64) *progress {
	p := &progress{w: w, total: total, start: time.Now()}
	p.draw()
	return p
}

func (p *progress) add(n int64) {
	p.done.Add(n)
	now := time.Now().UnixNano()
	if last := p.last.Load(); now-last > int64(100*time.Millisecond) && p.last.CompareAndSwap(last, now) {
		p.draw()
	}
}

func (p *progress) draw() {
	if p.w == nil {
		return
	}
	fmt.Fprint(p.w, "\r"+p.line())
}

func (p *progress) line() string {
	done := p.done.Load()
	frac := 1.0
	if p.total > 0 {
		frac = float64(done) / float64(p.total)
	}
	const width = 40
	filled := int(frac * width)
	if filled > width {
		filled = width
	}
	bar := strings.Repeat("=", filled)
	if filled < width {
		bar += ">" + strings.Repeat(" ", width-filled-1)
	}
	rate := float64(done) / time.Since(p.start).Seconds() / (1 << 20)
	return fmt.Sprintf("%s / %s [%s] %6.2f%% %.1f MiB/s", mib(done), mib(p.total), bar, frac*100, rate)
}

func (p *progress) finish() {
	if p.w == nil {
		return
	}
	p.draw()
	fmt.Fprintln(p.w)
}

func mib(n int64) string { return fmt.Sprintf("%.2f MiB", float64(n)/(1<<20)) }
