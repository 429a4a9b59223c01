package tekton

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/client/virtctl"
)

// DefaultDiskImage is where a filesystem claim's disk is in the task's pod
// (the claim mounted at /mnt/targetpvc, CDI's disk.img in it).
const DefaultDiskImage = "/mnt/targetpvc/disk.img"

func diskVirtCustomize(ctx context.Context, fs *flag.FlagSet) func(context.Context, *virtctl.Client, results) error {
	return diskVirt(ctx, fs, "virt-customize", "virt-customize commands in --commands-from-file format")
}

func diskVirtSysprep(ctx context.Context, fs *flag.FlagSet) func(context.Context, *virtctl.Client, results) error {
	return diskVirt(ctx, fs, "virt-sysprep", "virt-sysprep customization commands in --commands-from-file format")
}

// diskVirt runs a libguestfs tool (virt-customize, virt-sysprep) on the
// claim's disk with the commands in a file, as upstream's disk-virt tasks
// do. The claim must not be in use by a running VM: libguestfs writes the
// filesystem directly.
func diskVirt(_ context.Context, fs *flag.FlagSet, tool, commandsHelp string) func(context.Context, *virtctl.Client, results) error {
	pvc := fs.String("pvc", "", "PersistentVolumeClaim whose disk is modified (in the active namespace)")
	commands := fs.String("virtCommands", "", commandsHelp)
	verbose := fs.String("verbose", "false", "true or false: verbose mode and tracing of libguestfs calls")
	extra := fs.String("additionalVirtOptions", "", "more options for "+tool+" (split on spaces, '…' and \"…\" quoting kept)")
	disk := fs.String("disk", DefaultDiskImage, "the claim's disk image as the task's pod sees it")
	return func(ctx context.Context, c *virtctl.Client, _ results) error {
		if *pvc == "" {
			return fmt.Errorf("pvc %w", errMissing)
		}
		if strings.TrimSpace(*commands) == "" && tool == "virt-customize" {
			return fmt.Errorf("virtCommands %w", errMissing)
		}
		beVerbose, err := boolParam("verbose", *verbose)
		if err != nil {
			return err
		}
		opts, err := splitOptions(*extra)
		if err != nil {
			return fmt.Errorf("additionalVirtOptions: %w", err)
		}
		if err := claimIdle(ctx, c, *pvc); err != nil {
			return err
		}
		if _, err := os.Stat(*disk); err != nil {
			return fmt.Errorf("disk of claim %s/%s: %w", c.Namespace, *pvc, err)
		}
		dir, err := os.MkdirTemp("", "disk-virt-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(dir)
		script := filepath.Join(dir, "virt_commands")
		if err := os.WriteFile(script, []byte(*commands), 0o600); err != nil {
			return err
		}
		args := []string{"--add", *disk}
		if strings.TrimSpace(*commands) != "" {
			args = append(args, "--commands-from-file", script)
		}
		args = append(args, opts...)
		if beVerbose {
			if !hasOption(args, "-v", "--verbose") {
				args = append(args, "--verbose")
			}
			if !hasOption(args, "-x") {
				args = append(args, "-x")
			}
		}
		cmd := exec.CommandContext(ctx, tool, args...)
		cmd.Stdout, cmd.Stderr = fs.Output(), fs.Output()
		cmd.Env = append(os.Environ(), "LIBGUESTFS_BACKEND=direct")
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("%s on claim %s/%s: %w", tool, c.Namespace, *pvc, err)
		}
		return nil
	}
}

// claimIdle checks that the claim exists and that no running VMI uses it.
func claimIdle(ctx context.Context, c *virtctl.Client, name string) error {
	if _, err := c.Kube.CoreV1().PersistentVolumeClaims(c.Namespace).Get(ctx, name, metav1.GetOptions{}); err != nil {
		return fmt.Errorf("claim %s/%s: %w", c.Namespace, name, err)
	}
	vmis, err := c.Virt.VMIs.List(ctx, c.Namespace, metav1.ListOptions{})
	if err != nil {
		return fmt.Errorf("list vmis: %w", err)
	}
	for _, vmi := range vmis {
		if vmi.IsFinal() {
			continue
		}
		for _, v := range vmi.Spec.Volumes {
			if (v.PersistentVolumeClaim != nil && v.PersistentVolumeClaim.ClaimName == name) ||
				(v.DataVolume != nil && v.DataVolume.Name == name) {
				return fmt.Errorf("claim %s/%s is in use by the VMI %s (%s): stop it first", c.Namespace, name, vmi.Name, vmi.Status.Phase)
			}
		}
	}
	return nil
}

func hasOption(args []string, names ...string) bool {
	for _, a := range args {
		for _, n := range names {
			if a == n || strings.HasPrefix(a, n+"=") {
				return true
			}
		}
	}
	return false
}

// splitOptions splits s on blanks, honouring single and double quotes.
func splitOptions(s string) ([]string, error) {
	var out []string
	var cur strings.Builder
	var quote rune
	inWord := false
	for _, r := range s {
		switch {
		case quote != 0 && r == quote:
			quote = 0
		case quote != 0:
			cur.WriteRune(r)
		case r == '\'' || r == '"':
			quote, inWord = r, true
		case r == ' ' || r == '\t' || r == '\n':
			if inWord {
				out, inWord = append(out, cur.String()), false
				cur.Reset()
			}
		default:
			cur.WriteRune(r)
			inWord = true
		}
	}
	if quote != 0 {
		return nil, fmt.Errorf("unterminated %c quote in %q", quote, s)
	}
	if inWord {
		out = append(out, cur.String())
	}
	return out, nil
}
