# guests.sh: the checks of vagrant/test that run guests inside the node VMs
# (sourced by it: on, now, node_ready_after, ssh_config, IMAGE_URL, NODES,
# GUEST_WAIT, MIGRATION_TIMEOUT_PER_GIB come from there). Guest guest-nodeI runs on nodeI in namespace
# lab with 10.233.0.(10+I) on br-lab and pings the guest of the next node,
# again and again: after the first answer (LAB-PING-OK) every ping writes a
# numbered line, LAB-PING-OK or LAB-PING-LOST, each with the guest's boot id,
# so a later boot is told apart and a guest is seen to run on (a migration).

# create_guests (on control) URL NODES: the namespace, a cnv-bridge
# NetworkAttachmentDefinition on br-lab and a VM per node whose disk is
# imported from URL.
create_guests='
set -e
url=$1 nodes=$2
kubectl create namespace lab --dry-run=client -o yaml | kubectl apply -f -
kubectl apply -f - <<NAD
apiVersion: k8s.cni.cncf.io/v1
kind: NetworkAttachmentDefinition
metadata:
  name: lab-bridge
  namespace: lab
  annotations:
    k8s.v1.cni.cncf.io/resourceName: bridge.network.kubevirt.io/br-lab
spec:
  config: "{\"cniVersion\": \"0.3.1\", \"name\": \"lab-bridge\", \"type\": \"cnv-bridge\", \"bridge\": \"br-lab\", \"macspoofchk\": true}"
NAD
for i in $(seq "$nodes"); do
	peer=10.233.0.$((10 + i % nodes + 1))
	# guest-node1 is live-migrated (migrate_guest): preferred on node1,
	# not bound to it.
	place="nodeSelector: {kubernetes.io/hostname: node$i}"
	[ "$i" != 1 ] || place="affinity: {nodeAffinity: {preferredDuringSchedulingIgnoredDuringExecution: [{weight: 100, preference: {matchExpressions: [{key: kubernetes.io/hostname, operator: In, values: [node1]}]}}]}}"
	kubectl apply -f - <<VM
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata:
  name: guest-node$i
  namespace: lab
spec:
  runStrategy: Always
  dataVolumeTemplates:
  - metadata:
      name: guest-node$i-disk
    spec:
      source:
        http:
          url: $url
      storage:
        storageClassName: hostpath-csi
        resources:
          requests:
            storage: 128Mi
  template:
    spec:
      $place
      domain:
        resources:
          requests:
            memory: 128Mi
        devices:
          # The ping result is read from the serial log on the node
          # (the HyperConverged default disables the log).
          logSerialConsole: true
          disks:
          - name: rootdisk
            disk:
              bus: virtio
          - name: cloudinit
            disk:
              bus: virtio
          interfaces:
          - name: lab
            bridge: {}
      networks:
      - name: lab
        multus:
          networkName: lab-bridge
      volumes:
      - name: rootdisk
        dataVolume:
          name: guest-node$i-disk
      - name: cloudinit
        cloudInitNoCloud:
          userData: |
            #!/bin/sh
            # nodevirt.ip=10.233.0.$((10 + i))/24
            (
              n=0 ok= boot=\$(cat /proc/sys/kernel/random/boot_id)
              while :; do
                n=\$((n + 1))
                if ping -c 1 -W 2 $peer >/dev/null 2>&1; then
                  echo "LAB-PING-OK $peer seq=\$n boot=\$boot"; ok=1
                elif [ -n "\$ok" ]; then
                  echo "LAB-PING-LOST $peer seq=\$n boot=\$boot"
                elif [ \$n -ge 1200 ]; then
                  echo "LAB-PING-FAILED $peer seq=\$n boot=\$boot"; exit 1
                fi
                sleep 2
              done
            ) &
VM
done'

# wait_vmis (on control) NODES SECONDS [VM OLDUID]: every guest-nodeI's VMI
# Running on nodeI (VM's a new one, not OLDUID), printing progress as it
# changes; fails after SECONDS.
wait_vmis='
nodes=$1 bound=$2 renewed=${3:-} old=${4:-}
end=$((SECONDS + bound)) last=
while :; do
	ok=1 line=
	for i in $(seq "$nodes"); do
		vm=guest-node$i
		dv=$(kubectl get dv -n lab $vm-disk -o jsonpath="{.status.phase} {.status.progress}" 2>/dev/null)
		vmi=$(kubectl get vmi -n lab $vm -o jsonpath="{.metadata.uid} {.status.phase} {.status.nodeName}" 2>/dev/null)
		st=$(kubectl get vm -n lab $vm -o jsonpath="{.status.printableStatus}" 2>/dev/null)
		line+="$vm: dv ${dv:-none}, vm ${st:-none}, vmi ${vmi#* }; "
		set -- $vmi
		[ "${2:-}" = Running ] && [ "${3:-}" = node$i ] || ok=
		[ "$vm" != "$renewed" ] || [ "${1:-}" != "$old" ] || ok=
	done
	[ "$line" = "$last" ] || { echo "  $(date -u +%T) $line"; last=$line; }
	[ -n "$ok" ] && exit 0
	[ $SECONDS -lt $end ] || { echo "not all guests Running on their nodes after $bound s"; kubectl get events -n lab --sort-by=.lastTimestamp | tail -20; exit 1; }
	sleep 10
done'

# wait_ping (on a node) VM SECONDS [OLDBOOT]: the guest's ping result from
# its serial log (libvirt's log file of the domain), of a boot other than
# OLDBOOT; prints the boot id; fails on LAB-PING-FAILED or after SECONDS.
wait_ping='
vm=$1 bound=$2 old=${3:-none}
end=$((SECONDS + bound))
while :; do
	log=$(virsh -c qemu:///system dumpxml "lab_$vm" 2>/dev/null | sed -n "s/.*<log file=.\([^\"'\'']*\).*/\1/p" | head -1)
	if [ -n "$log" ] && [ -r "$log" ]; then
		# -o: the shell prompt and terminal queries may share the line.
		res=$(grep -a -o -E "LAB-PING-(OK|FAILED) [0-9.]+ seq=[0-9]+ boot=[0-9a-f-]+" "$log" | grep -v "boot=$old\$" | tail -1)
		case $res in
		LAB-PING-OK*) echo "$(hostname) $vm: $res" >&2; echo "${res##*boot=}"; exit 0 ;;
		LAB-PING-FAILED*) echo "$(hostname) $vm: $res" >&2; tail -30 "$log" >&2; exit 1 ;;
		esac
	fi
	[ $SECONDS -lt $end ] || { echo "$(hostname) $vm: no ping result after $bound s (log ${log:-none})" >&2; [ -z "$log" ] || tail -30 "$log" >&2; exit 1; }
	sleep 10
done'

# pings_after (on a node) VM BOOT SEQ SECONDS: waits for a LAB-PING-OK of
# boot BOOT numbered past SEQ in the guest's serial log; prints the highest
# number logged and how many pings past SEQ were lost. SEQ -1: any answer.
pings_after='
vm=$1 boot=$2 seq=$3 bound=$4
end=$((SECONDS + bound))
while :; do
	log=$(virsh -c qemu:///system dumpxml "lab_$vm" 2>/dev/null | sed -n "s/.*<log file=.\([^\"'\'']*\).*/\1/p" | head -1)
	if [ -n "$log" ] && [ -r "$log" ]; then
		last=$seq lost=0 ok=
		while read -r res n; do
			[ "$n" -gt "$seq" ] || continue
			[ "$n" -le "$last" ] || last=$n
			case $res in OK) ok=1 ;; LOST) lost=$((lost + 1)) ;; esac
		done < <(grep -a -o -E "LAB-PING-(OK|LOST) [0-9.]+ seq=[0-9]+ boot=$boot" "$log" | sed -E "s/LAB-PING-([A-Z]+) .* seq=([0-9]+) .*/\1 \2/")
		[ -z "$ok" ] || { echo "$last $lost"; exit 0; }
	fi
	[ $SECONDS -lt $end ] || { echo "$(hostname) $vm: no ping of boot $boot past $seq after $bound s (log ${log:-none})" >&2; [ -z "$log" ] || tail -20 "$log" >&2; exit 1; }
	sleep 5
done'

vmi_uid() { on control 'kubectl get vmi -n lab "$1" -o jsonpath="{.metadata.uid}"' "$1"; }
# qemu_pid NODE VM: the PID of the guest's QEMU on its node.
qemu_pid() { on "$1" 'cat "/run/libvirt/qemu/lab_$1.pid"' "$2"; }

declare -A BOOT # guest → boot id of its last ping across

# guests_up: a VM on each node, from the imported disk, each pinging the next
# node's guest over br-lab.
guests_up() {
	local i
	on control "$create_guests" "$IMAGE_URL" "$NODES"
	on control "$wait_vmis" "$NODES" "$GUEST_WAIT"
	for i in $(seq "$NODES"); do
		BOOT[guest-node$i]=$(on "node$i" "$wait_ping" "guest-node$i" "$GUEST_WAIT")
	done
}

# restart_agent NODE: systemd restarts the agent (Type=notify: back when
# READY), which heartbeats again; its guest runs on, the same QEMU process
# (KillMode=process).
restart_agent() {
	local uid pid since
	uid=$(vmi_uid "guest-$1") pid=$(qemu_pid "$1" "guest-$1") since=$(now)
	on "$1" 'systemctl restart nodevirt-nodeagent.service'
	node_ready_after "$1" "$since"
	[ "$(vmi_uid "guest-$1")" = "$uid" ] || { echo "guest-$1 has a new VMI after an agent restart"; return 1; }
	[ "$(qemu_pid "$1" "guest-$1")" = "$pid" ] || { echo "guest-$1's QEMU is not process $pid any more"; return 1; }
	on control "$wait_vmis" "$NODES" 120 >/dev/null
	echo "guest-$1: same VMI $uid and QEMU process $pid across the agent restart"
}

# reboot_node NODE: the node VM reboots (vagrant reload: shutdown, QEMU
# restarted, boot); systemd starts the agent at boot and it heartbeats again.
# Away far past the fencing window + margin (40 s), the node's guest's VMI is
# failed NodeUnreachable and the VM (node-local disk) runs again on that node
# once it is back, a fresh boot that pings across; a stale domain is not kept;
# the other nodes' guests are untouched.
reboot_node() {
	local vm=guest-$1 uid since start away i
	declare -A others
	uid=$(vmi_uid "$vm")
	for i in $(seq "$NODES"); do [ "node$i" = "$1" ] || others[guest-node$i]=$(vmi_uid "guest-node$i"); done
	since=$(now) start=$SECONDS
	vagrant reload "$1"
	ssh_config
	node_ready_after "$1" "$since"
	away=$((SECONDS - start))
	echo "$1 away and back Ready in $away s"
	on control "$wait_vmis" "$NODES" "$GUEST_WAIT" "$vm" "$uid"
	if [ "$away" -gt 90 ]; then
		on control '
			kubectl get events -n lab --field-selector "involvedObject.name=$1,reason=NodeUnreachable" --no-headers | grep . ||
				{ echo "no NodeUnreachable event on VM $1"; kubectl get events -n lab; exit 1; }' "$vm"
	fi
	on "$1" '
		doms=$(virsh -c qemu:///system list --all --name | grep "^lab_" || true)
		echo "$(hostname) domains: " $doms
		[ "$doms" = "lab_$1" ] || { echo "want exactly lab_$1"; exit 1; }
		[ "$(virsh -c qemu:///system domstate "lab_$1")" = running ]' "$vm"
	BOOT[$vm]=$(on "$1" "$wait_ping" "$vm" "$GUEST_WAIT" "${BOOT[$vm]}")
	for i in "${!others[@]}"; do
		[ "$(vmi_uid "$i")" = "${others[$i]}" ] || { echo "$i got a new VMI while $1 rebooted"; return 1; }
	done
	echo "${!others[*]}: same VMIs throughout"
}

# qemu_rss: each lab VM's QEMU on the host: resident size, its memory and the
# TCG translation cache it runs with (tb-size; QEMU's default is 1 GiB). A VM
# whose definition has a tb-cache and that started after it was set must run
# with it.
qemu_rss() {
	local dom pid rss mem tb want
	for dom in $(virsh -c qemu:///system list --name | grep '^vagrant_'); do
		pid=$(cat "/run/libvirt/qemu/$dom.pid")
		rss=$(awk '/^VmRSS/ {print int($2 / 1024)}' "/proc/$pid/status")
		mem=$(virsh -c qemu:///system dominfo "$dom" | awk '/^Max memory/ {print int($3 / 1024)}')
		tb=$(tr '\0' '\n' <"/proc/$pid/cmdline" | sed -n 's/.*tb-size=\([0-9]*\).*/\1/p')
		want=$(virsh -c qemu:///system dumpxml --inactive "$dom" | sed -n "s/.*<tb-cache unit='MiB'>\([0-9]*\)<.*/\1/p")
		want=${want:-$(virsh -c qemu:///system dumpxml --inactive "$dom" | sed -n "s/.*<tb-cache unit='KiB'>\([0-9]*\)<.*/\1/p" | awk '{print int($1 / 1024)}')}
		printf '  %-16s QEMU %6s: RSS %5d MiB, memory %5d MiB, tb-size %s MiB (defined: %s)\n' \
			"$dom" "$pid" "$rss" "$mem" "${tb:-default 1024}" "${want:-none}"
		if [ -n "$want" ] && [ -z "$tb" ] && [ $(($(date +%s) - $(ps -o etimes= -p "$pid"))) -gt "$(stat -c %Y "/etc/libvirt/qemu/$dom.xml")" ]; then
			echo "  $dom started after its tb-cache was defined but runs without it"
			return 1
		fi
	done
}

# migrate_guest: guest-node1 (node-local disk, bridged on br-lab) live-migrated
# from node1 to node2 with a VirtualMachineInstanceMigration as upstream
# virtctl migrate makes it: the migration Succeeded with the completion timeout
# the HyperConverged asks for (MIGRATION_TIMEOUT_PER_GIB: TCG inside TCG is
# slow), the same VMI on node2, its QEMU running there and no domain of it
# left on node1; the guest was not rebooted and its pings go on from node2,
# and guest-nodeNODES, which pings it, gets answers after the switchover.
# Prints the migration's time and libvirt's downtime.
migrate_guest() {
	local vm=guest-node1 src=node1 dst=node2 peer=guest-node$NODES uid name self peer_seq mark st lost
	uid=$(vmi_uid "$vm")
	on control '
		set -e
		kubectl patch hyperconverged -n kubevirt-hyperconverged kubevirt-hyperconverged --type merge \
			-p "{\"spec\":{\"liveMigrationConfig\":{\"completionTimeoutPerGiB\":$1}}}"
		for i in $(seq 120); do
			[ "$(kubectl get kubevirt -A -o jsonpath="{.items[0].spec.configuration.migrations.completionTimeoutPerGiB}")" = "$1" ] && exit 0
			sleep 5
		done; echo "the KubeVirt CR never got completionTimeoutPerGiB $1"; exit 1' "$MIGRATION_TIMEOUT_PER_GIB"
	[ "$(on control 'kubectl get vmi -n lab "$1" -o jsonpath="{.status.nodeName}"' "$vm")" = "$src" ] ||
		{ echo "$vm does not run on $src"; return 1; }
	self=$(on "$src" "$pings_after" "$vm" "${BOOT[$vm]}" -1 "$GUEST_WAIT")
	peer_seq=$(on "node$NODES" "$pings_after" "$peer" "${BOOT[$peer]}" -1 "$GUEST_WAIT")
	echo "before: $vm on $src pinged up to #${self% *}, $peer up to #${peer_seq% *}"
	name=kubevirt-migrate-vm-$(tr -dc a-z0-9 </dev/urandom | head -c 5)
	on control '
		set -e
		vm=$1 name=$2 bound=$3 want=$4
		kubectl apply -f - <<VMIM
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstanceMigration
metadata:
  name: $name
  namespace: lab
spec:
  vmiName: $vm
VMIM
		end=$((SECONDS + bound)) last=
		while :; do
			phase=$(kubectl get vmim -n lab "$name" -o jsonpath="{.status.phase}" 2>/dev/null || true)
			[ "$phase" = "$last" ] || { echo "  $(date -u +%T) $name: ${phase:-no phase yet}"; last=$phase; }
			case $phase in
			Succeeded) break ;;
			Failed) kubectl get vmim -n lab "$name" -o jsonpath="{.status.migrationState.failureReason}{\"\n\"}"
				kubectl get events -n lab --sort-by=.lastTimestamp | tail -20; exit 1 ;;
			esac
			[ $SECONDS -lt $end ] || { echo "$name not Succeeded after $bound s"; kubectl get vmim -n lab "$name" -o yaml; exit 1; }
			sleep 5
		done
		read -r from to start stop perGiB <<<"$(kubectl get vmim -n lab "$name" -o jsonpath="{.status.migrationState.sourceNode} {.status.migrationState.targetNode} {.status.migrationState.startTimestamp} {.status.migrationState.endTimestamp} {.status.migrationState.migrationConfiguration.completionTimeoutPerGiB}")"
		echo "$name: $from -> $to, $(($(date -d "$stop" +%s) - $(date -d "$start" +%s))) s from start to end ($start .. $stop), completionTimeoutPerGiB $perGiB"
		[ "$perGiB" = "$want" ] || { echo "the migration ran with completionTimeoutPerGiB ${perGiB:-none}, not $want"; exit 1; }
		kubectl get events -n lab --field-selector "involvedObject.name=$vm,reason=Migrated" -o jsonpath="{range .items[*]}{.message}{\"\n\"}{end}"' \
		"$vm" "$name" "$GUEST_WAIT" "$MIGRATION_TIMEOUT_PER_GIB"
	# The brain moves the VMI before it marks the migration Succeeded.
	st=$(on control 'kubectl get vmi -n lab "$1" -o jsonpath="{.metadata.uid} {.status.nodeName} completed={.status.migrationState.completed} failed={.status.migrationState.failed}"' "$vm")
	[ "$st" = "$uid $dst completed=true failed=" ] || { echo "$vm after the migration: \"$st\", want \"$uid $dst completed=true failed=\""; return 1; }
	echo "$vm: the same VMI $uid, on $dst"
	on "$dst" '
		pid=$(cat "/run/libvirt/qemu/lab_$1.pid") && kill -0 "$pid" || { echo "$(hostname): no QEMU of lab_$1"; exit 1; }
		[ "$(virsh -c qemu:///system domstate "lab_$1")" = running ] || { echo "$(hostname): lab_$1 not running"; exit 1; }
		echo "$(hostname): lab_$1 running, QEMU $pid"' "$vm"
	on "$src" '
		end=$((SECONDS + $2))
		while virsh -c qemu:///system list --all --name | grep -qx "lab_$1" && [ $SECONDS -lt $end ]; do
			sleep 5
		done
		if virsh -c qemu:///system list --all --name | grep -qx "lab_$1"; then
			echo "$(hostname): lab_$1 is still there"; virsh -c qemu:///system list --all; exit 1
		fi
		[ ! -e "/run/libvirt/qemu/lab_$1.pid" ] || { echo "$(hostname): a QEMU pid file of lab_$1 is left"; exit 1; }
		journalctl -u nodevirt-nodeagent.service --no-pager -o cat | grep -F "$1" | grep -F downtime | tail -1
		echo "$(hostname): no domain of $1 left"' "$vm" "$GUEST_WAIT"
	st=$(on "$dst" "$pings_after" "$vm" "${BOOT[$vm]}" "${self% *}" "$GUEST_WAIT")
	echo "$vm pings on from $dst, same boot ${BOOT[$vm]}: up to #${st% *}, ${st#* } lost since #${self% *}"
	# The peer's pings numbered past the ones logged once the migration
	# ended are answered by the guest on node2.
	mark=$(on "node$NODES" "$pings_after" "$peer" "${BOOT[$peer]}" -1 "$GUEST_WAIT")
	st=$(on "node$NODES" "$pings_after" "$peer" "${BOOT[$peer]}" "${mark% *}" "$GUEST_WAIT")
	lost=$(on "node$NODES" "$pings_after" "$peer" "${BOOT[$peer]}" "${peer_seq% *}" 0)
	echo "$peer answered by $vm on $dst (#${st% *}); ${lost#* } of its pings #$((${peer_seq% *} + 1))..#${lost% *} lost, the migration within them"
}
