package admission

import (
	"time"

	"context"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	admissionregistrationclient "k8s.io/client-go/kubernetes/typed/admissionregistration/v1"
	"k8s.io/client-go/util/retry"
)

func applyMutating(ctx context.Context, c admissionregistrationclient.MutatingWebhookConfigurationInterface, want *admissionregistrationv1.MutatingWebhookConfiguration) error {
	return retry.RetryOnConflict(retry.DefaultRetry, func() error {
		cur, err := c.Get(ctx, want.Name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			_, err = c.Create(ctx, want, metav1.CreateOptions{})
			return err
		}
		if err != nil {
			return err
		}
		cur = cur.DeepCopy()
		cur.Labels, cur.Webhooks = want.Labels, want.Webhooks
		_, err = c.Update(ctx, cur, metav1.UpdateOptions{})
		return err
	})
}

func applyValidating(ctx context.Context, c admissionregistrationclient.ValidatingWebhookConfigurationInterface, want *admissionregistrationv1.ValidatingWebhookConfiguration) error {
	return retry.RetryOnConflict(retry.DefaultRetry, func() error {
		cur, err := c.Get(ctx, want.Name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			_, err = c.Create(ctx, want, metav1.CreateOptions{})
			return err
		}
		if err != nil {
			return err
		}
		cur = cur.DeepCopy()
		cur.Labels, cur.Webhooks = want.Labels, want.Webhooks
		_, err = c.Update(ctx, cur, metav1.UpdateOptions{})
		return err
	})
}

// Uninstall removes the brain's webhook configurations — first, so no
// request is left failing against a brain that is going away — and then the
// certificate secrets in namespace. What is already gone is not an error.
func Uninstall(ctx context.Context, kube kubernetes.Interface, namespace string) error {
	ar := kube.AdmissionregistrationV1()
	if err := ar.MutatingWebhookConfigurations().Delete(ctx, MutatingConfigName, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		return err
	}
	if err := ar.ValidatingWebhookConfigurations().Delete(ctx, ValidatingConfigName, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		return err
	}
	err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		_, e1 := ar.MutatingWebhookConfigurations().Get(ctx, MutatingConfigName, metav1.GetOptions{})
		_, e2 := ar.ValidatingWebhookConfigurations().Get(ctx, ValidatingConfigName, metav1.GetOptions{})
		return apierrors.IsNotFound(e1) && apierrors.IsNotFound(e2), nil
	})
	if err != nil {
		return err
	}
	for _, name := range []string{"nodevirt-brain-ca", "nodevirt-brain-webhook-cert"} {
		if err := kube.CoreV1().Secrets(namespace).Delete(ctx, name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return err
		}
	}
	return nil
}
