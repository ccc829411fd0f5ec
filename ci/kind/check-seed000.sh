#!/usr/bin/env bash
# Seed 000 on a real node: nattrace must call a healthy same-node Service
# connection `ok` (exit 0), and with net.bridge.bridge-nf-call-iptables=0 on
# the node every connection `reply_not_reverse_nated` with cause
# `bridge_nf_call_iptables_off` (exit 1); with NODEPORT, the same Service
# entered from outside the node by its NodePort is `ok` with both NATs.
#
# One script, two callers: the kind workflow (.github/workflows/kind.yml,
# node reached with `docker exec`) and `.ci/run` (tests/tests/kind_check.rs,
# the lab's node namespace reached with `ip netns exec`), so the checking
# logic runs on every commit although kind cannot run on the build machines.
#
# Environment (all required unless a default is shown):
#   NODE_EXEC    command prefix that runs a command on the node, word-split:
#                "docker exec kind-control-plane", "ip netns exec <node-ns>"
#   CLIENT_EXEC  command prefix that runs a command in the client pod:
#                "kubectl exec client --", "ip netns exec <client-ns>"
#   SVC          the Service as IP:PORT (its cluster IP)
#   CLIENT_IP    the client pod's IP; BACKEND_IP the backend pod's (same node)
#   NATTRACE     nattrace's path as the node sees it
#   DATAPATH     bridge (default): pods on a Linux bridge, the broken step
#                must give seed 000; routed: pods on point-to-point veths
#                (kindnet, Calico), where the sysctl has nothing to act on and
#                the broken step must stay `ok` (no bridge cause may fire)
#   CONNECTIONS  connections per step (default 3)
#   TRACE_SECS   nattrace --duration (default 10)
#   CURL_MAX_TIME  curl --max-time in seconds (default 3)
#   WORKDIR      where outputs are kept (default: a new temporary directory)
#   NODEPORT     optional, NODE_IP:NODE_PORT of the same Service (type
#                NodePort, externalTrafficPolicy Cluster): a last step curls
#                it from outside the node and must see every flow `ok` with
#                the backend BACKEND_IP (issue 24: north-south traffic)
#   OUTSIDE_EXEC command prefix for that outside client (default: none, this
#                machine: the kind runner is outside its node container)
#   OUTSIDE_IP   the outside client's address, checked in the flows when set
#
# Exit: 0 every assertion held; 1 one failed (each failure is one line on
# stderr starting with FAIL, after nattrace's output); 2 bad environment.
set -euo pipefail

SYSCTL=/proc/sys/net/bridge/bridge-nf-call-iptables
ATTACH_TIMEOUT=60

say() { printf 'check-seed000 [%3ss]: %s\n' "$SECONDS" "$*" >&2; }
die_usage() { say "$*"; exit 2; }

for var in NODE_EXEC CLIENT_EXEC SVC CLIENT_IP BACKEND_IP NATTRACE; do
    # An empty NODE_EXEC would run the sysctl write on this machine itself.
    [ -n "${!var:-}" ] || die_usage "$var is not set (see the header of $0)"
done
DATAPATH=${DATAPATH:-bridge}
CONNECTIONS=${CONNECTIONS:-3}
TRACE_SECS=${TRACE_SECS:-10}
CURL_MAX_TIME=${CURL_MAX_TIME:-3}
case $DATAPATH in bridge | routed) ;; *) die_usage "DATAPATH must be bridge or routed, not '$DATAPATH'" ;; esac
for var in CONNECTIONS TRACE_SECS CURL_MAX_TIME; do
    case ${!var} in '' | *[!0-9]* | 0) die_usage "$var must be a positive whole number" ;; esac
done
command -v jq >/dev/null || die_usage "jq is needed (apt-get install jq)"
WORKDIR=${WORKDIR:-$(mktemp -d)}
mkdir -p "$WORKDIR"

# Word splitting of the two prefixes is what makes them prefixes.
node() {
    # shellcheck disable=SC2086
    $NODE_EXEC "$@"
}
client() {
    # shellcheck disable=SC2086
    $CLIENT_EXEC "$@"
}

outside() {
    # shellcheck disable=SC2086
    ${OUTSIDE_EXEC:-} "$@"
}

FAILURES=0
fail() {
    say "FAIL: $*"
    FAILURES=$((FAILURES + 1))
}

# --- the sysctl, restored whatever happens -----------------------------------

ORIGINAL=
restore_sysctl() {
    if [ -n "$ORIGINAL" ]; then
        node sh -c "echo $ORIGINAL > $SYSCTL" || say "could not restore $SYSCTL to $ORIGINAL"
    fi
}
trap restore_sysctl EXIT

set_sysctl() {
    node sh -c "echo $1 > $SYSCTL"
    local now
    now=$(node cat "$SYSCTL")
    [ "$now" = "$1" ] || { say "$SYSCTL reads $now after writing $1"; exit 1; }
}

# --- one traced step ---------------------------------------------------------

# traced_step DIR [SVC [REQUESTER]]: starts nattrace on the node for SVC
# (default $SVC), waits until it has attached (its first JSON line is
# {"kind":"start"}), makes CONNECTIONS parallel requests to SVC through
# REQUESTER (default: the client pod), and waits for nattrace to stop by
# itself (--duration).
# Leaves $dir/nattrace.{out,err,rc} and $dir/curl.N.{out,rc}.
traced_step() {
    local dir=$1 svc=${2:-$SVC} from=${3:-client} pid i rc
    mkdir -p "$dir"
    node "$NATTRACE" --svc "$svc" --duration "$TRACE_SECS" --output json \
        >"$dir/nattrace.out" 2>"$dir/nattrace.err" &
    pid=$!
    for ((i = 0; i < ATTACH_TIMEOUT * 10; i++)); do
        grep -q '"kind":"start"' "$dir/nattrace.out" 2>/dev/null && break
        if ! kill -0 "$pid" 2>/dev/null; then
            wait "$pid" || true
            say "nattrace exited before attaching:"
            cat "$dir/nattrace.err" >&2
            exit 1
        fi
        sleep 0.1
    done
    grep -q '"kind":"start"' "$dir/nattrace.out" || {
        say "nattrace printed no start line within ${ATTACH_TIMEOUT}s"
        exit 1
    }
    local pids=()
    for ((i = 1; i <= CONNECTIONS; i++)); do
        {
            rc=0
            "$from" curl -sS -o /dev/null -w '%{http_code}' --max-time "$CURL_MAX_TIME" \
                "http://$svc/" >"$dir/curl.$i.out" 2>&1 || rc=$?
            echo "$rc" >"$dir/curl.$i.rc"
        } &
        pids+=("$!")
    done
    for p in "${pids[@]}"; do wait "$p"; done
    rc=0
    wait "$pid" || rc=$?
    echo "$rc" >"$dir/nattrace.rc"
    say "nattrace exited $rc; its output:"
    # Flows without their packet lists: the verdict lines are what a reader needs here.
    jq -c 'if .kind == "flow" then del(.packets, .attempts)
           elif .kind == "start" then {kind, backend, backend_reason, checks_line}
           else . end' "$dir/nattrace.out" >&2 ||
        cat "$dir/nattrace.out" >&2
    sed 's/^/nattrace stderr: /' "$dir/nattrace.err" >&2
}

# --- assertions ----------------------------------------------------------------

# expect_curls DIR ok|fail
expect_curls() {
    local dir=$1 want=$2 i rc out
    for ((i = 1; i <= CONNECTIONS; i++)); do
        rc=$(cat "$dir/curl.$i.rc")
        out=$(cat "$dir/curl.$i.out")
        if [ "$want" = ok ]; then
            if [ "$rc" != 0 ] || [[ $out != 2?? ]]; then
                fail "curl $i: wanted a 2xx answer, got exit $rc: $out"
            fi
        else
            [ "$rc" != 0 ] || fail "curl $i: wanted a failure (seed 000: timeout), got an answer: $out"
        fi
    done
}

# expect_trace DIR EXIT VERDICT CAUSE [SVC [CLIENT_IP]] (CAUSE "-" = none;
# CLIENT_IP "-" = not checked)
expect_trace() {
    local dir=$1 want_rc=$2 verdict=$3 cause=$4 svc=${5:-$SVC} client_ip=${6:-$CLIENT_IP} rc out
    out=$dir/nattrace.out
    rc=$(cat "$dir/nattrace.rc")
    [ "$rc" = "$want_rc" ] || fail "nattrace exited $rc, wanted $want_rc"
    if ! jq -e . "$out" >/dev/null; then
        fail "nattrace's stdout is not JSON lines"
        return
    fi
    local flows summary
    flows=$(jq -s -c '[.[] | select(.kind == "flow")]' "$out")
    summary=$(jq -s -c 'last' "$out")
    [ "$(jq -r .kind <<<"$summary")" = summary ] || fail "the last line is not the summary: $summary"
    local n
    n=$(jq length <<<"$flows")
    [ "$n" = "$CONNECTIONS" ] || fail "$n flows for $CONNECTIONS connections"
    [ "$(jq .lost_events <<<"$summary")" = 0 ] || fail "events were lost: $summary"
    [ "$(jq ".by_verdict.$verdict" <<<"$summary")" = "$CONNECTIONS" ] ||
        fail "summary counts $(jq -c .by_verdict <<<"$summary"), wanted $CONNECTIONS $verdict"
    # Each flow: the verdict, the cause with its explanation and fix, and
    # the pods' addresses (the backend on the client's node, as in seed 000).
    local bad
    bad=$(jq -c --arg v "$verdict" --arg c "$cause" --arg svc "$svc" \
        --arg client "$client_ip" --arg backend "$BACKEND_IP" '
        .[] | select(
            .verdict != $v
            or .service != $svc
            or ($client != "-" and (.client | split(":")[0]) != $client)
            or ((.backend // "") | split(":")[0]) != $backend
            or .incomplete
            or (if $c == "-" then .cause != null
                else .cause != $c or (.cause_text // "") == "" or (.hint // "") == "" end))
        | {verdict, cause, client, service, backend, incomplete, detail}' <<<"$flows")
    [ -z "$bad" ] || fail "flows that are not $verdict (cause $cause) from $client_ip to $BACKEND_IP: $bad"
}

# --- the steps -----------------------------------------------------------------

say "node: $NODE_EXEC; client: $CLIENT_EXEC; Service $SVC; data path $DATAPATH; outputs in $WORKDIR"
node test -x "$NATTRACE" || die_usage "$NATTRACE is not an executable on the node"
if node test -e "$SYSCTL"; then
    ORIGINAL=$(node cat "$SYSCTL")
elif [ "$DATAPATH" = bridge ]; then
    die_usage "$SYSCTL does not exist on the node: load br_netfilter (modprobe br_netfilter) first"
fi
if [ "$DATAPATH" = bridge ] && [ "$ORIGINAL" != 1 ]; then
    die_usage "$SYSCTL is $ORIGINAL on the node: the healthy step needs 1"
fi

say "step 1: healthy — every flow ok, exit 0"
traced_step "$WORKDIR/healthy"
expect_curls "$WORKDIR/healthy" ok
expect_trace "$WORKDIR/healthy" 0 ok -

if [ -z "$ORIGINAL" ]; then
    say "step 2 skipped: no $SYSCTL on this node (br_netfilter not loaded), so there is nothing to turn off"
else
    set_sysctl 0
    if [ "$DATAPATH" = bridge ]; then
        say "step 2: bridge-nf-call-iptables=0 — seed 000: reply_not_reverse_nated, exit 1"
        traced_step "$WORKDIR/broken"
        expect_curls "$WORKDIR/broken" fail
        expect_trace "$WORKDIR/broken" 1 reply_not_reverse_nated bridge_nf_call_iptables_off
    else
        # No bridge: the same-node reply is routed through the node's
        # netfilter hooks and reverse-NATed whatever the sysctl says.
        say "step 2: bridge-nf-call-iptables=0 on a routed node — still ok, exit 0"
        traced_step "$WORKDIR/broken"
        expect_curls "$WORKDIR/broken" ok
        expect_trace "$WORKDIR/broken" 0 ok -
    fi
    restore_sysctl
    ORIGINAL=
fi

if [ -n "${NODEPORT:-}" ]; then
    # Entering from outside: DNAT to the backend and, with the Cluster
    # policy, masquerade to the node's address; both undone on the reply.
    say "step 3: NodePort $NODEPORT from outside the node — every flow ok, exit 0"
    traced_step "$WORKDIR/nodeport" "$NODEPORT" outside
    expect_curls "$WORKDIR/nodeport" ok
    expect_trace "$WORKDIR/nodeport" 0 ok - "$NODEPORT" "${OUTSIDE_IP:--}"
    # Both translations shown: the masquerade as well as the DNAT.
    unsnated=$(jq -c 'select(.kind == "flow" and .snat == null) | {client, service, backend}' \
        "$WORKDIR/nodeport/nattrace.out")
    [ -z "$unsnated" ] || fail "NodePort flows without the Cluster policy's masquerade: $unsnated"
fi

if [ "$FAILURES" -gt 0 ]; then
    say "$FAILURES assertion(s) failed"
    exit 1
fi
say "all assertions held"
