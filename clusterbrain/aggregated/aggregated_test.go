package aggregated

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	authv1 "k8s.io/api/authorization/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/nodevirt/nodevirt/clusterbrain/kit/httperr"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

func TestMain(m *testing.M) { controlplane.Main(m, controlplane.Config{}) }

// TestProxiedRequestCarriesUser registers a small API, calls it through
// kube-apiserver as admin and as an unprivileged user, and checks that the
// server sees each caller and that a direct call without the aggregator's
// certificate is refused.
func TestProxiedRequestCarriesUser(t *testing.T) {
	cp := controlplane.Shared(t)
	ns := cp.Namespace(t)
	kube := cp.Clientset(t)
	dyn, err := dynamic.NewForConfig(cp.RestConfig)
	if err != nil {
		t.Fatal(err)
	}
	group := "echo-" + ns + ".nodevirt.io"
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		u, ok := UserFrom(r.Context())
		if !ok {
			_ = httperr.WriteJSON(w, 200, map[string]any{"anonymous": true, "path": r.URL.Path})
			return
		}
		attrs := authv1.ResourceAttributes{Namespace: ns, Verb: "get", Group: group, Resource: "things"}
		allowed, reason, err := Authorize(r.Context(), kube, u, attrs)
		if err != nil {
			httperr.WriteStatus(w, err)
			return
		}
		if !allowed {
			httperr.WriteStatus(w, Forbidden(u, attrs, reason))
			return
		}
		_ = httperr.WriteJSON(w, 200, map[string]any{"user": u.Name, "groups": u.Groups, "path": r.URL.Path})
	})
	srv, err := NewServer(Config{
		Kube: kube, Dynamic: dyn, Addr: ":0", Handler: handler,
		Registration: Registration{Group: group, Versions: []string{"v1"}, Namespace: ns, Service: "echo"},
		Public:       func(r *http.Request) bool { return r.URL.Path == "/healthz" },
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		<-done
		_ = Unregister(context.Background(), kube, dyn, srv.Registration())
	})
	select {
	case <-srv.Ready():
	case err := <-done:
		t.Fatal(err)
	case <-time.After(30 * time.Second):
		t.Fatal("server not ready")
	}
	var body []byte
	testkit.Eventually(t, 60*time.Second, "an admin call through the aggregator", func() (err error) {
		if body, err = kube.Discovery().RESTClient().Get().AbsPath("/apis", group, "v1", "hello").DoRaw(ctx); err != nil {
			avail, msg, _ := APIServiceAvailable(ctx, dyn, group, "v1")
			return fmt.Errorf("%w (available=%v %s)", err, avail, msg)
		}
		return nil
	})
	var got struct {
		User   string
		Groups []string
		Path   string
	}
	if err := json.Unmarshal(body, &got); err != nil {
		t.Fatal(err)
	}
	if got.User != "nodevirt-admin" || got.Path != "/apis/"+group+"/v1/hello" {
		t.Fatalf("server saw %+v", got)
	}

	kc := filepath.Join(t.TempDir(), "nobody.kubeconfig")
	if err := cp.WriteKubeconfig(kc, "nobody", "testers"); err != nil {
		t.Fatal(err)
	}
	rc, err := clientcmd.BuildConfigFromFlags("", kc)
	if err != nil {
		t.Fatal(err)
	}
	// kube-apiserver lets nobody reach the API (get on "hello"), the server's
	// own review refuses "things".
	grant(t, kube, group, "nobody")
	hc, err := rest.HTTPClientFor(rc)
	if err != nil {
		t.Fatal(err)
	}
	// kube-apiserver's RBAC cache takes the new binding a moment later; until
	// then its own refusal ("cannot list resource \"hello\"") answers.
	testkit.Eventually(t, 30*time.Second, "a 403 from the server's own review", func() error {
		resp, err := hc.Get(rc.Host + "/apis/" + group + "/v1/hello")
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		var st metav1.Status
		_ = json.NewDecoder(resp.Body).Decode(&st)
		if resp.StatusCode != http.StatusForbidden || st.Reason != metav1.StatusReasonForbidden || !strings.Contains(st.Message, `User "nobody" cannot get resource "things"`) {
			return fmt.Errorf("unprivileged call: %d %+v", resp.StatusCode, st)
		}
		return nil
	})

	// Straight to the server, without the front-proxy certificate.
	direct := &http.Client{Transport: &http.Transport{TLSClientConfig: insecureTLS()}}
	resp, err := direct.Get("https://" + srv.Registration().Endpoint() + "/apis/" + group + "/v1/hello")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("direct call: %d, want 401", resp.StatusCode)
	}
	resp, err = direct.Get("https://" + srv.Registration().Endpoint() + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("public path: %d, want 200", resp.StatusCode)
	}
}

// grant lets user get every resource of group, cluster-wide.
func grant(t *testing.T, kube kubernetes.Interface, group, user string) {
	t.Helper()
	ctx := context.Background()
	name := "test-" + group
	role := &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: name},
		Rules: []rbacv1.PolicyRule{{APIGroups: []string{group}, Resources: []string{"hello"}, Verbs: []string{"get", "list"}}}}
	if _, err := kube.RbacV1().ClusterRoles().Create(ctx, role, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	rb := &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: name},
		RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: name},
		Subjects: []rbacv1.Subject{{Kind: "User", APIGroup: "rbac.authorization.k8s.io", Name: user}}}
	if _, err := kube.RbacV1().ClusterRoleBindings().Create(ctx, rb, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = kube.RbacV1().ClusterRoleBindings().Delete(ctx, name, metav1.DeleteOptions{})
		_ = kube.RbacV1().ClusterRoles().Delete(ctx, name, metav1.DeleteOptions{})
	})
}
