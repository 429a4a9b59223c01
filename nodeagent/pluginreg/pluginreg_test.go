package pluginreg

import (
	"context"
	"os"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"github.com/nodevirt/nodevirt/test/testkit"
)

// Kubelet's side of the protocol over the real socket: GetInfo names the
// driver and its endpoint, the verdict is kept, and the socket goes away
// with the role.
func TestKubeletRegistersTheDriver(t *testing.T) {
	dir := t.TempDir()
	r, err := New(Config{Dir: dir, DriverName: "kubevirt.io.hostpath-provisioner", Endpoint: "/var/lib/kubelet/plugins/x/csi.sock"})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	testkit.Eventually(t, 10*time.Second, "the registration socket", func() error {
		_, err := os.Stat(r.Socket())
		return err
	})
	conn, err := grpc.NewClient("unix://"+r.Socket(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	c := registerapi.NewRegistrationClient(conn)
	info, err := c.GetInfo(ctx, &registerapi.InfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if info.Type != registerapi.CSIPlugin || info.Name != "kubevirt.io.hostpath-provisioner" ||
		info.Endpoint != "/var/lib/kubelet/plugins/x/csi.sock" || len(info.SupportedVersions) != 1 {
		t.Errorf("info %+v", info)
	}
	if _, err := c.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{PluginRegistered: false, Error: "no"}); err != nil {
		t.Fatal(err)
	}
	if ok, msg := r.Registered(); ok || msg != "no" {
		t.Errorf("after a refusal: %v %q", ok, msg)
	}
	if _, err := c.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{PluginRegistered: true}); err != nil {
		t.Fatal(err)
	}
	if ok, _ := r.Registered(); !ok {
		t.Error("not registered after kubelet's yes")
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(r.Socket()); !os.IsNotExist(err) {
		t.Errorf("socket left behind: %v", err)
	}
}

func TestWithoutKubeletDoesNothing(t *testing.T) {
	r, err := New(Config{Dir: t.TempDir() + "/missing", DriverName: "d", Endpoint: "/x.sock"})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if err := r.Run(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := New(Config{DriverName: "d", Endpoint: "relative.sock"}); err == nil {
		t.Error("relative endpoint accepted")
	}
}
