package e2e

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"libvirt.org/go/libvirtxml"
)

// What the suite looks at on the host, as an administrator would: libvirt
// domains through virsh, QEMU's pid file, the serial log file.

const libvirtURI = "qemu:///system"

func virsh(args ...string) (string, error) {
	out, err := exec.Command("virsh", append([]string{"-c", libvirtURI}, args...)...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("virsh %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return string(out), nil
}

// domainName is how nodevirt names a VMI's domain, as KubeVirt does.
func domainName(ns, name string) string { return ns + "_" + name }

// domainState is virsh domstate of the VMI's domain, "" when there is none.
func domainState(ns, name string) string {
	out, err := virsh("domstate", domainName(ns, name))
	if err != nil {
		return ""
	}
	return strings.TrimSpace(out)
}

// domainXML is the VMI's live domain definition.
func domainXML(ns, name string) (*libvirtxml.Domain, error) {
	out, err := virsh("dumpxml", domainName(ns, name))
	if err != nil {
		return nil, err
	}
	dom := &libvirtxml.Domain{}
	if err := dom.Unmarshal(out); err != nil {
		return nil, fmt.Errorf("parse domain %s: %w", domainName(ns, name), err)
	}
	return dom, nil
}

// qemuPID is the pid of the VMI's QEMU process (libvirtd's pid file), 0
// when it does not run.
func qemuPID(ns, name string) int {
	data, err := os.ReadFile(filepath.Join("/run/libvirt/qemu", domainName(ns, name)+".pid"))
	if err != nil {
		return 0
	}
	return livePID(data)
}

// livePID is the pid a pid file's content names if that process is alive
// (not a zombie), else 0.
func livePID(data []byte) int {
	pid, err := strconv.Atoi(strings.TrimSpace(string(data)))
	if err != nil || !processAlive(pid) {
		return 0
	}
	return pid
}

func processAlive(pid int) bool {
	if pid <= 0 || syscall.Kill(pid, 0) != nil {
		return false
	}
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	i := strings.LastIndexByte(string(stat), ')')
	return i < 0 || i+2 >= len(stat) || stat[i+2] != 'Z'
}

// removeDomains destroys and undefines the run's domains that are left.
func (e *env) removeDomains() error {
	out, err := virsh("list", "--all", "--name")
	if err != nil {
		return nil // no libvirtd, nothing to remove
	}
	var errs []error
	for _, name := range strings.Fields(out) {
		if !strings.HasPrefix(name, "e2e-"+e.run+"-") {
			continue
		}
		fmt.Fprintf(os.Stderr, "e2e: teardown: removing leftover domain %s\n", name)
		_, _ = virsh("destroy", name)
		if _, err := virsh("undefine", "--nvram", name); err != nil {
			if _, err2 := virsh("undefine", name); err2 != nil && !strings.Contains(err2.Error(), "failed to get domain") {
				errs = append(errs, err2)
			}
		}
	}
	return errors.Join(errs...)
}

// removeMounts unmounts everything under the run's directory and detaches
// loop devices backed by files there.
func (e *env) removeMounts() error {
	f, err := os.Open("/proc/self/mounts")
	if err != nil {
		return err
	}
	var targets []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) > 1 {
			target := strings.NewReplacer(`\040`, " ", `\011`, "\t", `\012`, "\n", `\134`, `\`).Replace(fields[1])
			if strings.HasPrefix(target, e.root+"/") {
				targets = append(targets, target)
			}
		}
	}
	f.Close()
	var errs []error
	for i := len(targets) - 1; i >= 0; i-- {
		fmt.Fprintf(os.Stderr, "e2e: teardown: unmounting %s\n", targets[i])
		if out, err := exec.Command("umount", "-l", targets[i]).CombinedOutput(); err != nil {
			errs = append(errs, fmt.Errorf("umount %s: %s", targets[i], out))
		}
	}
	out, err := exec.Command("losetup", "--list", "--json").Output()
	if err == nil && len(out) > 0 {
		var l struct {
			Loopdevices []struct {
				Name     string `json:"name"`
				BackFile string `json:"back-file"`
			} `json:"loopdevices"`
		}
		if json.Unmarshal(out, &l) == nil {
			for _, d := range l.Loopdevices {
				if strings.HasPrefix(strings.TrimSuffix(d.BackFile, " (deleted)"), e.root+"/") {
					fmt.Fprintf(os.Stderr, "e2e: teardown: detaching %s (%s)\n", d.Name, d.BackFile)
					if out, err := exec.Command("losetup", "-d", d.Name).CombinedOutput(); err != nil {
						errs = append(errs, fmt.Errorf("detach %s: %s", d.Name, out))
					}
				}
			}
		}
	}
	return errors.Join(errs...)
}

// newBridge creates a host bridge with a name unique to the run. VMs' taps
// must be on a host bridge: libvirt, and so QEMU, run in the host's network
// namespace. The bridge has no address and no uplink: it touches none of
// the host's own interfaces.
func (e *env) newBridge() (string, error) {
	e.mu.Lock()
	e.bridgeNo++
	name := fmt.Sprintf("nve2e%s%d", e.run, e.bridgeNo)
	e.bridges = append(e.bridges, name)
	e.mu.Unlock()
	if out, err := exec.Command("ip", "link", "add", name, "type", "bridge").CombinedOutput(); err != nil {
		return "", fmt.Errorf("create bridge %s: %s", name, out)
	}
	if out, err := exec.Command("ip", "link", "set", name, "up").CombinedOutput(); err != nil {
		return "", fmt.Errorf("bring up bridge %s: %s", name, out)
	}
	return name, nil
}

// deleteBridge deletes a bridge and the tap devices still attached to it
// (a tap left there is a VM NIC nodevirt did not clean up: reported).
func deleteBridge(name string) (leftTaps []string, err error) {
	if _, err := os.Stat("/sys/class/net/" + name); err != nil {
		return nil, nil
	}
	ports, _ := os.ReadDir("/sys/class/net/" + name + "/brif")
	for _, p := range ports {
		if _, err := os.Stat("/sys/class/net/" + p.Name() + "/tun_flags"); err == nil {
			leftTaps = append(leftTaps, p.Name())
		}
	}
	var errs []error
	if out, err := exec.Command("ip", "link", "del", name).CombinedOutput(); err != nil {
		errs = append(errs, fmt.Errorf("delete bridge %s: %s", name, out))
	}
	for _, tap := range leftTaps {
		if out, err := exec.Command("ip", "link", "del", tap).CombinedOutput(); err != nil {
			errs = append(errs, fmt.Errorf("delete tap %s: %s", tap, out))
		}
	}
	return leftTaps, errors.Join(errs...)
}

func (e *env) removeBridges() error {
	e.mu.Lock()
	bridges := append([]string(nil), e.bridges...)
	e.mu.Unlock()
	var errs []error
	for _, br := range bridges {
		taps, err := deleteBridge(br)
		if len(taps) > 0 {
			fmt.Fprintf(os.Stderr, "e2e: teardown: bridge %s still had taps %v\n", br, taps)
		}
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// copyDisk makes a private sparse copy of a guest image for one VM (libvirt
// takes ownership of a domain's disk files and the guest may write).
func copyDisk(src, dst string) error {
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	if out, err := exec.Command("cp", "--sparse=always", "--reflink=auto", src, dst).CombinedOutput(); err != nil {
		return fmt.Errorf("copy %s: %s", src, out)
	}
	return os.Chmod(dst, 0o666)
}

// diskSource is the file or device behind a domain disk.
func diskSource(s *libvirtxml.DomainDiskSource) string {
	switch {
	case s == nil:
		return ""
	case s.File != nil:
		return s.File.File
	case s.Block != nil:
		return s.Block.Dev
	}
	return ""
}
