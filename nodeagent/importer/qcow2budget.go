package importer

import "sort"

// Memory budget of the streaming qcow2 converter. What it remembers while
// it reads is bounded whatever the image says:
//
//   - the L1 table, at most qcow2MaxL1Bytes;
//   - the refcount table, at most qcow2MaxRefcountTableBytes (beyond, its
//     blocks are parked like unknown clusters), and the sorted offsets of
//     its blocks (a fraction of it);
//   - the clusters announced ahead of the read position (L2 tables, data
//     clusters) and the clusters parked in the spill file: 8 bytes each,
//     at most qcow2MaxTracked of them together;
//   - the compressed clusters announced ahead, at most
//     qcow2MaxCompressedRuns.
//
// An image that needs more (a small file whose dense L2 tables point far
// ahead at a huge virtual disk) fails with ReasonUnsupportedImage instead
// of growing the node agent. Images written by qemu-img place each L2
// table just before its data and never come near these limits; a fully
// preallocated (preallocation=metadata) image may, beyond 64 GiB at 64 KiB
// clusters.
const (
	qcow2MaxL1Bytes            = 4 << 20
	qcow2MaxRefcountTableBytes = 1 << 20
	qcow2MaxTracked            = 1 << 20
	qcow2MaxCompressedRuns     = 1 << 16
)

// clusterQueue is a min-heap of (host cluster index, value) pairs packed
// in a uint64, the host index in the high half: the stream pops the
// entries of each host cluster as it reaches it. 8 bytes per entry.
type clusterQueue []uint64

func (q *clusterQueue) push(host, value uint32) {
	*q = append(*q, uint64(host)<<32|uint64(value))
	h := *q
	for i := len(h) - 1; i > 0; {
		p := (i - 1) / 2
		if h[p] <= h[i] {
			break
		}
		h[p], h[i] = h[i], h[p]
		i = p
	}
}

// popAt removes and returns the values queued for host cluster host (the
// queue holds no smaller host index).
func (q *clusterQueue) popAt(host uint32, out []uint32) []uint32 {
	for len(*q) > 0 && uint32((*q)[0]>>32) == host {
		out = append(out, uint32((*q)[0]))
		q.popMin()
	}
	return out
}

func (q *clusterQueue) popMin() {
	h := *q
	n := len(h) - 1
	h[0] = h[n]
	h = h[:n]
	for i := 0; ; {
		l, r, m := 2*i+1, 2*i+2, i
		if l < n && h[l] < h[m] {
			m = l
		}
		if r < n && h[r] < h[m] {
			m = r
		}
		if m == i {
			break
		}
		h[i], h[m] = h[m], h[i]
		i = m
	}
	*q = h
}

// clusterSet is a set of cluster indexes: one 64-bit word per 64
// clusters that hold a member.
type clusterSet struct {
	words map[uint32]uint64
	n     int
}

func (s *clusterSet) add(i uint32) {
	if s.words == nil {
		s.words = map[uint32]uint64{}
	}
	w := s.words[i>>6]
	if w&(1<<(i&63)) == 0 {
		s.n++
	}
	s.words[i>>6] = w | 1<<(i&63)
}

func (s *clusterSet) has(i uint32) bool { return s.words[i>>6]&(1<<(i&63)) != 0 }

// offsetSet is a sorted set of offsets, built once.
type offsetSet []int64

func (o offsetSet) has(off int64) bool {
	i := sort.Search(len(o), func(i int) bool { return o[i] >= off })
	return i < len(o) && o[i] == off
}
