// Command migration benchmarks nodevirt's live migration data path against
// raw `virsh migrate --live --p2p --copy-storage-all` of the same guest
// between the same two nodes, in the same run (issue 16's anchor).
//
// Two nodes run as `make lab NODES=2` runs them (test/lab: namespaces of
// their own, libvirtd + virtlogd each), on a fabric of the benchmark's own.
// Both methods migrate as the node agents do: libvirt's qemu+tls between
// the daemons and QEMU's native TLS for the stream (VIR_MIGRATE_TLS,
// forced by qemu.conf; virsh --tls), with node certificates of a CA made
// for the run (written as the agent writes its own, lab.ServeTLSWith);
// -transport=tcp runs both over plain TCP (lab only). The guest is the
// test suite's boot disk with 256 MiB of RAM and a 512 MiB data disk
// holding 256 MiB of random data, both node-local: each migration copies
// them (NBD) into empty sparse files the target prepared. Its domain is nodevirt's
// conversion (launcher/domain) with each node's paths; nodevirt's
// migrations go through launcher.Migrate with the target's own definition
// as the destination XML, as the node agent does; the anchor's through
// virsh with that same XML. The guest moves back and forth, the two methods
// taking turns two migrations at a time (so each moves it both ways). Rows:
// median total (wall) time and libvirt's downtime.
//
// Not measured here: the brain's and agents' orchestration around it
// (VMIM phases, target preparation), which the e2e test times.
package main

import (
	"context"
	"crypto/rand"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	k8sv1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	v1 "kubevirt.io/api/core/v1"
	"libvirt.org/go/libvirtxml"

	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/certs"
	"github.com/nodevirt/nodevirt/launcher"
	"github.com/nodevirt/nodevirt/launcher/domain"
	"github.com/nodevirt/nodevirt/test/bench/report"
	"github.com/nodevirt/nodevirt/test/guest"
	"github.com/nodevirt/nodevirt/test/lab"
)

const (
	vmName   = "bench_mover"
	dataSize = 512 << 20
	dataUsed = 256 << 20
)

func main() {
	rounds := flag.Int("rounds", 4, "migrations per method (even: each method both ways)")
	dir := flag.String("dir", "/var/tmp/nodevirt-bench-migration", "working directory (removed at the end)")
	transport := flag.String("transport", "tls", "tls (the node agents' transport: qemu+tls and QEMU's native TLS) or tcp (qemu+tcp, the stream in clear: lab only)")
	flag.Parse()
	if *transport != "tls" && *transport != "tcp" {
		fmt.Fprintln(os.Stderr, "bench migration: -transport is tls or tcp")
		os.Exit(2)
	}
	if err := run(*rounds, *dir, *transport == "tls"); err != nil {
		fmt.Fprintln(os.Stderr, "bench migration:", err)
		os.Exit(1)
	}
}

type node struct {
	lab.Node
	// uri is the benchmark's own connection to the node's libvirtd.
	uri string
	tls bool
}

// migrationURI is the node's libvirtd as a source node's libvirtd reaches
// it for a migration: with TLS the source's node certificate is the
// client's.
func (n node) migrationURI(from node) string {
	if !n.tls {
		return n.uri
	}
	return "qemu+tls://" + n.IP + "/system?pkipath=" + from.LibvirtPKIDir()
}

// disks are node n's files of the guest.
func (n node) disks() (boot, data string) {
	return filepath.Join(n.Dir, "guest", "boot.raw"), filepath.Join(n.Dir, "guest", "data.raw")
}

func run(rounds int, dir string, tls bool) error {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	fabric := lab.Fabric{Prefix: "nvbm", Subnet: "10.76.0", SwitchBridge: "nvbm-sw", LabBridge: "br-bm", NetnsPrefix: "nvbench-"}
	var nodes []node
	for i, name := range []string{"bm1", "bm2"} {
		n := lab.NewNode(fabric, name, i+1, filepath.Join(dir, name), fmt.Sprintf("10.75.%d.0/24", i+1))
		nodes = append(nodes, node{Node: n, uri: "qemu+tcp://" + n.IP + "/system", tls: tls})
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	defer func() {
		for _, n := range nodes {
			_ = lab.RemoveNode(n.Node)
		}
		_ = fabric.Down(dir)
		_ = os.RemoveAll(dir)
	}()
	if err := fabric.Up(dir); err != nil {
		return err
	}
	labNodes := []lab.Node{nodes[0].Node, nodes[1].Node}
	for _, n := range nodes {
		if err := os.MkdirAll(n.Dir, 0o755); err != nil {
			return err
		}
		if err := lab.StartNode(n.Node, labNodes); err != nil {
			return err
		}
		if err := os.MkdirAll(filepath.Join(n.Dir, "guest"), 0o755); err != nil {
			return err
		}
	}
	if tls {
		if err := serveTLS(nodes); err != nil {
			return err
		}
	}
	src, err := guest.BootDisk(ctx, guest.DiskSpec{})
	if err != nil {
		return err
	}
	boot, data := nodes[0].disks()
	if err := copyFile(src, boot); err != nil {
		return err
	}
	if err := randomData(data); err != nil {
		return err
	}
	first, err := launcher.Open(launcher.Config{URI: nodes[0].uri, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		return err
	}
	dom, err := domainOn(nodes[0])
	if err != nil {
		first.Close()
		return err
	}
	err = first.Create(ctx, dom, launcher.StartOptions{})
	first.Close()
	if err != nil {
		return err
	}
	time.Sleep(15 * time.Second) // the guest boots, then idles

	var rawTotal, rawDown, nvTotal, nvDown []time.Duration
	at := 0
	for i := range 2 * rounds {
		from, to := nodes[at], nodes[1-at]
		destXML, err := prepareTarget(ctx, to)
		if err != nil {
			return err
		}
		// raw, raw, nodevirt, nodevirt, ...: each method moves the guest
		// both ways.
		if (i/2)%2 == 0 {
			total, down, err := virshMigrate(from, to, destXML)
			if err != nil {
				return err
			}
			rawTotal, rawDown = append(rawTotal, total), append(rawDown, down)
		} else {
			total, down, err := nodevirtMigrate(ctx, from, to)
			if err != nil {
				return err
			}
			nvTotal, nvDown = append(nvTotal, total), append(nvDown, down)
		}
		fmt.Fprintf(os.Stderr, "  round %d %s→%s done\n", i, from.Name, to.Name)
		at = 1 - at
	}
	via, anchor := "TLS", "virsh migrate --live --p2p --copy-storage-all --tls"
	if !tls {
		via, anchor = "plain TCP", "virsh migrate --live --p2p --copy-storage-all"
	}
	total := report.Result{Name: "live migration (" + via + ") total, 256 MiB guest + 512 MiB local disk (256 MiB data), median", Unit: "ms",
		Value: report.Millis(median(nvTotal)), Anchor: report.Millis(median(rawTotal)), AnchorName: anchor,
		Target: "≤ 1.1×", LowerIsBetter: true}
	total.Met = total.Ratio() <= 1.1
	down := report.Result{Name: "live migration (" + via + ") downtime (libvirt job stats), median", Unit: "ms",
		Value: report.Millis(median(nvDown)), Anchor: report.Millis(median(rawDown)), AnchorName: anchor,
		Target: "≤ anchor + 50 ms and ≤ 300 ms", LowerIsBetter: true}
	down.Met = down.Value <= down.Anchor+50 && down.Value <= 300
	report.Emit(total)
	report.Emit(down)
	return nil
}

// serveTLS gives each node a certificate of a CA made for the run (as the
// brain's signer issues them: CN system:node:<name>, O nodevirt:nodes, the
// node's IP) and makes its libvirt migrate over TLS with it.
func serveTLS(nodes []node) error {
	ca, err := certs.CreateCA("nodevirt-bench-node-ca", 24*time.Hour, time.Now())
	if err != nil {
		return err
	}
	g, err := user.LookupGroup("libvirt-qemu")
	if err != nil {
		return fmt.Errorf("qemu's group: %w", err)
	}
	gid, err := strconv.Atoi(g.Gid)
	if err != nil {
		return err
	}
	for _, n := range nodes {
		kp, err := ca.Issue(certs.Leaf{CommonName: identity.NodeUser(n.Name), Organization: []string{identity.NodesGroup},
			IPs: []net.IP{net.ParseIP(n.IP)}, Server: true, Client: true})
		if err != nil {
			return err
		}
		chain := append(append([]byte{}, kp.CertPEM...), certs.EncodeCertificate(ca.Cert.Raw)...)
		if err := lab.ServeTLSWith(n.Node, chain, kp.KeyPEM, gid); err != nil {
			return err
		}
	}
	return nil
}

// domainOn is the guest's domain with node n's paths.
func domainOn(n node) (*libvirtxml.Domain, error) {
	boot, data := n.disks()
	no := false
	vmi := &v1.VirtualMachineInstance{
		ObjectMeta: metav1.ObjectMeta{Namespace: "bench", Name: "mover", UID: types.UID("b1000000-0000-4000-8000-00000000a001")},
		Spec: v1.VirtualMachineInstanceSpec{
			Domain: v1.DomainSpec{
				Resources: v1.ResourceRequirements{Requests: k8sv1.ResourceList{k8sv1.ResourceMemory: resource.MustParse("256Mi")}},
				Devices: v1.Devices{AutoattachGraphicsDevice: &no, Disks: []v1.Disk{
					{Name: "boot", DiskDevice: v1.DiskDevice{Disk: &v1.DiskTarget{Bus: v1.DiskBusVirtio}}},
					{Name: "data", DiskDevice: v1.DiskDevice{Disk: &v1.DiskTarget{Bus: v1.DiskBusVirtio}}},
				}},
			},
			Volumes: []v1.Volume{
				{Name: "boot", VolumeSource: v1.VolumeSource{PersistentVolumeClaim: &v1.PersistentVolumeClaimVolumeSource{
					PersistentVolumeClaimVolumeSource: k8sv1.PersistentVolumeClaimVolumeSource{ClaimName: "boot"}}}},
				{Name: "data", VolumeSource: v1.VolumeSource{PersistentVolumeClaim: &v1.PersistentVolumeClaimVolumeSource{
					PersistentVolumeClaimVolumeSource: k8sv1.PersistentVolumeClaimVolumeSource{ClaimName: "data"}}}},
			},
		},
	}
	env := domain.Env{Emulation: true, StateDir: filepath.Join(n.Dir, "guest", "state"),
		Disks: map[string]domain.DiskSource{"boot": {Path: boot, Format: domain.FormatRaw}, "data": {Path: data, Format: domain.FormatRaw}}}
	if err := os.MkdirAll(env.StateDir, 0o755); err != nil {
		return nil, err
	}
	return domain.Convert(vmi, env)
}

// prepareTarget does what the target node agent does: empty sparse disks
// of the source's sizes, the domain defined with the node's paths; it
// returns the definition as the source fetches it.
func prepareTarget(ctx context.Context, n node) (string, error) {
	boot, data := n.disks()
	srcBoot, err := guest.BootDisk(ctx, guest.DiskSpec{})
	if err != nil {
		return "", err
	}
	st, err := os.Stat(srcBoot)
	if err != nil {
		return "", err
	}
	for _, f := range []struct {
		path string
		size int64
	}{{boot, st.Size()}, {data, dataSize}} {
		os.Remove(f.path)
		if err := sparse(f.path, f.size); err != nil {
			return "", err
		}
	}
	dom, err := domainOn(n)
	if err != nil {
		return "", err
	}
	lv, err := launcher.Open(launcher.Config{URI: n.uri, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		return "", err
	}
	defer lv.Close()
	if err := lv.Define(ctx, dom); err != nil {
		return "", err
	}
	return launcher.RemoteDomainXML(n.uri, dom.Name)
}

// virshMigrate is the anchor: virsh, peer to peer, disks copied, over
// the same TLS transport.
func virshMigrate(from, to node, destXML string) (time.Duration, time.Duration, error) {
	xmlFile := filepath.Join(from.Dir, "dest.xml")
	if err := os.WriteFile(xmlFile, []byte(destXML), 0o644); err != nil {
		return 0, 0, err
	}
	t0 := time.Now()
	args := []string{"-c", from.uri, "migrate", "--live", "--p2p", "--persistent", "--copy-storage-all"}
	if to.tls {
		args = append(args, "--tls")
	}
	args = append(args, "--xml", xmlFile, "--persistent-xml", xmlFile, vmName, to.migrationURI(from))
	out, err := exec.Command("virsh", args...).CombinedOutput()
	total := time.Since(t0)
	if err != nil {
		return 0, 0, fmt.Errorf("virsh migrate: %w: %s", err, out)
	}
	info, err := exec.Command("virsh", "-c", from.uri, "domjobinfo", "--completed", vmName).CombinedOutput()
	if err != nil {
		return 0, 0, fmt.Errorf("virsh domjobinfo: %w: %s", err, info)
	}
	m := regexp.MustCompile(`Total downtime:\s+(\d+)\s+ms`).FindSubmatch(info)
	if m == nil {
		return 0, 0, fmt.Errorf("no downtime in domjobinfo: %s", info)
	}
	ms, _ := strconv.Atoi(string(m[1]))
	if out, err := exec.Command("virsh", "-c", from.uri, "undefine", vmName).CombinedOutput(); err != nil {
		return 0, 0, fmt.Errorf("virsh undefine: %w: %s", err, out)
	}
	return total, time.Duration(ms) * time.Millisecond, nil
}

// nodevirtMigrate is the node agent's data path: launcher.Migrate with the
// target's definition fetched from its libvirtd.
func nodevirtMigrate(ctx context.Context, from, to node) (time.Duration, time.Duration, error) {
	lv, err := launcher.Open(launcher.Config{URI: from.uri, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		return 0, 0, err
	}
	defer lv.Close()
	t0 := time.Now()
	dest := to.migrationURI(from)
	destXML, err := launcher.RemoteDomainXML(dest, vmName)
	if err != nil {
		return 0, 0, err
	}
	stats, err := lv.Migrate(ctx, vmName, launcher.MigrateOptions{DestURI: dest, DestXML: destXML, CopyStorage: true, TLS: to.tls})
	total := time.Since(t0)
	if err != nil {
		return 0, 0, err
	}
	if err := lv.Undefine(ctx, vmName); err != nil {
		return 0, 0, err
	}
	return total, stats.Downtime, nil
}

func median(ds []time.Duration) time.Duration {
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	if len(s) == 0 {
		return 0
	}
	return s[len(s)/2]
}

func sparse(path string, size int64) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Truncate(size)
}

func randomData(path string) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	defer f.Close()
	if _, err := io.CopyN(f, rand.Reader, dataUsed); err != nil {
		return err
	}
	return f.Truncate(dataSize)
}

func copyFile(src, dst string) error {
	out, err := exec.Command("cp", "--sparse=always", src, dst).CombinedOutput()
	if err != nil {
		return fmt.Errorf("cp %s: %w: %s", src, err, strings.TrimSpace(string(out)))
	}
	return nil
}
