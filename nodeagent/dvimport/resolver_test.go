package dvimport

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/nodevirt/nodevirt/csi"
)

// The hostpath CSI driver is what CSIResolver adapts.
var _ DiskLocator = (*csi.Driver)(nil)

// diskAt is a DiskLocator with one volume.
type diskAt struct{ path string }

func (d diskAt) VolumeDisk(id string) (string, bool, error) {
	if id != "vol-1" {
		return "", false, os.ErrNotExist
	}
	return d.path, false, nil
}

func TestCSIResolverReportsTheFilesystemSpace(t *testing.T) {
	dir := t.TempDir()
	disk := filepath.Join(dir, "disk.img")
	r := CSIResolver(diskAt{disk})
	path, isBlock, free, err := r.VolumeDisk("vol-1")
	if err != nil || path != disk || isBlock || free <= 0 {
		t.Fatalf("VolumeDisk: %q %v %d %v", path, isBlock, free, err)
	}
	// An existing disk's blocks count as usable: the import replaces it.
	if err := os.WriteFile(disk, make([]byte, 4<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	_, _, withDisk, err := r.VolumeDisk("vol-1")
	if err != nil || withDisk < free-(1<<20) {
		t.Errorf("capacity with an existing disk %d, without %d (%v)", withDisk, free, err)
	}
	if _, _, _, err := r.VolumeDisk("vol-2"); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("unknown volume: %v", err)
	}
}
