#!/bin/sh
# First half of the default vm-test payload (vm-guest, the scenario runner, is
# the second): proves, on this guest kernel, each thing the scenarios rely on,
# so a failing scenario can be told from a guest that lacks a feature.
# Exit status = number of failures.
fails=0
check() {
    desc=$1
    shift
    if "$@" >/tmp/check.out 2>&1; then
        echo "smoke: ok   $desc"
    else
        echo "smoke: FAIL $desc"
        sed 's/^/smoke:      /' /tmp/check.out
        fails=$((fails + 1))
    fi
}
# busybox sh runs its own applets before searching PATH, and its `ip` knows no
# netns: iproute2 is called by full path, also inside `sh -c`.
in_ns() { ns=$1; shift; /usr/sbin/ip netns exec "$ns" "$@"; }

echo "smoke: kernel $(uname -r)"
check "kprobe PMU (/sys/bus/event_source/devices/kprobe/type)" \
    test -r /sys/bus/event_source/devices/kprobe/type
check "vmlinux BTF" test -r /sys/kernel/btf/vmlinux
check "nf_nat module BTF" test -r /sys/kernel/btf/nf_nat
check "bridge module BTF" test -r /sys/kernel/btf/bridge
check "kprobe targets in kallsyms" \
    sh -c 'grep -qw nf_nat_manip_pkt /proc/kallsyms && grep -qw br_forward /proc/kallsyms && grep -qw nf_hook_slow /proc/kallsyms'
check "tracefs mounted" test -r /sys/kernel/tracing/available_events
check "bpffs mounted" grep -q ' /sys/fs/bpf bpf ' /proc/mounts

# A kube-proxy-style node: bridge cni0 in netns "node", pods pa/pb on it, a
# Service IP DNATed to pb. The reply from pb is bridged straight back to pa, so
# only br_netfilter's reverse NAT makes the connection work.
check "netns add" sh -c '/usr/sbin/ip netns add node && /usr/sbin/ip netns add pa && /usr/sbin/ip netns add pb'
check "bridge" sh -c '/usr/sbin/ip -n node link add cni0 type bridge &&
    /usr/sbin/ip -n node addr add 10.99.0.1/24 dev cni0 && /usr/sbin/ip -n node link set cni0 up && /usr/sbin/ip -n node link set lo up'
n=2
for p in pa pb; do
    check "veth $p" sh -c "/usr/sbin/ip -n node link add veth-$p type veth peer name eth0 netns $p &&
        /usr/sbin/ip -n node link set veth-$p master cni0 up &&
        /usr/sbin/ip -n $p addr add 10.99.0.$n/24 dev eth0 && /usr/sbin/ip -n $p link set eth0 up &&
        /usr/sbin/ip -n $p link set lo up && /usr/sbin/ip -n $p route add default via 10.99.0.1"
    n=$((n + 1))
done
check "ip_forward in node" in_ns node sysctl -w net.ipv4.ip_forward=1
check "bridge-nf-call-iptables=1 in node" \
    sh -c 'test "$(/usr/sbin/ip netns exec node cat /proc/sys/net/bridge/bridge-nf-call-iptables)" = 1'
check "iptables (nft) DNAT rule" in_ns node iptables -t nat -A PREROUTING \
    -d 10.96.0.10/32 -p tcp --dport 80 -j DNAT --to-destination 10.99.0.3:8080
check "iptables (nft) MASQUERADE rule" in_ns node iptables -t nat -A POSTROUTING \
    -s 10.99.0.0/24 ! -d 10.99.0.0/24 -j MASQUERADE
check "iptables-legacy nat table" sh -c '/usr/sbin/ip netns exec pa iptables-legacy -t nat -A OUTPUT \
    -d 10.96.0.99/32 -j DNAT --to-destination 10.99.0.3 && /usr/sbin/ip netns exec pa iptables-legacy -t nat -S | grep -q 10.96.0.99'
check "ping pa -> pb across the bridge" in_ns pa ping -c 1 -W 3 10.99.0.3

# timeout: a server that never sees its client must not hang the guest; only
# how long a broken run takes to fail (10 s cut a slowed guest's working
# server off before its file was written, with the guests beside the root tests).
timeout 60 /usr/sbin/ip netns exec pb sh -c 'echo pong | nc -l -p 8080 > /tmp/server.got' &
server=$!
# Until it listens (8080 = 0x1F90, state 0A = LISTEN in /proc/net/tcp), not a
# fixed sleep: an emulated guest on a loaded host can take longer than any.
tries=0
until /usr/sbin/ip netns exec pb grep -q ':1F90 00000000:0000 0A' /proc/net/tcp; do
    tries=$((tries + 1))
    [ "$tries" -ge 500 ] && break
    sleep 0.02 2>/dev/null || sleep 1
done
check "TCP pa -> Service 10.96.0.10:80 -> pb:8080 (DNAT + reverse NAT)" \
    sh -c 'echo ping | /usr/sbin/ip netns exec pa nc -w 3 10.96.0.10 80 | grep -q pong'
wait $server
check "server got the request" grep -q ping /tmp/server.got
check "conntrack shows the DNAT" sh -c '/usr/sbin/ip netns exec node conntrack -L -p tcp --orig-dst 10.96.0.10 2>/dev/null |
    grep -q "src=10.99.0.3 dst=10.99.0.2"'

if [ -x /bin/nattrace ]; then
    # The CLI is still being written: report, but don't judge, its --version.
    out=$(nattrace --version 2>&1)
    echo "smoke: info nattrace --version -> rc=$? output: $out"
else
    echo "smoke: FAIL /bin/nattrace missing from the initramfs"
    fails=$((fails + 1))
fi

echo "smoke: $fails failure(s)"
exit "$fails"
