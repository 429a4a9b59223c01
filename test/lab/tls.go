package lab

import (
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/nodevirt/nodevirt/nodeagent/libvirttls"
	"github.com/nodevirt/nodevirt/nodeagent/nodecert"
)

// LibvirtPKIDir and QEMUTLSDir are where node n's agent keeps its
// certificate in libvirt's and QEMU's layouts (its defaults under
// --state-dir): the source's pkipath= and the nodes' QEMU directory.
func (n Node) LibvirtPKIDir() string { return filepath.Join(n.AgentDir(), "libvirt-pki") }

// QEMUTLSDir: see LibvirtPKIDir.
func (n Node) QEMUTLSDir() string { return filepath.Join(n.AgentDir(), "qemu-tls") }

// ServeTLSWith makes node n's libvirt migrate over TLS with a certificate
// given here (leaf then CA, and its key) instead of one its agent got, for
// a node without an agent (the migration benchmark): it writes what the
// agent writes with --migration-transport=tls --libvirt-conf-dir (the
// certificate in libvirt's and QEMU's layouts, QEMU's readable by group
// qemuGid, libvirtd's server files, the agent's blocks in libvirtd.conf
// and qemu.conf) and restarts libvirtd with them (ServeLibvirtTLS).
func ServeTLSWith(n Node, chainPEM, keyPEM []byte, qemuGid int) error {
	if err := nodecert.WriteLibvirtPKI(n.LibvirtPKIDir(), chainPEM, keyPEM); err != nil {
		return err
	}
	if err := nodecert.WriteQEMUPKI(n.QEMUTLSDir(), qemuGid, chainPEM, keyPEM); err != nil {
		return err
	}
	// libvirttls.ServerRoot as the node sees it: its CA and libvirt
	// directories are bound from the node's own.
	root, err := os.MkdirTemp(n.Dir, "server-root-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(root)
	for d, from := range map[string]string{"CA": n.path("pki-CA"), "libvirt": n.path("pki-libvirt")} {
		if err := os.Symlink(from, filepath.Join(root, d)); err != nil {
			return err
		}
	}
	if err := libvirttls.CopyServerFiles(n.LibvirtPKIDir(), root); err != nil {
		return fmt.Errorf("node %s: %w", n.Name, err)
	}
	for file, kv := range map[string]map[string]string{
		"libvirtd.conf": libvirttls.LibvirtdSettings(libvirttls.ServerRoot),
		"qemu.conf":     libvirttls.QEMUSettings(n.QEMUTLSDir()),
	} {
		if _, err := libvirttls.SetBlock(filepath.Join(n.path("etc-libvirt"), file), libvirttls.Tag, kv); err != nil {
			return err
		}
	}
	_, err = ServeLibvirtTLS(n, 30*time.Second)
	return err
}
