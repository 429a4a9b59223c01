package importer

import (
	"archive/tar"
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"path"
	"strings"

	"github.com/nodevirt/nodevirt/clusterbrain/kit/registry"
)

// RegistrySource is a disk image in a container registry, laid out like a
// KubeVirt containerDisk: one file under /disk/ in a layer (a DataVolume's
// spec.source.registry, with its Secret and ConfigMap already read). The
// registry is spoken to by the shared client of package registry
// (clusterbrain/kit/registry); finding the disk in a layer and importing
// it is done here.
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

// registrySource is the part of src the registry client needs.
func (src *RegistrySource) registrySource() registry.Source {
	return registry.Source{
		URL: src.URL, CACertPEM: src.CACertPEM, Username: src.Username, Password: src.Password,
		InsecureRegistries: src.InsecureRegistries, Proxy: src.Proxy, Platform: src.Platform,
		AllowedNetworks: src.AllowedNetworks,
	}
}

func importRegistry(ctx context.Context, req Request) (Result, error) {
	c, err := registry.New(ctx, req.Registry.registrySource())
	if err != nil {
		return Result{}, fromRegistry(err)
	}
	defer c.Close()
	layers, err := c.Layers(ctx)
	if err != nil {
		return Result{}, fromRegistry(err)
	}
	var total int64
	for _, l := range layers {
		total += l.Size
	}
	t := newTracker(req.Progress, total)
	// containerDisks put the disk in their last layer: look there first.
	for i := len(layers) - 1; i >= 0; i-- {
		res, found, err := importFromLayer(ctx, c, req, layers[i], t)
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
// src.URL names, without downloading any layer (registry.ResolveDigest).
// Importing docker://host/repo@<digest> afterwards reads exactly that image.
// Errors are *Error.
func ResolveDigest(ctx context.Context, src *RegistrySource) (string, error) {
	digest, err := registry.ResolveDigest(ctx, src.registrySource())
	if err != nil {
		return "", asImportError(ctx, fromRegistry(err))
	}
	return digest, nil
}

// fromRegistry gives an error of the registry client its Reason.
func fromRegistry(err error) error {
	var re *registry.Error
	if !errors.As(err, &re) {
		return err
	}
	reason := ReasonFailed
	switch re.Kind {
	case registry.KindInvalidSource:
		reason = ReasonInvalidRequest
	case registry.KindUnreachable:
		reason = unreachableReason(err)
	case registry.KindUnauthorized:
		reason = ReasonUnauthorized
	case registry.KindNotFound:
		reason = ReasonSourceNotFound
	case registry.KindInvalidImage:
		reason = ReasonInvalidImage
	case registry.KindDigestMismatch:
		reason = ReasonChecksumMismatch
	}
	return &Error{Reason: reason, Err: err}
}

// importFromLayer streams one layer blob, looking for the disk in its tar.
// found is false when the layer holds no file under disk/.
func importFromLayer(ctx context.Context, c *registry.Client, req Request, l registry.Descriptor, t *tracker) (Result, bool, error) {
	h, want, err := registry.DigestHash(l.Digest)
	if err != nil {
		return Result{}, false, fromRegistry(err)
	}
	body, err := c.Blob(ctx, l)
	if err != nil {
		return Result{}, false, fromRegistry(err)
	}
	defer body.Close()
	blob := io.TeeReader(&countingReader{r: io.LimitReader(body, l.Size), t: t}, h)
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
		dr, closeFn, err := decompress(ctx, comp, br)
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
		res, err := importStream(ctx, req, tr, hdr.Size, t, verify)
		if err != nil {
			return Result{}, true, fmt.Errorf("%s from %s: %w", name, req.Registry.URL, err)
		}
		return res, true, nil
	}
}
