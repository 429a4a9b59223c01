package upload

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/x509"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

const (
	// TokenKeySecret holds the Ed25519 key that signs upload tokens.
	TokenKeySecret = "nodevirt-upload-token-key"
	tokenKeyField  = "private.pem"

	tokenIssuer    = "nodevirt-upload"
	opUpload       = "Upload"
	claimsResource = "persistentvolumeclaims"
	tokenLeeway    = 10 * time.Second
)

// tokenHeader is the fixed JOSE header of every token; a token with any
// other header is refused (no algorithm choice is left to the bearer).
var tokenHeader = base64.RawURLEncoding.EncodeToString([]byte(`{"alg":"EdDSA","typ":"JWT"}`))

// Claims is what a token grants: one upload into one PVC, for a while.
type Claims struct {
	Issuer    string `json:"iss"`
	Operation string `json:"op"`
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	Resource  string `json:"resource"`
	IssuedAt  int64  `json:"iat"`
	NotBefore int64  `json:"nbf"`
	Expiry    int64  `json:"exp"`
	ID        string `json:"jti"`
}

// Token errors; the proxy answers 401 with their text.
var (
	ErrTokenMalformed = errors.New("upload token is malformed")
	ErrTokenSignature = errors.New("upload token signature is not valid")
	ErrTokenExpired   = errors.New("upload token has expired")
	ErrTokenNotYet    = errors.New("upload token is not valid yet")
	ErrTokenScope     = errors.New("upload token is not an upload token")
)

// Signer issues and verifies upload tokens.
type Signer struct {
	key ed25519.PrivateKey
	ttl time.Duration
	now func() time.Time
}

// NewSigner signs with key; tokens live ttl.
func NewSigner(key ed25519.PrivateKey, ttl time.Duration) *Signer {
	return &Signer{key: key, ttl: ttl, now: time.Now}
}

// loadSigningKey returns the token key stored in namespace, creating it
// when missing (several brains racing end up with the one stored first).
func loadSigningKey(ctx context.Context, kube kubernetes.Interface, namespace string) (ed25519.PrivateKey, error) {
	secrets := kube.CoreV1().Secrets(namespace)
	s, err := secrets.Get(ctx, TokenKeySecret, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		_, key, genErr := ed25519.GenerateKey(rand.Reader)
		if genErr != nil {
			return nil, genErr
		}
		der, mErr := x509.MarshalPKCS8PrivateKey(key)
		if mErr != nil {
			return nil, mErr
		}
		s = &corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{Name: TokenKeySecret, Namespace: namespace,
				Labels: map[string]string{"app.kubernetes.io/managed-by": "nodevirt"}},
			Data: map[string][]byte{tokenKeyField: pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der})},
		}
		if _, err = secrets.Create(ctx, s, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return nil, fmt.Errorf("create secret %s/%s: %w", namespace, TokenKeySecret, err)
		}
		s, err = secrets.Get(ctx, TokenKeySecret, metav1.GetOptions{})
	}
	if err != nil {
		return nil, fmt.Errorf("token key secret %s/%s: %w", namespace, TokenKeySecret, err)
	}
	block, _ := pem.Decode(s.Data[tokenKeyField])
	if block == nil {
		return nil, fmt.Errorf("token key secret %s/%s: no pem key", namespace, TokenKeySecret)
	}
	k, err := x509.ParsePKCS8PrivateKey(block.Bytes)
	if err != nil {
		return nil, fmt.Errorf("token key secret %s/%s: %w", namespace, TokenKeySecret, err)
	}
	key, ok := k.(ed25519.PrivateKey)
	if !ok {
		return nil, fmt.Errorf("token key secret %s/%s: not an ed25519 key", namespace, TokenKeySecret)
	}
	return key, nil
}

// Issue returns a token for one upload into the PVC namespace/name.
func (s *Signer) Issue(namespace, name string) (string, error) {
	now := s.now()
	id := make([]byte, 12)
	if _, err := rand.Read(id); err != nil {
		return "", err
	}
	c := Claims{Issuer: tokenIssuer, Operation: opUpload, Namespace: namespace, Name: name, Resource: claimsResource,
		IssuedAt: now.Unix(), NotBefore: now.Unix(), Expiry: now.Add(s.ttl).Unix(), ID: hex.EncodeToString(id)}
	payload, err := json.Marshal(c)
	if err != nil {
		return "", err
	}
	signed := tokenHeader + "." + base64.RawURLEncoding.EncodeToString(payload)
	sig := ed25519.Sign(s.key, []byte(signed))
	return signed + "." + base64.RawURLEncoding.EncodeToString(sig), nil
}

// Verify checks a token's header, signature, issuer, operation and time
// window, and returns its claims.
func (s *Signer) Verify(token string) (Claims, error) {
	parts := strings.Split(token, ".")
	if len(parts) != 3 || parts[0] != tokenHeader {
		return Claims{}, ErrTokenMalformed
	}
	sig, err := base64.RawURLEncoding.DecodeString(parts[2])
	if err != nil {
		return Claims{}, ErrTokenMalformed
	}
	pub := s.key.Public().(ed25519.PublicKey)
	if !ed25519.Verify(pub, []byte(parts[0]+"."+parts[1]), sig) {
		return Claims{}, ErrTokenSignature
	}
	payload, err := base64.RawURLEncoding.DecodeString(parts[1])
	if err != nil {
		return Claims{}, ErrTokenMalformed
	}
	var c Claims
	dec := json.NewDecoder(bytes.NewReader(payload))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&c); err != nil {
		return Claims{}, ErrTokenMalformed
	}
	now := s.now()
	switch {
	case c.Issuer != tokenIssuer || c.Operation != opUpload || c.Resource != claimsResource || c.Namespace == "" || c.Name == "":
		return Claims{}, ErrTokenScope
	case now.After(time.Unix(c.Expiry, 0).Add(tokenLeeway)):
		return Claims{}, ErrTokenExpired
	case now.Add(tokenLeeway).Before(time.Unix(c.NotBefore, 0)):
		return Claims{}, ErrTokenNotYet
	}
	return c, nil
}
