package handler

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"k8s.io/apimachinery/pkg/types"
)

// recordFile is the handler's record inside a VMI's state directory.
const recordFile = "handler.json"

// record is what the handler made for one VMI: enough to undo it after a
// restart, even when the VMI and its NetworkAttachmentDefinitions are gone.
type record struct {
	UID       types.UID   `json:"uid"`
	Namespace string      `json:"namespace"`
	Name      string      `json:"name"`
	Domain    string      `json:"domain"`
	Taps      []tapRecord `json:"taps,omitempty"`
	// Migration is the UID of the live migration this node is the target
	// of, while the VMI is not bound here: the handler leaves the domain
	// and state alone until the migration ends (migration.go).
	Migration types.UID `json:"migration,omitempty"`
	// MigrationVolumes are the volumes made here for the node-local
	// disks of that migration: deleted if it fails.
	MigrationVolumes []migrationVolume `json:"migrationVolumes,omitempty"`
}

// migrationVolume is a volume made for an incoming migration's copy of
// the node-local disk of a VMI volume.
type migrationVolume struct {
	// Volume is the VMI's volume name; Claim its claim.
	Volume string `json:"volume"`
	Claim  string `json:"claim"`
	// VolumeID is the CSI volume; Context its volume context.
	VolumeID string            `json:"volumeID"`
	Context  map[string]string `json:"context,omitempty"`
}

// tapRecord is one tap attached for a NIC: on a Multus bridge network with
// the network config it was attached with (DetachTap needs it), or on the
// pod network with its MAC.
type tapRecord struct {
	Interface string          `json:"interface"`
	Tap       string          `json:"tap"`
	NetConf   json.RawMessage `json:"netConf,omitempty"`
	Pod       bool            `json:"pod,omitempty"`
	MAC       string          `json:"mac,omitempty"`
}

func (h *Handler) vmDir(uid types.UID) string { return filepath.Join(h.cfg.StateDir, string(uid)) }

// owns reports whether this handler made state for the VMI uid.
func (h *Handler) owns(uid types.UID) bool {
	if uid == "" {
		return false
	}
	_, err := os.Stat(filepath.Join(h.vmDir(uid), recordFile))
	return err == nil
}

// writeRecord stores r atomically, making the VMI's directory (reachable by
// QEMU's user) if needed.
func (h *Handler) writeRecord(r *record) error {
	dir := h.vmDir(r.UID)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("state of %s/%s: %w", r.Namespace, r.Name, err)
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		return fmt.Errorf("state of %s/%s: %w", r.Namespace, r.Name, err)
	}
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	tmp := filepath.Join(dir, recordFile+".tmp")
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return fmt.Errorf("state of %s/%s: %w", r.Namespace, r.Name, err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, recordFile)); err != nil {
		return fmt.Errorf("state of %s/%s: %w", r.Namespace, r.Name, err)
	}
	return nil
}

// readRecord returns the record of uid, nil when there is none.
func (h *Handler) readRecord(uid types.UID) (*record, error) {
	b, err := os.ReadFile(filepath.Join(h.vmDir(uid), recordFile))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read state of vmi %s: %w", uid, err)
	}
	var r record
	if err := json.Unmarshal(b, &r); err != nil {
		return nil, fmt.Errorf("read state of vmi %s: %w", uid, err)
	}
	return &r, nil
}

// records lists every record under StateDir.
func (h *Handler) records() ([]*record, error) {
	ents, err := os.ReadDir(h.cfg.StateDir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list vm state: %w", err)
	}
	var out []*record
	var errs []error
	for _, e := range ents {
		if !e.IsDir() {
			continue
		}
		r, err := h.readRecord(types.UID(e.Name()))
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if r != nil {
			out = append(out, r)
		}
	}
	return out, errors.Join(errs...)
}

// recordsOf returns the records of the VMI namespace/name, whatever its UID.
func (h *Handler) recordsOf(namespace, name string) ([]*record, error) {
	all, err := h.records()
	var out []*record
	for _, r := range all {
		if r.Namespace == namespace && r.Name == name {
			out = append(out, r)
		}
	}
	return out, err
}
