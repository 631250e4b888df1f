//! Per-packet cost of the real programs by packet class, measured with BPF_PROG_TEST_RUN and
//! interleaved round by round with empty programs of the same hook, so every ratio compares
//! numbers taken under the same conditions. A benchmark: it reports, it does not pass or fail.

use clap::Parser;
use dataplane_common::{
    lb::{NODEPORT_ANY_V4, SCOPE_NODEPORT, ServiceKey},
    maps::{PROG_FROM_POD, PROG_UNDERLAY, PROG_UNDERLAY_TC},
    testbed::{PROG_BASELINE, PROG_TC_BASELINE},
};
use dataplane_tests::median;
use dataplane_tests::{
    hybrid_bed::{self, HYBRID_POD, HYBRID_ROUTER_MAC, ROUTER_MAC},
    overlay_bed::{self, UNDERLAY_MAC},
    packets::{self, Ext},
};
use dataplane_user::lb::{BackendAddr, LbState, ServicePort};
use serde::Serialize;

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = 15)]
    rounds: u32,
    #[arg(long, default_value_t = 1_000_000)]
    repeat: u32,
    /// Single-iteration runs per round for cases that change the packet.
    #[arg(long, default_value_t = 2_000)]
    singles: u32,
    #[arg(long)]
    json: bool,
    /// Run only the cases whose packet names contain this text (and the empty programs):
    /// for profiling one path with `perf`.
    #[arg(long)]
    only: Option<String>,
}

#[derive(Clone, Copy, PartialEq)]
enum Hook {
    Xdp,
    Tc,
}

/// How a case is timed. `Repeat`: one test run of `--repeat` iterations, the kernel's mean.
/// `Single`: `--singles` test runs of one iteration each, the median; for programs that change
/// the packet (encapsulation, decapsulation), since repeated iterations would run on the
/// already-changed packet.
#[derive(Clone, Copy, PartialEq)]
enum Timing {
    Repeat,
    Single,
}

struct Case {
    program: &'static str,
    hook: Hook,
    timing: Timing,
    class: &'static str,
    frame: Vec<u8>,
    samples: Vec<f64>,
}

#[derive(Serialize)]
struct Row {
    program: &'static str,
    class: &'static str,
    timing: &'static str,
    median_ns: f64,
    baseline: &'static str,
    baseline_median_ns: f64,
    ratio: f64,
}

#[derive(Serialize)]
struct Report {
    rounds: u32,
    repeat: u32,
    rows: Vec<Row>,
}

fn cases() -> Vec<Case> {
    let case = |program, hook, class, frame| Case {
        program,
        hook,
        timing: Timing::Repeat,
        class,
        frame,
        samples: Vec::new(),
    };
    let single = |program, hook, class, frame| Case {
        timing: Timing::Single,
        ..case(program, hook, class, frame)
    };
    let to_local_pod = packets::with_ipv4_destination(&packets::ipv4_tcp(), [10, 244, 1, 3]);
    // Leaves the pod network: parsed and counted, no overlay work.
    let external = packets::with_ipv4_destination(&packets::ipv4_tcp(), [192, 0, 2, 1]);
    let geneve = packets::geneve_v4([10, 99, 0, 2], [10, 99, 0, 1], &to_local_pod);
    let v6_ext = packets::with_ipv6_extensions(
        &packets::ipv6_tcp(),
        &[
            Ext::options(packets::HOP_BY_HOP, 8),
            Ext::options(packets::DEST_OPTS, 16),
            Ext::options(packets::ROUTING, 24),
        ],
    );
    let mut v6_ext_external = v6_ext.clone();
    v6_ext_external[packets::L3 + 24..packets::L3 + 40]
        .copy_from_slice(&[0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]);
    let mut bad_ihl = packets::ipv4_udp();
    bad_ihl[packets::L3] = 0x44;
    // A hybrid pod's packet to the local pod, as its Windows node sends it.
    let mut from_hybrid_pod = packets::tcp_v4_flow(HYBRID_POD, 40000, [10, 244, 1, 3], 80, true);
    from_hybrid_pod[..6].copy_from_slice(&ROUTER_MAC);
    from_hybrid_pod[6..12].copy_from_slice(&HYBRID_ROUTER_MAC);
    let vxlan = packets::vxlan_v4(
        [10, 99, 0, 20],
        [10, 99, 0, 1],
        4789,
        4097,
        &from_hybrid_pod,
    );
    let to_hybrid_pod = packets::with_ipv4_destination(&packets::ipv4_tcp(), HYBRID_POD);
    let node_port = node_port_datagram();
    vec![
        case(PROG_BASELINE, Hook::Xdp, "ipv4 tcp", packets::ipv4_tcp()),
        case(PROG_UNDERLAY, Hook::Xdp, "ipv4 tcp", packets::ipv4_tcp()),
        case(PROG_UNDERLAY, Hook::Xdp, "ipv4 udp", packets::ipv4_udp()),
        case(
            PROG_UNDERLAY,
            Hook::Xdp,
            "ipv4 options udp",
            packets::with_ipv4_options(&packets::ipv4_udp(), 4),
        ),
        case(
            PROG_UNDERLAY,
            Hook::Xdp,
            "qinq ipv4 tcp",
            packets::qinq_ipv4_tcp(),
        ),
        case(PROG_UNDERLAY, Hook::Xdp, "ipv6 tcp", packets::ipv6_tcp()),
        case(
            PROG_UNDERLAY,
            Hook::Xdp,
            "ipv6 3 ext hdrs tcp",
            v6_ext.clone(),
        ),
        case(PROG_UNDERLAY, Hook::Xdp, "ipv4 bad ihl (drop)", bad_ihl),
        case(PROG_TC_BASELINE, Hook::Tc, "ipv4 tcp", packets::ipv4_tcp()),
        case(PROG_FROM_POD, Hook::Tc, "ipv4 tcp to external", external),
        case(
            PROG_FROM_POD,
            Hook::Tc,
            "ipv6 3 ext hdrs to external",
            v6_ext_external,
        ),
        single(PROG_BASELINE, Hook::Xdp, "ipv4 tcp", packets::ipv4_tcp()),
        single(PROG_UNDERLAY, Hook::Xdp, "geneve decap", geneve),
        single(PROG_UNDERLAY, Hook::Xdp, "vxlan decap (hybrid)", vxlan),
        single(PROG_TC_BASELINE, Hook::Tc, "ipv4 tcp", packets::ipv4_tcp()),
        single(
            PROG_FROM_POD,
            Hook::Tc,
            "geneve encap (ipv4)",
            packets::ipv4_tcp(),
        ),
        single(
            PROG_FROM_POD,
            Hook::Tc,
            "vxlan encap (hybrid pod)",
            to_hybrid_pod,
        ),
        single(PROG_FROM_POD, Hook::Tc, "same-node redirect", to_local_pod),
        single(
            PROG_UNDERLAY,
            Hook::Xdp,
            "nodeport masq + geneve encap",
            node_port,
        ),
    ]
}

/// The external client of the NodePort case, on the underlay's subnet.
const NODE_PORT_CLIENT: [u8; 4] = [10, 99, 0, 50];
const NODE_PORT_CLIENT_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x99, 0x50];
const NODE_PORT: u16 = 30053;

/// A datagram from the external client to this node's UDP NodePort, whose backend is a pod of
/// node b: after the flow's first packet (through `tc_underlay`), XDP masquerades it, wraps it
/// in Geneve and sends it back out (what `lb_pps` measures end to end).
fn node_port_datagram() -> Vec<u8> {
    let mut frame = packets::udp_v4_flow(NODE_PORT_CLIENT, 40000, [10, 99, 0, 1], NODE_PORT);
    frame[..6].copy_from_slice(&UNDERLAY_MAC);
    frame[6..12].copy_from_slice(&NODE_PORT_CLIENT_MAC);
    frame
}

/// Installs the UDP NodePort (backend 10.244.2.5:5353, on node b) and opens its flow with the
/// first datagram through `tc_underlay`, as the stack hands it up when XDP passes it.
fn open_node_port_flow(fixture: &mut dataplane_tests::fixture::Fixture) -> anyhow::Result<()> {
    let port = ServicePort {
        name: "bench/nodeport".into(),
        kind: dataplane_user::lb::AddressKind::NodePort,
        key: ServiceKey {
            addr: NODEPORT_ANY_V4,
            port_be: NODE_PORT.to_be_bytes(),
            protocol: 17,
            scope: SCOPE_NODEPORT,
        },
        affinity_timeout: 0,
        ready: vec![BackendAddr {
            ip: "10.244.2.5".parse()?,
            port: 5353,
        }],
        terminating: Vec::new(),
        source_ranges: Vec::new(),
        topology: None,
    };
    fixture.sync_lb(&mut LbState::default(), &[port])?;
    fixture.sync_node_addresses(&["10.99.0.1".parse()?, "fd99::1".parse()?])?;
    let first = fixture.run_tc(PROG_UNDERLAY_TC, &node_port_datagram(), 1)?;
    // TC_ACT_REDIRECT: masqueraded, wrapped and sent towards node b.
    anyhow::ensure!(
        first.action == 7,
        "the NodePort flow's first datagram was not forwarded (action {})",
        first.action
    );
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        args.rounds > 0 && args.repeat > 0 && args.singles > 0,
        "rounds, repeat and singles must be positive"
    );
    // The overlay is configured (one node of a small cluster, in a namespace of this thread,
    // with a hybrid node on VXLAN) so encapsulation and decapsulation run their full paths.
    let mut bed = overlay_bed::bed()?;
    hybrid_bed::set_hybrid(&mut bed, Some(hybrid_bed::hybrid_view(4789, true)))?;
    let fixture = &mut bed.fixture;
    open_node_port_flow(fixture)?;
    let mut cases = cases();
    if let Some(only) = &args.only {
        cases.retain(|c| {
            c.program == PROG_BASELINE || c.program == PROG_TC_BASELINE || c.class.contains(only)
        });
    }
    // What is timed must be the path named: the tunnel cases must wrap or unwrap their packet.
    for case in cases
        .iter()
        .filter(|c| c.class.contains("encap") || c.class.contains("decap"))
    {
        let outcome = match case.hook {
            Hook::Xdp => fixture.run_xdp(case.program, &case.frame, 1)?,
            Hook::Tc => fixture.run_tc(case.program, &case.frame, 1)?,
        };
        let changed_by = outcome.output.len() as i64 - case.frame.len() as i64;
        anyhow::ensure!(
            changed_by.abs() == 50,
            "{} {}: the packet was not wrapped or unwrapped (action {}, {changed_by} bytes)",
            case.program,
            case.class,
            outcome.action
        );
    }
    for _ in 0..args.rounds {
        for case in &mut cases {
            let (repeat, runs) = match case.timing {
                Timing::Repeat => (args.repeat, 1),
                Timing::Single => (1, args.singles),
            };
            let mut round = Vec::with_capacity(runs as usize);
            for _ in 0..runs {
                let outcome = match case.hook {
                    Hook::Xdp => fixture.run_xdp(case.program, &case.frame, repeat)?,
                    Hook::Tc => fixture.run_tc(case.program, &case.frame, repeat)?,
                };
                round.push(outcome.duration.as_nanos() as f64);
            }
            case.samples.push(median(&round));
        }
    }
    let baseline_of = |hook| {
        if hook == Hook::Xdp {
            PROG_BASELINE
        } else {
            PROG_TC_BASELINE
        }
    };
    let medians: Vec<f64> = cases.iter().map(|c| median(&c.samples)).collect();
    let baseline_median = |hook, timing| {
        cases
            .iter()
            .zip(&medians)
            .find(|(c, _)| c.program == baseline_of(hook) && c.timing == timing)
            .map_or(f64::NAN, |(_, m)| *m)
    };
    let rows: Vec<Row> = cases
        .iter()
        .zip(&medians)
        .map(|(case, &median_ns)| {
            let base = baseline_median(case.hook, case.timing);
            Row {
                program: case.program,
                class: case.class,
                timing: if case.timing == Timing::Repeat {
                    "repeat"
                } else {
                    "single"
                },
                median_ns,
                baseline: baseline_of(case.hook),
                baseline_median_ns: base,
                ratio: median_ns / base,
            }
        })
        .collect();
    let report = Report {
        rounds: args.rounds,
        repeat: args.repeat,
        rows,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report);
    }
    Ok(())
}

fn print_table(report: &Report) {
    println!(
        "BPF_PROG_TEST_RUN, {} interleaved rounds; repeat: kernel mean over {} iterations; \
         single: median of single-iteration runs (for programs that change the packet)",
        report.rounds, report.repeat
    );
    println!(
        "{:<14} {:<28} {:<7} {:>9} {:>7}  baseline",
        "program", "packet", "timing", "ns/pkt", "ratio"
    );
    for row in &report.rows {
        println!(
            "{:<14} {:<28} {:<7} {:>9.1} {:>7.2}  {} ({:.1} ns)",
            row.program,
            row.class,
            row.timing,
            row.median_ns,
            row.ratio,
            row.baseline,
            row.baseline_median_ns
        );
    }
}
