package lab

import (
	"context"
	"errors"
)

// Demo runs the golden path on a lab that is up. Until the VM path is wired
// end to end it stops with this message.
func Demo(ctx context.Context, cfg Config) error {
	return errors.New("the demo VM is not wired yet: the lab is up, see `kubectl --kubeconfig .lab/kubeconfig get nodes,hco -A`")
}
