// Package v1 is networkaddonsoperator.network.kubevirt.io/v1: the
// NetworkAddonsConfig that configures bridges, the MAC pool and friends.
package v1

import (
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/nodevirt/nodevirt/clusterbrain/api"
	hcov1beta1 "github.com/nodevirt/nodevirt/clusterbrain/api/hco/v1beta1"
)

// SchemeGroupVersion is the group and version of this package.
var SchemeGroupVersion = schema.GroupVersion{Group: "networkaddonsoperator.network.kubevirt.io", Version: "v1"}

// Name is the only NetworkAddonsConfig the platform reads.
const Name = "cluster"

// NetworkAddonsConfig is cluster-scoped.
type NetworkAddonsConfig struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`
	Spec              NetworkAddonsConfigSpec `json:"spec,omitempty"`
	Status            api.OperatorStatus      `json:"status,omitempty"`
}

// NetworkAddonsConfigList is a list of NetworkAddonsConfig.
type NetworkAddonsConfigList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []NetworkAddonsConfig `json:"items"`
}

// NetworkAddonsConfigSpec selects the network add-ons and their settings.
type NetworkAddonsConfigSpec struct {
	Multus                 *Multus                        `json:"multus,omitempty"`
	MultusDynamicNetworks  *struct{}                      `json:"multusDynamicNetworks,omitempty"`
	LinuxBridge            *LinuxBridge                   `json:"linuxBridge,omitempty"`
	Ovs                    *struct{}                      `json:"ovs,omitempty"`
	KubeMacPool            *KubeMacPool                   `json:"kubeMacPool,omitempty"`
	MacvtapCni             *struct{}                      `json:"macvtap,omitempty"`
	KubeSecondaryDNS       *struct{}                      `json:"kubeSecondaryDNS,omitempty"`
	ImagePullPolicy        corev1.PullPolicy              `json:"imagePullPolicy,omitempty"`
	PlacementConfiguration *PlacementConfiguration        `json:"placementConfiguration,omitempty"`
	SelfSignConfiguration  *SelfSignConfiguration         `json:"selfSignConfiguration,omitempty"`
	TLSSecurityProfile     *hcov1beta1.TLSSecurityProfile `json:"tlsSecurityProfile,omitempty"`
}

// Multus enables NetworkAttachmentDefinitions.
type Multus struct{}

// LinuxBridge enables the cnv-bridge plugin and bridge-marker.
type LinuxBridge struct {
	// UplinkOnly publishes only bridges that have an uplink port (nodevirt).
	UplinkOnly bool `json:"uplinkOnly,omitempty"`
}

// KubeMacPool is the MAC address range handed to VM interfaces.
type KubeMacPool struct {
	RangeStart string `json:"rangeStart,omitempty"`
	RangeEnd   string `json:"rangeEnd,omitempty"`
}

// PlacementConfiguration places infra and workload components.
type PlacementConfiguration struct {
	Infra     *hcov1beta1.NodePlacement `json:"infra,omitempty"`
	Workloads *hcov1beta1.NodePlacement `json:"workloads,omitempty"`
}

// SelfSignConfiguration holds the webhook certificate rotation settings.
type SelfSignConfiguration struct {
	CARotateInterval    string `json:"caRotateInterval,omitempty"`
	CAOverlapInterval   string `json:"caOverlapInterval,omitempty"`
	CertRotateInterval  string `json:"certRotateInterval,omitempty"`
	CertOverlapInterval string `json:"certOverlapInterval,omitempty"`
}

// DeepCopyObject implements runtime.Object.
func (in *NetworkAddonsConfig) DeepCopyObject() runtime.Object {
	out := new(NetworkAddonsConfig)
	api.DeepCopyJSON(in, out)
	return out
}

// DeepCopyObject implements runtime.Object.
func (in *NetworkAddonsConfigList) DeepCopyObject() runtime.Object {
	out := new(NetworkAddonsConfigList)
	api.DeepCopyJSON(in, out)
	return out
}
