// Command cnv-bridge is the nodevirt linux-bridge CNI plugin (also installed
// as nodevirt-bridge).
package main

import (
	"os"
	"runtime/debug"

	"github.com/containernetworking/cni/pkg/skel"

	"github.com/nodevirt/nodevirt/cni/bridge"
)

func main() {
	if bridge.IsUnregisterHelper() {
		os.Exit(bridge.RunUnregisterHelper())
	}
	// A run lives for milliseconds and allocates little: collecting
	// garbage would only cost CPU that concurrent runs compete for.
	debug.SetGCPercent(-1)
	skel.PluginMainFuncs(bridge.Funcs, bridge.VersionInfo, bridge.About)
}
