"""Cross-checks deploy/ beyond each object's own schema (kubernetes-validate
does that): the ServiceMonitor (a CRD, no schema offline) is checked by
structure, and the objects must fit together — the Service selects the
DaemonSet's pods, the ServiceMonitor selects the Service and names its port,
the port is the one nattrace's --metrics-addr serves. Exit 1 with one line
per problem. PyYAML comes with kubernetes-validate."""
import sys
import yaml

docs = {}
for path in sys.argv[1:]:
    for d in yaml.safe_load_all(open(path)):
        if d:
            docs[d["kind"]] = d

problems = []


def need(cond, what):
    if not cond:
        problems.append(what)


ds, svc, sm = docs.get("DaemonSet"), docs.get("Service"), docs.get("ServiceMonitor")
need(ds and svc and sm, "DaemonSet, Service and ServiceMonitor all present")
if problems:
    sys.exit("\n".join(problems))

pod = ds["spec"]["template"]["spec"]
c = pod["containers"][0]
need(pod.get("hostNetwork") is True, "DaemonSet: hostNetwork")
need(pod.get("hostPID") is True, "DaemonSet: hostPID")
need(c.get("securityContext", {}).get("privileged") is True, "DaemonSet: privileged")
mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
for path in ["/sys/kernel/btf", "/sys/fs/bpf", "/run/netns"]:
    need(mounts.get(path, {}).get("readOnly") is True, f"DaemonSet: {path} mounted read-only")
args = c.get("args", [])
need("--all-services" in args, "DaemonSet: --all-services")
addr = args[args.index("--metrics-addr") + 1] if "--metrics-addr" in args else ""
ports = {p["name"]: p for p in c.get("ports", [])}
need("metrics" in ports, "DaemonSet: a port named metrics")
metrics_port = ports.get("metrics", {}).get("containerPort")
need(addr.endswith(f":{metrics_port}"), f"--metrics-addr {addr!r} serves the metrics port {metrics_port}")
res = c.get("resources", {})
need("memory" in res.get("requests", {}) and "memory" in res.get("limits", {}), "DaemonSet: memory request and limit")

pod_labels = ds["spec"]["template"]["metadata"]["labels"]
need(all(pod_labels.get(k) == v for k, v in svc["spec"]["selector"].items()), "Service selects the DaemonSet's pods")
svc_ports = {p.get("name"): p for p in svc["spec"]["ports"]}
need(svc_ports.get("metrics", {}).get("targetPort") in ("metrics", metrics_port), "Service port metrics targets the pods' metrics port")

need(sm["apiVersion"] == "monitoring.coreos.com/v1", "ServiceMonitor apiVersion monitoring.coreos.com/v1")
spec = sm.get("spec", {})
sel = spec.get("selector", {}).get("matchLabels", {})
need(sel and all(svc["metadata"]["labels"].get(k) == v for k, v in sel.items()), "ServiceMonitor selects the Service by its labels")
names = spec.get("namespaceSelector", {}).get("matchNames", [svc["metadata"]["namespace"]])
need(svc["metadata"]["namespace"] in names, "ServiceMonitor looks in the Service's namespace")
eps = spec.get("endpoints", [])
need(eps and all(e.get("port") in svc_ports for e in eps), "ServiceMonitor endpoints name a port of the Service")
known = {"port", "path", "interval", "scrapeTimeout", "relabelings", "metricRelabelings", "scheme", "honorLabels"}
for e in eps:
    need(set(e) <= known, f"ServiceMonitor endpoint fields {sorted(set(e) - known)} are not ServiceMonitor fields")

if problems:
    sys.exit("\n".join(problems))
print("deploy/: DaemonSet, Service and ServiceMonitor fit together")
