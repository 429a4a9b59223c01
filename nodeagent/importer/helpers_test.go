package importer

import (
	"crypto/sha256"
	"encoding/hex"
	"io"
	"log"
	"math/rand"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

const testImageSize = 64 << 20

// testNetworks lets imports reach the test servers, which listen on
// loopback (forbidden by default).
var testNetworks = []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8"), netip.MustParsePrefix("::1/128")}

// makeRawImage writes a sparse raw disk of size bytes with random data in a
// few places (start, middle, unaligned, end) and returns its path.
func makeRawImage(t testing.TB, dir, name string, size int64, seed int64) string {
	t.Helper()
	p := filepath.Join(dir, name)
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	rnd := rand.New(rand.NewSource(seed))
	for _, at := range []struct{ off, n int64 }{
		{0, 1 << 20}, {size / 3, 3 << 20}, {size/2 + 12345, 70000}, {size - 512<<10, 512 << 10},
	} {
		b := make([]byte, at.n)
		rnd.Read(b)
		if at.off == size/3 {
			// Compressible, so that compressed qcow2 clusters exist.
			for i := range b {
				b[i] = "ACGT"[b[i]&3]
			}
		}
		// Some zero stretches inside the data too.
		clear(b[len(b)/4 : len(b)/4+8192])
		if _, err := f.WriteAt(b, at.off); err != nil {
			t.Fatal(err)
		}
	}
	return p
}

func run(t testing.TB, name string, args ...string) {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
}

func fileSHA(t testing.TB, p string) string {
	t.Helper()
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// prefixSHA hashes the first n bytes of p (a device, or a file).
func prefixSHA(t testing.TB, p string, n int64) string {
	t.Helper()
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if m, err := io.Copy(h, io.LimitReader(f, n)); err != nil || m != n {
		t.Fatalf("read %s: %d of %d bytes, %v", p, m, n, err)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// guestSHA is the sha256 of the guest-visible content of an image as qemu
// reads it: qemu-img's own conversion to raw.
func guestSHA(t testing.TB, p, format string) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), "ref.raw")
	run(t, "qemu-img", "convert", "-f", format, "-O", "raw", p, out)
	return fileSHA(t, out)
}

// serveDir serves dir over plain HTTP (with ranges, ETags via modtime).
func serveDir(t testing.TB, dir string) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.FileServer(http.Dir(dir)))
	t.Cleanup(srv.Close)
	return srv
}

// quietTLSServer starts a TLS server whose handshake failures (the
// untrusted-certificate cases) are not logged.
func quietTLSServer(h http.Handler) *httptest.Server {
	srv := httptest.NewUnstartedServer(h)
	srv.Config.ErrorLog = log.New(io.Discard, "", 0)
	srv.StartTLS()
	return srv
}

// leftovers lists the files in dir other than the named ones.
func leftovers(t testing.TB, dir string, keep ...string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		found := false
		for _, k := range keep {
			found = found || e.Name() == k
		}
		if !found {
			out = append(out, e.Name())
		}
	}
	return out
}

// wantReason fails unless err is an *Error with the given reason.
func wantReason(t testing.TB, err error, want Reason) {
	t.Helper()
	if err == nil {
		t.Fatalf("import succeeded, want %s", want)
	}
	if _, ok := err.(*Error); !ok {
		t.Errorf("error %T is not *Error: %v", err, err)
	}
	if got := ReasonOf(err); got != want {
		t.Fatalf("reason %s, want %s (%v)", got, want, err)
	}
}
