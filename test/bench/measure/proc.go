// Package measure reads the figures nodevirt's benchmarks take from outside
// the processes they measure: CPU time and memory from /proc, the pids of
// a test control plane's processes, and the API server's request counters.
package measure

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
)

// CPUTime reads the user+system CPU time process pid used (0 when it is
// gone).
func CPUTime(pid int) time.Duration {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	s := string(data)
	f := strings.Fields(s[strings.LastIndex(s, ")")+2:])
	if len(f) < 13 {
		return 0
	}
	u, _ := strconv.ParseInt(f[11], 10, 64)
	k, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(u+k) * time.Second / 100 // USER_HZ
}

// MemMiB reads a memory figure of /proc/PID/status (VmRSS, VmHWM, RssAnon...)
// in MiB (0 when the process or the field is missing).
func MemMiB(pid int, field string) float64 {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(data), "\n") {
		if strings.HasPrefix(line, field+":") {
			f := strings.Fields(line)
			kb, _ := strconv.ParseFloat(f[1], 64)
			return kb / 1024
		}
	}
	return 0
}

// ControlPlanePid finds the process of the binary named name (etcd,
// kube-apiserver) whose command line mentions dir, the directory of the
// control plane a run started, or 0.
func ControlPlanePid(name, dir string) int {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return 0
	}
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cmd, err := os.ReadFile("/proc/" + e.Name() + "/cmdline")
		if err != nil {
			continue
		}
		args := strings.Split(string(cmd), "\x00")
		if strings.HasSuffix(args[0], name) && strings.Contains(string(cmd), dir) {
			return pid
		}
	}
	return 0
}
