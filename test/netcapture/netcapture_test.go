package netcapture

import (
	"bytes"
	"encoding/binary"
	"math/rand/v2"
	"net"
	"testing"
)

// frame is an Ethernet/IPv4/TCP frame from src to dst with seq and payload.
func frame(src, dst string, sport, dport uint16, seq uint32, payload []byte) []byte {
	f := make([]byte, 14+20+20, 14+20+20+len(payload))
	binary.BigEndian.PutUint16(f[12:14], 0x0800)
	ip := f[14:34]
	ip[0] = 0x45
	binary.BigEndian.PutUint16(ip[2:4], uint16(20+20+len(payload)))
	ip[9] = 6
	copy(ip[12:16], net.ParseIP(src).To4())
	copy(ip[16:20], net.ParseIP(dst).To4())
	tcp := f[34:54]
	binary.BigEndian.PutUint16(tcp[0:2], sport)
	binary.BigEndian.PutUint16(tcp[2:4], dport)
	binary.BigEndian.PutUint32(tcp[4:8], seq)
	tcp[12] = 5 << 4
	return append(f, payload...)
}

// tlsRecords is a clear prefix followed by a TLS handshake record and
// application data records of random content.
func tlsRecords(prefix []byte, n int, rng *rand.Rand) []byte {
	out := append([]byte{}, prefix...)
	rec := func(typ byte, size int) {
		out = append(out, typ, 3, 3, byte(size>>8), byte(size))
		for i := 0; i < size; i++ {
			out = append(out, byte(rng.UintN(256)))
		}
	}
	rec(22, 300)
	for i := 0; i < n; i++ {
		rec(23, 1+rng.IntN(16384))
	}
	return out
}

// feed sends stream from src to dst as segments of random sizes, one
// retransmitted.
func feed(c *Capture, src, dst string, stream []byte, rng *rand.Rand) {
	seq := uint32(1000)
	for off := 0; off < len(stream); {
		n := min(1+rng.IntN(9000), len(stream)-off)
		c.packet(frame(src, dst, 49152, 40000, seq+uint32(off), stream[off:off+n]))
		if off == 0 {
			c.packet(frame(src, dst, 49152, 40000, seq, stream[:n])) // a retransmission
		}
		off += n
	}
}

func TestTLSStreamIsFramedAndHidesNothing(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	marker := []byte("NVMARK-secret")
	c := &Capture{marker: marker, flows: map[string]*capturedFlow{}}
	// NBD's clear negotiation, then TLS.
	stream := tlsRecords([]byte("NBDMAGIC\x00\x00\x42\x02\x81\x86\x12\x53IHAVEOPT"), 200, rng)
	feed(c, "10.0.0.1", "10.0.0.2", stream, rng)
	r := c.report()
	if len(r.Flows) != 1 {
		t.Fatalf("flows %v", r)
	}
	f := r.Flows[0]
	if f.Payload != uint64(len(stream)) || f.Marker || !f.Found || f.Broken != 0 || f.Gap || f.TLSStart != 24 ||
		f.TLSFramed != uint64(len(stream))-24 {
		t.Errorf("tls stream of %d bytes: %+v", len(stream), f)
	}
	r.CheckEncrypted(t, "10.0.0.1", "10.0.0.2", 1<<20)
}

func TestClearStreamIsCaught(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	marker := []byte("NVMARK-secret")
	c := &Capture{marker: marker, flows: map[string]*capturedFlow{}}
	// Guest memory in clear: random pages, the marker in one of them.
	var stream []byte
	for i := 0; i < 512; i++ {
		page := make([]byte, 4096)
		for j := range page {
			page[j] = byte(rng.UintN(256))
		}
		if i == 300 {
			copy(page[2000:], marker)
		}
		stream = append(stream, page...)
	}
	if !bytes.Contains(stream, marker) {
		t.Fatal("marker not in the stream")
	}
	feed(c, "10.0.0.1", "10.0.0.2", stream, rng)
	f := c.report().Flows[0]
	if !f.Marker {
		t.Errorf("the marker in clear was not seen: %+v", f)
	}
	if f.Found && f.Broken == 0 {
		t.Errorf("a clear stream passed for TLS: %+v", f)
	}
}
