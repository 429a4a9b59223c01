// Package registry is a client of the OCI distribution API, as far as
// nodevirt pulls images: it parses docker://host/repository[:tag|@digest]
// references, answers a registry's auth challenge (basic credentials or a
// bearer token from the challenge's realm), resolves a tag through an
// image index to one platform's layers, fetches manifests and blobs, and
// tells the digest a tag names now. Extra CAs, insecure registries (TLS
// not verified, or plain HTTP) and a proxy are honoured, and every
// connection goes through the reach policy of package reach.
//
// Both daemons use it: the node agent's importer (which downloads a layer
// and looks for the disk in it) and containerDisk puller, and the brain's
// DataImportCron controller, which polls a tag's digest.
//
// Every failure is an *Error whose Kind says what went wrong; a connection
// the reach policy refused also has a *reach.NotAllowedError in its chain.
package registry

import (
	"context"
	"crypto/sha256"
	"crypto/sha512"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io"
	"mime"
	"net/http"
	"net/netip"
	"net/url"
	"slices"
	"strings"

	"github.com/nodevirt/nodevirt/clusterbrain/kit/reach"
)

// Source is an image in a container registry and how to reach it.
type Source struct {
	// URL is docker://host[:port]/repository[:tag|@sha256:digest].
	URL string
	// CACertPEM holds extra trusted CA certificates.
	CACertPEM []byte
	// Username and Password are used for basic auth and to obtain bearer
	// tokens.
	Username, Password string
	// InsecureRegistries lists host[:port] entries reached without TLS
	// verification, or over plain HTTP.
	InsecureRegistries []string
	// Proxy, when set, routes requests through a proxy.
	Proxy *reach.Proxy
	// Platform chosen from an image index, "os/architecture"; default
	// "linux/amd64".
	Platform string
	// AllowedNetworks are addresses the client may reach although the
	// reach policy forbids them.
	AllowedNetworks []netip.Prefix
}

// Kind says what went wrong.
type Kind int

const (
	// KindInvalidSource: the Source itself is wrong (URL, CA bundle).
	KindInvalidSource Kind = iota
	// KindUnreachable: the registry could not be reached, or answered
	// with an error other than the ones below.
	KindUnreachable
	// KindUnauthorized: the registry refused the credentials, or wants
	// some and none were given.
	KindUnauthorized
	// KindNotFound: no such repository, tag, blob, or platform.
	KindNotFound
	// KindInvalidImage: a manifest is malformed, too large or without
	// layers, or a digest is malformed.
	KindInvalidImage
	// KindDigestMismatch: content does not hash to its digest.
	KindDigestMismatch
)

// Error is the error of every failed call.
type Error struct {
	Kind Kind
	Err  error
}

func (e *Error) Error() string { return e.Err.Error() }

func (e *Error) Unwrap() error { return e.Err }

func errorf(kind Kind, format string, args ...any) *Error {
	return &Error{Kind: kind, Err: fmt.Errorf(format, args...)}
}

// unreachable wraps a failed request; a refused connection stays
// recognisable through its *reach.NotAllowedError.
func unreachable(format string, args ...any) *Error {
	return errorf(KindUnreachable, format, args...)
}

// Media types of manifests and image indexes.
const (
	MediaOCIIndex    = "application/vnd.oci.image.index.v1+json"
	MediaOCIManifest = "application/vnd.oci.image.manifest.v1+json"
	MediaDockerList  = "application/vnd.docker.distribution.manifest.list.v2+json"
	MediaDockerV2    = "application/vnd.docker.distribution.manifest.v2+json"
)

const (
	maxManifestBytes = 4 << 20
	maxIndexDepth    = 2
)

// Descriptor points at a manifest or a blob.
type Descriptor struct {
	MediaType string    `json:"mediaType"`
	Digest    string    `json:"digest"`
	Size      int64     `json:"size"`
	Platform  *Platform `json:"platform,omitempty"`
}

// Platform is what an image index entry runs on.
type Platform struct {
	OS           string `json:"os"`
	Architecture string `json:"architecture"`
}

// Manifest is an image manifest or an image index.
type Manifest struct {
	MediaType string       `json:"mediaType"`
	Manifests []Descriptor `json:"manifests"` // an index
	Layers    []Descriptor `json:"layers"`    // an image manifest
}

// Client talks to the registry of one Source. It is not safe for
// concurrent use (it keeps the answered auth challenge).
type Client struct {
	src  Source
	host string
	repo string
	ref  string
	base string // scheme://host
	http *http.Client
	auth string // Authorization header once a challenge was answered
}

// New parses src.URL and builds a client for its registry. For an
// insecure registry it probes whether the registry speaks TLS at all.
func New(ctx context.Context, src Source) (*Client, error) {
	host, repo, ref, err := ParseURL(src.URL)
	if err != nil {
		return nil, err
	}
	insecure := slices.Contains(src.InsecureRegistries, host)
	hc, err := reach.NewClient(reach.Config{CACertPEM: src.CACertPEM, Proxy: src.Proxy, Insecure: insecure, AllowedNetworks: src.AllowedNetworks})
	if err != nil {
		return nil, &Error{Kind: KindInvalidSource, Err: err}
	}
	c := &Client{src: src, host: host, repo: repo, ref: ref, base: "https://" + host, http: hc}
	if insecure {
		// An insecure registry may not speak TLS at all.
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.base+"/v2/", nil)
		if err != nil {
			return nil, errorf(KindInvalidSource, "registry request: %w", err)
		}
		resp, err := c.http.Do(req)
		var rh tls.RecordHeaderError
		switch {
		case errors.Is(err, http.ErrSchemeMismatch) || errors.As(err, &rh):
			c.base = "http://" + host
		case err == nil:
			resp.Body.Close()
		}
	}
	return c, nil
}

// Close releases the client's idle connections.
func (c *Client) Close() { c.http.CloseIdleConnections() }

// Ref is the tag or digest the URL names ("latest" when it names none).
func (c *Client) Ref() string { return c.ref }

// ParseURL splits docker://host[:port]/repo[:tag|@digest]; ref is
// "latest" when the URL names neither tag nor digest.
func ParseURL(s string) (host, repo, ref string, err error) {
	rest, ok := strings.CutPrefix(s, "docker://")
	if !ok {
		return "", "", "", errorf(KindInvalidSource, "registry url %q: want docker://host/repository[:tag]", s)
	}
	host, rest, ok = strings.Cut(rest, "/")
	if !ok || host == "" || rest == "" {
		return "", "", "", errorf(KindInvalidSource, "registry url %q: want docker://host/repository[:tag]", s)
	}
	if repo, ref, ok = strings.Cut(rest, "@"); ok {
		return host, repo, ref, nil
	}
	repo, ref = rest, "latest"
	if i := strings.LastIndex(rest, ":"); i > strings.LastIndex(rest, "/") {
		repo, ref = rest[:i], rest[i+1:]
	}
	return host, repo, ref, nil
}

// ResolveDigest returns the digest of the manifest (or image index) that
// src.URL names, without downloading any layer: the URL's own digest when
// it names one, else the digest of what the registry serves for the tag
// now. Pulling docker://host/repo@<digest> afterwards reads exactly that
// image.
func ResolveDigest(ctx context.Context, src Source) (string, error) {
	c, err := New(ctx, src)
	if err != nil {
		return "", err
	}
	defer c.Close()
	return c.Digest(ctx)
}

// Digest is ResolveDigest for the client's Source.
func (c *Client) Digest(ctx context.Context) (string, error) {
	if strings.Contains(c.ref, ":") {
		return c.ref, nil
	}
	body, _, err := c.fetchManifest(ctx, c.ref)
	if err != nil {
		return "", err
	}
	sum := sha256.Sum256(body)
	return "sha256:" + hex.EncodeToString(sum[:]), nil
}

// Layers resolves the reference (through image indexes, choosing
// Source.Platform) to the image's layers.
func (c *Client) Layers(ctx context.Context) ([]Descriptor, error) {
	ref := c.ref
	for range maxIndexDepth + 1 {
		m, err := c.manifest(ctx, ref)
		if err != nil {
			return nil, err
		}
		if len(m.Manifests) == 0 {
			if len(m.Layers) == 0 {
				return nil, errorf(KindInvalidImage, "manifest %s has no layers", ref)
			}
			return m.Layers, nil
		}
		want := c.src.Platform
		if want == "" {
			want = "linux/amd64"
		}
		ref = ""
		for _, d := range m.Manifests {
			if d.Platform == nil || d.Platform.OS+"/"+d.Platform.Architecture == want {
				ref = d.Digest
				break
			}
		}
		if ref == "" {
			return nil, errorf(KindNotFound, "image index has no %s manifest", want)
		}
	}
	return nil, errorf(KindInvalidImage, "image indexes nest too deep")
}

// Blob opens a blob. The body is not verified: hash it with DigestHash.
func (c *Client) Blob(ctx context.Context, d Descriptor) (io.ReadCloser, error) {
	resp, err := c.get(ctx, "/v2/"+c.repo+"/blobs/"+d.Digest)
	if err != nil {
		return nil, err
	}
	return resp.Body, nil
}

// fetchManifest reads the manifest ref names, bounded in size.
func (c *Client) fetchManifest(ctx context.Context, ref string) (body []byte, contentType string, err error) {
	resp, err := c.get(ctx, "/v2/"+c.repo+"/manifests/"+ref, MediaOCIIndex, MediaOCIManifest, MediaDockerList, MediaDockerV2)
	if err != nil {
		return nil, "", err
	}
	defer resp.Body.Close()
	body, err = io.ReadAll(io.LimitReader(resp.Body, maxManifestBytes+1))
	if err != nil {
		return nil, "", unreachable("read manifest %s: %w", ref, err)
	}
	if len(body) > maxManifestBytes {
		return nil, "", errorf(KindInvalidImage, "manifest %s is too large", ref)
	}
	return body, resp.Header.Get("Content-Type"), nil
}

func (c *Client) manifest(ctx context.Context, ref string) (*Manifest, error) {
	body, contentType, err := c.fetchManifest(ctx, ref)
	if err != nil {
		return nil, err
	}
	if strings.Contains(ref, ":") {
		if err := checkDigest(ref, body); err != nil {
			return nil, err
		}
	}
	var m Manifest
	if err := json.Unmarshal(body, &m); err != nil {
		return nil, errorf(KindInvalidImage, "manifest %s: %w", ref, err)
	}
	mt, _, _ := mime.ParseMediaType(contentType)
	if m.MediaType == "" {
		m.MediaType = mt
	}
	return &m, nil
}

// DigestHash returns a hash of digest's algorithm (sha256 or sha512) and
// the sum digest wants.
func DigestHash(digest string) (hash.Hash, []byte, error) {
	algo, hexSum, _ := strings.Cut(digest, ":")
	want, err := hex.DecodeString(hexSum)
	var h hash.Hash
	switch algo {
	case "sha256":
		h = sha256.New()
	case "sha512":
		h = sha512.New()
	}
	if h == nil || err != nil || len(want) != h.Size() {
		return nil, nil, errorf(KindInvalidImage, "bad digest %q", digest)
	}
	return h, want, nil
}

func checkDigest(digest string, body []byte) error {
	h, want, err := DigestHash(digest)
	if err != nil {
		return err
	}
	h.Write(body)
	if got := h.Sum(nil); string(got) != string(want) {
		return errorf(KindDigestMismatch, "content of %s hashes to %x", digest, got)
	}
	return nil
}

// get fetches a registry path, answering one auth challenge.
func (c *Client) get(ctx context.Context, p string, accept ...string) (*http.Response, error) {
	for attempt := 0; ; attempt++ {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.base+p, nil)
		if err != nil {
			return nil, errorf(KindInvalidSource, "registry request: %w", err)
		}
		for _, a := range accept {
			req.Header.Add("Accept", a)
		}
		if c.auth != "" {
			req.Header.Set("Authorization", c.auth)
		}
		resp, err := c.http.Do(req)
		if err != nil {
			return nil, unreachable("registry %s: %w", c.host, err)
		}
		switch {
		case resp.StatusCode == http.StatusOK:
			return resp, nil
		case resp.StatusCode == http.StatusUnauthorized && attempt == 0:
			challenge := resp.Header.Get("WWW-Authenticate")
			resp.Body.Close()
			if err := c.answer(ctx, challenge); err != nil {
				return nil, err
			}
			continue
		}
		resp.Body.Close()
		switch resp.StatusCode {
		case http.StatusUnauthorized, http.StatusForbidden:
			return nil, errorf(KindUnauthorized, "registry %s%s: %s", c.host, p, resp.Status)
		case http.StatusNotFound:
			return nil, errorf(KindNotFound, "registry %s%s: %s", c.host, p, resp.Status)
		}
		return nil, unreachable("registry %s%s: %s", c.host, p, resp.Status)
	}
}

// answer sets c.auth from a WWW-Authenticate challenge: basic credentials,
// or a bearer token fetched from the challenge's realm.
func (c *Client) answer(ctx context.Context, challenge string) error {
	scheme, params, _ := strings.Cut(challenge, " ")
	switch strings.ToLower(scheme) {
	case "basic":
		if c.src.Username == "" {
			return errorf(KindUnauthorized, "registry %s wants credentials", c.host)
		}
		req, _ := http.NewRequest(http.MethodGet, "/", nil)
		req.SetBasicAuth(c.src.Username, c.src.Password)
		c.auth = req.Header.Get("Authorization")
		return nil
	case "bearer":
	default:
		return errorf(KindUnauthorized, "registry %s: unsupported auth challenge %q", c.host, scheme)
	}
	p := parseAuthParams(params)
	realm, err := url.Parse(p["realm"])
	if err != nil || p["realm"] == "" {
		return errorf(KindUnauthorized, "registry %s: bad bearer realm %q", c.host, p["realm"])
	}
	q := realm.Query()
	if p["service"] != "" {
		q.Set("service", p["service"])
	}
	scope := p["scope"]
	if scope == "" {
		scope = "repository:" + c.repo + ":pull"
	}
	q.Set("scope", scope)
	realm.RawQuery = q.Encode()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, realm.String(), nil)
	if err != nil {
		return errorf(KindUnauthorized, "token request: %w", err)
	}
	if c.src.Username != "" {
		req.SetBasicAuth(c.src.Username, c.src.Password)
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return unreachable("token request: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return errorf(KindUnauthorized, "token request to %s: %s", realm.Host, resp.Status)
	}
	var tok struct {
		Token       string `json:"token"`
		AccessToken string `json:"access_token"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&tok); err != nil {
		return errorf(KindUnauthorized, "token response: %w", err)
	}
	if tok.Token == "" {
		tok.Token = tok.AccessToken
	}
	if tok.Token == "" {
		return errorf(KindUnauthorized, "token response from %s has no token", realm.Host)
	}
	c.auth = "Bearer " + tok.Token
	return nil
}

// parseAuthParams reads key="value" pairs of a challenge.
func parseAuthParams(s string) map[string]string {
	out := map[string]string{}
	for s = strings.TrimSpace(s); s != ""; s = strings.TrimLeft(strings.TrimSpace(s), ",") {
		k, rest, ok := strings.Cut(s, "=")
		if !ok {
			break
		}
		k = strings.ToLower(strings.TrimSpace(k))
		rest = strings.TrimSpace(rest)
		var v string
		if strings.HasPrefix(rest, `"`) {
			end := strings.Index(rest[1:], `"`)
			if end < 0 {
				v, rest = rest[1:], ""
			} else {
				v, rest = rest[1:1+end], rest[2+end:]
			}
		} else {
			v, rest, _ = strings.Cut(rest, ",")
		}
		out[k] = v
		s = rest
	}
	return out
}
