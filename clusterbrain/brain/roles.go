package brain

// everyBrainRoles run on every brain replica: they serve requests
// (admission webhooks, aggregated APIs, downloads) and hold no exclusive state.
var everyBrainRoles = []RoleFactory{}

// leaderRoles run only on the elected brain: controllers that write.
var leaderRoles = []RoleFactory{}
