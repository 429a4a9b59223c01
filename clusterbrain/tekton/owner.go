package tekton

import (
	"context"
	"flag"
	"fmt"
	"os"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/client/virtctl"
)

// The Task gives the step its pod through the downward API.
const (
	PodNameEnv      = "POD_NAME"
	PodNamespaceEnv = "POD_NAMESPACE"
)

// podOwner is the setOwnerReference parameter: the created object is
// owned by the TaskRun's pod, so it goes when the TaskRun's pods do.
type podOwner struct{ on *string }

func ownerFlag(fs *flag.FlagSet) podOwner {
	return podOwner{fs.String("setOwnerReference", "false", "true or false: make the task's pod ($POD_NAME in $POD_NAMESPACE) the owner of the new object")}
}

func (o podOwner) set(ctx context.Context, c *virtctl.Client, obj metav1.Object) error {
	on, err := boolParam("setOwnerReference", *o.on)
	if err != nil || !on {
		return err
	}
	name, ns := os.Getenv(PodNameEnv), os.Getenv(PodNamespaceEnv)
	if name == "" || ns == "" {
		return fmt.Errorf("setOwnerReference: $%s and $%s name no pod", PodNameEnv, PodNamespaceEnv)
	}
	if ns != obj.GetNamespace() {
		return fmt.Errorf("setOwnerReference: the pod is in %s, the object in %s (owners are namespaced)", ns, obj.GetNamespace())
	}
	pod, err := c.Kube.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("setOwnerReference: pod %s/%s: %w", ns, name, err)
	}
	obj.SetOwnerReferences(append(obj.GetOwnerReferences(), metav1.OwnerReference{
		APIVersion: "v1", Kind: "Pod", Name: pod.Name, UID: pod.UID}))
	return nil
}
