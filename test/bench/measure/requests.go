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
