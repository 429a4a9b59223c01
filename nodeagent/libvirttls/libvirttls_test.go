package libvirttls_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nodevirt/nodevirt/nodeagent/libvirttls"
)

func TestSetBlockReplacesOnlyItsBlock(t *testing.T) {
	file := filepath.Join(t.TempDir(), "libvirtd.conf")
	head := "# the admin's\nlisten_tcp = 0\n"
	if err := os.WriteFile(file, []byte(head), 0o644); err != nil {
		t.Fatal(err)
	}
	changed, err := libvirttls.SetBlock(file, "a", map[string]string{"b": "2", "a": "1"})
	if err != nil || !changed {
		t.Fatalf("first write: changed %t, %v", changed, err)
	}
	if _, err := libvirttls.SetBlock(file, "lab", map[string]string{"listen_tls": "0"}); err != nil {
		t.Fatal(err)
	}
	if changed, err := libvirttls.SetBlock(file, "a", map[string]string{"a": "1", "b": "2"}); err != nil || changed {
		t.Errorf("same block again: changed %t, %v", changed, err)
	}
	if changed, err := libvirttls.SetBlock(file, "a", map[string]string{"a": "3"}); err != nil || !changed {
		t.Errorf("new value: changed %t, %v", changed, err)
	}
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	want := head + "# --- BEGIN a ---\na = 3\n# --- END a ---\n" +
		"# --- BEGIN lab ---\nlisten_tls = 0\n# --- END lab ---\n"
	if string(data) != want {
		t.Errorf("file:\n%s\nwant:\n%s", data, want)
	}
}

func TestRemoveBlocksLeavesTheRest(t *testing.T) {
	dir := t.TempDir()
	head := "# the admin's\nlisten_tcp = 0\n"
	for _, f := range []string{"libvirtd.conf", "qemu.conf"} {
		if err := os.WriteFile(filepath.Join(dir, f), []byte(head), 0o644); err != nil {
			t.Fatal(err)
		}
		for _, tag := range []string{libvirttls.Tag, "lab"} {
			if _, err := libvirttls.SetBlock(filepath.Join(dir, f), tag, map[string]string{"x": "1"}); err != nil {
				t.Fatal(err)
			}
		}
	}
	for range 2 { // the second removal finds nothing to do
		if err := libvirttls.RemoveBlocks(dir); err != nil {
			t.Fatal(err)
		}
	}
	for _, f := range []string{"libvirtd.conf", "qemu.conf"} {
		data, err := os.ReadFile(filepath.Join(dir, f))
		if err != nil {
			t.Fatal(err)
		}
		if want := head + "# --- BEGIN lab ---\nx = 1\n# --- END lab ---\n"; string(data) != want {
			t.Errorf("%s:\n%s\nwant:\n%s", f, data, want)
		}
	}
	if err := libvirttls.RemoveBlocks(filepath.Join(dir, "missing")); err != nil {
		t.Errorf("missing directory: %v", err)
	}
}

func TestSettings(t *testing.T) {
	l := libvirttls.LibvirtdSettings("/etc/pki")
	if l["tls_allowed_dn_list"] != `["O=nodevirt:nodes,CN=system:node:*"]` || l["cert_file"] != `"/etc/pki/libvirt/servercert.pem"` ||
		l["ca_file"] != `"/etc/pki/CA/cacert.pem"` || l["key_file"] != `"/etc/pki/libvirt/private/serverkey.pem"` {
		t.Errorf("libvirtd settings %v", l)
	}
	q := libvirttls.QEMUSettings("/qemu")
	if q["migrate_tls_x509_cert_dir"] != `"/qemu"` || q["migrate_tls_x509_verify"] != "1" || q["migrate_tls_force"] != "1" {
		t.Errorf("qemu settings %v", q)
	}
}

// TestApplyRestartsOnlyOnChange: the restart command runs when a block
// changed; an unchanged configuration asks libvirtd to reload its
// certificate instead, and a libvirtd that cannot is no error; a failed
// restart is done on the next Apply.
func TestApplyRestartsOnlyOnChange(t *testing.T) {
	dir := t.TempDir()
	for _, f := range []string{"libvirtd.conf", "qemu.conf"} {
		if err := os.WriteFile(filepath.Join(dir, f), []byte("# shipped\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	marks := filepath.Join(dir, "restarts")
	pki := fakePKI(t, dir)
	root := filepath.Join(dir, "etc-pki")
	c := libvirttls.New(libvirttls.Config{ConfDir: dir, PKIDir: pki, QEMUDir: "/qemu", ServerRoot: root, Restart: "echo restarted >> " + marks,
		AdminURI: "libvirtd:///system?socket=" + filepath.Join(dir, "no-such-socket")})
	ctx := context.Background()
	for i := 0; i < 2; i++ {
		if err := c.Apply(ctx); err != nil {
			t.Fatalf("apply %d: %v", i, err)
		}
	}
	data, _ := os.ReadFile(marks)
	if strings.Count(string(data), "restarted") != 1 {
		t.Errorf("restart ran %q, want once", data)
	}
	q, _ := os.ReadFile(filepath.Join(dir, "qemu.conf"))
	if !strings.HasPrefix(string(q), "# shipped\n") || !strings.Contains(string(q), `migrate_tls_x509_cert_dir = "/qemu"`) {
		t.Errorf("qemu.conf:\n%s", q)
	}
	ca, cert, key := libvirttls.ServerFiles(root)
	for file, want := range map[string]string{ca: "cacert.pem", cert: "servercert.pem", key: "serverkey.pem"} {
		if data, err := os.ReadFile(file); err != nil || string(data) != want {
			t.Errorf("%s: %q %v, want a copy of %s", file, data, err, want)
		}
	}
	if st, err := os.Stat(key); err != nil || st.Mode().Perm() != 0o600 {
		t.Errorf("server key %v %v, want mode 0600", st.Mode(), err)
	}
	// A failed restart is retried although the blocks are written by then:
	// the next Apply restarts again, and once it succeeded, no more.
	flaky := filepath.Join(dir, "flaky")
	failing := libvirttls.New(libvirttls.Config{ConfDir: dir, PKIDir: pki, ServerRoot: root, QEMUDir: "/other",
		Restart:  "test -e " + flaky + " && echo restarted >> " + marks + " || { touch " + flaky + "; exit 3; }",
		AdminURI: "libvirtd:///system?socket=" + filepath.Join(dir, "no-such-socket")})
	if err := failing.Apply(ctx); err == nil {
		t.Error("a failing restart command: no error")
	}
	for i := 0; i < 2; i++ {
		if err := failing.Apply(ctx); err != nil {
			t.Fatalf("apply after a failed restart, %d: %v", i, err)
		}
	}
	if data, _ := os.ReadFile(marks); strings.Count(string(data), "restarted") != 2 {
		t.Errorf("restarts %q, want a second one after the failed restart, and only one", data)
	}
}

// fakePKI writes stand-in node credentials (each file holds its own name)
// into dir/pki and returns that directory.
func fakePKI(t *testing.T, dir string) string {
	t.Helper()
	pki := filepath.Join(dir, "pki")
	if err := os.MkdirAll(pki, 0o700); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"cacert.pem", "servercert.pem", "serverkey.pem"} {
		if err := os.WriteFile(filepath.Join(pki, f), []byte(f), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return pki
}
