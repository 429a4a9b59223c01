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
package logverbosity

import (
	"log/slog"

	kubevirtv1 "kubevirt.io/api/core/v1"

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

// Follow keeps level at what pick reads from w's KubeVirt CR, logging each
// change to log (at Info, while the lower of the two levels is in force).
func Follow(w *crwatch.Watch, level *slog.LevelVar, pick func(*kubevirtv1.KubeVirt) slog.Level, log *slog.Logger) {
	w.OnKubeVirt(func(kv *kubevirtv1.KubeVirt) {
		l, old := pick(kv), level.Level()
		if l == old {
			return
		}
		if l < old {
			level.Set(l)
		}
		log.Info("log level changed", "from", "KubeVirt", "level", l, "was", old)
		level.Set(l)
	})
}
