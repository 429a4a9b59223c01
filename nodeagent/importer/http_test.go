package importer

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"crypto/sha512"
	"encoding/hex"
	"encoding/pem"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func readFixture(t *testing.T, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(getFixture(t).dir, name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// serveBytes serves b at every path, with ranges and a strong ETag.
func serveBytes(t *testing.T, b []byte) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("ETag", `"fixed"`)
		http.ServeContent(w, r, "image", time.Unix(1700000000, 0), bytes.NewReader(b))
	}))
	t.Cleanup(srv.Close)
	return srv
}

func importURL(t *testing.T, url string, capacity int64, mod func(*HTTPSource)) (string, Result, error) {
	t.Helper()
	dir := t.TempDir()
	src := &HTTPSource{AllowedNetworks: testNetworks, URL: url, Retries: 2, RetryDelay: 10 * time.Millisecond}
	if mod != nil {
		mod(src)
	}
	dest := filepath.Join(dir, "disk.img")
	res, err := Import(context.Background(), Request{Source: Source{HTTP: src}, Dest: dest, Capacity: capacity})
	if err != nil {
		if left := leftovers(t, dir); len(left) != 0 {
			t.Errorf("failed import left behind: %v", left)
		}
	}
	return dest, res, err
}

func TestTLSBasicAuthHeaders(t *testing.T) {
	fx := getFixture(t)
	img := filepath.Join(fx.dir, "disk.qcow2")
	var sawSecret atomic.Bool
	srv := quietTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if u, p, ok := r.BasicAuth(); !ok || u != "alice" || p != "s3cret" {
			w.Header().Set("WWW-Authenticate", `Basic realm="images"`)
			http.Error(w, "no", http.StatusUnauthorized)
			return
		}
		if r.Header.Get("X-Extra") != "one" {
			http.Error(w, "missing X-Extra", http.StatusBadRequest)
			return
		}
		sawSecret.Store(r.Header.Get("X-Token") == "two")
		http.ServeFile(w, r, img)
	}))
	defer srv.Close()
	ca := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw})
	good := func(s *HTTPSource) {
		s.CACertPEM, s.Username, s.Password = ca, "alice", "s3cret"
		s.ExtraHeaders, s.SecretExtraHeaders = []string{"X-Extra: one"}, []string{"X-Token: two"}
	}

	dest, _, err := importURL(t, srv.URL+"/x", testImageSize, good)
	if err != nil {
		t.Fatal(err)
	}
	if got := fileSHA(t, dest); got != fx.rawSHA {
		t.Errorf("content %s, want %s", got, fx.rawSHA)
	}
	if !sawSecret.Load() {
		t.Error("secret extra header not sent")
	}

	_, _, err = importURL(t, srv.URL+"/x", testImageSize, func(s *HTTPSource) { good(s); s.Password = "wrong" })
	wantReason(t, err, ReasonUnauthorized)

	start := time.Now()
	_, _, err = importURL(t, srv.URL+"/x", testImageSize, func(s *HTTPSource) { good(s); s.CACertPEM = nil })
	wantReason(t, err, ReasonSourceUnreachable)
	if !strings.Contains(err.Error(), "certificate") {
		t.Errorf("error does not mention the certificate: %v", err)
	}
	if time.Since(start) > 2*time.Second {
		t.Errorf("an untrusted certificate was retried (%v)", time.Since(start))
	}

	_, _, err = importURL(t, srv.URL+"/x", testImageSize, func(s *HTTPSource) { good(s); s.ExtraHeaders = []string{"no colon"} })
	wantReason(t, err, ReasonInvalidRequest)
}

// TestResumeAfterDrop serves an image whose first two connections die
// mid-body; the import must resume with Range requests and still match the
// checksum.
func TestResumeAfterDrop(t *testing.T) {
	data := readFixture(t, "disk-c.qcow2")
	sum := sha256.Sum256(data)
	var mu sync.Mutex
	var requests []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		n := len(requests)
		requests = append(requests, r.Header.Get("Range"))
		mu.Unlock()
		w.Header().Set("ETag", `"v1"`)
		if n < 2 {
			// Send part of what was asked for, then drop the connection.
			start := int64(0)
			if rg := r.Header.Get("Range"); rg != "" {
				fmt.Sscanf(rg, "bytes=%d-", &start)
				w.Header().Set("Content-Range", fmt.Sprintf("bytes %d-%d/%d", start, len(data)-1, len(data)))
				w.Header().Set("Content-Length", fmt.Sprint(int64(len(data))-start))
				w.WriteHeader(http.StatusPartialContent)
			} else {
				w.Header().Set("Content-Length", fmt.Sprint(len(data)))
				w.WriteHeader(http.StatusOK)
			}
			w.Write(data[start : start+int64(len(data))/3])
			w.(http.Flusher).Flush()
			panic(http.ErrAbortHandler)
		}
		http.ServeContent(w, r, "image", time.Unix(1700000000, 0), bytes.NewReader(data))
	}))
	defer srv.Close()

	fx := getFixture(t)
	dest, _, err := importURL(t, srv.URL+"/img", testImageSize, func(s *HTTPSource) {
		s.Checksum = "sha256:" + hex.EncodeToString(sum[:])
	})
	if err != nil {
		t.Fatal(err)
	}
	if got := fileSHA(t, dest); got != fx.rawSHA {
		t.Errorf("content %s, want %s", got, fx.rawSHA)
	}
	mu.Lock()
	defer mu.Unlock()
	third := len(data) / 3
	want := []string{"", fmt.Sprintf("bytes=%d-", third), fmt.Sprintf("bytes=%d-", 2*third)}
	if fmt.Sprint(requests) != fmt.Sprint(want) {
		t.Errorf("requests with ranges %q, want %q", requests, want)
	}
}

func TestTruncatedTransfer(t *testing.T) {
	data := readFixture(t, "disk.raw.gz")
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", fmt.Sprint(len(data)))
		w.WriteHeader(http.StatusOK)
		w.Write(data[:len(data)/2])
		w.(http.Flusher).Flush()
		panic(http.ErrAbortHandler)
	}))
	defer srv.Close()
	_, _, err := importURL(t, srv.URL+"/img", testImageSize, nil)
	wantReason(t, err, ReasonTruncated)
}

func TestTruncatedImages(t *testing.T) {
	for _, name := range []string{"disk.qcow2", "disk-c.qcow2", "disk.raw.gz", "disk.raw.xz", "disk.raw.zst"} {
		t.Run(name, func(t *testing.T) {
			data := readFixture(t, name)
			srv := serveBytes(t, data[:len(data)*2/3])
			_, _, err := importURL(t, srv.URL+"/img", testImageSize, nil)
			wantReason(t, err, ReasonTruncated)
		})
	}
}

func TestChecksum(t *testing.T) {
	fx := getFixture(t)
	srv := serveDir(t, fx.dir)
	for _, name := range []string{"disk.raw.gz", "disk.vmdk"} {
		data := readFixture(t, name)
		s256, s512 := sha256.Sum256(data), sha512.Sum512(data)
		for _, sum := range []string{"sha256:" + hex.EncodeToString(s256[:]), "SHA512:" + hex.EncodeToString(s512[:])} {
			if _, _, err := importURL(t, srv.URL+"/"+name, testImageSize, func(s *HTTPSource) { s.Checksum = sum }); err != nil {
				t.Errorf("%s with %s: %v", name, sum[:6], err)
			}
		}
		s256[0] ^= 1
		dest, _, err := importURL(t, srv.URL+"/"+name, testImageSize, func(s *HTTPSource) {
			s.Checksum = "sha256:" + hex.EncodeToString(s256[:])
		})
		wantReason(t, err, ReasonChecksumMismatch)
		if _, err := os.Stat(dest); !os.IsNotExist(err) {
			t.Errorf("%s: destination exists after a checksum mismatch", name)
		}
	}
	_, _, err := importURL(t, srv.URL+"/disk.raw", testImageSize, func(s *HTTPSource) { s.Checksum = "md5:abcd" })
	wantReason(t, err, ReasonInvalidRequest)
}

// TestTooLarge checks the virtual size against the capacity before the
// body is read.
func TestTooLarge(t *testing.T) {
	fx := getFixture(t)
	for _, name := range []string{"disk.raw", "disk.qcow2", "disk.vmdk", "disk.vhd", "disk.raw.gz", "disk.vhdx"} {
		t.Run(name, func(t *testing.T) {
			var sent atomic.Int64
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				f, err := os.Open(filepath.Join(fx.dir, name))
				if err != nil {
					t.Error(err)
					return
				}
				defer f.Close()
				st, _ := f.Stat()
				w.Header().Set("Content-Length", fmt.Sprint(st.Size()))
				n, _ := io.Copy(w, f)
				sent.Add(n)
			}))
			defer srv.Close()
			_, _, err := importURL(t, srv.URL+"/img", testImageSize/2, nil)
			wantReason(t, err, ReasonTooLarge)
		})
	}
}

// TestGzipBomb: 1 GiB of zeros in about 1 MiB of gzip must stop at the
// capacity.
func TestGzipBomb(t *testing.T) {
	var bomb bytes.Buffer
	zw, _ := gzip.NewWriterLevel(&bomb, gzip.BestCompression)
	zeros := make([]byte, 1<<20)
	for range 1024 {
		zw.Write(zeros)
	}
	zw.Close()
	srv := serveBytes(t, bomb.Bytes())
	start := time.Now()
	_, _, err := importURL(t, srv.URL+"/bomb", 16<<20, nil)
	wantReason(t, err, ReasonTooLarge)
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("bomb took %v to stop", d)
	}
}

func TestCorruptImages(t *testing.T) {
	qcow := readFixture(t, "disk.qcow2")
	badBits := bytes.Clone(qcow)
	badBits[23] = 40 // cluster bits
	badL1 := bytes.Clone(qcow)
	l1 := int(badL1[47]) | int(badL1[46])<<8 | int(badL1[45])<<16
	badL1[l1+6] |= 0x02 // first L2 offset no longer cluster aligned
	compressed := bytes.Clone(readFixture(t, "disk-c.qcow2"))
	for i := len(compressed) / 2; i < len(compressed)/2+256<<10; i++ {
		compressed[i] = 0xff
	}
	badGz := bytes.Clone(readFixture(t, "disk.raw.gz"))
	for i := 100; i < 4096; i++ {
		badGz[i] ^= 0x5a
	}
	vmdk := bytes.Clone(readFixture(t, "disk.vmdk"))
	for i := 512; i < 64<<10; i++ {
		vmdk[i] = 0xee
	}
	for _, c := range []struct {
		name string
		data []byte
		want Reason
	}{
		{"qcow2 cluster bits", badBits, ReasonInvalidImage},
		{"qcow2 l1 entry", badL1, ReasonInvalidImage},
		{"qcow2 compressed data", compressed, ReasonInvalidImage},
		{"gzip stream", badGz, ReasonInvalidImage},
		{"vmdk metadata", vmdk, ReasonInvalidImage},
	} {
		t.Run(c.name, func(t *testing.T) {
			srv := serveBytes(t, c.data)
			_, _, err := importURL(t, srv.URL+"/img", testImageSize, nil)
			wantReason(t, err, c.want)
		})
	}
}

func TestHTTPStatus(t *testing.T) {
	var calls atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		if strings.HasSuffix(r.URL.Path, "/broken") {
			http.Error(w, "oops", http.StatusBadGateway)
			return
		}
		http.NotFound(w, r)
	}))
	defer srv.Close()
	_, _, err := importURL(t, srv.URL+"/missing", testImageSize, nil)
	wantReason(t, err, ReasonSourceNotFound)
	calls.Store(0)
	_, _, err = importURL(t, srv.URL+"/broken", testImageSize, nil)
	wantReason(t, err, ReasonSourceUnreachable)
	if n := calls.Load(); n != 3 {
		t.Errorf("%d requests for a 502, want 1 + 2 retries", n)
	}
}

func TestCancel(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", fmt.Sprint(testImageSize))
		chunk := bytes.Repeat([]byte{7}, 64<<10)
		for range testImageSize / len(chunk) {
			if _, err := w.Write(chunk); err != nil {
				return
			}
			w.(http.Flusher).Flush()
			time.Sleep(20 * time.Millisecond)
		}
	}))
	defer srv.Close()
	dir := t.TempDir()
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(300*time.Millisecond, cancel)
	_, err := Import(ctx, Request{
		Source: Source{HTTP: &HTTPSource{AllowedNetworks: testNetworks, URL: srv.URL}}, Dest: filepath.Join(dir, "disk.img"), Capacity: testImageSize,
	})
	wantReason(t, err, ReasonCanceled)
	if left := leftovers(t, dir); len(left) != 0 {
		t.Errorf("canceled import left behind: %v", left)
	}
}

func TestProxy(t *testing.T) {
	fx := getFixture(t)
	origin := serveDir(t, fx.dir)
	var proxied atomic.Int32
	rp := &httputil.ReverseProxy{Rewrite: func(r *httputil.ProxyRequest) {}}
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !r.URL.IsAbs() {
			http.Error(w, "not a proxy request", http.StatusBadRequest)
			return
		}
		proxied.Add(1)
		rp.ServeHTTP(w, r)
	}))
	defer proxy.Close()

	dest, _, err := importURL(t, origin.URL+"/disk.raw.zst", testImageSize, func(s *HTTPSource) {
		s.Proxy = &Proxy{HTTPProxy: proxy.URL, NoProxy: "example.com"}
	})
	if err != nil {
		t.Fatal(err)
	}
	if proxied.Load() == 0 {
		t.Error("request did not go through the proxy")
	}
	if got := fileSHA(t, dest); got != fx.rawSHA {
		t.Errorf("content %s, want %s", got, fx.rawSHA)
	}
	proxied.Store(0)
	if _, _, err := importURL(t, origin.URL+"/disk.raw.zst", testImageSize, func(s *HTTPSource) {
		s.Proxy = &Proxy{HTTPProxy: proxy.URL, NoProxy: "10.0.0.0/8, 127.0.0.0/8"}
	}); err != nil {
		t.Fatal(err)
	}
	if proxied.Load() != 0 {
		t.Error("noProxy host went through the proxy")
	}
}

// TestResumeAfterStall: a connection that goes silent is dropped after the
// idle timeout and resumed.
func TestResumeAfterStall(t *testing.T) {
	data := readFixture(t, "disk.raw.zst")
	var calls atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("ETag", `"v1"`)
		if calls.Add(1) == 1 {
			w.Header().Set("Content-Length", fmt.Sprint(len(data)))
			w.Write(data[:len(data)/2])
			w.(http.Flusher).Flush()
			select {
			case <-r.Context().Done():
			case <-time.After(10 * time.Second):
			}
			return
		}
		if r.Header.Get("Range") == "" {
			t.Error("second request does not resume")
		}
		http.ServeContent(w, r, "image", time.Unix(1700000000, 0), bytes.NewReader(data))
	}))
	defer srv.Close()
	start := time.Now()
	dest, _, err := importURL(t, srv.URL+"/img", testImageSize, func(s *HTTPSource) { s.IdleTimeout = 300 * time.Millisecond })
	if err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("stall detected after %v", d)
	}
	if got := fileSHA(t, dest); got != getFixture(t).rawSHA {
		t.Errorf("content %s, want %s", got, getFixture(t).rawSHA)
	}
}

// TestProgress checks the reports of a streamed and a qemu-img import: in
// order, "NN.NN%" formatted, ending at 100.00%.
func TestProgress(t *testing.T) {
	fx := getFixture(t)
	// A slow server so that several reports happen.
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := os.ReadFile(filepath.Join(fx.dir, strings.TrimPrefix(r.URL.Path, "/")))
		w.Header().Set("Content-Length", fmt.Sprint(len(b)))
		for i := 0; i < len(b); i += len(b) / 8 {
			w.Write(b[i:min(len(b), i+len(b)/8)])
			w.(http.Flusher).Flush()
			time.Sleep(100 * time.Millisecond)
		}
	}))
	defer srv.Close()
	for _, name := range []string{"disk.qcow2", "disk.vhdx"} {
		var got []Progress
		_, err := Import(context.Background(), Request{
			Source: Source{HTTP: &HTTPSource{AllowedNetworks: testNetworks, URL: srv.URL + "/" + name}}, Dest: filepath.Join(t.TempDir(), "d"),
			Capacity: testImageSize, Progress: func(p Progress) { got = append(got, p) },
		})
		if err != nil {
			t.Fatal(err)
		}
		if len(got) < 3 {
			t.Fatalf("%s: only %d progress reports", name, len(got))
		}
		for i := 1; i < len(got); i++ {
			if got[i].Percent < got[i-1].Percent || got[i].Bytes < got[i-1].Bytes {
				t.Errorf("%s: progress went back: %v then %v", name, got[i-1], got[i])
			}
		}
		if last := got[len(got)-1]; last.String() != "100.00%" || last.Total == 0 {
			t.Errorf("%s: last report %+v", name, last)
		}
		if mid := got[len(got)/2].String(); !regexp.MustCompile(`^\d{1,3}\.\d\d%$`).MatchString(mid) {
			t.Errorf("%s: progress %q not NN.NN%%", name, mid)
		}
	}
}

func TestQemuProgressParsing(t *testing.T) {
	out := "    (0.00/100%)\r    (12.50/100%)\r    (100.00/100%)\r\n"
	var pcts []float64
	sc := bufio.NewScanner(strings.NewReader(out))
	sc.Split(splitCR)
	for sc.Scan() {
		if m := qemuProgress.FindSubmatch(sc.Bytes()); m != nil {
			v, _ := strconv.ParseFloat(string(m[1]), 64)
			pcts = append(pcts, v)
		}
	}
	if fmt.Sprint(pcts) != "[0 12.5 100]" {
		t.Errorf("parsed %v", pcts)
	}
}
