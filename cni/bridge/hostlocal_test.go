package bridge

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// hostLocalConf is a network config whose ipam is host-local on dir.
func hostLocalConf(t *testing.T, dir string, ipam map[string]any) []byte {
	t.Helper()
	ipam["type"] = "host-local"
	ipam["dataDir"] = dir
	b, err := json.Marshal(map[string]any{"cniVersion": "1.0.0", "name": "hl", "type": "cnv-bridge", "ipam": ipam})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// runHostLocal runs Debian's host-local binary (the reference this store
// must stay compatible with).
func runHostLocal(t *testing.T, verb, id string, conf []byte) string {
	t.Helper()
	bin := "/usr/lib/cni/host-local"
	if _, err := os.Stat(bin); err != nil {
		t.Skip("containernetworking-plugins not installed")
	}
	cmd := exec.Command(bin)
	cmd.Env = []string{"CNI_COMMAND=" + verb, "CNI_CONTAINERID=" + id, "CNI_IFNAME=eth0",
		"CNI_NETNS=/proc/self/ns/net", "CNI_PATH=/usr/lib/cni"}
	cmd.Stdin = bytes.NewReader(conf)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("host-local %s: %v: %s", verb, err, out)
	}
	return string(out)
}

func TestHostLocalSharesTheBinarysStore(t *testing.T) {
	dir := t.TempDir()
	conf := hostLocalConf(t, dir, map[string]any{"subnet": "10.77.0.0/29"})
	h := nativeHostLocal(conf, "")
	if h == nil {
		t.Fatal("plain subnet config not served natively")
	}
	// The binary takes the first address, we take the next one.
	out := runHostLocal(t, "ADD", "bin", conf)
	if !bytes.Contains([]byte(out), []byte(`"10.77.0.2/29"`)) {
		t.Fatalf("binary ADD: %s", out)
	}
	res, err := h.add("nat", "eth0")
	if err != nil {
		t.Fatal(err)
	}
	if got := res.IPs[0].Address.String(); got != "10.77.0.3/29" {
		t.Fatalf("native ADD got %s, want 10.77.0.3/29 (after the binary's)", got)
	}
	if got := res.IPs[0].Gateway.String(); got != "10.77.0.1" {
		t.Fatalf("gateway %s, want 10.77.0.1", got)
	}
	if _, err := h.add("nat", "eth0"); err == nil {
		t.Fatal("second ADD of the same attachment was accepted")
	}
	// Each releases the other's reservation.
	runHostLocal(t, "DEL", "nat", conf)
	if err := h.release("bin", "eth0"); err != nil {
		t.Fatal(err)
	}
	for _, ip := range []string{"10.77.0.2", "10.77.0.3"} {
		if _, err := os.Stat(filepath.Join(dir, "hl", ip)); !os.IsNotExist(err) {
			t.Fatalf("reservation %s left (err %v)", ip, err)
		}
	}
	if err := h.check("bin", "eth0"); err == nil {
		t.Fatal("CHECK passed without a reservation")
	}
}

func TestHostLocalRoundRobinAndExhaustion(t *testing.T) {
	dir := t.TempDir()
	// .1 is the gateway, .2-.6 usable in a /29 (.7 is broadcast).
	h := nativeHostLocal(hostLocalConf(t, dir, map[string]any{"subnet": "10.78.0.0/29"}), "")
	var got []string
	for i := range 5 {
		res, err := h.add(fmt.Sprint("c", i), "eth0")
		if err != nil {
			t.Fatalf("ADD %d: %v", i, err)
		}
		got = append(got, res.IPs[0].Address.IP.String())
	}
	if fmt.Sprint(got) != "[10.78.0.2 10.78.0.3 10.78.0.4 10.78.0.5 10.78.0.6]" {
		t.Fatalf("allocation order %v", got)
	}
	if _, err := h.add("c5", "eth0"); err == nil {
		t.Fatal("ADD succeeded on a full range")
	}
	// A freed address is reused only after the round robin reaches it.
	if err := h.release("c1", "eth0"); err != nil {
		t.Fatal(err)
	}
	res, err := h.add("c6", "eth0")
	if err != nil {
		t.Fatal(err)
	}
	if ip := res.IPs[0].Address.IP.String(); ip != "10.78.0.3" {
		t.Fatalf("after release got %s, want 10.78.0.3", ip)
	}
}

func TestHostLocalLeavesUnsupportedConfigsToTheBinary(t *testing.T) {
	dir := t.TempDir()
	for name, ipam := range map[string]map[string]any{
		"resolvConf": {"subnet": "10.79.0.0/24", "resolvConf": "/etc/resolv.conf"},
		"overlap":    {"ranges": [][]map[string]string{{{"subnet": "10.79.0.0/24"}}, {{"subnet": "10.79.0.0/25"}}}},
		"bad subnet": {"subnet": "10.79.0.0/33"},
		"no ranges":  {},
	} {
		if nativeHostLocal(hostLocalConf(t, dir, ipam), "") != nil {
			t.Errorf("%s: served natively", name)
		}
	}
	if nativeHostLocal(hostLocalConf(t, dir, map[string]any{"subnet": "10.79.0.0/24"}), "IgnoreUnknown=1;IP=10.79.0.9") != nil {
		t.Error("CNI_ARGS IP= served natively")
	}
}
