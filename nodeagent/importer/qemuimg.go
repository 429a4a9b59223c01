package importer

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
)

// convertWithQemuImg handles the formats that need random access: the
// image is downloaded (sparse) into the work directory, inspected with
// qemu-img info, and converted into the destination. It returns the
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
	info, err := qemuImgInfo(ctx, dl.tmp, f)
	if err != nil {
		return 0, err
	}
	switch {
	case info.BackingFilename != "":
		return 0, failf(ReasonUnsupportedImage, "%s image has a backing file", f)
	case info.Encrypted:
		return 0, failf(ReasonUnsupportedImage, "%s image is encrypted", f)
	}
	if err := d.setSize(info.VirtualSize); err != nil {
		return 0, err
	}
	args := []string{"convert", "-p", "-n", "--target-is-zero", "-f", string(f), "-O", "raw", dl.tmp, d.writePath()}
	if err := runQemuImgConvert(ctx, args, t.setConvert); err != nil {
		return 0, err
	}
	return info.VirtualSize, nil
}

type qemuInfo struct {
	VirtualSize     int64  `json:"virtual-size"`
	Format          string `json:"format"`
	BackingFilename string `json:"backing-filename"`
	Encrypted       bool   `json:"encrypted"`
}

func qemuImgInfo(ctx context.Context, path string, f Format) (*qemuInfo, error) {
	var stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, "qemu-img", "info", "--output=json", "-f", string(f), path)
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, failf(ReasonInvalidImage, "qemu-img info: %s: %w", bytes.TrimSpace(stderr.Bytes()), err)
	}
	var info qemuInfo
	if err := json.Unmarshal(out, &info); err != nil {
		return nil, failf(ReasonInvalidImage, "qemu-img info output: %w", err)
	}
	return &info, nil
}

var qemuProgress = regexp.MustCompile(`\((\d+(?:\.\d+)?)/100%\)`)

// runQemuImgConvert runs qemu-img with -p and reports its percent.
func runQemuImgConvert(ctx context.Context, args []string, progress func(float64)) error {
	var stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, "qemu-img", args...)
	cmd.Stderr = &stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start qemu-img: %w", err)
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
	if err := cmd.Wait(); err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
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
