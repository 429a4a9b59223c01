// Command nodevirt-guest builds the test guests of package
// github.com/nodevirt/nodevirt/test/guest from the command line, for
// Makefiles and the demo. It prints the paths of what it built.
//
//	nodevirt-guest requirements                  Debian packages needed, one a line
//	nodevirt-guest kernel                        kernel image and modules directory
//	nodevirt-guest initramfs [-guest-agent]      the default guest's initramfs
//	nodevirt-guest bootdisk [-size MiB] [-cmdline S] [-format raw|qcow2] [-guest-agent]
//
// -guest-agent adds Debian's QEMU guest agent (package qemu-guest-agent),
// so that the guest's VMI gets AgentConnected and virtctl guestosinfo,
// userlist and fslist answer.
//
// Artefacts are cached in $NODEVIRT_GUEST_CACHE (default /var/cache/nodevirt/guest).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/nodevirt/nodevirt/test/guest"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "nodevirt-guest:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string) error {
	if len(args) == 0 {
		return fmt.Errorf("usage: nodevirt-guest requirements|kernel|initramfs|bootdisk [flags]")
	}
	switch args[0] {
	case "requirements":
		fmt.Println(strings.Join(guest.Requirements(), "\n"))
	case "kernel":
		vmlinuz, modules, err := guest.Kernel(ctx)
		if err != nil {
			return err
		}
		fmt.Println(vmlinuz)
		fmt.Println(modules)
	case "initramfs":
		fs := flag.NewFlagSet("initramfs", flag.ContinueOnError)
		agent := fs.Bool("guest-agent", false, "add the QEMU guest agent")
		if err := fs.Parse(args[1:]); err != nil {
			return err
		}
		p, err := guest.Initramfs(ctx, guest.Spec{GuestAgent: *agent})
		if err != nil {
			return err
		}
		fmt.Println(p)
	case "bootdisk":
		fs := flag.NewFlagSet("bootdisk", flag.ContinueOnError)
		size := fs.Int("size", 64, "disk size in MiB")
		cmdline := fs.String("cmdline", "", "extra kernel command line")
		format := fs.String("format", "raw", "raw or qcow2")
		agent := fs.Bool("guest-agent", false, "add the QEMU guest agent")
		if err := fs.Parse(args[1:]); err != nil {
			return err
		}
		p, err := guest.BootDisk(ctx, guest.DiskSpec{SizeMiB: *size, Cmdline: *cmdline,
			Initramfs: guest.Spec{GuestAgent: *agent}})
		if err != nil {
			return err
		}
		switch *format {
		case "raw":
		case "qcow2":
			if p, err = guest.QCOW2(ctx, p); err != nil {
				return err
			}
		default:
			return fmt.Errorf("bootdisk: unknown format %q", *format)
		}
		fmt.Println(p)
	default:
		return fmt.Errorf("unknown command %q", args[0])
	}
	return nil
}
