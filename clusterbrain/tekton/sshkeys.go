package tekton

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/pem"
	"flag"
	"fmt"
	"strings"

	"golang.org/x/crypto/ssh"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/client/virtctl"
)

// Keys of the generated Secrets.
const (
	PublicKeyKey  = "key"
	PrivateKeyKey = corev1.SSHAuthPrivateKey // "ssh-privatekey"
)

func generateSSHKeys(_ context.Context, fs *flag.FlagSet) func(context.Context, *virtctl.Client, results) error {
	pubName := fs.String("publicKeySecretName", "", "name of the public key Secret (default: generated)")
	pubNS := fs.String("publicKeySecretNamespace", "", "its namespace (default: the active one)")
	privName := fs.String("privateKeySecretName", "", "name of the private key Secret (default: generated)")
	privNS := fs.String("privateKeySecretNamespace", "", "its namespace (default: the active one)")
	var opts multi
	fs.Var(&opts, "privateKeyConnectionOptions", "connection option KEY:VALUE stored beside the private key (repeatable)")
	return func(ctx context.Context, c *virtctl.Client, r results) error {
		pub, priv, err := ed25519.GenerateKey(rand.Reader)
		if err != nil {
			return err
		}
		sshPub, err := ssh.NewPublicKey(pub)
		if err != nil {
			return err
		}
		block, err := ssh.MarshalPrivateKey(priv, "")
		if err != nil {
			return err
		}
		privData := map[string][]byte{PrivateKeyKey: pem.EncodeToMemory(block)}
		for _, o := range opts {
			k, v, ok := strings.Cut(o, ":")
			if !ok || k == "" {
				return fmt.Errorf("privateKeyConnectionOptions: %q is not KEY:VALUE", o)
			}
			privData[k] = []byte(v)
		}
		for _, ns := range []*string{pubNS, privNS} {
			if *ns == "" {
				*ns = c.Namespace
			}
		}
		secrets := []struct {
			name, ns *string
			typ      corev1.SecretType
			data     map[string][]byte
			prefix   string
			results  [2]string
		}{
			{pubName, pubNS, corev1.SecretTypeOpaque, map[string][]byte{PublicKeyKey: ssh.MarshalAuthorizedKey(sshPub)}, "public-key-",
				[2]string{"publicKeySecretName", "publicKeySecretNamespace"}},
			{privName, privNS, corev1.SecretTypeSSHAuth, privData, "private-key-",
				[2]string{"privateKeySecretName", "privateKeySecretNamespace"}},
		}
		for _, s := range secrets {
			sec := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: *s.name, Namespace: *s.ns}, Type: s.typ, Data: s.data}
			if sec.Name == "" {
				sec.GenerateName = s.prefix
			}
			got, err := c.Kube.CoreV1().Secrets(*s.ns).Create(ctx, sec, metav1.CreateOptions{})
			if err != nil {
				return fmt.Errorf("create secret %s/%s: %w", *s.ns, sec.Name, err)
			}
			if err := r.set(s.results[0], got.Name); err != nil {
				return err
			}
			if err := r.set(s.results[1], got.Namespace); err != nil {
				return err
			}
		}
		return nil
	}
}
