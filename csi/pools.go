package csi

import (
	"errors"
	"fmt"
	"path/filepath"
	"strings"
)

// ErrPoolInUse is returned by RemovePool for a pool that still holds
// volumes or snapshots, or is the default pool.
var ErrPoolInUse = errors.New("storage pool in use")

// AddPool starts serving a pool while the driver runs: its directory is
// made if missing, and volumes recorded there by an earlier run are brought
// back. Adding a pool already served at the same path does nothing; the
// same name at another path, or a path another pool uses, is refused.
func (d *Driver) AddPool(pc PoolConfig) error {
	if !validID(pc.Name) {
		return fmt.Errorf("pool name %q is not a valid name", pc.Name)
	}
	if !filepath.IsAbs(pc.Path) {
		return fmt.Errorf("pool %s: path %q is not absolute", pc.Name, pc.Path)
	}
	unlock := d.locks.lock("pool/" + pc.Name)
	defer unlock()
	p, err := openPool(pc, d.cfg.SharePools)
	if err != nil {
		return err
	}
	d.poolsMu.Lock()
	for _, other := range d.pools {
		switch {
		case other.name == p.name && other.path == p.path:
			d.poolsMu.Unlock()
			return nil
		case other.name == p.name:
			d.poolsMu.Unlock()
			return fmt.Errorf("pool %s is served at %s already", p.name, other.path)
		case overlaps(other.path, p.path):
			d.poolsMu.Unlock()
			return fmt.Errorf("pool %s: path %s overlaps pool %s at %s", p.name, p.path, other.name, other.path)
		}
	}
	d.pools[p.name] = p
	d.poolsMu.Unlock()

	loops, err := loopsByBacking()
	if err == nil {
		err = d.loadPool(p, loops)
	}
	if err != nil {
		d.poolsMu.Lock()
		delete(d.pools, p.name)
		d.poolsMu.Unlock()
		return err
	}
	d.log.Info("serving pool", "pool", p.name, "path", p.path)
	return nil
}

// RemovePool stops serving an empty pool (its directory stays). A pool
// holding volumes or snapshots, and the default pool, are kept:
// ErrPoolInUse. Removing a pool not served succeeds.
func (d *Driver) RemovePool(name string) error {
	if name == d.cfg.DefaultPool {
		return fmt.Errorf("pool %s is the default pool: %w", name, ErrPoolInUse)
	}
	d.poolUse.Lock()
	defer d.poolUse.Unlock()
	d.mu.Lock()
	vols, snaps := 0, 0
	for _, v := range d.volumes {
		if v.Pool == name {
			vols++
		}
	}
	for _, s := range d.snapshots {
		if s.Pool == name {
			snaps++
		}
	}
	d.mu.Unlock()
	if vols+snaps > 0 {
		return fmt.Errorf("pool %s holds %d volumes and %d snapshots: %w", name, vols, snaps, ErrPoolInUse)
	}
	d.poolsMu.Lock()
	_, served := d.pools[name]
	delete(d.pools, name)
	d.poolsMu.Unlock()
	if served {
		d.log.Info("stopped serving pool", "pool", name)
	}
	return nil
}

// overlaps reports whether one directory is the other or inside it.
func overlaps(a, b string) bool {
	inside := func(x, y string) bool {
		rel, err := filepath.Rel(y, x)
		return err == nil && rel != ".." && !strings.HasPrefix(rel, "../")
	}
	return inside(a, b) || inside(b, a)
}
