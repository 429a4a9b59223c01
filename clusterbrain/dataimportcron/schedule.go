package dataimportcron

import (
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Schedule is a parsed five-field cron expression (minute hour
// day-of-month month day-of-week) with *, lists, ranges and steps; day of
// week 0 or 7 is Sunday. As in cron, when both day fields are restricted a
// day matching either runs.
type Schedule struct {
	minute, hour, dom, month, dow uint64 // bit sets
	domStar, dowStar              bool
}

// ParseSchedule parses expr.
func ParseSchedule(expr string) (*Schedule, error) {
	f := strings.Fields(expr)
	if len(f) != 5 {
		return nil, fmt.Errorf("schedule %q: want 5 fields, got %d", expr, len(f))
	}
	s := &Schedule{domStar: f[2] == "*", dowStar: f[4] == "*"}
	var err error
	for _, p := range []struct {
		field    string
		min, max int
		into     *uint64
	}{{f[0], 0, 59, &s.minute}, {f[1], 0, 23, &s.hour}, {f[2], 1, 31, &s.dom}, {f[3], 1, 12, &s.month}, {f[4], 0, 7, &s.dow}} {
		if *p.into, err = parseField(p.field, p.min, p.max); err != nil {
			return nil, fmt.Errorf("schedule %q: %w", expr, err)
		}
	}
	if s.dow&(1<<7) != 0 {
		s.dow |= 1
	}
	return s, nil
}

func parseField(field string, min, max int) (uint64, error) {
	var bits uint64
	for _, part := range strings.Split(field, ",") {
		rng, stepStr, hasStep := strings.Cut(part, "/")
		step := 1
		if hasStep {
			n, err := strconv.Atoi(stepStr)
			if err != nil || n <= 0 {
				return 0, fmt.Errorf("bad step in %q", part)
			}
			step = n
		}
		lo, hi := min, max
		if rng != "*" {
			a, b, isRange := strings.Cut(rng, "-")
			x, err := strconv.Atoi(a)
			if err != nil {
				return 0, fmt.Errorf("bad value %q", part)
			}
			lo, hi = x, x
			if isRange {
				if hi, err = strconv.Atoi(b); err != nil {
					return 0, fmt.Errorf("bad range %q", part)
				}
			} else if hasStep {
				hi = max
			}
		}
		if lo < min || hi > max || lo > hi {
			return 0, fmt.Errorf("%q is out of range %d-%d", part, min, max)
		}
		for v := lo; v <= hi; v += step {
			bits |= 1 << uint(v)
		}
	}
	return bits, nil
}

// Next returns the first minute strictly after t that the schedule
// matches (in t's location), or the zero time when none comes within
// five years (such as February 30th).
func (s *Schedule) Next(t time.Time) time.Time {
	t = t.Truncate(time.Minute).Add(time.Minute)
	end := t.AddDate(5, 0, 0)
	for t.Before(end) {
		if s.month&(1<<uint(t.Month())) == 0 {
			t = time.Date(t.Year(), t.Month()+1, 1, 0, 0, 0, 0, t.Location())
			continue
		}
		if !s.dayMatches(t) {
			t = time.Date(t.Year(), t.Month(), t.Day()+1, 0, 0, 0, 0, t.Location())
			continue
		}
		if s.hour&(1<<uint(t.Hour())) == 0 {
			t = time.Date(t.Year(), t.Month(), t.Day(), t.Hour()+1, 0, 0, 0, t.Location())
			continue
		}
		if s.minute&(1<<uint(t.Minute())) == 0 {
			t = t.Add(time.Minute)
			continue
		}
		return t
	}
	return time.Time{}
}

func (s *Schedule) dayMatches(t time.Time) bool {
	dom := s.dom&(1<<uint(t.Day())) != 0
	dow := s.dow&(1<<uint(t.Weekday())) != 0
	switch {
	case s.domStar && s.dowStar:
		return true
	case s.domStar:
		return dow
	case s.dowStar:
		return dom
	}
	return dom || dow
}
