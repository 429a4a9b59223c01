package lab

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/nodevirt/nodevirt/cni/bridge"
	"github.com/nodevirt/nodevirt/launcher/domain"
	"github.com/nodevirt/nodevirt/nodeagent/agent"
)

// removeGuests destroys and undefines the libvirt domains the lab's node
// agent started: those carrying nodevirt's metadata and files under the lab
// directory (other nodevirt guests on the host are left alone).
func removeGuests(cfg Config) error {
	if _, err := os.Stat("/run/libvirt/libvirt-sock"); err != nil {
		return nil
	}
	out, err := exec.Command("virsh", "-c", "qemu:///system", "list", "--all", "--name").Output()
	if err != nil {
		return fmt.Errorf("list domains: %w", err)
	}
	var errs []error
	for _, name := range strings.Fields(string(out)) {
		xml, err := exec.Command("virsh", "-c", "qemu:///system", "dumpxml", name).Output()
		if err != nil || !strings.Contains(string(xml), domain.MetadataNamespace) || !strings.Contains(string(xml), cfg.Dir+"/") {
			continue
		}
		fmt.Fprintf(cfg.Out, "    domain %s\n", name)
		_ = exec.Command("virsh", "-c", "qemu:///system", "destroy", name).Run()
		if out, err := exec.Command("virsh", "-c", "qemu:///system", "undefine", "--nvram", name).CombinedOutput(); err != nil &&
			!strings.Contains(string(out), "failed to get domain") {
			if out2, err2 := exec.Command("virsh", "-c", "qemu:///system", "undefine", name).CombinedOutput(); err2 != nil {
				errs = append(errs, fmt.Errorf("undefine %s: %s %s", name, out, out2))
			}
		}
	}
	return errors.Join(errs...)
}

// RemoveMounts unmounts everything mounted under dir (a lab's or a
// node agent's: CSI publications, loop-mounted volumes), deepest first, and
// detaches loop devices whose backing file lies there.
func RemoveMounts(dir string) error {
	f, err := os.Open("/proc/self/mounts")
	if err != nil {
		return err
	}
	var targets []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) > 1 && strings.HasPrefix(unescapeMount(fields[1]), dir+"/") {
			targets = append(targets, unescapeMount(fields[1]))
		}
	}
	f.Close()
	var errs []error
	for i := len(targets) - 1; i >= 0; i-- {
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
				if strings.HasPrefix(strings.TrimSuffix(d.BackFile, " (deleted)"), dir+"/") {
					if out, err := exec.Command("losetup", "-d", d.Name).CombinedOutput(); err != nil {
						errs = append(errs, fmt.Errorf("detach %s: %s", d.Name, out))
					}
				}
			}
		}
	}
	return errors.Join(errs...)
}

func unescapeMount(s string) string {
	return strings.NewReplacer(`\040`, " ", `\011`, "\t", `\012`, "\n", `\134`, `\`).Replace(s)
}

// removeBridges deletes the bridges the lab recorded creating.
func removeBridges(cfg Config) error {
	data, err := os.ReadFile(filepath.Join(cfg.Dir, "created.json"))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var r record
	if err := json.Unmarshal(data, &r); err != nil {
		return err
	}
	var errs []error
	for _, br := range r.Bridges {
		if _, err := os.Stat("/sys/class/net/" + br); err != nil {
			continue
		}
		fmt.Fprintf(cfg.Out, "    bridge %s\n", br)
		if out, err := exec.Command("ip", "link", "del", br).CombinedOutput(); err != nil {
			errs = append(errs, fmt.Errorf("delete bridge %s: %s", br, out))
		}
	}
	return errors.Join(errs...)
}

// removeNetwork removes what the lab's node agent wired on the host: the taps
// and spoof-check rules of bridge attachments, and the pod network (bridge,
// nftables tables, forwarding as it was).
func removeNetwork(ctx context.Context, cfg Config) error {
	agentDir := cfg.path("nodeagent")
	var errs []error
	errs = append(errs, agent.TeardownTaps(ctx, agentDir, func(tap string) { fmt.Fprintf(cfg.Out, "    tap %s\n", tap) }))
	errs = append(errs, bridge.RemoveUnusedTables(ctx))
	if _, err := os.Stat(agentDir); err == nil {
		errs = append(errs, agent.TeardownPodNetwork(ctx, agent.Config{StateDir: agentDir, NodeName: cfg.NodeName}))
	}
	return errors.Join(errs...)
}
