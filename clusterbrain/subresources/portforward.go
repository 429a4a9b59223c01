package subresources

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"strings"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// portForwardSub is the subresource of
// {virtualmachineinstances,virtualmachines}/{name}/portforward/{port}[/{protocol}].
const portForwardSub = "portforward"

// parsePortForward splits "portforward/{port}[/{protocol}]" into the port
// and the protocol (tcp when absent), as virt-api's routes take them.
func parsePortForward(sub string) (int, string, error) {
	parts := strings.Split(sub, "/")
	if len(parts) < 2 || len(parts) > 3 || parts[0] != portForwardSub {
		return 0, "", apierrors.NewNotFound(kubevirtv1.Resource("subresource"), sub)
	}
	port, err := strconv.Atoi(parts[1])
	if err != nil || port < 1 || port > 65535 {
		return 0, "", apierrors.NewBadRequest(fmt.Sprintf("port %q is not a port number (1-65535)", parts[1]))
	}
	protocol := "tcp"
	if len(parts) == 3 {
		protocol = parts[2]
	}
	if protocol != "tcp" && protocol != "udp" {
		return 0, "", apierrors.NewBadRequest(fmt.Sprintf("protocol %q cannot be forwarded: tcp or udp", protocol))
	}
	return port, protocol, nil
}

// vmiOfVM is the VMI a VM runs, as virt-api finds it for the VM variants
// of VMI subresources.
func (s *Server) vmiOfVM(ctx context.Context, ns, name string) (*kubevirtv1.VirtualMachineInstance, error) {
	vm, err := s.cfg.Virt.VMs.Get(ctx, ns, name)
	if apierrors.IsNotFound(err) {
		return nil, apierrors.NewNotFound(vmResource, name)
	}
	if err != nil {
		return nil, apierrors.NewInternalError(fmt.Errorf("unable to retrieve vm [%s]: %w", name, err))
	}
	if !vm.Status.Created {
		return nil, apierrors.NewConflict(vmResource, name, errors.New("VMI is not started"))
	}
	vmi, err := s.fetchVMI(ctx, ns, name)
	if err != nil {
		return nil, err
	}
	for _, ref := range vmi.OwnerReferences {
		if ref.UID == vm.UID {
			return vmi, nil
		}
	}
	return nil, apierrors.NewNotFound(vmiResource, name)
}

// portForward tunnels a websocket to a port of the guest through its
// nodeagent, which dials the guest's pod network address (virt-api dials
// the launcher pod's address). Any number of tunnels may be open at once:
// virtctl opens one per forwarded connection.
func (s *Server) portForward(w http.ResponseWriter, r *http.Request, req request, log *slog.Logger) error {
	ctx := r.Context()
	port, protocol, err := parsePortForward(req.subresource)
	if err != nil {
		return err
	}
	var vmi *kubevirtv1.VirtualMachineInstance
	if req.resource == "virtualmachines" {
		vmi, err = s.vmiOfVM(ctx, req.namespace, req.name)
	} else {
		vmi, err = s.fetchVMI(ctx, req.namespace, req.name)
	}
	if err != nil {
		return err
	}
	if !vmi.IsRunning() && !vmi.IsScheduled() {
		return apierrors.NewBadRequest(fmt.Sprintf("Unable to connect to VirtualMachineInstance because phase is %s instead of %s or %s",
			vmi.Status.Phase, kubevirtv1.Running, kubevirtv1.Scheduled))
	}
	if hasCondition(vmi, kubevirtv1.VirtualMachineInstancePaused) {
		return apierrors.NewConflict(vmiResource, vmi.Name, errors.New("VMI is paused"))
	}
	action := fmt.Sprintf("%s/%d/%s", portForwardSub, port, protocol)
	node, err := s.cfg.Node.Stream(ctx, vmi, action, nil)
	if err != nil {
		log.Info("open node port forward", "node", vmi.Status.NodeName, "port", port, "protocol", protocol, "err", err)
		return err
	}
	client := upgrade(w, r, node, log)
	if client == nil {
		return nil
	}
	log.Info("port forward opened", "node", vmi.Status.NodeName, "port", port, "protocol", protocol)
	n1, n2, err := splice(client, node)
	log.Info("port forward closed", "port", port, "protocol", protocol, "toNode", n1, "toClient", n2, "err", err)
	return nil
}
