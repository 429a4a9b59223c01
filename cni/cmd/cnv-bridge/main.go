// Command cnv-bridge is the nodevirt linux-bridge CNI plugin (also installed
// as nodevirt-bridge).
package main

import (
	"fmt"
	"os"
	"runtime"
	"runtime/debug"

	"github.com/containernetworking/cni/pkg/skel"

	"github.com/nodevirt/nodevirt/clusterbrain/kit/daemon/buildinfo"
	"github.com/nodevirt/nodevirt/cni/bridge"
)

func main() {
	// CNI's own VERSION command comes in CNI_COMMAND, never in arguments.
	if os.Getenv("CNI_COMMAND") == "" && buildinfo.Requested(os.Args[1:]) {
		fmt.Println(buildinfo.Line("cnv-bridge"))
		return
	}
	if bridge.IsUnregisterHelper() {
		os.Exit(bridge.RunUnregisterHelper())
	}
	// A run lives for milliseconds, allocates little and does one thing
	// at a time: collecting garbage, or a second P whose idle thread spins
	// looking for work, would only cost CPU that concurrent runs (and DEL's
	// unregistration helper) compete for.
	debug.SetGCPercent(-1)
	runtime.GOMAXPROCS(1)
	skel.PluginMainFuncs(bridge.Funcs, bridge.VersionInfo, bridge.About)
}
