package subresources

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"os/exec"
	"strings"
	"sync"
	"testing"

	"github.com/gorilla/websocket"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/identity"
	"github.com/nodevirt/nodevirt/clusterbrain/api/plainstream"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/uploadtls"
)

// standin is a node-side console server standing in for the nodeagent (not
// part of these tests): HTTPS with mutual TLS, virt-handler's paths, a
// console that is a real /bin/sh behind a pipe, and a VNC stream that
// echoes.
type standin struct {
	addr string

	mu       sync.Mutex
	calls    []string // "PUT ns/name/pause"
	bodies   []string // "ns/name/freeze {...}": the bodies of PUTs that have one
	consoles int      // console connections accepted
	peers    []string // client certificate names seen
}

// startStandin serves as node with a certificate naming it (and the name
// every node certificate shares).
func startStandin(t *testing.T, ca *uploadtls.CA, node string) *standin {
	t.Helper()
	cert, err := ca.Issue(identity.NodeUser(node), []string{node, identity.HandlerServerName}, []net.IP{net.ParseIP("127.0.0.1")}, false)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(ca.Cert)
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{Certificates: []tls.Certificate{cert},
		ClientCAs: pool, ClientAuth: tls.RequireAndVerifyClientCert})
	if err != nil {
		t.Fatal(err)
	}
	s := &standin{addr: ln.Addr().String()}
	srv := &http.Server{Handler: s}
	go srv.Serve(ln)
	// Lives as long as the test binary, like the server under test.
	return s
}

func (s *standin) record(r *http.Request, what string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.calls = append(s.calls, r.Method+" "+what)
	if r.TLS != nil && len(r.TLS.PeerCertificates) > 0 {
		s.peers = append(s.peers, r.TLS.PeerCertificates[0].Subject.CommonName)
	}
}

func (s *standin) called() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.calls...)
}

func (s *standin) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	// /v1/namespaces/{ns}/virtualmachineinstances/{name}/{action}
	p := strings.Split(strings.Trim(r.URL.Path, "/"), "/")
	if len(p) == 7 && p[5] == "vnc" && p[6] == "screenshot" {
		s.record(r, p[2]+"/"+p[4]+"/vnc/screenshot")
		w.Header().Set("Content-Type", "image/png")
		_, _ = w.Write(append([]byte("\x89PNG\r\n\x1a\n"), p[4]...))
		return
	}
	if len(p) == 8 && p[5] == "portforward" {
		s.record(r, p[2]+"/"+p[4]+"/"+strings.Join(p[5:], "/"))
		s.portForward(w, r, p[6]+"/"+p[7])
		return
	}
	if len(p) != 6 || p[0] != "v1" || p[1] != "namespaces" || p[3] != "virtualmachineinstances" {
		http.NotFound(w, r)
		return
	}
	ns, name, action := p[2], p[4], p[5]
	s.record(r, ns+"/"+name+"/"+action)
	switch action {
	case "pause", "unpause", "softreboot", "freeze", "unfreeze":
		if r.Method != http.MethodPut {
			http.Error(w, "method", http.StatusMethodNotAllowed)
			return
		}
		if body, _ := io.ReadAll(r.Body); len(body) > 0 {
			s.mu.Lock()
			s.bodies = append(s.bodies, ns+"/"+name+"/"+action+" "+string(body))
			s.mu.Unlock()
		}
		if name == "broken" {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusInternalServerError)
			_, _ = w.Write([]byte(`{"kind":"Status","apiVersion":"v1","status":"Failure","message":"domain is gone","code":500}`))
			return
		}
		w.WriteHeader(http.StatusOK)
	case "guestosinfo":
		_ = json.NewEncoder(w).Encode(kubevirtv1.VirtualMachineInstanceGuestAgentInfo{GAVersion: "8.1.0", Hostname: name + ".standin",
			OS: kubevirtv1.VirtualMachineInstanceGuestOSInfo{Name: "Debian GNU/Linux", ID: "debian"}})
	case "userlist":
		_ = json.NewEncoder(w).Encode(kubevirtv1.VirtualMachineInstanceGuestOSUserList{Items: []kubevirtv1.VirtualMachineInstanceGuestOSUser{{UserName: "root", LoginTime: 1700000000}}})
	case "filesystemlist":
		_ = json.NewEncoder(w).Encode(kubevirtv1.VirtualMachineInstanceFileSystemList{Items: []kubevirtv1.VirtualMachineInstanceFileSystem{{DiskName: "vda1", MountPoint: "/", FileSystemType: "ext4", UsedBytes: 1 << 20, TotalBytes: 1 << 30}}})
	case "console":
		s.console(w, r)
	case "vnc":
		s.vnc(w, r)
	default:
		http.NotFound(w, r)
	}
}

var standinUpgrader = websocket.Upgrader{Subprotocols: []string{PlainStreamProtocol}}

// console runs /bin/sh with the websocket as its terminal-less stdio.
func (s *standin) console(w http.ResponseWriter, r *http.Request) {
	conn, err := standinUpgrader.Upgrade(w, r, nil)
	if err != nil {
		return
	}
	s.mu.Lock()
	s.consoles++
	s.mu.Unlock()
	stream := plainstream.New(conn)
	defer stream.Close()
	sh := exec.Command("/bin/sh")
	sh.Stdin = stream
	out := &lockedWriter{w: stream}
	sh.Stdout, sh.Stderr = out, out
	if err := sh.Start(); err != nil {
		return
	}
	_, _ = stream.Write([]byte("standin console ready\n"))
	_ = sh.Wait()
}

// vnc echoes, standing in for QEMU's RFB socket.
func (s *standin) vnc(w http.ResponseWriter, r *http.Request) {
	conn, err := standinUpgrader.Upgrade(w, r, nil)
	if err != nil {
		return
	}
	stream := plainstream.New(conn)
	defer stream.Close()
	_, _ = stream.Write([]byte("RFB 003.008\n"))
	_, _ = io.Copy(stream, stream)
}

// portForward greets with the port it was asked for, then echoes:
// standing in for a guest's listener.
func (s *standin) portForward(w http.ResponseWriter, r *http.Request, port string) {
	conn, err := standinUpgrader.Upgrade(w, r, nil)
	if err != nil {
		return
	}
	stream := plainstream.New(conn)
	defer stream.Close()
	_, _ = stream.Write([]byte("guest port " + port + "\n"))
	_, _ = io.Copy(stream, stream)
}

type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

func insecureClient() *http.Client {
	return &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}
}
