// Command hostpath-csi-driver serves nodevirt's hostpath CSI driver on a
// unix socket, for running under the standard CSI sidecars on a cluster.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/nodevirt/nodevirt/clusterbrain/kit/daemon/buildinfo"
	"github.com/nodevirt/nodevirt/csi"
)

// poolFlags collects repeated -pool name=path flags.
type poolFlags []csi.PoolConfig

func (p *poolFlags) String() string { return fmt.Sprint(*p) }

func (p *poolFlags) Set(v string) error {
	name, path, ok := strings.Cut(v, "=")
	if !ok {
		return fmt.Errorf("pool %q is not name=path", v)
	}
	*p = append(*p, csi.PoolConfig{Name: name, Path: path})
	return nil
}

func main() {
	var (
		cfg      csi.Config
		pools    poolFlags
		logLevel slog.Level
	)
	flag.StringVar(&cfg.Endpoint, "endpoint", csi.DefaultEndpoint, "unix socket to serve CSI on (path or unix:// URL)")
	flag.StringVar(&cfg.NodeID, "node-id", os.Getenv("NODE_NAME"), "this node's name (default $NODE_NAME)")
	flag.StringVar(&cfg.StateRoot, "state-root", csi.DefaultStateRoot, "directory holding the default pool when no -pool is given")
	flag.Var(&pools, "pool", "storage pool as name=path (repeatable)")
	flag.StringVar(&cfg.DefaultPool, "default-pool", "", "pool used when a StorageClass names none (default: the first)")
	flag.Int64Var(&cfg.MaxVolumesPerNode, "max-volumes-per-node", 0, "volume limit reported to the CO (0: none)")
	flag.StringVar(&cfg.DriverName, "driver-name", csi.DriverName, "CSI driver name")
	flag.TextVar(&logLevel, "log-level", slog.LevelInfo, "log level (DEBUG logs every request)")
	showVersion := flag.Bool("version", false, buildinfo.FlagUsage)
	flag.Parse()
	if *showVersion {
		fmt.Println(buildinfo.Line("hostpath-csi-driver"))
		return
	}

	cfg.Pools = pools
	cfg.Version = buildinfo.Read().Version
	cfg.Logger = slog.New(slog.NewJSONHandler(os.Stderr, &slog.HandlerOptions{Level: logLevel}))

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, cfg); err != nil {
		cfg.Logger.Error("hostpath-csi-driver", "err", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, cfg csi.Config) error {
	d, err := csi.New(cfg)
	if err != nil {
		return err
	}
	return d.Run(ctx)
}
