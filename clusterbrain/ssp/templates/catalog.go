// Package templates is the common-templates catalogue of the SSP role: the
// OS × workload × flavor set of template.openshift.io/v1 Templates that
// OpenShift Virtualization deploys for amd64, written here as data (the
// facts of kubevirt/common-templates v0.35: OS labels, memory and CPU per
// flavor, disk sizes, boot sources, validations), rendered into Template
// objects, and processed as OpenShift's template processor does.
package templates

// Version is the common-templates release these facts follow; it labels
// every Template (template.kubevirt.io/version) and the VMs made from them.
const Version = "v0.35.0"

// Architecture is the only architecture the catalogue covers.
const Architecture = "amd64"

// Workloads.
const (
	Server          = "server"
	Desktop         = "desktop"
	HighPerformance = "highperformance"
)

// Flavor is one size of an OS's templates.
type Flavor struct {
	Name     string // tiny, small, medium, large
	Workload string
	Memory   string // guest memory
	Sockets  int
	// Default marks the OS's default variant
	// (template.kubevirt.io/default-os-variant).
	Default bool
}

// Firmware of an OS's VMs.
type Firmware struct {
	EFI, SecureBoot, Persistent bool
	// TPM adds a persistent vTPM.
	TPM bool
}

// OS is one family of templates.
type OS struct {
	// Name prefixes the templates' names and is vm.kubevirt.io/os.
	Name        string
	DisplayName string
	// Labels are the osinfo short ids the templates carry as
	// os.template.kubevirt.io/<id>; NameOS is their readable name.
	Labels []string
	NameOS string
	Tags   string
	Icon   string
	// DataSource is DATA_SOURCE_NAME's default (the golden image).
	DataSource string
	DiskSize   string
	// MinMemory is the minimal-required-memory validation, in bytes.
	MinMemory int64
	// Windows selects the Windows domain shape (Hyper-V enlightenments,
	// no cloud-init, validations of disk buses).
	Windows bool
	// CloudUser is the Linux cloud-init user.
	CloudUser string
	// NameFrom is the NAME parameter's generator expression.
	NameFrom string
	// Cores per socket; DiskBus and NICModel of the Windows shapes.
	Cores    int
	DiskBus  string
	NICModel string
	Firmware Firmware
	// MinCores adds a minimal-required-cores validation.
	MinCores int
	// Containerdisks and Images are the template.kubevirt.io/containerdisks
	// and template.kubevirt.io/images hints.
	Containerdisks []string
	Deprecated     bool
	// Transitional asks for virtio-transitional devices (old guests).
	Transitional bool
	Flavors      []Flavor
}

// matrix is the flavor table shared by most Linux families: every size in
// every workload, small server the default.
func matrix(tiny string, workloads ...string) []Flavor {
	var out []Flavor
	for _, s := range []struct {
		name, mem string
		sockets   int
	}{{"tiny", tiny, 1}, {"small", "2Gi", 1}, {"medium", "4Gi", 1}, {"large", "8Gi", 2}} {
		if s.mem == "" {
			continue
		}
		for _, w := range workloads {
			out = append(out, Flavor{Name: s.name, Workload: w, Memory: s.mem, Sockets: s.sockets,
				Default: s.name == "small" && w == Server})
		}
	}
	return out
}

// windowsMatrix is the medium and large sizes of the given workloads, the
// first workload's medium the default.
func windowsMatrix(workloads ...string) []Flavor {
	var out []Flavor
	for _, s := range []struct {
		name, mem string
		sockets   int
	}{{"medium", "4Gi", 1}, {"large", "8Gi", 2}} {
		for _, w := range workloads {
			out = append(out, Flavor{Name: s.name, Workload: w, Memory: s.mem, Sockets: s.sockets,
				Default: s.name == "medium" && w == workloads[0]})
		}
	}
	return out
}

func seq(prefix string, from, to int) []string {
	var out []string
	for i := from; i <= to; i++ {
		out = append(out, prefix+itoa(i))
	}
	return out
}

func itoa(i int) string {
	if i < 10 {
		return string(rune('0' + i))
	}
	return itoa(i/10) + string(rune('0'+i%10))
}

const (
	gi       = int64(1) << 30
	mi       = int64(1) << 20
	linuxTag = "hidden,kubevirt,virtualmachine,linux,"
	winTag   = "hidden,kubevirt,virtualmachine,windows"
	linuxGen = "-[a-z0-9]{16}"
)

// Catalog returns the OS families of the amd64 common templates.
func Catalog() []OS {
	all := []string{Server, Desktop, HighPerformance}
	efi := Firmware{EFI: true}
	return []OS{
		{Name: "centos-stream9", DisplayName: "CentOS Stream 9 VM", Labels: []string{"centos-stream9"}, NameOS: "CentOS Stream 9 or higher",
			Tags: linuxTag + "centosstream", Icon: "centos", DataSource: "centos-stream9", DiskSize: "30Gi", MinMemory: 1536 * mi,
			CloudUser: "centos", Containerdisks: []string{"quay.io/containerdisks/centos-stream:9"}, Flavors: matrix("1.5Gi", Server, Desktop)},
		// CentOS Stream 10 and RHEL 10 follow their 9 siblings' shape
		// (the boot sources HCO imports name them); see the SSP notes.
		{Name: "centos-stream10", DisplayName: "CentOS Stream 10 VM", Labels: []string{"centos-stream10"}, NameOS: "CentOS Stream 10 or higher",
			Tags: linuxTag + "centosstream", Icon: "centos", DataSource: "centos-stream10", DiskSize: "30Gi", MinMemory: 1536 * mi,
			CloudUser: "centos", Firmware: efi, Containerdisks: []string{"quay.io/containerdisks/centos-stream:10"}, Flavors: matrix("1.5Gi", Server, Desktop)},
		{Name: "centos6", DisplayName: "CentOS 6 VM", Labels: seq("centos6.", 0, 10), NameOS: "CentOS 6.0 or higher",
			Tags: linuxTag + "centos", Icon: "centos", DataSource: "centos6", DiskSize: "30Gi", MinMemory: 512 * mi,
			CloudUser: "centos", Deprecated: true, Transitional: true, Flavors: matrix("1Gi", Server)},
		{Name: "fedora", DisplayName: "Fedora VM", Labels: []string{"fedora43"}, NameOS: "Fedora Linux 43 or higher",
			Tags: "hidden,kubevirt,virtualmachine,fedora", Icon: "fedora", DataSource: "fedora", DiskSize: "30Gi", MinMemory: 2 * gi,
			CloudUser: "fedora", Firmware: efi, Containerdisks: []string{"quay.io/containerdisks/fedora:latest", "quay.io/containerdisks/fedora:43"},
			Flavors: matrix("", all...)},
		{Name: "opensuse", DisplayName: "openSUSE Leap 15.5+ VM", Labels: []string{"opensuse15.5", "opensuse15.6", "opensuse16.0"}, NameOS: "openSUSE Leap 15.5 or higher",
			Tags: linuxTag + "opensuse", Icon: "opensuse", DataSource: "opensuse", DiskSize: "30Gi", MinMemory: gi,
			CloudUser: "opensuse", Flavors: matrix("", Server)},
		{Name: "rhel7", DisplayName: "Red Hat Enterprise Linux 7 VM", Labels: seq("rhel7.", 0, 9), NameOS: "Red Hat Enterprise Linux 7.0 or higher",
			Tags: linuxTag + "rhel", Icon: "rhel", DataSource: "rhel7", DiskSize: "30Gi", MinMemory: gi,
			CloudUser: "cloud-user", Flavors: matrix("1Gi", all...)},
		{Name: "rhel8", DisplayName: "Red Hat Enterprise Linux 8 VM", Labels: seq("rhel8.", 0, 10), NameOS: "Red Hat Enterprise Linux 8.0 or higher",
			Tags: linuxTag + "rhel", Icon: "rhel", DataSource: "rhel8", DiskSize: "30Gi", MinMemory: 1536 * mi,
			CloudUser: "cloud-user", Containerdisks: []string{"registry.redhat.io/rhel8/rhel-guest-image"}, Flavors: matrix("1.5Gi", all...)},
		{Name: "rhel9", DisplayName: "Red Hat Enterprise Linux 9 VM", Labels: seq("rhel9.", 0, 6), NameOS: "Red Hat Enterprise Linux 9.0 or higher",
			Tags: linuxTag + "rhel", Icon: "rhel", DataSource: "rhel9", DiskSize: "30Gi", MinMemory: 1536 * mi,
			CloudUser: "cloud-user", Firmware: efi, Containerdisks: []string{"registry.redhat.io/rhel9/rhel-guest-image"}, Flavors: matrix("1.5Gi", all...)},
		{Name: "rhel10", DisplayName: "Red Hat Enterprise Linux 10 VM", Labels: []string{"rhel10.0"}, NameOS: "Red Hat Enterprise Linux 10.0 or higher",
			Tags: linuxTag + "rhel", Icon: "rhel", DataSource: "rhel10", DiskSize: "30Gi", MinMemory: 1536 * mi,
			CloudUser: "cloud-user", Firmware: efi, Flavors: matrix("1.5Gi", all...)},
		{Name: "ubuntu", DisplayName: "Ubuntu 18.04+ VM", Labels: []string{"ubuntu18.04", "ubuntu20.04", "ubuntu22.04", "ubuntu24.04"}, NameOS: "Ubuntu 18.04 or higher",
			Tags: "hidden,kubevirt,virtualmachine,ubuntu", Icon: "ubuntu", DataSource: "ubuntu", DiskSize: "30Gi", MinMemory: 2 * gi,
			CloudUser: "ubuntu", Containerdisks: []string{"quay.io/containerdisks/ubuntu:22.04"}, Flavors: ubuntuMatrix()},
		windows("windows10", "Microsoft Windows 10", "win10", "win10", "windows10", "60Gi", 2*gi, 1, "sata", "e1000e",
			Firmware{EFI: true, SecureBoot: true}, 0, Desktop, HighPerformance),
		windows("windows11", "Microsoft Windows 11", "win11", "win11", "windows11", "64Gi", 4*gi, 2, "sata", "e1000e",
			Firmware{EFI: true, SecureBoot: true, Persistent: true, TPM: true}, 2, Desktop, HighPerformance),
		windows("windows2k16", "Microsoft Windows Server 2016", "win2k16", "win2k16", "windows2016", "60Gi", 512*mi, 1, "virtio", "virtio",
			Firmware{EFI: true, SecureBoot: true}, 0, Server, HighPerformance),
		windows("windows2k19", "Microsoft Windows Server 2019", "win2k19", "win2k19", "windows2019", "60Gi", 512*mi, 1, "virtio", "virtio",
			Firmware{EFI: true, SecureBoot: true}, 0, Server, HighPerformance),
		windows("windows2k22", "Microsoft Windows Server 2022", "win2k22", "win2k22", "windows2022", "60Gi", 512*mi, 1, "virtio", "virtio",
			Firmware{EFI: true, SecureBoot: true, Persistent: true, TPM: true}, 0, Server, HighPerformance),
		windows("windows2k25", "Microsoft Windows Server 2025", "win2k25", "win2k25", "windows2025", "64Gi", 512*mi, 1, "virtio", "virtio",
			Firmware{EFI: true, SecureBoot: true, Persistent: true, TPM: true}, 0, Server, HighPerformance),
	}
}

func ubuntuMatrix() []Flavor {
	var out []Flavor
	for _, s := range []struct {
		name, mem string
		sockets   int
	}{{"small", "3Gi", 1}, {"medium", "4Gi", 1}, {"large", "8Gi", 2}} {
		for _, w := range []string{Server, Desktop} {
			out = append(out, Flavor{Name: s.name, Workload: w, Memory: s.mem, Sockets: s.sockets, Default: s.name == "small" && w == Server})
		}
	}
	return out
}

func windows(name, display, label, dataSource, namePrefix, disk string, minMem int64, cores int, bus, nic string, fw Firmware, minCores int, workloads ...string) OS {
	return OS{Name: name, DisplayName: display + " VM", Labels: []string{label}, NameOS: display, Tags: winTag, Icon: "windows",
		DataSource: dataSource, DiskSize: disk, MinMemory: minMem, Windows: true, NameFrom: namePrefix + "-[a-z0-9]{6}",
		Cores: cores, DiskBus: bus, NICModel: nic, Firmware: fw, MinCores: minCores, Flavors: windowsMatrix(workloads...)}
}
