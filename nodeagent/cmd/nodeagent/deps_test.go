package main

import (
	"os/exec"
	"strings"
	"testing"
)

// buildTags are the tags of the Makefile's NODEAGENT_BUILDFLAGS.
const buildTags = "grpcnotrace,libvirt_without_lxc"

// TestBuildLeavesOutWhatBloatsTheDaemon guards the node daemon's resident
// size, which follows its binary's: built as the Makefile builds it, the
// daemon links no x/net/trace (whose html/template reflection keeps every
// method of every type), no client-go informer factory and no libvirt-lxc.
func TestBuildLeavesOutWhatBloatsTheDaemon(t *testing.T) {
	out, err := exec.Command("go", "list", "-tags", buildTags, "-deps", ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	deps := map[string]bool{}
	for _, p := range strings.Fields(string(out)) {
		deps[p] = true
	}
	if !deps["github.com/nodevirt/nodevirt/nodeagent/agent"] {
		t.Fatalf("go list -deps did not list the agent: %s", out)
	}
	for _, p := range []string{"golang.org/x/net/trace", "html/template", "text/template"} {
		if deps[p] {
			t.Errorf("the daemon links %s", p)
		}
	}
	out, err = exec.Command("go", "list", "-tags", buildTags, "-f", `{{join .CgoPkgConfig " "}} {{join .CgoLDFLAGS " "}}`,
		"libvirt.org/go/libvirt").CombinedOutput()
	if err != nil {
		t.Fatalf("go list libvirt: %v\n%s", err, out)
	}
	if strings.Contains(string(out), "lxc") {
		t.Errorf("libvirt binding links libvirt-lxc: %s", out)
	}
	out, err = exec.Command("go", "list", "-tags", buildTags, "-f", `{{.ImportPath}}: {{join .Imports " "}}`,
		"github.com/nodevirt/nodevirt/nodeagent/...").CombinedOutput()
	if err != nil {
		t.Fatalf("go list nodeagent: %v\n%s", err, out)
	}
	for _, l := range strings.Split(string(out), "\n") {
		pkg, imports, _ := strings.Cut(l, ": ")
		if strings.HasSuffix(pkg, "test") {
			continue
		}
		for _, imp := range strings.Fields(imports) {
			if imp == "k8s.io/client-go/informers" {
				t.Errorf("%s builds client-go's informer factory (every informer of every group): use nodeagent/kube", pkg)
			}
		}
	}
}
