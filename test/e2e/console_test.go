package e2e

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/gorilla/websocket"
	"k8s.io/client-go/rest"

	"github.com/nodevirt/nodevirt/test/testkit"
)

// How the suite sees a guest's console.
//
//   - Interactive (type a command, read its output): the real API path,
//     the subresources.kubevirt.io/v1 "console" websocket with the
//     plain.kubevirt.io subprotocol, served by the brain behind
//     kube-apiserver and proxied to the node agent — what `virtctl console`
//     uses. Without it interactive tests fail, naming the missing API.
//   - Boot output (NODEVIRT-... markers, printed before anyone can attach):
//     the serial log that logSerialConsole: true asks for, read from the
//     file the live domain definition names, as an administrator would.

// console is an open console stream of one VMI.
type console struct {
	n    *testNS
	vmi  string
	conn *websocket.Conn

	mu      sync.Mutex
	out     []byte
	cursor  int
	readErr error
	changed chan struct{}
}

const subresourcesGV = "subresources.kubevirt.io/v1"

// console opens the VMI's console through kube-apiserver, as virtctl does.
func (n *testNS) console(vmi string) *console {
	n.t.Helper()
	if _, err := n.e.kube.Discovery().ServerResourcesForGroupVersion(subresourcesGV); err != nil {
		n.t.Fatalf("console of %s/%s: the %s API is not served (clusterbrain subresources role, issue 9): %v", n.name, vmi, subresourcesGV, err)
	}
	tlsCfg, err := rest.TLSConfigFor(n.e.rest)
	if err != nil {
		n.t.Fatal(err)
	}
	url := strings.Replace(n.e.rest.Host, "https://", "wss://", 1) +
		fmt.Sprintf("/apis/%s/namespaces/%s/virtualmachineinstances/%s/console", subresourcesGV, n.name, vmi)
	d := websocket.Dialer{TLSClientConfig: tlsCfg, Subprotocols: []string{"plain.kubevirt.io"}, HandshakeTimeout: 15 * time.Second}
	var conn *websocket.Conn
	n.eventually(30*time.Second, fmt.Sprintf("console websocket of %s/%s", n.name, vmi), func() (bool, string) {
		c, resp, err := d.Dial(url, nil)
		if err != nil {
			return false, dialError(err, resp)
		}
		conn = c
		return true, ""
	})
	c := &console{n: n, vmi: vmi, conn: conn, changed: make(chan struct{}, 1)}
	go c.read()
	n.t.Cleanup(func() { conn.Close() })
	return c
}

func dialError(err error, resp *http.Response) string {
	if resp == nil {
		return err.Error()
	}
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 2048))
	resp.Body.Close()
	return fmt.Sprintf("%v: HTTP %s: %s", err, resp.Status, strings.TrimSpace(string(body)))
}

func (c *console) read() {
	for {
		_, data, err := c.conn.ReadMessage()
		c.mu.Lock()
		c.out = append(c.out, data...)
		if err != nil {
			c.readErr = err
		}
		c.mu.Unlock()
		select {
		case c.changed <- struct{}{}:
		default:
		}
		if err != nil {
			return
		}
	}
}

// send types text on the console.
func (c *console) send(text string) {
	c.n.t.Helper()
	if err := c.conn.WriteMessage(websocket.BinaryMessage, []byte(text)); err != nil {
		c.n.t.Fatalf("console of %s/%s: write: %v", c.n.name, c.vmi, err)
	}
}

// expect waits until the output after the last match matches pattern and
// returns the submatches.
func (c *console) expect(pattern string, timeout time.Duration) []string {
	c.n.t.Helper()
	re := regexp.MustCompile(pattern)
	deadline := time.After(timeout)
	for {
		c.mu.Lock()
		rest := string(c.out[c.cursor:])
		if m := re.FindStringSubmatchIndex(rest); m != nil {
			c.cursor += m[1]
			c.mu.Unlock()
			out := make([]string, len(m)/2)
			for i := range out {
				if m[2*i] >= 0 {
					out[i] = rest[m[2*i]:m[2*i+1]]
				}
			}
			return out
		}
		readErr := c.readErr
		c.mu.Unlock()
		if readErr != nil {
			c.n.t.Fatalf("console of %s/%s closed before %q: %v; output so far:\n%s", c.n.name, c.vmi, pattern, readErr, lastBytes(rest, 600))
		}
		select {
		case <-c.changed:
		case <-deadline:
			c.n.t.Fatalf("console of %s/%s: %q not seen after %s; output since last match:\n%s", c.n.name, c.vmi, pattern, timeout, lastBytes(rest, 600))
		}
	}
}

// login presses Enter until the guest's root shell prompt answers.
func (c *console) login() {
	c.n.t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		c.send("\r")
		c.mu.Lock()
		found := strings.Contains(string(c.out[c.cursor:]), "nodevirt# ")
		c.mu.Unlock()
		if found {
			c.expect(`nodevirt# `, time.Second)
			// Drain prompts answering the extra Enters.
			time.Sleep(300 * time.Millisecond)
			c.mu.Lock()
			c.cursor = len(c.out)
			c.mu.Unlock()
			return
		}
		if time.Now().After(deadline) {
			c.expect(`nodevirt# `, time.Second) // fails with the output
		}
		select {
		case <-c.changed:
		case <-time.After(2 * time.Second):
		}
	}
}

func lastBytes(s string, n int) string {
	if len(s) > n {
		return "…" + s[len(s)-n:]
	}
	return s
}

// serialLog follows a VMI's serial log file (logSerialConsole: true).
type serialLog struct {
	n    *testNS
	vmi  string
	path string

	f      *os.File
	ino    uint64
	out    []byte
	cursor int
}

// serial opens the serial log of the VMI's current domain.
func (n *testNS) serial(vmi string) *serialLog {
	n.t.Helper()
	s := &serialLog{n: n, vmi: vmi}
	n.eventually(60*time.Second, fmt.Sprintf("serial log of %s/%s", n.name, vmi), func() (bool, string) {
		dom, err := domainXML(n.name, vmi)
		if err != nil {
			return false, "no domain: " + err.Error()
		}
		if dom.Devices != nil {
			for _, sr := range dom.Devices.Serials {
				if sr.Log != nil && sr.Log.File != "" {
					s.path = sr.Log.File
					return true, ""
				}
			}
		}
		return false, fmt.Sprintf("domain %s has no serial log although the VMI sets logSerialConsole: nodeagent/launcher ignored it", domainName(n.name, vmi))
	})
	n.t.Cleanup(func() {
		if s.f != nil {
			s.f.Close()
		}
	})
	return s
}

// poll reads what was appended since the last poll, reopening the file when
// it was replaced.
func (s *serialLog) poll() {
	if s.f != nil {
		if st, err := os.Stat(s.path); err == nil && st.Sys().(*syscall.Stat_t).Ino != s.ino {
			s.readAll()
			s.f.Close()
			s.f = nil
		}
	}
	if s.f == nil {
		f, err := os.Open(s.path)
		if err != nil {
			return
		}
		st, _ := f.Stat()
		s.f, s.ino = f, st.Sys().(*syscall.Stat_t).Ino
	}
	s.readAll()
}

func (s *serialLog) readAll() {
	buf := make([]byte, 64<<10)
	for {
		n, err := s.f.Read(buf)
		s.out = append(s.out, buf[:n]...)
		if n == 0 || err != nil {
			return
		}
	}
}

// expect waits until the log after the last match matches pattern and
// returns the submatches.
func (s *serialLog) expect(pattern string, timeout time.Duration) []string {
	s.n.t.Helper()
	re := regexp.MustCompile(pattern)
	var out []string
	what := fmt.Sprintf("%q in serial log %s of %s/%s", pattern, s.path, s.n.name, s.vmi)
	testkit.PollEvery(s.n.t, 200*time.Millisecond, timeout, what, func() (bool, error) {
		s.poll()
		rest := string(s.out[s.cursor:])
		m := re.FindStringSubmatchIndex(rest)
		if m == nil {
			return false, notSeen(func() string {
				return fmt.Sprintf("domain state %q; log since last match:\n%s", domainState(s.n.name, s.vmi), lastBytes(rest, 800))
			})
		}
		s.cursor += m[1]
		out = make([]string, len(m)/2)
		for i := range out {
			if m[2*i] >= 0 {
				out[i] = rest[m[2*i]:m[2*i+1]]
			}
		}
		return true, nil
	})
	return out
}

// notSeen explains a wait that timed out; it is only asked (a domain state
// read with virsh) when the wait fails.
type notSeen func() string

func (e notSeen) Error() string { return e() }

// contains tells whether the whole log read so far matches pattern.
func (s *serialLog) contains(pattern string) bool {
	s.poll()
	return regexp.MustCompile(pattern).Match(s.out)
}

// bootTimeout bounds a guest's boot under TCG on busy shared cores (it
// takes 4-6 s alone).
const bootTimeout = 150 * time.Second

// waitBooted waits for the guest's READY marker in its serial log.
func (n *testNS) waitBooted(vmi string) *serialLog {
	n.t.Helper()
	s := n.serial(vmi)
	s.expect(`NODEVIRT-GUEST-READY`, bootTimeout)
	return s
}

func regexpMatch(pattern, s string) bool { return regexp.MustCompile(pattern).MatchString(s) }
