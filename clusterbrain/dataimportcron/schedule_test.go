package dataimportcron

import (
	"testing"
	"time"
)

func TestScheduleNext(t *testing.T) {
	at := func(s string) time.Time {
		v, err := time.Parse("2006-01-02 15:04", s)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	for _, c := range []struct{ expr, from, want string }{
		{"0 */12 * * *", "2026-11-25 16:49", "2026-11-26 00:00"},
		{"0 */12 * * *", "2026-11-26 00:00", "2026-11-26 12:00"},
		{"* * * * *", "2026-11-25 16:49", "2026-11-25 16:50"},
		{"30 2 1 * *", "2026-11-25 16:49", "2026-12-01 02:30"},
		{"0 0 * * 0", "2026-11-25 16:49", "2026-11-29 00:00"}, // a Sunday
		{"0 0 * * 7", "2026-11-25 16:49", "2026-11-29 00:00"},
		{"15,45 9-10 * 2 *", "2026-11-25 16:49", "2027-02-01 09:15"},
		{"0 0 13 * 5", "2026-11-25 16:49", "2026-11-27 00:00"}, // Friday or the 13th
	} {
		s, err := ParseSchedule(c.expr)
		if err != nil {
			t.Fatalf("%q: %v", c.expr, err)
		}
		if got := s.Next(at(c.from)); !got.Equal(at(c.want)) {
			t.Errorf("%q after %s: %s, want %s", c.expr, c.from, got.Format("2006-01-02 15:04"), c.want)
		}
	}
	if s, _ := ParseSchedule("0 0 30 2 *"); !s.Next(at("2026-01-01 00:00")).IsZero() {
		t.Error("February 30th came")
	}
	for _, bad := range []string{"", "* * * *", "60 * * * *", "*/0 * * * *", "a * * * *", "5-1 * * * *"} {
		if _, err := ParseSchedule(bad); err == nil {
			t.Errorf("%q parsed", bad)
		}
	}
}
