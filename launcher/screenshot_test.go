package launcher

import (
	"bytes"
	"image/color"
	"strings"
	"testing"
)

func TestDecodePPM(t *testing.T) {
	// 2x1: a red and a half-grey pixel, maxval 255, with a comment.
	ppm := append([]byte("P6\n# qemu\n2 1\n255\n"), 0xff, 0, 0, 0x80, 0x80, 0x80)
	img, err := DecodePPM(bytes.NewReader(ppm))
	if err != nil {
		t.Fatal(err)
	}
	if b := img.Bounds(); b.Dx() != 2 || b.Dy() != 1 {
		t.Fatalf("bounds %v", b)
	}
	if got := color.RGBAModel.Convert(img.At(0, 0)).(color.RGBA); got != (color.RGBA{0xff, 0, 0, 0xff}) {
		t.Errorf("pixel 0 %v", got)
	}
	if got := color.RGBAModel.Convert(img.At(1, 0)).(color.RGBA); got != (color.RGBA{0x80, 0x80, 0x80, 0xff}) {
		t.Errorf("pixel 1 %v", got)
	}
	for _, bad := range []string{"P5\n1 1\n255\n\x00", "P6\n0 1\n255\n", "P6\n1 1\n65535\n\x00\x00\x00\x00\x00\x00",
		"P6\n99999 1\n255\n", "P6\n16384 16384\n255\n", "P6\n2 2\n255\n\x00\x00\x00", "P6\n" + strings.Repeat("9", 40)} {
		if _, err := DecodePPM(strings.NewReader(bad)); err == nil {
			t.Errorf("decoded %q", bad)
		}
	}
}
