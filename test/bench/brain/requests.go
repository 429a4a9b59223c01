package main

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"

	"k8s.io/client-go/kubernetes"

	"github.com/nodevirt/nodevirt/test/bench/measure"
)

// printRequestDelta writes the requests made between before and after,
// per object created, to stderr (watches left out).
func printRequestDelta(before, after measure.Requests, perObjects int) {
	rows, writes := measure.Delta(before, after)
	fmt.Fprintf(os.Stderr, "api writes during the burst: %.0f (%.2f per vm)\n", writes, writes/float64(perObjects))
	for _, r := range rows {
		fmt.Fprintf(os.Stderr, "  %-60s %6.0f  %.2f/vm\n", r.Key, r.N, r.N/float64(perObjects))
	}
}

// apiserverPid finds the kube-apiserver whose command line mentions dir
// (the control plane started for this run), or 0.
func apiserverPid(dir string) int { return measure.ControlPlanePid("kube-apiserver", dir) }

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
