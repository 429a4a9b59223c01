package controlplane

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// shared is the control plane of the current test binary, started by Main.
var shared *ControlPlane

// Main runs a test binary's tests against one control plane started for it
// in a temporary directory, and stops it afterwards. Use it from TestMain:
//
//	func TestMain(m *testing.M) { controlplane.Main(m, controlplane.Config{ControllerManager: true}) }
func Main(m *testing.M, cfg Config) {
	os.Exit(runMain(m, cfg))
}

func runMain(m *testing.M, cfg Config) int {
	dir, err := os.MkdirTemp("", "nodevirt-controlplane-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	cfg.Dir = dir
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	cp, err := Start(ctx, cfg)
	if err != nil {
		fmt.Fprintf(os.Stderr, "control plane: %v\n", err)
		if data, rerr := os.ReadFile(dir + "/kube-apiserver.log"); rerr == nil {
			fmt.Fprintf(os.Stderr, "%s\n", tail(string(data), 40))
		}
		return 1
	}
	shared = cp
	defer cp.Stop()
	return m.Run()
}

// Shared returns the control plane started by Main; the test fails when the
// binary has no TestMain calling Main.
func Shared(t testing.TB) *ControlPlane {
	t.Helper()
	if shared == nil {
		t.Fatal("no control plane: call controlplane.Main from TestMain")
	}
	return shared
}

// Clientset returns a typed client for the control plane.
func (c *ControlPlane) Clientset(t testing.TB) kubernetes.Interface {
	t.Helper()
	cs, err := kubernetes.NewForConfig(c.RestConfig)
	if err != nil {
		t.Fatal(err)
	}
	return cs
}

// Namespace creates a namespace that belongs to this test alone and deletes
// it when the test ends, so tests sharing a control plane stay isolated.
func (c *ControlPlane) Namespace(t testing.TB) string {
	t.Helper()
	cs := c.Clientset(t)
	name := namespaceName(t.Name())
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"nodevirt.io/test": "true"}}}
	if _, err := cs.CoreV1().Namespaces().Create(context.Background(), ns, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create test namespace: %v", err)
	}
	t.Cleanup(func() {
		_ = cs.CoreV1().Namespaces().Delete(context.Background(), name, metav1.DeleteOptions{})
	})
	return name
}

var nonDNS = regexp.MustCompile(`[^a-z0-9-]+`)

func namespaceName(test string) string {
	base := strings.Trim(nonDNS.ReplaceAllString(strings.ToLower(test), "-"), "-")
	if len(base) > 40 {
		base = strings.Trim(base[:40], "-")
	}
	return fmt.Sprintf("%s-%05d", base, rand.IntN(100000))
}

func tail(s string, lines int) string {
	parts := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(parts) > lines {
		parts = parts[len(parts)-lines:]
	}
	return strings.Join(parts, "\n")
}
