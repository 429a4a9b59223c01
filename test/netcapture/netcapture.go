// Package netcapture records what crosses a network interface of a network
// namespace as a host on that network would see it (an AF_PACKET socket
// opened inside the namespace), keeping no packets: per TCP connection
// direction, the payload bytes, whether a marker appeared in clear, and how
// much of the payload is framed as TLS records. Tests use it to show that a
// stream between nodes (a live migration) is encrypted.
package netcapture

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net"
	"os"
	"runtime"
	"sort"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sys/unix"
)

// Capture is a capture of the TCP traffic between nodes on a node's underlay
// interface (an AF_PACKET socket opened inside the node's network
// namespace): what a host on the "physical" network sees of a live
// migration. It keeps no packets, only per connection the payload bytes,
// whether a marker appeared in clear, and how much of the payload is framed
// as TLS records.
type Capture struct {
	fd     int
	marker []byte
	stop   chan struct{}
	done   chan struct{}

	mu    sync.Mutex
	flows map[string]*capturedFlow
	err   error
}

// capturedFlow is one direction of one TCP connection.
type capturedFlow struct {
	payload uint64
	nextSeq uint32
	started bool
	gap     bool
	// tail is the end of the payload so far (a marker split across
	// segments is still found).
	tail   []byte
	marker bool
	// TLS record framing from the first handshake record on: start is
	// the payload offset of that record, framed the bytes inside
	// well-formed records, need the bytes of the current record still to
	// come, hdr a record header being read, broken the offset where
	// framing failed (0: never).
	start, framed uint64
	need          int
	hdr           []byte
	broken        uint64
	found         bool
}

// Start captures on interface ifname of the network namespace at
// nsPath the TCP payloads between the addresses among, looking for marker.
func Start(nsPath, ifname string, marker []byte) (*Capture, error) {
	type opened struct {
		fd  int
		err error
	}
	ch := make(chan opened, 1)
	go func() {
		// This thread enters the namespace and comes back before it is
		// unlocked. It must never die in there: a thread's exit fires the
		// parent-death signal of the processes it started (the suite's
		// control plane), so it is not left locked to end either.
		runtime.LockOSThread()
		back, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			runtime.UnlockOSThread()
			ch <- opened{-1, err}
			return
		}
		defer back.Close()
		fd, err := openPacketSocket(nsPath, ifname)
		if rerr := unix.Setns(int(back.Fd()), unix.CLONE_NEWNET); rerr != nil {
			// Stuck in the node's namespace: park the thread forever
			// rather than let it exit.
			ch <- opened{-1, fmt.Errorf("back to the test's network namespace: %w", rerr)}
			select {}
		}
		runtime.UnlockOSThread()
		ch <- opened{fd, err}
	}()
	o := <-ch
	if o.err != nil {
		return nil, o.err
	}
	c := &Capture{fd: o.fd, marker: marker, stop: make(chan struct{}), done: make(chan struct{}), flows: map[string]*capturedFlow{}}
	go c.loop()
	return c, nil
}

func openPacketSocket(nsPath, ifname string) (int, error) {
	ns, err := os.Open(nsPath)
	if err != nil {
		return -1, err
	}
	defer ns.Close()
	if err := unix.Setns(int(ns.Fd()), unix.CLONE_NEWNET); err != nil {
		return -1, fmt.Errorf("setns %s: %w", nsPath, err)
	}
	ifi, err := net.InterfaceByName(ifname)
	if err != nil {
		return -1, err
	}
	proto := int(htons(unix.ETH_P_ALL))
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, proto)
	if err != nil {
		return -1, err
	}
	// A large buffer: the migration streams at hundreds of MiB/s.
	_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, 256<<20)
	_ = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Usec: 200000})
	if err := unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: ifi.Index}); err != nil {
		unix.Close(fd)
		return -1, err
	}
	return fd, nil
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

func (c *Capture) loop() {
	defer close(c.done)
	buf := make([]byte, 256<<10)
	for {
		select {
		case <-c.stop:
			return
		default:
		}
		n, _, err := unix.Recvfrom(c.fd, buf, 0)
		if err == unix.EAGAIN || err == unix.EINTR {
			continue
		}
		if err != nil {
			c.mu.Lock()
			c.err = err
			c.mu.Unlock()
			return
		}
		c.packet(buf[:n])
	}
}

// packet takes one Ethernet frame (IPv4/TCP only).
func (c *Capture) packet(f []byte) {
	if len(f) < 14+20 || binary.BigEndian.Uint16(f[12:14]) != 0x0800 {
		return
	}
	ip := f[14:]
	ihl := int(ip[0]&0x0f) * 4
	if ip[9] != 6 || ihl < 20 || len(ip) < ihl+20 {
		return
	}
	total := int(binary.BigEndian.Uint16(ip[2:4]))
	if total > len(ip) || total == 0 {
		// A GSO frame may carry 0 as its length: take what is there.
		total = len(ip)
	}
	tcp := ip[ihl:total]
	off := int(tcp[12]>>4) * 4
	if off < 20 || len(tcp) < off {
		return
	}
	key := fmt.Sprintf("%s:%d>%s:%d", net.IP(ip[12:16]), binary.BigEndian.Uint16(tcp[0:2]), net.IP(ip[16:20]), binary.BigEndian.Uint16(tcp[2:4]))
	seq := binary.BigEndian.Uint32(tcp[4:8])
	payload := tcp[off:]
	if len(payload) == 0 {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	fl := c.flows[key]
	if fl == nil {
		fl = &capturedFlow{}
		c.flows[key] = fl
	}
	if fl.started {
		d := int32(seq - fl.nextSeq)
		if d < 0 {
			// Retransmitted (in part): keep only what is new.
			if int(-d) >= len(payload) {
				return
			}
			payload = payload[-d:]
		} else if d > 0 {
			fl.gap = true // a segment the capture missed
		}
	}
	fl.started = true
	fl.nextSeq = seq + uint32(len(payload))
	hay := append(fl.tail, payload...)
	if bytes.Contains(hay, c.marker) {
		fl.marker = true
	}
	if k := len(c.marker) - 1; len(hay) > k {
		fl.tail = append(fl.tail[:0], hay[len(hay)-k:]...)
	} else {
		fl.tail = hay
	}
	fl.frame(payload)
	fl.payload += uint64(len(payload))
}

// frame follows TLS record framing over payload, which starts at offset
// fl.payload of the flow.
func (fl *capturedFlow) frame(p []byte) {
	if fl.broken != 0 || fl.gap {
		return
	}
	at := fl.payload
	if !fl.found {
		// Before TLS: a protocol's clear negotiation (NBD's STARTTLS) is
		// allowed in the first 4 KiB; TLS begins with a handshake record.
		for i := 0; i+3 <= len(p); i++ {
			if p[i] == 0x16 && p[i+1] == 0x03 && p[i+2] <= 0x04 {
				fl.found, fl.start = true, at+uint64(i)
				at += uint64(i)
				p = p[i:]
				break
			}
		}
		if !fl.found {
			if at+uint64(len(p)) > 4096 {
				fl.broken = at + uint64(len(p))
			}
			return
		}
	}
	for len(p) > 0 {
		if fl.need > 0 {
			k := min(fl.need, len(p))
			fl.need -= k
			fl.framed += uint64(k)
			p, at = p[k:], at+uint64(k)
			continue
		}
		k := min(5-len(fl.hdr), len(p))
		fl.hdr = append(fl.hdr, p[:k]...)
		p, at = p[k:], at+uint64(k)
		if len(fl.hdr) < 5 {
			return
		}
		typ, major, n := fl.hdr[0], fl.hdr[1], int(binary.BigEndian.Uint16(fl.hdr[3:5]))
		if typ < 20 || typ > 24 || major != 3 || n > 1<<14+2048 {
			fl.broken = at
			return
		}
		fl.framed += 5
		fl.need, fl.hdr = n, fl.hdr[:0]
	}
}

// Report is what a capture saw, per connection direction.
type Report struct {
	Flows []Flow
	Err   error
}

type Flow struct {
	Key       string
	Payload   uint64
	Marker    bool
	TLSStart  uint64
	TLSFramed uint64
	Found     bool
	Broken    uint64
	Gap       bool
}

// Stop ends the capture and reports, largest flow first.
func (c *Capture) Stop() Report {
	close(c.stop)
	<-c.done
	unix.Close(c.fd)
	return c.report()
}

func (c *Capture) report() Report {
	c.mu.Lock()
	defer c.mu.Unlock()
	r := Report{Err: c.err}
	for k, f := range c.flows {
		r.Flows = append(r.Flows, Flow{Key: k, Payload: f.payload, Marker: f.marker, TLSStart: f.start,
			TLSFramed: f.framed, Found: f.found, Broken: f.broken, Gap: f.gap})
	}
	sort.Slice(r.Flows, func(i, j int) bool { return r.Flows[i].Payload > r.Flows[j].Payload })
	return r
}

func (r Report) String() string {
	var b strings.Builder
	for _, f := range r.Flows {
		fmt.Fprintf(&b, "%s: %d bytes, marker in clear %t, tls from %d (%t) framed %d, broken at %d, gap %t\n",
			f.Key, f.Payload, f.Marker, f.TLSStart, f.Found, f.TLSFramed, f.Broken, f.Gap)
	}
	return b.String()
}

// CheckEncrypted fails t unless the capture saw the migration between the
// nodes at addresses a and b as TLS: at least minBytes between them, the
// marker nowhere in clear, and the largest connection framed as TLS
// records to its end.
func (r Report) CheckEncrypted(t testing.TB, a, b string, minBytes uint64) {
	t.Helper()
	if r.Err != nil {
		t.Errorf("capture: %v", r.Err)
	}
	var total uint64
	var largest *Flow
	for i, f := range r.Flows {
		if !strings.Contains(f.Key, a+":") || !strings.Contains(f.Key, b+":") {
			continue
		}
		total += f.Payload
		if f.Marker {
			t.Errorf("the guest's marker crossed the underlay in clear: %s", f.Key)
		}
		if largest == nil {
			largest = &r.Flows[i]
		}
	}
	t.Logf("underlay capture between %s and %s: %d bytes\n%s", a, b, total, r)
	if total < minBytes || largest == nil {
		t.Fatalf("the capture saw %d bytes between the nodes, want at least %d", total, minBytes)
	}
	f := largest
	switch {
	case !f.Found || f.Broken != 0:
		t.Errorf("the migration stream %s is not TLS: framing found %t, broken at byte %d", f.Key, f.Found, f.Broken)
	case f.Gap:
		// Frames the socket missed end the framing check there.
		if f.TLSFramed < 1<<20 {
			t.Errorf("the migration stream %s: only %d bytes framed as TLS before a capture gap", f.Key, f.TLSFramed)
		}
	case f.TLSFramed+f.TLSStart < f.Payload-f.Payload/100:
		t.Errorf("the migration stream %s: %d of %d bytes framed as TLS", f.Key, f.TLSFramed, f.Payload)
	}
}
