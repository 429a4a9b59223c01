package agent

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	csispec "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	hppv1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hostpathprovisioner/v1beta1"
	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	"github.com/nodevirt/nodevirt/clusterbrain/api/poolstate"
	"github.com/nodevirt/nodevirt/clusterbrain/hostpathprovisioner"
	"github.com/nodevirt/nodevirt/clusterbrain/rbac"
	"github.com/nodevirt/nodevirt/csi"
	"github.com/nodevirt/nodevirt/launcher/libvirttest"
	"github.com/nodevirt/nodevirt/nodeagent/console"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/testkit"
)

// TestAgentServesHostPathProvisionerPools runs the whole agent under the
// node role and the brain's HostPathProvisioner controller against the real
// API server. A HostPathProvisioner's pool selected for the node is opened
// (a CSI volume lands in <path>/csi), a pvcTemplate pool is refused on the
// node and in status, a pool named like one of --pools is served from the
// flag's directory; status counts the node, a StorageClass per served pool
// appears. When the placement stops selecting the node the pool is kept
// while it holds a volume, and closed once empty.
func TestAgentServesHostPathProvisionerPools(t *testing.T) {
	cp := controlplane.Shared(t)
	admin := cp.Clientset(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	testkit.InstallCRDs(t, cp)
	testkit.InstallSnapshotCRDs(t, cp)
	if err := rbac.EnsureDaemons(ctx, admin); err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	virt, err := client.NewSet(cp.RestConfig)
	if err != nil {
		t.Fatal(err)
	}
	brain, err := hostpathprovisioner.New(hostpathprovisioner.Config{Kube: admin, Virt: virt, Version: "test", Log: log})
	if err != nil {
		t.Fatal(err)
	}
	brainDone := make(chan error, 1)
	go func() { brainDone <- brain.Run(ctx) }()

	suffix := fmt.Sprint(time.Now().UnixNano() % 100000)
	node := "pools-node-" + suffix
	kc := filepath.Join(t.TempDir(), "kubeconfig")
	if err := cp.WriteKubeconfig(kc, identity.NodeUser(node), identity.NodesGroup); err != nil {
		t.Fatal(err)
	}
	state, hostDirs := t.TempDir(), t.TempDir()
	// The agent's pools get shared bind mounts of their volumes directories.
	testkit.UnmountBelowAtCleanup(t, state)
	testkit.UnmountBelowAtCleanup(t, hostDirs)
	flagPool := filepath.Join(state, "pools", "default")
	a, err := New(Config{Kubeconfig: kc, NodeName: node, StateDir: state, HealthAddr: freePort(t),
		Emulation: EmulationOn, LibvirtURI: libvirttest.Ensure(t), CSISocket: filepath.Join(state, "csi.sock"),
		Pools: map[string]string{"default": flagPool}, Console: console.Config{Addr: "-"}, UploadAddr: "-", MetricsAddr: "-", PodCIDR: "-",
		KubeletPluginDir: "-", BrainNamespace: "kube-system", Heartbeat: 2 * time.Second, FencingWindow: time.Minute, SelfFence: "none", Log: log})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	defer func() {
		cancel()
		for _, c := range []chan error{done, brainDone} {
			select {
			case err := <-c:
				if err != nil {
					t.Errorf("stopped with: %v", err)
				}
			case <-time.After(20 * time.Second):
				t.Error("did not stop within 20s")
			}
		}
	}()

	fast, claim := "fast-"+suffix, "claim-"+suffix
	hpp := &hppv1beta1.HostPathProvisioner{
		ObjectMeta: metav1.ObjectMeta{Name: "hpp-" + suffix},
		Spec: hppv1beta1.HostPathProvisionerSpec{
			ImagePullPolicy: corev1.PullIfNotPresent,
			StoragePools: []hppv1beta1.StoragePool{
				{Name: fast, Path: filepath.Join(hostDirs, "fast")},
				{Name: claim, Path: filepath.Join(hostDirs, "claim"), PVCTemplate: &corev1.PersistentVolumeClaimSpec{}},
				{Name: "default", Path: filepath.Join(hostDirs, "other")},
			},
			Workload: hppv1beta1.NodePlacement{NodeSelector: map[string]string{csi.TopologyKey: node}},
		},
	}
	if hpp, err = virt.HostPathProvisioners.Create(ctx, hpp); err != nil {
		t.Fatal(err)
	}
	defer virt.HostPathProvisioners.Delete(context.Background(), "", hpp.Name, metav1.DeleteOptions{})

	// The node reports each pool.
	var reported poolstate.NodePools
	testkit.Eventually(t, 60*time.Second, "node reports the pools", func() error {
		n, err := admin.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if reported, err = poolstate.Decode(n); err != nil {
			return err
		}
		if s, ok := reported.For(fast, hpp.Name); !ok || s.Phase != poolstate.PhaseReady {
			return fmt.Errorf("pools reported: %+v", reported)
		}
		return nil
	})
	if s, _ := reported.For(fast, hpp.Name); s.Path != filepath.Join(hostDirs, "fast", "csi") {
		t.Errorf("pool %s served at %s, want <path>/csi", fast, s.Path)
	}
	if s, ok := reported.For(claim, hpp.Name); !ok || s.Phase != poolstate.PhaseRefused || !strings.Contains(s.Message, "pvcTemplate") {
		t.Errorf("pvcTemplate pool reported %+v, want refused naming pvcTemplate", s)
	}
	if s, ok := reported.For("default", hpp.Name); !ok || s.Phase != poolstate.PhaseReady || s.Path != flagPool ||
		!strings.Contains(s.Message, "--pools") {
		t.Errorf("pool named like a --pools pool reported %+v, want served from %s", s, flagPool)
	}
	if _, err := os.Stat(filepath.Join(hostDirs, "other")); err == nil {
		t.Error("the overridden pool's directory was made")
	}

	// The brain's status and classes.
	testkit.Eventually(t, 60*time.Second, "status counts the node", func() error {
		got, err := virt.HostPathProvisioners.Get(ctx, "", hpp.Name)
		if err != nil {
			return err
		}
		byName := map[string]hppv1beta1.StoragePoolStatus{}
		for _, s := range got.Status.StoragePoolStatuses {
			byName[s.Name] = s
		}
		if s := byName[fast]; s.Phase != hppv1beta1.StoragePoolReady || s.DesiredReady != 1 || s.CurrentReady != 1 {
			return fmt.Errorf("pool %s status %+v", fast, s)
		}
		if s := byName[claim]; s.Phase != hppv1beta1.StoragePoolRefused {
			return fmt.Errorf("pool %s status %+v", claim, s)
		}
		if c := condition(got, "Degraded"); c.Status != "True" || !strings.Contains(c.Message, claim) || !strings.Contains(c.Message, "pvcTemplate") {
			return fmt.Errorf("degraded %+v", c)
		}
		if c := condition(got, "Available"); c.Status != "True" {
			return fmt.Errorf("available %+v", c)
		}
		return nil
	})
	sc, err := admin.StorageV1().StorageClasses().Get(ctx, hostpathprovisioner.ClassPrefix+fast, metav1.GetOptions{})
	if err != nil || sc.Provisioner != csi.DriverName || sc.Parameters[csi.ParamStoragePool] != fast {
		t.Fatalf("storage class of pool %s: %+v %v", fast, sc, err)
	}
	defer admin.StorageV1().StorageClasses().Delete(context.Background(), sc.Name, metav1.DeleteOptions{})
	if _, err := admin.StorageV1().StorageClasses().Get(ctx, hostpathprovisioner.ClassPrefix+claim, metav1.GetOptions{}); err == nil {
		t.Error("a refused pool got a storage class")
	}

	// A volume of the pool, made through the agent's CSI socket.
	conn, err := grpc.NewClient("unix://"+filepath.Join(state, "csi.sock"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctrl := csispec.NewControllerClient(conn)
	mount := []*csispec.VolumeCapability{{AccessType: &csispec.VolumeCapability_Mount{Mount: &csispec.VolumeCapability_MountVolume{}},
		AccessMode: &csispec.VolumeCapability_AccessMode{Mode: csispec.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}}
	vol, err := ctrl.CreateVolume(ctx, &csispec.CreateVolumeRequest{Name: "pvc-" + suffix, VolumeCapabilities: mount,
		CapacityRange: &csispec.CapacityRange{RequiredBytes: 16 << 20}, Parameters: sc.Parameters})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(hostDirs, "fast", "csi", "volumes", vol.GetVolume().GetVolumeId()+".img")); err != nil {
		t.Fatalf("volume not in the pool's directory: %v", err)
	}
	deleted := false
	defer func() {
		if !deleted {
			ctrl.DeleteVolume(context.Background(), &csispec.DeleteVolumeRequest{VolumeId: vol.GetVolume().GetVolumeId()})
		}
	}()

	// The placement stops selecting the node: the pool stays while it holds
	// the volume, the status no longer counts the node.
	hpp, err = virt.HostPathProvisioners.Get(ctx, "", hpp.Name)
	if err != nil {
		t.Fatal(err)
	}
	hpp.Spec.Workload.NodeSelector = map[string]string{csi.TopologyKey: "elsewhere"}
	if hpp, err = virt.HostPathProvisioners.Update(ctx, hpp); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 60*time.Second, "status without the node", func() error {
		got, err := virt.HostPathProvisioners.Get(ctx, "", hpp.Name)
		if err != nil {
			return err
		}
		if c := condition(got, "Available"); c.Status != "False" || !strings.Contains(c.Message, "spec.workload") {
			return fmt.Errorf("available %+v", c)
		}
		return nil
	})
	testkit.Eventually(t, 60*time.Second, "pool kept while it holds a volume", func() error {
		n, err := admin.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
		if err != nil {
			return err
		}
		p, _ := poolstate.Decode(n)
		if s, ok := p.Find(fast); !ok || !strings.Contains(s.Message, "kept while it holds volumes") {
			return fmt.Errorf("pools reported: %+v", p)
		}
		return nil
	})
	if _, err := ctrl.DeleteVolume(ctx, &csispec.DeleteVolumeRequest{VolumeId: vol.GetVolume().GetVolumeId()}); err != nil {
		t.Fatal(err)
	}
	deleted = true
	testkit.Eventually(t, 60*time.Second, "empty pool closed", func() error {
		n, err := admin.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
		if err != nil {
			return err
		}
		p, _ := poolstate.Decode(n)
		if _, ok := p.Find(fast); ok {
			return fmt.Errorf("pools reported: %+v", p)
		}
		return nil
	})
	if _, err := ctrl.CreateVolume(ctx, &csispec.CreateVolumeRequest{Name: "pvc-late-" + suffix, VolumeCapabilities: mount,
		Parameters: sc.Parameters}); err == nil {
		t.Error("a closed pool took a volume")
	}
}

func condition(hpp *hppv1beta1.HostPathProvisioner, typ string) (c struct{ Status, Message string }) {
	for _, x := range hpp.Status.Conditions {
		if x.Type == typ {
			c.Status, c.Message = x.Status, x.Message
		}
	}
	return c
}
