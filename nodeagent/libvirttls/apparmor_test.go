package libvirttls_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nodevirt/nodevirt/nodeagent/libvirttls"
)

// TestAppArmorAllowsQEMUDir: on an AppArmor host the agent adds a block
// letting QEMU read its certificate directory to the local override of
// Debian's libvirt-qemu abstraction (once, the rest of the file kept), and
// loads the domains' profiles again; the profile of a domain as
// virt-aa-helper writes it, with the host's abstractions, then compiles
// (apparmor_parser -Q) and carries the rule.
func TestAppArmorAllowsQEMUDir(t *testing.T) {
	if _, err := os.Stat(filepath.Join(libvirttls.AppArmorRoot, "abstractions", "libvirt-qemu")); err != nil {
		t.Skipf("no libvirt-qemu AppArmor abstraction on this host: %v", err)
	}
	parser, err := exec.LookPath("apparmor_parser")
	if err != nil {
		t.Skipf("apparmor_parser not installed (Makefile deps: apparmor): %v", err)
	}
	dir := t.TempDir()
	root := filepath.Join(dir, "apparmor.d")
	if out, err := exec.Command("cp", "-a", libvirttls.AppArmorRoot, root).CombinedOutput(); err != nil {
		t.Fatalf("copy %s: %v %s", libvirttls.AppArmorRoot, err, out)
	}
	local := filepath.Join(root, "local", "abstractions", "libvirt-qemu")
	if err := os.WriteFile(local, []byte("# the admin's\n/srv/isos/** r,\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	const uuid = "0f0e1d2c-1111-2222-3333-444455556666"
	tmpl, err := os.ReadFile(filepath.Join(root, "libvirt", "TEMPLATE.qemu"))
	if err != nil {
		t.Fatal(err)
	}
	profile := filepath.Join(root, "libvirt", "libvirt-"+uuid)
	if err := os.WriteFile(profile, []byte(strings.Replace(string(tmpl), "LIBVIRT_TEMPLATE", "libvirt-"+uuid, 1)), 0o644); err != nil {
		t.Fatal(err)
	}
	pki := fakePKI(t, dir)
	loads := filepath.Join(dir, "loads")
	qemuDir := "/var/lib/nodevirt/qemu-tls"
	cfg := libvirttls.Config{ConfDir: dir, PKIDir: pki, QEMUDir: qemuDir, ServerRoot: filepath.Join(dir, "etc-pki"),
		AdminURI: "libvirtd:///system?socket=" + filepath.Join(dir, "no-such-socket"), AppArmorRoot: root,
		AppArmorEnabled: func() bool { return true },
		// What apparmor_parser -r does, but the kernel load.
		AppArmorParser: []string{"sh", "-c", `echo "$*" >> ` + loads + ` && exec ` + parser + ` -Q -r "$@"`, "sh"}}
	for i := 0; i < 2; i++ {
		if err := libvirttls.New(cfg).Apply(context.Background()); err != nil {
			t.Fatalf("apply %d: %v", i, err)
		}
	}
	data, err := os.ReadFile(local)
	if err != nil {
		t.Fatal(err)
	}
	want := "# the admin's\n/srv/isos/** r,\n# --- BEGIN nodevirt-nodeagent " + qemuDir + " ---\n" +
		`"` + qemuDir + `/" r,` + "\n" + `"` + qemuDir + `/**" r,` + "\n# --- END nodevirt-nodeagent " + qemuDir + " ---\n"
	if string(data) != want {
		t.Errorf("%s:\n%s\nwant:\n%s", local, data, want)
	}
	if l, _ := os.ReadFile(loads); strings.Count(string(l), profile) != 1 || strings.Contains(string(l), "TEMPLATE") {
		t.Errorf("profiles loaded %q, want %s once (only when the block changed, never the templates)", l, profile)
	}
	out, err := exec.Command(parser, "-p", "--base", root, profile).CombinedOutput()
	if err != nil {
		t.Fatalf("apparmor_parser -p: %v %s", err, out)
	}
	if !strings.Contains(string(out), `"`+qemuDir+`/**" r,`) {
		t.Errorf("the domain's profile, expanded, lacks the rule for %s", qemuDir)
	}

	// A directory AppArmor would read as a pattern is refused, not written.
	cfg.QEMUDir = "/var/lib/{a,b}"
	if err := libvirttls.New(cfg).Apply(context.Background()); err == nil {
		t.Error("a QEMU directory with AppArmor pattern characters: no error")
	}
	if data2, _ := os.ReadFile(local); string(data2) != want {
		t.Errorf("the refused directory changed %s:\n%s", local, data2)
	}
	// Without AppArmor nothing is written.
	cfg.QEMUDir, cfg.AppArmorEnabled = "/elsewhere", func() bool { return false }
	if err := libvirttls.New(cfg).Apply(context.Background()); err != nil {
		t.Fatal(err)
	}
	if data2, _ := os.ReadFile(local); string(data2) != want {
		t.Errorf("without AppArmor %s changed:\n%s", local, data2)
	}
}
