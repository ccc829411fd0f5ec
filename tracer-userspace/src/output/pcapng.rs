//! pcapng for Wireshark/tshark: every packet of each decided flow once per
//! address pair it had (`sightings`), one interface block per observation
//! point (hook + interface), each packet block commented with the points it
//! passed, NAT stages and the flow's verdict — so the SYN to the Service
//! address and the same SYN to the backend after DNAT sit next to each
//! other.
//!
//! The kernel events carry header fields, not payload: the IPv4/IPv6 + TCP/UDP
//! headers written here are synthesized from them (addresses and ports as
//! seen at that point, IP id, seq/ack, flags). There is no payload, and the
//! lengths are those of the synthesized headers.
use std::{
    borrow::Cow,
    collections::HashMap,
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    time::Duration,
};

use pcap_file::{
    DataLink, Endianness, PcapError,
    pcapng::{
        PcapNgWriter,
        blocks::{
            enhanced_packet::{EnhancedPacketBlock, EnhancedPacketOption},
            interface_description::{InterfaceDescriptionBlock, InterfaceDescriptionOption},
            section_header::{SectionHeaderBlock, SectionHeaderOption},
        },
    },
};
use tracer_common::proto;

use crate::{
    collector::{Dir, FlowReport, Hop, Name, PacketEvidence, Proto},
    recording::Clock,
};

/// An observation point: one pcapng interface.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Point {
    hook: &'static str,
    nf_hook: Option<&'static str>,
    nat_stage: Option<&'static str>,
    ifindex: u32,
    netns: u32,
    /// Set when flows are merged across nodes: one interface per node and point.
    node: Option<crate::collector::Name>,
}

pub struct PcapngOutput<W: io::Write> {
    writer: PcapNgWriter<W>,
    points: HashMap<Point, u32>,
    clock: Option<Clock>,
    /// Each node's clock, for hops of flows merged across nodes.
    node_clocks: HashMap<String, Clock>,
}

impl<W: io::Write> PcapngOutput<W> {
    /// `clock` turns event times into wall-clock times; without it the
    /// packets carry CLOCK_MONOTONIC (time since boot).
    pub fn new(out: W, clock: Option<Clock>, description: &str) -> Result<Self, PcapError> {
        let section = SectionHeaderBlock {
            endianness: Endianness::native(),
            major_version: 1,
            minor_version: 0,
            section_length: -1,
            options: vec![
                SectionHeaderOption::UserApplication(Cow::Owned(format!(
                    "nattrace {}",
                    env!("CARGO_PKG_VERSION")
                ))),
                SectionHeaderOption::Comment(Cow::Owned(format!(
                    "{description}; IPv4/IPv6 + TCP/UDP headers synthesized from kernel events, no payload"
                ))),
            ],
        };
        Ok(Self {
            writer: PcapNgWriter::with_section_header(out, section)?,
            points: HashMap::new(),
            clock,
            node_clocks: HashMap::new(),
        })
    }

    /// Hops labelled with a node get that node's wall clock.
    pub fn set_node_clocks(&mut self, clocks: HashMap<String, Clock>) {
        self.node_clocks = clocks;
    }

    pub fn into_inner(self) -> W {
        self.writer.into_inner()
    }

    pub fn flow(&mut self, r: &FlowReport) -> Result<(), PcapError> {
        let verdict = match (&r.cause, r.incomplete) {
            (Some(c), _) => format!("{} (cause {})", r.verdict.as_str(), c.id.as_str()),
            (None, true) => format!("{} (incomplete)", r.verdict.as_str()),
            (None, false) => r.verdict.as_str().to_owned(),
        };
        // A connection that broke after an `ok` opening says so.
        let verdict = match &r.established {
            Some(e) => format!(
                "{verdict} mid-stream after {} ms and {} good replies",
                e.after_ms, e.good_replies
            ),
            None => verdict,
        };
        let pods = match (&r.client_pod, &r.backend_pod) {
            (None, None) => String::new(),
            (c, b) => format!(
                " (pods: client {}, backend {})",
                c.as_ref().map_or("-", Name::as_str),
                b.as_ref().map_or("-", Name::as_str)
            ),
        };
        for (packet, sighting) in sightings(&r.packets) {
            let hop = sighting[0];
            let id = self.interface(hop)?;
            let data = synthesize(r.proto, packet, hop.src, hop.dst);
            let clock = match &hop.node {
                Some(n) => self.node_clocks.get(n.as_str()),
                None => self.clock.as_ref(),
            };
            let ts = match clock {
                Some(c) => c.to_unix(hop.ts_ns),
                None => hop.ts_ns,
            };
            let dir = match packet.dir {
                Dir::Request => "request",
                Dir::Reply => "reply",
            };
            let points: Vec<String> = sighting.iter().map(|h| point_name(h)).collect();
            let comment = format!(
                "{} {dir} {} → {} at {}; flow {} → {}{pods}: {verdict}",
                packet.kind,
                hop.src,
                hop.dst,
                points.join(", "),
                r.client,
                r.service,
            );
            self.writer.write_pcapng_block(EnhancedPacketBlock {
                interface_id: id,
                timestamp: Duration::from_nanos(ts),
                original_len: data.len() as u32,
                data: Cow::Owned(data),
                options: vec![EnhancedPacketOption::Comment(Cow::Owned(comment))],
            })?;
        }
        Ok(())
    }

    /// The target the blocks are written to.
    pub fn writer(&mut self) -> &mut W {
        self.writer.get_mut()
    }

    pub fn flush(&mut self) -> io::Result<()> {
        self.writer.get_mut().flush()
    }

    fn interface(&mut self, hop: &Hop) -> Result<u32, PcapError> {
        let point = Point {
            hook: hop.hook,
            nf_hook: hop.nf_hook,
            nat_stage: hop.nat_stage,
            ifindex: hop.ifindex,
            netns: hop.netns,
            node: hop.node.clone(),
        };
        if let Some(&id) = self.points.get(&point) {
            return Ok(id);
        }
        let id = self.points.len() as u32;
        let mut description = format!("nattrace observation point: {}", point_name(hop));
        if !hop.node_ns {
            match &hop.pod {
                Some(pod) => description.push_str(&format!(" ({pod}, netns inode {})", hop.netns)),
                None => description.push_str(&format!(" (netns inode {})", hop.netns)),
            }
        }
        self.writer.write_pcapng_block(InterfaceDescriptionBlock {
            linktype: DataLink::RAW,
            snaplen: 0xffff,
            options: vec![
                InterfaceDescriptionOption::IfName(Cow::Owned(point_name(hop))),
                InterfaceDescriptionOption::IfDescription(Cow::Owned(description)),
                // Nanosecond timestamps, like the events.
                InterfaceDescriptionOption::IfTsResol(9),
            ],
        })?;
        self.points.insert(point, id);
        Ok(id)
    }
}

/// A flow's hops grouped by what a capture there would show: one group
/// per packet (flags, sequence numbers, IP id) and address pair (and
/// node), in the order first seen. Wireshark's TCP analysis keys a
/// connection by addresses and ports only, not by interface, so the same
/// segment written once per hop read as a retransmission at every hop
/// after the first (tshark 4.0's expert info "This frame is a (suspected)
/// retransmission"; tried: neither separate interfaces, pcapng's
/// epb_packetid — the format's mark for one packet seen on several
/// interfaces, which pcap-file 2.0 cannot write anyway: its UnknownOption
/// is not exported — epb_flags nor separate sections change that). One
/// block per group keeps the packet before and after NAT side by side and
/// every hop named in the comment. A real retransmission carries a new IP
/// id (Linux counts per socket) and stays a block of its own.
fn sightings(packets: &[PacketEvidence]) -> Vec<(&PacketEvidence, Vec<&Hop>)> {
    let same = |a: &PacketEvidence, b: &PacketEvidence| {
        a.dir == b.dir
            && a.tcp_flags == b.tcp_flags
            && a.seq == b.seq
            && a.ack == b.ack
            && a.ip_id == b.ip_id
            && a.dns_id == b.dns_id
    };
    let mut out: Vec<(&PacketEvidence, Vec<&Hop>)> = Vec::new();
    for packet in packets {
        for hop in &packet.hops {
            match out.iter_mut().find(|(p, g)| {
                same(p, packet)
                    && g[0].src == hop.src
                    && g[0].dst == hop.dst
                    && g[0].node == hop.node
            }) {
                Some((_, g)) => g.push(hop),
                None => out.push((packet, vec![hop])),
            }
        }
    }
    out
}

/// "tc-ingress veth-client", "netfilter PREROUTING before-nat eth0", "dev-rx if7";
/// prefixed with the node ("node-b: tc-egress flannel.1") in merged flows.
fn point_name(hop: &Hop) -> String {
    let mut name = match &hop.node {
        Some(n) => format!("{n}: {}", hop.hook),
        None => hop.hook.to_owned(),
    };
    for part in [hop.nf_hook, hop.nat_stage].into_iter().flatten() {
        name.push(' ');
        name.push_str(part);
    }
    match (&hop.ifname, hop.ifindex) {
        (Some(n), _) => {
            name.push(' ');
            name.push_str(n.as_str());
        }
        (None, 0) => {}
        (None, i) => name.push_str(&format!(" if{i}")),
    }
    name
}

fn checksum(chunks: &[&[u8]]) -> u16 {
    let mut sum = 0u32;
    for chunk in chunks {
        let mut words = chunk.chunks_exact(2);
        for w in &mut words {
            sum += u32::from(u16::from_be_bytes([w[0], w[1]]));
        }
        if let [last] = words.remainder() {
            sum += u32::from(*last) << 8;
        }
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// IPv4 or IPv6 header + TCP or UDP header with valid checksums (so
/// Wireshark does not flag them), addresses and ports as at this
/// observation point. LINKTYPE_RAW carries both families (the version
/// nibble tells them apart).
fn synthesize(proto: Proto, packet: &PacketEvidence, src: SocketAddr, dst: SocketAddr) -> Vec<u8> {
    let l4_len: u16 = match proto {
        Proto::Tcp => 20,
        Proto::Udp => 8,
    };
    let next = match proto {
        Proto::Tcp => proto::TCP,
        Proto::Udp => proto::UDP,
    };
    let (mut out, pseudo) = match (src.ip(), dst.ip()) {
        (IpAddr::V4(s), IpAddr::V4(d)) => ipv4_header(packet, next, l4_len, s, d),
        // A family mix never comes out of the kernel (one packet, one
        // family); should it, both are written as IPv6 (mapped).
        (s, d) => ipv6_header(next, l4_len, to_v6(s), to_v6(d)),
    };

    let mut l4 = vec![0u8; l4_len as usize];
    l4[0..2].copy_from_slice(&src.port().to_be_bytes());
    l4[2..4].copy_from_slice(&dst.port().to_be_bytes());
    match proto {
        Proto::Tcp => {
            l4[4..8].copy_from_slice(&packet.seq.to_be_bytes());
            l4[8..12].copy_from_slice(&packet.ack.to_be_bytes());
            l4[12] = 5 << 4;
            l4[13] = packet.tcp_flags;
            l4[14..16].copy_from_slice(&0xffffu16.to_be_bytes());
        }
        Proto::Udp => l4[4..6].copy_from_slice(&l4_len.to_be_bytes()),
    }
    let c = checksum(&[&pseudo, &l4]);
    let at = if proto == Proto::Tcp { 16 } else { 6 };
    l4[at..at + 2].copy_from_slice(&c.to_be_bytes());
    out.extend_from_slice(&l4);
    out
}

fn to_v6(a: IpAddr) -> Ipv6Addr {
    match a {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    }
}

/// The IPv4 header and the TCP/UDP pseudo-header (RFC 793 3.1).
fn ipv4_header(
    packet: &PacketEvidence,
    next: u8,
    l4_len: u16,
    src: Ipv4Addr,
    dst: Ipv4Addr,
) -> (Vec<u8>, Vec<u8>) {
    let total = 20 + l4_len;
    let mut ip = [0u8; 20];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&total.to_be_bytes());
    ip[4..6].copy_from_slice(&packet.ip_id.to_be_bytes());
    ip[6] = 0x40; // DF, as Linux sets on TCP
    ip[8] = 64;
    ip[9] = next;
    ip[12..16].copy_from_slice(&src.octets());
    ip[16..20].copy_from_slice(&dst.octets());
    let c = checksum(&[&ip]);
    ip[10..12].copy_from_slice(&c.to_be_bytes());
    let mut pseudo = vec![0u8; 12];
    pseudo[0..8].copy_from_slice(&ip[12..20]);
    pseudo[9] = next;
    pseudo[10..12].copy_from_slice(&l4_len.to_be_bytes());
    (ip.to_vec(), pseudo)
}

/// The IPv6 fixed header and the upper-layer pseudo-header (RFC 8200 8.1).
fn ipv6_header(next: u8, l4_len: u16, src: Ipv6Addr, dst: Ipv6Addr) -> (Vec<u8>, Vec<u8>) {
    let mut ip = [0u8; 40];
    ip[0] = 0x60;
    ip[4..6].copy_from_slice(&l4_len.to_be_bytes());
    ip[6] = next;
    ip[7] = 64;
    ip[8..24].copy_from_slice(&src.octets());
    ip[24..40].copy_from_slice(&dst.octets());
    let mut pseudo = vec![0u8; 40];
    pseudo[0..32].copy_from_slice(&ip[8..40]);
    pseudo[34..36].copy_from_slice(&l4_len.to_be_bytes());
    pseudo[39] = next;
    (ip.to_vec(), pseudo)
}

#[cfg(test)]
mod tests {
    use super::checksum;

    #[test]
    fn checksum_of_a_known_ipv4_header() {
        // Example header from RFC 1071 discussions (checksum field zeroed).
        let hdr = [
            0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0x00, 0x00, 0xc0, 0xa8,
            0x00, 0x01, 0xc0, 0xa8, 0x00, 0xc7,
        ];
        assert_eq!(checksum(&[&hdr]), 0xb861);
    }
}

/// The pcapng file's writer-thread target: it never leaves a partial block
/// behind. A full disk fails a write(2) in the middle of a block (tshark:
/// "cut short in the middle of a packet"), and a pcapng given up because
/// its reader fell behind stops wherever the last chunk ended; either way
/// the file is cut back to the end of its last complete block, so it reads
/// cleanly up to there. Every block starts with its type and total length
/// (32 bits each, in the section's byte order: native, see
/// [`PcapngOutput::new`]), which is all it needs to find the block ends.
pub struct WholeBlocks<F: io::Write + SetLen> {
    file: F,
    /// Bytes written so far.
    written: u64,
    /// Where the block being written started (= end of the last complete one).
    block_start: u64,
    /// The first 8 bytes of that block, as far as written.
    head: Vec<u8>,
}

/// What [`WholeBlocks`] needs besides writing: cutting the file back.
pub trait SetLen {
    fn set_len(&mut self, len: u64) -> io::Result<()>;
}

impl SetLen for std::fs::File {
    fn set_len(&mut self, len: u64) -> io::Result<()> {
        use std::io::Seek as _;
        std::fs::File::set_len(self, len)?;
        self.seek(io::SeekFrom::Start(len)).map(|_| ())
    }
}

impl<F: io::Write + SetLen> WholeBlocks<F> {
    pub fn new(file: F) -> Self {
        Self {
            file,
            written: 0,
            block_start: 0,
            head: Vec::with_capacity(8),
        }
    }

    /// Follows the block boundaries through bytes that reached the file.
    fn account(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            if self.head.len() < 8 {
                let take = (8 - self.head.len()).min(data.len());
                self.head.extend_from_slice(&data[..take]);
                self.written += take as u64;
                data = &data[take..];
                if self.head.len() < 8 {
                    return;
                }
            }
            let len = u64::from(u32::from_ne_bytes(
                self.head[4..8].try_into().expect("4 bytes"),
            ));
            let end = self.block_start + len.max(8);
            let take = (end - self.written).min(data.len() as u64);
            self.written += take;
            data = &data[take as usize..];
            if self.written == end {
                self.block_start = end;
                self.head.clear();
            }
        }
    }

    /// Cuts a partly written block off (no-op when none is).
    fn cut_back(&mut self) {
        if self.written != self.block_start && self.file.set_len(self.block_start).is_ok() {
            self.written = self.block_start;
            self.head.clear();
        }
    }
}

impl<F: io::Write + SetLen> io::Write for WholeBlocks<F> {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        match self.file.write(data) {
            Ok(n) => {
                self.account(&data[..n]);
                Ok(n)
            }
            Err(e) => {
                self.cut_back();
                Err(e)
            }
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        self.file.flush().inspect_err(|_| self.cut_back())
    }
}

impl<F: io::Write + SetLen> Drop for WholeBlocks<F> {
    fn drop(&mut self) {
        self.cut_back();
    }
}

#[cfg(test)]
mod whole_blocks_tests {
    use std::io::Write as _;

    use super::*;

    /// A "disk" that fills after `room` bytes, like ENOSPC mid-write.
    struct Disk {
        bytes: std::rc::Rc<std::cell::RefCell<Vec<u8>>>,
        room: usize,
    }

    impl io::Write for Disk {
        fn write(&mut self, data: &[u8]) -> io::Result<usize> {
            let mut bytes = self.bytes.borrow_mut();
            let n = data.len().min(self.room.saturating_sub(bytes.len()));
            if n == 0 {
                return Err(io::Error::from_raw_os_error(libc::ENOSPC));
            }
            bytes.extend_from_slice(&data[..n]);
            Ok(n)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    impl SetLen for Disk {
        fn set_len(&mut self, len: u64) -> io::Result<()> {
            self.bytes.borrow_mut().truncate(len as usize);
            Ok(())
        }
    }

    /// Issue 26 item 10: a full disk cut the pcapng mid-packet.
    #[test]
    fn a_full_disk_leaves_only_whole_blocks() {
        use crate::collector::{Collector, CollectorConfig, fixtures};
        let mut c = Collector::new(CollectorConfig {
            services: fixtures::services(),
            facts: fixtures::facts(Some(false)),
            ..CollectorConfig::default()
        });
        for ev in fixtures::seed000_same_node(false) {
            c.push(ev);
        }
        let (reports, _) = c.finish(fixtures::T0 + 10_000_000_000);
        let mut whole = Vec::new();
        {
            let mut out = PcapngOutput::new(&mut whole, None, "test").unwrap();
            for r in &reports {
                out.flow(r).unwrap();
            }
            out.flush().unwrap();
        }
        assert!(whole.len() > 600, "{}", whole.len());
        for room in [100, 333, whole.len() / 2 + 7, whole.len() - 3] {
            let bytes = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
            let disk = Disk {
                bytes: bytes.clone(),
                room,
            };
            let mut w = WholeBlocks::new(disk);
            assert!(w.write_all(&whole).is_err());
            drop(w);
            let cut = bytes.borrow().clone();
            assert!(cut.len() <= room && whole.starts_with(&cut), "room {room}");
            if room == 100 {
                // Less than the section header: nothing complete to keep.
                assert!(cut.is_empty());
                continue;
            }
            let mut reader = pcap_file::pcapng::PcapNgReader::new(&cut[..]).unwrap();
            while let Some(block) = reader.next_block() {
                block.unwrap_or_else(|e| panic!("room {room}: {e}"));
            }
        }
    }
}
