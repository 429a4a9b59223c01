package lab

import (
	"bufio"
	"crypto/sha256"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/nodevirt/nodevirt/nodeagent/libvirttls"
	"github.com/nodevirt/nodevirt/test/controlplane"
)

// The multi-node lab (Nodes ≥ 2) runs every node in namespaces of its own
// on this machine:
//
//   - a named network namespace nodevirt-<node> (so `ip netns pids`,
//     `ip -n` work) with eth0 on the underlay (UnderlayBridge in the host
//     namespace, UnderlayGateway there) and br-lab, whose uplink lab0 joins
//     SwitchBridge in the host namespace: one L2 segment across the nodes,
//     the way a physical switch joins hosts' bridges;
//   - a mount, UTS and cgroup namespace held by a small "holder" process
//     (the node's init): its own sysfs (so /sys/class/net is the node's),
//     cgroup hierarchies mounted inside the cgroup namespace, whose root is
//     the node's cgroup <the lab's own cgroup>/<Fabric.Prefix>/<node> in
//     every hierarchy (so libvirt's machine cgroups of two nodes never
//     collide, and the lab stays under its own limits), a private /run,
//     /etc/libvirt, /var/lib/libvirt, /var/log/libvirt, /var/cache/libvirt,
//     /etc/hosts and hostname. `ip netns exec` is not used: it mounts a
//     fresh /sys whose cgroup directory is empty, and libvirt would run
//     without cgroups;
//   - its own virtlogd and libvirtd (distinct host_uuid, listening on the
//     node IP, migration_address/migration_host set for live migration),
//     and its own node agent (state dir, CSI socket, pools, pod subnet).
//
// Every process of a node enters through the node's enter script, which
// first moves itself into the node's cgroups, then joins the holder's
// namespaces. Killing every process in the netns is a node's power loss.

// Fabric names what a multi-node setup makes on the host: the lab's
// (LabFabric) or a test run's, so that both can run side by side.
type Fabric struct {
	// Prefix starts every host-side link name (at most 10 characters), the
	// nft table and the cgroup subtree.
	Prefix string
	// Subnet is the first three octets of the underlay /24; the host holds
	// .1, node i holds .(10+i).
	Subnet string
	// SwitchBridge is the host-side bridge joining every node's LabBridge.
	SwitchBridge string
	// LabBridge is the bridge every node has, its uplink in SwitchBridge.
	LabBridge string
	// NetnsPrefix + node name is a node's named network namespace.
	NetnsPrefix string
}

// LabFabric is `make lab`'s.
var LabFabric = Fabric{Prefix: "nvlab", Subnet: "10.77.0", SwitchBridge: "nvlab-sw", LabBridge: "br-lab", NetnsPrefix: "nodevirt-"}

// The lab's names, as the README gives them.
var (
	UnderlayBridge  = LabFabric.UnderlayBridge()
	SwitchBridge    = LabFabric.SwitchBridge
	UnderlayGateway = LabFabric.Gateway()
	LabBridge       = LabFabric.LabBridge
)

const underlayBits = 24

// UnderlayBridge is the host-side bridge of the underlay.
func (f Fabric) UnderlayBridge() string { return f.Prefix + "0" }

// Gateway is the host's address on the underlay, where nodes reach the API
// server and the outside.
func (f Fabric) Gateway() string { return f.Subnet + ".1" }

// NodeIP is the underlay address of the node with index i (from 1).
func (f Fabric) NodeIP(i int) string { return f.Subnet + "." + strconv.Itoa(10+i) }

func (f Fabric) natTable() string { return f.Prefix }

// NewNode describes node name, the index-th (from 1) of fabric f, keeping
// its files in dir.
func NewNode(f Fabric, name string, index int, dir, podCIDR string) Node {
	return Node{Name: name, Index: index, IP: f.NodeIP(index), PodCIDR: podCIDR, Dir: dir, Fabric: f}
}

// Node is one node of a multi-node lab.
type Node struct {
	// Name is the Node's name and the netns's suffix.
	Name string
	// Index counts from 1.
	Index int
	// IP is the node's underlay address, its InternalIP.
	IP string
	// PodCIDR is the node's pod-network subnet (no two nodes overlap).
	PodCIDR string
	// Dir holds the node's private directories, scripts and pid files.
	Dir string
	// Fabric is what the node is plugged into.
	Fabric Fabric
}

// Netns is the node's named network namespace.
func (n Node) Netns() string { return n.Fabric.NetnsPrefix + n.Name }

// UnderlayLink is the host-side end of the node's underlay veth: down, the
// node is cut off from the API server and the other nodes (a partition).
func (n Node) UnderlayLink() string { under, _ := n.links(); return under }

// links are the host-side ends of the node's underlay and switch veths.
func (n Node) links() (under, sw string) {
	return fmt.Sprintf("%su%d", n.Fabric.Prefix, n.Index), fmt.Sprintf("%ss%d", n.Fabric.Prefix, n.Index)
}

func (n Node) path(parts ...string) string {
	return filepath.Join(append([]string{n.Dir}, parts...)...)
}

// AgentDir is the node agent's state directory.
func (n Node) AgentDir() string { return n.path("nodeagent") }

// HostUUID is the node's stable libvirt host UUID, derived from its name:
// libvirt refuses to migrate between daemons with equal ones, and without
// SMBIOS it would invent a new one at every start.
func (n Node) HostUUID() string {
	s := sha256.Sum256([]byte("nodevirt-lab/" + n.Name))
	s[6] = s[6]&0x0f | 0x40
	s[8] = s[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", s[0:4], s[4:6], s[6:8], s[8:10], s[10:16])
}

// Nodes lists the lab's nodes; nil for the one-node lab on the host.
func (c Config) Nodes() []Node {
	if c.NodeCount < 2 {
		return nil
	}
	nodes := make([]Node, c.NodeCount)
	for i := range nodes {
		name := fmt.Sprintf("node%d", i+1)
		nodes[i] = NewNode(LabFabric, name, i+1, c.path("nodes", name), fmt.Sprintf("10.244.%d.0/24", i+1))
	}
	return nodes
}

// Node finds a node of the lab by name.
func (c Config) Node(name string) (Node, error) {
	for _, n := range c.Nodes() {
		if n.Name == name {
			return n, nil
		}
	}
	return Node{}, fmt.Errorf("no lab node %q (the lab has %d)", name, c.NodeCount)
}

// run runs a command, its output in the error.
func run(name string, args ...string) error {
	if out, err := exec.Command(name, args...).CombinedOutput(); err != nil {
		return fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

func linkExists(name string) bool {
	_, err := os.Stat("/sys/class/net/" + name)
	return err == nil
}

// Up creates the host side of f: the underlay bridge with the gateway
// address, NAT for the nodes' egress, and the switch bridge. stateDir keeps
// what Down restores (IPv4 forwarding as it was).
func (f Fabric) Up(stateDir string) error {
	for _, br := range []string{f.UnderlayBridge(), f.SwitchBridge} {
		if !linkExists(br) {
			if err := run("ip", "link", "add", br, "type", "bridge"); err != nil {
				return err
			}
		}
		if err := run("ip", "link", "set", br, "up"); err != nil {
			return err
		}
	}
	if err := run("ip", "addr", "replace", fmt.Sprintf("%s/%d", f.Gateway(), underlayBits), "dev", f.UnderlayBridge()); err != nil {
		return err
	}
	// Forwarding as it was is restored by Down.
	fwd := "/proc/sys/net/ipv4/ip_forward"
	if _, err := os.Stat(filepath.Join(stateDir, "ip_forward.saved")); errors.Is(err, os.ErrNotExist) {
		old, err := os.ReadFile(fwd)
		if err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(stateDir, "ip_forward.saved"), old, 0o644); err != nil {
			return err
		}
	}
	if err := os.WriteFile(fwd, []byte("1"), 0o644); err != nil {
		return err
	}
	_ = run("nft", "delete", "table", "ip", f.natTable())
	rules := fmt.Sprintf("table ip %s {\n chain postrouting {\n  type nat hook postrouting priority srcnat; policy accept;\n"+
		"  ip saddr %s.0/%d oifname != %q masquerade\n }\n}\n", f.natTable(), f.Subnet, underlayBits, f.UnderlayBridge())
	cmd := exec.Command("nft", "-f", "-")
	cmd.Stdin = strings.NewReader(rules)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("nft nat table: %w: %s", err, out)
	}
	return nil
}

// ensureNodeNet creates node n's netns and links (idempotent).
func ensureNodeNet(n Node) error {
	ns := n.Netns()
	if _, err := os.Stat("/run/netns/" + ns); err != nil {
		if err := run("ip", "netns", "add", ns); err != nil {
			return err
		}
	}
	in := func(args ...string) error { return run("ip", append([]string{"-n", ns}, args...)...) }
	if err := in("link", "set", "lo", "up"); err != nil {
		return err
	}
	under, sw := n.links()
	f := n.Fabric
	if !linkExists(under) {
		if err := run("ip", "link", "add", under, "type", "veth", "peer", "name", "eth0", "netns", ns); err != nil {
			return err
		}
	}
	if !linkExists(sw) {
		if err := run("ip", "link", "add", sw, "type", "veth", "peer", "name", "lab0", "netns", ns); err != nil {
			return err
		}
	}
	for _, l := range []struct{ link, br string }{{under, f.UnderlayBridge()}, {sw, f.SwitchBridge}} {
		if err := run("ip", "link", "set", l.link, "master", l.br, "up"); err != nil {
			return err
		}
	}
	if err := in("link", "show", f.LabBridge); err != nil {
		if err := in("link", "add", f.LabBridge, "type", "bridge"); err != nil {
			return err
		}
	}
	for _, step := range [][]string{
		{"addr", "replace", fmt.Sprintf("%s/%d", n.IP, underlayBits), "dev", "eth0"},
		{"link", "set", "eth0", "up"},
		{"route", "replace", "default", "via", f.Gateway()},
		{"link", "set", "lab0", "master", f.LabBridge, "up"},
		{"link", "set", f.LabBridge, "up"},
	} {
		if err := in(step...); err != nil {
			return err
		}
	}
	return nil
}

// cgroupHierarchy is one cgroup mount of the host.
type cgroupHierarchy struct {
	// Dir is the mount point, e.g. /sys/fs/cgroup/memory.
	Dir string
	// FSType is cgroup or cgroup2; Options the mount's controller options.
	FSType, Options string
	// Own is this process's cgroup in it (relative to Dir).
	Own string
}

// hostCgroups lists the host's cgroup hierarchies and this process's place
// in each.
func hostCgroups() ([]cgroupHierarchy, error) {
	own := map[string]string{}
	data, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return nil, err
	}
	for _, line := range strings.Split(strings.TrimSpace(string(data)), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) == 3 {
			own[parts[1]] = parts[2]
		}
	}
	f, err := os.Open("/proc/self/mounts")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var hs []cgroupHierarchy
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 4 || (fields[2] != "cgroup" && fields[2] != "cgroup2") {
			continue
		}
		h := cgroupHierarchy{Dir: fields[1], FSType: fields[2]}
		if h.FSType == "cgroup2" {
			h.Own = own[""]
		} else {
			var ctrls []string
			for _, o := range strings.Split(fields[3], ",") {
				switch {
				case o == "rw" || o == "ro" || strings.HasPrefix(o, "relatime") || o == "nosuid" || o == "nodev" || o == "noexec":
				default:
					ctrls = append(ctrls, o)
				}
			}
			h.Options = strings.Join(ctrls, ",")
			for key, path := range own {
				if key != "" && sameControllers(key, ctrls) {
					h.Own = path
				}
			}
		}
		hs = append(hs, h)
	}
	return hs, sc.Err()
}

func sameControllers(key string, opts []string) bool {
	want := strings.Split(key, ",")
	var got []string
	for _, o := range opts {
		if !strings.Contains(o, "=") || strings.HasPrefix(o, "name=") {
			got = append(got, o)
		}
	}
	if len(want) != len(got) {
		return false
	}
	for _, w := range want {
		found := false
		for _, g := range got {
			if g == w {
				found = true
			}
		}
		if !found {
			return false
		}
	}
	return true
}

// nodeCgroupDir is node n's cgroup directory in hierarchy h: below this
// process's own cgroup, so the lab stays inside whatever limits it runs
// under.
func nodeCgroupDir(h cgroupHierarchy, n Node) string {
	return filepath.Join(h.Dir, h.Own, n.Fabric.Prefix, n.Name)
}

// ensureNodeCgroups creates node n's cgroups (cpuset ones get their
// parent's CPUs and memory nodes, which cgroup v1 leaves empty).
func ensureNodeCgroups(hs []cgroupHierarchy, n Node) error {
	for _, h := range hs {
		dir := nodeCgroupDir(h, n)
		for _, d := range []string{filepath.Dir(dir), dir} {
			if err := os.MkdirAll(d, 0o755); err != nil {
				return fmt.Errorf("cgroup %s: %w", d, err)
			}
			if strings.Contains(h.Options, "cpuset") {
				for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
					cur, _ := os.ReadFile(filepath.Join(d, f))
					if strings.TrimSpace(string(cur)) != "" {
						continue
					}
					v, err := os.ReadFile(filepath.Join(filepath.Dir(d), f))
					if err != nil {
						return err
					}
					if err := os.WriteFile(filepath.Join(d, f), v, 0o644); err != nil {
						return fmt.Errorf("%s/%s: %w", d, f, err)
					}
				}
			}
		}
	}
	return nil
}

// removeNodeCgroups removes node n's cgroups, deepest first (libvirt's
// machine cgroups below them), once their processes are gone.
func removeNodeCgroups(hs []cgroupHierarchy, n Node) error {
	var errs []error
	for _, h := range hs {
		root := nodeCgroupDir(h, n)
		var dirs []string
		_ = filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
		for i := len(dirs) - 1; i >= 0; i-- {
			if err := syscall.Rmdir(dirs[i]); err != nil && !errors.Is(err, os.ErrNotExist) {
				errs = append(errs, fmt.Errorf("rmdir %s: %w", dirs[i], err))
			}
		}
		_ = syscall.Rmdir(filepath.Dir(root)) // the lab's subtree, once empty
	}
	return errors.Join(errs...)
}

// writeNodeFiles writes node n's private libvirt configuration, /etc/hosts
// and its holder and enter scripts.
func writeNodeFiles(nodes []Node, n Node, hs []cgroupHierarchy) error {
	for _, d := range []string{"run/lock", "lib-libvirt", "log-libvirt/qemu", "cache-libvirt", "pools/default", "nodeagent", "pki-CA", "pki-libvirt"} {
		if err := os.MkdirAll(n.path(d), 0o755); err != nil {
			return err
		}
	}
	// Mount points of the node's own libvirt server files (its agent
	// writes them where libvirtd reloads them from, libvirttls.ServerRoot);
	// the host's files there, if any, are never touched.
	for _, d := range []string{"CA", "libvirt"} {
		if err := os.MkdirAll(filepath.Join(libvirttls.ServerRoot, d), 0o755); err != nil {
			return err
		}
	}
	etc := n.path("etc-libvirt")
	if _, err := os.Stat(etc); errors.Is(err, os.ErrNotExist) {
		if err := run("cp", "-a", "/etc/libvirt", etc); err != nil {
			return err
		}
		// No default network or domains of the host: a node starts empty.
		if err := os.RemoveAll(filepath.Join(etc, "qemu")); err != nil {
			return err
		}
		if err := os.MkdirAll(filepath.Join(etc, "qemu"), 0o755); err != nil {
			return err
		}
		if err := run("cp", "-a", "/var/lib/libvirt/.", n.path("lib-libvirt")); err != nil {
			return err
		}
	}
	// A node whose agent wrote its certificate before keeps serving TLS
	// (ServeLibvirtTLS).
	_, err := os.Stat(n.libvirtPKI(libvirtServerCert))
	if err := appendConf(filepath.Join(etc, "libvirtd.conf"), "nodevirt-lab", libvirtdConf(n, err == nil)); err != nil {
		return err
	}
	if err := appendConf(filepath.Join(etc, "qemu.conf"), "nodevirt-lab", map[string]string{
		"migration_address": quote(n.IP), "migration_host": quote(n.IP),
	}); err != nil {
		return err
	}
	hosts := "127.0.0.1\tlocalhost\n" + n.Fabric.Gateway() + "\tlab-host\n"
	for _, o := range nodes {
		hosts += o.IP + "\t" + o.Name + "\n"
	}
	if err := os.WriteFile(n.path("hosts"), []byte(hosts), 0o644); err != nil {
		return err
	}

	var join, mounts strings.Builder
	for _, h := range hs {
		fmt.Fprintf(&join, "echo $$ > %s/cgroup.procs\n", nodeCgroupDir(h, n))
		if h.FSType == "cgroup2" {
			fmt.Fprintf(&mounts, "mkdir -p %s && mount -t cgroup2 cgroup2 %s\n", h.Dir, h.Dir)
		} else {
			fmt.Fprintf(&mounts, "mkdir -p %s && mount -t cgroup -o %s cgroup %s\n", h.Dir, h.Options, h.Dir)
		}
	}
	binds := [][2]string{
		{n.path("run"), "/run"}, {etc, "/etc/libvirt"}, {n.path("lib-libvirt"), "/var/lib/libvirt"},
		{n.path("log-libvirt"), "/var/log/libvirt"}, {n.path("cache-libvirt"), "/var/cache/libvirt"},
		{n.path("hosts"), "/etc/hosts"},
		{n.path("pki-CA"), filepath.Join(libvirttls.ServerRoot, "CA")}, {n.path("pki-libvirt"), filepath.Join(libvirttls.ServerRoot, "libvirt")},
	}
	for _, b := range binds {
		fmt.Fprintf(&mounts, "mount --bind %s %s\n", b[0], b[1])
	}
	// The holder: joins the node's cgroups, enters the netns, unshares
	// mount, UTS and cgroup namespaces (the cgroup namespace's root is the
	// node's cgroup, joined first) and sets them up; then it only holds
	// them. Its pid stays the same through every exec.
	holder := "#!/bin/sh\nset -e\ncd /\n" + join.String() +
		fmt.Sprintf("exec nsenter --net=/run/netns/%s -- unshare --mount --uts --cgroup --propagation private -- /bin/sh %s\n",
			n.Netns(), n.path("init.sh"))
	initScript := "#!/bin/sh\nset -e\nhostname " + n.Name + "\n" +
		"mount -t sysfs sysfs /sys\nmount -t tmpfs -o mode=755 cgroup /sys/fs/cgroup\n" + mounts.String() +
		"touch " + n.path("holder.ready") + "\nexec sleep infinity\n"
	enter := "#!/bin/sh\n# Runs a command inside lab node " + n.Name + ".\nset -e\ncd /\n" + join.String() +
		fmt.Sprintf("exec nsenter --target \"$(cat %s)\" --net --mount --uts --cgroup -- \"$@\"\n", n.path("holder.pid"))
	for name, text := range map[string]string{"holder.sh": holder, "init.sh": initScript, "enter": enter} {
		if err := os.WriteFile(n.path(name), []byte(text), 0o755); err != nil {
			return err
		}
	}
	return nil
}

func quote(s string) string { return strconv.Quote(s) }

// appendConf sets keys in a libvirt configuration file: the block marked
// tag (libvirttls.SetBlock), beside the node agent's own.
func appendConf(file, tag string, kv map[string]string) error {
	_, err := libvirttls.SetBlock(file, tag, kv)
	return err
}

// startHolder starts node n's holder unless it runs, and waits until its
// namespaces are set up.
func startHolder(n Node) error {
	if _, ok := controlplane.AlivePid(n.path("holder.pid")); ok {
		return nil
	}
	os.Remove(n.path("holder.ready"))
	logf, err := os.OpenFile(n.path("holder.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer logf.Close()
	cmd := exec.Command("/bin/sh", n.path("holder.sh"))
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("node %s holder: %w", n.Name, err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	if err := os.WriteFile(n.path("holder.pid"), []byte(strconv.Itoa(cmd.Process.Pid)), 0o644); err != nil {
		return err
	}
	deadline := time.After(20 * time.Second)
	for {
		if _, err := os.Stat(n.path("holder.ready")); err == nil {
			return nil
		}
		select {
		case err := <-exited:
			log, _ := os.ReadFile(n.path("holder.log"))
			return fmt.Errorf("node %s holder exited: %v: %s", n.Name, err, lastLines(string(log), 5))
		case <-deadline:
			return fmt.Errorf("node %s holder not ready after 20s (see %s)", n.Name, n.path("holder.log"))
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func lastLines(s string, k int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	if len(lines) > k {
		lines = lines[len(lines)-k:]
	}
	return strings.Join(lines, "\n")
}

// EnterCommand is the command line that runs argv inside node n.
func EnterCommand(n Node, argv ...string) []string {
	return append([]string{"/bin/sh", n.path("enter")}, argv...)
}

// startNodeLibvirt starts node n's virtlogd then libvirtd unless they run.
func startNodeLibvirt(n Node) error {
	for _, d := range []struct{ name, sock string }{
		{"virtlogd", "virtlogd-sock"},
		{"libvirtd", "libvirt-sock"},
	} {
		pidFile := n.path("run", d.name+".pid")
		if _, ok := controlplane.AlivePid(pidFile); ok {
			continue
		}
		sock := n.path("run", "libvirt", d.sock)
		os.Remove(sock)
		args := []string{d.name, "--daemon", "--pid-file=/run/" + d.name + ".pid"}
		if d.name == "libvirtd" {
			args = append(args, "--listen")
		}
		argv := EnterCommand(n, args...)
		if out, err := exec.Command(argv[0], argv[1:]...).CombinedOutput(); err != nil {
			return fmt.Errorf("node %s: start %s: %w: %s", n.Name, d.name, err, out)
		}
		if err := waitFor(sock, 20*time.Second); err != nil {
			return fmt.Errorf("node %s: %s: %w", n.Name, d.name, err)
		}
	}
	return nil
}

// Files of the node agent's certificate in libvirt's layout (nodeagent
// --libvirt-pki-dir, default <state-dir>/libvirt-pki).
const libvirtServerCert = "servercert.pem"

// libvirtPKI is a file of the node agent's libvirt TLS directory.
func (n Node) libvirtPKI(name string) string {
	return filepath.Join(n.LibvirtPKIDir(), name)
}

// serverCertCopied reports whether node n's agent copied its server
// certificate where the node's libvirtd reads it.
func (n Node) serverCertCopied() bool {
	_, err := os.Stat(filepath.Join(n.path("pki-libvirt"), "servercert.pem"))
	return err == nil
}

// libvirtdConf is the lab's part of node n's libvirtd.conf: plain TCP
// without authentication and, with tls, libvirt's TLS listener, whose files
// and admitted subjects are the node agent's block (its
// --libvirt-conf-dir, package libvirttls).
func libvirtdConf(n Node, tls bool) map[string]string {
	kv := map[string]string{
		"host_uuid": quote(n.HostUUID()), "listen_tls": "0", "listen_tcp": "1", "listen_addr": quote(n.IP),
		"auth_tcp": quote("none"),
	}
	if tls {
		kv["listen_tls"] = "1"
	}
	return kv
}

// agentConfigured reports whether node n's agent wrote its TLS blocks
// into the node's libvirtd.conf and qemu.conf.
func agentConfigured(n Node) bool {
	for _, f := range []string{"libvirtd.conf", "qemu.conf"} {
		data, err := os.ReadFile(filepath.Join(n.path("etc-libvirt"), f))
		if err != nil || !strings.Contains(string(data), "# --- END "+libvirttls.Tag+" ---") {
			return false
		}
	}
	return true
}

// ServeLibvirtTLS makes node n's libvirtd listen with TLS on the
// certificate its agent (started with --migration-transport=tls and
// --libvirt-conf-dir=/etc/libvirt) wrote, and QEMU's migration streams
// use it: it waits up to wait for the files and the agent's blocks in
// libvirtd.conf and qemu.conf, then restarts libvirtd with them unless it
// already serves them, and says whether it did. Guests keep running across
// the restart.
func ServeLibvirtTLS(n Node, wait time.Duration) (bool, error) {
	if err := waitFor(n.libvirtPKI(libvirtServerCert), wait); err != nil {
		return false, fmt.Errorf("node %s: agent's libvirt certificate: %w", n.Name, err)
	}
	for deadline := time.Now().Add(wait); !agentConfigured(n) || !n.serverCertCopied(); time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			return false, fmt.Errorf("node %s: the agent wrote no TLS configuration into %s within %s", n.Name, n.path("etc-libvirt"), wait)
		}
	}
	conf := filepath.Join(n.path("etc-libvirt"), "libvirtd.conf")
	before, err := os.ReadFile(conf)
	if err != nil {
		return false, err
	}
	if err := appendConf(conf, "nodevirt-lab", libvirtdConf(n, true)); err != nil {
		return false, err
	}
	after, err := os.ReadFile(conf)
	if err != nil {
		return false, err
	}
	pidFile := n.path("run", "libvirtd.pid")
	pid, alive := controlplane.AlivePid(pidFile)
	if string(before) == string(after) && alive {
		return false, nil
	}
	if alive {
		if err := syscall.Kill(pid, syscall.SIGTERM); err != nil {
			return false, fmt.Errorf("node %s: stop libvirtd: %w", n.Name, err)
		}
		deadline := time.Now().Add(30 * time.Second)
		for {
			if _, ok := controlplane.AlivePid(pidFile); !ok {
				break
			}
			if time.Now().After(deadline) {
				return false, fmt.Errorf("node %s: libvirtd %d did not stop", n.Name, pid)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	return true, startNodeLibvirt(n)
}
