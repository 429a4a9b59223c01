// Package e2e is nodevirt's end-to-end acceptance suite, modelled on the
// conformance-labelled tests of KubeVirt.
//
// The suite runs the product as a user would get it: its TestMain builds the
// real binaries, starts a private control plane (etcd, kube-apiserver,
// kube-controller-manager) in a temporary directory, uses the host's
// libvirtd (starting one as launcher/libvirttest does when none runs), runs
// clusterbrain and nodeagent as processes with their logs captured, creates
// the HyperConverged CR with emulation and waits until the node is Ready and
// the HyperConverged Available. Tests then drive VirtualMachines and
// VirtualMachineInstances through the Kubernetes API only, and look at the
// host (libvirt domains, QEMU processes, serial logs) the way an
// administrator would, to check what the API says.
//
// Everything the suite makes carries its run id: namespaces
// "e2e-<run>-...", domains "<namespace>_<name>", bridges "nve2e<run><n>".
// Teardown removes exactly those, plus mounts and loop devices under the
// run's temporary directory, so the machine is left as it was found.
//
// A component that is missing makes the tests that need it fail with a
// message naming it; nothing is skipped.
//
//	go test ./test/e2e/ -v                  # the whole suite
//	go test ./test/e2e/ -v -run TestVMI     # a part of it
package e2e
