// Command nodevirt-lab runs the single-machine lab behind `make lab`,
// `make lab-down` and `make demo`.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/nodevirt/nodevirt/test/controlplane"
	"github.com/nodevirt/nodevirt/test/lab"
	"github.com/nodevirt/nodevirt/test/upstreamvirtctl"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: nodevirt-lab up|down|demo|build-controlplane|build-upstream-virtctl [flags]")
		os.Exit(2)
	}
	verb := os.Args[1]
	fs := flag.NewFlagSet(verb, flag.ExitOnError)
	var cfg lab.Config
	fs.StringVar(&cfg.Dir, "dir", ".lab", "lab state directory")
	fs.StringVar(&cfg.BinDir, "bin", "bin", "directory of the built nodevirt binaries")
	fs.StringVar(&cfg.Emulation, "emulation", "on", "guests under TCG: on, off or auto")
	fs.StringVar(&cfg.NodeName, "node-name", "", "lab node name (default: host name)")
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
	case "demo":
		err = lab.Demo(ctx, cfg)
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
