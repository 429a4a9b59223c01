package importer

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"time"

	"github.com/nodevirt/nodevirt/nodeagent/importer/confine"
)

// Limits of the confined qemu-img runs (see package confine for the rest
// of the confinement). qemu-img info gets CDI's figures; convert gets the
// same address space and CPU time that grows with the image.
const (
	QemuImgInfoCPU          = 30 * time.Second
	QemuImgInfoAddressSpace = 1 << 30
	QemuImgConvertCPUBase   = 120 * time.Second
	QemuImgConvertCPUPerGiB = 30 * time.Second
	QemuImgConvertAddrSpace = 1 << 30
)

// Where the image and the destination appear inside the sandbox.
const (
	sandboxImage = "/in/image"
	sandboxDisk  = "/out/disk"
)

// convertWithQemuImg handles the formats that need random access: the
// image is downloaded (sparse) into the work directory, vetted (vetFile,
// then qemu-img info), and converted into the destination. qemu-img runs
// confined: it sees only the download and the destination. It returns the
// virtual size.
func convertWithQemuImg(ctx context.Context, req Request, d *destination, r io.Reader, f Format, t *tracker) (int64, error) {
	workDir := req.workDir()
	if workDir == "" {
		return 0, failf(ReasonScratchRequired, "%s image needs a work directory to be converted", f)
	}
	t.setTwoPhase()
	// The download is bounded like a decompressed stream: an image file is
	// not much larger than the disk it holds.
	limit := d.capacity + d.capacity/8 + 64<<20
	dl, err := openDestination(filepath.Join(workDir, filepath.Base(req.Dest)+".download"), false, limit)
	if err != nil {
		return 0, err
	}
	defer dl.abort()
	w := &sequentialWriter{d: dl}
	n, err := io.CopyBuffer(w, r, make([]byte, 1<<20))
	if err != nil {
		return 0, err
	}
	if err := dl.finishSize(n); err != nil {
		return 0, err
	}
	if err := vetFile(f, dl.f, n); err != nil {
		return 0, err
	}
	if _, err := confine.Own(dl.tmp, 0, 0); err != nil {
		return 0, failf(ReasonDestination, "%w", err)
	}
	info, err := qemuImgInfo(ctx, dl.tmp, f)
	if err != nil {
		return 0, err
	}
	if err := info.vet(f); err != nil {
		return 0, err
	}
	if err := d.setSize(info.VirtualSize); err != nil {
		return 0, err
	}
	restore, err := confine.Own(d.writePath(), 0, 0)
	if err != nil {
		return 0, failf(ReasonDestination, "%w", err)
	}
	spec := confine.Spec{
		Binds: []confine.Bind{{Host: dl.tmp, Path: sandboxImage}, {Host: d.writePath(), Path: sandboxDisk, Writable: true}},
		Limits: confine.Limits{
			CPU:          QemuImgConvertCPUBase + time.Duration(info.VirtualSize>>30+1)*QemuImgConvertCPUPerGiB,
			AddressSpace: QemuImgConvertAddrSpace,
		},
	}
	if !d.block {
		spec.Limits.FileSize = d.capacity
	}
	args := []string{"convert", "-p", "-n", "--target-is-zero", "-f", string(f), "-O", "raw", sandboxImage, sandboxDisk}
	err = runQemuImgConvert(ctx, spec, args, t.setConvert)
	if rerr := restore(); rerr != nil && err == nil {
		err = failf(ReasonDestination, "%w", rerr)
	}
	if err != nil {
		return 0, err
	}
	return info.VirtualSize, nil
}

// qemuInfo is the part of `qemu-img info --output=json` that is vetted.
type qemuInfo struct {
	VirtualSize         int64  `json:"virtual-size"`
	Format              string `json:"format"`
	Filename            string `json:"filename"`
	BackingFilename     string `json:"backing-filename"`
	FullBackingFilename string `json:"full-backing-filename"`
	Encrypted           bool   `json:"encrypted"`
	FormatSpecific      struct {
		Type string          `json:"type"`
		Data json.RawMessage `json:"data"`
	} `json:"format-specific"`
	Children []struct {
		Name string `json:"name"`
	} `json:"children"`
}

// formatSpecific is the union of the format-specific fields that say
// where data comes from.
type formatSpecific struct {
	DataFile   *string `json:"data-file"`
	Encrypt    any     `json:"encrypt"`
	CreateType string  `json:"create-type"`
	Extents    []struct {
		Filename string `json:"filename"`
		Format   string `json:"format"`
	} `json:"extents"`
}

// vet checks that what qemu-img found is the image we detected, with no
// reference outside itself: no backing file, no data file, no second
// child, for VMDK one extent that is the image itself.
func (info *qemuInfo) vet(f Format) error {
	switch {
	case info.Format != string(f):
		return failf(ReasonInvalidImage, "qemu-img reads the image as %q, not %s", info.Format, f)
	case info.BackingFilename != "" || info.FullBackingFilename != "":
		return failf(ReasonUnsupportedImage, "%s image has a backing file %q", f, info.BackingFilename+info.FullBackingFilename)
	case info.Encrypted:
		return failf(ReasonUnsupportedImage, "%s image is encrypted", f)
	case info.VirtualSize < 0:
		return failf(ReasonInvalidImage, "%s image has virtual size %d", f, info.VirtualSize)
	}
	for _, c := range info.Children {
		if c.Name != "file" {
			return failf(ReasonUnsupportedImage, "%s image opens a second file (%q)", f, c.Name)
		}
	}
	var fs formatSpecific
	if len(info.FormatSpecific.Data) > 0 {
		if err := json.Unmarshal(info.FormatSpecific.Data, &fs); err != nil {
			return failf(ReasonInvalidImage, "qemu-img info format-specific data: %w", err)
		}
	}
	switch {
	case fs.DataFile != nil:
		return failf(ReasonUnsupportedImage, "%s image with an external data file %q", f, *fs.DataFile)
	case fs.Encrypt != nil:
		return failf(ReasonUnsupportedImage, "%s image is encrypted", f)
	}
	if f == FormatVMDK {
		switch fs.CreateType {
		case "monolithicSparse", "streamOptimized":
		default:
			return failf(ReasonUnsupportedImage, "vmdk createType %q is not a single-file image", fs.CreateType)
		}
		if len(fs.Extents) != 1 || fs.Extents[0].Filename != sandboxImage {
			names := make([]string, 0, len(fs.Extents))
			for _, e := range fs.Extents {
				names = append(names, strconv.Quote(e.Filename))
			}
			return failf(ReasonUnsupportedImage, "vmdk image extents %v are not the image itself", names)
		}
	}
	return nil
}

// qemuImgInfo runs a confined `qemu-img info` on path, read as format f
// (never probed).
func qemuImgInfo(ctx context.Context, path string, f Format) (*qemuInfo, error) {
	spec := confine.Spec{
		Binds:  []confine.Bind{{Host: path, Path: sandboxImage}},
		Limits: confine.Limits{CPU: QemuImgInfoCPU, AddressSpace: QemuImgInfoAddressSpace},
	}
	out, err := confine.Run(ctx, spec, "qemu-img", "info", "--output=json", "-f", string(f), sandboxImage)
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, failf(ReasonInvalidImage, "qemu-img info: %w", err)
	}
	var info qemuInfo
	if err := json.Unmarshal(out, &info); err != nil {
		return nil, failf(ReasonInvalidImage, "qemu-img info output: %w", err)
	}
	return &info, nil
}

var qemuProgress = regexp.MustCompile(`\((\d+(?:\.\d+)?)/100%\)`)

// runQemuImgConvert runs a confined qemu-img with -p and reports its
// percent.
func runQemuImgConvert(ctx context.Context, spec confine.Spec, args []string, progress func(float64)) error {
	var stderr bytes.Buffer
	var out io.ReadCloser
	wait, err := confine.Start(ctx, spec, func(cmd *exec.Cmd) error {
		cmd.Stderr = &stderr
		var err error
		out, err = cmd.StdoutPipe()
		return err
	}, "qemu-img", args...)
	if err != nil {
		return failf(ReasonConvert, "qemu-img convert: %w", err)
	}
	sc := bufio.NewScanner(out)
	sc.Split(splitCR)
	for sc.Scan() {
		if m := qemuProgress.FindSubmatch(sc.Bytes()); m != nil {
			if pct, err := strconv.ParseFloat(string(m[1]), 64); err == nil {
				progress(pct)
			}
		}
	}
	if err := wait(); err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		var ee *exec.ExitError
		if errors.As(err, &ee) && ee.ProcessState != nil {
			err = fmt.Errorf("%w (%s)", err, ee.ProcessState)
		}
		return failf(ReasonConvert, "qemu-img convert: %s: %w", bytes.TrimSpace(stderr.Bytes()), err)
	}
	return nil
}

// splitCR splits qemu-img's progress output, whose lines end in \r.
func splitCR(data []byte, atEOF bool) (int, []byte, error) {
	if i := bytes.IndexAny(data, "\r\n"); i >= 0 {
		return i + 1, data[:i], nil
	}
	if atEOF && len(data) > 0 {
		return len(data), data, nil
	}
	return 0, nil, nil
}
