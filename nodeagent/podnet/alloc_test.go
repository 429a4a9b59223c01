package podnet

import (
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func testMAC(i int) net.HardwareAddr {
	m, _ := net.ParseMAC(fmt.Sprintf("02:00:00:00:01:%02x", i))
	return m
}

// A /29 has 5 guest addresses (network, gateway and broadcast excluded):
// all are handed out once, the sixth MAC is refused, a release makes room,
// and the table read back from disk is the same.
func TestAllocationsExhaustReleaseReload(t *testing.T) {
	_, subnet, _ := net.ParseCIDR("192.0.2.8/29")
	path := filepath.Join(t.TempDir(), "state", "allocations.json")
	a, err := loadAllocations(path, subnet, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for i := range 5 {
		ip, err := a.assign(fmt.Sprintf("ns/vm%d", i), fmt.Sprintf("tap%d", i), testMAC(i))
		if err != nil {
			t.Fatal(err)
		}
		if ip.Equal(net.ParseIP("192.0.2.8")) || ip.Equal(net.ParseIP("192.0.2.9")) || ip.Equal(net.ParseIP("192.0.2.15")) || !subnet.Contains(ip) {
			t.Fatalf("assigned %s: network, gateway, broadcast or outside", ip)
		}
		if seen[ip.String()] {
			t.Fatalf("%s assigned twice", ip)
		}
		seen[ip.String()] = true
	}
	if _, err := a.assign("ns/vm5", "tap5", testMAC(5)); err == nil || !strings.Contains(err.Error(), "no free address") {
		t.Fatalf("sixth assign = %v, want exhaustion", err)
	}
	// The same MAC again keeps its address, even under a new VMI.
	first := net.ParseIP(a.get(testMAC(0)).IP)
	if ip, err := a.assign("ns/vm0-again", "tapX", testMAC(0)); err != nil || !ip.Equal(first) {
		t.Fatalf("re-assign = %v, %v; want %s", ip, err, first)
	}
	gone, err := a.release("ns/vm0-again", "tapX")
	if err != nil || len(gone) != 1 {
		t.Fatalf("release = %v, %v", gone, err)
	}
	if got, _ := a.release("ns/vm0-again", "tapX"); len(got) != 0 {
		t.Fatal("second release found something")
	}
	ip5, err := a.assign("ns/vm5", "tap5", testMAC(5))
	if err != nil {
		t.Fatal(err)
	}

	b, err := loadAllocations(path, subnet, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	if len(b.all()) != 5 {
		t.Fatalf("reloaded %d allocations, want 5", len(b.all()))
	}
	for i := 1; i <= 5; i++ {
		if x, y := a.get(testMAC(i)), b.get(testMAC(i)); y == nil || *x != *y {
			t.Fatalf("MAC %d: saved %+v, reloaded %+v", i, x, y)
		}
	}
	if b.get(testMAC(0)) != nil || !net.ParseIP(b.get(testMAC(5)).IP).Equal(ip5) {
		t.Fatal("release or new assignment not persisted")
	}
}

// A MAC hashes to a preferred address, so it finds the same one after its
// allocation was released (a VM restarted: VMI deleted and made again).
func TestAllocationsStableAcrossRelease(t *testing.T) {
	_, subnet, _ := net.ParseCIDR("10.244.0.0/24")
	a, err := loadAllocations(filepath.Join(t.TempDir(), "a.json"), subnet, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	ip, err := a.assign("ns/vm", "tap", testMAC(7))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.release("ns/vm", ""); err != nil {
		t.Fatal(err)
	}
	again, err := a.assign("ns/vm", "tap", testMAC(7))
	if err != nil || !again.Equal(ip) {
		t.Fatalf("after release got %v, %v; want %s", again, err, ip)
	}
}

// Entries that no longer fit (the CIDR changed, a hand-edited duplicate)
// are dropped on load; a corrupt file is an error, not an empty table.
func TestAllocationsLoadDropsStale(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "allocations.json")
	content := `{"subnet":"10.1.0.0/24","allocations":[
		{"vmi":"a/old","tap":"t1","mac":"02:00:00:00:00:01","ip":"10.1.0.7"},
		{"vmi":"a/ok","tap":"t2","mac":"02:00:00:00:00:02","ip":"10.2.0.7"},
		{"vmi":"a/dup","tap":"t3","mac":"02:00:00:00:00:03","ip":"10.2.0.7"},
		{"vmi":"a/gw","tap":"t4","mac":"02:00:00:00:00:04","ip":"10.2.0.1"},
		{"vmi":"a/bad","tap":"t5","mac":"zz","ip":"10.2.0.9"}]}`
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	_, subnet, _ := net.ParseCIDR("10.2.0.0/24")
	a, err := loadAllocations(path, subnet, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	all := a.all()
	if len(all) != 1 || all[0].VMI != "a/ok" {
		t.Fatalf("kept %+v, want only a/ok", all)
	}
	if err := os.WriteFile(path, []byte("{not json"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := loadAllocations(path, subnet, slog.Default()); err == nil {
		t.Fatal("corrupt allocation file accepted")
	}
}
