package launcher

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"image"
	"image/png"
	"io"
	"strconv"

	"libvirt.org/go/libvirt"
)

// maxScreenshot bounds what is read of a screenshot stream: a 4096x2160
// true-colour frame with room to spare.
const maxScreenshot = 64 << 20

// Screenshot takes a picture of the domain's first display
// (virDomainScreenshot) and returns it as PNG. QEMU hands libvirt a PPM
// image, converted here.
func (m *Manager) Screenshot(ctx context.Context, name string) ([]byte, error) {
	var mime string
	st, err := m.openStream(name, "screenshot", func(d *libvirt.Domain, st *libvirt.Stream) error {
		var err error
		mime, err = d.Screenshot(st, 0, 0)
		return err
	})
	if err != nil {
		return nil, err
	}
	defer st.Free()
	var raw bytes.Buffer
	buf := make([]byte, 256<<10)
	for {
		n, err := st.Recv(buf)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			_ = st.Abort()
			return nil, fmt.Errorf("screenshot %s: %w", name, err)
		}
		if n == 0 {
			break
		}
		if raw.Len()+n > maxScreenshot {
			_ = st.Abort()
			return nil, fmt.Errorf("screenshot %s: larger than %d bytes", name, maxScreenshot)
		}
		raw.Write(buf[:n])
	}
	if err := st.Finish(); err != nil {
		return nil, fmt.Errorf("screenshot %s: %w", name, err)
	}
	switch mime {
	case "image/png":
		return raw.Bytes(), nil
	case "image/x-portable-pixmap":
		img, err := DecodePPM(&raw)
		if err != nil {
			return nil, fmt.Errorf("screenshot %s: %w", name, err)
		}
		var out bytes.Buffer
		if err := png.Encode(&out, img); err != nil {
			return nil, fmt.Errorf("screenshot %s: %w", name, err)
		}
		return out.Bytes(), nil
	}
	return nil, fmt.Errorf("screenshot %s: unexpected image type %q", name, mime)
}

// DecodePPM decodes a binary PPM (P6) image with 8-bit samples, the format
// QEMU's screendump writes. A header claiming more pixels than a screenshot
// may hold is refused before anything is allocated for them.
func DecodePPM(r io.Reader) (image.Image, error) {
	br := bufio.NewReader(r)
	var fields [4]string
	for i := range fields {
		f, err := ppmToken(br)
		if err != nil {
			return nil, fmt.Errorf("ppm header: %w", err)
		}
		fields[i] = f
	}
	if fields[0] != "P6" {
		return nil, fmt.Errorf("ppm: magic %q, want P6", fields[0])
	}
	w, errW := strconv.Atoi(fields[1])
	h, errH := strconv.Atoi(fields[2])
	maxval, errM := strconv.Atoi(fields[3])
	if errW != nil || errH != nil || errM != nil || w <= 0 || h <= 0 || w > 16384 || h > 16384 || 3*w*h > maxScreenshot || maxval <= 0 || maxval > 255 {
		return nil, fmt.Errorf("ppm: bad header %q", fields)
	}
	img := image.NewRGBA(image.Rect(0, 0, w, h))
	row := make([]byte, 3*w)
	for y := range h {
		if _, err := io.ReadFull(br, row); err != nil {
			return nil, fmt.Errorf("ppm: row %d: %w", y, err)
		}
		for x := range w {
			o := img.PixOffset(x, y)
			for c := range 3 {
				img.Pix[o+c] = uint8(int(row[3*x+c]) * 255 / maxval)
			}
			img.Pix[o+3] = 0xff
		}
	}
	return img, nil
}

// ppmToken reads one header token, skipping whitespace and comments; the
// single whitespace after the last token is consumed with it.
func ppmToken(br *bufio.Reader) (string, error) {
	var tok []byte
	for {
		b, err := br.ReadByte()
		if err != nil {
			if errors.Is(err, io.EOF) && len(tok) > 0 {
				return string(tok), nil
			}
			return "", err
		}
		switch {
		case b == '#' && len(tok) == 0:
			if _, err := br.ReadString('\n'); err != nil {
				return "", err
			}
		case b == ' ' || b == '\t' || b == '\n' || b == '\r':
			if len(tok) > 0 {
				return string(tok), nil
			}
		default:
			if len(tok) > 16 {
				return "", errors.New("token too long")
			}
			tok = append(tok, b)
		}
	}
}
