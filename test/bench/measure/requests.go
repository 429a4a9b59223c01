package measure

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"

	"k8s.io/client-go/kubernetes"
)

// Requests are the API server's apiserver_request_total counters keyed
// "VERB resource[/subresource] code".
type Requests map[string]float64

// RequestCounts reads the API server's request counters, so a run can show
// how many round trips each object cost.
func RequestCounts(ctx context.Context, kube kubernetes.Interface) (Requests, error) {
	body, err := kube.CoreV1().RESTClient().Get().AbsPath("/metrics").Stream(ctx)
	if err != nil {
		return nil, fmt.Errorf("read apiserver metrics: %w", err)
	}
	defer body.Close()
	return ParseRequestCounts(body)
}

// ParseRequestCounts reads apiserver_request_total from a /metrics body.
func ParseRequestCounts(r io.Reader) (Requests, error) {
	out := Requests{}
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

// Count is one kind of request and how many were made.
type Count struct {
	Key string
	N   float64
}

// Delta returns the requests made between before and after, most frequent
// first, watches left out, and how many of them were writes (every verb but
// GET and LIST).
func Delta(before, after Requests) (rows []Count, writes float64) {
	for k, v := range after {
		d := v - before[k]
		verb, _, _ := strings.Cut(k, " ")
		if d <= 0 || verb == "WATCH" {
			continue
		}
		rows = append(rows, Count{k, d})
		if verb != "GET" && verb != "LIST" {
			writes += d
		}
	}
	sort.Slice(rows, func(i, j int) bool {
		return rows[i].N > rows[j].N || rows[i].N == rows[j].N && rows[i].Key < rows[j].Key
	})
	return rows, writes
}

// Latencies reads the API server's histograms of admission webhook
// calls (per webhook) and of request handling (per verb and resource) as
// "name" → [sum seconds, count], for the figures printed after a run.
func Latencies(ctx context.Context, kube kubernetes.Interface) (map[string][2]float64, error) {
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

// WriteLatencyDelta writes to w the mean latency of each webhook and
// request kind seen at least 10 times between before and after.
func WriteLatencyDelta(w io.Writer, before, after map[string][2]float64) {
	var names []string
	for k, v := range after {
		if v[1]-before[k][1] > 0 {
			names = append(names, k)
		}
	}
	sort.Strings(names)
	fmt.Fprintln(w, "mean latencies during the burst (api server's view):")
	for _, k := range names {
		n := after[k][1] - before[k][1]
		s := after[k][0] - before[k][0]
		if n < 10 {
			continue
		}
		fmt.Fprintf(w, "  %-70s %6.0f × %6.1f ms = %5.1f s\n", k, n, 1000*s/n, s)
	}
}
