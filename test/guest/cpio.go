package guest

import (
	"fmt"
	"io"
	"sort"
	"strings"
)

// archive is an initramfs under construction: guest path → entry. It is
// written as a "newc" cpio archive, the format the kernel unpacks, so no
// root privilege (for device nodes) and no cpio binary is needed.
type archive struct {
	entries map[string]entry
}

type entry struct {
	mode   uint32 // file type bits | permissions
	data   []byte // regular file contents
	src    string // or: host file to copy (regular files)
	target string // symlink target
	rdev   [2]uint32
}

const (
	modeDir     = 0o040000
	modeFile    = 0o100000
	modeSymlink = 0o120000
	modeChar    = 0o020000
)

func newArchive() *archive { return &archive{entries: map[string]entry{}} }

// clean turns a guest path into the archive's form: relative, no leading "/".
func clean(p string) string { return strings.TrimPrefix(strings.TrimSpace(p), "/") }

func (a *archive) dir(p string) {
	p = clean(p)
	for p != "" && p != "." {
		if _, ok := a.entries[p]; !ok {
			a.entries[p] = entry{mode: modeDir | 0o755}
		}
		i := strings.LastIndex(p, "/")
		if i < 0 {
			break
		}
		p = p[:i]
	}
}

func (a *archive) parent(p string) {
	if i := strings.LastIndex(p, "/"); i > 0 {
		a.dir(p[:i])
	}
}

func (a *archive) file(p string, perm uint32, data []byte) {
	p = clean(p)
	a.parent(p)
	a.entries[p] = entry{mode: modeFile | perm, data: data}
}

func (a *archive) copy(p string, perm uint32, src string) {
	p = clean(p)
	a.parent(p)
	a.entries[p] = entry{mode: modeFile | perm, src: src}
}

func (a *archive) symlink(p, target string) {
	p = clean(p)
	a.parent(p)
	a.entries[p] = entry{mode: modeSymlink | 0o777, target: target}
}

func (a *archive) chardev(p string, major, minor uint32) {
	p = clean(p)
	a.parent(p)
	a.entries[p] = entry{mode: modeChar | 0o600, rdev: [2]uint32{major, minor}}
}

// names returns the paths sorted so that a directory precedes its contents.
func (a *archive) names() []string {
	names := make([]string, 0, len(a.entries))
	for n := range a.entries {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// describe feeds everything that determines the archive's bytes to a key.
func (a *archive) describe(k *hasher) error {
	for _, n := range a.names() {
		e := a.entries[n]
		k.add(n, fmt.Sprintf("%o", e.mode), e.target, fmt.Sprint(e.rdev), string(e.data))
		if e.src != "" {
			if err := k.addFile(e.src); err != nil {
				return err
			}
		}
	}
	return nil
}

// write emits the newc archive. open reads a host file named by an entry.
func (a *archive) write(w io.Writer, readFile func(string) ([]byte, error)) error {
	ino := uint32(1)
	for _, n := range a.names() {
		e := a.entries[n]
		body := e.data
		switch {
		case e.mode&0o170000 == modeSymlink:
			body = []byte(e.target)
		case e.src != "":
			b, err := readFile(e.src)
			if err != nil {
				return err
			}
			body = b
		}
		if err := writeRecord(w, ino, n, e, body); err != nil {
			return err
		}
		ino++
	}
	return writeRecord(w, ino, "TRAILER!!!", entry{}, nil)
}

func writeRecord(w io.Writer, ino uint32, name string, e entry, body []byte) error {
	nlink := uint32(1)
	if e.mode&0o170000 == modeDir {
		nlink = 2
	}
	hdr := fmt.Sprintf("070701%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x",
		ino, e.mode, 0, 0, nlink, 0, len(body), 0, 0, e.rdev[0], e.rdev[1], len(name)+1, 0)
	buf := append([]byte(hdr), name...)
	buf = append(buf, 0)
	buf = pad4(buf)
	buf = append(buf, body...)
	buf = pad4(buf)
	_, err := w.Write(buf)
	return err
}

func pad4(b []byte) []byte {
	for len(b)%4 != 0 {
		b = append(b, 0)
	}
	return b
}
