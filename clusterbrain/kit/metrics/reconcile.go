package metrics

// reconciles counts the reconciles of the brain's controllers.
var reconciles = Default().Counter("nodevirt_reconcile_total",
	"Reconciles of the brain's controllers, by controller and result.", "controller", "result")

// Reconciled counts one reconcile of controller in the default registry,
// as "ok" or "error" by err.
func Reconciled(controller string, err error) {
	result := "ok"
	if err != nil {
		result = "error"
	}
	reconciles.With(controller, result).Inc()
}
