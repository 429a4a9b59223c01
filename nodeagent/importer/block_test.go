package importer

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// loopDevice attaches a fresh file of size bytes to a loop device filled
// with a non-zero pattern, so that unwritten holes would show.
func loopDevice(t *testing.T, size int64) string {
	t.Helper()
	backing := filepath.Join(t.TempDir(), "backing.img")
	if err := os.WriteFile(backing, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(backing, size); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("losetup", "-f", "--show", backing).CombinedOutput()
	if err != nil {
		t.Skipf("no loop device: %v %s", err, out)
	}
	dev := strings.TrimSpace(string(out))
	t.Cleanup(func() { exec.Command("losetup", "-d", dev).Run() })
	fillPattern(t, dev, size)
	return dev
}

func fillPattern(t *testing.T, dev string, size int64) {
	t.Helper()
	f, err := os.OpenFile(dev, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	chunk := bytes.Repeat([]byte{0xab}, 1<<20)
	for off := int64(0); off < size; off += int64(len(chunk)) {
		if _, err := f.WriteAt(chunk, off); err != nil {
			t.Fatal(err)
		}
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
}

func zeroSHA(n int64) string {
	h := sha256.New()
	z := make([]byte, 1<<20)
	for ; n > 0; n -= int64(len(z)) {
		h.Write(z[:min(n, int64(len(z)))])
	}
	return hex.EncodeToString(h.Sum(nil))
}

func TestBlockDestination(t *testing.T) {
	fx := getFixture(t)
	srv := serveDir(t, fx.dir)
	const devSize = 96 << 20
	dev := loopDevice(t, devSize)
	work := t.TempDir()
	imp := func(name, workDir string) (Result, error) {
		return Import(context.Background(), Request{
			Source: Source{HTTP: &HTTPSource{AllowedNetworks: testNetworks, URL: srv.URL + "/" + name}}, Dest: dev, DestIsBlock: true, WorkDir: workDir,
		})
	}
	for _, c := range []struct{ name, workDir string }{
		{"disk.qcow2", ""}, {"disk-c.qcow2", ""}, {"disk.raw.gz", ""}, {"disk.raw", ""},
		{"disk.vmdk", work}, {"disk-late.qcow2", work},
	} {
		t.Run(c.name, func(t *testing.T) {
			fillPattern(t, dev, devSize)
			if _, err := imp(c.name, c.workDir); err != nil {
				t.Fatal(err)
			}
			if got := prefixSHA(t, dev, testImageSize); got != fx.rawSHA {
				t.Errorf("device content %s, want %s", got, fx.rawSHA)
			}
			if left := leftovers(t, work); len(left) != 0 {
				t.Errorf("work dir left with %v", left)
			}
		})
	}

	t.Run("needs work dir", func(t *testing.T) {
		for _, name := range []string{"disk.vhdx", "disk-late.qcow2"} {
			_, err := imp(name, "")
			wantReason(t, err, ReasonScratchRequired)
		}
	})

	t.Run("failure zeroes what was written", func(t *testing.T) {
		data := readFixture(t, "disk.qcow2")
		fillPattern(t, dev, devSize)
		_, err := ImportFromReader(context.Background(), bytes.NewReader(data[:len(data)*3/4]), -1,
			Request{Dest: dev, DestIsBlock: true})
		wantReason(t, err, ReasonTruncated)
		if got := prefixSHA(t, dev, testImageSize); got != zeroSHA(testImageSize) {
			t.Error("device range not zeroed after a failed import")
		}
	})

	t.Run("too large for the device", func(t *testing.T) {
		_, err := Import(context.Background(), Request{
			Source: Source{HTTP: &HTTPSource{AllowedNetworks: testNetworks, URL: srv.URL + "/disk.qcow2"}}, Dest: dev, DestIsBlock: true, Capacity: 32 << 20,
		})
		wantReason(t, err, ReasonTooLarge)
		_, err = Import(context.Background(), Request{Source: Source{Blank: true}, Dest: dev, DestIsBlock: true, Capacity: 2 * devSize})
		wantReason(t, err, ReasonInvalidRequest)
	})

	t.Run("blank", func(t *testing.T) {
		fillPattern(t, dev, devSize)
		if _, err := Import(context.Background(), Request{Source: Source{Blank: true}, Dest: dev, DestIsBlock: true}); err != nil {
			t.Fatal(err)
		}
		if got := prefixSHA(t, dev, devSize); got != zeroSHA(devSize) {
			t.Error("blank device not zero")
		}
	})
}
