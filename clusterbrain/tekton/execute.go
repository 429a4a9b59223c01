package tekton

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/client/virtctl"
)

// Keys of an execute-in-vm connection Secret (upstream's).
const (
	SecretUser              = "user"
	SecretHostPublicKey     = "host-public-key"
	SecretNoStrictHostCheck = "disable-strict-host-key-checking"
	SecretSSHOptions        = "additional-ssh-options"
	SecretType              = "type"
)

func executeInVM(_ context.Context, fs *flag.FlagSet) func(context.Context, *virtctl.Client, results) error {
	name := fs.String("vmName", "", "name of the VM")
	ns := fs.String("vmNamespace", "", "its namespace (default: the active one)")
	secret := fs.String("secretName", "", "Secret with the SSH connection (user, ssh-privatekey, host-public-key …)")
	secretDir := fs.String("secretDir", "/data/connectionsecret", "where the Task mounts the Secret (read through the API when empty)")
	script := fs.String("script", "", "script to run in the VM (instead of command and args)")
	timeout := fs.Duration("timeout", 30*time.Minute, "how long the VM's start and the command may take")
	var command, args multi
	fs.Var(&command, "command", "command to run in the VM (repeatable: its words)")
	fs.Var(&args, "args", "its arguments (repeatable)")
	return func(ctx context.Context, c *virtctl.Client, _ results) error {
		if *name == "" {
			return fmt.Errorf("vmName %w", errMissing)
		}
		defaultNS(c, ns)
		run := *script
		if run == "" {
			words := append(append([]string{}, command...), args...)
			if len(words) == 0 {
				return fmt.Errorf("script or command %w", errMissing)
			}
			quoted := make([]string, len(words))
			for i, w := range words {
				quoted[i] = shellQuote(w)
			}
			run = strings.Join(quoted, " ")
		}
		if *secret == "" || *secret == "__empty__" {
			return fmt.Errorf("secretName %w (the SSH connection)", errMissing)
		}
		data, err := connectionSecret(ctx, c, *ns, *secret, *secretDir)
		if err != nil {
			return err
		}
		conn, err := sshConnection(data)
		if err != nil {
			return fmt.Errorf("secret %s: %w", *secret, err)
		}
		ctx, cancel := context.WithTimeout(ctx, *timeout)
		defer cancel()
		ip, err := runningAddress(ctx, c, *ns, *name)
		if err != nil {
			return err
		}
		addr := net.JoinHostPort(ip, strconv.Itoa(conn.port))
		if err := poll(ctx, time.Second, func() (bool, error) {
			d, err := (&net.Dialer{Timeout: 5 * time.Second}).DialContext(ctx, "tcp", addr)
			if err == nil {
				d.Close()
			}
			return err == nil, nil
		}); err != nil {
			return fmt.Errorf("ssh on vm %s/%s (%s): %w", *ns, *name, addr, err)
		}
		return conn.run(ctx, ip, run, fs.Output())
	}
}

// connectionSecret reads the Secret where the Task mounted it, else
// through the API.
func connectionSecret(ctx context.Context, c *virtctl.Client, ns, name, dir string) (map[string][]byte, error) {
	if dir != "" {
		if entries, err := os.ReadDir(dir); err == nil && len(entries) > 0 {
			data := map[string][]byte{}
			for _, e := range entries {
				if e.IsDir() || strings.HasPrefix(e.Name(), "..") {
					continue
				}
				b, err := os.ReadFile(filepath.Join(dir, e.Name()))
				if err != nil {
					return nil, err
				}
				data[e.Name()] = b
			}
			return data, nil
		}
	}
	s, err := c.Kube.CoreV1().Secrets(ns).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("connection secret %s/%s: %w", ns, name, err)
	}
	if s.Type != corev1.SecretTypeSSHAuth && string(s.Data[SecretType]) != "ssh" {
		return nil, fmt.Errorf("connection secret %s/%s: type %s with no type: ssh key", ns, name, s.Type)
	}
	return s.Data, nil
}

type sshConn struct {
	user, key, hostKey string
	strict             bool
	opts               []string
	port               int
}

func sshConnection(data map[string][]byte) (*sshConn, error) {
	c := &sshConn{user: strings.TrimSpace(string(data[SecretUser])), key: string(data[corev1.SSHAuthPrivateKey]),
		hostKey: strings.TrimSpace(string(data[SecretHostPublicKey])), port: 22}
	if c.user == "" {
		return nil, fmt.Errorf("%s %w", SecretUser, errMissing)
	}
	if c.key == "" {
		return nil, fmt.Errorf("%s %w", corev1.SSHAuthPrivateKey, errMissing)
	}
	noStrict, err := boolParam(SecretNoStrictHostCheck, strings.TrimSpace(string(data[SecretNoStrictHostCheck])))
	if err != nil {
		return nil, err
	}
	c.strict = !noStrict
	if c.strict && c.hostKey == "" {
		return nil, fmt.Errorf("%s or %s=true is required", SecretHostPublicKey, SecretNoStrictHostCheck)
	}
	if c.opts, err = splitOptions(string(data[SecretSSHOptions])); err != nil {
		return nil, fmt.Errorf("%s: %w", SecretSSHOptions, err)
	}
	for i, o := range c.opts {
		if o == "-p" && i+1 < len(c.opts) {
			if c.port, err = strconv.Atoi(c.opts[i+1]); err != nil {
				return nil, fmt.Errorf("%s: port %q", SecretSSHOptions, c.opts[i+1])
			}
		}
	}
	return c, nil
}

func (c *sshConn) run(ctx context.Context, ip, script string, out interface{ Write([]byte) (int, error) }) error {
	dir, err := os.MkdirTemp("", "execute-in-vm-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	key, known := filepath.Join(dir, "id"), filepath.Join(dir, "known_hosts")
	if !strings.HasSuffix(c.key, "\n") {
		c.key += "\n"
	}
	if err := os.WriteFile(key, []byte(c.key), 0o600); err != nil {
		return err
	}
	if c.hostKey != "" {
		host := ip
		if c.port != 22 {
			host = fmt.Sprintf("[%s]:%d", ip, c.port)
		}
		if err := os.WriteFile(known, []byte(host+" "+c.hostKey+"\n"), 0o600); err != nil {
			return err
		}
	}
	strict := "yes"
	if !c.strict {
		strict = "no"
	}
	args := []string{"-i", key, "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes", "-o", "UserKnownHostsFile=" + known,
		"-o", "StrictHostKeyChecking=" + strict}
	args = append(args, c.opts...)
	args = append(args, c.user+"@"+ip, "--", script)
	cmd := exec.CommandContext(ctx, "ssh", args...)
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Run(); err != nil {
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			return fmt.Errorf("the command in the VM exited %d", exit.ExitCode())
		}
		return fmt.Errorf("ssh: %w", err)
	}
	return nil
}

// runningAddress starts the VM if it has no VMI (once), waits until its
// VMI runs and reports an address: the pod network's, else the first one.
func runningAddress(ctx context.Context, c *virtctl.Client, ns, name string) (string, error) {
	started := false
	var ip string
	pc := *c
	pc.Namespace = ns
	err := poll(ctx, time.Second, func() (bool, error) {
		vmi, err := c.Virt.VMIs.Get(ctx, ns, name)
		if apierrors.IsNotFound(err) || (err == nil && vmi.Status.Phase == kubevirtv1.Failed) {
			if !started {
				started = true
				if err := pc.VM(ctx, name, "start", &kubevirtv1.StartOptions{}); err != nil && !apierrors.IsConflict(err) {
					return false, fmt.Errorf("start vm %s/%s: %w", ns, name, err)
				}
			}
			return false, nil
		}
		if err != nil || vmi.Status.Phase != kubevirtv1.Running {
			return false, err
		}
		ip = vmiAddress(vmi)
		return ip != "", nil
	})
	if err != nil {
		return "", fmt.Errorf("vm %s/%s running with an address: %w", ns, name, err)
	}
	return ip, nil
}

func vmiAddress(vmi *kubevirtv1.VirtualMachineInstance) string {
	pod := ""
	for _, n := range vmi.Spec.Networks {
		if n.Pod != nil {
			pod = n.Name
		}
	}
	first := ""
	for _, i := range vmi.Status.Interfaces {
		if i.IP == "" {
			continue
		}
		if i.Name == pod && pod != "" {
			return i.IP
		}
		if first == "" {
			first = i.IP
		}
	}
	return first
}

func shellQuote(s string) string {
	if s != "" && strings.IndexFunc(s, func(r rune) bool {
		return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("-_./=:,+@%", r))
	}) < 0 {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
