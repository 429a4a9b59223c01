package dvimport

import (
	"fmt"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// VolumeResolver finds the VM disk of a volume on this node. The CSI driver
// satisfies it (see CSIResolver). Without a resolver the agent cannot
// import anything: New refuses a Config without one.
type VolumeResolver interface {
	// VolumeDisk returns where the disk of the volume with this CSI volume
	// handle lives: the disk image file inside a filesystem volume (its
	// directory exists, the file may not) or the block device. capacity is
	// the bytes the disk may occupy, or 0 when unknown (then the PVC's size
	// decides). An unknown handle is an error.
	VolumeDisk(volumeHandle string) (path string, isBlock bool, capacity int64, err error)
}

// DiskLocator is what the hostpath CSI driver (csi.Driver) offers.
type DiskLocator interface {
	VolumeDisk(volumeID string) (path string, isBlock bool, err error)
}

// CSIResolver adapts the CSI driver to a VolumeResolver: the capacity of a
// filesystem volume is the space available in the filesystem holding its
// disk (plus what an existing disk file holds); a block
// device reports 0 (the importer uses the device's size).
func CSIResolver(d DiskLocator) VolumeResolver { return csiResolver{d} }

type csiResolver struct{ d DiskLocator }

var _ VolumeResolver = csiResolver{}

func (r csiResolver) VolumeDisk(handle string) (string, bool, int64, error) {
	path, isBlock, err := r.d.VolumeDisk(handle)
	if err != nil || isBlock {
		return path, isBlock, 0, err
	}
	var st unix.Statfs_t
	if err := unix.Statfs(filepath.Dir(path), &st); err != nil {
		return "", false, 0, fmt.Errorf("volume %s: %w", handle, err)
	}
	capacity := int64(st.Bavail) * st.Bsize
	var fst unix.Stat_t
	if unix.Stat(path, &fst) == nil {
		capacity += fst.Blocks * 512
	}
	return path, false, capacity, nil
}
