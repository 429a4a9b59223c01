// Command nodevirt-pause is the pod sandbox ("pause") program of the kubelet
// test's containerd: it holds the pod's namespaces, reaps the orphans it
// inherits as PID 1 and exits on SIGTERM or SIGINT. Built static, it is the
// one file of the sandbox image the test writes (no registry is reached).
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGCHLD)
	for s := range sigs {
		if s != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var ws syscall.WaitStatus
			if pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil); pid <= 0 || err != nil {
				break
			}
		}
	}
}
