package importstate

import "math"

// DefaultFilesystemOverhead is the fraction of a filesystem volume its
// filesystem takes when the CDI CR sets none (CDI's default).
const DefaultFilesystemOverhead = 0.06

// UsableOf is the number of bytes a disk image may occupy on a filesystem
// volume of size bytes whose filesystem takes the fraction overhead: the
// one rule for the brain's AnnUsableSize and for the node when a claim has
// none (with DefaultFilesystemOverhead).
func UsableOf(size int64, overhead float64) int64 {
	return int64(float64(size) * (1 - overhead))
}

// SizeFor is the filesystem volume size, in whole MiB, that leaves usable
// bytes once the filesystem took the fraction overhead (UsableOf's
// inverse, rounded up).
func SizeFor(usable int64, overhead float64) int64 {
	need := int64(math.Ceil(float64(usable) / (1 - overhead)))
	return (need + 1<<20 - 1) &^ (1<<20 - 1)
}
