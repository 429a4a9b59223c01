package guest

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// RunSpec says how Run boots a guest.
type RunSpec struct {
	// Kernel and Initramfs boot the guest directly. With Kernel empty the
	// guest boots from Disks[0] through the BIOS (a BootDisk).
	Kernel    string
	Initramfs string
	// Cmdline is appended to "console=ttyS0 panic=-1" for a direct kernel
	// boot, e.g. "nodevirt.ip=10.0.0.2/24".
	Cmdline string
	// Disks are attached in order (vda, vdb, … on the default virtio bus).
	Disks []Disk
	// NICs are attached in order (eth0, eth1, …).
	NICs []NIC
	// MemoryMiB defaults to 256, CPUs to 1, Machine to "pc".
	MemoryMiB int
	CPUs      int
	Machine   string
	// Log, when set, receives the console output line by line as it
	// arrives (for example a test's t.Output()).
	Log io.Writer
	// NetNS, when set, is a network namespace file (/run/netns/NAME or
	// /proc/PID/ns/net) QEMU runs in, so that NIC.Tap names a tap device
	// made inside that namespace and the host's network stays untouched.
	NetNS string
	// ExtraArgs are appended to the QEMU command line.
	ExtraArgs []string
}

// Disk is a disk or CD-ROM of a guest run by Run.
type Disk struct {
	Path string
	// Format is "raw" or "qcow2"; empty detects it from the file's header.
	Format string
	// Bus is "virtio" (the default), "ide" or "scsi" (virtio-scsi).
	Bus string
	// CDROM attaches the image as a read-only CD-ROM, as a cloud-init seed
	// usually is: on the "ide" bus by default, on "scsi" for q35 machines,
	// whose CD-ROMs would be AHCI (SATA), a driver the cloud kernel lacks.
	CDROM bool
	// Snapshot sends writes to a temporary overlay, leaving the file
	// untouched, so a cached image can be booted by many guests at once.
	Snapshot bool
	// ReadOnly attaches the disk read-only.
	ReadOnly bool
}

// NIC is a network interface of a guest run by Run.
type NIC struct {
	// MAC defaults to one QEMU picks.
	MAC string
	// Model defaults to "virtio-net-pci".
	Model string
	// Tap names a tap device to connect to, in RunSpec.NetNS if that is
	// set (made by QEMU if it does not exist; no scripts are run).
	Tap string
	// Netdev is a raw QEMU -netdev backend without its id, for example
	// "socket,listen=127.0.0.1:5000" or "socket,mcast=230.0.0.1:5000".
	// With neither Tap nor Netdev the NIC is connected to nothing.
	Netdev string
}

// Instance is a running QEMU guest whose serial console is read and written
// by the test.
type Instance struct {
	cmd     *exec.Cmd
	stdin   io.WriteCloser
	dir     string
	monitor string
	log     io.Writer

	mu      sync.Mutex
	out     []byte        // console output, \r and terminal escapes removed
	cursor  int           // where the next Expect starts looking
	changed chan struct{} // closed and replaced whenever out grows or QEMU exits
	exited  bool
	waitErr error
	stderr  bytes.Buffer
	cmdSeq  int
}

// Run starts QEMU (TCG, no display, serial console on a pipe, HMP monitor on
// a unix socket). QEMU is killed when ctx ends; call Kill (or Wait) to reap
// it and remove its temporary directory.
func Run(ctx context.Context, spec RunSpec) (*Instance, error) {
	qemu, err := need("qemu-system-x86_64")
	if err != nil {
		return nil, err
	}
	if spec.Kernel == "" && len(spec.Disks) == 0 {
		return nil, errors.New("run guest: neither a kernel nor a boot disk given")
	}
	dir, err := os.MkdirTemp("", "nodevirt-guest-")
	if err != nil {
		return nil, fmt.Errorf("run guest: %w", err)
	}
	args, err := qemuArgs(spec, filepath.Join(dir, "monitor.sock"))
	if err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("run guest: %w", err)
	}
	if spec.NetNS != "" {
		nsenter, err := need("nsenter")
		if err != nil {
			os.RemoveAll(dir)
			return nil, fmt.Errorf("run guest: %w", err)
		}
		// nsenter execs QEMU once in the namespace: the process stays the same.
		args = append([]string{"--net=" + spec.NetNS, "--", qemu}, args...)
		qemu = nsenter
	}
	cmd := exec.CommandContext(ctx, qemu, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	in := &Instance{cmd: cmd, dir: dir, monitor: filepath.Join(dir, "monitor.sock"), log: spec.Log,
		changed: make(chan struct{})}
	cmd.Stderr = &lockedWriter{mu: &in.mu, w: &in.stderr}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("run guest: %w", err)
	}
	if in.stdin, err = cmd.StdinPipe(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("run guest: %w", err)
	}
	if err := cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("run guest: %w", err)
	}
	go in.read(stdout)
	return in, nil
}

func qemuArgs(spec RunSpec, monitor string) ([]string, error) {
	mem, cpus, machine := spec.MemoryMiB, spec.CPUs, spec.Machine
	if mem == 0 {
		mem = 256
	}
	if cpus == 0 {
		cpus = 1
	}
	if machine == "" {
		machine = "pc"
	}
	args := []string{
		"-accel", "tcg", "-machine", machine, "-m", strconv.Itoa(mem), "-smp", strconv.Itoa(cpus),
		"-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
		"-chardev", "stdio,id=console,signal=off", "-serial", "chardev:console",
		"-monitor", "unix:" + monitor + ",server=on,wait=off",
	}
	if spec.Kernel != "" {
		args = append(args, "-kernel", spec.Kernel, "-append", strings.TrimSpace("console=ttyS0 panic=-1 "+spec.Cmdline))
		if spec.Initramfs != "" {
			args = append(args, "-initrd", spec.Initramfs)
		}
	}
	scsi := false
	for i, d := range spec.Disks {
		format := d.Format
		if format == "" {
			var err error
			if format, err = detectFormat(d.Path); err != nil {
				return nil, err
			}
		}
		drive := fmt.Sprintf("file=%s,format=%s,if=none,id=disk%d", d.Path, format, i)
		if d.Snapshot {
			drive += ",snapshot=on"
		}
		if d.ReadOnly || d.CDROM {
			drive += ",readonly=on"
		}
		bus := d.Bus
		switch {
		case bus != "":
		case d.CDROM && strings.HasPrefix(machine, "q35"):
			bus = "scsi" // q35's CD-ROMs are AHCI, which the cloud kernel lacks
		case d.CDROM:
			bus = "ide"
		default:
			bus = "virtio"
		}
		var dev string
		switch {
		case bus == "virtio" && !d.CDROM:
			dev = "virtio-blk-pci"
		case bus == "ide" && d.CDROM:
			dev = "ide-cd"
		case bus == "ide":
			dev = "ide-hd"
		case bus == "scsi":
			if !scsi {
				args = append(args, "-device", "virtio-scsi-pci,id=scsi0")
				scsi = true
			}
			dev = "scsi-hd,bus=scsi0.0"
			if d.CDROM {
				dev = "scsi-cd,bus=scsi0.0"
			}
		default:
			return nil, fmt.Errorf("disk %s: bus %q cannot carry it (cdrom=%t)", d.Path, bus, d.CDROM)
		}
		dev += fmt.Sprintf(",drive=disk%d", i)
		if i == 0 && spec.Kernel == "" {
			dev += ",bootindex=1"
		}
		args = append(args, "-drive", drive, "-device", dev)
	}
	for i, n := range spec.NICs {
		backend := n.Netdev
		switch {
		case n.Tap != "" && backend != "":
			return nil, fmt.Errorf("nic %d: both Tap and Netdev given", i)
		case n.Tap != "":
			backend = "tap,ifname=" + n.Tap + ",script=no,downscript=no"
		case backend == "":
			backend = fmt.Sprintf("hubport,hubid=%d", 100+i) // a hub of its own: connected to nothing
		}
		model := n.Model
		if model == "" {
			model = "virtio-net-pci"
		}
		dev := fmt.Sprintf("%s,netdev=net%d", model, i)
		if n.MAC != "" {
			dev += ",mac=" + n.MAC
		}
		args = append(args, "-netdev", fmt.Sprintf("%s,id=net%d", backend, i), "-device", dev)
	}
	return append(args, spec.ExtraArgs...), nil
}

func detectFormat(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", fmt.Errorf("disk: %w", err)
	}
	defer f.Close()
	magic := make([]byte, 4)
	if _, err := io.ReadFull(f, magic); err == nil && string(magic) == "QFI\xfb" {
		return "qcow2", nil
	}
	return "raw", nil
}

type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// read copies the console into out until QEMU closes it, then reaps QEMU.
func (in *Instance) read(r io.Reader) {
	var filter escapeFilter
	var pending []byte // the unfinished line, for Log
	buf := make([]byte, 4096)
	for {
		n, err := r.Read(buf)
		if n > 0 {
			clean := filter.apply(buf[:n])
			in.mu.Lock()
			in.out = append(in.out, clean...)
			in.notifyLocked()
			in.mu.Unlock()
			if in.log != nil {
				pending = append(pending, clean...)
				if i := bytes.LastIndexByte(pending, '\n'); i >= 0 {
					in.log.Write(pending[:i+1])
					pending = append([]byte(nil), pending[i+1:]...)
				}
			}
		}
		if err != nil {
			break
		}
	}
	if in.log != nil && len(pending) > 0 {
		in.log.Write(append(pending, '\n'))
	}
	err := in.cmd.Wait()
	in.mu.Lock()
	in.exited, in.waitErr = true, err
	in.notifyLocked()
	in.mu.Unlock()
	os.RemoveAll(in.dir)
}

func (in *Instance) notifyLocked() {
	close(in.changed)
	in.changed = make(chan struct{})
}

// escapeFilter drops carriage returns and ANSI escape sequences (busybox's
// line editor asks the terminal for the cursor position at every prompt),
// keeping state across reads.
type escapeFilter struct{ state int }

func (f *escapeFilter) apply(p []byte) []byte {
	out := make([]byte, 0, len(p))
	for _, b := range p {
		switch f.state {
		case 0:
			switch b {
			case 0x1b:
				f.state = 1
			case '\r':
			default:
				out = append(out, b)
			}
		case 1: // after ESC
			if b == '[' {
				f.state = 2
			} else {
				f.state = 0
			}
		case 2: // inside a CSI sequence, until its final byte
			if b >= 0x40 && b <= 0x7e {
				f.state = 0
			}
		}
	}
	return out
}

// Expect waits for a console line containing marker that comes after the
// line the previous Expect (or Command) matched, and returns the whole line.
// It fails when ctx ends or QEMU exits first.
func (in *Instance) Expect(ctx context.Context, marker string) (string, error) {
	for {
		in.mu.Lock()
		rest := in.out[in.cursor:]
		start := 0
		for {
			nl := bytes.IndexByte(rest[start:], '\n')
			if nl < 0 {
				break
			}
			line := rest[start : start+nl]
			if bytes.Contains(line, []byte(marker)) {
				in.cursor += start + nl + 1
				in.mu.Unlock()
				return string(line), nil
			}
			start += nl + 1
		}
		exited, changed := in.exited, in.changed
		in.mu.Unlock()
		if exited {
			return "", fmt.Errorf("expect %q: qemu exited (%v) first; console ends with:\n%s", marker, in.exitError(), in.tail(20))
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return "", fmt.Errorf("expect %q: %w; console ends with:\n%s", marker, ctx.Err(), in.tail(20))
		}
	}
}

// Send types line and a newline on the serial console. Busybox's line
// editor takes lines of up to about 1000 characters.
func (in *Instance) Send(line string) error {
	if _, err := io.WriteString(in.stdin, line+"\n"); err != nil {
		return fmt.Errorf("send to guest console: %w", err)
	}
	return nil
}

// Command runs a shell command on the guest's console once the guest is
// ready, and returns its output (stdout and stderr, which both go to the
// console, without the trailing newline). The command is one line of shell
// that must not end in "&". A non-zero exit status is an error that carries
// the output.
func (in *Instance) Command(ctx context.Context, command string) (string, error) {
	if err := in.waitPrompt(ctx); err != nil {
		return "", fmt.Errorf("guest command %q: %w", command, err)
	}
	in.mu.Lock()
	in.cmdSeq++
	seq := in.cmdSeq
	in.mu.Unlock()
	// The quotes keep the typed-in echo of the command from matching.
	begin, end := fmt.Sprintf("NODEVIRT-CMD-BEGIN-%d", seq), fmt.Sprintf("NODEVIRT-CMD-END-%d ", seq)
	line := fmt.Sprintf("echo NODEVIRT-CMD''-BEGIN-%d; %s; echo NODEVIRT-CMD''-END-%d $?", seq, command, seq)
	if err := in.Send(line); err != nil {
		return "", err
	}
	if _, err := in.Expect(ctx, begin); err != nil {
		return "", fmt.Errorf("guest command %q: %w", command, err)
	}
	in.mu.Lock()
	from := in.cursor
	in.mu.Unlock()
	last, err := in.Expect(ctx, end)
	if err != nil {
		return "", fmt.Errorf("guest command %q: %w", command, err)
	}
	in.mu.Lock()
	block := string(in.out[from:in.cursor])
	in.mu.Unlock()
	output := strings.TrimSuffix(strings.TrimSuffix(block, last+"\n"), "\n")
	status := strings.TrimSpace(last[strings.Index(last, end)+len(end):])
	if status != "0" {
		return output, fmt.Errorf("guest command %q exited %s: %s", command, status, output)
	}
	return output, nil
}

// waitPrompt waits until the boot script has finished and the console shell
// has printed its first prompt.
func (in *Instance) waitPrompt(ctx context.Context) error {
	for {
		in.mu.Lock()
		ready := bytes.Index(in.out, []byte("NODEVIRT-GUEST-READY\n"))
		ok := ready >= 0 && bytes.Contains(in.out[ready:], []byte("nodevirt# "))
		exited, changed := in.exited, in.changed
		in.mu.Unlock()
		switch {
		case ok:
			return nil
		case exited:
			return fmt.Errorf("qemu exited (%v) before the console shell started; console ends with:\n%s", in.exitError(), in.tail(20))
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return fmt.Errorf("waiting for the console shell: %w; console ends with:\n%s", ctx.Err(), in.tail(20))
		}
	}
}

// Output returns everything the console printed so far.
func (in *Instance) Output() string {
	in.mu.Lock()
	defer in.mu.Unlock()
	return string(in.out)
}

func (in *Instance) tail(n int) string {
	lines := strings.Split(strings.TrimRight(in.Output(), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

func (in *Instance) exitError() error {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.waitErr != nil && in.stderr.Len() > 0 {
		return fmt.Errorf("%w: %s", in.waitErr, strings.TrimSpace(in.stderr.String()))
	}
	return in.waitErr
}

// Monitor runs one QEMU human monitor command (e.g. "info status") and
// returns its reply.
func (in *Instance) Monitor(command string) (string, error) {
	var conn net.Conn
	var err error
	for range 50 { // the socket appears shortly after QEMU starts
		if conn, err = net.Dial("unix", in.monitor); err == nil {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err != nil {
		return "", fmt.Errorf("qemu monitor: %w", err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(30 * time.Second))
	r := bufio.NewReader(conn)
	var filter escapeFilter
	readPrompt := func() (string, error) {
		var got []byte
		for !bytes.HasSuffix(got, []byte("(qemu) ")) {
			b, err := r.ReadByte()
			if err != nil {
				return string(got), err
			}
			got = append(got, filter.apply([]byte{b})...)
		}
		return string(got[:len(got)-len("(qemu) ")]), nil
	}
	if _, err := readPrompt(); err != nil {
		return "", fmt.Errorf("qemu monitor: %w", err)
	}
	if _, err := io.WriteString(conn, command+"\n"); err != nil {
		return "", fmt.Errorf("qemu monitor %q: %w", command, err)
	}
	reply, err := readPrompt()
	if err != nil && !(errors.Is(err, io.EOF) && command == "quit") {
		return "", fmt.Errorf("qemu monitor %q: %w", command, err)
	}
	// The monitor echoes the command line first.
	if i := strings.IndexByte(reply, '\n'); i >= 0 {
		reply = reply[i+1:]
	} else {
		reply = ""
	}
	return strings.TrimSpace(reply), nil
}

// Powerdown presses the guest's ACPI power button.
func (in *Instance) Powerdown() error {
	_, err := in.Monitor("system_powerdown")
	return err
}

// Wait waits for QEMU to exit (the guest powered off) and returns its exit
// error, or ctx's error if ctx ends first.
func (in *Instance) Wait(ctx context.Context) error {
	for {
		in.mu.Lock()
		exited, changed := in.exited, in.changed
		in.mu.Unlock()
		if exited {
			return in.exitError()
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return fmt.Errorf("wait for guest: %w", ctx.Err())
		}
	}
}

// Exited reports whether QEMU has exited.
func (in *Instance) Exited() bool {
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.exited
}

// Kill stops QEMU at once (if it still runs) and waits for it. Killing an
// instance that has exited is not an error.
func (in *Instance) Kill() error {
	if !in.Exited() && in.cmd.Process != nil {
		_ = in.cmd.Process.Kill()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := in.Wait(ctx)
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		return nil // killed, as asked
	}
	return err
}
