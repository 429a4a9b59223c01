// Package tekton is nodevirt's pipeline tasks program: one binary whose
// subcommands do what OpenShift Virtualization's Tekton tasks do, with
// the tasks' parameter names as flags, writing each result to a file named
// after it in --results-dir (Tekton's /tekton/results). The Task manifests
// that run it and the example Pipelines are in package manifests.
//
// Tasks: create-vm-from-manifest, create-vm-from-template, copy-template,
// modify-vm-template, modify-data-object, wait-for-vmi-status, cleanup-vm,
// generate-ssh-keys, execute-in-vm (the OpenSSH client), disk-virt-customize
// and disk-virt-sysprep (libguestfs' virt-customize and virt-sysprep).
package tekton

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/nodevirt/nodevirt/clusterbrain/client/virtctl"
	"github.com/nodevirt/nodevirt/clusterbrain/tekton/manifests"
)

// Tasks returns the tekton.dev/v1 Task manifests, by file name.
func Tasks() (map[string][]byte, error) { return manifests.Tasks() }

// Env is where a task runs.
type Env struct {
	Out, Err io.Writer
	// Connect builds the cluster client (in a TaskRun: in-cluster, the
	// namespace of the pod; here also --kubeconfig and -n).
	Connect func(namespace string) (*virtctl.Client, error)
}

type task struct {
	short string
	run   func(ctx context.Context, fs *flag.FlagSet) func(ctx context.Context, c *virtctl.Client, r results) error
}

var tasks = map[string]task{
	"create-vm-from-manifest": {"Create a VirtualMachine from a manifest.", createFromManifest},
	"create-vm-from-template": {"Create a VirtualMachine from a template.openshift.io Template.", createFromTemplate},
	"wait-for-vmi-status":     {"Wait until a VirtualMachineInstance meets a success or a failure condition.", waitForVMIStatus},
	"cleanup-vm":              {"Stop and/or delete a VirtualMachine.", cleanupVM},
	"generate-ssh-keys":       {"Generate an SSH key pair into a public and a private Secret.", generateSSHKeys},
	"copy-template":           {"Copy a template.openshift.io Template (a common one becomes a user's).", copyTemplate},
	"modify-vm-template":      {"Modify a Template and its VirtualMachine, or delete the Template.", modifyVMTemplate},
	"execute-in-vm":           {"Run a script or command in a VM over SSH (starting the VM if it is not running).", executeInVM},
	"disk-virt-customize":     {"Run virt-customize commands on a claim's disk.", diskVirtCustomize},
	"disk-virt-sysprep":       {"Run virt-sysprep (and its customize commands) on a claim's disk.", diskVirtSysprep},
	"modify-data-object":      {"Create (or replace, or delete) a DataVolume or DataSource, waiting for it if asked.", modifyDataObject},
}

// results writes Tekton results.
type results struct {
	dir string
	out io.Writer
}

func (r results) set(name, value string) error {
	fmt.Fprintf(r.out, "%s: %s\n", name, value)
	if r.dir == "" {
		return nil
	}
	if err := os.MkdirAll(r.dir, 0o755); err != nil {
		return fmt.Errorf("results dir: %w", err)
	}
	if err := os.WriteFile(filepath.Join(r.dir, name), []byte(value), 0o644); err != nil {
		return fmt.Errorf("result %s: %w", name, err)
	}
	return nil
}

// Run runs one task; it returns the process exit code.
func Run(ctx context.Context, args []string, env Env) int {
	if err := run(ctx, args, env); err != nil {
		fmt.Fprintln(env.Err, "Error:", err)
		return 1
	}
	return 0
}

func run(ctx context.Context, args []string, env Env) error {
	if len(args) == 0 || args[0] == "help" || args[0] == "-h" || args[0] == "--help" {
		usage(env.Out)
		return nil
	}
	t, ok := tasks[args[0]]
	if !ok {
		usage(env.Err)
		return fmt.Errorf("unknown task %q", args[0])
	}
	fs := flag.NewFlagSet(args[0], flag.ContinueOnError)
	fs.SetOutput(env.Err)
	resultsDir := fs.String("results-dir", "/tekton/results", "where Tekton collects the results (empty: print only)")
	ns := fs.String("n", "", "namespace for parameters left empty (default: the pod's or the kubeconfig's)")
	// Tekton expands an array parameter into separate arguments: the
	// Task passes them after "--" and names the flag they are values of;
	// after "--", --array-param=NAME switches to the next array.
	arrayParam := fs.String("array-param", "", "the repeatable flag the arguments after -- are values of")
	exec := t.run(ctx, fs)
	if err := fs.Parse(args[1:]); err != nil {
		return err
	}
	if err := setArrays(fs, *arrayParam); err != nil {
		return fmt.Errorf("%s: %w", args[0], err)
	}
	c, err := env.Connect(*ns)
	if err != nil {
		return err
	}
	return exec(ctx, c, results{dir: *resultsDir, out: env.Out})
}

func usage(w io.Writer) {
	names := make([]string, 0, len(tasks))
	for n := range tasks {
		names = append(names, n)
	}
	sort.Strings(names)
	fmt.Fprintln(w, "nodevirt-tasks runs one pipeline task.\n\nTasks:")
	for _, n := range names {
		fmt.Fprintf(w, "  %-26s %s\n", n, tasks[n].short)
	}
}

// setArrays gives the arguments left after "--" to the repeatable flag
// named by --array-param, and after each "--array-param=NAME" among them
// to NAME; empty arguments (an empty array's expansion) are skipped.
func setArrays(fs *flag.FlagSet, current string) error {
	for _, v := range fs.Args() {
		if name, ok := strings.CutPrefix(v, "--array-param="); ok {
			if fs.Lookup(name) == nil {
				return fmt.Errorf("--array-param: no parameter %q", name)
			}
			current = name
			continue
		}
		if v == "" {
			continue
		}
		if current == "" {
			return fmt.Errorf("unexpected arguments %v", fs.Args())
		}
		if err := fs.Set(current, v); err != nil {
			return fmt.Errorf("%s: %w", current, err)
		}
	}
	return nil
}

// multi collects a repeated flag.
type multi []string

func (m *multi) String() string     { return strings.Join(*m, ",") }
func (m *multi) Set(s string) error { *m = append(*m, s); return nil }

func boolParam(name, v string) (bool, error) {
	switch strings.ToLower(v) {
	case "", "false":
		return false, nil
	case "true":
		return true, nil
	}
	return false, fmt.Errorf("%s: %q is neither true nor false", name, v)
}

var errMissing = errors.New("is required")
