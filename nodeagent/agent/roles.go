package agent

// nodeRoles are the node agent's jobs, each in its own package.
var nodeRoles = []RoleFactory{
	newCSIRole,
	newProvisionerRole,
	newBridgeMarkerRole,
}
