package admission

// DefaultsChange exposes defaultVMISpec to the external tests.
var DefaultsChange = defaultVMISpec
