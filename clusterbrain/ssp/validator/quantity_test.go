package validator

import "k8s.io/apimachinery/pkg/api/resource"

func mustQuantity(s string) resource.Quantity { return resource.MustParse(s) }

// collect keeps the API server's warnings.
type collect struct{ msgs []string }

func (c *collect) HandleWarningHeader(_ int, _ string, msg string) { c.msgs = append(c.msgs, msg) }
