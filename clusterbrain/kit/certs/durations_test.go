package certs

import (
	"testing"
	"time"
)

func TestDurationsValidation(t *testing.T) {
	if err := DefaultDurations().validate(); err != nil {
		t.Fatal(err)
	}
	bad := []Durations{
		{CA: time.Hour, CARenewBefore: 2 * time.Hour, Server: time.Minute, ServerRenewBefore: time.Second},
		{CA: time.Hour, CARenewBefore: time.Minute, Server: 2 * time.Hour, ServerRenewBefore: time.Minute},
		{},
	}
	for _, d := range bad {
		if d.validate() == nil {
			t.Errorf("%+v accepted", d)
		}
	}
}
