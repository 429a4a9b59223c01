// Package v1alpha1 holds MACAllocation (macallocations.nodevirt.io), the
// persisted record of MAC addresses handed out by the MAC pool. The pool
// writes blocks: one object per aligned run of BlockSize addresses, named
// after its first address ("block-02-00-00-00-01-00"), whose
// spec.entries list the addresses of the run that are taken; every change
// is a write of that one object guarded by its resourceVersion, so two
// writers can never both take one address, and one write records a whole
// group of admissions. An object without entries whose name is an address
// ("02-00-00-00-00-2a") records that single address (the earlier format,
// still honoured).
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
	// Entries, on a block, are its taken addresses (MAC is then the
	// block's first address and the owner fields are empty).
	Entries []MACEntry `json:"entries,omitempty"`
}

// MACEntry is one taken address of a block.
type MACEntry struct {
	// MAC is the address, lower case with colons.
	MAC string `json:"mac"`
	// Namespace and VMName name the owning VirtualMachine (VMName empty
	// while the VM has only a generateName).
	Namespace string    `json:"namespace"`
	VMName    string    `json:"vmName,omitempty"`
	VMUID     types.UID `json:"vmUID,omitempty"`
	Interface string    `json:"interface,omitempty"`
	// Since is when the address was taken by this owner.
	Since metav1.Time `json:"since"`
}

// BlockBits is log2 of BlockSize.
const BlockBits = 4

// BlockSize is how many addresses one block object records.
const BlockSize = 1 << BlockBits

// BlockPrefix starts the name of every block object.
const BlockPrefix = "block-"

// BlockName returns the name of the block object holding mac.
func BlockName(mac uint64) string {
	base := mac &^ (BlockSize - 1)
	hw := make(net.HardwareAddr, 6)
	for i := 5; i >= 0; i-- {
		hw[i] = byte(base)
		base >>= 8
	}
	return BlockPrefix + NameFor(hw)
}

// IsBlock reports whether a is a block object.
func (a *MACAllocation) IsBlock() bool { return strings.HasPrefix(a.Name, BlockPrefix) }

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
	if in.Spec.Entries != nil {
		out.Spec.Entries = make([]MACEntry, len(in.Spec.Entries))
		for i := range in.Spec.Entries {
			out.Spec.Entries[i] = in.Spec.Entries[i]
			in.Spec.Entries[i].Since.DeepCopyInto(&out.Spec.Entries[i].Since)
		}
	}
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
