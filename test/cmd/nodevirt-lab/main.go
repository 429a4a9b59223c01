// Command nodevirt-lab runs the single-machine lab behind `make lab`,
// `make lab-down` and `make demo`.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"syscall"

	"github.com/nodevirt/nodevirt/clusterbrain/kit/daemon/buildinfo"
	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/lab"
	"github.com/nodevirt/nodevirt/test/upstreamvirtctl"
)

func main() {
	if buildinfo.Requested(os.Args[1:]) {
		fmt.Println(buildinfo.Line("nodevirt-lab"))
		return
	}
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: nodevirt-lab up|down|demo|exec|build-controlplane|build-upstream-virtctl [flags]\n"+
			"       nodevirt-lab up --kubelet                           (the node is a real kubelet; nodevirt installed from bin/images)\n"+
			"       nodevirt-lab exec [--dir DIR] NODE -- CMD ARGS...   (runs a command inside a lab node)\n"+
			"       nodevirt-lab power-off [--dir DIR] NODE             (kills every process of a node at once)")
		os.Exit(2)
	}
	verb := os.Args[1]
	fs := flag.NewFlagSet(verb, flag.ExitOnError)
	var cfg lab.Config
	fs.StringVar(&cfg.Dir, "dir", ".lab", "lab state directory")
	fs.StringVar(&cfg.BinDir, "bin", "bin", "directory of the built nodevirt binaries")
	fs.StringVar(&cfg.Emulation, "emulation", "on", "guests under TCG: on, off or auto")
	fs.StringVar(&cfg.NodeName, "node-name", "", "lab node name of a one-node lab (default: host name)")
	fs.BoolVar(&cfg.Kubelet, "kubelet", false, "run the node as a real kubelet with containerd and install nodevirt from bin/images (make lab KUBELET=1)")
	fs.IntVar(&cfg.NodeCount, "nodes", 0, "number of nodes; 2 or more run each in namespaces of its own (default: the running lab's, else 1)")
	fs.Parse(os.Args[2:])
	cfg.Log = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	var err error
	switch verb {
	case "up":
		err = lab.Up(ctx, cfg)
	case "down":
		err = lab.Down(ctx, cfg)
	case "kubelet-node":
		// Started detached by up --kubelet: holds the kubelet node until
		// SIGTERM (down).
		err = lab.RunKubeletNode(ctx, cfg)
	case "demo":
		err = lab.Demo(ctx, cfg)
	case "exec":
		err = execInNode(cfg, fs.Args())
	case "power-off":
		// Every process of the node killed at once: a host's power loss.
		// `nodevirt-lab up` (make lab) powers it on again.
		if fs.NArg() != 1 {
			err = fmt.Errorf("power-off: want NODE")
			break
		}
		err = lab.PowerOffNode(cfg, fs.Arg(0))
	case "build-controlplane":
		_, err = controlplane.EnsureBinaries(ctx, "")
	case "build-upstream-virtctl":
		var bin string
		if bin, err = upstreamvirtctl.Binary(ctx); err == nil {
			fmt.Println(bin)
		}
	default:
		err = fmt.Errorf("unknown verb %q", verb)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "nodevirt-lab:", err)
		os.Exit(1)
	}
}

// execInNode runs argv[1:] inside lab node argv[0], with this terminal,
// and exits with its status.
func execInNode(cfg lab.Config, argv []string) error {
	if len(argv) == 0 {
		return fmt.Errorf("exec: want NODE -- CMD [ARGS...]")
	}
	node, argv := argv[0], argv[1:]
	if len(argv) > 0 && argv[0] == "--" {
		argv = argv[1:]
	}
	if len(argv) == 0 {
		return fmt.Errorf("exec: want NODE -- CMD [ARGS...]")
	}
	cmdline, err := lab.NodeCommand(cfg, node, argv...)
	if err != nil {
		return err
	}
	cmd := exec.Command(cmdline[0], cmdline[1:]...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	signal.Ignore(syscall.SIGINT)
	if err := cmd.Run(); err != nil {
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			os.Exit(exit.ExitCode())
		}
		return err
	}
	return nil
}
