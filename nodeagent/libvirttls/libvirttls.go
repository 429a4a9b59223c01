// Package libvirttls sets up the node's libvirt for live migration over TLS
// with the node's own certificate (package nodecert writes the files): a
// block the agent owns in libvirtd.conf (the TLS listener's key_file,
// cert_file and ca_file, and tls_allowed_dn_list admitting only node
// certificates; the files in libvirt's default layout under /etc/pki, the
// only place server-update-tls reloads from) and one in qemu.conf (QEMU's native TLS for the migration
// stream, memory and NBD disk copy: migrate_tls_x509_cert_dir, verified and
// forced). libvirtd reads those files at start: when a block changes the
// configured restart command runs; when only the certificate was renewed a
// running libvirtd is told to load it (virt-admin server-update-tls).
//
// Who writes what: the agent writes its blocks (marked BEGIN/END with its
// tag) and nothing else of the files; a lab or an admin keeps its own keys
// outside them. libvirt takes the first of duplicated keys, so the keys of
// the blocks must not be set elsewhere.
package libvirttls

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	"github.com/nodevirt/nodevirt/nodeagent/nodecert"
)

// Tag marks the agent's blocks in libvirt's configuration files.
const Tag = "nodevirt-nodeagent"

// AllowedDN is the tls_allowed_dn_list pattern admitting a node certificate
// of the node CA (subject CN=system:node:<name>, O=nodevirt:nodes), in the
// form libvirt compares (GnuTLS's string of the subject in certificate
// order, as virt-pki-query-dn prints it), and
// nothing else the CA might sign.
var AllowedDN = "O=" + identity.NodesGroup + ",CN=" + identity.NodeUser("*")

// ServerRoot is where libvirtd looks for its TLS server files by default
// (SYSCONFDIR/pki): virt-admin server-update-tls reloads them from there
// only, whatever key_file, cert_file and ca_file say, so the agent puts
// them there (ServerFiles) and names the same paths.
const ServerRoot = "/etc/pki"

// ServerFiles are the CA, certificate and key files of libvirtd's TLS
// listener under root (libvirt's default layout).
func ServerFiles(root string) (ca, cert, key string) {
	return filepath.Join(root, "CA", "cacert.pem"), filepath.Join(root, "libvirt", "servercert.pem"),
		filepath.Join(root, "libvirt", "private", "serverkey.pem")
}

// LibvirtdSettings are the agent's keys of libvirtd.conf: the TLS
// listener's files under root (ServerRoot but in tests) and the subjects
// it admits. Whether libvirtd listens at all is how it is started
// (--listen with listen_tls, or systemd's libvirtd-tls.socket).
func LibvirtdSettings(root string) map[string]string {
	ca, cert, key := ServerFiles(root)
	return map[string]string{
		"key_file":            strconv.Quote(key),
		"cert_file":           strconv.Quote(cert),
		"ca_file":             strconv.Quote(ca),
		"auth_tls":            strconv.Quote("none"),
		"tls_allowed_dn_list": "[" + strconv.Quote(AllowedDN) + "]",
	}
}

// CopyServerFiles copies the node certificate's server files from pkiDir
// (nodecert's libvirt layout) to libvirt's default layout under root: the
// CA and certificate 0644, the key 0600 in a 0700 directory.
func CopyServerFiles(pkiDir, root string) error {
	ca, cert, key := ServerFiles(root)
	for _, f := range []struct {
		from, to string
		mode     os.FileMode
	}{
		{nodecert.LibvirtCAFile, ca, 0o644}, {nodecert.LibvirtServerCertFile, cert, 0o644},
		{nodecert.LibvirtServerKeyFile, key, 0o600},
	} {
		data, err := os.ReadFile(filepath.Join(pkiDir, f.from))
		if err != nil {
			return err
		}
		dirMode := os.FileMode(0o755)
		if f.mode == 0o600 {
			dirMode = 0o700
		}
		if err := os.MkdirAll(filepath.Dir(f.to), dirMode); err != nil {
			return err
		}
		tmp := f.to + ".tmp"
		if err := os.WriteFile(tmp, data, f.mode); err != nil {
			return err
		}
		if err := os.Rename(tmp, f.to); err != nil {
			return err
		}
	}
	return nil
}

// QEMUSettings are the agent's keys of qemu.conf: QEMU's native TLS with
// the files in qemuDir for every migration stream, the peer's certificate
// verified, and a migration without VIR_MIGRATE_TLS refused.
func QEMUSettings(qemuDir string) map[string]string {
	return map[string]string{
		"migrate_tls_x509_cert_dir": strconv.Quote(qemuDir),
		"migrate_tls_x509_verify":   "1",
		"migrate_tls_force":         "1",
	}
}

// SetBlock makes kv (key = value lines, sorted) the block marked tag in a
// libvirt configuration file, replacing that block where it is (appended
// when missing) and leaving the rest of the file as it was; it reports
// whether the file changed.
func SetBlock(file, tag string, kv map[string]string) (bool, error) {
	var body strings.Builder
	for _, k := range slices.Sorted(maps.Keys(kv)) {
		body.WriteString(k + " = " + kv[k] + "\n")
	}
	return setBlock(file, tag, body.String())
}

// RemoveBlocks takes the agent's blocks (Tag) out of libvirtd.conf and
// qemu.conf in confDir, for uninstalling (`nodeagent
// --teardown-libvirt-tls`): the files they name go with the agent's state,
// and a qemu.conf naming a missing migrate_tls_x509_cert_dir stops
// libvirtd from starting at all.
func RemoveBlocks(confDir string) error {
	var errs []error
	for _, file := range []string{"libvirtd.conf", "qemu.conf"} {
		if _, err := removeBlock(filepath.Join(confDir, file), Tag); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// removeBlock deletes the block marked tag from file, reporting whether
// there was one; a missing file has none.
func removeBlock(file, tag string) (bool, error) {
	data, err := os.ReadFile(file)
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	begin, end := "# --- BEGIN "+tag+" ---\n", "# --- END "+tag+" ---\n"
	old := string(data)
	i := strings.Index(old, begin)
	if i < 0 {
		return false, nil
	}
	rest := old[i+len(begin):]
	after := ""
	if j := strings.Index(rest, end); j >= 0 {
		after = rest[j+len(end):]
	}
	return true, writeAtomic(file, old[:i]+after)
}

// setBlock makes body (whole lines) the block marked tag in file.
func setBlock(file, tag, body string) (bool, error) {
	data, err := os.ReadFile(file)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return false, err
	}
	begin, end := "# --- BEGIN "+tag+" ---\n", "# --- END "+tag+" ---\n"
	var block strings.Builder
	block.WriteString(begin)
	block.WriteString(body)
	block.WriteString(end)
	old := string(data)
	text := ""
	if i := strings.Index(old, begin); i >= 0 {
		// In place: the other blocks keep their order.
		rest := old[i+len(begin):]
		after := ""
		if j := strings.Index(rest, end); j >= 0 {
			after = rest[j+len(end):]
		}
		text = old[:i] + block.String() + after
	} else {
		if old != "" && !strings.HasSuffix(old, "\n") {
			old += "\n"
		}
		text = old + block.String()
	}
	if text == string(data) {
		return false, nil
	}
	return true, writeAtomic(file, text)
}

// writeAtomic replaces file with text through a rename.
func writeAtomic(file, text string) error {
	tmp := file + ".tmp"
	if err := os.WriteFile(tmp, []byte(text), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, file)
}

// Config configures a Configurer.
type Config struct {
	// ConfDir is libvirt's configuration directory (libvirtd.conf,
	// qemu.conf); empty: the files are not managed, only reloads run.
	ConfDir string
	// PKIDir holds the node certificate in libvirt's layout; QEMUDir in
	// QEMU's (both written by nodecert). With ConfDir the server's files
	// are copied to libvirt's default layout under ServerRoot (default
	// the package's ServerRoot, what libvirtd reloads).
	PKIDir, QEMUDir, ServerRoot string
	// AdminURI is libvirtd's admin endpoint for server-update-tls
	// (default libvirtd:///system); Server the server to update (default
	// libvirtd).
	AdminURI, Server string
	// Restart restarts libvirtd (through /bin/sh -c) after a block
	// changed, so it reads them; empty: the change is logged, and takes
	// effect at libvirtd's next start.
	Restart string
	// AppArmorRoot is AppArmor's profile directory (default
	// AppArmorRoot). With ConfDir set and AppArmorEnabled true (default:
	// the kernel enforces AppArmor), QEMU is allowed to read QEMUDir there
	// (apparmor.go).
	AppArmorRoot    string
	AppArmorEnabled func() bool
	// AppArmorParser loads a profile again (default apparmor_parser -r;
	// --base and the profile's path are appended).
	AppArmorParser []string
	Log            *slog.Logger
}

// Configurer applies Config whenever the node certificate is written.
type Configurer struct {
	cfg Config
	log *slog.Logger
	// written is signalled by nodecert after each write of the files.
	written chan struct{}
	// restartDue: a block changed and libvirtd has not restarted since
	// (the restart failed): the retry restarts although nothing changes.
	restartDue bool
}

// New defaults cfg.
func New(cfg Config) *Configurer {
	if cfg.AdminURI == "" {
		cfg.AdminURI = "libvirtd:///system"
	}
	if cfg.Server == "" {
		cfg.Server = "libvirtd"
	}
	if cfg.ServerRoot == "" {
		cfg.ServerRoot = ServerRoot
	}
	if cfg.AppArmorRoot == "" {
		cfg.AppArmorRoot = AppArmorRoot
	}
	if cfg.AppArmorEnabled == nil {
		cfg.AppArmorEnabled = AppArmorEnabled
	}
	if len(cfg.AppArmorParser) == 0 {
		cfg.AppArmorParser = []string{"apparmor_parser", "-r"}
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	return &Configurer{cfg: cfg, log: cfg.Log.With("role", "libvirt-tls"), written: make(chan struct{}, 1)}
}

// Written tells the configurer the certificate files were (re)written; it
// never blocks (nodecert.Config.OnWritten).
func (c *Configurer) Written() {
	select {
	case c.written <- struct{}{}:
	default:
	}
}

// Name implements the daemon role.
func (c *Configurer) Name() string { return "libvirt-tls" }

// Run applies the configuration after every write of the certificate
// until ctx ends; a failed step is retried.
func (c *Configurer) Run(ctx context.Context) error {
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-c.written:
		}
		for retry := 2 * time.Second; ; retry = min(retry*2, time.Minute) {
			err := c.Apply(ctx)
			if err == nil || ctx.Err() != nil {
				break
			}
			c.log.Error("libvirt tls configuration", "err", err, "retry", retry)
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(retry):
			}
		}
	}
}

// Apply writes the blocks and makes libvirtd use them: a restart when a
// block changed, otherwise server-update-tls (the certificate was renewed).
func (c *Configurer) Apply(ctx context.Context) error {
	changed := false
	if c.cfg.ConfDir != "" {
		if err := CopyServerFiles(c.cfg.PKIDir, c.cfg.ServerRoot); err != nil {
			return fmt.Errorf("libvirt tls: %w", err)
		}
		for file, kv := range map[string]map[string]string{
			"libvirtd.conf": LibvirtdSettings(c.cfg.ServerRoot),
			"qemu.conf":     QEMUSettings(c.cfg.QEMUDir),
		} {
			ch, err := SetBlock(filepath.Join(c.cfg.ConfDir, file), Tag, kv)
			if err != nil {
				return fmt.Errorf("libvirt tls: %w", err)
			}
			changed = changed || ch
		}
		if c.cfg.AppArmorEnabled() {
			// Not a libvirtd setting: no restart for it.
			if err := c.allowQEMUDir(ctx); err != nil {
				return fmt.Errorf("libvirt tls: %w", err)
			}
		}
	}
	c.restartDue = c.restartDue || changed
	switch {
	case c.restartDue && c.cfg.Restart != "":
		c.log.Info("restarting libvirtd to serve TLS with the node certificate", "command", c.cfg.Restart)
		if out, err := run(ctx, "/bin/sh", "-c", c.cfg.Restart); err != nil {
			return fmt.Errorf("restart libvirtd: %w: %s", err, out)
		}
		c.restartDue = false
	case c.restartDue:
		c.restartDue = false
		c.log.Warn("libvirt's TLS configuration written; libvirtd serves it from its next start", "dir", c.cfg.ConfDir)
	default:
		// Not retried: a libvirtd without a TLS listener (configured by
		// hand, not yet restarted) has nothing to update; the next
		// renewal tries again.
		if err := UpdateTLS(ctx, c.cfg.AdminURI, c.cfg.Server); err != nil {
			c.log.Warn("libvirtd did not load the node certificate", "err", err)
			return nil
		}
		c.log.Info("libvirtd serves the current node certificate")
	}
	return nil
}

// UpdateTLS makes the libvirtd at adminURI load its TLS files again
// (virt-admin server-update-tls): a renewed certificate without a restart.
func UpdateTLS(ctx context.Context, adminURI, server string) error {
	if out, err := run(ctx, "virt-admin", "-c", adminURI, "server-update-tls", server); err != nil {
		return fmt.Errorf("virt-admin server-update-tls %s: %w: %s", server, err, out)
	}
	return nil
}

func run(ctx context.Context, argv ...string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, argv[0], argv[1:]...).CombinedOutput()
	return strings.TrimSpace(string(out)), err
}
