// Package v1alpha1 holds MACAllocation (macallocations.nodevirt.io), the
// persisted record of one MAC address handed out by the MAC pool. Its name
// is the address itself ("02-00-00-00-00-2a"), so creating it is the
// cluster-wide uniqueness check.
package v1alpha1

import (
	"fmt"
	"net"
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
)

// SchemeGroupVersion is nodevirt.io/v1alpha1.
var SchemeGroupVersion = schema.GroupVersion{Group: "nodevirt.io", Version: "v1alpha1"}

// MACAllocation records that a MAC address belongs to a VirtualMachine.
type MACAllocation struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`
	Spec              MACAllocationSpec `json:"spec"`
}

// MACAllocationSpec names the address and its owner.
type MACAllocationSpec struct {
	// MAC is the address, lower case with colons.
	MAC string `json:"mac"`
	// Namespace and VMName name the owning VirtualMachine; VMName is empty
	// until the VM has a name (generateName) and the reconciler fills it.
	Namespace string `json:"namespace"`
	VMName    string `json:"vmName,omitempty"`
	// VMUID is the owner's UID once known.
	VMUID types.UID `json:"vmUID,omitempty"`
	// Interface is the VM interface the address was given to.
	Interface string `json:"interface,omitempty"`
}

// MACAllocationList is a list of MACAllocation.
type MACAllocationList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []MACAllocation `json:"items"`
}

// NameFor returns the object name of mac ("02-00-00-00-00-2a").
func NameFor(mac net.HardwareAddr) string {
	return strings.ReplaceAll(strings.ToLower(mac.String()), ":", "-")
}

// ParseName is NameFor's inverse.
func ParseName(name string) (net.HardwareAddr, error) {
	hw, err := net.ParseMAC(strings.ReplaceAll(name, "-", ":"))
	if err != nil || len(hw) != 6 {
		return nil, fmt.Errorf("%q is not a mac allocation name", name)
	}
	return hw, nil
}

// AddToScheme registers the kinds.
func AddToScheme(s *runtime.Scheme) error {
	s.AddKnownTypes(SchemeGroupVersion, &MACAllocation{}, &MACAllocationList{})
	metav1.AddToGroupVersion(s, SchemeGroupVersion)
	return nil
}

// DeepCopyInto copies in into out.
func (in *MACAllocation) DeepCopyInto(out *MACAllocation) {
	*out = *in
	out.TypeMeta = in.TypeMeta
	in.ObjectMeta.DeepCopyInto(&out.ObjectMeta)
}

// DeepCopy returns a copy.
func (in *MACAllocation) DeepCopy() *MACAllocation {
	if in == nil {
		return nil
	}
	out := new(MACAllocation)
	in.DeepCopyInto(out)
	return out
}

// DeepCopyObject implements runtime.Object.
func (in *MACAllocation) DeepCopyObject() runtime.Object { return in.DeepCopy() }

// DeepCopyObject implements runtime.Object.
func (in *MACAllocationList) DeepCopyObject() runtime.Object {
	if in == nil {
		return nil
	}
	out := &MACAllocationList{TypeMeta: in.TypeMeta}
	in.ListMeta.DeepCopyInto(&out.ListMeta)
	for i := range in.Items {
		out.Items = append(out.Items, *in.Items[i].DeepCopy())
	}
	return out
}
