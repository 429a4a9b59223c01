package virtctl

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"time"

	"golang.org/x/term"
)

// escapeByte (Ctrl+]) ends a console session, as in virtctl.
const escapeByte = 29

// Console attaches o to the VMI's serial console until the user types
// Ctrl+], input ends or the stream closes. While the VMI is not running yet
// (400 answers) it retries for up to timeout.
func Console(ctx context.Context, c *Client, name string, timeout time.Duration, o IO) error {
	deadline := time.Now().Add(timeout)
	var s io.ReadWriteCloser
	for {
		st, err := c.Stream(ctx, name, "console", nil)
		if err == nil {
			s = st
			break
		}
		var se *StreamError
		if !errors.As(err, &se) || se.Code != http.StatusBadRequest || time.Now().After(deadline) {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Second):
		}
	}
	defer s.Close()
	if f, ok := o.In.(*os.File); ok && term.IsTerminal(int(f.Fd())) {
		state, err := term.MakeRaw(int(f.Fd()))
		if err != nil {
			return fmt.Errorf("make raw terminal: %w", err)
		}
		defer term.Restore(int(f.Fd()), state)
	}
	fmt.Fprintf(o.Err, "Successfully connected to %s console. Press Ctrl+] or Ctrl+5 to exit console.\n", name)
	errc := make(chan error, 2)
	go func() {
		_, err := io.Copy(o.Out, s)
		if err == nil {
			err = io.EOF
		}
		errc <- err
	}()
	go func() {
		buf := make([]byte, 1024)
		for {
			n, err := o.In.Read(buf)
			for i := 0; i < n; i++ {
				if buf[i] == escapeByte {
					if i > 0 {
						_, _ = s.Write(buf[:i])
					}
					errc <- nil
					return
				}
			}
			if n > 0 {
				if _, werr := s.Write(buf[:n]); werr != nil {
					errc <- werr
					return
				}
			}
			if err != nil {
				errc <- nil // end of input: leave the console
				return
			}
		}
	}()
	var err error
	select {
	case err = <-errc:
	case <-ctx.Done():
	}
	if errors.Is(err, io.EOF) {
		fmt.Fprint(o.Err, "\nYou were disconnected from the console. This could be caused by one of the following:"+
			"\n - the target VM was powered off"+
			"\n - another user connected to the console of the target VM"+
			"\n - network issues\n")
		return nil
	}
	return err
}

// VNCProxy serves ln until ctx ends: each local connection gets its own
// VNC stream to the VMI. It prints {"port": N} first, as --proxy-only does.
func VNCProxy(ctx context.Context, c *Client, name string, ln net.Listener, o IO) error {
	defer ln.Close()
	data, _ := json.Marshal(struct {
		Port int `json:"port"`
	}{ln.Addr().(*net.TCPAddr).Port})
	fmt.Fprintln(o.Out, string(data))
	go func() { <-ctx.Done(); ln.Close() }()
	for {
		conn, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		go func() {
			defer conn.Close()
			s, err := c.Stream(ctx, name, "vnc", nil)
			if err != nil {
				fmt.Fprintln(o.Err, "vnc:", err)
				return
			}
			defer s.Close()
			done := make(chan struct{}, 2)
			go func() { _, _ = io.Copy(s, conn); done <- struct{}{} }()
			go func() { _, _ = io.Copy(conn, s); done <- struct{}{} }()
			<-done
		}()
	}
}
