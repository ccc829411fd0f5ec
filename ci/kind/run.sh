#!/usr/bin/env bash
# The seed 000 check on a kind cluster: creates the cluster for one data path
# and kube-proxy mode, runs the workload, copies the static nattrace into the
# node container and runs ci/kind/check-seed000.sh with the node reached by
# `docker exec`. What .github/workflows/kind.yml runs per matrix entry, and
# how to run it locally (needs docker, kind, kubectl, jq, curl; see README).
#
#   CNI=bridge|kindnet PROXY_MODE=iptables|nftables NATTRACE_BIN=path ci/kind/run.sh
#
# NATTRACE_BIN: the static musl binary (`cargo xtask musl` prints its path).
# KEEP_CLUSTER=1 leaves the cluster up afterwards (default: deleted).
# Exit: the check's status (0 held, 1 failed, 2 bad environment).
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
CLUSTER=nattrace
NODE=$CLUSTER-control-plane
# The reference CNI plugins: kind's node image ships only host-local, ptp,
# portmap and loopback, not `bridge`.
CNI_PLUGINS_VERSION=v1.6.2

say() { printf 'kind-run: %s\n' "$*" >&2; }

CNI=${CNI:-bridge}
PROXY_MODE=${PROXY_MODE:-iptables}
case $CNI in
    bridge) DATAPATH=bridge ;;
    kindnet) DATAPATH=routed ;;
    *) say "CNI must be bridge or kindnet, not '$CNI'"; exit 2 ;;
esac
case $PROXY_MODE in iptables | nftables) ;; *) say "PROXY_MODE must be iptables or nftables"; exit 2 ;; esac
[ -x "${NATTRACE_BIN:-}" ] || { say "NATTRACE_BIN must name the static nattrace (cargo xtask musl)"; exit 2; }
for tool in docker kind kubectl jq curl; do
    command -v "$tool" >/dev/null || { say "$tool is needed"; exit 2; }
done
# br_netfilter is a kernel module, shared by every container: kind cannot
# load it, and without it nothing on the node can reach the sysctl.
[ -e /proc/sys/net/bridge/bridge-nf-call-iptables ] || {
    say "br_netfilter is not loaded on this host: sudo modprobe br_netfilter"
    exit 2
}

# shellcheck disable=SC2317 # run by the EXIT trap
cleanup() {
    if [ "${KEEP_CLUSTER:-0}" = 1 ]; then
        say "cluster $CLUSTER left running (kind delete cluster --name $CLUSTER)"
    else
        kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
    fi
}
trap cleanup EXIT

say "creating cluster: data path $CNI, kube-proxy $PROXY_MODE"
kind create cluster --config "$HERE/cluster-$CNI-$PROXY_MODE.yaml"

install_bridge_cni() {
    local tmp tgz pod_cidr
    tmp=$(mktemp -d)
    tgz=cni-plugins-linux-amd64-$CNI_PLUGINS_VERSION.tgz
    curl -fsSL --retry 3 -o "$tmp/$tgz" \
        "https://github.com/containernetworking/plugins/releases/download/$CNI_PLUGINS_VERSION/$tgz"
    curl -fsSL --retry 3 -o "$tmp/$tgz.sha256" \
        "https://github.com/containernetworking/plugins/releases/download/$CNI_PLUGINS_VERSION/$tgz.sha256"
    (cd "$tmp" && sha256sum -c "$tgz.sha256")
    tar -C "$tmp" -xzf "$tmp/$tgz" ./bridge
    docker cp "$tmp/bridge" "$NODE:/opt/cni/bin/bridge"
    # The controller manager allocates it shortly after the node registers.
    for _ in $(seq 60); do
        pod_cidr=$(kubectl get node "$NODE" -o jsonpath='{.spec.podCIDR}' 2>/dev/null || true)
        [ -n "$pod_cidr" ] && break
        sleep 1
    done
    [ -n "$pod_cidr" ] || { say "node $NODE got no podCIDR"; exit 1; }
    sed "s|@POD_CIDR@|$pod_cidr|" "$HERE/cni-bridge.conflist" >"$tmp/10-bridge.conflist"
    docker cp "$tmp/10-bridge.conflist" "$NODE:/etc/cni/net.d/10-bridge.conflist"
    rm -rf "$tmp"
    say "bridge CNI on $NODE: cni0, pods in $pod_cidr"
}
if [ "$CNI" = bridge ]; then
    install_bridge_cni
fi
kubectl wait --for=condition=Ready "node/$NODE" --timeout=180s

docker cp "$NATTRACE_BIN" "$NODE:/usr/local/bin/nattrace"
kubectl apply -f "$HERE/workload.yaml"
kubectl wait --for=condition=Ready pod/backend pod/client --timeout=300s

SVC_IP=$(kubectl get service web -o jsonpath='{.spec.clusterIP}')
CLIENT_IP=$(kubectl get pod client -o jsonpath='{.status.podIP}')
BACKEND_IP=$(kubectl get pod backend -o jsonpath='{.status.podIP}')
NODE_IP=$(kubectl get node "$NODE" -o jsonpath='{.status.addresses[?(@.type=="InternalIP")].address}')

# kube-proxy programs the Service a moment after the endpoint is ready.
for i in $(seq 60); do
    if kubectl exec client -- curl -sS -o /dev/null --max-time 2 "http://$SVC_IP/" 2>/dev/null; then
        break
    fi
    [ "$i" = 60 ] && { say "the client never reached http://$SVC_IP/"; exit 1; }
    sleep 1
done

if [ "$CNI" = bridge ]; then
    # The premise of the check: the same-node reply crosses a Linux bridge.
    docker exec "$NODE" ip -o link show type bridge | grep -q ' cni0:' ||
        { say "no cni0 bridge on $NODE"; exit 1; }
fi

rc=0
NODE_EXEC="docker exec $NODE" \
    CLIENT_EXEC="kubectl exec client --" \
    SVC="$SVC_IP:80" \
    CLIENT_IP="$CLIENT_IP" \
    BACKEND_IP="$BACKEND_IP" \
    NATTRACE=/usr/local/bin/nattrace \
    DATAPATH="$DATAPATH" \
    NODEPORT="$NODE_IP:30090" \
    WORKDIR="${WORKDIR:-$(mktemp -d)}" \
    "$HERE/check-seed000.sh" || rc=$?
if [ "$rc" != 0 ]; then
    kubectl get pods,services,endpointslices -o wide >&2 || true
    docker exec "$NODE" ip -br addr >&2 || true
fi
exit "$rc"
