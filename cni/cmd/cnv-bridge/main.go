// Command cnv-bridge is the nodevirt linux-bridge CNI plugin (also installed
// as nodevirt-bridge).
package main

import (
	"os"

	"github.com/containernetworking/cni/pkg/skel"

	"github.com/nodevirt/nodevirt/cni/bridge"
)

func main() {
	if bridge.IsUnregisterHelper() {
		os.Exit(bridge.RunUnregisterHelper())
	}
	skel.PluginMainFuncs(bridge.Funcs, bridge.VersionInfo, bridge.About)
}
