// Package containerdisk is the node agent's cache of containerDisk images:
// the disks of spec.volumes[].containerDisk, pulled over the OCI
// distribution API (the shared registry client of clusterbrain/kit/registry,
// through package importer, which finds the disk in the layers) once per
// image digest and shared by every VMI of the node that boots from them.
//
// A cached image is a raw disk file the guest never writes: the launcher
// gives each VMI a qcow2 overlay backed by it (launcher/domain), as KubeVirt
// gives each virt-launcher pod its own overlay of the containerDisk.
//
// Pull policies follow KubeVirt (DefaultPullPolicy): Always resolves the
// tag at every start and pulls when the digest is new, IfNotPresent uses
// what the node has, Never never contacts the registry. Pulls of one image
// asked for at once are made once. A pull is written under Dir/tmp and
// renamed into Dir/images when complete, so a crash never leaves half an
// image; New clears Dir/tmp. Each image records its users (VMI UIDs);
// Release forgets a user, and images without users for Config.KeepUnused
// are removed.
//
// Acquire never blocks on the network: it starts the pull in the
// background and returns ErrPulling, calling back when the pull is over,
// so that a big image does not hold a reconcile worker. A failed pull is
// retried only after an exponential back-off (Config.Backoff up to
// Config.MaxBackoff); meanwhile Acquire returns a *PullError with
// ReasonImagePullBackOff, as kubelet reports an image it is backing off.
package containerdisk

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	k8sv1 "k8s.io/api/core/v1"

	"github.com/nodevirt/nodevirt/nodeagent/importer"
)

// Reasons of a PullError, as kubelet names image pull failures (KubeVirt
// copies them into the VMI's Synchronized condition).
const (
	// ReasonErrImagePull: the last pull failed.
	ReasonErrImagePull = "ErrImagePull"
	// ReasonImagePullBackOff: the last pull failed and the next one waits
	// for its back-off.
	ReasonImagePullBackOff = "ImagePullBackOff"
	// ReasonErrImageNeverPull: the policy is Never and the node does not
	// have the image.
	ReasonErrImageNeverPull = "ErrImageNeverPull"
	// ReasonInvalidImageName: the image name cannot be parsed.
	ReasonInvalidImageName = "InvalidImageName"
)

// ErrPulling is returned (wrapped) by Acquire while the image is being
// pulled in the background.
var ErrPulling = errors.New("image pull in progress")

// PullError says why a containerDisk image is not available.
type PullError struct {
	// Image is the image name as the VMI wrote it.
	Image string
	// Reason is one of the Reason constants.
	Reason string
	// Cause is the importer's reason of the failed pull (SourceNotFound,
	// Unauthorized, InvalidImage when the image holds no disk, ...); empty
	// when no pull was made.
	Cause importer.Reason
	// RetryAt is when a pull will be tried again (ReasonImagePullBackOff).
	RetryAt time.Time
	Err     error
}

func (e *PullError) Error() string {
	// No countdown in the message: it becomes a VMI condition, rewritten
	// only when it changes.
	return fmt.Sprintf("containerDisk image %s: %s: %v", e.Image, e.Reason, e.Err)
}

func (e *PullError) Unwrap() error { return e.Err }

// Defaults of Config.
const (
	DefaultMaxImageSize = 1 << 40
	DefaultBackoff      = 2 * time.Second
	DefaultMaxBackoff   = 5 * time.Minute
	DefaultKeepUnused   = time.Hour
)

// Config configures a Puller.
type Config struct {
	// Dir is the cache's root; required, absolute. Images must be readable
	// by the user QEMU runs as (directories 0755, images 0644).
	Dir string
	// MaxImageSize bounds the virtual size of a disk; DefaultMaxImageSize
	// when zero.
	MaxImageSize int64
	// Backoff is the wait after a first failed pull, doubled after each
	// further failure up to MaxBackoff; the defaults when zero.
	Backoff, MaxBackoff time.Duration
	// KeepUnused is how long an image nothing uses stays cached;
	// DefaultKeepUnused when zero, negative removes it at once.
	KeepUnused time.Duration
	// Log; slog.Default() when nil.
	Log *slog.Logger
}

func (c *Config) defaults() {
	if c.MaxImageSize == 0 {
		c.MaxImageSize = DefaultMaxImageSize
	}
	if c.Backoff == 0 {
		c.Backoff = DefaultBackoff
	}
	if c.MaxBackoff == 0 {
		c.MaxBackoff = DefaultMaxBackoff
	}
	if c.KeepUnused == 0 {
		c.KeepUnused = DefaultKeepUnused
	}
	if c.Log == nil {
		c.Log = slog.Default()
	}
}

func (c *Config) validate() error {
	switch {
	case !filepath.IsAbs(c.Dir):
		return fmt.Errorf("containerdisk: cache dir %q is not an absolute path", c.Dir)
	case c.MaxImageSize < 0:
		return errors.New("containerdisk: negative max image size")
	case c.Backoff < 0 || c.MaxBackoff < c.Backoff:
		return errors.New("containerdisk: back-off must be positive and at most the max back-off")
	}
	return nil
}

// Request names one containerDisk image as a VMI volume asks for it.
type Request struct {
	// Image is spec.volumes[].containerDisk.image.
	Image string
	// PullPolicy is its imagePullPolicy; empty means DefaultPullPolicy.
	PullPolicy k8sv1.PullPolicy
	// Path is the disk's file inside the image; empty means the file under
	// /disk/.
	Path string
	// PullSecret is the .dockerconfigjson of the imagePullSecret, nil for
	// none (anonymous pulls).
	PullSecret []byte
	// InsecureRegistries lists host[:port] registries reached without TLS
	// verification or over plain HTTP (the CDI configuration's list).
	InsecureRegistries []string
	// AllowedNetworks are addresses the pull may reach although imports
	// may not by default (loopback, link-local, this node's addresses).
	AllowedNetworks []netip.Prefix
}

// Image is a cached containerDisk.
type Image struct {
	// Reference is the normalised image name.
	Reference string
	// Digest is the digest of the manifest (or index) pulled.
	Digest string
	// Path is the raw disk image; read-only.
	Path string
	// VirtualSize is the disk's size.
	VirtualSize int64
}

// Puller pulls and caches containerDisk images.
type Puller struct {
	cfg Config
	log *slog.Logger

	mu   sync.Mutex
	keys map[string]*keyState // by image+path
}

// keyState is what the Puller knows of one image+path in this run.
type keyState struct {
	running  bool
	waiting  map[string]func()  // owners waiting for the running pull
	results  map[string]outcome // finished pulls not yet seen by their owner
	failures int
	lastErr  *PullError
	retryAt  time.Time
}

type outcome struct {
	img Image
	err error
}

// New validates cfg, makes the cache directories and clears what an
// interrupted run left in Dir/tmp.
func New(cfg Config) (*Puller, error) {
	cfg.defaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	p := &Puller{cfg: cfg, log: cfg.Log.With("role", "containerdisk"), keys: map[string]*keyState{}}
	if err := p.initDirs(); err != nil {
		return nil, err
	}
	return p, nil
}

// Dir is the cache's root.
func (p *Puller) Dir() string { return p.cfg.Dir }

// Acquire returns the cached image req names and records owner (a VMI UID)
// as its user. When the image must be pulled first, it starts the pull
// under ctx and returns an error wrapping ErrPulling; done (if not nil) is
// called once that pull is over, and the next Acquire by owner returns its
// outcome. Failures are *PullError.
func (p *Puller) Acquire(ctx context.Context, req Request, owner string, done func()) (Image, error) {
	if owner == "" || strings.ContainsAny(owner, "/\x00") || owner == "." || owner == ".." {
		return Image{}, fmt.Errorf("containerdisk: invalid owner %q", owner)
	}
	ref, err := ParseReference(req.Image)
	if err != nil {
		return Image{}, &PullError{Image: req.Image, Reason: ReasonInvalidImageName, Err: err}
	}
	policy := req.PullPolicy
	if policy == "" {
		policy = DefaultPullPolicy(req.Image)
	}
	switch policy {
	case k8sv1.PullAlways, k8sv1.PullIfNotPresent, k8sv1.PullNever:
	default:
		return Image{}, &PullError{Image: req.Image, Reason: ReasonErrImagePull,
			Err: fmt.Errorf("unknown imagePullPolicy %q", policy)}
	}
	key := ref.String() + "\x00" + cleanPath(req.Path)

	p.mu.Lock()
	defer p.mu.Unlock()
	ks := p.keys[key]
	if ks == nil {
		ks = &keyState{waiting: map[string]func(){}, results: map[string]outcome{}}
		p.keys[key] = ks
	}
	if out, ok := ks.results[owner]; ok {
		delete(ks.results, owner)
		if out.err != nil {
			return Image{}, out.err
		}
		if err := p.addUser(out.img, owner); err == nil {
			return out.img, nil
		}
		// Pruned since: look again below.
	}
	if ks.running {
		ks.waiting[owner] = done
		return Image{}, fmt.Errorf("containerDisk image %s: %w", req.Image, ErrPulling)
	}
	// A digest names one image forever: any policy but Always may use the
	// node's copy, and so may Always when the name pins a digest.
	if policy != k8sv1.PullAlways || ref.Digest != "" {
		if img, ok := p.local(ref, req.Path); ok {
			if err := p.addUser(img, owner); err == nil {
				return img, nil
			}
		}
	}
	if policy == k8sv1.PullNever {
		return Image{}, &PullError{Image: req.Image, Reason: ReasonErrImageNeverPull,
			Err: errors.New("the image is not present on this node and imagePullPolicy is Never")}
	}
	if now := time.Now(); now.Before(ks.retryAt) {
		e := *ks.lastErr
		e.Reason, e.RetryAt = ReasonImagePullBackOff, ks.retryAt
		return Image{}, &e
	}
	ks.running = true
	ks.waiting[owner] = done
	go p.run(ctx, ks, ref, req)
	return Image{}, fmt.Errorf("containerDisk image %s: %w", req.Image, ErrPulling)
}

// Pull is Acquire waiting for the pull: it returns the image or why it
// could not be pulled.
func (p *Puller) Pull(ctx context.Context, req Request, owner string) (Image, error) {
	for {
		ch := make(chan struct{}, 1)
		img, err := p.Acquire(ctx, req, owner, func() { ch <- struct{}{} })
		if !errors.Is(err, ErrPulling) {
			return img, err
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return Image{}, ctx.Err()
		}
	}
}

// run pulls in the background and hands the outcome to the waiting owners.
func (p *Puller) run(ctx context.Context, ks *keyState, ref Reference, req Request) {
	log := p.log.With("image", req.Image)
	t0 := time.Now()
	log.Info("pulling containerDisk image")
	img, err := p.pull(ctx, ref, req)
	var out outcome
	switch {
	case err == nil:
		log.Info("containerDisk image ready", "digest", img.Digest, "path", img.Path, "took", time.Since(t0).Round(time.Millisecond))
		out.img = img
	default:
		pe := &PullError{Image: req.Image, Reason: ReasonErrImagePull, Cause: importer.ReasonOf(err), Err: err}
		log.Warn("containerDisk image pull failed", "reason", pe.Cause, "err", err)
		out.err = pe
	}
	p.mu.Lock()
	ks.running = false
	switch {
	case err == nil:
		ks.failures, ks.lastErr, ks.retryAt = 0, nil, time.Time{}
	case ctx.Err() == nil:
		ks.failures++
		ks.lastErr = out.err.(*PullError)
		ks.retryAt = time.Now().Add(p.backoff(ks.failures))
	}
	var notify []func()
	for owner, done := range ks.waiting {
		ks.results[owner] = out
		if done != nil {
			notify = append(notify, done)
		}
	}
	clear(ks.waiting)
	p.mu.Unlock()
	for _, f := range notify {
		f()
	}
}

// backoff is the wait after the n-th failure in a row.
func (p *Puller) backoff(n int) time.Duration {
	d := p.cfg.Backoff
	for range n - 1 {
		if d >= p.cfg.MaxBackoff/2 {
			return p.cfg.MaxBackoff
		}
		d *= 2
	}
	return min(d, p.cfg.MaxBackoff)
}

// pull resolves the image's digest and downloads it unless the cache has
// that digest already.
func (p *Puller) pull(ctx context.Context, ref Reference, req Request) (Image, error) {
	src := importer.RegistrySource{URL: ref.url(""), InsecureRegistries: req.InsecureRegistries, File: req.Path,
		AllowedNetworks: req.AllowedNetworks}
	if req.PullSecret != nil {
		user, pass, ok, err := Credentials(req.PullSecret, ref.Host)
		if err != nil {
			return Image{}, &importer.Error{Reason: importer.ReasonInvalidRequest, Err: err}
		}
		if ok {
			src.Username, src.Password = user, pass
		}
	}
	digest, err := importer.ResolveDigest(ctx, &src)
	if err != nil {
		return Image{}, err
	}
	p.mu.Lock()
	img, ok := p.entry(digest, req.Path)
	p.mu.Unlock()
	if !ok {
		src.URL = ref.url(digest)
		if img, err = p.download(ctx, ref, digest, req.Path, &src); err != nil {
			return Image{}, err
		}
	}
	if err := p.writeRef(ref, req.Path, digest); err != nil {
		return Image{}, err
	}
	return img, nil
}

// Release forgets owner as a user of every cached image, then removes the
// images unused for longer than Config.KeepUnused. Releasing an owner that
// uses nothing succeeds.
func (p *Puller) Release(owner string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	err := p.removeUser(owner)
	return errors.Join(err, p.prune())
}

// Retain forgets every user for which keep is false (the node agent calls
// it once after a restart with the VMIs it still knows), then removes the
// images unused for longer than Config.KeepUnused.
func (p *Puller) Retain(keep func(owner string) bool) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	ents, err := p.entries()
	errs := []error{err}
	for _, e := range ents {
		users, err := e.users()
		errs = append(errs, err)
		for _, u := range users {
			if keep(u) {
				continue
			}
			if err := os.Remove(filepath.Join(e.dir, usersDir, u)); err != nil && !errors.Is(err, fs.ErrNotExist) {
				errs = append(errs, err)
			}
		}
	}
	errs = append(errs, p.prune())
	return errors.Join(errs...)
}

// Prune removes the images unused for longer than Config.KeepUnused.
func (p *Puller) Prune() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.prune()
}

// Images lists the cached images with their users.
func (p *Puller) Images() (map[Image][]string, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	ents, err := p.entries()
	out := map[Image][]string{}
	for _, e := range ents {
		users, uerr := e.users()
		err = errors.Join(err, uerr)
		slices.Sort(users)
		out[e.img] = users
	}
	return out, err
}

func cleanPath(p string) string {
	if p == "" {
		return ""
	}
	return filepath.Clean("/" + p)
}
