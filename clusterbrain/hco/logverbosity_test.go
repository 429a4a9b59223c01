package hco

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/crwatch"
	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
	"github.com/nodevirt/nodevirt/clusterbrain/api/logverbosity"
	"github.com/nodevirt/nodevirt/test/testkit"
)

// TestLogVerbosityReachesTheDaemons: the HyperConverged's
// logVerbosityConfig.kubevirt, rendered into the KubeVirt CR, sets the log
// level of loggers built as the daemons build theirs (a slog.LevelVar kept
// by crwatch + logverbosity.Follow), without a restart: the brain's from
// virtController/virtAPI/virtOperator, a node agent's from its
// nodeVerbosity entry or virtHandler/virtLauncher. Removing it puts them
// back to Info.
func TestLogVerbosityReachesTheDaemons(t *testing.T) {
	e := newEnv(t)
	e.create(hcov1beta1.Name, `{"spec":{"logVerbosityConfig":{"kubevirt":{"virtController":4,"virtHandler":1,"nodeVerbosity":{"loud-node":5}}}}}`)

	w := crwatch.New(e.virt, e.ns)
	type daemon struct {
		level *slog.LevelVar
		log   *slog.Logger
	}
	daemons := map[string]daemon{}
	for name, pick := range map[string]func(*kubevirtv1.KubeVirt) slog.Level{
		"brain": logverbosity.Brain, "quiet-node": logverbosity.Node("quiet-node"), "loud-node": logverbosity.Node("loud-node"),
	} {
		d := daemon{level: new(slog.LevelVar)}
		d.log = slog.New(slog.NewTextHandler(io.Discard, &slog.HandlerOptions{Level: d.level}))
		logverbosity.Follow(w, d.level, pick, d.log)
		daemons[name] = d
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = w.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })

	// shows reports which of a Debug, an Info and a Warn record the
	// daemon's logger writes now.
	shows := func(d daemon) string {
		var got []string
		for _, l := range []slog.Level{slog.LevelDebug, slog.LevelInfo, slog.LevelWarn} {
			if d.log.Enabled(context.Background(), l) {
				got = append(got, l.String())
			}
		}
		return strings.Join(got, ",")
	}
	wait := func(what string, want map[string]string) {
		t.Helper()
		testkit.Eventually(t, time.Minute, what, func() error {
			for name, w := range want {
				if got := shows(daemons[name]); got != w {
					return fmt.Errorf("%s logs %s, want %s", name, got, w)
				}
			}
			return nil
		})
	}
	wait("the HyperConverged's verbosities", map[string]string{
		"brain": "DEBUG,INFO,WARN", "loud-node": "DEBUG,INFO,WARN", "quiet-node": "WARN"})

	e.update(hcov1beta1.Name, func(hc *hcov1beta1.HyperConverged) { hc.Spec.LogVerbosityConfig = nil })
	wait("the default verbosity", map[string]string{"brain": "INFO,WARN", "loud-node": "INFO,WARN", "quiet-node": "INFO,WARN"})
}
