package logverbosity

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"

	kubevirtv1 "kubevirt.io/api/core/v1"
	cdiv1 "kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/crwatch"
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

func TestCDILevels(t *testing.T) {
	cdi := func(v *int32) *cdiv1.CDI {
		return &cdiv1.CDI{Spec: cdiv1.CDISpec{Config: &cdiv1.CDIConfigSpec{LogVerbosity: v}}}
	}
	v := func(n int32) *int32 { return &n }
	for _, tc := range []struct {
		name string
		cdi  *cdiv1.CDI
		want slog.Level
	}{
		{"no CR", nil, slog.LevelInfo},
		{"no config", &cdiv1.CDI{}, slog.LevelInfo},
		{"unset", cdi(nil), slog.LevelInfo},
		{"0: warnings and errors", cdi(v(0)), Level(1)},
		{"CDI's default 1: Info", cdi(v(1)), slog.LevelInfo},
		{"2", cdi(v(2)), -2},
		{"3: Debug", cdi(v(3)), slog.LevelDebug},
		{"negative: as 0", cdi(v(-4)), Level(1)},
	} {
		if got := CDI(tc.cdi); got != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
}

// The CDI roles' logger writes through the daemon's handler (its output and
// attributes) at its own level: a daemon at Warn still shows CDI's Info, and
// the daemon's Info stays out.
func TestCDIRolesLogAtTheirOwnLevel(t *testing.T) {
	var out bytes.Buffer
	daemon := new(slog.LevelVar)
	daemon.Set(slog.LevelWarn)
	log := slog.New(slog.NewTextHandler(&out, &slog.HandlerOptions{Level: daemon})).With("node", "n1")
	cdi := CDIRoles(crwatch.New(nil, ""), log).With("role", "importer")
	log.Info("daemon info")
	cdi.Info("import started", "datavolume", "ns/dv")
	cdi.WithGroup("g").Debug("hidden")
	got := out.String()
	if strings.Contains(got, "daemon info") || strings.Contains(got, "hidden") ||
		!strings.Contains(got, `level=INFO msg="import started" node=n1 role=importer datavolume=ns/dv`) {
		t.Errorf("output:\n%s", got)
	}
}
