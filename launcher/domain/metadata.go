package domain

import (
	"encoding/xml"
	"errors"
	"fmt"
	"io"
	"strings"

	"libvirt.org/go/libvirtxml"
)

// MetadataNamespace is the XML namespace of nodevirt's element in a domain's
// <metadata>; libvirt keys custom metadata by it.
const MetadataNamespace = "https://github.com/nodevirt/nodevirt/launcher/vmi/v1"

// Metadata ties a domain to the VMI it runs, so that a restarted agent can map
// domains back to VMIs.
type Metadata struct {
	XMLName   xml.Name `xml:"https://github.com/nodevirt/nodevirt/launcher/vmi/v1 vmi"`
	UID       string   `xml:"uid,attr"`
	Namespace string   `xml:"namespace,attr"`
	Name      string   `xml:"name,attr"`
	// MemoryHardLimitKiB is the memory limit of the domain's cgroup
	// (resources.limits.memory plus QEMU's overhead); 0 for none. It is not
	// a <memtune> element because libvirt raises QEMU's RLIMIT_MEMLOCK to a
	// <memtune> hard limit at start, which fails without CAP_SYS_RESOURCE;
	// the launcher applies it to the running domain instead.
	MemoryHardLimitKiB uint64 `xml:"memoryHardLimitKiB,attr,omitempty"`
}

// Name returns the domain name of a VMI, "<namespace>_<name>" as KubeVirt
// names its domains.
func Name(namespace, name string) string { return namespace + "_" + name }

// SplitName is the inverse of Name. ok is false for a name nodevirt did not
// make (no underscore); Kubernetes names never contain one.
func SplitName(domainName string) (namespace, name string, ok bool) {
	return strings.Cut(domainName, "_")
}

// Marshal renders m as the element that goes into <metadata>.
func (m Metadata) Marshal() (string, error) {
	b, err := xml.Marshal(m)
	if err != nil {
		return "", fmt.Errorf("marshal domain metadata: %w", err)
	}
	return string(b), nil
}

// ParseMetadata reads nodevirt's element from a <metadata> block, or the
// element alone as virDomainGetMetadata returns it (libvirt drops the
// namespace there: it selected the element by it). ok is false when the
// element is absent.
func ParseMetadata(innerXML string) (m Metadata, ok bool, err error) {
	dec := xml.NewDecoder(strings.NewReader("<metadata>" + innerXML + "</metadata>"))
	depth := 0
	for {
		tok, err := dec.Token()
		if errors.Is(err, io.EOF) {
			return Metadata{}, false, nil
		}
		if err != nil {
			return Metadata{}, false, fmt.Errorf("parse domain metadata: %w", err)
		}
		switch se := tok.(type) {
		case xml.EndElement:
			depth--
		case xml.StartElement:
			depth++
			if depth != 2 || se.Name.Local != "vmi" || (se.Name.Space != MetadataNamespace && se.Name.Space != "") {
				continue
			}
			var attrs struct {
				UID       string `xml:"uid,attr"`
				Namespace string `xml:"namespace,attr"`
				Name      string `xml:"name,attr"`
				HardLimit uint64 `xml:"memoryHardLimitKiB,attr"`
			}
			if err := dec.DecodeElement(&attrs, &se); err != nil {
				return Metadata{}, false, fmt.Errorf("parse domain metadata: %w", err)
			}
			return Metadata{UID: attrs.UID, Namespace: attrs.Namespace, Name: attrs.Name, MemoryHardLimitKiB: attrs.HardLimit}, true, nil
		}
	}
}

// MetadataOf returns nodevirt's metadata of a parsed domain.
func MetadataOf(d *libvirtxml.Domain) (Metadata, bool, error) {
	if d.Metadata == nil {
		return Metadata{}, false, nil
	}
	return ParseMetadata(d.Metadata.XML)
}
