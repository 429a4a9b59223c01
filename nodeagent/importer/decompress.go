package importer

import (
	"bytes"
	"compress/bzip2"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"os/exec"
	"sync"

	"github.com/klauspost/compress/zstd"

	"github.com/nodevirt/nodevirt/nodeagent/importer/confine"
)

// decompress wraps r in a streaming decompressor. xz goes through the xz
// binary (faster than any Go decoder, and one dependency less). close
// releases the decoder and must be called.
func decompress(ctx context.Context, c Compression, r io.Reader) (io.Reader, func(), error) {
	switch c {
	case CompressionGzip:
		zr, err := gzip.NewReader(r)
		if err != nil {
			return nil, nil, corruptCompression(c, err)
		}
		return &decodeErrors{c: c, r: zr}, func() { zr.Close() }, nil
	case CompressionZstd:
		zr, err := zstd.NewReader(r, zstd.WithDecoderConcurrency(1), zstd.WithDecoderMaxWindow(ZstdMaxWindow), zstd.WithDecoderLowmem(true))
		if err != nil {
			return nil, nil, corruptCompression(c, err)
		}
		return &decodeErrors{c: c, r: zr}, zr.Close, nil
	case CompressionBzip2:
		return &decodeErrors{c: c, r: bzip2.NewReader(r)}, func() {}, nil
	case CompressionXz:
		return xzReader(ctx, r)
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

// ZstdMaxWindow is the largest zstd window a compressed image may use:
// the decoder's history, held in the node agent, grows to it. zstd's
// levels up to 19 use at most 8 MiB; --ultra and --long streams with
// larger windows are refused (InvalidImage).
const ZstdMaxWindow = 32 << 20

// XzAddressSpace bounds the confined xz decoder's address space; xz
// streams made with the largest presets need about 65 MiB to decode.
const XzAddressSpace = 512 << 20

// xzProc is a running, confined `xz -dc` fed from the source.
type xzProc struct {
	out      io.ReadCloser
	stderr   bytes.Buffer
	mu       sync.Mutex
	srcErr   error
	fed      chan struct{}
	waitOnce sync.Once
	wait     func() error
	waitErr  error
}

func xzReader(ctx context.Context, r io.Reader) (io.Reader, func(), error) {
	x := &xzProc{fed: make(chan struct{})}
	ctx, cancel := context.WithCancel(ctx)
	var in io.WriteCloser
	spec := confine.Spec{Limits: confine.Limits{AddressSpace: XzAddressSpace}}
	wait, err := confine.Start(ctx, spec, func(cmd *exec.Cmd) error {
		cmd.Stderr = &x.stderr
		var err error
		if in, err = cmd.StdinPipe(); err != nil {
			return err
		}
		x.out, err = cmd.StdoutPipe()
		return err
	}, "xz", "-dc", "-T1", "--memlimit-decompress=256MiB")
	if err != nil {
		cancel()
		return nil, nil, failf(ReasonFailed, "start xz: %w", err)
	}
	x.wait = wait
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
		cancel()
		_ = x.waitDone()
	}
	return x, stop, nil
}

// waitDone waits for xz once and returns how it ended.
func (x *xzProc) waitDone() error {
	x.waitOnce.Do(func() { x.waitErr = x.wait() })
	return x.waitErr
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
	if werr := x.waitDone(); werr != nil {
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
