package guest

import (
	"bytes"
	"io"
	"strings"
	"sync"
	"testing"
	"time"
)

// Console collects what a guest's console stream yields (a libvirt console,
// the node agent's console server, the subresource websocket), so tests can
// wait for lines. Each Expect consumes output up to the line it returns.
type Console struct {
	mu      sync.Mutex
	buf     []byte
	cursor  int
	changed chan struct{}
	err     error
}

// ReadConsole starts collecting r until it ends.
func ReadConsole(r io.Reader) *Console {
	c := &Console{changed: make(chan struct{})}
	go func() {
		p := make([]byte, 4096)
		for {
			n, err := r.Read(p)
			c.mu.Lock()
			c.buf = append(c.buf, bytes.ReplaceAll(p[:n], []byte("\r"), nil)...)
			if err != nil {
				c.err = err
			}
			close(c.changed)
			c.changed = make(chan struct{})
			c.mu.Unlock()
			if err != nil {
				return
			}
		}
	}()
	return c
}

// Expect waits up to timeout for a whole line containing text and returns
// it; the test fails when none comes or the stream ends first.
func (c *Console) Expect(t testing.TB, text string, timeout time.Duration) string {
	t.Helper()
	return c.expect(t, text, false, timeout)
}

// ExpectExact is Expect for a line equal to text.
func (c *Console) ExpectExact(t testing.TB, text string, timeout time.Duration) string {
	t.Helper()
	return c.expect(t, text, true, timeout)
}

func (c *Console) expect(t testing.TB, text string, exact bool, timeout time.Duration) string {
	t.Helper()
	deadline := time.After(timeout)
	for {
		c.mu.Lock()
		rest := c.buf[c.cursor:]
		for off := 0; ; {
			nl := bytes.IndexByte(rest[off:], '\n')
			if nl < 0 {
				break
			}
			line := string(rest[off : off+nl])
			if (exact && line == text) || (!exact && strings.Contains(line, text)) {
				c.cursor += off + nl + 1
				c.mu.Unlock()
				return line
			}
			off += nl + 1
		}
		ch, err := c.changed, c.err
		c.mu.Unlock()
		if err != nil {
			t.Fatalf("console ended (%v) before %q; got:\n%s", err, text, c.String())
		}
		select {
		case <-ch:
		case <-deadline:
			t.Fatalf("no %q on the console within %s; got:\n%s", text, timeout, c.String())
		}
	}
}

// Prompt is the guest's shell prompt on its console.
const Prompt = "nodevirt# "

// Login waits up to timeout for the console shell's prompt, pressing Enter
// on w every two seconds while none shows: a line typed before init has
// started the shell can be lost with the tty's input. Output up to the
// prompt is consumed.
func (c *Console) Login(t testing.TB, w io.Writer, timeout time.Duration) {
	t.Helper()
	deadline := time.After(timeout)
	for {
		c.mu.Lock()
		i := bytes.LastIndex(c.buf[c.cursor:], []byte(Prompt))
		if i >= 0 {
			c.cursor += i + len(Prompt)
		}
		ch, err := c.changed, c.err
		c.mu.Unlock()
		switch {
		case i >= 0:
			return
		case err != nil:
			t.Fatalf("console ended (%v) before the shell prompt; got:\n%s", err, c.String())
		}
		select {
		case <-ch:
		case <-time.After(2 * time.Second):
			if _, err := io.WriteString(w, "\n"); err != nil {
				t.Fatalf("console: %v", err)
			}
		case <-deadline:
			t.Fatalf("no shell prompt on the console within %s; got:\n%s", timeout, c.String())
		}
	}
}

// Ended waits up to timeout for the stream to end and tells whether it did.
func (c *Console) Ended(timeout time.Duration) bool {
	deadline := time.After(timeout)
	for {
		c.mu.Lock()
		ch, err := c.changed, c.err
		c.mu.Unlock()
		if err != nil {
			return true
		}
		select {
		case <-ch:
		case <-deadline:
			return false
		}
	}
}

// String is everything collected so far.
func (c *Console) String() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return string(c.buf)
}
