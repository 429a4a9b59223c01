// Command virtctl is nodevirt's virtctl: KubeVirt's verbs and flags against
// the subresources.kubevirt.io and upload.cdi.kubevirt.io APIs.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/nodevirt/nodevirt/clusterbrain/client/virtctl"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/daemon/buildinfo"
)

func main() {
	if buildinfo.Requested(os.Args[1:]) {
		fmt.Println(buildinfo.Line("virtctl"))
		return
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	code := virtctl.Run(ctx, os.Args[1:], virtctl.IO{In: os.Stdin, Out: os.Stdout, Err: os.Stderr})
	stop()
	os.Exit(code)
}
