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
	daemons := map[string]*slog.Logger{}
	for name, pick := range map[string]func(*kubevirtv1.KubeVirt) slog.Level{
		"brain": logverbosity.Brain, "quiet-node": logverbosity.Node("quiet-node"), "loud-node": logverbosity.Node("loud-node"),
	} {
		daemons[name] = followingLogger(w, pick)
	}
	run(t, w)
	waitLevels(t, daemons, "the HyperConverged's verbosities", map[string]string{
		"brain": "DEBUG,INFO,WARN", "loud-node": "DEBUG,INFO,WARN", "quiet-node": "WARN"})

	e.update(hcov1beta1.Name, func(hc *hcov1beta1.HyperConverged) { hc.Spec.LogVerbosityConfig = nil })
	waitLevels(t, daemons, "the default verbosity", map[string]string{"brain": "INFO,WARN", "loud-node": "INFO,WARN", "quiet-node": "INFO,WARN"})
}

// TestCDILogVerbosityReachesTheCDIRoles: logVerbosityConfig.cdi, rendered
// into the CDI CR, sets the level of the CDI roles' logger built as the
// brain and the node agents build it (logverbosity.CDIRoles over the
// daemon's logger), apart from the daemon's own level, without a restart:
// CDI's 3 is Debug while the brain stays at Warn, 0 keeps warnings, and
// removing it puts it back to Info.
func TestCDILogVerbosityReachesTheCDIRoles(t *testing.T) {
	e := newEnv(t)
	e.create(hcov1beta1.Name, `{"spec":{"logVerbosityConfig":{"kubevirt":{"virtController":1},"cdi":3}}}`)

	w := crwatch.New(e.virt, e.ns)
	brain := followingLogger(w, logverbosity.Brain)
	loggers := map[string]*slog.Logger{"brain": brain, "cdi": logverbosity.CDIRoles(w, brain).With("role", "importer")}
	run(t, w)
	waitLevels(t, loggers, "the HyperConverged's verbosities", map[string]string{"brain": "WARN", "cdi": "DEBUG,INFO,WARN"})

	e.update(hcov1beta1.Name, func(hc *hcov1beta1.HyperConverged) { hc.Spec.LogVerbosityConfig.CDI = ptrTo(int32(0)) })
	waitLevels(t, loggers, "CDI's verbosity 0", map[string]string{"brain": "WARN", "cdi": "WARN"})

	e.update(hcov1beta1.Name, func(hc *hcov1beta1.HyperConverged) { hc.Spec.LogVerbosityConfig = nil })
	waitLevels(t, loggers, "the default verbosity", map[string]string{"brain": "INFO,WARN", "cdi": "INFO,WARN"})
}

// followingLogger is a daemon's logger: its level follows pick of w's
// KubeVirt CR, as the mains and logverbosity.Follow make it.
func followingLogger(w *crwatch.Watch, pick func(*kubevirtv1.KubeVirt) slog.Level) *slog.Logger {
	level := new(slog.LevelVar)
	log := slog.New(slog.NewTextHandler(io.Discard, &slog.HandlerOptions{Level: level}))
	logverbosity.Follow(w, level, pick, log)
	return log
}

// run runs w until the test ends.
func run(t *testing.T, w *crwatch.Watch) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = w.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
}

// waitLevels waits until each logger of want writes exactly the levels
// named (of Debug, Info and Warn).
func waitLevels(t *testing.T, loggers map[string]*slog.Logger, what string, want map[string]string) {
	t.Helper()
	testkit.Eventually(t, time.Minute, what, func() error {
		for name, w := range want {
			var got []string
			for _, l := range []slog.Level{slog.LevelDebug, slog.LevelInfo, slog.LevelWarn} {
				if loggers[name].Enabled(context.Background(), l) {
					got = append(got, l.String())
				}
			}
			if g := strings.Join(got, ","); g != w {
				return fmt.Errorf("%s logs %s, want %s", name, g, w)
			}
		}
		return nil
	})
}
