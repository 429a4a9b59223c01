package bridge

import (
	"context"
	"strings"
	"testing"

	"github.com/nodevirt/nodevirt/cni/cnitest"
)

func TestRemoveUnusedTablesKeepsUsedOnes(t *testing.T) {
	ns, err := cnitest.NewNS("nvtbl")
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	ctx := context.Background()
	tables := func() string {
		out, err := ns.Run(ctx, "nft", "list", "tables")
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	err = ns.Do(func() error {
		var b strings.Builder
		spoofBase(&b)
		c := spoofChainName("nvtap0")
		b.WriteString("add chain bridge " + spoofTable + " " + c + "\n")
		b.WriteString("add element bridge " + spoofTable + " ports { \"nvtap0\" : jump " + c + " }\n")
		if err := runNFT(ctx, b.String()); err != nil {
			return err
		}
		return RemoveUnusedTables(ctx)
	})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(tables(), spoofTable) {
		t.Fatal("a table with a port in use was removed")
	}
	err = ns.Do(func() error {
		if err := runNFT(ctx, spoofDelScript("nvtap0")); err != nil {
			return err
		}
		return RemoveUnusedTables(ctx)
	})
	if err != nil {
		t.Fatal(err)
	}
	if out := tables(); strings.Contains(out, spoofTable) {
		t.Fatalf("unused table left:\n%s", out)
	}
}
