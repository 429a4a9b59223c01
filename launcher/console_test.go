package launcher

import (
	"errors"
	"io"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// blockingStream is a stream whose Recv blocks until Abort, and which
// records a Free that comes while a Recv or Send is still running (the use
// after free libvirt would suffer).
type blockingStream struct {
	inRecv    atomic.Int32
	aborted   chan struct{}
	abortOnce sync.Once
	freed     atomic.Int32
	freedLive atomic.Bool
}

func (s *blockingStream) Recv(p []byte) (int, error) {
	s.inRecv.Add(1)
	defer s.inRecv.Add(-1)
	<-s.aborted
	// libvirt still touches the stream while it unwinds the call.
	time.Sleep(20 * time.Millisecond)
	if s.freed.Load() > 0 {
		s.freedLive.Store(true)
	}
	return 0, errors.New("stream aborted")
}

func (s *blockingStream) Send(p []byte) (int, error) { return len(p), nil }

func (s *blockingStream) Abort() error {
	s.abortOnce.Do(func() { close(s.aborted) })
	return nil
}

func (s *blockingStream) Free() error {
	if s.inRecv.Load() > 0 {
		s.freedLive.Store(true)
	}
	s.freed.Add(1)
	return nil
}

// TestConsoleCloseDuringRecvFreesAfterTheReader: the console server closes
// the stream while its reader is blocked in Recv; the stream must be freed
// once, after that Recv has returned. Run with -race.
func TestConsoleCloseDuringRecvFreesAfterTheReader(t *testing.T) {
	for range 50 {
		st := &blockingStream{aborted: make(chan struct{})}
		c := &console{st: st}
		readDone := make(chan error, 1)
		go func() {
			_, err := io.ReadAll(c)
			readDone <- err
		}()
		for st.inRecv.Load() == 0 {
			time.Sleep(time.Millisecond)
		}
		writeDone := make(chan struct{})
		go func() { _, _ = c.Write([]byte("x")); close(writeDone) }()
		if err := c.Close(); err != nil {
			t.Fatal(err)
		}
		_ = c.Close()
		if err := <-readDone; err == nil {
			t.Fatal("read of a closed console ended without an error")
		}
		<-writeDone
		if st.freedLive.Load() {
			t.Fatal("the stream was freed while a Recv was still running")
		}
		if n := st.freed.Load(); n != 1 {
			t.Fatalf("stream freed %d times, want once", n)
		}
		if _, err := c.Read(make([]byte, 1)); !errors.Is(err, errConsoleClosed) {
			t.Fatalf("read after close: %v", err)
		}
	}
}
