//! Multicast: the per-packet cost of a pod's packet to a group with 1, 8 and 32 members on
//! its node, and with members on 4 other nodes, beside the same pod's unicast packet to a pod
//! of its node and to a pod of another node, and an empty tc program; `tc_from_pod` under
//! BPF_PROG_TEST_RUN on the overlay bed (`overlay_bed`), single runs (the program changes
//! the packet), cases interleaved round by round, medians reported. Each copy goes out of a
//! real veth (local members) or the underlay veth (other nodes), so a copy's cost includes
//! its clone and its transmission. A benchmark: it reports.

use clap::Parser;
use dataplane_common::{
    maps::{MCAST_GROUPS, MCAST_PODS, PROG_FROM_POD},
    multicast::{McastGroup, McastKey, McastPod, namespace_id},
    testbed::PROG_TC_BASELINE,
};
use dataplane_tests::{fixture::TEST_RUN_IFINDEX, median, overlay_bed, packets};
use dataplane_user::{mapsync::addr16, model::endpoint};
use etherparse::PacketBuilder;
use serde::Serialize;

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = 15)]
    rounds: u32,
    /// Single-iteration runs per case and round.
    #[arg(long, default_value_t = 2_000)]
    singles: u32,
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Row {
    case: String,
    median_ns: f64,
    /// Against the unicast packet of the same reach (a pod of this node, or of another node).
    ratio_to_unicast: f64,
    /// (this case - the unicast packet) / copies.
    extra_ns_per_copy: f64,
}

#[derive(Serialize)]
struct Report {
    rounds: u32,
    singles: u32,
    empty_program_ns: f64,
    rows: Vec<Row>,
}

/// A case: its label, the frame, copies made, and whether it reaches other nodes.
struct Case {
    label: String,
    frame: Vec<u8>,
    copies: u32,
    remote: bool,
}

/// UDP from the bed's sending pod to `dst` (TTL 2, so copies may leave the node).
fn udp_to(dst: [u8; 4]) -> Vec<u8> {
    let mac = if dst[0] & 0xF0 == 0xE0 {
        [0x01, 0x00, 0x5e, dst[1] & 0x7f, dst[2], dst[3]]
    } else {
        packets::GW_MAC
    };
    let mut frame = Vec::new();
    PacketBuilder::ethernet2(packets::POD_MAC, mac)
        .ipv4(packets::SRC_V4, dst, 2)
        .udp(40000, 5000)
        .write(&mut frame, packets::PAYLOAD)
        .expect("frame");
    frame
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut bed = overlay_bed::bed()?;
    // 32 member pods' veths, and 4 other member nodes (static neighbours).
    let mut members = Vec::new();
    for i in 0..32 {
        let ifindex = bed.add_pod_veth(&format!("mc{i}"), &format!("mp{i}"))?;
        bed.ip(&format!("link set mc{i} up"))?;
        bed.ip(&format!("link set mp{i} up"))?;
        members.push(ifindex);
    }
    let mut nodes = Vec::new();
    for n in 3..7u8 {
        let address = format!("10.99.0.{n}");
        bed.ip(&format!(
            "neigh add {address} lladdr 02:00:00:00:99:{n:02x} dev ul0 nud permanent"
        ))?;
        nodes.push(endpoint(address.parse()?));
    }
    let team = namespace_id(b"team");
    {
        let mut pods: aya::maps::HashMap<&mut aya::maps::MapData, u32, McastPod> =
            bed.fixture.typed_map(MCAST_PODS)?;
        pods.insert(
            TEST_RUN_IFINDEX,
            McastPod {
                namespace: team,
                _pad: 0,
            },
            0,
        )?;
    }
    let mut cases = vec![
        Case {
            label: "unicast to a pod of this node".into(),
            frame: udp_to([10, 244, 1, 3]),
            copies: 1,
            remote: false,
        },
        Case {
            label: "unicast to a pod of another node (Geneve)".into(),
            frame: udp_to([10, 244, 2, 5]),
            copies: 1,
            remote: true,
        },
    ];
    {
        let mut groups: aya::maps::HashMap<&mut aya::maps::MapData, McastKey, McastGroup> =
            bed.fixture.typed_map(MCAST_GROUPS)?;
        for count in [1usize, 8, 32] {
            let group = [239, 1, 0, count as u8];
            let mut entry = McastGroup::default();
            entry.local[..count].copy_from_slice(&members[..count]);
            entry.local_count = count as u32;
            let key = McastKey {
                namespace: team,
                group: addr16(std::net::IpAddr::from(group)),
            };
            groups.insert(key, entry, 0)?;
            cases.push(Case {
                label: format!("multicast, {count} member(s) on this node"),
                frame: udp_to(group),
                copies: count as u32,
                remote: false,
            });
        }
        let group = [239, 2, 0, 1];
        let mut entry = McastGroup::default();
        entry.remote[..4].copy_from_slice(&nodes);
        entry.remote_count = 4;
        let key = McastKey {
            namespace: team,
            group: addr16(std::net::IpAddr::from(group)),
        };
        groups.insert(key, entry, 0)?;
        cases.push(Case {
            label: "multicast, members on 4 other nodes".into(),
            frame: udp_to(group),
            copies: 4,
            remote: true,
        });
    }
    let empty = udp_to([10, 244, 1, 3]);
    let mut samples = vec![Vec::new(); cases.len() + 1];
    for _ in 0..args.rounds {
        for (i, frame) in std::iter::once(&empty)
            .chain(cases.iter().map(|c| &c.frame))
            .enumerate()
        {
            let program = if i == 0 {
                PROG_TC_BASELINE
            } else {
                PROG_FROM_POD
            };
            let mut round = Vec::with_capacity(args.singles as usize);
            for _ in 0..args.singles {
                let outcome = bed.fixture.run_tc(program, frame, 1)?;
                round.push(outcome.duration.as_nanos() as f64);
            }
            samples[i].push(median(&round));
        }
    }
    let medians: Vec<f64> = samples.iter().map(|s| median(s)).collect();
    let (local_unicast, remote_unicast) = (medians[1], medians[2]);
    let rows: Vec<Row> = cases
        .iter()
        .zip(&medians[1..])
        .map(|(case, &median_ns)| {
            let unicast = if case.remote {
                remote_unicast
            } else {
                local_unicast
            };
            Row {
                case: case.label.clone(),
                median_ns,
                ratio_to_unicast: median_ns / unicast,
                extra_ns_per_copy: (median_ns - unicast) / f64::from(case.copies),
            }
        })
        .collect();
    let counters = bed.fixture.counters();
    let copies = counters.packets(
        dataplane_common::Hook::FromPod,
        dataplane_common::PacketClass::MulticastLocalCopy,
    );
    anyhow::ensure!(copies > 0, "no multicast copy was made");
    let report = Report {
        rounds: args.rounds,
        singles: args.singles,
        empty_program_ns: medians[0],
        rows,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "multicast: tc_from_pod per packet ({} rounds x {} single runs, medians); empty tc program {:.0} ns",
        report.rounds, report.singles, report.empty_program_ns
    );
    println!(
        "  {:<45} {:>9} {:>11} {:>14}",
        "case", "ns", "x unicast", "extra ns/copy"
    );
    for row in &report.rows {
        println!(
            "  {:<45} {:>9.0} {:>11.2} {:>14.0}",
            row.case, row.median_ns, row.ratio_to_unicast, row.extra_ns_per_copy
        );
    }
    Ok(())
}
