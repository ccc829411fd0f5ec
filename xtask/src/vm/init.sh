#!/bin/sh
# PID 1 of a vm-test guest: prepare the filesystems the tracer and the lab need,
# load the modules, run the payload, report its status on the console, power off.
# The host looks for the NATTRACE-VM-RESULT line; anything else is just log.
/usr/bin/busybox --install -s /bin
# Programs exec'ing `ip` (iproute2 `ip netns exec`, the test runner) must get
# iproute2's, which is in /usr/sbin; busybox's own has no netns support.
rm -f /bin/ip
export PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /run
# `ip netns add` bind-mounts namespace files here, which needs a writable mount.
mkdir -p /var/run/netns
mount -t tmpfs tmpfs /var/run/netns
mount -t tracefs tracefs /sys/kernel/tracing
mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null
mount -t bpf bpf /sys/fs/bpf
/usr/sbin/ip link set lo up

# The firmware leaves the cursor mid-line; the host looks for this at a line start.
echo
echo "vm: kernel $(uname -r), loading modules"
failed=""
while read -r m; do
    # Some modules refuse to load on this virtual CPU (crc32c-intel wants SSE4.2
    # on some hosts); what the lab really needs is checked by the payload.
    insmod "$m" 2>/tmp/insmod.err || failed="$failed $(basename "$m" .ko)($(cat /tmp/insmod.err))"
done < /etc/modules.order
[ -n "$failed" ] && echo "vm: modules that did not load:$failed"

# Uptimes on the console show where a slow guest spends its time.
echo "vm: running payload at uptime $(cut -d' ' -f1 /proc/uptime)s: $(cat /etc/payload)"
sh -c "$(cat /etc/payload)"
rc=$?
# A leading newline so the marker never shares a line with payload output.
echo
echo "vm: payload done at uptime $(cut -d' ' -f1 /proc/uptime)s"
echo "NATTRACE-VM-RESULT rc=$rc"
sync
poweroff -f
