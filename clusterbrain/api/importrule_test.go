package api_test

import (
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
)

const module = "github.com/nodevirt/nodevirt"

// graph is the module's import graph of non-test packages: each package
// with its direct imports, from one `go list -deps`.
type graph map[string][]string

func loadGraph(t *testing.T) graph {
	t.Helper()
	goBin, err := exec.LookPath("go")
	if err != nil {
		goBin = filepath.Join(runtime.GOROOT(), "bin", "go")
	}
	out, err := exec.Command(goBin, "list", "-deps", "-f", "{{.ImportPath}}\t{{join .Imports \" \"}}", module+"/...").Output()
	if err != nil {
		if ee, ok := err.(*exec.ExitError); ok {
			t.Fatalf("go list: %v\n%s", err, ee.Stderr)
		}
		t.Fatalf("go list: %v", err)
	}
	g := graph{}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		pkg, imports, _ := strings.Cut(line, "\t")
		g[pkg] = strings.Fields(imports)
	}
	return g
}

// under says whether pkg is dir (relative to the module) or inside it.
func under(pkg string, dirs ...string) bool {
	for _, d := range dirs {
		if p := module + "/" + d; pkg == p || strings.HasPrefix(pkg, p+"/") {
			return true
		}
	}
	return false
}

// violations walks from every package of the module that from selects and
// returns, for each forbidden package it reaches, one import chain to it.
func (g graph) violations(from, forbidden func(string) bool) []string {
	var out []string
	seen := map[string]bool{}
	for root := range g {
		if !from(root) {
			continue
		}
		parent := map[string]string{root: ""}
		queue := []string{root}
		for len(queue) > 0 {
			p := queue[0]
			queue = queue[1:]
			if forbidden(p) {
				if !seen[root+" "+p] {
					seen[root+" "+p] = true
					chain := []string{p}
					for q := parent[p]; q != ""; q = parent[q] {
						chain = append(chain, q)
					}
					slices.Reverse(chain)
					out = append(out, strings.Join(chain, "\n    -> "))
				}
				continue
			}
			for _, i := range g[p] {
				if _, ok := parent[i]; !ok && strings.HasPrefix(i, module+"/") {
					parent[i] = p
					queue = append(queue, i)
				}
			}
		}
	}
	slices.Sort(out)
	return out
}

var nodeSide = []string{"nodeagent", "launcher", "csi", "cni"}

// TestImportRule keeps the shared contracts in leaf packages: the node side
// reaches no clusterbrain package but clusterbrain/api/... and
// clusterbrain/kit/..., the brain reaches nothing of the node side, the
// daemons do not link the virtctl client, and api/... and kit/... import
// nothing of nodevirt but each other.
func TestImportRule(t *testing.T) {
	g := loadGraph(t)
	for _, cmd := range []string{"nodeagent/cmd/nodeagent", "csi/cmd/hostpath-csi-driver", "cni/cmd/cnv-bridge",
		"clusterbrain/cmd/clusterbrain", "clusterbrain/cmd/virtctl"} {
		if _, ok := g[module+"/"+cmd]; !ok {
			t.Fatalf("command %s is not in the module's packages; the rule would check nothing", cmd)
		}
	}
	shared := func(p string) bool { return under(p, "clusterbrain/api", "clusterbrain/kit") }
	rules := []struct {
		name            string
		from, forbidden func(string) bool
	}{{
		name:      "node side reaches a clusterbrain package outside api/... and kit/...",
		from:      func(p string) bool { return under(p, nodeSide...) },
		forbidden: func(p string) bool { return under(p, "clusterbrain") && !shared(p) },
	}, {
		name:      "brain reaches the node side",
		from:      func(p string) bool { return under(p, "clusterbrain") },
		forbidden: func(p string) bool { return under(p, nodeSide...) },
	}, {
		name:      "a daemon links the virtctl client",
		from:      func(p string) bool { return under(p, "clusterbrain/cmd/clusterbrain", "nodeagent/cmd/nodeagent") },
		forbidden: func(p string) bool { return under(p, "clusterbrain/client") },
	}, {
		name:      "a shared contract or kit package imports a daemon's package",
		from:      shared,
		forbidden: func(p string) bool { return strings.HasPrefix(p, module+"/") && !shared(p) },
	}}
	for _, r := range rules {
		if v := g.violations(r.from, r.forbidden); len(v) > 0 {
			t.Errorf("%s (%d):\n  %s", r.name, len(v), strings.Join(v, "\n  "))
		}
	}
}
