// Package instancetypes holds the common instance types and preferences as
// kubevirt/common-instancetypes defines them (the u1, o1, cx1, m1 and n1
// series; OS preferences), and the brain role that installs them as
// cluster-wide objects and keeps them as defined.
package instancetypes

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"

	jsonpatch "gopkg.in/evanphx/json-patch.v4"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
	instancetypev1beta1 "kubevirt.io/api/instancetype/v1beta1"
)

// Labels and annotations common-instancetypes puts on its objects.
const (
	LabelVendor     = "instancetype.kubevirt.io/vendor"
	LabelVersion    = "instancetype.kubevirt.io/version"
	LabelClass      = "instancetype.kubevirt.io/class"
	LabelIcon       = "instancetype.kubevirt.io/icon-pf"
	LabelCPU        = "instancetype.kubevirt.io/cpu"
	LabelMemory     = "instancetype.kubevirt.io/memory"
	LabelSize       = "instancetype.kubevirt.io/size"
	LabelHugepages  = "instancetype.kubevirt.io/hugepages"
	LabelDedicated  = "instancetype.kubevirt.io/dedicatedCPUPlacement"
	LabelIsolate    = "instancetype.kubevirt.io/isolateEmulatorThread"
	LabelNUMA       = "instancetype.kubevirt.io/numa"
	LabelReqCPU     = "instancetype.kubevirt.io/required-cpu"
	LabelReqMemory  = "instancetype.kubevirt.io/required-memory"
	LabelCIVersion  = "instancetype.kubevirt.io/common-instancetypes-version"
	LabelManagedBy  = "app.kubernetes.io/managed-by"
	AnnDisplayName  = "instancetype.kubevirt.io/displayName"
	AnnDescription  = "instancetype.kubevirt.io/description"
	AnnPrefDisplay  = "openshift.io/display-name"
	AnnPrefTags     = "tags"
	AnnPrefIcon     = "iconClass"
	Vendor          = "kubevirt.io"
	ManagedBy       = "nodevirt"
	upstreamVersion = "v1.7.0"
)

// series is one instance type class: what every size shares.
type series struct {
	prefix, class, icon, display, description string
	dedicated, isolate, numa                  bool
	overcommitPercent                         int
	hugepages                                 string // every size's page size ("" none)
	maxSocketsIsGuest, ioThreadsAuto          bool
	podAnnotations                            map[string]string
	sizes                                     []size
}

// size is one instance type of a series.
type size struct {
	name   string
	cpu    uint32
	memory string
	// hugepages overrides the series' page size for this size.
	hugepages string
}

// sizesWithHugepages lists the sizes twice: with 2Mi pages, and with 1Gi
// pages under a "1gi" suffix, as the cx1 and m1 series do.
func sizesWithHugepages(base []size) []size {
	var out []size
	for _, s := range base {
		out = append(out, size{name: s.name, cpu: s.cpu, memory: s.memory, hugepages: "2Mi"})
	}
	for _, s := range base {
		out = append(out, size{name: s.name + "1gi", cpu: s.cpu, memory: s.memory, hugepages: "1Gi"})
	}
	return out
}

// generalSizes are the u1 and o1 sizes (u1 also has 2xmedium).
var generalSizes = []size{
	{name: "nano", cpu: 1, memory: "512Mi"}, {name: "micro", cpu: 1, memory: "1Gi"}, {name: "small", cpu: 1, memory: "2Gi"},
	{name: "medium", cpu: 1, memory: "4Gi"}, {name: "large", cpu: 2, memory: "8Gi"}, {name: "xlarge", cpu: 4, memory: "16Gi"},
	{name: "2xlarge", cpu: 8, memory: "32Gi"}, {name: "4xlarge", cpu: 16, memory: "64Gi"}, {name: "8xlarge", cpu: 32, memory: "128Gi"},
}

var catalogSeries = []series{
	{prefix: "u1", class: "general.purpose", icon: "pficon-server-group", display: "General Purpose",
		description: "General purpose: neutral resources for most applications; vCPUs share physical cores on a time-slice basis.",
		sizes:       append(append([]size{}, generalSizes...), size{name: "2xmedium", cpu: 2, memory: "4Gi"})},
	{prefix: "o1", class: "overcommitted", icon: "pficon-virtual-machine", display: "Overcommitted",
		description: "Like the U series with memory overcommitted.", overcommitPercent: 50, sizes: generalSizes},
	{prefix: "cx1", class: "compute.exclusive", icon: "pficon-registry", display: "Compute Exclusive",
		description: "Exclusive cores for compute intensive work, isolated emulator thread, guest NUMA topology and huge pages.",
		dedicated:   true, isolate: true, numa: true, maxSocketsIsGuest: true, ioThreadsAuto: true,
		sizes: sizesWithHugepages([]size{
			{name: "medium", cpu: 1, memory: "2Gi"}, {name: "large", cpu: 2, memory: "4Gi"}, {name: "xlarge", cpu: 4, memory: "8Gi"},
			{name: "2xlarge", cpu: 8, memory: "16Gi"}, {name: "4xlarge", cpu: 16, memory: "32Gi"}, {name: "8xlarge", cpu: 32, memory: "64Gi"},
		})},
	{prefix: "m1", class: "memory.intensive", icon: "fa-memory", display: "Memory Intensive",
		description: "Memory intensive applications, backed by huge pages.",
		sizes: sizesWithHugepages([]size{
			{name: "large", cpu: 2, memory: "16Gi"}, {name: "xlarge", cpu: 4, memory: "32Gi"}, {name: "2xlarge", cpu: 8, memory: "64Gi"},
			{name: "4xlarge", cpu: 16, memory: "128Gi"}, {name: "8xlarge", cpu: 32, memory: "256Gi"},
		})},
	{prefix: "n1", class: "network", icon: "pficon-network", display: "Network",
		description: "Network intensive (DPDK) applications: dedicated cores, isolated emulator thread, 1Gi huge pages.",
		dedicated:   true, isolate: true, hugepages: "1Gi",
		podAnnotations: map[string]string{"cpu-load-balancing.crio.io": "disable", "cpu-quota.crio.io": "disable", "irq-load-balancing.crio.io": "disable"},
		sizes: []size{
			{name: "medium", cpu: 4, memory: "4Gi"}, {name: "large", cpu: 4, memory: "8Gi"}, {name: "xlarge", cpu: 8, memory: "16Gi"},
			{name: "2xlarge", cpu: 16, memory: "32Gi"}, {name: "4xlarge", cpu: 32, memory: "64Gi"}, {name: "8xlarge", cpu: 64, memory: "128Gi"},
		}},
}

func yes() *bool { v := true; return &v }

// ClusterInstancetypes returns every common instance type.
func ClusterInstancetypes() []*instancetypev1beta1.VirtualMachineClusterInstancetype {
	var out []*instancetypev1beta1.VirtualMachineClusterInstancetype
	for _, s := range catalogSeries {
		for _, z := range s.sizes {
			pages := z.hugepages
			if pages == "" {
				pages = s.hugepages
			}
			labels := map[string]string{
				LabelVendor: Vendor, LabelVersion: "1", LabelClass: s.class, LabelIcon: s.icon, LabelCIVersion: upstreamVersion,
				LabelManagedBy: ManagedBy, LabelCPU: strconv.Itoa(int(z.cpu)), LabelMemory: z.memory,
				LabelSize: strings.TrimSuffix(z.name, "1gi"),
			}
			spec := instancetypev1beta1.VirtualMachineInstancetypeSpec{
				CPU:         instancetypev1beta1.CPUInstancetype{Guest: z.cpu},
				Memory:      instancetypev1beta1.MemoryInstancetype{Guest: resource.MustParse(z.memory), OvercommitPercent: s.overcommitPercent},
				Annotations: s.podAnnotations,
			}
			if pages != "" {
				labels[LabelHugepages] = pages
				spec.Memory.Hugepages = &kubevirtv1.Hugepages{PageSize: pages}
			}
			if s.dedicated {
				labels[LabelDedicated] = "true"
				spec.CPU.DedicatedCPUPlacement = yes()
			}
			if s.isolate {
				labels[LabelIsolate] = "true"
				spec.CPU.IsolateEmulatorThread = yes()
			}
			if s.numa {
				labels[LabelNUMA] = "true"
				spec.CPU.NUMA = &kubevirtv1.NUMA{GuestMappingPassthrough: &kubevirtv1.NUMAGuestMappingPassthrough{}}
			}
			if s.maxSocketsIsGuest {
				n := z.cpu
				spec.CPU.MaxSockets = &n
			}
			if s.ioThreadsAuto {
				p := kubevirtv1.IOThreadsPolicyAuto
				spec.IOThreadsPolicy = &p
			}
			out = append(out, &instancetypev1beta1.VirtualMachineClusterInstancetype{
				TypeMeta: metav1.TypeMeta{APIVersion: instancetypev1beta1.SchemeGroupVersion.String(), Kind: "VirtualMachineClusterInstancetype"},
				ObjectMeta: metav1.ObjectMeta{Name: s.prefix + "." + z.name, Labels: labels,
					Annotations: map[string]string{AnnDisplayName: s.display, AnnDescription: s.description}},
				Spec: spec,
			})
		}
	}
	return out
}

// Preference components, as JSON merge patches of a preference spec (the
// building blocks common-instancetypes composes its preferences from).
const (
	compVirtioDisk     = `{"devices":{"preferredDiskBus":"virtio"}}`
	compVirtioNet      = `{"devices":{"preferredInterfaceModel":"virtio"}}`
	compRng            = `{"devices":{"preferredRng":{}}}`
	compEFI            = `{"firmware":{"preferredEfi":{"secureBoot":false}}}`
	compEFIPersisted   = `{"firmware":{"preferredEfi":{"persistent":true,"secureBoot":false}}}`
	compSecureBoot     = `{"features":{"preferredSmm":{}},"firmware":{"preferredEfi":{"secureBoot":true}}}`
	compTPM            = `{"devices":{"preferredTPM":{"persistent":true}}}`
	compDedicatedIO    = `{"devices":{"preferredDiskDedicatedIoThread":true}}`
	compSataDisk       = `{"devices":{"preferredDiskBus":"sata"}}`
	compE1000e         = `{"devices":{"preferredInterfaceModel":"e1000e"}}`
	compE1000          = `{"devices":{"preferredInterfaceModel":"e1000"}}`
	compTabletUSB      = `{"devices":{"preferredAutoattachInputDevice":true}}`
	compGracePeriod    = `{"preferredTerminationGracePeriodSeconds":3600}`
	compSockets        = `{"cpu":{"preferredCPUTopology":"sockets"}}`
	compCores          = `{"cpu":{"preferredCPUTopology":"cores"}}`
	compAMD64          = `{"preferredArchitecture":"amd64","requirements":{"architecture":"amd64"}}`
	compVirtioTransit  = `{"devices":{"preferredUseVirtioTransitional":true}}`
	compHyperV         = `{"clock":{"preferredClockOffset":{"utc":{}},"preferredTimer":{"hpet":{"present":false},"pit":{"tickPolicy":"delay"},"rtc":{"tickPolicy":"catchup"},"hyperv":{}}},"features":{"preferredAcpi":{},"preferredApic":{},"preferredHyperv":{"relaxed":{},"vapic":{},"vpindex":{},"spinlocks":{"spinlocks":8191},"synic":{},"synictimer":{"direct":{}},"tlbflush":{},"frequencies":{},"reenlightenment":{},"ipi":{},"runtime":{},"reset":{}}}}`
	compWindowsVirtio  = `{"devices":{"preferredDiskBus":"virtio","preferredInterfaceModel":"virtio"}}`
	requirementsFormat = `{"requirements":{"cpu":{"guest":%d},"memory":{"guest":%q}}}`
)

var (
	linux   = []string{compVirtioDisk, compVirtioNet, compRng}
	windows = []string{compHyperV, compSockets, compSataDisk, compE1000e, compTabletUSB, compGracePeriod}
)

// preference is one OS preference: its components, minimum resources and
// catalogue metadata.
type preference struct {
	name, display, icon, tags string
	components                []string
	cpu                       uint32
	memory                    string
}

func with(base []string, more ...string) []string {
	return append(append([]string{}, base...), more...)
}

var catalogPreferences = []preference{
	{name: "linux", display: "Linux Guest", icon: "icon-linux", components: linux},
	{name: "linux.efi", display: "Linux EFI Guest", icon: "icon-linux", components: with(linux, compEFI)},
	{name: "linux.virtiotransitional", display: "Linux Virtio Transitional Guest", icon: "icon-linux", components: with(linux, compVirtioTransit)},
	{name: "legacy", display: "Legacy Guest", icon: "icon-linux", components: []string{compE1000, compSataDisk}},
	{name: "alpine", display: "Alpine", icon: "icon-alpine", tags: "hidden,kubevirt,alpine", components: linux, cpu: 1, memory: "512Mi"},
	{name: "cirros", display: "Cirros", icon: "icon-cirros", tags: "hidden,kubevirt,cirros", components: linux, cpu: 1, memory: "256Mi"},
	{name: "debian", display: "Debian", icon: "icon-debian", tags: "hidden,kubevirt,debian", components: with(linux, compEFI), cpu: 1, memory: "512Mi"},
	{name: "ubuntu", display: "Ubuntu", icon: "icon-ubuntu", tags: "hidden,kubevirt,ubuntu", components: linux, cpu: 1, memory: "2Gi"},
	{name: "fedora", display: "Fedora (amd64)", icon: "icon-fedora", tags: "hidden,kubevirt,fedora", components: with(linux, compAMD64, compSecureBoot), cpu: 1, memory: "2Gi"},
	{name: "centos.stream9", display: "CentOS Stream 9", icon: "icon-centos", tags: "hidden,kubevirt,centos", components: with(linux, compDedicatedIO), cpu: 1, memory: "1.5Gi"},
	{name: "centos.stream10", display: "CentOS Stream 10", icon: "icon-centos", tags: "hidden,kubevirt,centos", components: with(linux, compDedicatedIO), cpu: 1, memory: "1.5Gi"},
	{name: "rhel.8", display: "Red Hat Enterprise Linux 8", icon: "icon-rhel", tags: "hidden,kubevirt,rhel", components: linux, cpu: 1, memory: "1.5Gi"},
	{name: "rhel.9", display: "Red Hat Enterprise Linux 9 (amd64)", icon: "icon-rhel", tags: "hidden,kubevirt,rhel", components: with(linux, compAMD64, compDedicatedIO, compSecureBoot), cpu: 1, memory: "1.5Gi"},
	{name: "rhel.10", display: "Red Hat Enterprise Linux 10 (amd64)", icon: "icon-rhel", tags: "hidden,kubevirt,rhel", components: with(linux, compAMD64, compDedicatedIO, compEFI, compSecureBoot), cpu: 1, memory: "1.5Gi"},
	{name: "opensuse.leap", display: "OpenSUSE Leap", icon: "icon-opensuse", tags: "hidden,kubevirt,opensuse", components: linux, cpu: 1, memory: "2Gi"},
	{name: "opensuse.tumbleweed", display: "OpenSUSE Tumbleweed", icon: "icon-opensuse", tags: "hidden,kubevirt,opensuse", components: linux, cpu: 1, memory: "2Gi"},
	{name: "oraclelinux", display: "Oracle Linux", icon: "icon-oraclelinux", tags: "hidden,kubevirt,oraclelinux", components: with(linux, compEFI), cpu: 2, memory: "4Gi"},
	{name: "sles", display: "SUSE Linux Enterprise Server", icon: "icon-suse", tags: "hidden,kubevirt,sles", components: linux, cpu: 1, memory: "2Gi"},
	{name: "windows.10", display: "Microsoft Windows 10", icon: "icon-windows", tags: "hidden,kubevirt,windows", components: with(windows, compCores, compSecureBoot), cpu: 1, memory: "2Gi"},
	{name: "windows.10.virtio", display: "Microsoft Windows 10 (virtio)", icon: "icon-windows", tags: "hidden,kubevirt,windows", components: with(windows, compCores, compSecureBoot, compWindowsVirtio), cpu: 1, memory: "2Gi"},
	{name: "windows.11", display: "Microsoft Windows 11", icon: "icon-windows", tags: "hidden,kubevirt,windows", components: with(windows, compCores, compEFIPersisted, compTPM, compSecureBoot), cpu: 2, memory: "4Gi"},
	{name: "windows.11.virtio", display: "Microsoft Windows 11 (virtio)", icon: "icon-windows", tags: "hidden,kubevirt,windows", components: with(windows, compCores, compEFIPersisted, compTPM, compSecureBoot, compWindowsVirtio), cpu: 2, memory: "4Gi"},
	{name: "windows.2k16", display: "Microsoft Windows Server 2016", icon: "icon-windows", tags: "hidden,kubevirt,windows", components: with(windows, compSecureBoot), cpu: 1, memory: "2Gi"},
	{name: "windows.2k19", display: "Microsoft Windows Server 2019", icon: "icon-windows", tags: "hidden,kubevirt,windows", components: with(windows, compSecureBoot), cpu: 1, memory: "2Gi"},
	{name: "windows.2k22", display: "Microsoft Windows Server 2022", icon: "icon-windows", tags: "hidden,kubevirt,windows", components: with(windows, compEFIPersisted, compTPM, compSecureBoot), cpu: 1, memory: "2Gi"},
	{name: "windows.2k25", display: "Microsoft Windows Server 2025", icon: "icon-windows", tags: "hidden,kubevirt,windows", components: with(windows, compEFIPersisted, compTPM, compSecureBoot), cpu: 1, memory: "2Gi"},
}

// composeSpec merges the components, in order, into one preference spec.
func composeSpec(components []string) (instancetypev1beta1.VirtualMachinePreferenceSpec, error) {
	doc := []byte(`{}`)
	for _, c := range components {
		var err error
		if doc, err = jsonpatch.MergePatch(doc, []byte(c)); err != nil {
			return instancetypev1beta1.VirtualMachinePreferenceSpec{}, fmt.Errorf("merge component %s: %w", c, err)
		}
	}
	var spec instancetypev1beta1.VirtualMachinePreferenceSpec
	if err := json.Unmarshal(doc, &spec); err != nil {
		return spec, fmt.Errorf("decode preference: %w", err)
	}
	return spec, nil
}

// ClusterPreferences returns every common preference.
func ClusterPreferences() ([]*instancetypev1beta1.VirtualMachineClusterPreference, error) {
	var out []*instancetypev1beta1.VirtualMachineClusterPreference
	for _, p := range catalogPreferences {
		comps := p.components
		labels := map[string]string{LabelVendor: Vendor, LabelCIVersion: upstreamVersion, LabelManagedBy: ManagedBy}
		if p.cpu > 0 {
			comps = with(comps, fmt.Sprintf(requirementsFormat, p.cpu, p.memory))
			labels[LabelReqCPU], labels[LabelReqMemory] = strconv.Itoa(int(p.cpu)), p.memory
		}
		spec, err := composeSpec(comps)
		if err != nil {
			return nil, fmt.Errorf("preference %s: %w", p.name, err)
		}
		ann := map[string]string{AnnPrefDisplay: p.display, AnnPrefIcon: p.icon}
		if p.tags != "" {
			ann[AnnPrefTags] = p.tags
		}
		out = append(out, &instancetypev1beta1.VirtualMachineClusterPreference{
			TypeMeta:   metav1.TypeMeta{APIVersion: instancetypev1beta1.SchemeGroupVersion.String(), Kind: "VirtualMachineClusterPreference"},
			ObjectMeta: metav1.ObjectMeta{Name: p.name, Labels: labels, Annotations: ann},
			Spec:       spec,
		})
	}
	return out, nil
}
