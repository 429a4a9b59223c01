package launcher

import (
	"testing"
	"time"

	"libvirt.org/go/libvirt"
)

// TestMigrateFlags: each option turns on its libvirt flag and nothing else.
func TestMigrateFlags(t *testing.T) {
	base := libvirt.MIGRATE_LIVE | libvirt.MIGRATE_PEER2PEER | libvirt.MIGRATE_PERSIST_DEST
	for _, c := range []struct {
		opts MigrateOptions
		want libvirt.DomainMigrateFlags
	}{
		{MigrateOptions{}, base},
		{MigrateOptions{TLS: true}, base | libvirt.MIGRATE_TLS},
		{MigrateOptions{PostCopyAfter: time.Minute}, base | libvirt.MIGRATE_POSTCOPY},
		{MigrateOptions{CopyStorage: true, SharedUnsafe: true}, base | libvirt.MIGRATE_NON_SHARED_DISK | libvirt.MIGRATE_UNSAFE},
		{MigrateOptions{AutoConverge: true, TLS: true}, base | libvirt.MIGRATE_AUTO_CONVERGE | libvirt.MIGRATE_TLS},
	} {
		if got := migrateFlags(c.opts); got != c.want {
			t.Errorf("%+v: flags %#x, want %#x", c.opts, got, c.want)
		}
	}
}
