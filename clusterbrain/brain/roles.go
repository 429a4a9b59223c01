package brain

import (
	"github.com/nodevirt/nodevirt/clusterbrain/datavolume"
	"github.com/nodevirt/nodevirt/clusterbrain/hco"
	"github.com/nodevirt/nodevirt/clusterbrain/upload"
)

// everyBrainRoles run on every brain replica: they serve requests
// (admission webhooks, aggregated APIs, downloads) and hold no exclusive state.
var everyBrainRoles = []RoleFactory{
	func(d *Deps) (Role, error) {
		return upload.New(upload.Config{Kube: d.Kube, Namespace: d.Config.Namespace, Log: d.Log})
	},
}

// leaderRoles run only on the elected brain: controllers that write.
var leaderRoles = []RoleFactory{
	func(d *Deps) (Role, error) {
		return datavolume.New(datavolume.Config{Kube: d.Kube, Virt: d.Virt, Log: d.Log})
	},
	func(d *Deps) (Role, error) {
		return hco.New(hco.Config{Namespace: d.Config.Namespace, Kube: d.Kube, Virt: d.Virt, Log: d.Log.With("role", "hco"), BrainHealth: d.Health.Ready})
	},
}
