package controller

import (
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/record"
)

// Recorder records Events as component. Events recorded before Start are
// kept in the broadcaster's buffer; after stop they are dropped.
type Recorder struct {
	record.EventRecorder
	broadcaster record.EventBroadcaster
}

// NewRecorder returns a recorder whose objects' kinds scheme knows.
func NewRecorder(scheme *runtime.Scheme, component string) *Recorder {
	return newRecorder(scheme, corev1.EventSource{Component: component})
}

// NewNodeRecorder is NewRecorder for a component running on node (the
// events' source host).
func NewNodeRecorder(scheme *runtime.Scheme, component, node string) *Recorder {
	return newRecorder(scheme, corev1.EventSource{Component: component, Host: node})
}

func newRecorder(scheme *runtime.Scheme, source corev1.EventSource) *Recorder {
	b := record.NewBroadcaster()
	return &Recorder{EventRecorder: b.NewRecorder(scheme, source), broadcaster: b}
}

// EventsClient is the part of a clientset events are written with.
type EventsClient interface {
	CoreV1() typedcorev1.CoreV1Interface
}

var _ EventsClient = (kubernetes.Interface)(nil)

// Start sends the recorded events to the API server of kube until stop is
// called.
func (r *Recorder) Start(kube EventsClient) (stop func()) {
	w := r.broadcaster.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: kube.CoreV1().Events("")})
	return func() {
		w.Stop()
		r.broadcaster.Shutdown()
	}
}
