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
