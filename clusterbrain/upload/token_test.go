package upload

import (
	"crypto/ed25519"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"
)

func testSigner(t *testing.T) *Signer {
	t.Helper()
	_, key, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return NewSigner(key, 5*time.Minute)
}

func TestTokenRoundTripAndRefusals(t *testing.T) {
	s := testSigner(t)
	tok, err := s.Issue("ns1", "disk")
	if err != nil {
		t.Fatal(err)
	}
	c, err := s.Verify(tok)
	if err != nil || c.Namespace != "ns1" || c.Name != "disk" || c.Expiry-c.IssuedAt != 300 {
		t.Fatalf("verify: %+v %v", c, err)
	}

	parts := strings.Split(tok, ".")
	payload, _ := base64.RawURLEncoding.DecodeString(parts[1])
	var m map[string]any
	_ = json.Unmarshal(payload, &m)
	m["name"] = "other-disk"
	tampered, _ := json.Marshal(m)
	noneHeader := base64.RawURLEncoding.EncodeToString([]byte(`{"alg":"none","typ":"JWT"}`))

	other := testSigner(t)
	forged, _ := other.Issue("ns1", "disk")

	past := testSigner(t)
	past.key = s.key
	past.now = func() time.Time { return time.Now().Add(-6 * time.Minute) }
	expired, _ := past.Issue("ns1", "disk")

	future := testSigner(t)
	future.key = s.key
	future.now = func() time.Time { return time.Now().Add(time.Minute) }
	early, _ := future.Issue("ns1", "disk")

	for name, c := range map[string]struct {
		token string
		want  error
	}{
		"forged":      {forged, ErrTokenSignature},
		"tampered":    {parts[0] + "." + base64.RawURLEncoding.EncodeToString(tampered) + "." + parts[2], ErrTokenSignature},
		"alg none":    {noneHeader + "." + parts[1] + ".", ErrTokenMalformed},
		"two parts":   {parts[0] + "." + parts[1], ErrTokenMalformed},
		"garbage sig": {parts[0] + "." + parts[1] + ".!!!", ErrTokenMalformed},
		"expired":     {expired, ErrTokenExpired},
		"not yet":     {early, ErrTokenNotYet},
	} {
		if _, err := s.Verify(c.token); !errors.Is(err, c.want) {
			t.Errorf("%s: got %v, want %v", name, err, c.want)
		}
	}
}
