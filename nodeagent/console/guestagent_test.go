package console

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	kubevirtv1 "kubevirt.io/api/core/v1"
)

// agentBackend adds fixed guest agent answers to echoBackend; the VMI
// "noagent" runs without an agent. The handler's integration test reads a
// real qemu-ga through these calls.
type agentBackend struct{ *echoBackend }

var _ GuestAgentBackend = agentBackend{}

func (b agentBackend) check(ns, name string) error {
	if _, err := b.open(ns, name); err != nil {
		return err
	}
	if name == "noagent" {
		return fmt.Errorf("%w: %s/%s", ErrNoGuestAgent, ns, name)
	}
	return nil
}

func (b agentBackend) GuestOSInfo(_ context.Context, ns, name string) (*kubevirtv1.VirtualMachineInstanceGuestAgentInfo, error) {
	if err := b.check(ns, name); err != nil {
		return nil, err
	}
	return &kubevirtv1.VirtualMachineInstanceGuestAgentInfo{GAVersion: "7.2.0", Hostname: name,
		OS: kubevirtv1.VirtualMachineInstanceGuestOSInfo{ID: "debian"}}, nil
}

func (b agentBackend) UserList(_ context.Context, ns, name string) (*kubevirtv1.VirtualMachineInstanceGuestOSUserList, error) {
	if err := b.check(ns, name); err != nil {
		return nil, err
	}
	return &kubevirtv1.VirtualMachineInstanceGuestOSUserList{Items: []kubevirtv1.VirtualMachineInstanceGuestOSUser{{UserName: "root", LoginTime: 1}}}, nil
}

func (b agentBackend) FileSystemList(_ context.Context, ns, name string) (*kubevirtv1.VirtualMachineInstanceFileSystemList, error) {
	if err := b.check(ns, name); err != nil {
		return nil, err
	}
	return &kubevirtv1.VirtualMachineInstanceFileSystemList{Items: []kubevirtv1.VirtualMachineInstanceFileSystem{{DiskName: "vda1", MountPoint: "/boot"}}}, nil
}

func TestGuestAgentGets(t *testing.T) {
	pki, err := MintPKI(t.TempDir(), "127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	s, err := New(pki.ServerConfig("127.0.0.1:0"), agentBackend{&echoBackend{calls: make(chan string, 10)}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	done := make(chan error)
	go func() { done <- s.Run(ctx) }()
	defer func() { cancel(); <-done }()
	c := client(t, s, pki)

	var info kubevirtv1.VirtualMachineInstanceGuestAgentInfo
	if err := c.GuestAgent(ctx, "ns", "vm", "guestosinfo", &info); err != nil || info.Hostname != "vm" || info.OS.ID != "debian" {
		t.Fatalf("guestosinfo: %+v %v", info, err)
	}
	var users kubevirtv1.VirtualMachineInstanceGuestOSUserList
	if err := c.GuestAgent(ctx, "ns", "vm", "userlist", &users); err != nil || len(users.Items) != 1 || users.Items[0].UserName != "root" {
		t.Fatalf("userlist: %+v %v", users, err)
	}
	var fss kubevirtv1.VirtualMachineInstanceFileSystemList
	if err := c.GuestAgent(ctx, "ns", "vm", "filesystemlist", &fss); err != nil || len(fss.Items) != 1 || fss.Items[0].MountPoint != "/boot" {
		t.Fatalf("filesystemlist: %+v %v", fss, err)
	}
	if err := c.GuestAgent(ctx, "ns", "noagent", "userlist", &users); !errors.Is(err, ErrNoGuestAgent) || !strings.Contains(err.Error(), "409") {
		t.Errorf("no agent: %v, want a 409 with ErrNoGuestAgent", err)
	}
	if err := c.GuestAgent(ctx, "ns", "missing", "userlist", &users); !errors.Is(err, ErrNotFound) {
		t.Errorf("missing vmi: %v, want ErrNotFound", err)
	}
	if err := c.GuestAgent(ctx, "ns", "vm", "nosuchinfo", &users); err == nil || !strings.Contains(err.Error(), "404") {
		t.Errorf("unknown info: %v, want 404", err)
	}
}

func TestGuestAgentNotServed(t *testing.T) {
	s, pki, _ := startServer(t, nil)
	c := client(t, s, pki)
	var info kubevirtv1.VirtualMachineInstanceGuestAgentInfo
	err := c.GuestAgent(context.Background(), "ns", "vm", "guestosinfo", &info)
	if err == nil || !strings.Contains(err.Error(), "501") {
		t.Fatalf("backend without guest agent: %v, want 501", err)
	}
}

// freezeBackend adds freeze and thaw to agentBackend.
type freezeBackend struct{ agentBackend }

var _ FreezeBackend = freezeBackend{}

func (b freezeBackend) Freeze(_ context.Context, ns, name string, unfreezeTimeout time.Duration) error {
	if err := b.check(ns, name); err != nil {
		return err
	}
	b.calls <- fmt.Sprintf("freeze %s/%s %s", ns, name, unfreezeTimeout)
	return nil
}

func (b freezeBackend) Unfreeze(_ context.Context, ns, name string) error {
	if err := b.check(ns, name); err != nil {
		return err
	}
	b.calls <- "unfreeze " + ns + "/" + name
	return nil
}

// TestFreezeActions: freeze and unfreeze reach a backend that freezes; a
// guest without agent is a 409; a backend that cannot freeze answers 501.
func TestFreezeActions(t *testing.T) {
	pki, err := MintPKI(t.TempDir(), "127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	calls := make(chan string, 10)
	run := func(b Backend) (*Client, func()) {
		s, err := New(pki.ServerConfig("127.0.0.1:0"), b)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		done := make(chan error)
		go func() { done <- s.Run(ctx) }()
		return client(t, s, pki), func() { cancel(); <-done }
	}
	c, stop := run(freezeBackend{agentBackend{&echoBackend{calls: calls}}})
	defer stop()
	ctx := context.Background()
	for a, want := range map[string]string{"freeze": "freeze ns/vm 5m0s", "unfreeze": "unfreeze ns/vm"} {
		if err := c.Do(ctx, "ns", "vm", a); err != nil {
			t.Fatalf("%s: %v", a, err)
		}
		if got := <-calls; got != want {
			t.Errorf("backend got %q for %s, want %q", got, a, want)
		}
	}
	if err := c.Do(ctx, "ns", "noagent", "freeze"); err == nil || !strings.Contains(err.Error(), "409") || !strings.Contains(err.Error(), "guest agent") {
		t.Errorf("freeze without agent: %v, want a 409 naming the guest agent", err)
	}
	plain, stopPlain := run(&echoBackend{calls: calls})
	defer stopPlain()
	if err := plain.Do(ctx, "ns", "vm", "freeze"); err == nil || !strings.Contains(err.Error(), "501") {
		t.Errorf("freeze on a backend without freeze: %v, want 501", err)
	}
}

// A freeze's body is KubeVirt's FreezeUnfreezeTimeout: absent, the default;
// given, its value (0: never thawed by the node); a negative or missing
// timeout in a body is refused.
func TestUnfreezeTimeoutBody(t *testing.T) {
	for body, want := range map[string]string{"": "5m0s", `{"unfreezeTimeout":"30s"}`: "30s", `{"unfreezeTimeout":"0s"}`: "0s",
		`{"unfreezeTimeout":"-1s"}`: "error", `{}`: "error", `{`: "error"} {
		d, err := unfreezeTimeout(httptest.NewRequest(http.MethodPut, "/", strings.NewReader(body)))
		got := d.String()
		if err != nil {
			got = "error"
		}
		if got != want {
			t.Errorf("body %q: %s (%v), want %s", body, got, err, want)
		}
	}
}
