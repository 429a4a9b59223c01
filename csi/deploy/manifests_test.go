// Package deploy holds the manifests that run the hostpath CSI driver under
// the standard sidecars; the test checks them against the Kubernetes types.
package deploy

import (
	"bytes"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"
)

// TestManifestsDecodeStrictly decodes every document into its Go type,
// refusing unknown fields, and checks the names users rely on.
func TestManifestsDecodeStrictly(t *testing.T) {
	files, err := filepath.Glob("*.yaml")
	if err != nil || len(files) == 0 {
		t.Fatalf("no manifests: %v", err)
	}
	seen := map[string]any{}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, doc := range bytes.Split(b, []byte("\n---\n")) {
			var tm metav1.TypeMeta
			if err := yaml.Unmarshal(doc, &tm); err != nil {
				t.Fatalf("%s: %v", f, err)
			}
			var obj any
			switch tm.Kind {
			case "Namespace":
				obj = &corev1.Namespace{}
			case "ServiceAccount":
				obj = &corev1.ServiceAccount{}
			case "ClusterRole":
				obj = &rbacv1.ClusterRole{}
			case "ClusterRoleBinding":
				obj = &rbacv1.ClusterRoleBinding{}
			case "CSIDriver":
				obj = &storagev1.CSIDriver{}
			case "StorageClass":
				obj = &storagev1.StorageClass{}
			case "DaemonSet":
				obj = &appsv1.DaemonSet{}
			case "VolumeSnapshotClass":
				continue // CRD type, not in k8s.io/api
			default:
				t.Fatalf("%s: unexpected kind %q", f, tm.Kind)
			}
			if err := yaml.UnmarshalStrict(doc, obj); err != nil {
				t.Fatalf("%s (%s): %v", f, tm.Kind, err)
			}
			seen[tm.Kind] = obj
		}
	}

	sc := seen["StorageClass"].(*storagev1.StorageClass)
	if sc.Name != "hostpath-csi" || sc.Provisioner != "kubevirt.io.hostpath-provisioner" ||
		sc.VolumeBindingMode == nil || *sc.VolumeBindingMode != storagev1.VolumeBindingWaitForFirstConsumer {
		t.Errorf("storage class: %+v", sc)
	}
	if d := seen["CSIDriver"].(*storagev1.CSIDriver); d.Name != "kubevirt.io.hostpath-provisioner" {
		t.Errorf("csi driver name %q", d.Name)
	}
	ds := seen["DaemonSet"].(*appsv1.DaemonSet)
	var names []string
	for _, c := range ds.Spec.Template.Spec.Containers {
		names = append(names, c.Name)
		if c.Name == "csi-provisioner" || c.Name == "csi-snapshotter" {
			if !slices.Contains(c.Args, "--node-deployment=true") {
				t.Errorf("%s does not run in node-deployment mode: %v", c.Name, c.Args)
			}
		}
	}
	for _, want := range []string{"hostpath-csi-driver", "csi-provisioner", "csi-snapshotter", "node-driver-registrar", "liveness-probe"} {
		if !slices.Contains(names, want) {
			t.Errorf("daemonset lacks container %s (has %s)", want, strings.Join(names, ", "))
		}
	}
}
