package e2e

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"
)

// daemon is a nodevirt binary run as a child process, its output appended
// to <root>/<name>.log across restarts.
type daemon struct {
	name    string
	bin     string
	args    []string
	logPath string
	env     []string

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
}

func newDaemon(e *env, name string, args ...string) *daemon {
	return &daemon{name: name, bin: filepath.Join(e.bin, name), args: args, logPath: e.path(name + ".log"),
		env: append(os.Environ(), "NODEVIRT_ROOT="+e.repo, "CNI_PATH="+e.bin)}
}

func (d *daemon) start() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	logf, err := os.OpenFile(d.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer logf.Close()
	fmt.Fprintf(logf, "=== e2e: starting %s %s at %s\n", d.name, strings.Join(d.args, " "), time.Now().Format(time.RFC3339Nano))
	cmd := exec.Command(d.bin, d.args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Env = d.env
	// Its own process group, and gone if the test binary dies.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", d.name, err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	d.cmd, d.done = cmd, done
	return nil
}

func (d *daemon) pid() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.cmd == nil {
		return 0
	}
	return d.cmd.Process.Pid
}

func (d *daemon) alive() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.done == nil {
		return false
	}
	select {
	case <-d.done:
		return false
	default:
		return true
	}
}

// kill sends SIGKILL and waits for the process to be gone.
func (d *daemon) kill() {
	d.signal(syscall.SIGKILL, 10*time.Second)
}

// stop sends SIGTERM, then SIGKILL after 15 s.
func (d *daemon) stop() {
	if !d.signal(syscall.SIGTERM, 15*time.Second) {
		d.kill()
	}
}

func (d *daemon) signal(sig syscall.Signal, wait time.Duration) bool {
	d.mu.Lock()
	cmd, done := d.cmd, d.done
	d.mu.Unlock()
	if cmd == nil {
		return true
	}
	_ = cmd.Process.Signal(sig)
	select {
	case <-done:
		return true
	case <-time.After(wait):
		return false
	}
}

// addr returns the value of one of the daemon's --flag=value arguments.
func (d *daemon) flag(name string) string {
	for _, a := range d.args {
		if v, ok := strings.CutPrefix(a, "--"+name+"="); ok {
			return v
		}
	}
	return ""
}

// tail returns the last lines of the daemon's log.
func (d *daemon) tail(lines int) string {
	return tailFile(d.logPath, lines, "")
}

// tailFile returns the last lines of a file, only those containing match
// when it is not empty.
func tailFile(path string, lines int, match string) string {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Sprintf("(no log: %v)", err)
	}
	defer f.Close()
	var ring []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		if match != "" && !strings.Contains(sc.Text(), match) {
			continue
		}
		ring = append(ring, sc.Text())
		if len(ring) > lines {
			ring = ring[1:]
		}
	}
	return strings.Join(ring, "\n")
}

// dumpLogs writes the tails of every log the run has.
func (e *env) dumpLogs(w io.Writer, lines int) {
	if e.root == "" {
		return
	}
	for _, d := range []*daemon{e.brain, e.agent, e.agent2} {
		if d != nil {
			fmt.Fprintf(w, "\n===== last %d lines of %s =====\n%s\n", lines, d.logPath, d.tail(lines))
		}
	}
	for _, name := range []string{"kube-apiserver", "kube-controller-manager"} {
		p := e.path("controlplane", name+".log")
		fmt.Fprintf(w, "\n===== last 15 lines of %s =====\n%s\n", p, tailFile(p, 15, ""))
	}
}
