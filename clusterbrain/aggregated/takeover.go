package aggregated

import (
	"context"
	"log/slog"
	"net"
	"strconv"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// TakeoverInterval is how often a brain checks that the endpoint its API
// is registered at still answers.
const TakeoverInterval = 5 * time.Second

// Answers reports whether something accepts TCP connections at addr
// within a second.
func Answers(addr string) bool {
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		return false
	}
	c.Close()
	return true
}

// EndpointsAnswer reports whether the EndpointSlice namespace/name names
// an endpoint that answers: the replica that registered last is alive.
func EndpointsAnswer(ctx context.Context, kube kubernetes.Interface, namespace, name string) (bool, error) {
	live, _, err := probeEndpoints(ctx, kube, namespace, name)
	return live > 0, err
}

// EndpointsAllAnswer reports whether the EndpointSlice namespace/name names
// endpoints and every one of them answers. Callers that pick an endpoint
// per request (kube-apiserver calling a webhook) fail on a dead one, so it
// must go as soon as it dies.
func EndpointsAllAnswer(ctx context.Context, kube kubernetes.Interface, namespace, name string) (bool, error) {
	live, dead, err := probeEndpoints(ctx, kube, namespace, name)
	return live > 0 && dead == 0, err
}

// probeEndpoints counts the EndpointSlice's addresses that answer and
// those that do not (none of either when it is missing or malformed).
func probeEndpoints(ctx context.Context, kube kubernetes.Interface, namespace, name string) (live, dead int, err error) {
	slice, err := kube.DiscoveryV1().EndpointSlices(namespace).Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return 0, 0, nil
	}
	if err != nil {
		return 0, 0, err
	}
	if len(slice.Ports) != 1 || slice.Ports[0].Port == nil {
		return 0, 0, nil
	}
	port := strconv.Itoa(int(*slice.Ports[0].Port))
	for _, e := range slice.Endpoints {
		for _, a := range e.Addresses {
			if Answers(net.JoinHostPort(a, port)) {
				live++
			} else {
				dead++
			}
		}
	}
	return live, dead, nil
}

// KeepRegistered takes a registration over until ctx ends: every
// TakeoverInterval it asks alive whether the registered server answers and
// calls register when it does not. With several brains, each serving its
// own port or host, an API or webhook moves to a live brain within
// TakeoverInterval of the registered one dying.
func KeepRegistered(ctx context.Context, log *slog.Logger, what string, alive func(context.Context) bool, register func(context.Context) error) {
	t := time.NewTicker(TakeoverInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if alive(ctx) {
			continue
		}
		log.Info("registered server gone: taking over", "registration", what)
		if err := register(ctx); err != nil && ctx.Err() == nil {
			log.Warn("take over", "registration", what, "err", err)
		}
	}
}

// SliceAnswers is an alive check for KeepRegistered: whether an endpoint
// of the EndpointSlice namespace/name answers. A failed read counts as
// alive (nothing is known to be dead).
func SliceAnswers(kube kubernetes.Interface, namespace, name string) func(context.Context) bool {
	return func(ctx context.Context) bool {
		ok, err := EndpointsAnswer(ctx, kube, namespace, name)
		return err != nil || ok
	}
}
