package kubelet

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/nodevirt/nodevirt/clusterbrain/api/importstate"
)

// Namespace is where the manifests install nodevirt.
const Namespace = "kubevirt-hyperconverged"

// Kubectl runs kubectl against kubeconfig with a context of its own (the
// uninstall runs after its caller's context ended) and returns its output.
func Kubectl(kubeconfig string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, "kubectl", append([]string{"--kubeconfig", kubeconfig}, args...)...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("kubectl %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return string(out), nil
}

// Build is one build's images and manifest as `make images` writes them
// (bin/images: *.tar and nodevirt.yaml).
type Build struct {
	Dir      string
	Manifest string
	Archives []string
}

// FindBuild locates the build in dir.
func FindBuild(dir string) (Build, error) {
	b := Build{Dir: dir, Manifest: filepath.Join(dir, "nodevirt.yaml")}
	b.Archives, _ = filepath.Glob(filepath.Join(dir, "*.tar"))
	if _, err := os.Stat(b.Manifest); err != nil || len(b.Archives) == 0 {
		return b, fmt.Errorf("no images in %s: run make images first (%v)", dir, err)
	}
	return b, nil
}

// Install imports the build's images into the node's containerd, applies
// its manifest unchanged and waits until the node agent DaemonSet is Ready
// and the brain Deployment Available. report gets each step as it ends.
func Install(ctx context.Context, n *Node, b Build, report func(string)) error {
	if err := n.Import(ctx, b.Archives...); err != nil {
		return err
	}
	report("images imported")
	kc := n.cfg.ControlPlane.Kubeconfig
	if _, err := Kubectl(kc, "apply", "-f", b.Manifest); err != nil {
		return err
	}
	report("manifest applied")
	kube, err := kubernetes.NewForConfig(n.cfg.ControlPlane.RestConfig)
	if err != nil {
		return err
	}
	if err := waitFor(ctx, 5*time.Minute, "node agent DaemonSet Ready", func() error {
		ds, err := kube.AppsV1().DaemonSets(Namespace).Get(ctx, "nodevirt-nodeagent", metav1.GetOptions{})
		if err != nil {
			return err
		}
		if ds.Status.DesiredNumberScheduled < 1 || ds.Status.NumberReady != ds.Status.DesiredNumberScheduled {
			return fmt.Errorf("%d of %d ready", ds.Status.NumberReady, ds.Status.DesiredNumberScheduled)
		}
		return nil
	}); err != nil {
		return err
	}
	report("node agent Ready")
	if err := waitFor(ctx, 5*time.Minute, "brain Deployment Available", func() error {
		d, err := kube.AppsV1().Deployments(Namespace).Get(ctx, "nodevirt-clusterbrain", metav1.GetOptions{})
		if err != nil {
			return err
		}
		for _, c := range d.Status.Conditions {
			if c.Type == appsv1.DeploymentAvailable && c.Status == corev1.ConditionTrue {
				return nil
			}
		}
		return fmt.Errorf("%d available", d.Status.AvailableReplicas)
	}); err != nil {
		return err
	}
	report("brain Available")
	return nil
}

// CreateHyperConverged applies the HyperConverged of
// clusterbrain/deploy/hyperconverged.yaml once its CRD is established,
// under TCG (this machine's KVM hangs ordinary guests), letting nodes
// import from importNetworks (the test's and the lab's image servers), and
// waits until it is Available.
func CreateHyperConverged(kubeconfig, root, importNetworks string) error {
	if _, err := Kubectl(kubeconfig, "wait", "--for=condition=established", "--timeout=2m", "crd/hyperconvergeds.hco.kubevirt.io"); err != nil {
		return err
	}
	if _, err := Kubectl(kubeconfig, "apply", "-f", filepath.Join(root, "clusterbrain", "deploy", "hyperconverged.yaml")); err != nil {
		return err
	}
	if _, err := Kubectl(kubeconfig, "annotate", "--overwrite", "-n", Namespace, "hyperconverged", "kubevirt-hyperconverged",
		"nodevirt.io/use-emulation=true", importstate.AnnImportAllowedNetworks+"="+importNetworks); err != nil {
		return err
	}
	_, err := Kubectl(kubeconfig, "wait", "--for=condition=Available", "--timeout=5m", "-n", Namespace, "hyperconverged/kubevirt-hyperconverged")
	return err
}

// Uninstall deletes the HyperConverged while the brains that own its
// finalizer run; then stops the brains and agents, deletes what the brains
// registered themselves (APIServices, webhook configurations and the
// Services and EndpointSlices behind them: left behind,
// the APIServices' missing backends keep the namespace from going and the
// webhooks refuse requests), then everything the manifest made; and
// removes what the node agent's pod network left on the host (with the
// agent binary of the build, bin/images/bin/nodeagent).
func Uninstall(kubeconfig string, b Build) error {
	var errs []error
	if _, err := Kubectl(kubeconfig, "delete", "--ignore-not-found", "--wait", "--timeout=2m", "-n", Namespace,
		"hyperconvergeds.hco.kubevirt.io", "kubevirt-hyperconverged"); err != nil {
		errs = append(errs, err)
	}
	if _, err := Kubectl(kubeconfig, "delete", "--ignore-not-found", "--wait", "--timeout=3m", "-n", Namespace,
		"deployment/nodevirt-clusterbrain", "daemonset/nodevirt-nodeagent"); err != nil {
		errs = append(errs, err)
	}
	if _, err := Kubectl(kubeconfig, "wait", "--for=delete", "--timeout=3m", "-n", Namespace, "pods",
		"-l", "app.kubernetes.io/part-of=nodevirt"); err != nil && !strings.Contains(err.Error(), "no matching resources") {
		errs = append(errs, err)
	}
	if _, err := Kubectl(kubeconfig, "delete", "--ignore-not-found", "--wait", "--timeout=2m",
		"apiservices,mutatingwebhookconfigurations,validatingwebhookconfigurations", "-l", "app.kubernetes.io/managed-by=nodevirt"); err != nil {
		errs = append(errs, err)
	}
	// The Services and EndpointSlices the brains put in front of their
	// webhooks and aggregated APIs.
	if _, err := Kubectl(kubeconfig, "delete", "--ignore-not-found", "--wait", "--timeout=2m", "-n", Namespace,
		"services,endpointslices.discovery.k8s.io", "-l", "app.kubernetes.io/managed-by=nodevirt"); err != nil {
		errs = append(errs, err)
	}
	if _, err := Kubectl(kubeconfig, "delete", "--ignore-not-found", "--wait", "--timeout=3m", "-f", b.Manifest); err != nil {
		errs = append(errs, err)
	}
	bin := filepath.Join(b.Dir, "bin", "nodeagent")
	// The host's libvirt configuration loses the agent's TLS blocks: the
	// directories they name go with /var/lib/nodevirt, and libvirtd does
	// not start while qemu.conf names a missing one.
	if out, err := exec.Command(bin, "--teardown-podnet", "--state-dir=/var/lib/nodevirt",
		"--teardown-libvirt-tls", "--libvirt-conf-dir=/etc/libvirt").CombinedOutput(); err != nil {
		errs = append(errs, fmt.Errorf("teardown pod network and libvirt TLS: %w: %s", err, out))
	}
	return errors.Join(errs...)
}

// HostIP is the address of the interface holding the default route: the
// node's InternalIP.
func HostIP() (string, error) {
	out, err := exec.Command("ip", "-4", "-o", "route", "get", "192.0.2.255").Output()
	if err != nil {
		return "", err
	}
	f := strings.Fields(string(out))
	for i := range f {
		if f[i] == "src" && i+1 < len(f) {
			return f[i+1], nil
		}
	}
	return "", fmt.Errorf("no source address in %q", out)
}
