#!/bin/sh
# nodevirt test guest boot script, run once by busybox init (sysinit).
# Marker lines (NODEVIRT-...) are what tests wait for; keep their format.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /run
mount -t tmpfs tmpfs /tmp
hostname nodevirt-guest

# Modules in dependency order, as resolved by the builder.
while read -r ko; do
	[ -n "$ko" ] || continue
	insmod "$ko" || echo "NODEVIRT-MODULE-FAILED ${ko##*/}"
done </etc/nodevirt/modules

# Power button -> poweroff (see /etc/acpi/PWRF/00000080).
acpid -c /etc/acpi -l /run/acpid.log 2>/dev/null || echo "NODEVIRT-ACPID-FAILED"

# Disks behind SCSI/ATA controllers are probed asynchronously: wait until
# the set of block devices stops changing (at most ~3 s).
settle() {
	prev=; same=0; i=0
	while [ $i -lt 15 ]; do
		cur=$(ls /sys/block /sys/class/net | tr '\n' ' ')
		if [ "$cur" = "$prev" ]; then
			same=$((same + 1))
			[ $same -ge 2 ] && return
		else
			same=0; prev=$cur
		fi
		sleep 0.2
		i=$((i + 1))
	done
}
settle

# From here on the console is for tests: keep kernel messages off it.
echo 1 >/proc/sys/kernel/printk

ip link set lo up
for n in /sys/class/net/*; do
	n=${n##*/}
	[ "$n" = lo ] || ip link set "$n" up
done

echo NODEVIRT-GUEST-BOOTED
for n in /sys/class/net/*; do
	n=${n##*/}
	[ "$n" = lo ] || [ ! -e "/sys/class/net/$n" ] || echo "NODEVIRT-NIC $n $(cat /sys/class/net/$n/address)"
done
for b in /sys/block/*; do
	[ -e "$b" ] || continue
	b=${b##*/}
	case $b in loop* | ram* | zram*) continue ;; esac
	echo "NODEVIRT-DISK $b $(($(cat /sys/block/$b/size) * 512))"
done

# A cloud-init seed: ISO9660 with volume id cidata (NoCloud) or config-2
# (config drive).
userdata=
for b in /sys/block/*; do
	[ -e "$b" ] || continue
	b=${b##*/}
	case $b in loop* | ram* | zram*) continue ;; esac
	[ "$(dd if=/dev/$b bs=1 skip=32769 count=5 2>/dev/null)" = CD001 ] || continue
	label=$(dd if=/dev/$b bs=1 skip=32808 count=32 2>/dev/null | tr -d ' ')
	case $label in
	cidata | CIDATA) file=user-data ;;
	config-2 | CONFIG-2) file=openstack/latest/user_data ;;
	*) continue ;;
	esac
	mkdir -p /run/seed
	if mount -t iso9660 -o ro /dev/$b /run/seed; then
		echo "NODEVIRT-SEED $b $label"
		[ -f /run/seed/$file ] && userdata=/run/seed/$file
		break
	fi
done
if [ -n "$userdata" ]; then
	echo NODEVIRT-USERDATA-BEGIN
	cat "$userdata"
	[ -n "$(tail -c 1 "$userdata")" ] && echo
	echo NODEVIRT-USERDATA-END
fi

# Static address: nodevirt.ip=ADDR/PREFIX (and nodevirt.gw=ADDR) on the kernel
# command line or anywhere in user-data; user-data wins.
words="$(cat /proc/cmdline)"
[ -n "$userdata" ] && words="$words $(grep -o 'nodevirt\.[a-z]*=[^ ]*' "$userdata" | tr '\n' ' ')"
ipaddr=; gw=
for w in $words; do
	case $w in
	nodevirt.ip=*) ipaddr=${w#nodevirt.ip=} ;;
	nodevirt.gw=*) gw=${w#nodevirt.gw=} ;;
	esac
done
if [ -n "$ipaddr" ] && [ -e /sys/class/net/eth0 ]; then
	ip addr add "$ipaddr" dev eth0 && echo "NODEVIRT-IP eth0 $ipaddr"
	[ -n "$gw" ] && ip route add default via "$gw"
fi

if [ -n "$userdata" ] && [ "$(head -c 2 "$userdata")" = "#!" ]; then
	cp "$userdata" /run/user-data
	chmod +x /run/user-data
	/run/user-data
	echo "NODEVIRT-USERDATA-EXIT $?"
fi

# The QEMU guest agent (Spec.GuestAgent). Without udev nobody makes the
# /dev/virtio-ports/<name> links: make them from sysfs.
if [ -x /usr/sbin/qemu-ga ]; then
	agentdev=
	for p in /sys/class/virtio-ports/*; do
		[ -e "$p/name" ] || continue
		n=$(cat "$p/name")
		[ -n "$n" ] || continue
		mkdir -p /dev/virtio-ports
		ln -sf "/dev/${p##*/}" "/dev/virtio-ports/$n"
		[ "$n" = org.qemu.guest_agent.0 ] && agentdev=/dev/virtio-ports/$n
	done
	if [ -n "$agentdev" ]; then
		[ -f /etc/nodevirt/utmp ] && cp /etc/nodevirt/utmp /run/utmp
		mkdir -p /run/qemu-ga
		/usr/sbin/qemu-ga -m virtio-serial -p "$agentdev" -t /run/qemu-ga >/run/qemu-ga.log 2>&1 &
		echo "NODEVIRT-AGENT-STARTED $agentdev"
	else
		echo NODEVIRT-AGENT-NO-PORT
	fi
fi

if [ -s /etc/nodevirt/init ]; then
	sh /etc/nodevirt/init
	echo "NODEVIRT-INIT-EXIT $?"
fi

echo NODEVIRT-GUEST-READY
