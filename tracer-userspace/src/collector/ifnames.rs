//! Interface names by (network namespace, ifindex): an ifindex means
//! nothing without its namespace (every pod has an `eth0`, often ifindex 2
//! or 3, which the node also uses for its own devices). The node's names
//! come with the node facts; names in other namespaces (pods) and of
//! interfaces that appeared after start are learned while tracing
//! ([`super::Collector::learn_interface`]), since the collector does no I/O.
use std::collections::HashMap;

use super::types::Name;
use crate::facts::NodeFacts;

/// Names held at most; a node runs a few hundred pods at a time.
const MAX_NAMES: usize = 65536;

#[derive(Clone, Debug, Default)]
pub(crate) struct IfNames {
    node_inode: u32,
    /// foldhash: looked up for every hop of every reported flow.
    names: HashMap<(u32, u32), Name, foldhash::fast::RandomState>,
}

impl IfNames {
    pub fn new(facts: &NodeFacts) -> Self {
        let mut names = Self {
            node_inode: facts.netns_inode,
            names: HashMap::default(),
        };
        for i in &facts.interfaces {
            names.learn(facts.netns_inode, i.ifindex, &i.name);
        }
        names
    }

    /// Events of the node namespace may carry netns 0 (tc, netfilter).
    fn key(&self, netns: u32, ifindex: u32) -> (u32, u32) {
        (if netns == 0 { self.node_inode } else { netns }, ifindex)
    }

    pub fn learn(&mut self, netns: u32, ifindex: u32, name: &str) {
        if name.is_empty() || ifindex == 0 {
            return;
        }
        let key = self.key(netns, ifindex);
        if self.names.get(&key).is_some_and(|n| n.as_str() == name) {
            return;
        }
        if self.names.len() >= MAX_NAMES {
            // Pods come and go for days: forget theirs, keep the node's.
            let node = self.node_inode;
            self.names.retain(|&(ns, _), _| ns == node);
        }
        self.names.insert(key, Name(name.into()));
    }

    pub fn get(&self, netns: u32, ifindex: u32) -> Option<&Name> {
        self.names.get(&self.key(netns, ifindex))
    }

    /// The name, or `if<N>` when it is not known.
    pub fn describe(&self, netns: u32, ifindex: u32) -> String {
        match self.get(netns, ifindex) {
            Some(n) => n.to_string(),
            None => format!("if{ifindex}"),
        }
    }
}
