package importstate

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestReadCloneRequestBindsTheClaim(t *testing.T) {
	pvc := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "tenant", Name: "copy", UID: "u-1"}}
	req := CloneRequest{TargetNamespace: "tenant", TargetName: "copy", SourceNamespace: "golden", SourceName: "fedora", SourceKind: CloneSourceClaim}
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: CloneRequestName(pvc.UID)}, Data: req.Data()}
	got, err := ReadCloneRequest(cm, pvc)
	if err != nil || got != req {
		t.Fatalf("read %+v %v, want %+v", got, err, req)
	}
	restore := req
	restore.SourceKind = CloneSourceSnapshot
	if got, err := ReadCloneRequest(&corev1.ConfigMap{ObjectMeta: cm.ObjectMeta, Data: restore.Data()}, pvc); err != nil || got != restore {
		t.Fatalf("read %+v %v, want %+v", got, err, restore)
	}
	// Requests written before source kinds existed are claim clones.
	old := &corev1.ConfigMap{ObjectMeta: cm.ObjectMeta, Data: map[string]string{CloneTargetKey: "tenant/copy", CloneSourceKey: "golden/fedora"}}
	if got, err := ReadCloneRequest(old, pvc); err != nil || got != req {
		t.Fatalf("read %+v %v, want %+v", got, err, req)
	}
	for name, bad := range map[string]*corev1.ConfigMap{
		"another claim's uid": {ObjectMeta: metav1.ObjectMeta{Name: CloneRequestName("u-2")}, Data: req.Data()},
		"another target":      {ObjectMeta: metav1.ObjectMeta{Name: cm.Name}, Data: map[string]string{CloneTargetKey: "tenant/other", CloneSourceKey: "golden/fedora"}},
		"no source":           {ObjectMeta: metav1.ObjectMeta{Name: cm.Name}, Data: map[string]string{CloneTargetKey: "tenant/copy"}},
		"source without name": {ObjectMeta: metav1.ObjectMeta{Name: cm.Name}, Data: map[string]string{CloneTargetKey: "tenant/copy", CloneSourceKey: "golden/"}},
		"unknown source kind": {ObjectMeta: metav1.ObjectMeta{Name: cm.Name}, Data: map[string]string{CloneTargetKey: "tenant/copy", CloneSourceKey: "golden/fedora",
			CloneSourceKindKey: "Secret"}},
	} {
		if _, err := ReadCloneRequest(bad, pvc); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}
