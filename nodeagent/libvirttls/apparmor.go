package libvirttls

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
)

// AppArmor. On a host where AppArmor confines QEMU (Debian's and Ubuntu's
// libvirt: virt-aa-helper loads a profile for each domain at its start,
// and that profile includes abstractions/libvirt-qemu), QEMU may read
// /etc/pki/qemu but not the agent's QEMUDir (by default under
// /var/lib/nodevirt), so a migration over TLS fails when QEMU loads its
// certificate. The abstraction ends by including
// local/abstractions/libvirt-qemu, the site's additions: the agent keeps a
// block there allowing QEMU to read QEMUDir (one block per directory, so
// nodes sharing a host keep theirs), and when the block changed it loads
// the profiles of the domains already defined again (apparmor_parser -r),
// so a guest started before it can migrate out; later guests get it with
// their profile.

// AppArmorRoot is AppArmor's profile directory.
const AppArmorRoot = "/etc/apparmor.d"

// AppArmorEnabled reports whether the kernel enforces AppArmor.
func AppArmorEnabled() bool {
	data, err := os.ReadFile("/sys/module/apparmor/parameters/enabled")
	return err == nil && strings.TrimSpace(string(data)) == "Y"
}

// AppArmorRules are the rules letting QEMU read the files in dir: the
// directory and everything under it, read only. A dir AppArmor would read
// as a pattern (globbing or quoting characters) is refused.
func AppArmorRules(dir string) (string, error) {
	d := filepath.Clean(dir)
	if !filepath.IsAbs(d) || strings.ContainsAny(d, "*?[]{}^\"\\,#@\n\t\x00") {
		return "", fmt.Errorf("%q: not an absolute path AppArmor takes literally", dir)
	}
	if d == "/" {
		return "", errors.New("the root directory as QEMU's certificate directory")
	}
	return strconv.Quote(d+"/") + " r,\n" + strconv.Quote(d+"/**") + " r,\n", nil
}

// domainProfile is the name of a profile virt-aa-helper wrote for a
// domain (libvirt-<uuid>; its paths are in libvirt-<uuid>.files).
var domainProfile = regexp.MustCompile(`^libvirt-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`)

// allowQEMUDir keeps the agent's block in the local abstraction and, when
// it changed, loads the domains' profiles again.
func (c *Configurer) allowQEMUDir(ctx context.Context) error {
	root := c.cfg.AppArmorRoot
	if _, err := os.Stat(filepath.Join(root, "abstractions", "libvirt-qemu")); err != nil {
		c.log.Info("no libvirt-qemu AppArmor abstraction: QEMU is not confined by libvirt's profiles", "dir", root)
		return nil
	}
	rules, err := AppArmorRules(c.cfg.QEMUDir)
	if err != nil {
		return fmt.Errorf("apparmor: %w", err)
	}
	local := filepath.Join(root, "local", "abstractions", "libvirt-qemu")
	if err := os.MkdirAll(filepath.Dir(local), 0o755); err != nil {
		return fmt.Errorf("apparmor: %w", err)
	}
	changed, err := setBlock(local, Tag+" "+filepath.Clean(c.cfg.QEMUDir), rules)
	if err != nil || !changed {
		return err
	}
	c.log.Info("AppArmor: QEMU may read the migration certificates", "dir", c.cfg.QEMUDir, "file", local)
	entries, err := os.ReadDir(filepath.Join(root, "libvirt"))
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("apparmor: %w", err)
	}
	for _, e := range entries {
		if !domainProfile.MatchString(e.Name()) {
			continue
		}
		argv := append(append([]string{}, c.cfg.AppArmorParser...), "--base", root, filepath.Join(root, "libvirt", e.Name()))
		if out, err := run(ctx, argv...); err != nil {
			// The guest keeps running; only its migrations out fail
			// until its profile is loaded again (its next start).
			c.log.Warn("AppArmor: domain profile not reloaded", "profile", e.Name(), "err", err, "output", out)
		}
	}
	return nil
}
