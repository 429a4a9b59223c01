package bridge

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"syscall"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"
)

// Deleting a veth costs the kernel about 15 ms, nearly all of it spent after
// the device is gone: RTM_DELLINK unlists both ends (names free, ports off the
// bridge with their VLAN entries, RTM_DELLINK broadcast) under the RTNL lock,
// then the deleting task waits in rcu_barrier() before its syscall returns.
// Moving the link to another namespace instead waits in the same barrier, and
// a process cannot exit while one of its threads sits in that wait, so no
// thread of the plugin can make the call without the runtime waiting for it.
// The binary therefore hands the RTM_DELLINK to a helper process (itself,
// forked and executed directly, without os/exec) started before the rest of
// DEL's work, and answers as soon as the kernel has announced the link's
// removal. It does so only when no other DEL is handing off at that moment:
// concurrent deletions share the kernel's wait, so those delete in line. When DEL answers, the link no longer exists in any namespace;
// only the kernel's reclamation of its memory is still running, in the
// helper's syscall.

// unregisterEnv turns the plugin binary into the unregistration helper: its
// value is "<ifindex>" of the link to delete in the inherited netns.
const unregisterEnv = "NODEVIRT_BRIDGE_UNREGISTER"

// unregisterTimeout bounds the wait for the helper before DEL deletes the
// link itself.
const unregisterTimeout = 5 * time.Second

// IsUnregisterHelper reports whether the process was started as the helper.
func IsUnregisterHelper() bool { return os.Getenv(unregisterEnv) != "" }

// RunUnregisterHelper deletes the link named by the environment and returns
// the process exit code.
func RunUnregisterHelper() int {
	idx, err := strconv.Atoi(os.Getenv(unregisterEnv))
	if err != nil || idx <= 0 {
		return 2
	}
	err = netlink.LinkDel(&netlink.Device{LinkAttrs: netlink.LinkAttrs{Index: idx}})
	if err != nil && !errors.Is(err, syscall.ENODEV) {
		return 1
	}
	return 0
}

// linkRemover starts removing a host link by name and returns a function
// that waits until the link is gone; a missing link is success.
type linkRemover func(h *netlink.Handle, name string) (wait func() error)

// helperUnlessBusy hands the deletion to a helper process when no other DEL
// using this state directory is doing so at the moment, and otherwise
// deletes in line: with deletions running concurrently the kernel's wait is
// one barrier shared by all of them, while every extra process costs CPU
// the concurrent calls compete for.
func helperUnlessBusy(st store) linkRemover {
	return func(h *netlink.Handle, name string) func() error {
		unlock, ok := st.tryLock("unregister")
		if !ok {
			return removeInLine(h, name)
		}
		wait := startHelperRemoval(h, name)
		return func() error {
			defer unlock()
			return wait()
		}
	}
}

// removeInLine deletes the link in the calling thread (for callers that live
// on after the call, where the kernel's wait costs nothing but time).
func removeInLine(h *netlink.Handle, name string) func() error {
	err := deleteLink(h, name)
	return func() error { return err }
}

// startHelperRemoval hands the link's deletion to a helper process. Its wait
// returns once the kernel has removed the link, falling back to deleting it
// in line when the helper cannot start, fails, or does not act in time.
func startHelperRemoval(h *netlink.Handle, name string) func() error {
	l, err := linkByName(h, name)
	if err != nil || l == nil {
		return func() error { return err }
	}
	idx := l.Attrs().Index
	// Subscribe before the helper starts, so its RTM_DELLINK cannot be missed.
	sub, err := nl.Subscribe(unix.NETLINK_ROUTE, unix.RTNLGRP_LINK)
	if err != nil {
		return removeInLine(h, name)
	}
	fallback := func() error {
		sub.Close()
		return deleteLinkIndex(h, idx, name)
	}
	if err := sub.SetReceiveTimeout(&unix.Timeval{Usec: 20_000}); err != nil {
		return fallback
	}
	self, err := os.Executable()
	if err != nil {
		return fallback
	}
	// One P and no GC: the helper makes a single syscall, and every thread
	// its runtime would start costs CPU the next plugin call could use. No
	// files: the runtime puts /dev/null on its stdio.
	pid, err := syscall.ForkExec(self, []string{self}, &syscall.ProcAttr{
		Env: []string{unregisterEnv + "=" + strconv.Itoa(idx), "GOMAXPROCS=1", "GOGC=off"},
		Sys: &syscall.SysProcAttr{Setsid: true},
	})
	if err != nil {
		return fallback
	}
	return func() error {
		defer sub.Close()
		deadline := time.Now().Add(unregisterTimeout)
		for {
			gone, err := linkRemovedEvent(sub, idx)
			if gone {
				return nil
			}
			if err != nil {
				// Overflow or a broken socket: ask the kernel directly.
				if _, lerr := h.LinkByIndex(idx); lerr != nil {
					return nil
				}
			}
			// A helper that exited without our seeing the event (or that
			// failed) leaves whatever is left to be deleted here. One still
			// running when the plugin exits is reaped by its new parent.
			var ws unix.WaitStatus
			if wpid, _ := unix.Wait4(pid, &ws, unix.WNOHANG, nil); wpid == pid || time.Now().After(deadline) {
				return deleteLinkIndex(h, idx, name)
			}
		}
	}
}

// linkRemovedEvent reads one batch of link notifications and reports whether
// it announces the removal of link idx. A receive timeout is no error.
func linkRemovedEvent(sub *nl.NetlinkSocket, idx int) (bool, error) {
	msgs, _, err := sub.Receive()
	if err != nil {
		if errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EWOULDBLOCK) || errors.Is(err, unix.EINTR) {
			return false, nil
		}
		return false, fmt.Errorf("link notifications: %w", err)
	}
	for _, m := range msgs {
		if m.Header.Type != unix.RTM_DELLINK || len(m.Data) < unix.SizeofIfInfomsg {
			continue
		}
		if int(nl.DeserializeIfInfomsg(m.Data).Index) == idx {
			return true, nil
		}
	}
	return false, nil
}

// deleteLinkIndex deletes link idx if it still exists.
func deleteLinkIndex(h *netlink.Handle, idx int, name string) error {
	l, err := h.LinkByIndex(idx)
	if err != nil {
		var nf netlink.LinkNotFoundError
		if errors.As(err, &nf) || errors.Is(err, syscall.ENODEV) {
			return nil
		}
		return fmt.Errorf("look up link %s: %w", name, err)
	}
	if err := h.LinkDel(l); err != nil && !errors.Is(err, syscall.ENODEV) {
		return fmt.Errorf("delete link %s: %w", name, err)
	}
	return nil
}
