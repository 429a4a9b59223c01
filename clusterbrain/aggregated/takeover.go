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
	slice, err := kube.DiscoveryV1().EndpointSlices(namespace).Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	if len(slice.Ports) != 1 || slice.Ports[0].Port == nil {
		return false, nil
	}
	port := strconv.Itoa(int(*slice.Ports[0].Port))
	for _, e := range slice.Endpoints {
		for _, a := range e.Addresses {
			if Answers(net.JoinHostPort(a, port)) {
				return true, nil
			}
		}
	}
	return false, nil
}

// keepRegistered takes the registration over whenever no registered
// endpoint answers: with several brains, each serving its own port or
// host, the API moves to a live one within TakeoverInterval of the
// registered one dying.
func (s *Server) keepRegistered(ctx context.Context, register func(context.Context) error) {
	t := time.NewTicker(TakeoverInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		r := s.cfg.Registration
		KeepRegistered(ctx, s.cfg.Kube, r.Namespace, r.Service, s.cfg.Log.With("group", r.Group), register)
	}
}

// KeepRegistered is one round of the takeover: register again when no
// endpoint of the slice namespace/name answers.
func KeepRegistered(ctx context.Context, kube kubernetes.Interface, namespace, name string, log *slog.Logger, register func(context.Context) error) {
	alive, err := EndpointsAnswer(ctx, kube, namespace, name)
	if err != nil || alive {
		return
	}
	log.Info("registered endpoint gone: taking the api over", "endpointslice", namespace+"/"+name)
	if err := register(ctx); err != nil && ctx.Err() == nil {
		log.Warn("take the api over", "endpointslice", namespace+"/"+name, "err", err)
	}
}
