// Package serverconfig checks how the project's HTTP servers are built.
package serverconfig

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nodevirt/nodevirt/test/controlplane"
)

// TestEveryHTTPServerHasTimeouts: every http.Server literal outside tests
// sets ReadHeaderTimeout (a client that never finishes its headers, or its
// TLS handshake, is cut off) and IdleTimeout (a kept-alive connection that
// sends nothing is closed), so no peer holds a connection and its
// goroutine forever.
func TestEveryHTTPServerHasTimeouts(t *testing.T) {
	root, err := controlplane.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	found := 0
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			name := d.Name()
			if path != root && (strings.HasPrefix(name, ".") || name == "tools" && filepath.Base(filepath.Dir(path)) == "test") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, 0)
		if err != nil {
			return err
		}
		ast.Inspect(f, func(n ast.Node) bool {
			lit, ok := n.(*ast.CompositeLit)
			if !ok {
				return true
			}
			sel, ok := lit.Type.(*ast.SelectorExpr)
			if !ok || sel.Sel.Name != "Server" {
				return true
			}
			if pkg, ok := sel.X.(*ast.Ident); !ok || pkg.Name != "http" {
				return true
			}
			found++
			set := map[string]bool{}
			for _, e := range lit.Elts {
				if kv, ok := e.(*ast.KeyValueExpr); ok {
					if k, ok := kv.Key.(*ast.Ident); ok {
						set[k.Name] = true
					}
				}
			}
			rel, _ := filepath.Rel(root, fset.Position(lit.Pos()).Filename)
			for _, want := range []string{"ReadHeaderTimeout", "IdleTimeout"} {
				if !set[want] {
					t.Errorf("%s:%d: http.Server without %s", rel, fset.Position(lit.Pos()).Line, want)
				}
			}
			return true
		})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if found < 10 {
		t.Fatalf("found only %d http.Server literals: the walk missed the tree", found)
	}
	t.Logf("%d http.Server literals checked", found)
}
