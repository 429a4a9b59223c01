package node

import (
	"os"
	"path/filepath"
	"testing"
)

func TestDefaultRouteInterface(t *testing.T) {
	file := filepath.Join(t.TempDir(), "route")
	table := "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n" +
		"br0\t0000A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n" +
		"eth1\t00000000\t0100A8C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n"
	if err := os.WriteFile(file, []byte(table), 0o644); err != nil {
		t.Fatal(err)
	}
	if got := defaultRouteInterface(file); got != "eth1" {
		t.Fatalf("default route interface = %q, want eth1", got)
	}
	if err := os.WriteFile(file, []byte(table[:len(table)-len("eth1\t00000000\t0100A8C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n")]), 0o644); err != nil {
		t.Fatal(err)
	}
	if got := defaultRouteInterface(file); got != "" {
		t.Fatalf("without a default route got %q", got)
	}
}

func TestInternalIPNeverLoopback(t *testing.T) {
	if _, err := InternalIP("127.0.0.1"); err == nil {
		t.Fatal("loopback accepted as node ip")
	}
	if _, err := InternalIP("192.0.2.254"); err == nil {
		t.Fatal("an address the host does not have was accepted")
	}
	ip, err := InternalIP("")
	if err != nil {
		t.Skipf("host has no global ipv4 address: %v", err)
	}
	if ip.IsLoopback() || !hasAddress(ip) {
		t.Fatalf("chosen node ip %s is loopback or not the host's", ip)
	}
	again, err := InternalIP(ip.String())
	if err != nil || !again.Equal(ip) {
		t.Fatalf("explicit %s: %v %v", ip, again, err)
	}
}
