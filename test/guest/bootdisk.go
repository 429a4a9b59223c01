package guest

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// baseCmdline starts every boot disk's kernel command line: the serial
// console, and no_timer_check, since a TCG guest on a busy host can miss
// the kernel's IO-APIC timer check and panic at boot ("IO-APIC + timer
// doesn't work!"), as seen in a CI run of the e2e suite.
const baseCmdline = "console=ttyS0 no_timer_check"

// DiskSpec describes a BootDisk.
type DiskSpec struct {
	// SizeMiB is the disk's size; 0 means 64.
	SizeMiB int
	// Cmdline is appended to the kernel command line (baseCmdline).
	Cmdline string
	// Initramfs is the guest's initramfs; the zero Spec is the default guest.
	Initramfs Spec
}

// partitionOffset is where the single partition starts: 1 MiB, sector 2048.
const partitionOffset = 1 << 20

// BootDisk returns a raw disk image that boots the guest through the BIOS:
// an MBR with extlinux's boot code and one active ext2 partition at 1 MiB
// holding the kernel, the initramfs and extlinux.conf. It is what a VM
// imports and boots without a direct kernel boot.
//
// The image lives in the cache and is shared: do not write to it. Copy it,
// use it as a qcow2 backing file, or boot it with Disk.Snapshot. (libvirt
// also changes the owner of a domain's disk files: give it a copy.)
//
// Building needs root (a loop device and a mount).
func BootDisk(ctx context.Context, spec DiskSpec) (string, error) {
	if spec.SizeMiB == 0 {
		spec.SizeMiB = 64
	}
	if spec.SizeMiB < 16 {
		return "", fmt.Errorf("boot disk: %d MiB is too small, want at least 16", spec.SizeMiB)
	}
	vmlinuz, _, err := Kernel(ctx)
	if err != nil {
		return "", err
	}
	initrd, err := Initramfs(ctx, spec.Initramfs)
	if err != nil {
		return "", err
	}
	mbr, err := need("/usr/lib/syslinux/mbr/mbr.bin")
	if err != nil {
		return "", fmt.Errorf("boot disk: %w", err)
	}
	version, err := run(ctx, "", "extlinux", "--version")
	if err != nil {
		// extlinux --version exits 1 on some releases; its absence is what matters.
		if _, nerr := need("extlinux"); nerr != nil {
			return "", fmt.Errorf("boot disk: %w", nerr)
		}
	}
	k, sum := newKey()
	k.add("bootdisk", vmlinuz, initrd, fmt.Sprint(spec.SizeMiB), baseCmdline, spec.Cmdline, version)
	if err := k.addFile(mbr); err != nil {
		return "", fmt.Errorf("boot disk: %w", err)
	}
	c, err := openCache()
	if err != nil {
		return "", err
	}
	return c.build(ctx, "bootdisk-"+sum()+".raw", func(tmp string) error {
		return makeBootDisk(ctx, tmp, int64(spec.SizeMiB)<<20, vmlinuz, initrd, mbr, extlinuxConf(spec.Cmdline))
	})
}

func extlinuxConf(cmdline string) string {
	return fmt.Sprintf(`SERIAL 0 115200
DEFAULT nodevirt
PROMPT 0
LABEL nodevirt
  LINUX /boot/vmlinuz
  INITRD /boot/initrd.img
  APPEND %s
`, strings.TrimSpace(baseCmdline+" "+cmdline))
}

// makeBootDisk writes the image at path. Partition devices of loop devices
// do not appear without udev, so the file system is made on a loop device
// that starts at the partition's offset.
func makeBootDisk(ctx context.Context, path string, size int64, vmlinuz, initrd, mbr, conf string) (err error) {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := f.Truncate(size); err != nil {
		f.Close()
		return err
	}
	if err := writePartitionTable(f, size); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}

	// Undo what was set up, in reverse order, whatever happens.
	var revert []func()
	defer func() {
		for i := len(revert) - 1; i >= 0; i-- {
			revert[i]()
		}
	}()
	out, err := run(ctx, "", "losetup", "--find", "--show",
		"--offset", fmt.Sprint(partitionOffset), "--sizelimit", fmt.Sprint(size-partitionOffset), path)
	if err != nil {
		return err
	}
	loop := strings.TrimSpace(out)
	revert = append(revert, func() { detachLoop(loop) })
	if _, err := run(ctx, "", "mkfs.ext2", "-q", "-F", "-L", "nodevirt-boot", loop); err != nil {
		return err
	}
	mnt, err := os.MkdirTemp("", "nodevirt-bootdisk-")
	if err != nil {
		return err
	}
	revert = append(revert, func() { os.Remove(mnt) })
	if _, err := run(ctx, "", "mount", "-t", "ext2", loop, mnt); err != nil {
		return err
	}
	mounted := true
	revert = append(revert, func() {
		if mounted {
			_ = unmount(mnt)
		}
	})
	dir := filepath.Join(mnt, "boot", "extlinux")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	if err := copyFile(vmlinuz, filepath.Join(mnt, "boot", "vmlinuz")); err != nil {
		return err
	}
	if err := copyFile(initrd, filepath.Join(mnt, "boot", "initrd.img")); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "extlinux.conf"), []byte(conf), 0o644); err != nil {
		return err
	}
	if _, err := run(ctx, "", "extlinux", "--install", dir); err != nil {
		return err
	}
	if err := unmount(mnt); err != nil {
		return err
	}
	mounted = false

	code, err := os.ReadFile(mbr)
	if err != nil {
		return err
	}
	if len(code) > 440 {
		return fmt.Errorf("%s is %d bytes, more than the 440 of boot code an MBR holds", mbr, len(code))
	}
	f, err = os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	if _, err := f.WriteAt(code, 0); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// writePartitionTable writes an MBR partition table with one active Linux
// partition from partitionOffset to the end of the disk.
func writePartitionTable(w io.WriterAt, size int64) error {
	const sector = 512
	entry := make([]byte, 16)
	entry[0] = 0x80                            // active: the MBR code boots it
	copy(entry[1:4], []byte{0xfe, 0xff, 0xff}) // CHS start: use LBA
	entry[4] = 0x83                            // Linux
	copy(entry[5:8], []byte{0xfe, 0xff, 0xff}) // CHS end: use LBA
	binary.LittleEndian.PutUint32(entry[8:12], partitionOffset/sector)
	binary.LittleEndian.PutUint32(entry[12:16], uint32((size-partitionOffset)/sector))
	if _, err := w.WriteAt(entry, 446); err != nil {
		return err
	}
	_, err := w.WriteAt([]byte{0x55, 0xaa}, 510)
	return err
}

func unmount(dir string) error {
	_, err := run(context.Background(), "", "umount", dir)
	return err
}

// detachLoop detaches a loop device; the kernel may still hold it for a
// moment after the unmount.
func detachLoop(dev string) {
	for range 10 {
		if _, err := run(context.Background(), "", "losetup", "--detach", dev); err == nil {
			return
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func copyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.Create(dst)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// QCOW2 returns a qcow2 copy of a raw image, made with qemu-img and cached
// (keyed by the raw file's path, size and modification time).
func QCOW2(ctx context.Context, raw string) (string, error) {
	abs, err := filepath.Abs(raw)
	if err != nil {
		return "", fmt.Errorf("qcow2 of %s: %w", raw, err)
	}
	st, err := os.Stat(abs)
	if err != nil {
		return "", fmt.Errorf("qcow2 of %s: %w", raw, err)
	}
	k, sum := newKey()
	k.add("qcow2", abs, fmt.Sprint(st.Size()), st.ModTime().UTC().Format(time.RFC3339Nano))
	c, err := openCache()
	if err != nil {
		return "", err
	}
	base := strings.TrimSuffix(filepath.Base(abs), filepath.Ext(abs))
	return c.build(ctx, base+"-"+sum()+".qcow2", func(tmp string) error {
		_, err := run(ctx, "", "qemu-img", "convert", "-f", "raw", "-O", "qcow2", abs, tmp)
		return err
	})
}
