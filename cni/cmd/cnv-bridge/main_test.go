package main

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nodevirt/nodevirt/cni/cnitest"
)

// --version prints the build; CNI's own VERSION command (CNI_COMMAND, stdin)
// still answers the CNI versions, whatever the arguments.
func TestVersionFlagBesideCNIVersion(t *testing.T) {
	dir, err := cnitest.BuildPlugin(context.Background(), t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	plugin := filepath.Join(dir, "cnv-bridge")
	out, err := exec.Command(plugin, "--version").Output()
	if err != nil {
		t.Fatalf("--version: %v", err)
	}
	if !strings.HasPrefix(string(out), "cnv-bridge ") || !strings.Contains(string(out), "(revision ") {
		t.Errorf("--version printed %q", out)
	}
	for _, args := range [][]string{nil, {"--version"}} {
		cmd := exec.Command(plugin, args...)
		cmd.Env = append(os.Environ(), "CNI_COMMAND=VERSION")
		cmd.Stdin = strings.NewReader(`{"cniVersion":"1.0.0"}`)
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("CNI VERSION %v: %v", args, err)
		}
		var v struct {
			Supported []string `json:"supportedVersions"`
		}
		if err := json.Unmarshal(out, &v); err != nil || len(v.Supported) == 0 {
			t.Errorf("CNI VERSION %v answered %q (%v)", args, out, err)
		}
	}
}
