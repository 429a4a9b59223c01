package importstate

import "testing"

func TestUsableSize(t *testing.T) {
	const gi = 1 << 30
	for _, tc := range []struct {
		name            string
		size            int64
		overhead        float64
		usable, sizeFor int64
	}{
		// The node's former fallback was size*94/100: the same bytes.
		{"default, 10Gi", 10 * gi, DefaultFilesystemOverhead, 10 * gi * 94 / 100, 10894 << 20},
		{"default, 1Gi", gi, DefaultFilesystemOverhead, gi * 94 / 100, 1090 << 20},
		{"default, odd bytes", 123456789, DefaultFilesystemOverhead, 123456789 * 94 / 100, 126 << 20},
		{"no overhead", 5 * gi, 0, 5 * gi, 5 * gi},
		{"half", 4 * gi, 0.5, 2 * gi, 8 * gi},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := UsableOf(tc.size, tc.overhead); got != tc.usable {
				t.Errorf("UsableOf(%d, %v) = %d, want %d", tc.size, tc.overhead, got, tc.usable)
			}
			got := SizeFor(tc.size, tc.overhead)
			if got != tc.sizeFor || got%(1<<20) != 0 || UsableOf(got, tc.overhead) < tc.size {
				t.Errorf("SizeFor(%d, %v) = %d, want %d (whole MiB, leaving at least the usable bytes)", tc.size, tc.overhead, got, tc.sizeFor)
			}
		})
	}
}
