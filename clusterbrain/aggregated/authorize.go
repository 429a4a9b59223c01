package aggregated

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"

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

// WriteError writes err as a Kubernetes Status; errors that are not API
// status errors become 500 Internal Error.
func WriteError(w http.ResponseWriter, err error) {
	var se apierrors.APIStatus
	if !errors.As(err, &se) {
		se = apierrors.NewInternalError(err)
	}
	st := se.Status()
	st.Kind, st.APIVersion = "Status", "v1"
	if st.Status == "" {
		st.Status = metav1.StatusFailure
	}
	code := int(st.Code)
	if code == 0 {
		code = http.StatusInternalServerError
	}
	WriteJSON(w, code, &st)
}

// WriteJSON writes v as JSON with status code.
func WriteJSON(w http.ResponseWriter, code int, v any) {
	data, err := json.Marshal(v)
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_, _ = w.Write(data)
}
