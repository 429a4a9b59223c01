package brain

import (
	"context"
	"errors"

	"k8s.io/client-go/dynamic"

	"github.com/nodevirt/nodevirt/clusterbrain/admission"
	"github.com/nodevirt/nodevirt/clusterbrain/aggregated"
	snapshotv1 "github.com/nodevirt/nodevirt/clusterbrain/api/volumesnapshot/v1"
	"github.com/nodevirt/nodevirt/clusterbrain/capacitypods"
	"github.com/nodevirt/nodevirt/clusterbrain/clidownload"
	"github.com/nodevirt/nodevirt/clusterbrain/dataimportcron"
	"github.com/nodevirt/nodevirt/clusterbrain/datavolume"
	"github.com/nodevirt/nodevirt/clusterbrain/hco"
	"github.com/nodevirt/nodevirt/clusterbrain/hcoconvert"
	"github.com/nodevirt/nodevirt/clusterbrain/hostpathprovisioner"
	"github.com/nodevirt/nodevirt/clusterbrain/instancetypes"
	"github.com/nodevirt/nodevirt/clusterbrain/kit/daemon/buildinfo"
	"github.com/nodevirt/nodevirt/clusterbrain/macpool"
	"github.com/nodevirt/nodevirt/clusterbrain/migration"
	"github.com/nodevirt/nodevirt/clusterbrain/nodecerts"
	"github.com/nodevirt/nodevirt/clusterbrain/nodefailure"
	"github.com/nodevirt/nodevirt/clusterbrain/nodereads"
	"github.com/nodevirt/nodevirt/clusterbrain/rbac"
	"github.com/nodevirt/nodevirt/clusterbrain/replicas"
	"github.com/nodevirt/nodevirt/clusterbrain/scheduler"
	"github.com/nodevirt/nodevirt/clusterbrain/ssp"
	"github.com/nodevirt/nodevirt/clusterbrain/ssp/templateapi"
	"github.com/nodevirt/nodevirt/clusterbrain/ssp/templates"
	"github.com/nodevirt/nodevirt/clusterbrain/ssp/validator"
	"github.com/nodevirt/nodevirt/clusterbrain/subresources"
	"github.com/nodevirt/nodevirt/clusterbrain/upload"
	"github.com/nodevirt/nodevirt/clusterbrain/vmclone"
	"github.com/nodevirt/nodevirt/clusterbrain/vmcontroller"
	"github.com/nodevirt/nodevirt/clusterbrain/vmsnapshot"
)

// everyBrainRoles run on every brain replica: they serve requests
// (admission webhooks, aggregated APIs, downloads) and hold no exclusive state.
var everyBrainRoles = []RoleFactory{
	func(d *Deps) (Role, error) {
		return clidownload.New(clidownload.Config{Dir: d.Config.VirtctlDir, Addr: d.Config.CLIDownloadAddr, Log: d.Log.With("role", "cli-download")})
	},
	func(d *Deps) (Role, error) {
		return upload.New(upload.Config{Kube: d.Kube, Namespace: d.Config.Namespace, APIAddr: d.Config.UploadAPIAddr, ProxyAddr: d.Config.UploadProxyAddr,
			TLSProfile: d.CDITLS, Log: d.CDILog})
	},
	func(d *Deps) (Role, error) {
		return subresources.ForBrain(d.RestConfig, d.Kube, d.Virt, d.Config.Namespace, d.Config.SubresourcesAddr, d.KubeVirtTLS, d.Rollout, d.Log.With("role", "subresources"))
	},
	func(d *Deps) (Role, error) {
		dyn, err := dynamic.NewForConfig(d.RestConfig)
		if err != nil {
			return nil, err
		}
		return templateapi.New(templateapi.Config{Kube: d.Kube, Dynamic: dyn, Namespace: d.Config.Namespace,
			Addr: d.Config.TemplateAPIAddr, TLSProfile: d.KubeVirtTLS, Log: d.Log.With("role", "template-api")})
	},
	func(d *Deps) (Role, error) {
		dyn, err := dynamic.NewForConfig(d.RestConfig)
		if err != nil {
			return nil, err
		}
		return nodereads.New(nodereads.Config{Kube: d.Kube, Dynamic: dyn, Virt: d.Virt, Namespace: d.Config.Namespace,
			Addr: d.Config.NodeReadsAddr, TLSProfile: d.KubeVirtTLS, Log: d.Log})
	},
	func(d *Deps) (Role, error) {
		return newMetricsServer(d.Config.MetricsAddr, d.Virt, d.allVMIs, d.Log.With("role", "metrics")), nil
	},
	func(d *Deps) (Role, error) {
		// One webhook server: KubeVirt's VM/VMI admission (with quotas),
		// CDI's DataVolume validation, the MAC pool and the hco-webhook.
		return admission.NewRole(admission.Config{Addr: d.Config.WebhookAddr, Service: d.Config.WebhookService,
			Namespace: d.Config.Namespace, TLSProfile: d.KubeVirtTLS},
			admission.Deps{Kube: d.Kube, Virt: d.Virt, Log: d.Log},
			admission.RegisterDataVolumes,
			macpool.Register(macpool.Config{RestConfig: d.RestConfig, Namespace: d.Config.Namespace}),
			hco.Webhooks(d.Config.Namespace), datavolume.Webhooks(),
			// Snapshots, restores and clones.
			vmsnapshot.Webhooks(), vmclone.Webhooks(),
			// hco.kubevirt.io/v1 ↔ v1beta1 (the stored version).
			hcoconvert.Register(d.RestConfig),
			// SSP's template validator.
			validator.Register(d.RestConfig))
	},
}

var (
	_ vmcontroller.Placer     = (*scheduler.Scheduler)(nil)
	_ datavolume.VolumePlacer = (*scheduler.Scheduler)(nil)
)

// leaderRoles run only on the elected brain: controllers that write.
var leaderRoles = []RoleFactory{
	func(d *Deps) (Role, error) {
		// Nodes' Ready condition and taints from their Leases; lost nodes'
		// VMIs failed over (package fencing's timeline).
		return nodefailure.New(nodefailure.Config{Kube: d.Kube, Virt: d.Virt, Window: d.Config.FencingWindow, Nodes: d.nodes,
			Leases: d.leases, Log: d.Log.With("role", "node-failure")})
	},
	func(d *Deps) (Role, error) {
		// Golden images: DataImportCrons and DataSources' Ready.
		return dataimportcron.New(dataimportcron.Config{Virt: d.Virt, Log: d.CDILog.With("role", "dataimportcron")})
	},
	func(d *Deps) (Role, error) {
		// HostPathProvisioners' status and StorageClasses, from the node
		// agents' pool reports; hco judges its HPP child from that status.
		return hostpathprovisioner.New(hostpathprovisioner.Config{Kube: d.Kube, Virt: d.Virt, Version: buildinfo.Read().Version,
			Nodes: d.nodes, Log: d.Log.With("role", "hostpathprovisioner")})
	},
	func(d *Deps) (Role, error) {
		// Before hco, which probes it for the SSP child.
		dyn, err := dynamic.NewForConfig(d.RestConfig)
		if err != nil {
			return nil, err
		}
		r, err := ssp.New(ssp.Config{Kube: d.Kube, Dynamic: dyn, Virt: d.Virt, Log: d.Log.With("role", "ssp-templates")})
		d.ssp = r
		return r, err
	},
	func(d *Deps) (Role, error) {
		return hco.New(hco.Config{Namespace: d.Config.Namespace, Kube: d.Kube, Virt: d.Virt, Log: d.Log.With("role", "hco"), BrainHealth: d.Health.Ready,
			Probes: childProbes(d), Nodes: d.nodes, BrainDeployment: d.Config.Deployment})
	},
	func(d *Deps) (Role, error) {
		return instancetypes.New(instancetypes.Config{Virt: d.Virt, Namespace: d.Config.Namespace, Log: d.Log.With("role", "common-instancetypes")})
	},
	func(d *Deps) (Role, error) {
		s, err := scheduler.New(scheduler.Config{RestConfig: d.RestConfig, Log: d.Log.With("role", "scheduler"), VMIInformer: d.vmis,
			NodeInformer: d.nodes})
		d.scheduler = s
		return s, err
	},
	func(d *Deps) (Role, error) {
		dyn, err := dynamic.NewForConfig(d.RestConfig)
		if err != nil {
			return nil, err
		}
		// Volumes bound before any consumer go where the scheduler would
		// put a VMI.
		return datavolume.New(datavolume.Config{Kube: d.Kube, Virt: d.Virt, Log: d.CDILog, Snapshots: snapshotv1.NewClient(dyn),
			Namespace: d.Config.Namespace, Placer: d.scheduler})
	},
	func(d *Deps) (Role, error) {
		// The scheduler places each VMI before it is created, so the VMI is
		// created with its node label and bound by one status write.
		return vmcontroller.New(vmcontroller.Config{RestConfig: d.RestConfig, Log: d.Log.With("role", "vm-controller"), Placer: d.scheduler,
			VMInformer: d.vms, VMIInformer: d.vmis, CPUModels: d.CPUModels,
			MemoryOvercommit: d.MemoryOvercommit, Rollout: d.Rollout})
	},
	func(d *Deps) (Role, error) {
		// Nodes' certificates, signed with the node CA only the brain reads.
		return nodecerts.New(nodecerts.Config{Kube: d.Kube, Namespace: d.Config.Namespace, Log: d.Log})
	},
	func(d *Deps) (Role, error) {
		// The daemons' roles and node restriction.
		return rbac.NewDaemonRoles(d.Kube, d.Log)
	},
	func(d *Deps) (Role, error) {
		if !d.Config.CapacityPods {
			return idleRole("capacity-pods"), nil
		}
		return capacitypods.New(capacitypods.Config{Kube: d.Kube, VMIs: d.vmis, Image: d.Config.CapacityPodImage,
			MemoryOvercommit: d.MemoryOvercommit, Log: d.Log.With("role", "capacity-pods")})
	},
	func(d *Deps) (Role, error) {
		// Live migrations: the scheduler picks each target node.
		dyn, err := dynamic.NewForConfig(d.RestConfig)
		if err != nil {
			return nil, err
		}
		return migration.New(migration.Config{Kube: d.Kube, Virt: d.Virt, Placer: d.scheduler, Dynamic: dyn, Nodes: d.nodes, Log: d.Log})
	},
	func(d *Deps) (Role, error) {
		// VirtualMachineSnapshots and restores on the nodes' CSI
		// snapshots, guests frozen through their nodes.
		dyn, err := dynamic.NewForConfig(d.RestConfig)
		if err != nil {
			return nil, err
		}
		return vmsnapshot.New(vmsnapshot.Config{Virt: d.Virt, Kube: d.Kube, Snapshots: snapshotv1.NewClient(dyn),
			VMs: d.vms, VMIs: d.vmis, Freezer: vmsnapshot.NodeFreezer{Node: subresources.NewBrainNodeClient(d.Kube, d.Config.Namespace)},
			Log: d.Log.With("role", "vm-snapshots")})
	},
	func(d *Deps) (Role, error) {
		// VirtualMachineClones, through a snapshot and a restore.
		return vmclone.New(vmclone.Config{Virt: d.Virt, Log: d.Log.With("role", "vm-clones")})
	},
	func(d *Deps) (Role, error) {
		// VirtualMachineInstanceReplicaSets' VMIs and VirtualMachinePools'
		// VMs kept at their replica counts.
		return replicas.New(replicas.Config{Virt: d.Virt, Kube: d.Kube, VMIs: d.vmis, VMs: d.vms, CPUModels: d.CPUModels,
			MemoryOvercommit: d.MemoryOvercommit, Rollout: d.Rollout, Log: d.Log.With("role", "replicas")})
	},
	func(d *Deps) (Role, error) {
		return macpool.NewReconciler(macpool.Config{RestConfig: d.RestConfig, Virt: d.Virt, Namespace: d.Config.Namespace, Log: d.Log.With("role", "macpool"),
			VMInformer: d.vms})
	},
}

// idleRole is a role switched off by configuration: it waits for the end.
type idleRole string

func (r idleRole) Name() string { return string(r) }

func (r idleRole) Run(ctx context.Context) error { <-ctx.Done(); return nil }

// childProbes are the brain's parts each HyperConverged child stands for
// (the node agents' parts are judged from their Nodes by the hco role).
func childProbes(d *Deps) map[string][]hco.Probe {
	h := d.Health
	return map[string][]hco.Probe{
		"KubeVirt": {
			hco.RoleRunning(h, "VM controller", "vm-controller"),
			hco.RoleRunning(h, "scheduler", "scheduler"),
			hco.RoleRunning(h, "admission webhooks", "admission"),
		},
		"CDI": {
			hco.RoleRunning(h, "DataVolume controller", "datavolume"),
			hco.RoleRunning(h, "upload proxy", "upload"),
			hco.RoleRunning(h, "DataImportCron controller", "dataimportcron"),
			hco.WebhookPublished(d.Kube, "DataVolume webhook", false, admission.ValidatingConfigName, admission.DataVolumeValidatorName),
		},
		"SSP": {
			hco.RoleRunning(h, "common templates", "ssp-templates"),
			{What: "common templates", Check: func(context.Context) error { return d.ssp.Health() }},
			hco.RoleRunning(h, "template API", "template-api"),
			{What: "template API", Check: apiServiceAvailable(d, templates.Group, templates.APIVersion)},
			hco.WebhookPublished(d.Kube, "template validator", false, admission.ValidatingConfigName, validator.WebhookName),
		},
		"NetworkAddonsConfig": {
			hco.RoleRunning(h, "MAC pool", "macpool-reconciler"),
			hco.WebhookPublished(d.Kube, "MAC pool webhook", true, admission.MutatingConfigName, macpool.WebhookName),
		},
	}
}

// apiServiceAvailable probes that the aggregator reports the group
// version's APIService Available.
func apiServiceAvailable(d *Deps, group, version string) func(context.Context) error {
	dyn, err := dynamic.NewForConfig(d.RestConfig)
	return func(ctx context.Context) error {
		if err != nil {
			return err
		}
		ok, msg, err := aggregated.APIServiceAvailable(ctx, dyn, group, version)
		switch {
		case err != nil:
			return err
		case !ok:
			return errors.New("APIService " + version + "." + group + " not available: " + msg)
		}
		return nil
	}
}
