package aggregated

import (
	"context"
	"errors"
	"fmt"

	authv1 "k8s.io/api/authorization/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes"
)

// Authorize asks kube-apiserver whether u may do attrs. A denial is not an
// error: allowed is false and reason says why.
func Authorize(ctx context.Context, kube kubernetes.Interface, u User, attrs authv1.ResourceAttributes) (allowed bool, reason string, err error) {
	extra := map[string]authv1.ExtraValue{}
	for k, v := range u.Extra {
		extra[k] = v
	}
	sar := &authv1.SubjectAccessReview{Spec: authv1.SubjectAccessReviewSpec{
		User: u.Name, UID: u.UID, Groups: u.Groups, Extra: extra, ResourceAttributes: &attrs,
	}}
	res, err := kube.AuthorizationV1().SubjectAccessReviews().Create(ctx, sar, metav1.CreateOptions{})
	if err != nil {
		return false, "", fmt.Errorf("subject access review: %w", err)
	}
	return res.Status.Allowed, res.Status.Reason, nil
}

// Forbidden is the error kube-apiserver itself would return for attrs.
func Forbidden(u User, attrs authv1.ResourceAttributes, reason string) *apierrors.StatusError {
	res := attrs.Resource
	if attrs.Subresource != "" {
		res += "/" + attrs.Subresource
	}
	msg := fmt.Sprintf("User %q cannot %s resource %q in API group %q", u.Name, attrs.Verb, res, attrs.Group)
	if attrs.Namespace != "" {
		msg += fmt.Sprintf(" in the namespace %q", attrs.Namespace)
	}
	if reason != "" {
		msg += ": " + reason
	}
	err := apierrors.NewForbidden(schema.GroupResource{Group: attrs.Group, Resource: res}, attrs.Name, errors.New(msg))
	err.ErrStatus.Message = msg
	return err
}
