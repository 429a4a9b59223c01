package handler

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"strings"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	v1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/kit/metrics"
	"github.com/nodevirt/nodevirt/cni/bridge"
	"github.com/nodevirt/nodevirt/launcher/domain"
)

// tapName is the deterministic tap of a VMI's interface: an agent restart
// finds the same device.
func tapName(uid types.UID, iface string) string {
	sum := sha256.Sum256([]byte(string(uid) + "/" + iface))
	return "nvt" + hex.EncodeToString(sum[:])[:11]
}

// plannedTaps decides the tap of every NIC of vmi and what to attach it to:
// the bridge of its Multus network (with that network's config) or the
// node's pod network (with its MAC); no device is made.
func (h *Handler) plannedTaps(ctx context.Context, vmi *v1.VirtualMachineInstance) ([]tapRecord, error) {
	networks := map[string]*v1.Network{}
	for i := range vmi.Spec.Networks {
		networks[vmi.Spec.Networks[i].Name] = &vmi.Spec.Networks[i]
	}
	var out []tapRecord
	for i, iface := range vmi.Spec.Domain.Devices.Interfaces {
		path := fmt.Sprintf("spec.domain.devices.interfaces[%d]", i)
		n, ok := networks[iface.Name]
		if !ok {
			return nil, fmt.Errorf("%w: %s: no network named %q in spec.networks", errSpec, path, iface.Name)
		}
		if iface.State == v1.InterfaceStateAbsent {
			continue
		}
		if n.Pod != nil {
			t, err := h.podTap(vmi, &iface, path)
			if err != nil {
				return nil, err
			}
			out = append(out, t)
			continue
		}
		if n.Multus == nil {
			return nil, fmt.Errorf("%w: %s (%s): the network has no source (pod or multus)", errSpec, path, iface.Name)
		}
		if iface.Bridge == nil {
			return nil, fmt.Errorf("%w: %s (%s): only the bridge binding can connect to a Multus network", errSpec, path, iface.Name)
		}
		conf, err := h.networkConfig(ctx, vmi.Namespace, n.Multus.NetworkName)
		if err != nil {
			return nil, fmt.Errorf("%s (%s): %w", path, iface.Name, err)
		}
		mac, err := interfaceMAC(vmi, &iface)
		if err != nil {
			return nil, err
		}
		out = append(out, tapRecord{Interface: iface.Name, Tap: tapName(vmi.UID, iface.Name), NetConf: conf, MAC: mac.String()})
	}
	return out, nil
}

// networkConfig reads spec.config of the NetworkAttachmentDefinition
// networkName ("name" in the VMI's namespace, or "namespace/name") and
// checks that the bridge plugin accepts it.
func (h *Handler) networkConfig(ctx context.Context, namespace, networkName string) (json.RawMessage, error) {
	ns, name := namespace, networkName
	if a, b, ok := strings.Cut(networkName, "/"); ok {
		ns, name = a, b
	}
	nad, err := h.cfg.Virt.NADs.Get(ctx, ns, name)
	if apierrors.IsNotFound(err) {
		return nil, fmt.Errorf("%w: network-attachment-definition %s/%s does not exist", errWaiting, ns, name)
	}
	if err != nil {
		return nil, fmt.Errorf("network-attachment-definition %s/%s: %w", ns, name, err)
	}
	raw := []byte(nad.Spec.Config)
	if len(raw) == 0 {
		return nil, fmt.Errorf("network-attachment-definition %s/%s has no spec.config", ns, name)
	}
	if _, err := h.netConf(raw); err != nil {
		return nil, fmt.Errorf("network-attachment-definition %s/%s: %w", ns, name, err)
	}
	return raw, nil
}

// netConf parses a recorded network config, with NetStateDir applied.
func (h *Handler) netConf(raw []byte) (*bridge.NetConf, error) {
	conf, err := bridge.ParseNetConf(raw)
	if err != nil {
		return nil, err
	}
	if h.cfg.NetStateDir != "" {
		conf.StateDir = h.cfg.NetStateDir
	}
	return conf, nil
}

// plannedDomainTaps is what the domain would get from the planned taps
// before any is attached (no MTU yet): enough to check the spec before
// anything is made on the host.
func plannedDomainTaps(taps []tapRecord) map[string]domain.Tap {
	out := make(map[string]domain.Tap, len(taps))
	for _, t := range taps {
		out[t.Interface] = domain.Tap{Dev: t.Tap, MAC: t.MAC}
	}
	return out
}

// attachTaps makes (or re-adopts) every planned tap on its bridge with the
// MAC the plan recorded, or on the pod network, and returns what each
// attach made, by interface name, for the domain: the tap device, the MAC
// its port was made for and the port's MTU.
func (h *Handler) attachTaps(ctx context.Context, vmi *v1.VirtualMachineInstance, taps []tapRecord) (map[string]domain.Tap, error) {
	out := make(map[string]domain.Tap, len(taps))
	for _, t := range taps {
		if t.Pod {
			a, err := h.attachPodTap(ctx, podKey(vmi.Namespace, vmi.Name, vmi.UID), t)
			if err != nil {
				return nil, err
			}
			out[t.Interface] = domainTap(a)
			continue
		}
		conf, err := h.netConf(t.NetConf)
		if err != nil {
			return nil, fmt.Errorf("interface %s: %w", t.Interface, err)
		}
		var mac net.HardwareAddr
		if t.MAC != "" {
			if mac, err = net.ParseMAC(t.MAC); err != nil {
				return nil, fmt.Errorf("interface %s: recorded mac %q: %w", t.Interface, t.MAC, err)
			}
		}
		start := time.Now()
		a, err := bridge.AttachTap(ctx, conf, t.Tap, mac, -1)
		observeTap("attach", start, err)
		if err != nil {
			return nil, fmt.Errorf("interface %s: %w", t.Interface, err)
		}
		out[t.Interface] = domainTap(a)
	}
	return out, nil
}

// domainTap is what the domain's NIC takes from an attach.
func domainTap(a *bridge.Attachment) domain.Tap {
	t := domain.Tap{Dev: a.Port, MTU: a.MTU}
	if a.MAC != nil {
		t.MAC = a.MAC.String()
	}
	return t
}

// detachTaps removes the taps of a record; gone taps are fine.
func (h *Handler) detachTaps(ctx context.Context, r *record) error {
	var errs []error
	for _, t := range r.Taps {
		if t.Pod {
			errs = append(errs, h.detachPodTap(ctx, r, t))
			continue
		}
		conf, err := h.netConf(t.NetConf)
		if err != nil {
			errs = append(errs, fmt.Errorf("tap %s: %w", t.Tap, err))
			continue
		}
		start := time.Now()
		err = bridge.DetachTap(ctx, conf, t.Tap)
		observeTap("detach", start, err)
		if err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// DetachRecordedTaps removes the bridge taps (and their spoof-check rules)
// of every VMI recorded under stateDir, the handler's record being the only
// one kept of them; netStateDir is Config.NetStateDir. It is for
// uninstalling after the agent stopped (`make lab-down`): guests lose their
// secondary networks. Pod network taps are the pod network's teardown.
// If each is not nil, it is told every tap before it goes.
func DetachRecordedTaps(ctx context.Context, stateDir, netStateDir string, each func(tap string)) error {
	h := &Handler{cfg: Config{StateDir: stateDir, NetStateDir: netStateDir}}
	recs, err := h.records()
	errs := []error{err}
	for _, r := range recs {
		bridged := &record{UID: r.UID, Namespace: r.Namespace, Name: r.Name}
		for _, t := range r.Taps {
			if !t.Pod {
				bridged.Taps = append(bridged.Taps, t)
				if each != nil {
					each(t.Tap)
				}
			}
		}
		errs = append(errs, h.detachTaps(ctx, bridged))
	}
	return errors.Join(errs...)
}

// tapDuration times the bridge plugin's operations made in process for VM
// NICs (the CNI binary's own runs are the container runtime's to time).
var tapDuration = metrics.Default().Histogram("nodevirt_cni_operation_duration_seconds",
	"Duration of linux-bridge plugin operations on VM taps.", metrics.LatencyBuckets, "op", "result")

func observeTap(op string, start time.Time, err error) {
	result := "ok"
	if err != nil {
		result = "error"
	}
	tapDuration.With(op, result).Observe(time.Since(start).Seconds())
}
