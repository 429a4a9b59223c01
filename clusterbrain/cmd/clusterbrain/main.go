// Command clusterbrain is nodevirt's cluster brain.
package main

import (
	"flag"
	"fmt"
	"log/slog"
	"os"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	"github.com/nodevirt/nodevirt/clusterbrain/brain"
	"github.com/nodevirt/nodevirt/clusterbrain/capacitypods"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/daemon"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/daemon/buildinfo"
	"github.com/nodevirt/nodevirt/clusterbrain/nodereads"
	"github.com/nodevirt/nodevirt/clusterbrain/rbac"
)

func main() {
	var cfg brain.Config
	flag.StringVar(&cfg.Kubeconfig, "kubeconfig", os.Getenv("KUBECONFIG"), "kubeconfig path (empty: in-cluster)")
	flag.StringVar(&cfg.Namespace, "namespace", "kubevirt-hyperconverged", "namespace of the brain's lease, secrets and HyperConverged")
	flag.StringVar(&cfg.Identity, "identity", "", "leader-election identity (default host name and pid)")
	flag.StringVar(&cfg.HealthAddr, "health-addr", "127.0.0.1:8480", "address of /healthz and /readyz")
	flag.StringVar(&cfg.WebhookAddr, "webhook-addr", "127.0.0.1:8443", "address of the admission webhooks")
	flag.StringVar(&cfg.WebhookService, "webhook-service", "", "namespace/name of a Service the webhook configurations name, kept pointing at every brain (then --webhook-addr must not be loopback); empty: they name --webhook-addr's URL")
	flag.StringVar(&cfg.SubresourcesAddr, "subresources-addr", ":8444", "address of the subresources.kubevirt.io aggregated API (not loopback)")
	flag.StringVar(&cfg.UploadAPIAddr, "upload-api-addr", ":8445", "address of the upload.cdi.kubevirt.io aggregated API (not loopback)")
	flag.StringVar(&cfg.UploadProxyAddr, "uploadproxy-addr", ":8446", "address of the upload proxy")
	flag.StringVar(&cfg.TemplateAPIAddr, "template-api-addr", ":8448", "address of the template.openshift.io aggregated API (not loopback)")
	flag.StringVar(&cfg.NodeReadsAddr, "node-reads-addr", nodereads.DefaultAddr, "address of the nodereads.nodevirt.io aggregated API nodes read Secrets and ConfigMaps through (not loopback)")
	flag.StringVar(&cfg.MetricsAddr, "metrics-addr", brain.DefaultMetricsAddr, "address of /metrics (unauthenticated: loopback unless you put a proxy in front)")
	flag.StringVar(&cfg.CLIDownloadAddr, "cli-download-addr", ":8482", "address of the virtctl download service")
	flag.StringVar(&cfg.VirtctlDir, "virtctl-dir", "/usr/local/share/nodevirt/virtctl", "directory of the virtctl builds served for download")
	flag.DurationVar(&cfg.LeaseDuration, "lease-duration", 0, "leader lease duration (default 10s)")
	flag.DurationVar(&cfg.FencingWindow, "fencing-window", 0, "how long a node may miss its lease renewals before its agent stops its guests; its VMIs fail over after this plus a 10s margin (default 30s)")
	flag.BoolVar(&cfg.CapacityPods, "capacity-pods", false, "keep a pod per bound VMI holding its CPU and memory, so kube-scheduler and kubelet count VMs (clusters with kubelets)")
	flag.StringVar(&cfg.CapacityPodImage, "capacity-pod-image", capacitypods.DefaultImage, "the pause image capacity pods run")
	flag.StringVar(&cfg.Deployment, "deployment", "", "the brain's own Deployment in --namespace, placed by the HyperConverged's spec.infra.nodePlacement (empty: not run by a Deployment)")
	installRoles := flag.Bool("install-roles", false, "install the daemons' cluster roles and bindings (run once with an administrator's kubeconfig), then exit")
	showVersion := flag.Bool("version", false, buildinfo.FlagUsage)
	flag.Parse()
	if *showVersion {
		fmt.Println(buildinfo.Line("clusterbrain"))
		return
	}
	cfg.LogLevel = new(slog.LevelVar) // follows the KubeVirt CR's logVerbosity
	cfg.Log = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: cfg.LogLevel}))
	if *installRoles {
		if err := installDaemonRoles(cfg.Kubeconfig); err != nil {
			fmt.Fprintln(os.Stderr, "clusterbrain:", err)
			os.Exit(1)
		}
		fmt.Printf("installed: brain user %s (group %s), nodes system:node:<name> (group %s)\n", identity.BrainUser, identity.BrainGroup, identity.NodesGroup)
		return
	}

	b, err := brain.New(cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "clusterbrain:", err)
		os.Exit(2)
	}
	ctx, stop := daemon.SignalContext()
	defer stop()
	if err := b.Run(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "clusterbrain:", err)
		os.Exit(1)
	}
}

// installDaemonRoles installs the daemons' roles with the kubeconfig's
// (administrator's) credentials.
func installDaemonRoles(kubeconfig string) error {
	rc, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return err
	}
	kube, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return err
	}
	ctx, stop := daemon.SignalContext()
	defer stop()
	return rbac.EnsureDaemons(ctx, kube)
}
