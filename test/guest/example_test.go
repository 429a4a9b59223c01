package guest_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/nodevirt/nodevirt/test/guest"
)

// A guest booted from the extlinux disk, with a NoCloud seed, a NIC with a
// known MAC, a command typed on its console and a graceful ACPI shutdown.
func ExampleRun() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	disk, err := guest.BootDisk(ctx, guest.DiskSpec{})
	if err != nil {
		log.Fatal(err)
	}
	seed, err := guest.NoCloudSeed("/tmp/example-seed", "#!/bin/sh\necho hi from user-data\n", "", "")
	if err != nil {
		log.Fatal(err)
	}
	vm, err := guest.Run(ctx, guest.RunSpec{
		Disks: []guest.Disk{{Path: disk, Snapshot: true}, {Path: seed, CDROM: true}},
		NICs:  []guest.NIC{{MAC: "52:54:00:00:00:01"}},
	})
	if err != nil {
		log.Fatal(err)
	}
	defer vm.Kill()
	if _, err := vm.Expect(ctx, "NODEVIRT-GUEST-BOOTED"); err != nil {
		log.Fatal(err)
	}
	nic, _ := vm.Expect(ctx, "NODEVIRT-NIC eth0") // "NODEVIRT-NIC eth0 52:54:00:00:00:01"
	out, err := vm.Command(ctx, "uname -r")
	fmt.Println(nic, out, err)
	if err := vm.Powerdown(); err != nil {
		log.Fatal(err)
	}
	if err := vm.Wait(ctx); err != nil {
		log.Fatal(err)
	}
}

// A guest for an in-guest network test: iproute2 and the VLAN modules added,
// a script run at boot, booted directly from kernel and initramfs.
func ExampleInitramfs() {
	ctx := context.Background()
	vmlinuz, _, err := guest.Kernel(ctx)
	if err != nil {
		log.Fatal(err)
	}
	initrd, err := guest.Initramfs(ctx, guest.Spec{
		Files:   map[string]string{"/usr/sbin/ip": "/usr/sbin/ip", "/usr/sbin/bridge": "/usr/sbin/bridge"},
		Modules: []string{"bridge", "8021q", "veth"},
		Init:    "/usr/sbin/ip link add br0 type bridge vlan_filtering 1 && echo VLAN-OK",
	})
	if err != nil {
		log.Fatal(err)
	}
	vm, err := guest.Run(ctx, guest.RunSpec{Kernel: vmlinuz, Initramfs: initrd})
	if err != nil {
		log.Fatal(err)
	}
	defer vm.Kill()
	if _, err := vm.Expect(ctx, "VLAN-OK"); err != nil {
		log.Fatal(err)
	}
}
