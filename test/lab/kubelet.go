package lab

// The lab's kubelet mode (make lab KUBELET=1): the lab's one node is a real
// kubelet with containerd, brought up by the kubelet test's machinery
// (test/kubelet), and nodevirt is installed onto it as a user would, from
// the images of `make images` and their rendered manifest. The node's undo
// list lives in one detached process, `nodevirt-lab kubelet-node`, which
// holds the node until lab-down's SIGTERM, then uninstalls nodevirt and
// undoes everything kubelet changed on the host.

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/kubelet"
)

const (
	// kubeletNode names the process holding the kubelet node (pid, log).
	kubeletNode = "kubelet-node"
	// kubeletModeFile records that the lab runs in kubelet mode.
	kubeletModeFile = "kubelet-mode"
)

// kubeletControlPlane is the control plane of a kubelet lab: kubelets are
// authorized as a real cluster's are, and the node's pods reach the API
// server at the host's address.
func kubeletControlPlane(cfg Config) controlplane.Config {
	return controlplane.Config{Dir: cfg.path("controlplane"), ControllerManager: true, Detach: true,
		NodeAuthorizer: true, BindAddress: "0.0.0.0", Log: cfg.Log}
}

// recordedKubelet tells whether the lab in dir runs in kubelet mode.
func recordedKubelet(dir string) bool {
	_, err := os.Stat(filepath.Join(dir, kubeletModeFile))
	return err == nil
}

// upKubelet starts the kubelet node process unless it runs and waits until
// it reports nodevirt installed and the HyperConverged Available.
func upKubelet(ctx context.Context, cfg Config) error {
	step(cfg.Out, "kubelet and kube-scheduler (the control plane's pin)")
	if _, err := controlplane.EnsureNodeBinaries(ctx, ""); err != nil {
		return err
	}
	if _, err := kubelet.FindBuild(filepath.Join(cfg.BinDir, "images")); err != nil {
		return err
	}
	step(cfg.Out, "kubelet node (containerd, kubelet, kube-scheduler), nodevirt installed from bin/images/nodevirt.yaml")
	ready := cfg.path(kubeletNode + ".ready")
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	if err := startProcess(cfg, cfg.path(kubeletNode), []string{exe, "kubelet-node", "--dir=" + cfg.Dir,
		"--bin=" + cfg.BinDir, "--node-name=" + cfg.NodeName}); err != nil {
		return err
	}
	deadline := time.Now().Add(20 * time.Minute)
	for {
		if _, err := os.Stat(ready); err == nil {
			return nil
		}
		if _, alive := controlplane.AlivePid(cfg.path(kubeletNode + ".pid")); !alive {
			return fmt.Errorf("the kubelet node stopped: see %s", cfg.path(kubeletNode+".log"))
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("kubelet node not ready after 20 min: see %s", cfg.path(kubeletNode+".log"))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Second):
		}
	}
}

// RunKubeletNode is `nodevirt-lab kubelet-node`: it brings the kubelet node
// up, installs the build of BinDir/images and the HyperConverged, writes the
// ready file, and holds the node until ctx ends; then it uninstalls and
// undoes the node, whatever happened before.
func RunKubeletNode(ctx context.Context, cfg Config) (err error) {
	if err := cfg.defaults(); err != nil {
		return err
	}
	report := func(what string) { fmt.Fprintf(cfg.Out, "%s %s\n", time.Now().Format(time.RFC3339), what) }
	root, err := controlplane.RepoRoot()
	if err != nil {
		return err
	}
	build, err := kubelet.FindBuild(filepath.Join(cfg.BinDir, "images"))
	if err != nil {
		return err
	}
	cp, err := controlplane.Start(ctx, kubeletControlPlane(cfg))
	if err != nil {
		return err
	}
	u, err := url.Parse(cp.URL)
	if err != nil {
		return err
	}
	port, err := strconv.Atoi(u.Port())
	if err != nil {
		return err
	}
	ip, err := kubelet.HostIP()
	if err != nil {
		return err
	}
	bins, err := controlplane.EnsureNodeBinaries(ctx, "")
	if err != nil {
		return err
	}
	node, err := kubelet.Start(ctx, kubelet.Config{Dir: cfg.path("kubelet"), NodeName: cfg.NodeName, NodeIP: ip,
		ControlPlane: cp, APIServerPort: port, Bins: bins, Log: cfg.Log})
	if err != nil {
		return err
	}
	report("node " + cfg.NodeName + " Ready")
	defer func() {
		report("uninstalling")
		uerr := kubelet.Uninstall(cp.Kubeconfig, build)
		report("undoing the node")
		err = errors.Join(err, uerr, node.Stop())
		report("stopped")
	}()
	if err := kubelet.Install(ctx, node, build, report); err != nil {
		return err
	}
	// Nodes may import from the host (the lab's image servers).
	if err := kubelet.CreateHyperConverged(cp.Kubeconfig, root, "127.0.0.0/8,::1,"+ip+"/32"); err != nil {
		return err
	}
	report("HyperConverged Available")
	if err := os.WriteFile(cfg.path(kubeletNode+".ready"), nil, 0o644); err != nil {
		return err
	}
	<-ctx.Done()
	return nil
}

// downKubelet stops the kubelet node process, which uninstalls nodevirt
// and undoes the node (its log says how that went).
func downKubelet(cfg Config) error {
	pid, ok := controlplane.AlivePid(cfg.path(kubeletNode + ".pid"))
	if !ok {
		return nil
	}
	step(cfg.Out, "kubelet node (uninstall nodevirt, undo kubelet's changes)")
	if err := controlplane.TerminatePid(pid, 8*time.Minute); err != nil {
		return err
	}
	if log, err := os.ReadFile(cfg.path(kubeletNode + ".log")); err == nil && !strings.Contains(string(log), " stopped\n") {
		return fmt.Errorf("the kubelet node did not finish its undo: see %s", cfg.path(kubeletNode+".log"))
	}
	return nil
}
