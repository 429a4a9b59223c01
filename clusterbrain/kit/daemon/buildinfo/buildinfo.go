// Package buildinfo says which build a nodevirt binary is: a version and a
// build stamp (source revision and commit time), printed by every binary's
// --version. The Go toolchain records the revision and time of the checkout
// it built from; the Makefile's build target may set them (and the
// version) with -ldflags -X for builds outside a checkout.
//
// It is a leaf package: it imports only the standard library, so every
// binary, the CNI plugin included, can use it.
package buildinfo

import (
	"fmt"
	"runtime"
	"runtime/debug"
	"strings"
)

// Set with -ldflags "-X github.com/nodevirt/nodevirt/clusterbrain/kit/daemon/buildinfo.version=…"
// (and .revision, .buildTime); empty means what the toolchain recorded.
var (
	version   string
	revision  string
	buildTime string
)

// Info is one binary's version and build stamp.
type Info struct {
	// Version is the linker-set version, else the module's version, else
	// "devel".
	Version string
	// Revision is the source revision built ("" when unknown).
	Revision string
	// Time is the revision's commit time, RFC 3339 ("" when unknown).
	Time string
	// Modified says the tree had uncommitted changes.
	Modified  bool
	GoVersion string
	Platform  string
}

// Read returns the running binary's Info.
func Read() Info {
	i := Info{Version: "devel", GoVersion: runtime.Version(), Platform: runtime.GOOS + "/" + runtime.GOARCH}
	if bi, ok := debug.ReadBuildInfo(); ok {
		if v := bi.Main.Version; v != "" && v != "(devel)" {
			i.Version = v
		}
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				i.Revision = s.Value
			case "vcs.time":
				i.Time = s.Value
			case "vcs.modified":
				i.Modified = s.Value == "true"
			}
		}
	}
	if version != "" {
		i.Version = version
	}
	if revision != "" {
		i.Revision = revision
	}
	if buildTime != "" {
		i.Time = buildTime
	}
	return i
}

// String is the one line --version prints after the program's name.
func (i Info) String() string {
	var b strings.Builder
	b.WriteString(i.Version)
	stamp := []string{"revision " + orUnknown(i.Revision), "committed " + orUnknown(i.Time)}
	if i.Modified {
		stamp = append(stamp, "modified")
	}
	stamp = append(stamp, i.GoVersion, i.Platform)
	fmt.Fprintf(&b, " (%s)", strings.Join(stamp, ", "))
	return b.String()
}

func orUnknown(s string) string {
	if s == "" {
		return "unknown"
	}
	return s
}

// Line is what program's --version prints.
func Line(program string) string { return program + " " + Read().String() }

// FlagUsage is the usage text of a --version flag.
const FlagUsage = "print the version and build stamp and exit"

// Requested reports whether a command's arguments (without the program
// name) ask only for the version: for binaries without a flag set.
func Requested(args []string) bool {
	return len(args) == 1 && (args[0] == "--version" || args[0] == "-version")
}
