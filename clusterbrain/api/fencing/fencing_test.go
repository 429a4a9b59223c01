package fencing

import (
	"testing"
	"time"
)

func TestShouldFenceOnlyWhenCutOff(t *testing.T) {
	renewed := time.Date(2026, 11, 25, 12, 0, 0, 0, time.UTC)
	w := DefaultWindow
	if ShouldFence(renewed.Add(w-time.Second), renewed, w, 2, 0) {
		t.Error("fenced within the window")
	}
	if ShouldFence(renewed.Add(w+time.Second), renewed, w, 2, 1) {
		t.Error("fenced although a peer answers (the API server is down for everyone)")
	}
	if !ShouldFence(renewed.Add(w+time.Second), renewed, w, 2, 0) {
		t.Error("not fenced past the window with every peer unreachable")
	}
	if ShouldFence(renewed.Add(w+time.Second), renewed, w, 0, 0) {
		t.Error("fenced with no peers known (nothing could run its guests elsewhere)")
	}
}

func TestBrainFailsOverOnlyAfterAgentsFence(t *testing.T) {
	renewed := time.Date(2026, 11, 25, 12, 0, 0, 0, time.UTC)
	for after := time.Duration(0); after < 2*time.Minute; after += time.Second {
		now := renewed.Add(after)
		if Lost(now, renewed, DefaultWindow, DefaultMargin, false) && !ShouldFence(now, renewed, DefaultWindow, 1, 0) {
			t.Fatalf("at +%s the brain fails over while a cut-off agent has not fenced", after)
		}
	}
	if !Lost(renewed, renewed, DefaultWindow, DefaultMargin, true) {
		t.Error("out-of-service node not lost at once")
	}
}
