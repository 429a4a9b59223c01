// Command nodevirt-copy copies the files of a directory into another, each
// through a temporary file renamed into place, so that a reader (a container
// runtime calling a CNI plugin, the brain serving a download) never sees a
// partial file. It is the entrypoint of the images that only carry files:
// the CNI plugin installer (an init container writing /opt/cni/bin) and the
// virtctl downloads (an init container filling the brain's download
// directory).
//
//	nodevirt-copy -from /cni -to /host/opt/cni/bin
package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
)

func main() {
	from := flag.String("from", "", "directory whose files are copied (not recursively)")
	to := flag.String("to", "", "directory they are copied into (created if missing)")
	flag.Parse()
	n, err := copyDir(*from, *to)
	if err != nil {
		fmt.Fprintln(os.Stderr, "nodevirt-copy:", err)
		os.Exit(1)
	}
	fmt.Printf("nodevirt-copy: %d files from %s to %s\n", n, *from, *to)
}

func copyDir(from, to string) (int, error) {
	if from == "" || to == "" {
		return 0, fmt.Errorf("-from and -to are required")
	}
	entries, err := os.ReadDir(from)
	if err != nil {
		return 0, err
	}
	if err := os.MkdirAll(to, 0o755); err != nil {
		return 0, err
	}
	n := 0
	for _, e := range entries {
		src := filepath.Join(from, e.Name())
		st, err := os.Stat(src) // symlinks are copied as their targets
		if err != nil {
			return n, err
		}
		if !st.Mode().IsRegular() {
			continue
		}
		if err := copyFile(src, filepath.Join(to, e.Name()), st.Mode().Perm()); err != nil {
			return n, fmt.Errorf("copy %s: %w", e.Name(), err)
		}
		n++
	}
	return n, nil
}

func copyFile(src, dest string, mode os.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	tmp, err := os.CreateTemp(filepath.Dir(dest), "."+filepath.Base(dest)+".*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := io.Copy(tmp, in); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Chmod(mode); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), dest)
}
