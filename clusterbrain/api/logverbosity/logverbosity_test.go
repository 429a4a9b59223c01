package logverbosity

import (
	"log/slog"
	"testing"

	kubevirtv1 "kubevirt.io/api/core/v1"
)

func TestLevels(t *testing.T) {
	for v, want := range map[uint]slog.Level{0: slog.LevelInfo, 1: 2, 2: slog.LevelInfo, 3: -2, 4: slog.LevelDebug, 9: -14, 1 << 40: -28} {
		if got := Level(v); got != want {
			t.Errorf("Level(%d) = %v, want %v", v, got, want)
		}
	}
	if Level(1) <= slog.LevelInfo || Level(1) > slog.LevelWarn {
		t.Errorf("verbosity 1 (%v) should drop Info and keep Warn", Level(1))
	}

	kv := func(lv *kubevirtv1.LogVerbosity) *kubevirtv1.KubeVirt {
		k := &kubevirtv1.KubeVirt{}
		k.Spec.Configuration.DeveloperConfiguration = &kubevirtv1.DeveloperConfiguration{LogVerbosity: lv}
		return k
	}
	set := kv(&kubevirtv1.LogVerbosity{VirtAPI: 3, VirtOperator: 5, VirtController: 1, VirtHandler: 1, VirtLauncher: 4,
		NodeVerbosity: map[string]uint{"quiet": 1}})
	for _, tc := range []struct {
		name string
		got  slog.Level
		want slog.Level
	}{
		{"brain: the highest of its components", Brain(set), Level(5)},
		{"node: the higher of handler and launcher", Node("n1")(set), Level(4)},
		{"node: its own entry wins", Node("quiet")(set), Level(1)},
		{"no CR", Brain(nil), slog.LevelInfo},
		{"no verbosity", Node("n1")(kv(nil)), slog.LevelInfo},
		{"an empty one", Brain(kv(&kubevirtv1.LogVerbosity{})), slog.LevelInfo},
	} {
		if tc.got != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, tc.got, tc.want)
		}
	}
}
