# nodevirt — see README.md. Every target installs what it needs.
SHELL := /bin/bash
GO ?= go
BIN := $(CURDIR)/bin
LAB := $(CURDIR)/.lab
EMULATION ?= on
# NODES=N (N >= 2) runs the lab's nodes each in namespaces of its own; unset
# keeps the running lab's count (one node when there is none).
NODES ?=
LAB_NODES = $(if $(NODES),--nodes $(NODES))
# KUBELET=1 makes the lab's node a real kubelet with containerd and installs
# nodevirt onto it from `make images` (test/kubelet's machinery).
KUBELET ?=
DEBIAN_PACKAGES := libvirt-daemon-system libvirt-dev qemu-system-x86 qemu-utils etcd-server \
	containernetworking-plugins nftables iptables busybox-static extlinux syslinux-common genisoimage qemu-guest-agent \
	iproute2 ovmf xz-utils zstd curl cpio kmod e2fsprogs util-linux strace libguestfs-tools dropbear-bin openssh-client \
	apparmor
TEST_TIMEOUT ?= 35m

.PHONY: all build install install-units install-controlplane vagrant-deps vagrant-box vagrant-stage vagrant-up vagrant-down vagrant-clean test-vagrant vagrant-test deps controlplane upstream-virtctl lab lab-down demo test unit bench vet fmt clean virtctl-dist fuzz

all: build

# deps installs the Debian packages nodevirt and its tests use (idempotent).
deps:
	@missing=$$(for p in $(DEBIAN_PACKAGES); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q '^install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages: $$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

# The node daemon runs on every node: its resident size follows its binary's.
# grpcnotrace drops gRPC's golang.org/x/net/trace (and with it html/template,
# whose reflection keeps every method of every type in the binary);
# libvirt_without_lxc leaves libvirt-lxc.so unlinked (the agent drives QEMU).
NODEAGENT_BUILDFLAGS := -trimpath -tags grpcnotrace,libvirt_without_lxc

# Every binary's --version (package buildinfo): the toolchain records no
# revision in a git worktree, so the build target stamps it.
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null)
BUILD_REVISION := $(shell git rev-parse HEAD 2>/dev/null)
BUILD_TIME := $(shell git log -1 --format=%cI 2>/dev/null)
STAMP := -X github.com/nodevirt/nodevirt/clusterbrain/kit/daemon/buildinfo.version=$(VERSION) \
	-X github.com/nodevirt/nodevirt/clusterbrain/kit/daemon/buildinfo.revision=$(BUILD_REVISION) \
	-X github.com/nodevirt/nodevirt/clusterbrain/kit/daemon/buildinfo.buildTime=$(BUILD_TIME)

build: deps
	@mkdir -p $(BIN)
	$(GO) build $(NODEAGENT_BUILDFLAGS) -ldflags='-s -w $(STAMP)' -o $(BIN)/ ./nodeagent/cmd/nodeagent
	$(GO) build -ldflags='$(STAMP)' -o $(BIN)/ ./clusterbrain/cmd/... ./test/cmd/nodevirt-lab
	CGO_ENABLED=0 $(GO) build -ldflags='$(STAMP)' -o $(BIN)/ ./cni/cmd/cnv-bridge
	@ln -sf cnv-bridge $(BIN)/nodevirt-bridge
	@mkdir -p $(BIN)/dist && [ -e $(BIN)/dist/virtctl-linux-amd64 ] || ln -sf ../virtctl $(BIN)/dist/virtctl-linux-amd64
	@if [ -d csi/cmd/hostpath-csi-driver ]; then $(GO) build -ldflags='$(STAMP)' -o $(BIN)/ ./csi/cmd/hostpath-csi-driver; fi

# install puts the daemons on PATH, the CNI plugin where runtimes look for it
# (as cnv-bridge and nodevirt-bridge), and the systemd deployment in place
# (see install-units). The control-plane programs come with
# install-controlplane.
PREFIX ?= /usr/local
CNI_BIN_DIR ?= /opt/cni/bin
install: build install-units
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(CNI_BIN_DIR)
	install -m 0755 $(BIN)/nodeagent $(BIN)/clusterbrain $(DESTDIR)$(PREFIX)/bin/
	@if [ -x $(BIN)/virtctl ]; then install -m 0755 $(BIN)/virtctl $(DESTDIR)$(PREFIX)/bin/; fi
	install -d $(DESTDIR)$(PREFIX)/share/nodevirt/virtctl
	@if [ -e $(BIN)/dist/virtctl-linux-amd64 ]; then install -m 0755 $(BIN)/dist/virtctl-linux-amd64 $(DESTDIR)$(PREFIX)/share/nodevirt/virtctl/; fi
	install -m 0755 $(BIN)/cnv-bridge $(DESTDIR)$(CNI_BIN_DIR)/cnv-bridge
	ln -sf cnv-bridge $(DESTDIR)$(CNI_BIN_DIR)/nodevirt-bridge

# install-units installs the systemd units (their /usr/local paths following
# PREFIX), nodevirt-certs (credentials), the documentation the units name,
# and the configuration files they read
# (/etc/nodevirt/*.conf; existing ones are kept, the shipped defaults go
# beside them as *.conf.dist).
UNITDIR ?= /etc/systemd/system
install-units:
	install -d $(DESTDIR)$(UNITDIR) $(DESTDIR)/etc/nodevirt $(DESTDIR)$(PREFIX)/share/doc/nodevirt $(DESTDIR)$(PREFIX)/sbin
	install -m 0755 systemd/nodevirt-certs $(DESTDIR)$(PREFIX)/sbin/nodevirt-certs
	@for u in systemd/*.service; do \
		sed 's|/usr/local/|$(PREFIX)/|g' $$u > $(DESTDIR)$(UNITDIR)/$${u##*/} && chmod 0644 $(DESTDIR)$(UNITDIR)/$${u##*/} || exit 1; \
	done
	install -m 0644 systemd/README.md $(DESTDIR)$(PREFIX)/share/doc/nodevirt/systemd.md
	install -m 0644 README.md $(DESTDIR)$(PREFIX)/share/doc/nodevirt/README.md
	@for c in systemd/conf/*.conf; do \
		f=$(DESTDIR)/etc/nodevirt/$${c##*/}; \
		if [ -e $$f ]; then install -m 0644 $$c $$f.dist; else install -m 0644 $$c $$f; fi || exit 1; \
	done
	@if [ -z "$(DESTDIR)" ] && [ -d /run/systemd/system ]; then systemctl daemon-reload; fi

# install-controlplane installs kube-apiserver and kube-controller-manager
# (built by `make controlplane`) for nodevirt-kube-*.service.
CONTROLPLANE_CACHE ?= /var/cache/nodevirt/controlplane
install-controlplane: controlplane
	install -d $(DESTDIR)$(PREFIX)/bin
	d=$$(ls -td $(CONTROLPLANE_CACHE)/*/ | head -1); \
	install -m 0755 $$d/kube-apiserver $$d/kube-controller-manager $(DESTDIR)$(PREFIX)/bin/

# virtctl-dist cross-builds the CLI for the download service (bin/dist, served
# by the brain at the upstream download paths); `make build` links the host's.
virtctl-dist:
	@for t in linux/amd64 linux/arm64 darwin/amd64 darwin/arm64 windows/amd64; do \
		os=$${t%/*}; arch=$${t#*/}; ext=; [ $$os = windows ] && ext=.exe; \
		CGO_ENABLED=0 GOOS=$$os GOARCH=$$arch $(GO) build -trimpath -ldflags='-s -w' \
			-o $(BIN)/dist/virtctl-$$os-$$arch$$ext ./clusterbrain/cmd/virtctl || exit 1; \
	done

# controlplane builds kube-apiserver and kube-controller-manager once per pin.
controlplane: deps
	$(GO) run ./test/cmd/nodevirt-lab build-controlplane

# upstream-virtctl builds KubeVirt's own virtctl (test/tools/virtctl pins the
# release) once per pin, for the compatibility tests and for trying the lab.
upstream-virtctl:
	$(GO) run ./test/cmd/nodevirt-lab build-upstream-virtctl

lab: build $(if $(KUBELET),images kubelet-packages)
	$(BIN)/nodevirt-lab up --dir $(LAB) --bin $(BIN) --emulation $(EMULATION) $(LAB_NODES) $(if $(KUBELET),--kubelet)

lab-down:
	@if [ -x $(BIN)/nodevirt-lab ]; then $(BIN)/nodevirt-lab down --dir $(LAB); \
	else $(GO) run ./test/cmd/nodevirt-lab down --dir $(LAB); fi

demo: lab
	$(BIN)/nodevirt-lab demo --dir $(LAB) --bin $(BIN)

vet:
	$(GO) vet ./...
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

# test runs every test on real parts: unit and integration tests against a real
# control plane, libvirtd + QEMU (TCG), network namespaces and CSI sockets.
test: deps controlplane upstream-virtctl vet
	$(GO) test -p 2 -timeout $(TEST_TIMEOUT) ./... 2>&1 | tee $(CURDIR)/.test.out; exit $${PIPESTATUS[0]}
	@$(MAKE) -s fuzz FUZZTIME=$(TEST_FUZZTIME)

# fuzz runs every Fuzz target of the module (seed corpora in each package's
# testdata/fuzz) with the coverage-guided fuzzer for FUZZTIME each; `make test`
# runs them briefly, `make fuzz FUZZTIME=10m` for a long run. A crasher is
# written to the package's testdata/fuzz and fails the target.
FUZZTIME ?= 1m
TEST_FUZZTIME ?= 5s
FUZZMINTIME ?= 5s
fuzz:
	@for file in $$(grep -rl --include='*_test.go' --exclude-dir=.lab --exclude-dir=bin '^func Fuzz' . | sort); do \
		pkg=./$$(dirname $${file#./}); \
		for f in $$(sed -n 's/^func \(Fuzz[A-Za-z0-9_]*\)(.*/\1/p' $$file); do \
			echo "fuzz $$pkg $$f ($(FUZZTIME))"; \
			$(GO) test -run '^$$' -fuzz "^$$f\$$" -fuzztime $(FUZZTIME) -fuzzminimizetime $(FUZZMINTIME) $$pkg >/tmp/nodevirt-fuzz.out 2>&1 || { cat /tmp/nodevirt-fuzz.out; exit 1; }; \
		done; \
	done

bench: build
	@mkdir -p $(LAB)
	$(GO) run ./test/bench -out $(LAB)/bench.json

clean:
	rm -rf $(BIN)

# The Vagrant multi-node lab (vagrant/README.md): a control VM and NODES node
# VMs under vagrant-libvirt, nodevirt installed in them through the systemd
# deployment above.
VAGRANT_PACKAGES := vagrant vagrant-libvirt mmdebstrap dnsmasq-base libvirt-daemon-system qemu-system-x86 \
	qemu-utils extlinux syslinux-common e2fsprogs util-linux fdisk openssh-client
VAGRANT_BOX ?= nodevirt/debian12
VAGRANT_STAGE := $(CURDIR)/vagrant/.stage
NODES ?= 2

vagrant-deps:
	@missing=$$(for p in $(VAGRANT_PACKAGES); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q '^install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages: $$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi
	@vagrant/host-prepare

# vagrant-box builds the Debian 12 box from Debian packages and adds it as
# $(VAGRANT_BOX), unless a box of that name is there already (FORCE=1 rebuilds).
vagrant-box: vagrant-deps
	vagrant/box/build --name $(VAGRANT_BOX) --out $(CURDIR)/vagrant/.box $(if $(FORCE),--force)

# vagrant-stage gathers what the VMs install (they have neither Go nor the
# internet): `make install` into a staging root, the control-plane programs
# and kubectl.
vagrant-stage: build install-controlplane
	rm -rf $(VAGRANT_STAGE) && mkdir -p $(VAGRANT_STAGE)
	$(MAKE) --no-print-directory install DESTDIR=$(VAGRANT_STAGE)/root
	$(MAKE) --no-print-directory install-controlplane DESTDIR=$(VAGRANT_STAGE)/root
	install -m 0755 $$(command -v kubectl) $(VAGRANT_STAGE)/root$(PREFIX)/bin/kubectl
	ln -f $(VAGRANT_STAGE)/root$(PREFIX)/share/nodevirt/virtctl/virtctl-linux-amd64 $(VAGRANT_STAGE)/root$(PREFIX)/bin/virtctl
	@# Copies into TCG VMs are slow (SSH): each role gets only what it runs.
	tar -C $(VAGRANT_STAGE)/root -czf $(VAGRANT_STAGE)/control.tar.gz --exclude=.$(PREFIX)/bin/nodeagent --exclude=.$(CNI_BIN_DIR) .
	tar -C $(VAGRANT_STAGE)/root -czf $(VAGRANT_STAGE)/node.tar.gz --exclude=.$(PREFIX)/share/nodevirt \
		$(foreach b,kube-apiserver kube-controller-manager kubectl clusterbrain virtctl,--exclude=.$(PREFIX)/bin/$(b)) .

vagrant-up: vagrant-box vagrant-stage
	cd vagrant && NODES=$(NODES) VAGRANT_BOX=$(VAGRANT_BOX) vagrant up

vagrant-down:
	@if command -v vagrant >/dev/null; then cd vagrant && vagrant destroy -f; fi

# vagrant-clean also removes what vagrant destroy keeps for the next lab: the
# box, its base volume and the storage pool $(VAGRANT_POOL).
VAGRANT_POOL ?= nodevirt-vagrant
vagrant-clean: vagrant-down
	-vagrant box remove --force $(VAGRANT_BOX) 2>/dev/null
	@if virsh -c qemu:///system pool-info $(VAGRANT_POOL) >/dev/null 2>&1; then \
		for v in $$(virsh -c qemu:///system vol-list $(VAGRANT_POOL) | awk 'NR > 2 && $$1 != "" {print $$1}'); do \
			virsh -c qemu:///system vol-delete --pool $(VAGRANT_POOL) $$v >/dev/null; done; \
		virsh -c qemu:///system pool-destroy $(VAGRANT_POOL) >/dev/null; \
		virsh -c qemu:///system pool-undefine $(VAGRANT_POOL) >/dev/null; \
		rmdir /var/lib/libvirt/$(VAGRANT_POOL) 2>/dev/null || true; \
	fi

# test-vagrant brings the lab up from nothing, checks it from inside (a guest
# on each node VM from the smallest test guest's disk, served by the host) and
# destroys it, printing how long each step took.
test-vagrant vagrant-test: vagrant-box vagrant-stage
	image=$$($(GO) run ./test/guest/cmd/nodevirt-guest bootdisk -format qcow2) && \
	GUEST_IMAGE=$$image NODES=$(NODES) VAGRANT_BOX=$(VAGRANT_BOX) vagrant/test

# --- Images and cluster manifests (install on an existing cluster) ----------
# images writes one archive per image into bin/images (ctr -n k8s.io images
# import, docker load, podman load), tagged $(IMAGE_TAG), built from this tree
# without a base image or a registry (clusterbrain/cmd/nodevirt-image), and
# bin/images/nodevirt.yaml: the manifests rendered with those tags.
# nodeagent: the binary plus exactly the programs it runs and every shared
# library they load, copied from this host's Debian packages (`make deps`;
# the image lists each file's package in /usr/share/doc/nodevirt/).
# clusterbrain, cni and virtctl: static binaries only.
IMAGES := $(BIN)/images
IMAGE_REPO ?= localhost/nodevirt
IMAGE_TAG ?= $(subst +,-,$(VERSION))
# Once per make run: archives and manifest must agree even if the tree
# changes meanwhile (VERSION asks git each time it is expanded).
IMAGE_TAG := $(IMAGE_TAG)
VIRTCTL_PLATFORMS ?= linux/amd64
NODEAGENT_IMAGE_TOOLS := nft qemu-img xz mkfs.ext4 e2fsck resize2fs genisoimage unshare mount umount sh mkdir touch readlink dirname ln virt-admin nsenter
NODEVIRT_IMAGE = $(GO) run ./clusterbrain/cmd/nodevirt-image -created $(BUILD_TIME) \
	-label org.opencontainers.image.version=$(IMAGE_TAG) -label org.opencontainers.image.revision=$(BUILD_REVISION)
KUSTOMIZE ?= kubectl kustomize
DEPLOY := clusterbrain/deploy

.PHONY: images manifests manifests-for-images test-kubelet
images: deps
	@rm -rf $(IMAGES) && mkdir -p $(IMAGES)/bin $(IMAGES)/virtctl
	$(GO) build $(NODEAGENT_BUILDFLAGS) -ldflags='-s -w $(STAMP)' -o $(IMAGES)/bin/ ./nodeagent/cmd/nodeagent
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags='-s -w $(STAMP)' -o $(IMAGES)/bin/ ./clusterbrain/cmd/clusterbrain ./cni/cmd/cnv-bridge ./clusterbrain/cmd/nodevirt-copy
	@for t in $(VIRTCTL_PLATFORMS); do os=$${t%/*}; arch=$${t#*/}; ext=; [ $$os = windows ] && ext=.exe; \
		CGO_ENABLED=0 GOOS=$$os GOARCH=$$arch $(GO) build -trimpath -ldflags='-s -w $(STAMP)' \
			-o $(IMAGES)/virtctl/virtctl-$$os-$$arch$$ext ./clusterbrain/cmd/virtctl || exit 1; done
	$(NODEVIRT_IMAGE) -o $(IMAGES)/nodeagent.tar -name $(IMAGE_REPO)/nodeagent:$(IMAGE_TAG) -merged-usr -etc -libs \
		-add $(IMAGES)/bin/nodeagent:/usr/local/bin/nodeagent $(foreach t,$(NODEAGENT_IMAGE_TOOLS),-host $(t)) -host /etc/mke2fs.conf \
		-entrypoint /usr/local/bin/nodeagent
	$(NODEVIRT_IMAGE) -o $(IMAGES)/clusterbrain.tar -name $(IMAGE_REPO)/clusterbrain:$(IMAGE_TAG) -etc \
		-add $(IMAGES)/bin/clusterbrain:/usr/local/bin/clusterbrain -entrypoint /usr/local/bin/clusterbrain
	$(NODEVIRT_IMAGE) -o $(IMAGES)/cni.tar -name $(IMAGE_REPO)/cni:$(IMAGE_TAG) \
		-add $(IMAGES)/bin/cnv-bridge:/cni/cnv-bridge -add $(IMAGES)/bin/cnv-bridge:/cni/nodevirt-bridge \
		-add $(IMAGES)/bin/nodevirt-copy:/usr/local/bin/nodevirt-copy \
		-entrypoint /usr/local/bin/nodevirt-copy -entrypoint -from=/cni -entrypoint -to=/host/opt/cni/bin
	$(NODEVIRT_IMAGE) -o $(IMAGES)/virtctl.tar -name $(IMAGE_REPO)/virtctl:$(IMAGE_TAG) \
		$$(for f in $(IMAGES)/virtctl/*; do echo -add $$f:/virtctl/$${f##*/}; done) \
		-add $(IMAGES)/bin/nodevirt-copy:/usr/local/bin/nodevirt-copy \
		-entrypoint /usr/local/bin/nodevirt-copy -entrypoint -from=/virtctl -entrypoint -to=/share/virtctl
	$(MAKE) --no-print-directory manifests-for-images IMAGE_TAG=$(IMAGE_TAG)
	@ls -l $(IMAGES)/*.tar

# manifests writes the base's RBAC and node restriction files from
# clusterbrain/rbac and renders the kustomize base into the one-file
# $(DEPLOY)/nodevirt.yaml (tags as in the base); clusterbrain/deploy's tests
# fail when any of them disagree.
manifests:
	$(GO) test -count=1 -run TestGenerated ./$(DEPLOY) -update
	$(KUSTOMIZE) $(DEPLOY)/base > $(DEPLOY)/nodevirt.yaml

manifests-for-images:
	@mkdir -p $(IMAGES)/overlay && printf '%s\n' 'apiVersion: kustomize.config.k8s.io/v1beta1' 'kind: Kustomization' \
		'resources: [../../../$(DEPLOY)/base]' 'images:' \
		$(foreach i,nodeagent clusterbrain cni virtctl,'- {name: localhost/nodevirt/$(i), newName: $(IMAGE_REPO)/$(i), newTag: "$(IMAGE_TAG)"}') \
		> $(IMAGES)/overlay/kustomization.yaml
	$(KUSTOMIZE) --load-restrictor LoadRestrictionsNone $(IMAGES)/overlay > $(IMAGES)/nodevirt.yaml

# test-kubelet installs nodevirt on a real kubelet node of a local control
# plane (test/kubelet): containerd and runc from Debian, kubelet and
# kube-scheduler from the control plane's pin, the images above imported,
# bin/images/nodevirt.yaml applied; it undoes what kubelet changed on the
# host. Not part of `make test`; run it alone (it uses the host's libvirtd,
# /var/lib/kubelet and /opt/cni/bin). Its upgrade step applies a newer build:
# images-next is `make images` again with VERSION=<this version>-next into
# bin/images-next.
KUBELET_TEST_PACKAGES := containerd runc
.PHONY: images-next
images-next:
	$(MAKE) --no-print-directory images VERSION=$(VERSION)-next IMAGES=$(BIN)/images-next
.PHONY: kubelet-packages
kubelet-packages:
	@missing=$$(for p in $(KUBELET_TEST_PACKAGES); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q '^install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages: $$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi
test-kubelet: images images-next kubelet-packages
	NODEVIRT_KUBELET=1 $(GO) test -count=1 -timeout 40m -run TestKubeletInstall -v ./test/kubelet
# --- end of images and cluster manifests -------------------------------------
