// Command nodeagent is nodevirt's per-node daemon.
package main

import (
	"flag"
	"fmt"
	"log/slog"
	"os"
	"runtime/debug"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/nodevirt/nodevirt/clusterbrain/kit/daemon"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/daemon/buildinfo"
	"github.com/nodevirt/nodevirt/nodeagent/agent"
	"github.com/nodevirt/nodevirt/nodeagent/hostdisk"
	"github.com/nodevirt/nodevirt/nodeagent/libvirttls"
	nodemetrics "github.com/nodevirt/nodevirt/nodeagent/metrics"
)

func main() {
	var cfg agent.Config
	var pools, consoleClients string
	var teardownPodnet, teardownLibvirtTLS bool
	var gcPercent int
	var memoryLimit string
	flag.StringVar(&cfg.Kubeconfig, "kubeconfig", os.Getenv("KUBECONFIG"), "kubeconfig path")
	flag.StringVar(&cfg.NodeName, "node-name", "", "node name (default: host name)")
	flag.StringVar(&cfg.NodeIP, "node-ip", "", "the node's InternalIP (default: the address of the default route's interface)")
	flag.StringVar(&cfg.MigrationTransport, "migration-transport", "tls", "how libvirt daemons of two nodes talk in a live migration: tls (the node certificates of the node CA; libvirtd must listen with TLS on --libvirt-pki-dir's files), or tcp (unauthenticated: a lab on one machine only)")
	flag.StringVar(&cfg.StateDir, "state-dir", "/var/lib/nodevirt", "state directory")
	flag.StringVar(&cfg.LibvirtPKIDir, "libvirt-pki-dir", "", "with --migration-transport=tls: where the node certificate, key and node CA are written in libvirt's TLS layout, for this node's libvirtd (key_file, cert_file, ca_file) and as pkipath of the migration URI (default <state-dir>/libvirt-pki)")
	flag.StringVar(&cfg.QEMUTLSDir, "qemu-tls-dir", "", "with --migration-transport=tls: where the node certificate is written in QEMU's x509 layout, for QEMU's native TLS of the migration stream (qemu.conf migrate_tls_x509_cert_dir; default <state-dir>/qemu-tls)")
	flag.StringVar(&cfg.QEMUGroup, "qemu-group", "libvirt-qemu", "the group QEMU runs as (qemu.conf group), a name or a gid: it may read --qemu-tls-dir")
	flag.StringVar(&cfg.LibvirtConfDir, "libvirt-conf-dir", "", "with --migration-transport=tls: libvirt's configuration directory (e.g. /etc/libvirt), where the agent keeps its TLS blocks in libvirtd.conf and qemu.conf (empty: configured by hand)")
	flag.StringVar(&cfg.LibvirtRestart, "libvirt-restart-command", "", "shell command that restarts libvirtd after the agent changed its configuration (empty: it is logged, and read at libvirtd's next start)")
	flag.StringVar(&cfg.LibvirtAdminURI, "libvirt-admin-uri", "libvirtd:///system", "libvirtd's admin URI, for virt-admin server-update-tls after a certificate renewal")
	flag.StringVar(&cfg.HealthAddr, "health-addr", "127.0.0.1:8481", "address of /healthz and /readyz")
	flag.StringVar(&cfg.Emulation, "emulation", "auto", "auto (probe KVM), on (TCG) or off (require KVM)")
	flag.StringVar(&cfg.LibvirtURI, "libvirt-uri", "qemu:///system", "libvirt connection URI")
	flag.StringVar(&cfg.CSISocket, "csi-socket", "/var/lib/kubelet/plugins/kubevirt.io.hostpath-provisioner/csi.sock", "CSI driver socket")
	flag.StringVar(&cfg.KubeletPluginDir, "kubelet-plugin-dir", "", "kubelet's plugin registry directory, where the CSI driver registers with kubelet (default /var/lib/kubelet/plugins_registry; - for none)")
	flag.StringVar(&cfg.HostDiskRoot, "host-disk-root", hostdisk.DefaultRoot, "the only directory hostDisk volumes may name files in (no symlinks followed below it)")
	flag.StringVar(&pools, "pools", "", "storage pools as name=path,name=path (default: default=<state-dir>/pools/default)")
	flag.StringVar(&cfg.UploadAddr, "upload-addr", ":8447", "listen address of the upload receiver for the brain's upload proxy (- for none)")
	flag.StringVar(&cfg.BrainNamespace, "brain-namespace", "kubevirt-hyperconverged", "namespace of the brain's Secrets (node CA)")
	flag.StringVar(&cfg.Console.Addr, "console-addr", agent.DefaultConsoleAddr, "listen address of the mTLS console/VNC/control server for the brain (- for none)")
	flag.StringVar(&cfg.Console.CertFile, "console-cert", "", "console server certificate (PEM)")
	flag.StringVar(&cfg.Console.KeyFile, "console-key", "", "console server key (PEM)")
	flag.StringVar(&cfg.Console.ClientCAFile, "console-client-ca", "", "CA bundle that client (brain) certificates must chain to")
	flag.StringVar(&consoleClients, "console-allowed-clients", "", "comma-separated client certificate names allowed (empty: any the CA signed)")
	flag.StringVar(&cfg.MetricsAddr, "metrics-addr", nodemetrics.DefaultAddr, "listen address of /metrics (- for none; unauthenticated: loopback unless you put a proxy in front)")
	flag.StringVar(&cfg.PodCIDR, "pod-cidr", "10.244.0.0/24", "IPv4 subnet of the node's pod network for masquerade interfaces (- for none)")
	flag.StringVar(&cfg.SelfFence, "self-fence", "stop", "when the lease cannot be renewed for longer than the fencing window and no peer answers: stop (the guests) or none")
	flag.DurationVar(&cfg.FencingWindow, "fencing-window", 30*time.Second, "how long without a lease renewal before self-fencing (the brain's --fencing-window must not be shorter)")
	flag.DurationVar(&cfg.Heartbeat, "heartbeat", 10*time.Second, "how often the node's Lease and Ready condition are renewed")
	flag.StringVar(&cfg.PodBridge, "pod-bridge", "nodevirt0", "bridge of the node's pod network")
	flag.IntVar(&gcPercent, "gc-percent", 50, "Go GC target: heap growth in percent of the live heap before a collection (GOGC, which wins when set)")
	flag.StringVar(&memoryLimit, "memory-limit", "0", "soft limit of the Go runtime's memory, e.g. 64Mi (GOMEMLIMIT, which wins when set); 0 for none")
	flag.BoolVar(&teardownPodnet, "teardown-podnet", false, "remove the pod network (bridge, taps, nftables tables, state) and exit; for uninstalling")
	flag.BoolVar(&teardownLibvirtTLS, "teardown-libvirt-tls", false, "remove the agent's blocks from libvirtd.conf and qemu.conf in --libvirt-conf-dir and exit; for uninstalling (libvirtd serves them until its next start)")
	showVersion := flag.Bool("version", false, buildinfo.FlagUsage)
	flag.Parse()
	if *showVersion {
		fmt.Println(buildinfo.Line("nodeagent"))
		return
	}
	if err := tuneGC(gcPercent, memoryLimit); err != nil {
		fmt.Fprintln(os.Stderr, "nodeagent:", err)
		os.Exit(2)
	}
	if consoleClients != "" {
		cfg.Console.AllowedClients = strings.Split(consoleClients, ",")
	}
	cfg.LogLevel = new(slog.LevelVar) // follows the KubeVirt CR's logVerbosity
	cfg.Log = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: cfg.LogLevel}))
	if pools != "" {
		cfg.Pools = map[string]string{}
		for _, p := range strings.Split(pools, ",") {
			name, path, ok := strings.Cut(p, "=")
			if !ok {
				fmt.Fprintf(os.Stderr, "nodeagent: bad pool %q, want name=path\n", p)
				os.Exit(2)
			}
			cfg.Pools[name] = path
		}
	}
	if teardownLibvirtTLS {
		if cfg.LibvirtConfDir == "" {
			fmt.Fprintln(os.Stderr, "nodeagent: --teardown-libvirt-tls needs --libvirt-conf-dir")
			os.Exit(2)
		}
		if err := libvirttls.RemoveBlocks(cfg.LibvirtConfDir); err != nil {
			fmt.Fprintln(os.Stderr, "nodeagent:", err)
			os.Exit(1)
		}
		if !teardownPodnet {
			return
		}
	}
	if teardownPodnet {
		ctx, stop := daemon.SignalContext()
		defer stop()
		if err := agent.TeardownPodNetwork(ctx, cfg); err != nil {
			fmt.Fprintln(os.Stderr, "nodeagent:", err)
			os.Exit(1)
		}
		return
	}
	a, err := agent.New(cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "nodeagent:", err)
		os.Exit(2)
	}
	ctx, stop := daemon.SignalContext()
	defer stop()
	if err := a.Run(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "nodeagent:", err)
		os.Exit(1)
	}
}

// tuneGC sets the daemon's garbage collector: it runs on every node beside
// the guests, so it trades a little CPU for a smaller heap. GOGC and
// GOMEMLIMIT in the environment win over the flags.
func tuneGC(percent int, limit string) error {
	if os.Getenv("GOGC") == "" {
		debug.SetGCPercent(percent)
	}
	q, err := resource.ParseQuantity(limit)
	if err != nil {
		return fmt.Errorf("memory limit %q: %w", limit, err)
	}
	if os.Getenv("GOMEMLIMIT") == "" && q.Value() > 0 {
		debug.SetMemoryLimit(q.Value())
	}
	return nil
}
