package csi

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Loop device flags (linux/loop.h); x/sys/unix does not export them.
const (
	loFlagsReadOnly  = 1
	loFlagsAutoclear = 4
)

// loopMajor is the block major number of loop devices.
const loopMajor = 7

// attachLoop binds image to a free loop device and returns the device path.
// The device stays until detachLoop.
func attachLoop(image string, readOnly bool) (string, error) {
	f, err := openLoop(image, readOnly, false)
	if err != nil {
		return "", err
	}
	defer f.Close()
	return f.Name(), nil
}

// openLoop binds image to a free loop device and returns it open. With
// autoclear the kernel detaches the device at its last close, so the caller
// keeps it open until something else (a mount) holds it.
func openLoop(image string, readOnly, autoclear bool) (*os.File, error) {
	flags := os.O_RDWR
	if readOnly {
		flags = os.O_RDONLY
	}
	backing, err := os.OpenFile(image, flags|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open loop backing file: %w", err)
	}
	defer backing.Close()

	ctl, err := os.OpenFile("/dev/loop-control", os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open loop-control: %w", err)
	}
	defer ctl.Close()

	var cfg unix.LoopConfig
	cfg.Fd = uint32(backing.Fd())
	if readOnly {
		cfg.Info.Flags |= loFlagsReadOnly
	}
	if autoclear {
		cfg.Info.Flags |= loFlagsAutoclear
	}
	copy(cfg.Info.File_name[:len(cfg.Info.File_name)-1], image)

	// Another process may grab the same free device between GET_FREE and
	// CONFIGURE; the loser sees EBUSY and asks again.
	for attempt := 0; attempt < 64; attempt++ {
		n, err := unix.IoctlRetInt(int(ctl.Fd()), unix.LOOP_CTL_GET_FREE)
		if err != nil {
			return nil, fmt.Errorf("find free loop device: %w", err)
		}
		dev := "/dev/loop" + strconv.Itoa(n)
		f, err := os.OpenFile(dev, flags|unix.O_CLOEXEC, 0)
		if err != nil {
			return nil, fmt.Errorf("open %s: %w", dev, err)
		}
		err = unix.IoctlLoopConfigure(int(f.Fd()), &cfg)
		if err != nil {
			f.Close()
		}
		if errors.Is(err, unix.EBUSY) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("configure %s: %w", dev, err)
		}
		return f, nil
	}
	return nil, fmt.Errorf("attach %s: no free loop device after retries", image)
}

// detachLoop unbinds dev. A device that is already free is not an error.
func detachLoop(dev string) error {
	f, err := os.OpenFile(dev, os.O_RDONLY|unix.O_CLOEXEC, 0)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("open %s: %w", dev, err)
	}
	defer f.Close()
	if err := unix.IoctlSetInt(int(f.Fd()), unix.LOOP_CLR_FD, 0); err != nil && !errors.Is(err, unix.ENXIO) {
		return fmt.Errorf("detach %s: %w", dev, err)
	}
	return nil
}

// refreshLoopCapacity makes dev pick up a new size of its backing file.
func refreshLoopCapacity(dev string) error {
	f, err := os.OpenFile(dev, os.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open %s: %w", dev, err)
	}
	defer f.Close()
	if err := unix.IoctlSetInt(int(f.Fd()), unix.LOOP_SET_CAPACITY, 0); err != nil {
		return fmt.Errorf("set capacity of %s: %w", dev, err)
	}
	return nil
}

// loopDevice describes one attached loop device.
type loopDevice struct {
	Path     string
	ReadOnly bool
}

// loopsByBacking lists attached loop devices by their backing file.
func loopsByBacking() (map[string][]loopDevice, error) {
	entries, err := filepath.Glob("/sys/block/loop*/loop/backing_file")
	if err != nil {
		return nil, fmt.Errorf("list loop devices: %w", err)
	}
	out := map[string][]loopDevice{}
	for _, e := range entries {
		b, err := os.ReadFile(e)
		if err != nil {
			continue // detached meanwhile
		}
		sysDir := filepath.Dir(filepath.Dir(e))
		ro, _ := os.ReadFile(filepath.Join(sysDir, "ro"))
		backing := strings.TrimSuffix(strings.TrimSpace(string(b)), " (deleted)")
		out[backing] = append(out[backing], loopDevice{
			Path:     "/dev/" + filepath.Base(sysDir),
			ReadOnly: strings.TrimSpace(string(ro)) == "1",
		})
	}
	return out, nil
}

// loopDeviceOf returns the loop device holding the filesystem mounted at dir.
func loopDeviceOf(dir string) (string, error) {
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		return "", fmt.Errorf("stat %s: %w", dir, err)
	}
	if unix.Major(st.Dev) != loopMajor {
		return "", fmt.Errorf("%s is not on a loop device", dir)
	}
	link := fmt.Sprintf("/sys/dev/block/%d:%d", unix.Major(st.Dev), unix.Minor(st.Dev))
	target, err := os.Readlink(link)
	if err != nil {
		return "", fmt.Errorf("resolve device of %s: %w", dir, err)
	}
	return "/dev/" + filepath.Base(target), nil
}
