package importer

import (
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"os/exec"
	"sync"

	"github.com/klauspost/compress/zstd"
)

// decompress wraps r in a streaming decompressor. xz goes through the xz
// binary (faster than any Go decoder, and one dependency less). close
// releases the decoder and must be called.
func decompress(c Compression, r io.Reader) (io.Reader, func(), error) {
	switch c {
	case CompressionGzip:
		zr, err := gzip.NewReader(r)
		if err != nil {
			return nil, nil, corruptCompression(c, err)
		}
		return &decodeErrors{c: c, r: zr}, func() { zr.Close() }, nil
	case CompressionZstd:
		zr, err := zstd.NewReader(r, zstd.WithDecoderConcurrency(1), zstd.WithDecoderMaxWindow(1<<27), zstd.WithDecoderLowmem(true))
		if err != nil {
			return nil, nil, corruptCompression(c, err)
		}
		return &decodeErrors{c: c, r: zr}, zr.Close, nil
	case CompressionXz:
		return xzReader(r)
	}
	return nil, nil, fmt.Errorf("unknown compression %q", c)
}

func corruptCompression(c Compression, err error) error {
	var ie *Error
	if errors.As(err, &ie) || errors.Is(err, context.Canceled) {
		return err
	}
	if errors.Is(err, io.ErrUnexpectedEOF) {
		return &Error{Reason: ReasonTruncated, Err: fmt.Errorf("%s stream ended early: %w", c, err)}
	}
	return &Error{Reason: ReasonInvalidImage, Err: fmt.Errorf("decompress %s: %w", c, err)}
}

// decodeErrors gives decoder errors a Reason, leaving source errors (which
// already have one) alone.
type decodeErrors struct {
	c Compression
	r io.Reader
}

func (d *decodeErrors) Read(p []byte) (int, error) {
	n, err := d.r.Read(p)
	if err != nil && err != io.EOF {
		err = corruptCompression(d.c, err)
	}
	return n, err
}

// xzProc is a running `xz -dc` fed from the source.
type xzProc struct {
	cmd    *exec.Cmd
	out    io.ReadCloser
	stderr bytes.Buffer
	mu     sync.Mutex
	srcErr error
	fed    chan struct{}
}

func xzReader(r io.Reader) (io.Reader, func(), error) {
	x := &xzProc{fed: make(chan struct{})}
	x.cmd = exec.Command("xz", "-dc", "-T1")
	x.cmd.Stderr = &x.stderr
	in, err := x.cmd.StdinPipe()
	if err != nil {
		return nil, nil, err
	}
	if x.out, err = x.cmd.StdoutPipe(); err != nil {
		return nil, nil, err
	}
	if err := x.cmd.Start(); err != nil {
		return nil, nil, fmt.Errorf("start xz: %w", err)
	}
	go func() {
		defer close(x.fed)
		_, err := io.Copy(in, r)
		in.Close()
		if err != nil && !errors.Is(err, exec.ErrWaitDelay) {
			x.mu.Lock()
			x.srcErr = err
			x.mu.Unlock()
		}
	}()
	stop := func() {
		_ = x.cmd.Process.Kill()
		_ = x.cmd.Wait()
	}
	return x, stop, nil
}

func (x *xzProc) Read(p []byte) (int, error) {
	n, err := x.out.Read(p)
	if err == nil {
		return n, nil
	}
	// Output ended: the source error, if any, explains it best.
	<-x.fed
	x.mu.Lock()
	srcErr := x.srcErr
	x.mu.Unlock()
	if srcErr != nil {
		var ie *Error
		if errors.As(srcErr, &ie) || errors.Is(srcErr, context.Canceled) {
			return n, srcErr
		}
	}
	if werr := x.cmd.Wait(); werr != nil {
		msg := bytes.TrimSpace(x.stderr.Bytes())
		if bytes.Contains(msg, []byte("Unexpected end of input")) {
			return n, failf(ReasonTruncated, "xz stream ended early: %s", msg)
		}
		return n, failf(ReasonInvalidImage, "decompress xz: %s: %w", msg, werr)
	}
	if srcErr != nil {
		return n, srcErr
	}
	return n, io.EOF
}
