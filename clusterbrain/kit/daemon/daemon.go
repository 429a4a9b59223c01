// Package daemon holds what every nodevirt daemon does the same way: a
// signal-derived context, /healthz and /readyz, and systemd's readiness and
// watchdog notifications.
package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/nodevirt/nodevirt/clusterbrain/kit/httperr"
)

// SignalContext is cancelled on SIGTERM or SIGINT.
func SignalContext() (context.Context, context.CancelFunc) {
	return signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
}

// Health tracks named readiness checks and serves them.
type Health struct {
	mu     sync.Mutex
	checks map[string]error
}

// NewHealth returns a Health whose named checks start not ready.
func NewHealth(names ...string) *Health {
	h := &Health{checks: map[string]error{}}
	for _, n := range names {
		h.checks[n] = errors.New("starting")
	}
	return h
}

// Set records the state of one check; nil is ready.
func (h *Health) Set(name string, err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.checks[name] = err
}

// Check reports the state of one check: nil when it is ready or was never
// set (a role that has not stopped).
func (h *Health) Check(name string) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.checks[name]
}

// Ready reports nil when every check is ready, else what is not.
func (h *Health) Ready() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	var errs []string
	for n, err := range h.checks {
		if err != nil {
			errs = append(errs, fmt.Sprintf("%s: %v", n, err))
		}
	}
	if len(errs) > 0 {
		return errors.New(strings.Join(errs, "; "))
	}
	return nil
}

// Handler serves /healthz (the process answers) and /readyz (every check
// ready).
func (h *Health) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
	mux.Handle("/readyz", httperr.TextHandler(func(w http.ResponseWriter, _ *http.Request) error {
		if err := h.Ready(); err != nil {
			return httperr.With(http.StatusServiceUnavailable, err)
		}
		fmt.Fprintln(w, "ok")
		return nil
	}))
	return mux
}

// Serve runs an HTTP server on addr until ctx ends.
func Serve(ctx context.Context, addr string, handler http.Handler, log *slog.Logger) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("listen %s: %w", addr, err)
	}
	srv := &http.Server{Handler: handler, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 2 * time.Minute}
	go func() {
		<-ctx.Done()
		shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(shutdown)
	}()
	log.Info("serving", "addr", ln.Addr().String())
	if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// Notify sends a state line to systemd when NOTIFY_SOCKET is set (Type=notify
// units); otherwise it does nothing.
func Notify(state string) error {
	sock := os.Getenv("NOTIFY_SOCKET")
	if sock == "" {
		return nil
	}
	if strings.HasPrefix(sock, "@") {
		sock = "\x00" + sock[1:]
	}
	conn, err := net.DialUnix("unixgram", nil, &net.UnixAddr{Name: sock, Net: "unixgram"})
	if err != nil {
		return fmt.Errorf("notify systemd: %w", err)
	}
	defer conn.Close()
	_, err = conn.Write([]byte(state))
	return err
}

// Watchdog pings systemd's watchdog at half its interval while healthy()
// returns nil, until ctx ends. Without WATCHDOG_USEC it returns at once.
func Watchdog(ctx context.Context, healthy func() error) {
	usec, err := strconv.ParseInt(os.Getenv("WATCHDOG_USEC"), 10, 64)
	if err != nil || usec <= 0 {
		return
	}
	tick := time.NewTicker(time.Duration(usec) * time.Microsecond / 2)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			if healthy() == nil {
				_ = Notify("WATCHDOG=1")
			}
		}
	}
}
