// Command nodevirt-tasks runs one of nodevirt's pipeline tasks (the Tekton
// tasks of OpenShift Virtualization): nodevirt-tasks TASK --param=value ….
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/nodevirt/nodevirt/clusterbrain/client/virtctl"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/daemon/buildinfo"
	"github.com/nodevirt/nodevirt/clusterbrain/tekton"
)

func main() {
	if buildinfo.Requested(os.Args[1:]) {
		fmt.Println(buildinfo.Line("nodevirt-tasks"))
		return
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	code := tekton.Run(ctx, os.Args[1:], tekton.Env{Out: os.Stdout, Err: os.Stderr,
		Connect: func(ns string) (*virtctl.Client, error) {
			return virtctl.Load(virtctl.Options{Kubeconfig: os.Getenv("KUBECONFIG"), Namespace: ns})
		}})
	stop()
	os.Exit(code)
}
