package kvm

import (
	"testing"
	"time"
)

func TestProbeMissingDevice(t *testing.T) {
	r := Probe("/nonexistent/kvm", time.Second)
	if r.Usable || r.Reason == "" {
		t.Fatalf("missing device probed as %+v", r)
	}
}

func TestProbeHostDevice(t *testing.T) {
	if !Present("/dev/kvm") {
		t.Skip("this host has no /dev/kvm")
	}
	r := Probe("/dev/kvm", 3*time.Second)
	t.Logf("kvm probe: usable=%v reason=%s", r.Usable, r.Reason)
	if r.Reason == "" {
		t.Fatal("probe gave no reason")
	}
}
