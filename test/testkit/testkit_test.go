package testkit

import (
	"errors"
	"testing"
	"time"
)

func TestPollShapes(t *testing.T) {
	for _, tc := range []struct {
		name string
		wait func(t *testing.T, calls *int)
	}{
		{"until", func(t *testing.T, calls *int) {
			Until(t, 5*time.Second, "third call", func() bool { *calls++; return *calls == 3 })
		}},
		{"eventually", func(t *testing.T, calls *int) {
			Eventually(t, 5*time.Second, "third call", func() error {
				if *calls++; *calls < 3 {
					return errors.New("not yet")
				}
				return nil
			})
		}},
		{"poll", func(t *testing.T, calls *int) {
			Poll(t, 5*time.Second, "third call", func() (bool, error) { *calls++; return *calls == 3, nil })
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			calls := 0
			start := time.Now()
			tc.wait(t, &calls)
			if calls != 3 {
				t.Errorf("condition evaluated %d times, want 3", calls)
			}
			if took := time.Since(start); took < 2*Interval {
				t.Errorf("returned after %v: no pause between evaluations", took)
			}
		})
	}
}

func TestPollEveryWaitsItsInterval(t *testing.T) {
	calls := 0
	start := time.Now()
	PollEvery(t, 4*Interval, 5*time.Second, "third call", func() (bool, error) { calls++; return calls == 3, nil })
	if took := time.Since(start); calls != 3 || took < 8*Interval {
		t.Errorf("%d evaluations in %v, want 3 with two pauses of %v", calls, took, 4*Interval)
	}
}

func TestWaitReportsInsteadOfFailing(t *testing.T) {
	calls := 0
	err := Wait(Interval, 3*Interval, "a condition never met", func() (bool, error) {
		calls++
		return false, errors.New("still no")
	})
	if err == nil || err.Error() != "timed out after 150ms waiting for a condition never met: still no" || calls < 2 {
		t.Errorf("after %d evaluations: %v; want the timeout with the last error", calls, err)
	}
	if err := Wait(Interval, time.Second, "a met condition", func() (bool, error) { return true, nil }); err != nil {
		t.Errorf("met condition: %v", err)
	}
}

func TestStopEndsTheWaitAtOnce(t *testing.T) {
	lost := errors.New("gone for good")
	calls := 0
	start := time.Now()
	err := Wait(Interval, time.Minute, "a lost cause", func() (bool, error) {
		if calls++; calls < 3 {
			return false, errors.New("not yet")
		}
		return false, Stop(lost)
	})
	if !errors.Is(err, lost) || calls != 3 || time.Since(start) > 30*time.Second {
		t.Errorf("%d evaluations in %v, error %v; want the stopping error at the third", calls, time.Since(start), err)
	}
	if Stop(nil) != nil {
		t.Error("Stop(nil) is not nil")
	}
}
