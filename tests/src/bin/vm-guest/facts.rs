//! What the lab configured, read back independently of nattrace, and the
//! checks of nattrace's JSON against it: the fields the probes read from
//! kernel structs, and the backends' agreement.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddrV4;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};
use lab::Lab;
use lab::presets::{
    BACKEND_IP, BACKEND_POD, CLIENT_IP, CLIENT_POD, NODE_A, WEB_PORT, WEB_SERVICE_IP,
};
use serde_json::Value;

/// Lines of a failure's evidence printed; the rest is counted.
const MAX_PROBLEMS: usize = 12;

/// What the lab configured, read back independently of nattrace.
pub struct LabFacts {
    pub node_path: PathBuf,
    pub client_path: PathBuf,
    pub node_ns: u64,
    pub client_ns: u64,
    pub backend_ns: u64,
    /// netns inode → ifindex → interface name.
    pub links: HashMap<u64, HashMap<u64, String>>,
    pub client_eth0: u64,
    /// The node-side veth (cni0 bridge port) of the client and of the backend.
    pub client_port: u64,
    pub backend_port: u64,
}

fn inode(path: &Path) -> anyhow::Result<u64> {
    Ok(std::fs::metadata(path)
        .with_context(|| format!("stat {}", path.display()))?
        .ino())
}

/// `ip -o link` → (ifindex, name, peer ifindex for veths).
fn links(lab: &Lab, target: &str) -> anyhow::Result<Vec<(u64, String, Option<u64>)>> {
    let out = lab.run(target, &["ip", "-o", "link", "show"])?;
    let mut found = Vec::new();
    for line in out.lines() {
        let mut parts = line.split(": ");
        let (Some(index), Some(name)) = (parts.next(), parts.next()) else {
            continue;
        };
        let (name, peer) = match name.split_once("@if") {
            Some((n, p)) => (n, p.parse().ok()),
            None => (name.split('@').next().unwrap_or(name), None),
        };
        found.push((index.trim().parse()?, name.to_string(), peer));
    }
    Ok(found)
}

pub fn lab_facts(lab: &Lab) -> anyhow::Result<LabFacts> {
    let node_path = lab.node_netns(NODE_A)?.path();
    let client_path = lab.netns(CLIENT_POD)?.path();
    let mut facts = LabFacts {
        node_ns: inode(&node_path)?,
        client_ns: inode(&client_path)?,
        backend_ns: inode(&lab.netns(BACKEND_POD)?.path())?,
        node_path,
        client_path,
        links: HashMap::new(),
        client_eth0: 0,
        client_port: 0,
        backend_port: 0,
    };
    for (target, ns) in [
        (NODE_A, facts.node_ns),
        (CLIENT_POD, facts.client_ns),
        (BACKEND_POD, facts.backend_ns),
    ] {
        let list = links(lab, target)?;
        // A pod's eth0 names its peer: the node's bridge port for that pod.
        if let Some((index, _, peer)) = list.iter().find(|(_, n, _)| n == "eth0") {
            match target {
                CLIENT_POD => {
                    facts.client_eth0 = *index;
                    facts.client_port = peer.context("client eth0 has no veth peer")?;
                }
                BACKEND_POD => {
                    facts.backend_port = peer.context("backend eth0 has no veth peer")?
                }
                _ => {}
            }
        }
        facts
            .links
            .insert(ns, list.into_iter().map(|(i, n, _)| (i, n)).collect());
    }
    if facts.client_eth0 == 0 || facts.backend_port == 0 {
        bail!("the pods' eth0 were not found");
    }
    Ok(facts)
}

/// Every hop's netns, ifindex, name and addresses must be the lab's, and the
/// points that prove each struct read must be present.
pub fn check_fields(flows: &[Value], lab: &LabFacts, backend: &str) -> Result<String, String> {
    let mut problems = BTreeSet::new();
    let mut seen = BTreeSet::new();
    let mut hops = 0;
    let known_ips = [CLIENT_IP, WEB_SERVICE_IP, BACKEND_IP];
    let backend_ep = SocketAddrV4::new(BACKEND_IP, WEB_PORT);
    let ns_name = |ns: u64| match ns {
        n if n == lab.node_ns => "node",
        n if n == lab.client_ns => "client pod",
        n if n == lab.backend_ns => "backend pod",
        _ => "?",
    };
    for packet in flows
        .iter()
        .flat_map(|f| f["packets"].as_array().into_iter().flatten())
    {
        let reply = packet["dir"] == "reply";
        for hop in packet["hops"].as_array().into_iter().flatten() {
            hops += 1;
            let hook = hop["hook"].as_str().unwrap_or("?");
            let netns = hop["netns"].as_u64().unwrap_or(0);
            let ifindex = hop["ifindex"].as_u64().unwrap_or(0);
            let addr = |k: &str| hop[k].as_str().and_then(|s| s.parse::<SocketAddrV4>().ok());
            let (Some(src), Some(dst)) = (addr("src"), addr("dst")) else {
                problems.insert(format!(
                    "{hook}: unparsable addresses {} -> {}",
                    hop["src"], hop["dst"]
                ));
                continue;
            };
            let at = format!("{hook} {src} -> {dst}");
            match lab.links.get(&netns) {
                None => {
                    problems.insert(format!(
                        "{hook}: netns inode {netns} is none of the lab's (node {}, client {}, backend {})",
                        lab.node_ns, lab.client_ns, lab.backend_ns
                    ));
                }
                Some(names) if ifindex != 0 => {
                    match (names.get(&ifindex), hop["ifname"].as_str()) {
                        (None, _) => {
                            problems.insert(format!(
                            "{hook}: ifindex {ifindex} does not exist in the {} netns ({names:?})",
                            ns_name(netns)
                        ));
                        }
                        (Some(real), Some(reported)) if real != reported => {
                            problems.insert(format!(
                                "{hook}: ifindex {ifindex} is {real}, reported as {reported}"
                            ));
                        }
                        _ => {}
                    }
                }
                Some(_) => {}
            }
            if !known_ips.contains(src.ip()) || !known_ips.contains(dst.ip()) {
                problems.insert(format!("{at}: an address the lab never used"));
            }
            if src.port() != WEB_PORT && dst.port() != WEB_PORT {
                problems.insert(format!("{at}: neither port is {WEB_PORT}"));
            }
            let node = netns == lab.node_ns;
            let point = match hook {
                "dev-tx" if netns == lab.client_ns && ifindex == lab.client_eth0 && !reply => {
                    Some("dev-tx client eth0 (request)")
                }
                "dev-rx" if netns == lab.client_ns && ifindex == lab.client_eth0 && reply => {
                    Some("dev-rx client eth0 (reply)")
                }
                // A pod veth is left to the device tracepoints (probes/tc.rs).
                "dev-rx" if node && ifindex == lab.client_port && !reply => {
                    Some("dev-rx node client-port (request)")
                }
                "netfilter" if node && hop["nat_stage"] == "after-nat" && dst == backend_ep => {
                    Some("netfilter DNAT to the backend (after-nat)")
                }
                "br-forward" if node && ifindex == lab.client_port && reply => {
                    Some("br-forward to client-port (reply)")
                }
                "br-forward" if node && ifindex == lab.backend_port && !reply => {
                    Some("br-forward to backend-port (request)")
                }
                _ => None,
            };
            seen.extend(point);
        }
    }
    let mut required = vec![
        "dev-tx client eth0 (request)",
        "dev-rx client eth0 (reply)",
        "dev-rx node client-port (request)",
        "netfilter DNAT to the backend (after-nat)",
    ];
    if backend == "kprobe" {
        required.extend([
            "br-forward to client-port (reply)",
            "br-forward to backend-port (request)",
        ]);
    }
    for r in required {
        if !seen.contains(r) {
            problems.insert(format!("no hop at {r}"));
        }
    }
    if problems.is_empty() {
        return Ok(format!(
            "{hops} hops, all in the lab's namespaces and interfaces; seen {}",
            seen.into_iter().collect::<Vec<_>>().join(", ")
        ));
    }
    let total = problems.len();
    let mut lines: Vec<String> = problems.into_iter().take(MAX_PROBLEMS).collect();
    if total > MAX_PROBLEMS {
        lines.push(format!("... and {} more", total - MAX_PROBLEMS));
    }
    lines.push(format!(
        "lab: node netns {} client {} backend {}; client eth0 if{}, node ports client if{} backend if{}; {hops} hops",
        lab.node_ns, lab.client_ns, lab.backend_ns, lab.client_eth0, lab.client_port, lab.backend_port
    ));
    Err(lines.join("\n"))
}

/// A flow without what differs between runs (client port, timestamps).
fn flow_key(f: &Value) -> String {
    let ip = |v: &Value| {
        v.as_str()
            .and_then(|s| s.parse::<SocketAddrV4>().ok())
            .map_or("-".to_string(), |a| a.ip().to_string())
    };
    format!(
        "{} {} cause={} client={} service={} backend={} snat={}",
        f["verdict"].as_str().unwrap_or("?"),
        f["proto"].as_str().unwrap_or("?"),
        f["cause"].as_str().unwrap_or("-"),
        ip(&f["client"]),
        f["service"].as_str().unwrap_or("-"),
        f["backend"].as_str().unwrap_or("-"),
        ip(&f["snat"]),
    )
}

pub fn compare(runs: &[(&str, Vec<Value>)]) -> Result<String, String> {
    let keyed: Vec<(&str, BTreeMap<String, usize>)> = runs
        .iter()
        .map(|(b, flows)| {
            let mut counts = BTreeMap::new();
            for f in flows {
                *counts.entry(flow_key(f)).or_default() += 1;
            }
            (*b, counts)
        })
        .collect();
    let (first, reference) = &keyed[0];
    let differ: Vec<String> = keyed[1..]
        .iter()
        .filter(|(_, k)| k != reference)
        .map(|(b, k)| format!("{b}: {k:?}\n{first}: {reference:?}"))
        .collect();
    if differ.is_empty() && !reference.is_empty() {
        let names: Vec<&str> = keyed.iter().map(|(b, _)| *b).collect();
        Ok(format!("{}: {reference:?}", names.join(" = ")))
    } else if reference.is_empty() {
        Err(format!("{first} reported no flows to compare"))
    } else {
        Err(differ.join("\n"))
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn lab() -> LabFacts {
        let links = |names: &[(u64, &str)]| {
            names
                .iter()
                .map(|(i, n)| (*i, n.to_string()))
                .collect::<HashMap<_, _>>()
        };
        LabFacts {
            node_path: PathBuf::new(),
            client_path: PathBuf::new(),
            node_ns: 100,
            client_ns: 200,
            backend_ns: 300,
            links: HashMap::from([
                (
                    100,
                    links(&[(1, "lo"), (3, "cni0"), (4, "veth0"), (5, "veth1")]),
                ),
                (200, links(&[(1, "lo"), (2, "eth0")])),
                (300, links(&[(1, "lo"), (2, "eth0")])),
            ]),
            client_eth0: 2,
            client_port: 4,
            backend_port: 5,
        }
    }

    fn hop(hook: &str, netns: u64, ifindex: u64, src: &str, dst: &str) -> Value {
        json!({"hook": hook, "netns": netns, "ifindex": ifindex, "src": src, "dst": dst,
               "nat_stage": if hook == "netfilter" { json!("after-nat") } else { Value::Null }})
    }

    /// One netfilter-backend flow of seed 000, as a correct kernel read gives it.
    fn flow(netns_of_client_hops: u64) -> Value {
        let (c, s, b) = (
            "100.96.54.240:40000",
            "100.67.30.133:80",
            "100.96.54.247:80",
        );
        let request = vec![
            hop("dev-tx", netns_of_client_hops, 2, c, s),
            hop("dev-rx", 100, 4, c, s),
            hop("netfilter", 100, 3, c, b),
        ];
        let reply = vec![hop("dev-rx", netns_of_client_hops, 2, b, c)];
        json!({"packets": [{"dir": "request", "hops": request}, {"dir": "reply", "hops": reply}]})
    }

    #[test]
    fn right_fields_pass() {
        check_fields(&[flow(200)], &lab(), "netfilter").unwrap();
    }

    /// What a wrong `net.ns.inum` offset looks like: a netns the lab never made.
    #[test]
    fn a_wrong_netns_fails() {
        let err = check_fields(&[flow(12345)], &lab(), "netfilter").unwrap_err();
        assert!(
            err.contains("netns inode 12345 is none of the lab's"),
            "{err}"
        );
        assert!(err.contains("no hop at dev-tx client eth0"), "{err}");
    }

    /// The kprobe backend must also show the bridge's forwarding decision.
    #[test]
    fn kprobe_needs_br_forward() {
        let err = check_fields(&[flow(200)], &lab(), "kprobe").unwrap_err();
        assert!(err.contains("no hop at br-forward to client-port"), "{err}");
    }
}
