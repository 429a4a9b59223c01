package importer

import (
	"github.com/nodevirt/nodevirt/clusterbrain/kit/reach"
)

// Network reach of an import: an HTTP or registry import connects only
// where the reach policy of package reach (clusterbrain/kit/reach) lets it
// (no loopback, link-local or cloud metadata address, no address of this
// node, unless the request's AllowedNetworks names it; the CDI CR's
// nodevirt.io/import-allowed-networks annotation, see
// importstate.AnnImportAllowedNetworks, read with reach.ParseNetworks). A
// refused connection fails with ReasonNetworkNotAllowed.

// Proxy is the import proxy of the CDI configuration.
type Proxy = reach.Proxy

// forbiddenHeaders are request headers user-given extra headers may not
// set: the request's own framing and routing, what resumption sets, and
// the headers cloud metadata services require (so that a request that
// reaches one anyway is refused by it).
var forbiddenHeaders = map[string]bool{
	"Host": true, "Content-Length": true, "Transfer-Encoding": true, "Connection": true, "Upgrade": true,
	"Te": true, "Trailer": true, "Keep-Alive": true, "Proxy-Authorization": true, "Proxy-Connection": true,
	"Range": true, "If-Range": true,
	"Metadata-Flavor": true, "Metadata": true, "X-Google-Metadata-Request": true,
	"X-Aws-Ec2-Metadata-Token": true, "X-Aws-Ec2-Metadata-Token-Ttl-Seconds": true,
	"X-Forwarded-For": true, "Forwarded": true,
}

// unreachableReason is the reason of a failed request: NetworkNotAllowed
// when the reach policy stopped it, else SourceUnreachable.
func unreachableReason(err error) Reason {
	if reach.IsNotAllowed(err) {
		return ReasonNetworkNotAllowed
	}
	return ReasonSourceUnreachable
}
