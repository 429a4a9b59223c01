// Package controlplane runs a real Kubernetes control plane on this machine:
// Debian's etcd plus kube-apiserver and kube-controller-manager built from the
// pinned release (see EnsureBinaries). The API server has RBAC, admission
// webhooks and the aggregation layer configured, serves TLS on loopback and
// authenticates clients by certificate. Tests share one control plane per test
// binary (see Shared); the lab runs the same processes detached.
package controlplane

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// Config says where and how the control plane runs.
type Config struct {
	// Dir holds certificates, etcd data, logs and kubeconfigs.
	Dir string
	// CacheDir is where the binaries are built (DefaultCacheDir when empty).
	CacheDir string
	// APIServerPort is the secure port; 0 picks a free one.
	APIServerPort int
	// BindAddress is where kube-apiserver listens (127.0.0.1 when empty);
	// a multi-node lab binds every address so that nodes in their own
	// network namespaces reach it. Clients still verify the certificate
	// for 127.0.0.1 (their kubeconfig's tls-server-name).
	BindAddress string
	// ControllerManager also runs kube-controller-manager (PV binding,
	// garbage collection, namespace deletion).
	ControllerManager bool
	// NodeAuthorizer authorizes kubelets as a real cluster does (Node,RBAC
	// and the NodeRestriction admission plugin) and has the API server
	// reach them at their InternalIP (the kubelet test).
	NodeAuthorizer bool
	// Detach starts the processes in their own sessions, writing pid files
	// under Dir, so they outlive the caller (the lab). Otherwise they die
	// with the caller.
	Detach bool
	// Log receives progress; slog.Default() when nil.
	Log *slog.Logger
}

// ControlPlane is a running control plane.
type ControlPlane struct {
	cfg        Config
	pki        pki
	procs      []*exec.Cmd
	URL        string
	Kubeconfig string
	RestConfig *rest.Config
}

func (c *Config) defaults() error {
	if c.Dir == "" {
		return errors.New("controlplane: Dir is required")
	}
	if c.Log == nil {
		c.Log = slog.Default()
	}
	if c.BindAddress == "" {
		c.BindAddress = "127.0.0.1"
	}
	abs, err := filepath.Abs(c.Dir)
	if err != nil {
		return err
	}
	c.Dir = abs
	return nil
}

// Start brings up etcd, kube-apiserver and optionally kube-controller-manager
// and returns once the API server is ready. When Detach is set and the
// processes already run (from an earlier Start), they are kept.
func Start(ctx context.Context, cfg Config) (*ControlPlane, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	bins, err := EnsureBinaries(ctx, cfg.CacheDir)
	if err != nil {
		return nil, err
	}
	c := &ControlPlane{cfg: cfg, pki: pki{dir: filepath.Join(cfg.Dir, "pki")}}
	if err := c.pki.generate(); err != nil {
		return nil, fmt.Errorf("control-plane certificates: %w", err)
	}
	ports, err := c.ports()
	if err != nil {
		return nil, err
	}
	c.URL = fmt.Sprintf("https://127.0.0.1:%d", ports.apiserver)
	c.Kubeconfig = filepath.Join(cfg.Dir, "kubeconfig")
	if err := c.writeKubeconfig(c.Kubeconfig, "admin"); err != nil {
		return nil, err
	}
	if err := c.writeKubeconfig(filepath.Join(cfg.Dir, "controller-manager.kubeconfig"), "controller-manager"); err != nil {
		return nil, err
	}
	c.RestConfig, err = clientcmd.BuildConfigFromFlags("", c.Kubeconfig)
	if err != nil {
		return nil, err
	}
	started := false
	defer func() {
		if !started {
			c.Stop()
		}
	}()
	if err := c.run(ctx, "etcd", bins.Etcd, c.etcdArgs(ports)...); err != nil {
		return nil, err
	}
	if err := c.run(ctx, "kube-apiserver", bins.APIServer, c.apiserverArgs(ports)...); err != nil {
		return nil, err
	}
	if err := c.waitReady(ctx, 90*time.Second); err != nil {
		return nil, err
	}
	if cfg.ControllerManager {
		if err := c.run(ctx, "kube-controller-manager", bins.ControllerManager, c.controllerManagerArgs()...); err != nil {
			return nil, err
		}
	}
	started = true
	return c, nil
}

type portSet struct{ etcdClient, etcdPeer, apiserver int }

// ports reuses the ports recorded by an earlier detached start, so a lab
// keeps its address, and picks free ones otherwise.
func (c *ControlPlane) ports() (portSet, error) {
	file := filepath.Join(c.cfg.Dir, "ports")
	if data, err := os.ReadFile(file); err == nil {
		var p portSet
		if _, err := fmt.Sscanf(string(data), "%d %d %d", &p.etcdClient, &p.etcdPeer, &p.apiserver); err == nil {
			return p, nil
		}
	}
	var p portSet
	for _, dst := range []*int{&p.etcdClient, &p.etcdPeer} {
		n, err := freePort()
		if err != nil {
			return p, err
		}
		*dst = n
	}
	p.apiserver = c.cfg.APIServerPort
	if p.apiserver == 0 {
		n, err := freePort()
		if err != nil {
			return p, err
		}
		p.apiserver = n
	}
	data := fmt.Sprintf("%d %d %d\n", p.etcdClient, p.etcdPeer, p.apiserver)
	return p, os.WriteFile(file, []byte(data), 0o600)
}

func (c *ControlPlane) etcdArgs(p portSet) []string {
	client := fmt.Sprintf("http://127.0.0.1:%d", p.etcdClient)
	peer := fmt.Sprintf("http://127.0.0.1:%d", p.etcdPeer)
	return []string{
		"--name=nodevirt", "--data-dir=" + filepath.Join(c.cfg.Dir, "etcd"),
		"--listen-client-urls=" + client, "--advertise-client-urls=" + client,
		"--listen-peer-urls=" + peer, "--initial-advertise-peer-urls=" + peer,
		"--initial-cluster=nodevirt=" + peer, "--log-level=warn", "--logger=zap",
		"--quota-backend-bytes=8589934592", "--auto-compaction-retention=1",
		// kube-apiserver needs progress notifications for consistent watches
		// started without a resource version.
		"--experimental-watch-progress-notify-interval=5s",
	}
}

func (c *ControlPlane) apiserverArgs(p portSet) []string {
	f := c.pki.path
	authz, admission, kubelets := "RBAC", "", []string{}
	if c.cfg.NodeAuthorizer {
		authz, admission = "Node,RBAC", ",NodeRestriction"
		kubelets = append(kubelets, "--kubelet-preferred-address-types=InternalIP")
	}
	return append(kubelets, []string{
		fmt.Sprintf("--etcd-servers=http://127.0.0.1:%d", p.etcdClient),
		"--bind-address=" + c.cfg.BindAddress, "--advertise-address=127.0.0.1",
		fmt.Sprintf("--secure-port=%d", p.apiserver),
		"--tls-cert-file=" + f("apiserver.crt"), "--tls-private-key-file=" + f("apiserver.key"),
		"--client-ca-file=" + f("ca.crt"),
		"--authorization-mode=" + authz,
		"--enable-admission-plugins=NamespaceLifecycle,ServiceAccount,DefaultStorageClass,MutatingAdmissionWebhook,ValidatingAdmissionWebhook,ValidatingAdmissionPolicy,ResourceQuota" + admission,
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file=" + f("sa.pub"), "--service-account-signing-key-file=" + f("sa.key"),
		"--service-cluster-ip-range=10.0.0.0/24",
		"--requestheader-client-ca-file=" + f("front-proxy-ca.crt"),
		"--requestheader-allowed-names=front-proxy-client",
		"--requestheader-username-headers=X-Remote-User",
		"--requestheader-group-headers=X-Remote-Group",
		"--requestheader-extra-headers-prefix=X-Remote-Extra-",
		"--proxy-client-cert-file=" + f("front-proxy-client.crt"), "--proxy-client-key-file=" + f("front-proxy-client.key"),
		// No kube-proxy runs here: aggregated APIs and webhooks are reached
		// through their Endpoints, not the Service's cluster IP.
		"--enable-aggregator-routing=true",
		"--allow-privileged=true",
		"--profiling=false",
		"--v=0",
	}...)
}

func (c *ControlPlane) controllerManagerArgs() []string {
	f := c.pki.path
	kc := filepath.Join(c.cfg.Dir, "controller-manager.kubeconfig")
	return []string{
		"--kubeconfig=" + kc, "--authentication-kubeconfig=" + kc, "--authorization-kubeconfig=" + kc,
		"--service-account-private-key-file=" + f("sa.key"), "--root-ca-file=" + f("ca.crt"),
		"--cluster-signing-cert-file=" + f("ca.crt"), "--cluster-signing-key-file=" + f("ca.key"),
		"--use-service-account-credentials=true", "--leader-elect=false",
		"--bind-address=127.0.0.1", "--secure-port=0",
		"--controllers=*,-nodeipam,-cloud-node-lifecycle,-service,-route,-ttl,-bootstrapsigner,-tokencleaner",
		"--v=0",
	}
}

// run starts one process, or adopts the running one recorded in its pid file
// when detached.
func (c *ControlPlane) run(ctx context.Context, name, bin string, args ...string) error {
	pidFile := filepath.Join(c.cfg.Dir, name+".pid")
	if c.cfg.Detach {
		if pid, ok := alivePid(pidFile); ok {
			c.cfg.Log.Info("already running", "component", name, "pid", pid)
			return nil
		}
	}
	logf, err := os.OpenFile(filepath.Join(c.cfg.Dir, name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer logf.Close()
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	if c.cfg.Detach {
		cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	} else {
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", name, err)
	}
	c.cfg.Log.Info("started", "component", name, "pid", cmd.Process.Pid)
	if err := os.WriteFile(pidFile, []byte(strconv.Itoa(cmd.Process.Pid)), 0o644); err != nil {
		return err
	}
	if c.cfg.Detach {
		go cmd.Wait() // reap if it dies while we still run
		return nil
	}
	c.procs = append(c.procs, cmd)
	return nil
}

func (c *ControlPlane) waitReady(ctx context.Context, timeout time.Duration) error {
	caPEM, err := os.ReadFile(c.pki.path("ca.crt"))
	if err != nil {
		return err
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(caPEM)
	cert, err := tls.LoadX509KeyPair(c.pki.path("admin.crt"), c.pki.path("admin.key"))
	if err != nil {
		return err
	}
	client := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{
		TLSClientConfig: &tls.Config{RootCAs: pool, Certificates: []tls.Certificate{cert}},
	}}
	deadline := time.Now().Add(timeout)
	var last string
	for time.Now().Before(deadline) {
		resp, err := client.Get(c.URL + "/readyz")
		if err == nil {
			body := make([]byte, 4096)
			n, _ := resp.Body.Read(body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			last = fmt.Sprintf("%d %s", resp.StatusCode, strings.TrimSpace(string(body[:n])))
		} else {
			last = err.Error()
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(250 * time.Millisecond):
		}
	}
	return fmt.Errorf("kube-apiserver not ready after %s (see %s): %s", timeout,
		filepath.Join(c.cfg.Dir, "kube-apiserver.log"), last)
}

func (c *ControlPlane) writeKubeconfig(path, identity string) error {
	ca, err := os.ReadFile(c.pki.path("ca.crt"))
	if err != nil {
		return err
	}
	crt, err := os.ReadFile(c.pki.path(identity + ".crt"))
	if err != nil {
		return err
	}
	key, err := os.ReadFile(c.pki.path(identity + ".key"))
	if err != nil {
		return err
	}
	kc := clientcmdapi.NewConfig()
	kc.Clusters["nodevirt"] = &clientcmdapi.Cluster{Server: c.URL, CertificateAuthorityData: ca}
	kc.AuthInfos[identity] = &clientcmdapi.AuthInfo{ClientCertificateData: crt, ClientKeyData: key}
	kc.Contexts["nodevirt"] = &clientcmdapi.Context{Cluster: "nodevirt", AuthInfo: identity}
	kc.CurrentContext = "nodevirt"
	return clientcmd.WriteToFile(*kc, path)
}

// CA returns the cluster CA, to sign client certificates for daemons.
func (c *ControlPlane) CA() (*CA, error) {
	return LoadCA(c.pki.path("ca.crt"), c.pki.path("ca.key"))
}

// FrontProxyCAFile is the CA that signs the aggregator's client certificate;
// aggregated API servers trust requests carrying X-Remote-User only from it.
func (c *ControlPlane) FrontProxyCAFile() string { return c.pki.path("front-proxy-ca.crt") }

// CAFile is the cluster CA certificate.
func (c *ControlPlane) CAFile() string { return c.pki.path("ca.crt") }

// WriteKubeconfig writes a kubeconfig for a new client identity signed by
// the cluster CA (e.g. a daemon or an unprivileged test user).
func (c *ControlPlane) WriteKubeconfig(path, user string, groups ...string) error {
	ca, err := c.CA()
	if err != nil {
		return err
	}
	crt, key, err := ca.Sign(CertRequest{CommonName: user, Organization: groups, Client: true})
	if err != nil {
		return err
	}
	name := "user-" + strings.NewReplacer(":", "-", "/", "-").Replace(user)
	if err := os.WriteFile(c.pki.path(name+".crt"), crt, 0o600); err != nil {
		return err
	}
	if err := os.WriteFile(c.pki.path(name+".key"), key, 0o600); err != nil {
		return err
	}
	saved := c.URL
	defer func() { c.URL = saved }()
	return c.writeKubeconfig(path, name)
}

// Stop ends the processes this ControlPlane started (not detached ones) and
// waits for them.
func (c *ControlPlane) Stop() {
	for i := len(c.procs) - 1; i >= 0; i-- {
		p := c.procs[i]
		_ = p.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { p.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = p.Process.Kill()
			<-done
		}
	}
	c.procs = nil
}

// StopDetached ends the processes recorded by pid files under dir, in the
// reverse order of start, and waits until they are gone.
func StopDetached(dir string) error {
	var errs []error
	for _, name := range []string{"kube-controller-manager", "kube-apiserver", "etcd"} {
		pidFile := filepath.Join(dir, name+".pid")
		if pid, ok := alivePid(pidFile); ok {
			if err := TerminatePid(pid, 15*time.Second); err != nil {
				errs = append(errs, fmt.Errorf("stop %s: %w", name, err))
			}
		}
		os.Remove(pidFile)
	}
	return errors.Join(errs...)
}

// TerminatePid sends SIGTERM, then SIGKILL after grace, and waits for exit.
func TerminatePid(pid int, grace time.Duration) error {
	if err := syscall.Kill(pid, syscall.SIGTERM); err != nil {
		if errors.Is(err, syscall.ESRCH) {
			return nil
		}
		return err
	}
	deadline := time.Now().Add(grace)
	for time.Now().Before(deadline) {
		if syscall.Kill(pid, 0) != nil {
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	_ = syscall.Kill(pid, syscall.SIGKILL)
	for i := 0; i < 100 && syscall.Kill(pid, 0) == nil; i++ {
		time.Sleep(50 * time.Millisecond)
	}
	return nil
}

// alivePid reads a pid file and tells whether that process still runs (and
// is not a zombie).
func alivePid(pidFile string) (int, bool) {
	data, err := os.ReadFile(pidFile)
	if err != nil {
		return 0, false
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(data)))
	if err != nil || pid <= 0 {
		return 0, false
	}
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, false
	}
	if i := strings.LastIndexByte(string(stat), ')'); i > 0 && i+2 < len(stat) && stat[i+2] == 'Z' {
		return 0, false
	}
	return pid, true
}

// AlivePid is alivePid for callers managing their own daemons.
func AlivePid(pidFile string) (int, bool) { return alivePid(pidFile) }

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// RestartAPIServer kills kube-apiserver with SIGKILL, as a crash does,
// leaves the API away for down, then starts it again on the same port and
// waits until it is ready: an API server outage for the clients (etcd and
// the controller manager keep running).
func (c *ControlPlane) RestartAPIServer(ctx context.Context, down time.Duration) error {
	const name = "kube-apiserver"
	pid, ok := alivePid(filepath.Join(c.cfg.Dir, name+".pid"))
	if !ok {
		return fmt.Errorf("%s does not run", name)
	}
	if i := slices.IndexFunc(c.procs, func(p *exec.Cmd) bool { return p.Process.Pid == pid }); i >= 0 {
		p := c.procs[i]
		_ = p.Process.Kill()
		_ = p.Wait()
		c.procs = slices.Delete(c.procs, i, i+1)
	} else if err := TerminatePid(pid, 0); err != nil {
		return fmt.Errorf("kill %s: %w", name, err)
	}
	c.cfg.Log.Info("killed", "component", name, "pid", pid)
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(down):
	}
	bins, err := EnsureBinaries(ctx, c.cfg.CacheDir)
	if err != nil {
		return err
	}
	ports, err := c.ports()
	if err != nil {
		return err
	}
	if err := c.run(ctx, name, bins.APIServer, c.apiserverArgs(ports)...); err != nil {
		return err
	}
	return c.waitReady(ctx, 90*time.Second)
}
