package aggregated

import (
	"context"
	"encoding/base64"
	"fmt"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
)

var apiServiceGVR = schema.GroupVersionResource{Group: "apiregistration.k8s.io", Version: "v1", Resource: "apiservices"}

// Registration says which API group this process serves and where.
type Registration struct {
	// Group and Versions are the API served (one APIService per version).
	Group    string
	Versions []string
	// Namespace and Service name the selector-less Service fronting it.
	Namespace, Service string
	// IP and Port are where kube-apiserver dials (with
	// --enable-aggregator-routing it dials the endpoint, not the Service).
	IP   net.IP
	Port int
	// GroupPriorityMinimum and VersionPriority order discovery (KubeVirt
	// uses 1000 and 15).
	GroupPriorityMinimum, VersionPriority int64
}

// ServerName is the DNS name kube-apiserver verifies the serving certificate
// against.
func (r Registration) ServerName() string {
	return r.Service + "." + r.Namespace + ".svc"
}

// Discovery reports whether req asks for the registration's discovery or
// health: what kube-apiserver reads without a user (the APIService's
// availability check, discovery, OpenAPI).
func (r Registration) Discovery(req *http.Request) bool {
	switch p := strings.TrimSuffix(req.URL.Path, "/"); p {
	case "", "/apis", "/apis/" + r.Group, "/healthz", "/openapi/v2", "/openapi/v3":
		return true
	default:
		return slices.Contains(r.Versions, strings.TrimPrefix(p, "/apis/"+r.Group+"/"))
	}
}

const portName = "https"

// Register creates or updates the Service, its EndpointSlice
// and the APIServices, with caBundle as the CA kube-apiserver trusts.
// Another replica registering later points the endpoints at itself; with
// several replicas each adds itself instead of replacing the others.
func Register(ctx context.Context, kube kubernetes.Interface, dyn dynamic.Interface, r Registration, caBundle []byte) error {
	if err := RegisterEndpoint(ctx, kube, r); err != nil {
		return err
	}
	for _, v := range r.Versions {
		if err := r.registerAPIService(ctx, dyn, v, caBundle, r.labels()); err != nil {
			return err
		}
	}
	return nil
}

func (r Registration) labels() map[string]string {
	return map[string]string{"app.kubernetes.io/managed-by": "nodevirt", "app.kubernetes.io/component": r.Service}
}

// RegisterEndpoint creates or updates the selector-less Service (port 443)
// and its EndpointSlice naming this replica, and drops the endpoints of
// replicas that no longer answer: what a webhook configuration's service
// reference, like an APIService, needs behind it.
func RegisterEndpoint(ctx context.Context, kube kubernetes.Interface, r Registration) error {
	labels := r.labels()
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: r.Service, Namespace: r.Namespace, Labels: labels},
		Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{
			Name: portName, Port: 443, Protocol: corev1.ProtocolTCP, TargetPort: intstr.FromInt32(int32(r.Port)),
		}}},
	}
	services := kube.CoreV1().Services(r.Namespace)
	if cur, err := services.Get(ctx, r.Service, metav1.GetOptions{}); apierrors.IsNotFound(err) {
		if _, err := services.Create(ctx, svc, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("create service %s/%s: %w", r.Namespace, r.Service, err)
		}
	} else if err != nil {
		return fmt.Errorf("read service %s/%s: %w", r.Namespace, r.Service, err)
	} else if len(cur.Spec.Selector) > 0 || len(cur.Spec.Ports) != 1 || cur.Spec.Ports[0].TargetPort.IntValue() != r.Port {
		cur = cur.DeepCopy()
		cur.Spec.Selector = nil
		cur.Spec.Ports = svc.Spec.Ports
		if _, err := services.Update(ctx, cur, metav1.UpdateOptions{}); err != nil {
			return fmt.Errorf("update service %s/%s: %w", r.Namespace, r.Service, err)
		}
	}
	return r.registerSlice(ctx, kube, labels)
}

func (r Registration) registerSlice(ctx context.Context, kube kubernetes.Interface, labels map[string]string) error {
	ready := true
	name, proto, port := portName, corev1.ProtocolTCP, int32(r.Port)
	l := map[string]string{
		discoveryv1.LabelServiceName: r.Service,
		discoveryv1.LabelManagedBy:   "nodevirt",
	}
	for k, v := range labels {
		l[k] = v
	}
	addrType := discoveryv1.AddressTypeIPv4
	if r.IP.To4() == nil {
		addrType = discoveryv1.AddressTypeIPv6
	}
	want := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: r.Service, Namespace: r.Namespace, Labels: l},
		AddressType: addrType,
		Endpoints:   []discoveryv1.Endpoint{{Addresses: []string{r.IP.String()}, Conditions: discoveryv1.EndpointConditions{Ready: &ready}}},
		Ports:       []discoveryv1.EndpointPort{{Name: &name, Protocol: &proto, Port: &port}},
	}
	slices := kube.DiscoveryV1().EndpointSlices(r.Namespace)
	cur, err := slices.Get(ctx, r.Service, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		if _, err := slices.Create(ctx, want, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("create endpointslice %s/%s: %w", r.Namespace, r.Service, err)
		}
		return nil
	}
	if err != nil {
		return fmt.Errorf("read endpointslice %s/%s: %w", r.Namespace, r.Service, err)
	}
	cur = cur.DeepCopy()
	addr := r.IP.String()
	found := false
	live := cur.Endpoints[:0]
	for _, e := range cur.Endpoints {
		keep := false
		for _, a := range e.Addresses {
			found = found || a == addr
			// Endpoints of replicas that no longer answer are dropped.
			keep = keep || a == addr || len(cur.Ports) == 1 && cur.Ports[0].Port != nil &&
				Answers(net.JoinHostPort(a, strconv.Itoa(int(*cur.Ports[0].Port))))
		}
		if keep {
			live = append(live, e)
		}
	}
	pruned := len(live) != len(cur.Endpoints)
	cur.Endpoints = live
	if found && !pruned && len(cur.Ports) == 1 && cur.Ports[0].Port != nil && *cur.Ports[0].Port == port {
		return nil
	}
	if len(cur.Ports) != 1 || cur.Ports[0].Port == nil || *cur.Ports[0].Port != port {
		cur.Endpoints = nil // another port: the old endpoints are stale
	}
	cur.Labels, cur.AddressType, cur.Ports = l, addrType, want.Ports
	if !found || len(cur.Endpoints) == 0 {
		cur.Endpoints = append(cur.Endpoints, want.Endpoints...)
	}
	if _, err := slices.Update(ctx, cur, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("update endpointslice %s/%s: %w", r.Namespace, r.Service, err)
	}
	return nil
}

func (r Registration) registerAPIService(ctx context.Context, dyn dynamic.Interface, version string, caBundle []byte, labels map[string]string) error {
	name := version + "." + r.Group
	gp, vp := r.GroupPriorityMinimum, r.VersionPriority
	if gp == 0 {
		gp = 1000
	}
	if vp == 0 {
		vp = 15
	}
	lbl := map[string]any{}
	for k, v := range labels {
		lbl[k] = v
	}
	spec := map[string]any{
		"group": r.Group, "version": version,
		"service":              map[string]any{"namespace": r.Namespace, "name": r.Service, "port": int64(443)},
		"caBundle":             base64.StdEncoding.EncodeToString(caBundle),
		"groupPriorityMinimum": gp, "versionPriority": vp,
	}
	apis := dyn.Resource(apiServiceGVR)
	cur, err := apis.Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		obj := &unstructured.Unstructured{Object: map[string]any{
			"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
			"metadata": map[string]any{"name": name, "labels": lbl},
			"spec":     spec,
		}}
		if _, err := apis.Create(ctx, obj, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("create apiservice %s: %w", name, err)
		}
		return nil
	}
	if err != nil {
		return fmt.Errorf("read apiservice %s: %w", name, err)
	}
	cur = cur.DeepCopy()
	cur.Object["spec"] = spec
	if _, err := apis.Update(ctx, cur, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("update apiservice %s: %w", name, err)
	}
	return nil
}

// Unregister deletes the APIServices, Service and EndpointSlice;
// what is already gone is fine.
func Unregister(ctx context.Context, kube kubernetes.Interface, dyn dynamic.Interface, r Registration) error {
	ignore := func(err error) error {
		if apierrors.IsNotFound(err) {
			return nil
		}
		return err
	}
	for _, v := range r.Versions {
		if err := ignore(dyn.Resource(apiServiceGVR).Delete(ctx, v+"."+r.Group, metav1.DeleteOptions{})); err != nil {
			return fmt.Errorf("delete apiservice %s.%s: %w", v, r.Group, err)
		}
	}
	return UnregisterEndpoint(ctx, kube, r)
}

// UnregisterEndpoint deletes the Service and EndpointSlice; what is
// already gone is fine.
func UnregisterEndpoint(ctx context.Context, kube kubernetes.Interface, r Registration) error {
	if err := kube.CoreV1().Services(r.Namespace).Delete(ctx, r.Service, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete service: %w", err)
	}
	if err := kube.DiscoveryV1().EndpointSlices(r.Namespace).Delete(ctx, r.Service, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete endpointslice: %w", err)
	}
	return nil
}

// APIServiceAvailable reports whether kube-apiserver marked the APIService
// of version available, with its message when not.
func APIServiceAvailable(ctx context.Context, dyn dynamic.Interface, group, version string) (bool, string, error) {
	obj, err := dyn.Resource(apiServiceGVR).Get(ctx, version+"."+group, metav1.GetOptions{})
	if err != nil {
		return false, "", err
	}
	conds, _, _ := unstructured.NestedSlice(obj.Object, "status", "conditions")
	for _, c := range conds {
		m, _ := c.(map[string]any)
		if m["type"] == "Available" {
			msg, _ := m["message"].(string)
			return m["status"] == "True", msg, nil
		}
	}
	return false, "no Available condition yet", nil
}

// Hosts are the names a serving certificate behind the Service must be
// valid for (kube-apiserver verifies ServerName), with the endpoint's
// address once known.
func (r Registration) Hosts() []string {
	hosts := []string{r.ServerName(), r.ServerName() + ".cluster.local", r.Service + "." + r.Namespace}
	if r.IP != nil {
		hosts = append(hosts, r.IP.String())
	}
	return hosts
}

// Resolve fills IP and Port, when unset, from addr, the address the server
// listens on (a host address when it listens on all of them). Loopback is
// refused: kube-apiserver does not dial loopback endpoints.
func (r *Registration) Resolve(addr net.Addr) error {
	tcp, ok := addr.(*net.TCPAddr)
	if !ok {
		return fmt.Errorf("endpoint of %s/%s: %s is not a tcp address", r.Namespace, r.Service, addr)
	}
	if r.Port == 0 {
		r.Port = tcp.Port
	}
	if r.IP == nil {
		r.IP = tcp.IP
		if r.IP.IsUnspecified() {
			ip, err := hostIP()
			if err != nil {
				return err
			}
			r.IP = ip
		}
	}
	if r.IP.IsLoopback() {
		return fmt.Errorf("endpoint of %s/%s on %s: kube-apiserver refuses loopback endpoints; listen on a host address or on all addresses", r.Namespace, r.Service, addr)
	}
	return nil
}

// Endpoint is the host:port kube-apiserver dials.
func (r Registration) Endpoint() string {
	return net.JoinHostPort(r.IP.String(), strconv.Itoa(r.Port))
}
