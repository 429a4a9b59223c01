package ssp

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	authv1 "k8s.io/api/authorization/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apiextensionsclient "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	sspv1beta2 "github.com/nodevirt/nodevirt/clusterbrain/api/ssp/v1beta2"
	"github.com/nodevirt/nodevirt/clusterbrain/tekton/manifests"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

func installTektonCRDs(t *testing.T) {
	t.Helper()
	data, err := os.ReadFile("testdata/tekton-crds.yaml")
	if err != nil {
		t.Fatal(err)
	}
	ext := apiextensionsclient.NewForConfigOrDie(controlplane.Shared(t).RestConfig).ApiextensionsV1().CustomResourceDefinitions()
	for _, doc := range strings.Split(string(data), "\n---\n") {
		crd := &apiextensionsv1.CustomResourceDefinition{}
		if err := yaml.Unmarshal([]byte(doc), crd); err != nil {
			t.Fatal(err)
		}
		if _, err := ext.Create(context.Background(), crd, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatal(err)
		}
		name := crd.Name
		t.Cleanup(func() { _ = ext.Delete(context.Background(), name, metav1.DeleteOptions{}) })
		testkit.EventuallyEvery(t, 100*time.Millisecond, 60*time.Second, "CRD "+name+" established", func() error {
			got, err := ext.Get(context.Background(), name, metav1.GetOptions{})
			if err != nil {
				return err
			}
			for _, c := range got.Status.Conditions {
				if c.Type == apiextensionsv1.Established && c.Status == apiextensionsv1.ConditionTrue {
					return nil
				}
			}
			return fmt.Errorf("crd %s not established", name)
		})
	}
}

func TestPipelineTasksDeployedIntoTheTektonNamespace(t *testing.T) {
	e := start(t)
	ctx := context.Background()
	tns := e.ns + "-templates"
	pns := e.ns + "-pipelines"
	t.Cleanup(func() {
		for _, ns := range []string{tns, pns} {
			_ = e.kube.CoreV1().Namespaces().Delete(context.Background(), ns, metav1.DeleteOptions{})
		}
	})
	e.createSSP(t, tns)
	sas := func() int {
		l, err := e.kube.CoreV1().ServiceAccounts(pns).List(ctx, metav1.ListOptions{LabelSelector: tektonSelector})
		if err != nil {
			return -1
		}
		return len(l.Items)
	}
	testkit.EventuallyEvery(t, 100*time.Millisecond, 90*time.Second, "the SSP healthy", e.role.Health)
	if n := sas(); n != 0 {
		t.Fatalf("%d task ServiceAccounts without deployTektonTaskResources", n)
	}

	// Asked for, without Tekton: reported (the role's health, which the
	// HyperConverged's SSP child follows), no crash.
	setGate := func(on bool) {
		t.Helper()
		s, err := e.virt.SSPs.Get(ctx, e.ns, "ssp")
		if err != nil {
			t.Fatal(err)
		}
		s.Spec.TektonPipelines = &sspv1beta2.TektonObjects{Namespace: pns}
		s.Spec.FeatureGates = &sspv1beta2.SSPFeatureGates{DeployTektonTaskResources: on}
		if s.Labels == nil {
			s.Labels = map[string]string{}
		}
		s.Labels["kick"] = fmt.Sprint(time.Now().UnixNano())
		if _, err := e.virt.SSPs.Update(ctx, s); err != nil {
			t.Fatal(err)
		}
	}
	setGate(true)
	testkit.EventuallyEvery(t, 100*time.Millisecond, 60*time.Second, "health naming the missing Tekton CRD", func() error {
		if err := e.role.Health(); err == nil || !strings.Contains(err.Error(), "CRD tasks.tekton.dev not found") {
			return fmt.Errorf("health %v, want the missing Tekton CRD named", err)
		}
		return nil
	})

	installTektonCRDs(t)
	setGate(true)
	names := manifests.TaskNames()
	testkit.EventuallyEvery(t, 100*time.Millisecond, 120*time.Second, "the Tekton tasks deployed", func() error {
		if err := e.role.Health(); err != nil {
			return err
		}
		tasks, err := e.dyn.Resource(TektonTasksGVR).Namespace(pns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return err
		}
		if len(tasks.Items) != len(names) {
			return fmt.Errorf("%d tasks in %s, want %d", len(tasks.Items), pns, len(names))
		}
		if n := sas(); n != len(names) {
			return fmt.Errorf("%d ServiceAccounts", n)
		}
		return nil
	})
	for _, n := range names {
		cr, err := e.kube.RbacV1().ClusterRoles().Get(ctx, n+"-task", metav1.GetOptions{})
		if err != nil || len(cr.Rules) == 0 {
			t.Errorf("ClusterRole %s-task: %v", n, err)
		}
		rb, err := e.kube.RbacV1().RoleBindings(pns).Get(ctx, n+"-task", metav1.GetOptions{})
		if err != nil || rb.RoleRef.Name != n+"-task" || rb.Subjects[0].Name != n+"-task" {
			t.Errorf("RoleBinding %s-task: %v %+v", n, err, rb)
		}
	}
	pipes, err := e.dyn.Resource(TektonPipelinesGVR).Namespace(pns).List(ctx, metav1.ListOptions{})
	if err != nil || len(pipes.Items) != 2 {
		t.Fatalf("pipelines: %v %d", err, len(pipes.Items))
	}
	for _, p := range pipes.Items {
		data, _ := p.MarshalJSON()
		if strings.Contains(string(data), manifests.TasksNamespacePlaceholder) || !strings.Contains(string(data), `"value":"`+pns+`"`) {
			t.Errorf("pipeline %s does not resolve its tasks in %s", p.GetName(), pns)
		}
	}
	// The ServiceAccount may do what its task needs, and no more.
	sar := func(sa, verb, group, resource string) bool {
		t.Helper()
		ok, err := canI(ctx, e, "system:serviceaccount:"+pns+":"+sa, pns, verb, group, resource)
		if err != nil {
			t.Fatal(err)
		}
		return ok
	}
	if !sar("copy-template-task", "create", "template.openshift.io", "templates") || sar("copy-template-task", "delete", "kubevirt.io", "virtualmachines") {
		t.Error("copy-template-task's permissions are not its task's")
	}

	// Turned off, everything goes.
	setGate(false)
	testkit.EventuallyEvery(t, 100*time.Millisecond, 60*time.Second, "the Tekton tasks removed", func() error {
		tasks, err := e.dyn.Resource(TektonTasksGVR).Namespace(pns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return err
		}
		if len(tasks.Items) != 0 || sas() != 0 {
			return fmt.Errorf("%d tasks, %d ServiceAccounts left", len(tasks.Items), sas())
		}
		if _, err := e.kube.RbacV1().ClusterRoles().Get(ctx, "copy-template-task", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
			return fmt.Errorf("ClusterRole left: %v", err)
		}
		return nil
	})
}

// canI asks the API server whether user may do verb on group/resource in ns.
func canI(ctx context.Context, e *env, user, ns, verb, group, resource string) (bool, error) {
	r, err := e.kube.AuthorizationV1().SubjectAccessReviews().Create(ctx, &authv1.SubjectAccessReview{Spec: authv1.SubjectAccessReviewSpec{
		User: user, Groups: []string{"system:serviceaccounts", "system:serviceaccounts:" + ns},
		ResourceAttributes: &authv1.ResourceAttributes{Namespace: ns, Verb: verb, Group: group, Resource: resource}}}, metav1.CreateOptions{})
	if err != nil {
		return false, err
	}
	return r.Status.Allowed, nil
}
