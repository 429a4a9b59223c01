package bridgemarker

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/nodevirt/nodevirt/nodeagent/kube"
)

// FieldManager is the field manager of the Node status patches.
const FieldManager = "bridge-marker"

// NodePublisher writes the resources into a Node's status capacity and
// allocatable, removing bridge resources no longer desired.
type NodePublisher struct {
	Client   kube.Interface
	NodeName string
}

var _ Publisher = (*NodePublisher)(nil)

// Publish patches the Node status so its bridge resources equal resources.
func (p *NodePublisher) Publish(ctx context.Context, resources map[string]int64) error {
	node, err := p.Client.CoreV1().Nodes().Get(ctx, p.NodeName, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("get node %s: %w", p.NodeName, err)
	}
	want := map[string]any{}
	for k, v := range resources {
		want[k] = strconv.FormatInt(v, 10)
	}
	for k := range node.Status.Capacity {
		if strings.HasPrefix(string(k), ResourcePrefix) {
			if _, ok := resources[string(k)]; !ok {
				want[string(k)] = nil // merge patch: remove
			}
		}
	}
	for k := range node.Status.Allocatable {
		if strings.HasPrefix(string(k), ResourcePrefix) {
			if _, ok := resources[string(k)]; !ok {
				want[string(k)] = nil
			}
		}
	}
	if len(want) == 0 {
		return nil
	}
	body, err := json.Marshal(map[string]any{"status": map[string]any{"capacity": want, "allocatable": want}})
	if err != nil {
		return err
	}
	_, err = p.Client.CoreV1().Nodes().Patch(ctx, p.NodeName, types.MergePatchType, body,
		metav1.PatchOptions{FieldManager: FieldManager}, "status")
	if err != nil {
		return fmt.Errorf("patch node %s status: %w", p.NodeName, err)
	}
	return nil
}
