package upload

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"mime/multipart"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	apiresource "k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"
	uploadv1beta1 "kubevirt.io/containerized-data-importer-api/pkg/apis/upload/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/datavolume"
	"github.com/nodevirt/nodevirt/nodeagent/dvimport"
	"github.com/nodevirt/nodevirt/nodeagent/dvimport/dvimporttest"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

func TestMain(m *testing.M) {
	controlplane.Main(m, controlplane.Config{ControllerManager: true})
}

const (
	node           = "node-a"
	brainNamespace = "kubevirt-hyperconverged"
)

type env struct {
	cp       *controlplane.ControlPlane
	kube     kubernetes.Interface
	virt     *client.Set
	srv      *Server
	resolver dvimporttest.DirResolver
	proxy    *http.Client
	ns       string
}

var (
	setupOnce sync.Once
	shared    env
)

// setup runs, once per binary, the upload role, the DataVolume controller
// and node-a's dvimport role with its upload endpoint.
func setup(t *testing.T) env {
	t.Helper()
	cp := controlplane.Shared(t)
	setupOnce.Do(func() {
		ctx := context.Background()
		testkit.InstallCRDs(t, cp)
		kube := cp.Clientset(t)
		virt, err := client.NewSet(cp.RestConfig)
		if err != nil {
			t.Fatal(err)
		}
		ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: brainNamespace}}
		if _, err := kube.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatal(err)
		}
		dvimporttest.CreateNode(t, kube, node)
		log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
		srv, err := New(Config{Kube: kube, Namespace: brainNamespace, APIAddr: ":0", ProxyAddr: "127.0.0.1:0", ReadyWait: 3 * time.Second, Log: log})
		if err != nil {
			t.Fatal(err)
		}
		go func() {
			if err := srv.Run(ctx); err != nil {
				fmt.Fprintln(os.Stderr, "upload role:", err)
			}
		}()
		ctrl, err := datavolume.New(datavolume.Config{Kube: kube, Virt: virt, Log: log})
		if err != nil {
			t.Fatal(err)
		}
		go func() { _ = ctrl.Run(ctx) }()
		root, err := os.MkdirTemp("", "upload-volumes-")
		if err != nil {
			t.Fatal(err)
		}
		resolver := dvimporttest.DirResolver{Root: root}
		agent, err := dvimport.New(dvimport.Config{NodeName: node, Kube: kube, Virt: virt, Resolver: resolver,
			BrainNamespace: brainNamespace, UploadAddr: "127.0.0.1:0", Log: log})
		if err != nil {
			t.Fatal(err)
		}
		go func() { _ = agent.Run(ctx) }()
		testkit.Until(t, 30*time.Second, "the upload role ready", srv.Ready)
		waitAPIAvailable(t, cp)
		proxy := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: srv.CA().Pool()}}}
		shared = env{cp: cp, kube: kube, virt: virt, srv: srv, resolver: resolver, proxy: proxy}
	})
	if shared.srv == nil {
		t.Fatal("setup failed earlier")
	}
	e := shared
	e.ns = cp.Namespace(t)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	dvimporttest.Provision(ctx, t, e.kube, e.ns, node)
	return e
}

// waitAPIAvailable waits until kube-apiserver reaches the aggregated API.
func waitAPIAvailable(t *testing.T, cp *controlplane.ControlPlane) {
	t.Helper()
	kube := cp.Clientset(t)
	testkit.Eventually(t, time.Minute, "the aggregated api available", func() error {
		_, err := kube.Discovery().ServerResourcesForGroupVersion(group + "/" + version)
		return err
	})
}

// requestToken asks the API server for a token as the user of rc.
func requestToken(rc *rest.Config, ns, pvc string) (string, error) {
	c := rest.CopyConfig(rc)
	c.GroupVersion = &uploadv1beta1.SchemeGroupVersion
	c.APIPath = "/apis"
	c.NegotiatedSerializer = serializer.NewCodecFactory(client.NewScheme()).WithoutConversion()
	rcl, err := rest.RESTClientFor(c)
	if err != nil {
		return "", err
	}
	req := &uploadv1beta1.UploadTokenRequest{ObjectMeta: metav1.ObjectMeta{Name: "token-for-virtctl"},
		Spec: uploadv1beta1.UploadTokenRequestSpec{PvcName: pvc}}
	var out uploadv1beta1.UploadTokenRequest
	if err := rcl.Post().Namespace(ns).Resource(resource).Body(req).Do(context.Background()).Into(&out); err != nil {
		return "", err
	}
	return out.Status.Token, nil
}

func (e env) uploadDV(t *testing.T, name string) {
	t.Helper()
	dv := &cdiv1.DataVolume{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: e.ns},
		Spec: cdiv1.DataVolumeSpec{Source: &cdiv1.DataVolumeSource{Upload: &cdiv1.DataVolumeSourceUpload{}},
			Storage: &cdiv1.StorageSpec{Resources: corev1.VolumeResourceRequirements{
				Requests: corev1.ResourceList{corev1.ResourceStorage: apiresource.MustParse("64Mi")}}}},
	}
	if _, err := e.virt.DataVolumes.Create(context.Background(), dv); err != nil {
		t.Fatal(err)
	}
	dvimporttest.WaitDV(t, e.virt.DataVolumes, e.ns, name, 30*time.Second, "UploadReady",
		func(dv *cdiv1.DataVolume) bool { return dv.Status.Phase == cdiv1.UploadReady })
}

// post sends body to the upload proxy's path with the Authorization value.
func (e env) post(t *testing.T, method, path, auth string, body io.Reader, contentType string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(method, "https://"+e.srv.ProxyAddr()+path, body)
	if err != nil {
		t.Fatal(err)
	}
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	resp, err := e.proxy.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, strings.TrimSpace(string(data))
}

func TestUploadWithATokenFillsTheVolume(t *testing.T) {
	e := setup(t)
	dir := t.TempDir()
	raw := dvimporttest.MakeImage(t, dir, "disk.raw", 20<<20, 11)
	qcow2 := filepath.Join(dir, "disk.qcow2")
	if out, err := exec.Command("qemu-img", "convert", "-f", "raw", "-O", "qcow2", raw, qcow2).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img: %v\n%s", err, out)
	}
	e.uploadDV(t, "up")
	e.uploadDV(t, "form")
	pvc, err := e.kube.CoreV1().PersistentVolumeClaims(e.ns).Get(context.Background(), "up", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// What virtctl image-upload waits for.
	if pvc.Annotations["cdi.kubevirt.io/storage.pod.phase"] != "Running" || pvc.Annotations["cdi.kubevirt.io/storage.pod.ready"] != "true" {
		t.Errorf("upload pvc annotations %v", pvc.Annotations)
	}

	token, err := requestToken(e.cp.RestConfig, e.ns, "up")
	if err != nil {
		t.Fatalf("token request: %v", err)
	}
	if code, body := e.post(t, http.MethodHead, PathUploadAsync, "Bearer "+token, nil, ""); code != http.StatusOK {
		t.Fatalf("async probe: %d %s", code, body)
	}
	// A bad image is refused with its reason; the target stays ready.
	if code, body := e.post(t, http.MethodPost, PathUpload, "Bearer "+token, strings.NewReader("QFI\xfb garbage"), ""); code != http.StatusBadRequest || !strings.Contains(body, "Image") && !strings.Contains(body, "Invalid") {
		t.Errorf("garbage upload: %d %q", code, body)
	}
	f, err := os.Open(raw)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	start := time.Now()
	if code, body := e.post(t, http.MethodPost, PathUploadAsync, "Bearer "+token, f, "application/octet-stream"); code != http.StatusOK {
		t.Fatalf("upload: %d %s", code, body)
	}
	t.Logf("uploaded 20 MiB through the proxy in %s", time.Since(start).Round(time.Millisecond))
	dv := dvimporttest.WaitDV(t, e.virt.DataVolumes, e.ns, "up", 20*time.Second, "Succeeded",
		func(dv *cdiv1.DataVolume) bool { return dv.Status.Phase == cdiv1.Succeeded })
	if c := dvimporttest.Condition(dv, cdiv1.DataVolumeReady); c.Status != corev1.ConditionTrue {
		t.Errorf("ready condition %+v", c)
	}
	dvimporttest.SameDisk(t, e.resolver.Disk(pvc), raw)
	// The token cannot be used again on a finished volume.
	if code, body := e.post(t, http.MethodPost, PathUpload, "Bearer "+token, strings.NewReader("x"), ""); code != http.StatusConflict {
		t.Errorf("upload into a finished volume: %d %s", code, body)
	}

	// A form upload of a qcow2 image.
	formToken, err := requestToken(e.cp.RestConfig, e.ns, "form")
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	mw := multipart.NewWriter(&buf)
	fw, _ := mw.CreateFormFile("file", "disk.qcow2")
	data, _ := os.ReadFile(qcow2)
	_, _ = fw.Write(data)
	_ = mw.Close()
	if code, body := e.post(t, http.MethodPost, PathUploadForm, "Bearer "+formToken, &buf, mw.FormDataContentType()); code != http.StatusOK {
		t.Fatalf("form upload: %d %s", code, body)
	}
	dvimporttest.WaitDV(t, e.virt.DataVolumes, e.ns, "form", 20*time.Second, "Succeeded",
		func(dv *cdiv1.DataVolume) bool { return dv.Status.Phase == cdiv1.Succeeded })
	formPVC, _ := e.kube.CoreV1().PersistentVolumeClaims(e.ns).Get(context.Background(), "form", metav1.GetOptions{})
	dvimporttest.SameDisk(t, e.resolver.Disk(formPVC), raw)
}

func TestBadTokensAreRefused(t *testing.T) {
	e := setup(t)
	e.uploadDV(t, "target")
	// A volume that is not an upload target.
	blank := &cdiv1.DataVolume{ObjectMeta: metav1.ObjectMeta{Name: "imported", Namespace: e.ns,
		Annotations: map[string]string{"cdi.kubevirt.io/storage.bind.immediate.requested": "true"}},
		Spec: cdiv1.DataVolumeSpec{Source: &cdiv1.DataVolumeSource{Blank: &cdiv1.DataVolumeBlankImage{}},
			Storage: &cdiv1.StorageSpec{Resources: corev1.VolumeResourceRequirements{
				Requests: corev1.ResourceList{corev1.ResourceStorage: apiresource.MustParse("8Mi")}}}}}
	if _, err := e.virt.DataVolumes.Create(context.Background(), blank); err != nil {
		t.Fatal(err)
	}
	key, err := loadSigningKey(context.Background(), e.kube, brainNamespace)
	if err != nil {
		t.Fatal(err)
	}
	expiredSigner := NewSigner(key, 5*time.Minute)
	expiredSigner.now = func() time.Time { return time.Now().Add(-10 * time.Minute) }
	expired, _ := expiredSigner.Issue(e.ns, "target")
	forged, _ := testSigner(t).Issue(e.ns, "target")
	valid, err := requestToken(e.cp.RestConfig, e.ns, "target")
	if err != nil {
		t.Fatal(err)
	}
	tampered := valid[:len(valid)-4] + "AAAA"
	otherVolume, _ := NewSigner(key, time.Minute).Issue(e.ns, "imported")
	missingVolume, _ := NewSigner(key, time.Minute).Issue(e.ns, "nothing-here")

	for name, c := range map[string]struct {
		auth string
		code int
		msg  string
	}{
		"missing":        {"", http.StatusUnauthorized, "missing upload token"},
		"not bearer":     {"Basic dXNlcjpwdw==", http.StatusUnauthorized, "malformed authorization"},
		"expired":        {"Bearer " + expired, http.StatusUnauthorized, "expired"},
		"forged":         {"Bearer " + forged, http.StatusUnauthorized, "signature"},
		"tampered":       {"Bearer " + tampered, http.StatusUnauthorized, "signature"},
		"garbage":        {"Bearer abc.def.ghi", http.StatusUnauthorized, "malformed"},
		"other volume":   {"Bearer " + otherVolume, http.StatusForbidden, "not an upload target"},
		"missing volume": {"Bearer " + missingVolume, http.StatusNotFound, "not found"},
	} {
		code, body := e.post(t, http.MethodPost, PathUpload, c.auth, strings.NewReader("data"), "")
		if code != c.code || !strings.Contains(body, c.msg) {
			t.Errorf("%s: got %d %q, want %d %q", name, code, body, c.code, c.msg)
		}
	}
	// Nothing reached the target.
	dv, err := e.virt.DataVolumes.Get(context.Background(), e.ns, "target")
	if err != nil || dv.Status.Phase != cdiv1.UploadReady {
		t.Errorf("target after refused uploads: %v %v", dv.Status.Phase, err)
	}
}

func TestTokenRequestsAreAuthorized(t *testing.T) {
	e := setup(t)
	alice := rest.CopyConfig(e.cp.RestConfig)
	alice.Impersonate = rest.ImpersonationConfig{UserName: "alice", Groups: []string{"system:authenticated"}}
	_, err := requestToken(alice, e.ns, "disk")
	if !apierrors.IsForbidden(err) || !strings.Contains(err.Error(), "alice") {
		t.Fatalf("token for a user without rights: %v", err)
	}
	role := &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Name: "uploader", Namespace: e.ns},
		Rules: []rbacv1.PolicyRule{{APIGroups: []string{group}, Resources: []string{resource}, Verbs: []string{"create"}}}}
	binding := &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "alice-uploads", Namespace: e.ns},
		Subjects: []rbacv1.Subject{{Kind: "User", Name: "alice", APIGroup: rbacv1.GroupName}},
		RoleRef:  rbacv1.RoleRef{Kind: "Role", Name: "uploader", APIGroup: rbacv1.GroupName}}
	ctx := context.Background()
	if _, err := e.kube.RbacV1().Roles(e.ns).Create(ctx, role, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.kube.RbacV1().RoleBindings(e.ns).Create(ctx, binding, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var token string
	testkit.Eventually(t, 10*time.Second, "a token for an authorized user", func() (err error) {
		token, err = requestToken(alice, e.ns, "disk")
		return err
	})
	c, err := e.srv.signer.Verify(token)
	if err != nil || c.Namespace != e.ns || c.Name != "disk" {
		t.Fatalf("issued token: %+v %v", c, err)
	}
	// A request without a claim is refused as invalid, as cdi-apiserver does.
	if _, err := requestToken(alice, e.ns, ""); !apierrors.IsInvalid(err) || !strings.Contains(err.Error(), "spec.pvcName is required") {
		t.Errorf("token without a claim: %v", err)
	}
	// Alice's rights end at her namespace.
	if _, err := requestToken(alice, "default", "disk"); !apierrors.IsForbidden(err) {
		t.Errorf("token in another namespace: %v", err)
	}
	// The aggregated API itself accepts no caller but the front proxy.
	direct := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}
	body, _ := json.Marshal(uploadv1beta1.UploadTokenRequest{Spec: uploadv1beta1.UploadTokenRequestSpec{PvcName: "disk"}})
	req, _ := http.NewRequest(http.MethodPost, "https://"+e.srv.APIAddr()+"/apis/"+group+"/"+version+"/namespaces/"+e.ns+"/"+resource, bytes.NewReader(body))
	req.Header.Set("X-Remote-User", "system:admin")
	req.Header.Set("X-Remote-Group", "system:masters")
	resp, err := direct.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("direct call with forged headers: %d", resp.StatusCode)
	}
}
