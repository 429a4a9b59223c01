package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"sort"
	"strconv"
	"strings"

	"k8s.io/client-go/kubernetes"
)

// requestCounts reads the API server's apiserver_request_total counters,
// keyed "VERB resource[/subresource] code", so a run can show how many
// round trips each object cost.
func requestCounts(ctx context.Context, kube kubernetes.Interface) (map[string]float64, error) {
	body, err := kube.CoreV1().RESTClient().Get().AbsPath("/metrics").Stream(ctx)
	if err != nil {
		return nil, fmt.Errorf("read apiserver metrics: %w", err)
	}
	defer body.Close()
	return parseRequestCounts(body)
}

func parseRequestCounts(r io.Reader) (map[string]float64, error) {
	out := map[string]float64{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "apiserver_request_total{") {
			continue
		}
		end := strings.LastIndexByte(line, '}')
		if end < 0 {
			continue
		}
		v, err := strconv.ParseFloat(strings.TrimSpace(line[end+1:]), 64)
		if err != nil {
			continue
		}
		labels := map[string]string{}
		for _, kv := range strings.Split(line[len("apiserver_request_total{"):end], ",") {
			k, val, ok := strings.Cut(kv, "=")
			if ok {
				labels[k] = strings.Trim(val, `"`)
			}
		}
		res := labels["resource"]
		if sub := labels["subresource"]; sub != "" {
			res += "/" + sub
		}
		out[labels["verb"]+" "+res+" "+labels["code"]] += v
	}
	return out, sc.Err()
}

// printRequestDelta writes the requests made between before and after,
// per object created, to stderr (watches left out).
func printRequestDelta(before, after map[string]float64, perObjects int) {
	type row struct {
		key string
		n   float64
	}
	var rows []row
	var writes float64
	for k, v := range after {
		d := v - before[k]
		verb := strings.Fields(k)[0]
		if d <= 0 || verb == "WATCH" {
			continue
		}
		rows = append(rows, row{k, d})
		if verb != "GET" && verb != "LIST" {
			writes += d
		}
	}
	sort.Slice(rows, func(i, j int) bool { return rows[i].n > rows[j].n })
	fmt.Fprintf(os.Stderr, "api writes during the burst: %.0f (%.2f per vm)\n", writes, writes/float64(perObjects))
	for _, r := range rows {
		fmt.Fprintf(os.Stderr, "  %-60s %6.0f  %.2f/vm\n", r.key, r.n, r.n/float64(perObjects))
	}
}

// apiserverPid finds the kube-apiserver whose command line mentions dir
// (the control plane started for this run), or 0.
func apiserverPid(dir string) int { return controlPlanePid("kube-apiserver", dir) }

// controlPlanePid finds the process of the binary named name whose
// command line mentions dir, or 0.
func controlPlanePid(name, dir string) int {
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

// latencySums reads the API server's histograms of admission webhook
// calls (per webhook) and of request handling (per verb and resource) as
// "name" → [sum seconds, count], for the figures printed after a run.
func latencySums(ctx context.Context, kube kubernetes.Interface) (map[string][2]float64, error) {
	body, err := kube.CoreV1().RESTClient().Get().AbsPath("/metrics").Stream(ctx)
	if err != nil {
		return nil, fmt.Errorf("read apiserver metrics: %w", err)
	}
	defer body.Close()
	out := map[string][2]float64{}
	sc := bufio.NewScanner(body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		var metric, key string
		switch {
		case strings.HasPrefix(line, "apiserver_admission_webhook_admission_duration_seconds_sum{"),
			strings.HasPrefix(line, "apiserver_admission_webhook_admission_duration_seconds_count{"):
			metric, key = "webhook", "name"
		case strings.HasPrefix(line, "apiserver_request_duration_seconds_sum{"),
			strings.HasPrefix(line, "apiserver_request_duration_seconds_count{"):
			metric, key = "request", "resource"
		default:
			continue
		}
		open, end := strings.IndexByte(line, '{'), strings.LastIndexByte(line, '}')
		v, err := strconv.ParseFloat(strings.TrimSpace(line[end+1:]), 64)
		if err != nil {
			continue
		}
		labels := map[string]string{}
		for _, kv := range strings.Split(line[open+1:end], ",") {
			k, val, ok := strings.Cut(kv, "=")
			if ok {
				labels[k] = strings.Trim(val, `"`)
			}
		}
		name := metric + " " + labels[key]
		if metric == "request" {
			if labels["verb"] == "WATCH" {
				continue
			}
			name = metric + " " + labels["verb"] + " " + labels["resource"]
			if s := labels["subresource"]; s != "" {
				name += "/" + s
			}
		} else {
			name += " " + labels["operation"]
		}
		cur := out[name]
		if strings.Contains(line[:open], "_sum") {
			cur[0] += v
		} else {
			cur[1] += v
		}
		out[name] = cur
	}
	return out, sc.Err()
}

// printLatencyDelta writes the mean latency of each webhook and request
// kind seen between before and after.
func printLatencyDelta(before, after map[string][2]float64) {
	var names []string
	for k, v := range after {
		if v[1]-before[k][1] > 0 {
			names = append(names, k)
		}
	}
	sort.Strings(names)
	fmt.Fprintln(os.Stderr, "mean latencies during the burst (api server's view):")
	for _, k := range names {
		n := after[k][1] - before[k][1]
		s := after[k][0] - before[k][0]
		if n < 10 {
			continue
		}
		fmt.Fprintf(os.Stderr, "  %-70s %6.0f × %6.1f ms = %5.1f s\n", k, n, 1000*s/n, s)
	}
}
