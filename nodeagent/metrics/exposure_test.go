package metrics

import (
	"net"
	"testing"
)

// The node's metrics carry no authentication: by default they listen on
// loopback only.
func TestDefaultAddrIsLoopback(t *testing.T) {
	var c Config
	c.defaults()
	host, _, err := net.SplitHostPort(c.Addr)
	if err != nil {
		t.Fatal(err)
	}
	if ip := net.ParseIP(host); ip == nil || !ip.IsLoopback() {
		t.Fatalf("default metrics address %q is not loopback", c.Addr)
	}
}
