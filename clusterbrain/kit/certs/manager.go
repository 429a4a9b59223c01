package certs

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
)

// Secret keys. The CA secret also carries the bundle clients must trust.
const (
	KeyCert   = "tls.crt"
	KeyKey    = "tls.key"
	KeyBundle = "ca-bundle.crt"
)

// Durations are the lifetimes of the CA and of the serving certificate and
// how long before expiry each is renewed.
type Durations struct {
	CA, CARenewBefore         time.Duration
	Server, ServerRenewBefore time.Duration
}

// DefaultDurations are HCO's defaults: CA 48h renewed 24h before expiry,
// server 24h renewed 12h before.
func DefaultDurations() Durations {
	return Durations{CA: 48 * time.Hour, CARenewBefore: 24 * time.Hour, Server: 24 * time.Hour, ServerRenewBefore: 12 * time.Hour}
}

func (d Durations) validate() error {
	if d.CA <= 0 || d.Server <= 0 || d.CARenewBefore <= 0 || d.ServerRenewBefore <= 0 {
		return errors.New("certificate durations must be positive")
	}
	if d.CARenewBefore >= d.CA || d.ServerRenewBefore >= d.Server {
		return errors.New("renewBefore must be shorter than the duration")
	}
	if d.Server > d.CA {
		return errors.New("server certificate must not outlive its ca")
	}
	return nil
}

// HCODurations reads spec.certConfig of the HyperConverged name in ns,
// falling back to DefaultDurations for whatever is unset, missing or invalid.
func HCODurations(virt *client.Set, ns, name string) func(context.Context) Durations {
	return func(ctx context.Context) Durations {
		d := DefaultDurations()
		// Certificates must not wait on the HyperConverged: an API server
		// slow to answer (a conversion webhook of a dead brain) leaves the
		// defaults.
		ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		hco, err := virt.HyperConvergeds.Get(ctx, ns, name)
		if err != nil {
			return d
		}
		c := hco.Spec.CertConfig
		set := func(dst *time.Duration, src *metav1.Duration) {
			if src != nil && src.Duration > 0 {
				*dst = src.Duration
			}
		}
		got := d
		set(&got.CA, c.CA.Duration)
		set(&got.CARenewBefore, c.CA.RenewBefore)
		set(&got.Server, c.Server.Duration)
		set(&got.ServerRenewBefore, c.Server.RenewBefore)
		if got.validate() != nil {
			return d
		}
		return got
	}
}

// Config configures a Manager.
type Config struct {
	Kube      kubernetes.Interface
	Namespace string
	// CASecret and ServerSecret name the Secrets (defaults
	// nodevirt-brain-ca and nodevirt-brain-webhook-cert).
	CASecret, ServerSecret string
	// Hosts the serving certificate is valid for (default 127.0.0.1,
	// localhost).
	Hosts []string
	// Durations returns the lifetimes at each sync (default DefaultDurations).
	Durations func(context.Context) Durations
	// PublishBundle makes clients trust bundle (e.g. by writing it into
	// webhook configurations). A certificate signed by a new CA is served
	// only after it succeeded and Propagation has passed.
	PublishBundle func(ctx context.Context, bundle []byte) error
	// Propagation is how long a newly published bundle takes to reach
	// clients (default 3s).
	Propagation time.Duration
	// Now is the clock (default time.Now).
	Now func() time.Time
	Log *slog.Logger
}

// Manager keeps the CA and the serving certificate valid.
type Manager struct {
	cfg Config

	serving atomic.Pointer[tls.Certificate]
	mu      sync.Mutex
	bundle  []byte    // last published bundle
	pubAt   time.Time // when it was published
}

// New defaults and validates cfg.
func New(cfg Config) (*Manager, error) {
	if cfg.Kube == nil || cfg.Namespace == "" {
		return nil, errors.New("certs: kube client and namespace are required")
	}
	if cfg.CASecret == "" {
		cfg.CASecret = "nodevirt-brain-ca"
	}
	if cfg.ServerSecret == "" {
		cfg.ServerSecret = "nodevirt-brain-webhook-cert"
	}
	if len(cfg.Hosts) == 0 {
		cfg.Hosts = []string{"127.0.0.1", "localhost"}
	}
	if cfg.Durations == nil {
		cfg.Durations = func(context.Context) Durations { return DefaultDurations() }
	}
	if cfg.PublishBundle == nil {
		cfg.PublishBundle = func(context.Context, []byte) error { return nil }
	}
	if cfg.Propagation == 0 {
		cfg.Propagation = 3 * time.Second
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	return &Manager{cfg: cfg}, nil
}

// GetCertificate serves the current certificate; use it as
// tls.Config.GetCertificate.
func (m *Manager) GetCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	c := m.serving.Load()
	if c == nil {
		return nil, errors.New("no serving certificate yet")
	}
	return c, nil
}

// CABundle returns the PEM bundle clients must trust (empty before the
// first Sync).
func (m *Manager) CABundle() []byte {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]byte(nil), m.bundle...)
}

// Run syncs now and again before each renewal is due, until ctx ends.
func (m *Manager) Run(ctx context.Context) error {
	for {
		next, err := m.Sync(ctx)
		wait := time.Until(next)
		if err != nil {
			m.cfg.Log.Error("certificate sync", "namespace", m.cfg.Namespace, "err", err)
			wait = 2 * time.Second
		}
		if wait > time.Minute {
			wait = time.Minute // pick up other replicas' rotations and certConfig edits
		}
		if wait < 100*time.Millisecond {
			wait = 100 * time.Millisecond
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(wait):
		}
	}
}

// Sync makes sure the CA and the serving certificate exist and are not due
// for renewal, publishes the bundle and loads the serving certificate. It
// returns when the next sync is due.
func (m *Manager) Sync(ctx context.Context) (time.Time, error) {
	now := m.cfg.Now()
	d := m.cfg.Durations(ctx)
	if err := d.validate(); err != nil {
		return now, err
	}
	ca, bundle, caExpiry, err := m.syncCA(ctx, d, now)
	if err != nil {
		return now, err
	}
	m.mu.Lock()
	published := bytes.Equal(m.bundle, bundle)
	m.mu.Unlock()
	if !published {
		if err := m.cfg.PublishBundle(ctx, bundle); err != nil {
			return now, fmt.Errorf("publish ca bundle: %w", err)
		}
		m.mu.Lock()
		m.bundle, m.pubAt = bundle, now
		m.mu.Unlock()
		m.cfg.Log.Info("ca bundle published", "namespace", m.cfg.Namespace, "secret", m.cfg.CASecret)
	}
	next := caExpiry.Add(-d.CARenewBefore)
	srvExpiry, err := m.syncServer(ctx, ca, d, now)
	if err != nil {
		var wait propagationWait
		if errors.As(err, &wait) {
			return wait.until, nil
		}
		return now, err
	}
	if t := srvExpiry.Add(-d.ServerRenewBefore); t.Before(next) {
		next = t
	}
	return next, nil
}

type propagationWait struct{ until time.Time }

func (propagationWait) Error() string { return "waiting for the ca bundle to propagate" }

func (m *Manager) syncCA(ctx context.Context, d Durations, now time.Time) (KeyPair, []byte, time.Time, error) {
	secrets := m.cfg.Kube.CoreV1().Secrets(m.cfg.Namespace)
	sec, err := secrets.Get(ctx, m.cfg.CASecret, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		ca, err := NewCA("nodevirt-brain-ca", d.CA, now)
		if err != nil {
			return KeyPair{}, nil, now, err
		}
		sec = &corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{Name: m.cfg.CASecret, Namespace: m.cfg.Namespace,
				Labels: map[string]string{"app.kubernetes.io/managed-by": "nodevirt"}},
			Type: corev1.SecretTypeTLS,
			Data: map[string][]byte{KeyCert: ca.CertPEM, KeyKey: ca.KeyPEM, KeyBundle: ca.CertPEM},
		}
		if sec, err = secrets.Create(ctx, sec, metav1.CreateOptions{}); err != nil {
			return KeyPair{}, nil, now, fmt.Errorf("create ca secret: %w", err) // AlreadyExists: another replica won; next sync reads it
		}
		m.cfg.Log.Info("ca created", "namespace", m.cfg.Namespace, "secret", m.cfg.CASecret)
	} else if err != nil {
		return KeyPair{}, nil, now, fmt.Errorf("read ca secret: %w", err)
	}
	ca := KeyPair{CertPEM: sec.Data[KeyCert], KeyPEM: sec.Data[KeyKey]}
	expiry, perr := ca.NotAfter()
	if perr == nil && expiry.Sub(now) > d.CARenewBefore && expiry.Sub(now) <= d.CA+time.Minute {
		return ca, sec.Data[KeyBundle], expiry, nil
	}
	// Renew: due, unreadable, or longer-lived than certConfig now allows.
	fresh, err := NewCA("nodevirt-brain-ca", d.CA, now)
	if err != nil {
		return KeyPair{}, nil, now, err
	}
	sec = sec.DeepCopy()
	sec.Data[KeyCert], sec.Data[KeyKey] = fresh.CertPEM, fresh.KeyPEM
	sec.Data[KeyBundle] = bundleAppend(sec.Data[KeyBundle], fresh.CertPEM, now, 2)
	if sec, err = secrets.Update(ctx, sec, metav1.UpdateOptions{}); err != nil {
		return KeyPair{}, nil, now, fmt.Errorf("rotate ca: %w", err)
	}
	m.cfg.Log.Info("ca rotated", "namespace", m.cfg.Namespace, "secret", m.cfg.CASecret)
	expiry, _ = fresh.NotAfter()
	return fresh, sec.Data[KeyBundle], expiry, nil
}

func (m *Manager) syncServer(ctx context.Context, ca KeyPair, d Durations, now time.Time) (time.Time, error) {
	secrets := m.cfg.Kube.CoreV1().Secrets(m.cfg.Namespace)
	sec, err := secrets.Get(ctx, m.cfg.ServerSecret, metav1.GetOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		return now, fmt.Errorf("read serving secret: %w", err)
	}
	exists := err == nil
	var cur KeyPair
	if exists {
		cur = KeyPair{CertPEM: sec.Data[KeyCert], KeyPEM: sec.Data[KeyKey]}
	}
	expiry, perr := cur.NotAfter()
	fresh := perr == nil && signedBy(cur, ca) && expiry.Sub(now) > d.ServerRenewBefore && expiry.Sub(now) <= d.Server+time.Minute
	if fresh && !covers(cur, m.cfg.Hosts) {
		fresh = false
		m.cfg.Log.Info("serving certificate reissued for other hosts", "namespace", m.cfg.Namespace, "secret", m.cfg.ServerSecret, "hosts", m.cfg.Hosts)
	}
	if !fresh {
		m.mu.Lock()
		ready := m.pubAt.Add(m.cfg.Propagation)
		m.mu.Unlock()
		// A certificate from a new CA waits until clients trust that CA;
		// meanwhile the old one, still valid, keeps serving.
		if perr == nil && expiry.After(now) && now.Before(ready) {
			if err := m.load(cur); err != nil {
				return now, err
			}
			return now, propagationWait{until: ready}
		}
		kp, err := Issue(ca, m.cfg.Hosts, d.Server, now)
		if err != nil {
			return now, err
		}
		if !exists {
			sec = &corev1.Secret{
				ObjectMeta: metav1.ObjectMeta{Name: m.cfg.ServerSecret, Namespace: m.cfg.Namespace,
					Labels: map[string]string{"app.kubernetes.io/managed-by": "nodevirt"}},
				Type: corev1.SecretTypeTLS,
				Data: map[string][]byte{KeyCert: kp.CertPEM, KeyKey: kp.KeyPEM},
			}
			if _, err := secrets.Create(ctx, sec, metav1.CreateOptions{}); err != nil {
				return now, fmt.Errorf("create serving secret: %w", err)
			}
		} else {
			sec = sec.DeepCopy()
			if sec.Data == nil {
				sec.Data = map[string][]byte{}
			}
			sec.Data[KeyCert], sec.Data[KeyKey] = kp.CertPEM, kp.KeyPEM
			if _, err := secrets.Update(ctx, sec, metav1.UpdateOptions{}); err != nil {
				return now, fmt.Errorf("renew serving secret: %w", err)
			}
		}
		m.cfg.Log.Info("serving certificate issued", "namespace", m.cfg.Namespace, "secret", m.cfg.ServerSecret)
		cur = kp
		expiry, _ = kp.NotAfter()
	}
	return expiry, m.load(cur)
}

func (m *Manager) load(kp KeyPair) error {
	if c := m.serving.Load(); c != nil && len(c.Certificate) > 0 {
		if old, err := kp.TLSCertificate(); err == nil && bytes.Equal(old.Certificate[0], c.Certificate[0]) {
			return nil
		}
	}
	c, err := kp.TLSCertificate()
	if err != nil {
		return err
	}
	m.serving.Store(c)
	return nil
}
