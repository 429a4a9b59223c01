package containerdisk

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/url"
	"strings"

	k8sv1 "k8s.io/api/core/v1"
)

// Reference is a parsed image name as a containerDisk's image field
// writes it: [host[:port]/]repository[:tag][@digest].
type Reference struct {
	// Host is the registry as the user names it ("docker.io" when the name
	// has none); it is what insecure registry lists and pull secrets match.
	Host string
	// Repository is the path inside the registry ("library/x" for a
	// single-component Docker Hub name).
	Repository string
	// Tag is the tag, "" when the name has a digest and no tag, "latest"
	// when it has neither.
	Tag string
	// Digest is the digest the name pins, or "".
	Digest string
}

// dockerHub is the registry of names without a host.
const dockerHub = "docker.io"

// ParseReference reads an image name the way container runtimes do: the
// first component is a host when it has a dot or a port or is
// "localhost", else the image is on Docker Hub.
func ParseReference(image string) (Reference, error) {
	bad := func(why string) (Reference, error) {
		return Reference{}, fmt.Errorf("invalid image name %q: %s", image, why)
	}
	if image == "" || strings.TrimSpace(image) != image || strings.Contains(image, "://") {
		return bad("want [host[:port]/]repository[:tag][@digest]")
	}
	var r Reference
	rest := image
	if name, digest, ok := strings.Cut(rest, "@"); ok {
		algo, hexSum, _ := strings.Cut(digest, ":")
		if (algo != "sha256" || len(hexSum) != 64) && (algo != "sha512" || len(hexSum) != 128) {
			return bad("digest must be sha256:<64 hex> or sha512:<128 hex>")
		}
		if strings.Trim(hexSum, "0123456789abcdef") != "" {
			return bad("digest is not lower-case hex")
		}
		rest, r.Digest = name, digest
	}
	if i := strings.LastIndex(rest, ":"); i > strings.LastIndex(rest, "/") {
		rest, r.Tag = rest[:i], rest[i+1:]
		if r.Tag == "" {
			return bad("empty tag")
		}
	}
	if first, path, ok := strings.Cut(rest, "/"); ok && (strings.ContainsAny(first, ".:") || first == "localhost") {
		r.Host, rest = first, path
	} else {
		r.Host = dockerHub
		if !strings.Contains(rest, "/") {
			rest = "library/" + rest
		}
	}
	if rest == "" || strings.HasPrefix(rest, "/") || strings.HasSuffix(rest, "/") || strings.Contains(rest, "//") {
		return bad("empty repository path component")
	}
	if strings.ToLower(rest) != rest {
		return bad("repository must be lower case")
	}
	r.Repository = rest
	if r.Tag == "" && r.Digest == "" {
		r.Tag = "latest"
	}
	return r, nil
}

// String is the normalised name: host/repository[:tag][@digest].
func (r Reference) String() string {
	s := r.Host + "/" + r.Repository
	if r.Tag != "" {
		s += ":" + r.Tag
	}
	if r.Digest != "" {
		s += "@" + r.Digest
	}
	return s
}

// apiHost is where the registry API of Host answers.
func (r Reference) apiHost() string {
	if r.Host == dockerHub {
		return "registry-1.docker.io"
	}
	return r.Host
}

// url is the importer's docker:// URL of the image, pinned to digest when
// it is not empty.
func (r Reference) url(digest string) string {
	u := "docker://" + r.apiHost() + "/" + r.Repository
	switch {
	case digest != "":
		return u + "@" + digest
	case r.Digest != "":
		return u + "@" + r.Digest
	}
	return u + ":" + r.Tag
}

// DefaultPullPolicy is KubeVirt's (and Kubernetes') default: Always for
// the tag latest or no tag at all, IfNotPresent otherwise.
func DefaultPullPolicy(image string) k8sv1.PullPolicy {
	r, err := ParseReference(image)
	if err == nil && r.Digest == "" && r.Tag == "latest" {
		return k8sv1.PullAlways
	}
	if err == nil {
		return k8sv1.PullIfNotPresent
	}
	return k8sv1.PullAlways
}

// dockerConfig is the content of a kubernetes.io/dockerconfigjson Secret's
// .dockerconfigjson key (the auths map) or of a kubernetes.io/dockercfg
// Secret's .dockercfg key (the map alone).
type dockerConfig struct {
	Auths map[string]dockerAuth `json:"auths"`
}

type dockerAuth struct {
	Username string `json:"username"`
	Password string `json:"password"`
	Auth     string `json:"auth"`
}

// Credentials returns the basic-auth credentials a pull secret's
// .dockerconfigjson (or .dockercfg) content holds for the registry host.
// Keys match as kubelet matches them: "host", "host:port", a URL whose
// host is that, and Docker Hub's historical names for docker.io. ok is
// false when no entry matches.
func Credentials(secret []byte, host string) (user, password string, ok bool, err error) {
	var cfg dockerConfig
	if err := json.Unmarshal(secret, &cfg); err != nil {
		return "", "", false, fmt.Errorf("pull secret: %w", err)
	}
	auths := cfg.Auths
	if auths == nil {
		// The legacy .dockercfg layout: the map itself.
		if err := json.Unmarshal(secret, &auths); err != nil {
			return "", "", false, fmt.Errorf("pull secret: %w", err)
		}
	}
	want := []string{host}
	if host == dockerHub {
		want = append(want, "index.docker.io", "registry-1.docker.io", "registry.hub.docker.com")
	}
	for key, a := range auths {
		if !hostMatches(key, want) {
			continue
		}
		user, password = a.Username, a.Password
		if a.Auth != "" {
			raw, err := base64.StdEncoding.DecodeString(a.Auth)
			if err != nil {
				return "", "", false, fmt.Errorf("pull secret entry %s: auth is not base64: %w", key, err)
			}
			var found bool
			if user, password, found = strings.Cut(string(raw), ":"); !found {
				return "", "", false, fmt.Errorf("pull secret entry %s: auth is not user:password", key)
			}
		}
		return user, password, true, nil
	}
	return "", "", false, nil
}

// hostMatches reports whether a docker config key names one of hosts.
func hostMatches(key string, hosts []string) bool {
	h := key
	if strings.Contains(key, "://") {
		u, err := url.Parse(key)
		if err != nil {
			return false
		}
		h = u.Host
	} else if i := strings.Index(key, "/"); i >= 0 {
		h = key[:i]
	}
	for _, want := range hosts {
		if strings.EqualFold(h, want) {
			return true
		}
	}
	return false
}
