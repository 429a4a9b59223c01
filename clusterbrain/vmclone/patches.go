package vmclone

import (
	"encoding/json"
	"fmt"
	"strings"

	"k8s.io/apimachinery/pkg/util/uuid"
	clonev1beta1 "kubevirt.io/api/clone/v1beta1"
	snapv1beta1 "kubevirt.io/api/snapshot/v1beta1"
)

// Filtered keeps the keys of m that filters admit, KubeVirt's rules: no
// filters admit every key; otherwise each filter is a pattern where "*"
// stands for any run of characters ("*", "example.org/*"), "!" before it
// excludes what it matches, and the last filter that matches a key
// decides.
func Filtered(m map[string]string, filters []string) (map[string]string, error) {
	for _, f := range filters {
		if strings.TrimPrefix(f, "!") == "" {
			return nil, fmt.Errorf("filter %q is empty", f)
		}
	}
	if len(filters) == 0 || m == nil {
		return m, nil
	}
	out := map[string]string{}
	for k, v := range m {
		keep := false
		for _, f := range filters {
			neg := strings.HasPrefix(f, "!")
			if match(strings.TrimPrefix(f, "!"), k) {
				keep = !neg
			}
		}
		if keep {
			out[k] = v
		}
	}
	return out, nil
}

// match reports whether key matches pattern, "*" matching any run of
// characters (slashes included).
func match(pattern, key string) bool {
	parts := strings.Split(pattern, "*")
	if len(parts) == 1 {
		return pattern == key
	}
	if !strings.HasPrefix(key, parts[0]) {
		return false
	}
	key = key[len(parts[0]):]
	last := parts[len(parts)-1]
	for _, p := range parts[1 : len(parts)-1] {
		i := strings.Index(key, p)
		if i < 0 {
			return false
		}
		key = key[i+len(p):]
	}
	return len(key) >= len(last) && strings.HasSuffix(key, last)
}

// op is one RFC 6902 operation.
type op struct {
	Op    string `json:"op"`
	Path  string `json:"path"`
	Value any    `json:"value,omitempty"`
}

func (o op) String() string {
	b, _ := json.Marshal(o) // strings, maps of strings and plain values
	return string(b)
}

// Patches are the restore patches that turn the snapshotted VM src into
// the clone's target: filtered labels and annotations (VM and template),
// new MAC addresses, a new SMBIOS serial (the requested one, else a
// generated one, as KubeVirt's API documents) and no firmware UUID, then
// the clone's own spec.patches.
func Patches(vc *clonev1beta1.VirtualMachineClone, src *snapv1beta1.VirtualMachine) ([]string, error) {
	var ops []op
	filter := func(p string, m map[string]string, filters []string) error {
		f, err := Filtered(m, filters)
		if err != nil {
			return err
		}
		if m != nil {
			if f == nil {
				f = map[string]string{}
			}
			ops = append(ops, op{Op: "add", Path: p, Value: f})
		}
		return nil
	}
	if err := filter("/metadata/labels", src.Labels, vc.Spec.LabelFilters); err != nil {
		return nil, err
	}
	if err := filter("/metadata/annotations", src.Annotations, vc.Spec.AnnotationFilters); err != nil {
		return nil, err
	}
	tmpl := src.Spec.Template
	if tmpl == nil {
		return nil, fmt.Errorf("vm %s has no template", src.Name)
	}
	if err := filter("/spec/template/metadata/labels", tmpl.ObjectMeta.Labels, vc.Spec.Template.LabelFilters); err != nil {
		return nil, err
	}
	if err := filter("/spec/template/metadata/annotations", tmpl.ObjectMeta.Annotations, vc.Spec.Template.AnnotationFilters); err != nil {
		return nil, err
	}
	for i, iface := range tmpl.Spec.Domain.Devices.Interfaces {
		p := fmt.Sprintf("/spec/template/spec/domain/devices/interfaces/%d/macAddress", i)
		if mac, ok := vc.Spec.NewMacAddresses[iface.Name]; ok && mac != "" {
			ops = append(ops, op{Op: "add", Path: p, Value: mac})
		} else if iface.MacAddress != "" {
			ops = append(ops, op{Op: "remove", Path: p}) // the MAC pool gives a new one
		}
	}
	serial := string(uuid.NewUUID())
	if vc.Spec.NewSMBiosSerial != nil && *vc.Spec.NewSMBiosSerial != "" {
		serial = *vc.Spec.NewSMBiosSerial
	}
	if fw := tmpl.Spec.Domain.Firmware; fw != nil {
		ops = append(ops, op{Op: "add", Path: "/spec/template/spec/domain/firmware/serial", Value: serial})
		if fw.UUID != "" {
			ops = append(ops, op{Op: "remove", Path: "/spec/template/spec/domain/firmware/uuid"})
		}
	} else {
		ops = append(ops, op{Op: "add", Path: "/spec/template/spec/domain/firmware", Value: map[string]string{"serial": serial}})
	}
	out := make([]string, 0, len(ops)+len(vc.Spec.Patches))
	for _, o := range ops {
		out = append(out, o.String())
	}
	return append(out, vc.Spec.Patches...), nil
}
