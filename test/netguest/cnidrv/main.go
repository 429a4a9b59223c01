// Command cnidrv is a cnitool-style driver used inside the network test
// guest: it runs a network config through libcni the way a runtime does.
//
//	cnidrv add|check|del <config.json> <containerID> <netns name> [ifname]
//	cnidrv gc <config.json> [containerID ...]   (the valid attachments, ifname eth0)
package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/types"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "cnidrv:", err)
		os.Exit(1)
	}
}

func run(args []string) error {
	if len(args) < 2 {
		return fmt.Errorf("usage: cnidrv add|check|del|gc <config> ...")
	}
	verb, confPath := args[0], args[1]
	b, err := os.ReadFile(confPath)
	if err != nil {
		return err
	}
	var list *libcni.NetworkConfigList
	if strings.Contains(string(b), `"plugins"`) {
		list, err = libcni.ConfListFromBytes(b)
	} else {
		var c *libcni.PluginConfig
		if c, err = libcni.ConfFromBytes(b); err == nil {
			list, err = libcni.ConfListFromConf(c)
		}
	}
	if err != nil {
		return fmt.Errorf("parse %s: %w", confPath, err)
	}
	cni := libcni.NewCNIConfigWithCacheDir(filepath.SplitList(os.Getenv("CNI_PATH")), "/run/cni-cache", nil)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if verb == "gc" {
		var valid []types.GCAttachment
		for _, id := range args[2:] {
			valid = append(valid, types.GCAttachment{ContainerID: id, IfName: "eth0"})
		}
		return cni.GCNetworkList(ctx, list, &libcni.GCArgs{ValidAttachments: valid})
	}
	if len(args) < 4 {
		return fmt.Errorf("%s needs <config> <containerID> <netns name>", verb)
	}
	rt := &libcni.RuntimeConf{ContainerID: args[2], NetNS: "/run/netns/" + args[3], IfName: "eth0"}
	if len(args) > 4 {
		rt.IfName = args[4]
	}
	switch verb {
	case "add":
		res, err := cni.AddNetworkList(ctx, list, rt)
		if err != nil {
			return err
		}
		return res.Print()
	case "check":
		return cni.CheckNetworkList(ctx, list, rt)
	case "del":
		return cni.DelNetworkList(ctx, list, rt)
	}
	return fmt.Errorf("unknown verb %q", verb)
}
