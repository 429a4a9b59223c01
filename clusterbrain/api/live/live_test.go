package live

import (
	"sync"
	"testing"
)

type setting struct {
	name string
	n    int
}

func TestValue(t *testing.T) {
	var nilValue *Value[setting]
	if nilValue.Get() != (setting{}) || (&Value[setting]{}).Get() != (setting{}) {
		t.Error("a nil or unset Value does not read as the zero setting")
	}
	v := &Value[setting]{}
	v.Set(setting{"b", 1})
	if got := v.Get(); got != (setting{"b", 1}) {
		t.Errorf("Get after Set: %+v", got)
	}
	// Readers see one whole setting or another, never a mix (go test -race
	// shows a data race if the holder had one).
	var wg sync.WaitGroup
	for i := range 4 {
		wg.Add(2)
		go func() { defer wg.Done(); v.Set(setting{string(rune('a' + i)), i}) }()
		go func() {
			defer wg.Done()
			if got := v.Get(); got.name != string(rune('a'+got.n)) {
				t.Errorf("torn read %+v", got)
			}
		}()
	}
	wg.Wait()
}
