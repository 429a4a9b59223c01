package importer

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/sha512"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"log/slog"
	"net/http"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/nodevirt/nodevirt/clusterbrain/kit/reach"
)

// HTTPSource is an image served over HTTP or HTTPS (a DataVolume's
// spec.source.http, with its ConfigMap and Secrets already read).
type HTTPSource struct {
	URL string
	// CACertPEM holds extra trusted CA certificates (the certConfigMap),
	// added to the system pool.
	CACertPEM []byte
	// Username and Password (the secretRef) are sent as basic auth when
	// Username is set.
	Username, Password string
	// ExtraHeaders and SecretExtraHeaders are "Name: value" lines sent with
	// every request; secret ones are never logged.
	ExtraHeaders, SecretExtraHeaders []string
	// Checksum is "sha256:<hex>" or "sha512:<hex>", verified over the bytes
	// as served before the import is committed. Empty: not checked.
	Checksum string
	// Proxy, when set, routes requests through a proxy; nil means direct
	// (the process environment is not consulted).
	Proxy *Proxy
	// Retries is how many times a failed request or a dropped connection
	// is retried (a dropped body resumes with a Range request). 0 means 5;
	// negative means none.
	Retries int
	// RetryDelay is the wait before the first retry, doubled each time up
	// to 10s. 0 means 500ms.
	RetryDelay time.Duration
	// IdleTimeout drops a connection that delivers nothing for this long
	// (it is then resumed like a dropped one). 0 means 60s.
	IdleTimeout time.Duration
	// AllowedNetworks are addresses the import may reach although the
	// default policy forbids them (loopback, link-local, this node's own
	// addresses); see package reach.
	AllowedNetworks []netip.Prefix
}

// drainLimit bounds what is read past the end of an image to verify a
// checksum or digest.
const drainLimit = 64 << 20

func importHTTP(ctx context.Context, req Request) (Result, error) {
	hs := req.HTTP
	headers, err := parseHeaders(append(append([]string(nil), hs.ExtraHeaders...), hs.SecretExtraHeaders...))
	if err != nil {
		return Result{}, err
	}
	client, err := newHTTPClient(hs.CACertPEM, hs.Proxy, hs.AllowedNetworks)
	if err != nil {
		return Result{}, err
	}
	defer client.CloseIdleConnections()
	retries, delay := hs.Retries, hs.RetryDelay
	if retries == 0 {
		retries = 5
	}
	if delay == 0 {
		delay = 500 * time.Millisecond
	}
	idle := hs.IdleTimeout
	if idle == 0 {
		idle = 60 * time.Second
	}
	hr := &httpReader{
		ctx: ctx, client: client, src: hs, headers: headers, log: req.logger().With("url", redactURL(hs.URL), "dest", req.Dest),
		total: -1, retriesLeft: max(retries, 0), delay: delay, idle: idle,
	}
	if err := hr.open(); err != nil {
		return Result{}, err
	}
	defer hr.close()

	algo, want, _ := parseChecksum(hs.Checksum)
	t := newTracker(req.Progress, hr.total)
	var src io.Reader = &countingReader{r: hr, t: t}
	var sum hash.Hash
	switch algo {
	case "sha256":
		sum = sha256.New()
	case "sha512":
		sum = sha512.New()
	}
	if sum != nil {
		src = io.TeeReader(src, sum)
	}
	finish := func() error {
		n, err := io.Copy(io.Discard, io.LimitReader(src, drainLimit+1))
		if err != nil {
			return err
		}
		if n > drainLimit {
			return failf(ReasonTooLarge, "source continues far past the end of the image")
		}
		if sum != nil && !bytes.Equal(sum.Sum(nil), want) {
			return failf(ReasonChecksumMismatch, "%s of the download is %x, want %x", algo, sum.Sum(nil), want)
		}
		return nil
	}
	return importStream(ctx, req, src, hr.total, t, finish)
}

// parseChecksum splits "sha256:<hex>"/"sha512:<hex>"; "" is no checksum.
func parseChecksum(s string) (algo string, sum []byte, err error) {
	if s == "" {
		return "", nil, nil
	}
	algo, hexSum, ok := strings.Cut(s, ":")
	algo = strings.ToLower(algo)
	want := map[string]int{"sha256": sha256.Size, "sha512": sha512.Size}[algo]
	if !ok || want == 0 {
		return "", nil, failf(ReasonInvalidRequest, "checksum %q: want sha256:<hex> or sha512:<hex>", s)
	}
	sum, err = hex.DecodeString(hexSum)
	if err != nil || len(sum) != want {
		return "", nil, failf(ReasonInvalidRequest, "checksum %q: bad %s digest", s, algo)
	}
	return algo, sum, nil
}

func parseHeaders(lines []string) (http.Header, error) {
	h := http.Header{}
	for _, l := range lines {
		name, value, ok := strings.Cut(l, ":")
		name = strings.TrimSpace(name)
		if !ok || name == "" {
			return nil, failf(ReasonInvalidRequest, "header %q: want \"Name: value\"", strings.SplitN(l, ":", 2)[0])
		}
		if forbiddenHeaders[http.CanonicalHeaderKey(name)] || strings.HasPrefix(http.CanonicalHeaderKey(name), "Proxy-") {
			return nil, failf(ReasonInvalidRequest, "header %q may not be set by an import", name)
		}
		h.Add(name, strings.TrimSpace(value))
	}
	return h, nil
}

// newHTTPClient builds a client of the reach policy (package reach)
// trusting the system CAs plus caPEM (and the proxy's CA).
func newHTTPClient(caPEM []byte, proxy *Proxy, allowed []netip.Prefix) (*http.Client, error) {
	c, err := reach.NewClient(reach.Config{CACertPEM: caPEM, Proxy: proxy, AllowedNetworks: allowed})
	if err != nil {
		return nil, &Error{Reason: ReasonInvalidRequest, Err: err}
	}
	return c, nil
}

// redactURL drops any user:password from a URL for logging.
func redactURL(s string) string {
	u, err := url.Parse(s)
	if err != nil {
		return "<unparsable url>"
	}
	return u.Redacted()
}

// httpReader reads an HTTP resource, reconnecting with a Range request
// after a dropped connection.
type httpReader struct {
	ctx         context.Context
	client      *http.Client
	src         *HTTPSource
	headers     http.Header
	log         *slog.Logger
	body        io.ReadCloser
	off         int64
	total       int64  // -1 when the server did not say
	etag        string // of the first response
	validator   string // If-Range value: a strong ETag or Last-Modified
	retriesLeft int
	delay       time.Duration
	idle        time.Duration
	stalled     atomic.Bool
	watchdog    *time.Timer // closes a body that stays silent for idle
	watched     io.ReadCloser
}

func (h *httpReader) close() {
	if h.watchdog != nil {
		h.watchdog.Stop()
	}
	if h.body != nil {
		h.body.Close()
		h.body = nil
	}
}

// open (re)connects at h.off, retrying transient failures.
func (h *httpReader) open() error {
	for {
		retry, err := h.request()
		if err == nil {
			return nil
		}
		if !retry || h.retriesLeft <= 0 || h.ctx.Err() != nil {
			return err
		}
		h.retriesLeft--
		h.log.Info("retrying download", "offset", h.off, "err", err)
		if err := h.wait(); err != nil {
			return err
		}
	}
}

func (h *httpReader) wait() error {
	t := time.NewTimer(h.delay)
	defer t.Stop()
	h.delay = min(2*h.delay, 10*time.Second)
	select {
	case <-h.ctx.Done():
		return h.ctx.Err()
	case <-t.C:
		return nil
	}
}

func (h *httpReader) request() (retry bool, err error) {
	req, err := http.NewRequestWithContext(h.ctx, http.MethodGet, h.src.URL, nil)
	if err != nil {
		return false, failf(ReasonInvalidRequest, "url %s: %w", redactURL(h.src.URL), err)
	}
	for k, vs := range h.headers {
		req.Header[k] = append([]string(nil), vs...)
	}
	if h.src.Username != "" {
		req.SetBasicAuth(h.src.Username, h.src.Password)
	}
	if h.off > 0 {
		req.Header.Set("Range", fmt.Sprintf("bytes=%d-", h.off))
		if h.validator != "" {
			req.Header.Set("If-Range", h.validator)
		}
	}
	resp, err := h.client.Do(req)
	if err != nil {
		var uerr *url.Error
		if errors.As(err, &uerr) {
			err = uerr.Err
		}
		// An address imports may not reach stays so.
		if unreachableReason(err) == ReasonNetworkNotAllowed {
			return false, failf(ReasonNetworkNotAllowed, "get %s: %w", redactURL(h.src.URL), err)
		}
		// A certificate that does not verify will not verify next time.
		var cve *tls.CertificateVerificationError
		retry := !errors.As(err, &cve)
		return retry, failf(ReasonSourceUnreachable, "get %s: %w", redactURL(h.src.URL), err)
	}
	ok := false
	defer func() {
		if !ok {
			resp.Body.Close()
		}
	}()
	switch code := resp.StatusCode; {
	case code == http.StatusOK:
		if h.off == 0 {
			h.total = resp.ContentLength
			h.etag = resp.Header.Get("ETag")
			h.validator = h.etag
			if strings.HasPrefix(h.validator, "W/") || h.validator == "" {
				h.validator = resp.Header.Get("Last-Modified")
			}
			break
		}
		// The server ignored the range: skip what we have, if it is the
		// same resource.
		if (h.etag != "" && resp.Header.Get("ETag") != h.etag) ||
			(h.total >= 0 && resp.ContentLength >= 0 && resp.ContentLength != h.total) {
			return false, failf(ReasonSourceChanged, "%s changed while downloading", redactURL(h.src.URL))
		}
		if _, err := io.CopyN(io.Discard, resp.Body, h.off); err != nil {
			return true, failf(ReasonSourceUnreachable, "skip to byte %d: %w", h.off, err)
		}
	case code == http.StatusPartialContent && h.off > 0:
		start, err := contentRangeStart(resp.Header.Get("Content-Range"))
		if err != nil || start != h.off {
			return false, failf(ReasonSourceChanged, "resume at %d answered with range %q", h.off, resp.Header.Get("Content-Range"))
		}
	case code == http.StatusRequestedRangeNotSatisfiable && h.total >= 0 && h.off >= h.total:
		resp.Body.Close()
		h.body = io.NopCloser(bytes.NewReader(nil))
		ok = true
		return false, nil
	case code == http.StatusUnauthorized || code == http.StatusForbidden:
		return false, failf(ReasonUnauthorized, "get %s: %s", redactURL(h.src.URL), resp.Status)
	case code == http.StatusNotFound || code == http.StatusGone:
		return false, failf(ReasonSourceNotFound, "get %s: %s", redactURL(h.src.URL), resp.Status)
	case code >= 500 || code == http.StatusTooManyRequests || code == http.StatusRequestTimeout:
		return true, failf(ReasonSourceUnreachable, "get %s: %s", redactURL(h.src.URL), resp.Status)
	default:
		return false, failf(ReasonSourceUnreachable, "get %s: unexpected %s", redactURL(h.src.URL), resp.Status)
	}
	h.body, ok = resp.Body, true
	return false, nil
}

func contentRangeStart(v string) (int64, error) {
	spec, ok := strings.CutPrefix(v, "bytes ")
	if !ok {
		return 0, fmt.Errorf("bad content-range %q", v)
	}
	start, _, _ := strings.Cut(spec, "-")
	return strconv.ParseInt(start, 10, 64)
}

func (h *httpReader) Read(p []byte) (int, error) {
	for {
		if h.body == nil {
			if h.total >= 0 && h.off >= h.total {
				return 0, io.EOF
			}
			if err := h.open(); err != nil {
				return 0, err
			}
		}
		n, err := h.readWatched(p)
		h.off += int64(n)
		if err == nil {
			return n, nil
		}
		if err == io.EOF {
			if h.total < 0 || h.off == h.total {
				return n, io.EOF
			}
			if h.off > h.total {
				return n, failf(ReasonSourceChanged, "server sent more than its content length %d", h.total)
			}
			err = io.ErrUnexpectedEOF
		}
		if h.ctx.Err() != nil {
			return n, h.ctx.Err()
		}
		h.close()
		if h.retriesLeft <= 0 {
			return n, failf(ReasonTruncated, "download broke at byte %d of %d: %w", h.off, h.total, err)
		}
		h.retriesLeft--
		h.log.Info("connection dropped, resuming", "offset", h.off, "err", err)
		if werr := h.wait(); werr != nil {
			return n, werr
		}
		if n > 0 {
			return n, nil
		}
	}
}

// readWatched reads the body under the idle watchdog, which closes a
// silent body so that the blocked Read returns and the download resumes.
func (h *httpReader) readWatched(p []byte) (int, error) {
	body := h.body
	if h.watched != body {
		if h.watchdog != nil {
			h.watchdog.Stop()
		}
		h.watched = body
		h.watchdog = time.AfterFunc(h.idle, func() {
			h.stalled.Store(true)
			body.Close()
		})
	} else {
		h.watchdog.Reset(h.idle)
	}
	n, err := body.Read(p)
	if !h.watchdog.Stop() && h.stalled.Swap(false) {
		err = fmt.Errorf("no data for %v", h.idle)
	}
	return n, err
}
