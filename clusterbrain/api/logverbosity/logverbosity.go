// Package logverbosity sets the daemons' log levels from the KubeVirt CR's
// developerConfiguration.logVerbosity (HCO's logVerbosityConfig.kubevirt),
// live: KubeVirt's components log with klog verbosities, nodevirt's with
// slog levels, and each daemon takes the components whose roles it plays.
//
//   - The brain plays virt-controller, virt-api and virt-operator: the
//     highest of virtController, virtAPI and virtOperator.
//   - A node agent plays virt-handler and virt-launcher: its node's entry
//     in nodeVerbosity when there is one, else the higher of virtHandler
//     and virtLauncher.
//
// A verbosity maps to a level two slog steps per klog step around
// KubeVirt's default of 2 (slog.LevelInfo): 1 keeps warnings and errors, 3
// adds nothing nodevirt logs yet, 4 and up is slog.LevelDebug. Unset (0),
// or no CR, is the default: Info.
//
// The roles a daemon plays for CDI follow the CDI CR's
// spec.config.logVerbosity (HCO's logVerbosityConfig.cdi) instead, with a
// logger of their own (CDIRoles): in the brain the DataVolume controller,
// the DataImportCron controller and the upload API and proxy (cdi-
// controller, cdi-uploadproxy); in a node agent the import role, which
// imports, clones and serves uploads (CDI's importer, cloner and upload
// server pods, which take cdi-controller's verbosity). CDI's default is 1,
// so its scale sits one step lower: 0 keeps warnings and errors, 1 (or
// unset) is Info, 3 and up Debug. CDI's webhooks (DataVolume admission)
// run in the brain's webhook server and log at the brain's level.
package logverbosity

import (
	"context"
	"log/slog"

	kubevirtv1 "kubevirt.io/api/core/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/crwatch"
)

// Default is KubeVirt's verbosity when none is set.
const Default = 2

// Level is the slog level of klog verbosity v (0: Default).
func Level(v uint) slog.Level {
	if v == 0 {
		v = Default
	}
	v = min(v, 16)
	return slog.Level(2 * (Default - int(v)))
}

// Brain is the level of the brain under kv.
func Brain(kv *kubevirtv1.KubeVirt) slog.Level {
	lv := of(kv)
	if lv == nil {
		return Level(0)
	}
	return Level(max(lv.VirtController, lv.VirtAPI, lv.VirtOperator))
}

// Node returns the level of the node agent of node under kv.
func Node(node string) func(*kubevirtv1.KubeVirt) slog.Level {
	return func(kv *kubevirtv1.KubeVirt) slog.Level {
		lv := of(kv)
		if lv == nil {
			return Level(0)
		}
		if v, ok := lv.NodeVerbosity[node]; ok {
			return Level(v)
		}
		return Level(max(lv.VirtHandler, lv.VirtLauncher))
	}
}

func of(kv *kubevirtv1.KubeVirt) *kubevirtv1.LogVerbosity {
	if kv == nil || kv.Spec.Configuration.DeveloperConfiguration == nil {
		return nil
	}
	return kv.Spec.Configuration.DeveloperConfiguration.LogVerbosity
}

// CDIDefault is CDI's verbosity when its CR sets none.
const CDIDefault = 1

// CDI is the level of the roles a daemon plays for CDI under cdi.
func CDI(cdi *cdiv1.CDI) slog.Level {
	if cdi == nil || cdi.Spec.Config == nil || cdi.Spec.Config.LogVerbosity == nil {
		return Level(0)
	}
	return Level(uint(max(*cdi.Spec.Config.LogVerbosity, 0)) + Default - CDIDefault)
}

// Follow keeps level at what pick reads from w's KubeVirt CR, logging each
// change to log (at Info, while the lower of the two levels is in force).
func Follow(w *crwatch.Watch, level *slog.LevelVar, pick func(*kubevirtv1.KubeVirt) slog.Level, log *slog.Logger) {
	w.OnKubeVirt(func(kv *kubevirtv1.KubeVirt) { set(level, pick(kv), "KubeVirt", log) })
}

// CDIRoles returns the logger of the roles a daemon plays for CDI: log's
// handler (its attributes, its output) at a level of its own, which
// follows w's CDI CR (CDI). log's own level, whatever it is, does not
// filter it.
func CDIRoles(w *crwatch.Watch, log *slog.Logger) *slog.Logger {
	level := new(slog.LevelVar)
	cdiLog := slog.New(leveled{h: log.Handler(), level: level})
	w.OnCDI(func(cdi *cdiv1.CDI) { set(level, CDI(cdi), "CDI", cdiLog) })
	return cdiLog
}

// set puts level at l, logging a change to log (at Info, while the lower
// of the two levels is in force).
func set(level *slog.LevelVar, l slog.Level, from string, log *slog.Logger) {
	old := level.Level()
	if l == old {
		return
	}
	if l < old {
		level.Set(l)
	}
	log.Info("log level changed", "from", from, "level", l, "was", old)
	level.Set(l)
}

// leveled is a handler at a level of its own: it decides which records
// are written and hands them to h, whose own level is not asked (slog
// handlers check it only in Enabled).
type leveled struct {
	h     slog.Handler
	level slog.Leveler
}

var _ slog.Handler = leveled{}

func (l leveled) Enabled(_ context.Context, lv slog.Level) bool { return lv >= l.level.Level() }

func (l leveled) Handle(ctx context.Context, r slog.Record) error { return l.h.Handle(ctx, r) }

func (l leveled) WithAttrs(as []slog.Attr) slog.Handler {
	return leveled{h: l.h.WithAttrs(as), level: l.level}
}

func (l leveled) WithGroup(name string) slog.Handler {
	return leveled{h: l.h.WithGroup(name), level: l.level}
}
