// Package kvm tells whether this host can run guests with KVM. A /dev/kvm
// that opens is not enough (nested or special hosts expose one on which guests
// hang), so Probe also runs a one-instruction guest and waits for its exit.
package kvm

import (
	"errors"
	"fmt"
	"os"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// ioctl numbers from linux/kvm.h.
const (
	kvmGetAPIVersion       = 0xAE00
	kvmCreateVM            = 0xAE01
	kvmGetVcpuMmapSize     = 0xAE04
	kvmCreateVcpu          = 0xAE41
	kvmSetUserMemoryRegion = 0x4020AE46
	kvmRun                 = 0xAE80
	kvmGetSregs            = 0x8138AE83
	kvmSetSregs            = 0x4138AE84
	kvmSetRegs             = 0x4090AE82
	kvmExitHlt             = 5
)

type userspaceMemoryRegion struct {
	slot          uint32
	flags         uint32
	guestPhysAddr uint64
	memorySize    uint64
	userspaceAddr uint64
}

// Result says how guests will run here.
type Result struct {
	Usable bool
	Reason string
}

// Probe opens dev (normally /dev/kvm), creates a VM whose only instruction
// is HLT and runs it; KVM is usable when the HLT exit arrives within timeout.
func Probe(dev string, timeout time.Duration) Result {
	done := make(chan Result, 1)
	go func() { done <- probe(dev) }()
	select {
	case r := <-done:
		return r
	case <-time.After(timeout):
		// The vCPU thread stays stuck in the kernel; the process exits or
		// lives with one blocked thread, which is the cost of asking.
		return Result{Reason: fmt.Sprintf("a test guest on %s did not halt within %s", dev, timeout)}
	}
}

func probe(dev string) Result {
	fd, err := unix.Open(dev, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return Result{Reason: fmt.Sprintf("open %s: %v", dev, err)}
	}
	defer unix.Close(fd)
	v, err := ioctl(fd, kvmGetAPIVersion, 0)
	if err != nil || v != 12 {
		return Result{Reason: fmt.Sprintf("%s: unexpected KVM API version %d (%v)", dev, v, err)}
	}
	vm, err := ioctl(fd, kvmCreateVM, 0)
	if err != nil {
		return Result{Reason: fmt.Sprintf("create vm: %v", err)}
	}
	defer unix.Close(int(vm))
	mem, err := unix.Mmap(-1, 0, 0x1000, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_ANONYMOUS)
	if err != nil {
		return Result{Reason: fmt.Sprintf("guest memory: %v", err)}
	}
	defer unix.Munmap(mem)
	mem[0] = 0xf4 // hlt
	region := userspaceMemoryRegion{memorySize: 0x1000, userspaceAddr: uint64(uintptr(unsafe.Pointer(&mem[0])))}
	if _, err := ioctl(int(vm), kvmSetUserMemoryRegion, uintptr(unsafe.Pointer(&region))); err != nil {
		return Result{Reason: fmt.Sprintf("set memory region: %v", err)}
	}
	vcpu, err := ioctl(int(vm), kvmCreateVcpu, 0)
	if err != nil {
		return Result{Reason: fmt.Sprintf("create vcpu: %v", err)}
	}
	defer unix.Close(int(vcpu))
	size, err := ioctl(fd, kvmGetVcpuMmapSize, 0)
	if err != nil {
		return Result{Reason: fmt.Sprintf("vcpu mmap size: %v", err)}
	}
	run, err := unix.Mmap(int(vcpu), 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return Result{Reason: fmt.Sprintf("map vcpu: %v", err)}
	}
	defer unix.Munmap(run)
	// Real mode, code segment at 0, instruction pointer at 0.
	sregs := make([]byte, 312)
	if _, err := ioctl(int(vcpu), kvmGetSregs, uintptr(unsafe.Pointer(&sregs[0]))); err != nil {
		return Result{Reason: fmt.Sprintf("get sregs: %v", err)}
	}
	// struct kvm_segment cs is the first field: base u64, limit u32, selector u16.
	for i := 0; i < 8; i++ {
		sregs[i] = 0
	}
	sregs[12], sregs[13] = 0, 0
	if _, err := ioctl(int(vcpu), kvmSetSregs, uintptr(unsafe.Pointer(&sregs[0]))); err != nil {
		return Result{Reason: fmt.Sprintf("set sregs: %v", err)}
	}
	regs := make([]uint64, 18) // rax..r15, rip, rflags
	regs[16] = 0               // rip
	regs[17] = 0x2             // rflags reserved bit
	if _, err := ioctl(int(vcpu), kvmSetRegs, uintptr(unsafe.Pointer(&regs[0]))); err != nil {
		return Result{Reason: fmt.Sprintf("set regs: %v", err)}
	}
	if _, err := ioctl(int(vcpu), kvmRun, 0); err != nil {
		return Result{Reason: fmt.Sprintf("run test guest: %v", err)}
	}
	exit := *(*uint32)(unsafe.Pointer(&run[8]))
	if exit != kvmExitHlt {
		return Result{Reason: fmt.Sprintf("test guest exited with reason %d, want hlt", exit)}
	}
	return Result{Usable: true, Reason: "test guest halted under KVM"}
}

func ioctl(fd int, req, arg uintptr) (uintptr, error) {
	r, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), req, arg)
	if errno != 0 {
		return r, errno
	}
	return r, nil
}

// ErrNoDevice is returned when the host has no KVM device at all.
var ErrNoDevice = errors.New("no kvm device")

// Present reports whether dev exists.
func Present(dev string) bool {
	_, err := os.Stat(dev)
	return err == nil
}
