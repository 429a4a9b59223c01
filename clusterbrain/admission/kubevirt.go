package admission

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/client-go/tools/cache"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/nodevirt/nodevirt/clusterbrain/api/client"
	"github.com/nodevirt/nodevirt/clusterbrain/api/cpumodel"
	"github.com/nodevirt/nodevirt/clusterbrain/api/featuregate"
	"github.com/nodevirt/nodevirt/clusterbrain/api/overcommit"
	"github.com/nodevirt/nodevirt/clusterbrain/api/rollout"
)

// defaultCPUAllocationRatio is KubeVirt's developerConfiguration
// cpuAllocationRatio default: a vCPU without a CPU request is charged a
// tenth of a CPU, as virt-launcher's pod requests it.
const defaultCPUAllocationRatio = 10

// clusterConfig is what the KubeVirt CR says that admission needs: its
// feature gates and CPU allocation ratio. Without a client (or a KubeVirt
// CR) no gate is on and the defaults apply.
type clusterConfig struct {
	virt *client.Set               // nil without a client
	kvs  cache.SharedIndexInformer // nil without a client
}

// newClusterConfig watches the KubeVirt CRs with s's client and runs the
// informer beside the server.
func newClusterConfig(s *Server) *clusterConfig {
	c := &clusterConfig{}
	if s.deps.Virt == nil {
		return c
	}
	c.virt = s.deps.Virt
	c.kvs = s.deps.Virt.KubeVirts.Informer("", 0, nil)
	s.Go(func(ctx context.Context) error { c.kvs.Run(ctx.Done()); return nil })
	return c
}

// kubeVirts returns the KubeVirt CRs, waiting up to 5s for the first list.
func (c *clusterConfig) kubeVirts(ctx context.Context) []*kubevirtv1.KubeVirt {
	if c == nil || c.kvs == nil {
		return nil
	}
	if !c.kvs.HasSynced() {
		wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		cache.WaitForCacheSync(wctx.Done(), c.kvs.HasSynced)
	}
	var out []*kubevirtv1.KubeVirt
	for _, o := range c.kvs.GetStore().List() {
		if kv, ok := o.(*kubevirtv1.KubeVirt); ok && kv.DeletionTimestamp == nil {
			out = append(out, kv)
		}
	}
	return out
}

// gates returns the feature-gate test for the cluster's KubeVirt CRs: a gate
// is on when a KubeVirt CR turns it on.
func (c *clusterConfig) gates(ctx context.Context) func(string) bool {
	kvs := c.kubeVirts(ctx)
	return func(gate string) bool {
		for _, kv := range kvs {
			if featuregate.KubeVirtEnabled(kv, gate) {
				return true
			}
		}
		return false
	}
}

// cpuAllocationRatio is the KubeVirt CR's developerConfiguration
// cpuAllocationRatio, or KubeVirt's default.
func (c *clusterConfig) cpuAllocationRatio(ctx context.Context) int {
	for _, kv := range c.kubeVirts(ctx) {
		if dc := kv.Spec.Configuration.DeveloperConfiguration; dc != nil && dc.CPUAllocationRatio > 0 {
			return dc.CPUAllocationRatio
		}
	}
	return defaultCPUAllocationRatio
}

// instancetypeMissing reports whether the instance type m names does not
// exist (yet). Without a client the type is taken to exist.
func (c *clusterConfig) instancetypeMissing(ctx context.Context, ns string, m *kubevirtv1.InstancetypeMatcher) (bool, error) {
	if c == nil || c.virt == nil {
		return false, nil
	}
	var err error
	switch strings.ToLower(m.Kind) {
	case "", "virtualmachineclusterinstancetype":
		_, err = c.virt.ClusterInstancetypes.Get(ctx, "", m.Name)
	case "virtualmachineinstancetype":
		_, err = c.virt.Instancetypes.Get(ctx, ns, m.Name)
	default:
		return false, nil // validateMatcher names the kind
	}
	if apierrors.IsNotFound(err) {
		return true, nil
	}
	if err != nil {
		return false, fmt.Errorf("instancetype %s: %w", m.Name, err)
	}
	return false, nil
}

// cpuModels is what the KubeVirt CR says about CPU models (package
// cpumodel): its default model and obsolete ones.
func (c *clusterConfig) cpuModels(ctx context.Context) cpumodel.Cluster {
	var kv *kubevirtv1.KubeVirt
	if kvs := c.kubeVirts(ctx); len(kvs) > 0 {
		kv = kvs[0]
	}
	return cpumodel.FromKubeVirt(kv)
}

// rollout is what the KubeVirt CR says about live updates (package
// rollout): the strategy and the CPU hotplug maximum.
func (c *clusterConfig) rollout(ctx context.Context) rollout.Cluster {
	var kv *kubevirtv1.KubeVirt
	if kvs := c.kubeVirts(ctx); len(kvs) > 0 {
		kv = kvs[0]
	}
	return rollout.FromKubeVirt(kv)
}

// memoryOvercommit is the KubeVirt CR's memoryOvercommit (package
// overcommit), or KubeVirt's default.
func (c *clusterConfig) memoryOvercommit(ctx context.Context) overcommit.Memory {
	var kv *kubevirtv1.KubeVirt
	if kvs := c.kubeVirts(ctx); len(kvs) > 0 {
		kv = kvs[0]
	}
	return overcommit.FromKubeVirt(kv)
}

// sameCPUModel reports whether the VM in old (JSON) has the model of cpu.
func sameCPUModel(old []byte, cpu *kubevirtv1.CPU) bool {
	var vm kubevirtv1.VirtualMachine
	if len(old) == 0 || json.Unmarshal(old, &vm) != nil || vm.Spec.Template == nil {
		return false
	}
	model := func(c *kubevirtv1.CPU) string {
		if c == nil {
			return ""
		}
		return c.Model
	}
	return model(vm.Spec.Template.Spec.Domain.CPU) == model(cpu)
}
