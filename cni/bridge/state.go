package bridge

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"

	"golang.org/x/sys/unix"
)

// Record is what one attachment made on the host, kept on disk so DEL and GC
// can undo it without the container's network namespace.
type Record struct {
	Kind        string `json:"kind"` // "veth"; "tap" only in memory (DetachTap)
	Network     string `json:"network,omitempty"`
	ContainerID string `json:"containerID,omitempty"`
	IfName      string `json:"ifname,omitempty"`
	Netns       string `json:"netns,omitempty"`

	Bridge     string      `json:"bridge"`
	Port       string      `json:"port"`
	MAC        string      `json:"mac,omitempty"`
	VLAN       int         `json:"vlan,omitempty"`
	Trunk      []VLANRange `json:"trunk,omitempty"`
	SpoofChain string      `json:"spoofChain,omitempty"`
	MasqChain  string      `json:"masqChain,omitempty"`
	MasqIPs    []string    `json:"masqIPs,omitempty"`

	// IPAMType and IPAMConfig let GC release addresses of an attachment the
	// runtime forgot: IPAMConfig is the stdin the IPAM plugin accepted on ADD.
	IPAMType   string          `json:"ipamType,omitempty"`
	IPAMConfig json.RawMessage `json:"ipamConfig,omitempty"`
}

// store is the state directory layout:
//
//	<dir>/net/<network>/<containerID>_<ifname>.json   CNI attachments
//	<dir>/lock/<bridge>.lock                            per-bridge flock
type store struct{ dir string }

var safeName = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.\-]*$`)

func checkSafe(what, s string) error {
	if !safeName.MatchString(s) || strings.Contains(s, "..") {
		return fmt.Errorf("%s %q has characters not allowed in a state file name", what, s)
	}
	return nil
}

func (s store) attachmentPath(network, containerID, ifName string) (string, error) {
	for _, c := range [][2]string{{"network name", network}, {"container ID", containerID}, {"ifname", ifName}} {
		if err := checkSafe(c[0], c[1]); err != nil {
			return "", err
		}
	}
	return filepath.Join(s.dir, "net", network, containerID+"_"+ifName+".json"), nil
}

// write stores r atomically (temp file + rename).
func (s store) write(path string, r *Record) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return fmt.Errorf("state dir: %w", err)
	}
	b, err := json.Marshal(r)
	if err != nil {
		return fmt.Errorf("encode state: %w", err)
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return fmt.Errorf("write state: %w", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("write state: %w", err)
	}
	return nil
}

// read returns the record at path, or nil when there is none.
func (s store) read(path string) (*Record, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read state: %w", err)
	}
	var r Record
	if err := json.Unmarshal(b, &r); err != nil {
		return nil, fmt.Errorf("decode state %s: %w", path, err)
	}
	return &r, nil
}

func (s store) remove(path string) error {
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove state: %w", err)
	}
	return nil
}

// networkRecords lists the attachment records of one network with their paths.
func (s store) networkRecords(network string) (map[string]*Record, error) {
	if err := checkSafe("network name", network); err != nil {
		return nil, err
	}
	dir := filepath.Join(s.dir, "net", network)
	ents, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list state: %w", err)
	}
	out := map[string]*Record{}
	for _, e := range ents {
		if !strings.HasSuffix(e.Name(), ".json") {
			continue
		}
		p := filepath.Join(dir, e.Name())
		r, err := s.read(p)
		if err != nil {
			return nil, err
		}
		if r != nil {
			out[p] = r
		}
	}
	return out, nil
}

// lockBridge takes an exclusive flock serialising host-side changes on one
// bridge; the returned func releases it.
func (s store) lockBridge(bridge string) (func(), error) {
	dir := filepath.Join(s.dir, "lock")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("lock dir: %w", err)
	}
	unlock, err := flock(filepath.Join(dir, bridge+".lock"))
	if err != nil {
		return nil, fmt.Errorf("lock bridge %s: %w", bridge, err)
	}
	return unlock, nil
}

// tryLock takes the named exclusive flock in the lock directory if no one
// holds it; ok is false when someone does (or the lock cannot be made).
func (s store) tryLock(name string) (unlock func(), ok bool) {
	dir := filepath.Join(s.dir, "lock")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, false
	}
	unlock, err := lockFile(filepath.Join(dir, name+".lock"), unix.LOCK_EX|unix.LOCK_NB)
	return unlock, err == nil
}

// flock takes an exclusive flock on path (created if missing), waiting for
// it; the returned func releases it.
func flock(path string) (func(), error) {
	return lockFile(path, unix.LOCK_EX)
}

func lockFile(path string, how int) (func(), error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, err
	}
	for {
		err = unix.Flock(int(f.Fd()), how)
		if !errors.Is(err, unix.EINTR) {
			break
		}
	}
	if err != nil {
		f.Close()
		return nil, err
	}
	return func() { f.Close() }, nil
}
