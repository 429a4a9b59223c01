package brain

import (
	"context"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/nodevirt/nodevirt/clusterbrain/kit/metrics"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/uploadtls"
	"github.com/nodevirt/nodevirt/test/testkit"
)

// The metrics endpoints carry no authentication, so by default they listen
// on loopback only: the brain's server on its default address answers on
// 127.0.0.1 and refuses a connection to the host's own address.
func TestMetricsListenOnLoopbackByDefault(t *testing.T) {
	host, port, err := net.SplitHostPort(DefaultMetricsAddr)
	if err != nil {
		t.Fatal(err)
	}
	if ip := net.ParseIP(host); ip == nil || !ip.IsLoopback() {
		t.Fatalf("default brain metrics address %s is not loopback", DefaultMetricsAddr)
	}
	// The same rule with a free port: serve on the default host.
	ln, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	_ = port
	s := &metrics.Server{Addr: addr, Registry: metrics.NewRegistry()}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = s.Run(ctx) }()
	testkit.Eventually(t, 5*time.Second, "the metrics server", func() error {
		resp, err := http.Get("http://" + addr + "/metrics")
		if err == nil {
			resp.Body.Close()
		}
		return err
	})
	ip, err := uploadtls.HostIP()
	if err != nil || ip.IsLoopback() {
		t.Skipf("no non-loopback host address to try (%v)", err)
	}
	_, p, _ := net.SplitHostPort(addr)
	if c, err := net.DialTimeout("tcp", net.JoinHostPort(ip.String(), p), 2*time.Second); err == nil {
		c.Close()
		t.Fatalf("metrics answer on the host address %s", ip)
	}
}
