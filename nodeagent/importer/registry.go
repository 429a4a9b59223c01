package importer

import (
	"archive/tar"
	"bufio"
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
	"path"
	"slices"
	"strings"
)

// RegistrySource is a disk image in a container registry, laid out like a
// KubeVirt containerDisk: one file under /disk/ in a layer (a DataVolume's
// spec.source.registry, with its Secret and ConfigMap already read).
type RegistrySource struct {
	// URL is docker://host[:port]/repository[:tag|@sha256:digest].
	URL string
	// CACertPEM holds extra trusted CA certificates (the certConfigMap).
	CACertPEM []byte
	// Username and Password (the secretRef) are used for basic auth and to
	// obtain bearer tokens.
	Username, Password string
	// InsecureRegistries lists host[:port] entries (the CDI configuration)
	// reached without TLS verification, or over plain HTTP.
	InsecureRegistries []string
	// Proxy, when set, routes requests through a proxy.
	Proxy *Proxy
	// Platform chosen from an image index, "os/architecture"; default
	// "linux/amd64".
	Platform string
	// File is the disk's path inside the image (a containerDisk's path);
	// empty means the first regular file under /disk/.
	File string
	// AllowedNetworks are addresses the pull may reach although the
	// default policy forbids them (see HTTPSource.AllowedNetworks).
	AllowedNetworks []netip.Prefix
}

const (
	mediaOCIIndex    = "application/vnd.oci.image.index.v1+json"
	mediaOCIManifest = "application/vnd.oci.image.manifest.v1+json"
	mediaDockerList  = "application/vnd.docker.distribution.manifest.list.v2+json"
	mediaDockerV2    = "application/vnd.docker.distribution.manifest.v2+json"
	maxManifestBytes = 4 << 20
	maxIndexDepth    = 2
)

type ociDescriptor struct {
	MediaType string `json:"mediaType"`
	Digest    string `json:"digest"`
	Size      int64  `json:"size"`
	Platform  *struct {
		OS           string `json:"os"`
		Architecture string `json:"architecture"`
	} `json:"platform,omitempty"`
}

type ociManifest struct {
	MediaType string          `json:"mediaType"`
	Manifests []ociDescriptor `json:"manifests"` // an index
	Layers    []ociDescriptor `json:"layers"`    // an image manifest
}

type registryClient struct {
	ctx    context.Context
	src    *RegistrySource
	host   string
	repo   string
	ref    string
	base   string // scheme://host
	client *http.Client
	auth   string // Authorization header once a challenge was answered
}

func importRegistry(ctx context.Context, req Request) (Result, error) {
	c, err := newRegistryClient(ctx, req.Registry)
	if err != nil {
		return Result{}, err
	}
	defer c.client.CloseIdleConnections()
	layers, err := c.layers()
	if err != nil {
		return Result{}, err
	}
	var total int64
	for _, l := range layers {
		total += l.Size
	}
	t := newTracker(req.Progress, total)
	// containerDisks put the disk in their last layer: look there first.
	for i := len(layers) - 1; i >= 0; i-- {
		res, found, err := c.importFromLayer(req, layers[i], t)
		if err != nil || found {
			return res, err
		}
	}
	if f := req.Registry.file(); f != "" {
		return Result{}, failf(ReasonInvalidImage, "%s has no file /%s", req.Registry.URL, f)
	}
	return Result{}, failf(ReasonInvalidImage, "%s has no file under /disk/", req.Registry.URL)
}

// file is File cleaned and without its leading slash, "" when unset.
func (src *RegistrySource) file() string {
	if src.File == "" {
		return ""
	}
	return strings.TrimPrefix(path.Clean("/"+src.File), "/")
}

// ResolveDigest returns the digest of the manifest (or image index) that
// src.URL names, without downloading any layer: the URL's own digest when it
// names one, else the digest of what the registry serves for the tag now.
// Importing docker://host/repo@<digest> afterwards reads exactly that image.
// Errors are *Error.
func ResolveDigest(ctx context.Context, src *RegistrySource) (digest string, err error) {
	defer func() { err = asImportError(ctx, err) }()
	c, err := newRegistryClient(ctx, src)
	if err != nil {
		return "", err
	}
	defer c.client.CloseIdleConnections()
	if strings.Contains(c.ref, ":") {
		return c.ref, nil
	}
	resp, err := c.get("/v2/"+c.repo+"/manifests/"+c.ref, mediaOCIIndex, mediaOCIManifest, mediaDockerList, mediaDockerV2)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxManifestBytes+1))
	if err != nil {
		return "", failf(ReasonSourceUnreachable, "read manifest %s: %w", c.ref, err)
	}
	if len(body) > maxManifestBytes {
		return "", failf(ReasonInvalidImage, "manifest %s is too large", c.ref)
	}
	sum := sha256.Sum256(body)
	return "sha256:" + hex.EncodeToString(sum[:]), nil
}

func newRegistryClient(ctx context.Context, src *RegistrySource) (*registryClient, error) {
	host, repo, ref, err := parseRegistryURL(src.URL)
	if err != nil {
		return nil, err
	}
	insecure := slices.Contains(src.InsecureRegistries, host)
	client, err := newHTTPClient(src.CACertPEM, src.Proxy, insecure, src.AllowedNetworks)
	if err != nil {
		return nil, err
	}
	c := &registryClient{ctx: ctx, src: src, host: host, repo: repo, ref: ref, base: "https://" + host, client: client}
	if insecure {
		// An insecure registry may not speak TLS at all.
		resp, err := c.client.Get(c.base + "/v2/")
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

// parseRegistryURL splits docker://host[:port]/repo[:tag|@digest].
func parseRegistryURL(s string) (host, repo, ref string, err error) {
	rest, ok := strings.CutPrefix(s, "docker://")
	if !ok {
		return "", "", "", failf(ReasonInvalidRequest, "registry url %q: want docker://host/repository[:tag]", s)
	}
	host, rest, ok = strings.Cut(rest, "/")
	if !ok || host == "" || rest == "" {
		return "", "", "", failf(ReasonInvalidRequest, "registry url %q: want docker://host/repository[:tag]", s)
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

// get fetches a registry path, answering one auth challenge.
func (c *registryClient) get(p string, accept ...string) (*http.Response, error) {
	for attempt := 0; ; attempt++ {
		req, err := http.NewRequestWithContext(c.ctx, http.MethodGet, c.base+p, nil)
		if err != nil {
			return nil, failf(ReasonInvalidRequest, "registry request: %w", err)
		}
		for _, a := range accept {
			req.Header.Add("Accept", a)
		}
		if c.auth != "" {
			req.Header.Set("Authorization", c.auth)
		}
		resp, err := c.client.Do(req)
		if err != nil {
			return nil, failf(unreachableReason(err), "registry %s: %w", c.host, err)
		}
		switch {
		case resp.StatusCode == http.StatusOK:
			return resp, nil
		case resp.StatusCode == http.StatusUnauthorized && attempt == 0:
			challenge := resp.Header.Get("WWW-Authenticate")
			resp.Body.Close()
			if err := c.answer(challenge); err != nil {
				return nil, err
			}
			continue
		}
		resp.Body.Close()
		switch resp.StatusCode {
		case http.StatusUnauthorized, http.StatusForbidden:
			return nil, failf(ReasonUnauthorized, "registry %s%s: %s", c.host, p, resp.Status)
		case http.StatusNotFound:
			return nil, failf(ReasonSourceNotFound, "registry %s%s: %s", c.host, p, resp.Status)
		}
		return nil, failf(ReasonSourceUnreachable, "registry %s%s: %s", c.host, p, resp.Status)
	}
}

// answer sets c.auth from a WWW-Authenticate challenge: basic credentials,
// or a bearer token fetched from the challenge's realm.
func (c *registryClient) answer(challenge string) error {
	scheme, params, _ := strings.Cut(challenge, " ")
	switch strings.ToLower(scheme) {
	case "basic":
		if c.src.Username == "" {
			return failf(ReasonUnauthorized, "registry %s wants credentials", c.host)
		}
		req, _ := http.NewRequest(http.MethodGet, "/", nil)
		req.SetBasicAuth(c.src.Username, c.src.Password)
		c.auth = req.Header.Get("Authorization")
		return nil
	case "bearer":
	default:
		return failf(ReasonUnauthorized, "registry %s: unsupported auth challenge %q", c.host, scheme)
	}
	p := parseAuthParams(params)
	realm, err := url.Parse(p["realm"])
	if err != nil || p["realm"] == "" {
		return failf(ReasonUnauthorized, "registry %s: bad bearer realm %q", c.host, p["realm"])
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
	req, err := http.NewRequestWithContext(c.ctx, http.MethodGet, realm.String(), nil)
	if err != nil {
		return failf(ReasonUnauthorized, "token request: %w", err)
	}
	if c.src.Username != "" {
		req.SetBasicAuth(c.src.Username, c.src.Password)
	}
	resp, err := c.client.Do(req)
	if err != nil {
		return failf(unreachableReason(err), "token request: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return failf(ReasonUnauthorized, "token request to %s: %s", realm.Host, resp.Status)
	}
	var tok struct {
		Token       string `json:"token"`
		AccessToken string `json:"access_token"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&tok); err != nil {
		return failf(ReasonUnauthorized, "token response: %w", err)
	}
	if tok.Token == "" {
		tok.Token = tok.AccessToken
	}
	if tok.Token == "" {
		return failf(ReasonUnauthorized, "token response from %s has no token", realm.Host)
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

// layers resolves the reference (through an index if needed) to the
// image's layers.
func (c *registryClient) layers() ([]ociDescriptor, error) {
	ref := c.ref
	for range maxIndexDepth + 1 {
		m, err := c.manifest(ref)
		if err != nil {
			return nil, err
		}
		if len(m.Manifests) == 0 {
			if len(m.Layers) == 0 {
				return nil, failf(ReasonInvalidImage, "manifest %s has no layers", ref)
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
			return nil, failf(ReasonSourceNotFound, "image index has no %s manifest", want)
		}
	}
	return nil, failf(ReasonInvalidImage, "image indexes nest too deep")
}

func (c *registryClient) manifest(ref string) (*ociManifest, error) {
	resp, err := c.get("/v2/"+c.repo+"/manifests/"+ref, mediaOCIIndex, mediaOCIManifest, mediaDockerList, mediaDockerV2)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxManifestBytes+1))
	if err != nil {
		return nil, failf(ReasonSourceUnreachable, "read manifest %s: %w", ref, err)
	}
	if len(body) > maxManifestBytes {
		return nil, failf(ReasonInvalidImage, "manifest %s is too large", ref)
	}
	if strings.Contains(ref, ":") {
		if err := checkDigest(ref, body); err != nil {
			return nil, err
		}
	}
	var m ociManifest
	if err := json.Unmarshal(body, &m); err != nil {
		return nil, failf(ReasonInvalidImage, "manifest %s: %w", ref, err)
	}
	mt, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	if m.MediaType == "" {
		m.MediaType = mt
	}
	return &m, nil
}

func digestHash(digest string) (hash.Hash, []byte, error) {
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
		return nil, nil, failf(ReasonInvalidImage, "bad digest %q", digest)
	}
	return h, want, nil
}

func checkDigest(digest string, body []byte) error {
	h, want, err := digestHash(digest)
	if err != nil {
		return err
	}
	h.Write(body)
	if got := h.Sum(nil); string(got) != string(want) {
		return failf(ReasonChecksumMismatch, "content of %s hashes to %x", digest, got)
	}
	return nil
}

// importFromLayer streams one layer blob, looking for the disk in its tar.
// found is false when the layer holds no file under disk/.
func (c *registryClient) importFromLayer(req Request, l ociDescriptor, t *tracker) (Result, bool, error) {
	h, want, err := digestHash(l.Digest)
	if err != nil {
		return Result{}, false, err
	}
	resp, err := c.get("/v2/" + c.repo + "/blobs/" + l.Digest)
	if err != nil {
		return Result{}, false, err
	}
	defer resp.Body.Close()
	blob := io.TeeReader(&countingReader{r: io.LimitReader(resp.Body, l.Size), t: t}, h)
	verify := func() error {
		if _, err := io.Copy(io.Discard, blob); err != nil {
			return failf(ReasonSourceUnreachable, "read layer %s: %w", l.Digest, err)
		}
		if got := h.Sum(nil); string(got) != string(want) {
			return failf(ReasonChecksumMismatch, "layer %s hashes to %x", l.Digest, got)
		}
		return nil
	}
	br := bufio.NewReaderSize(blob, 1<<20)
	head, err := br.Peek(8)
	if err != nil && !errors.Is(err, io.EOF) {
		return Result{}, false, failf(ReasonSourceUnreachable, "read layer %s: %w", l.Digest, err)
	}
	var layer io.Reader = br
	if comp := detectCompression(head); comp != CompressionNone {
		dr, closeFn, err := decompress(c.ctx, comp, br)
		if err != nil {
			return Result{}, false, err
		}
		defer closeFn()
		layer = dr
	}
	tr := tar.NewReader(layer)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			return Result{}, false, verify()
		}
		if err != nil {
			var ie *Error
			if errors.As(err, &ie) {
				return Result{}, false, err
			}
			return Result{}, false, failf(ReasonInvalidImage, "layer %s: %w", l.Digest, err)
		}
		name := strings.TrimPrefix(path.Clean("/"+hdr.Name), "/")
		if hdr.Typeflag != tar.TypeReg {
			continue
		}
		if f := req.Registry.file(); (f != "" && name != f) || (f == "" && !strings.HasPrefix(name, "disk/")) {
			continue
		}
		req.logger().Debug("disk found in layer", "dest", req.Dest, "layer", l.Digest, "file", name, "size", hdr.Size)
		res, err := importStream(c.ctx, req, tr, hdr.Size, t, verify)
		if err != nil {
			return Result{}, true, fmt.Errorf("%s from %s: %w", name, req.Registry.URL, err)
		}
		return res, true, nil
	}
}
