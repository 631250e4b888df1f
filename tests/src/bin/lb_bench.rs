//! Per-packet cost of the service load-balancer with BPF_PROG_TEST_RUN: a tracked flow
//! (conntrack hit), a new flow through the Maglev table, a new connection of a client with
//! ClientIP affinity, each next to the empty tc program, and each with 10 and with 10,000
//! services installed, and with 10 services in a backends array of the largest size
//! (`--max-backends 1048576`, against the default 262,144): three loaded copies of the
//! programs, measured in interleaved rounds.
//! Backends are outside the pod network so only the load-balancer's work is timed. A
//! benchmark: it reports, it does not pass or fail.

use clap::Parser;
use dataplane_common::{
    lb::{MAX_BACKEND_SLOTS, SCOPE_CLUSTER, ServiceKey},
    maps::PROG_FROM_POD,
    testbed::PROG_TC_BASELINE,
};
use dataplane_tests::median;
use dataplane_tests::{fixture::Fixture, packets::tcp_v4_flow};
use dataplane_user::{
    kernel::capacity::Capacities,
    lb::{BackendAddr, LbState, ServicePort},
    mapsync::addr16,
};
use serde::Serialize;

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = 9)]
    rounds: u32,
    /// Single-iteration runs per case and round.
    #[arg(long, default_value_t = 1_000)]
    singles: u32,
    #[arg(long)]
    json: bool,
}

/// What a case sends: the same frame every run, or a new flow (source port) every run.
#[derive(Clone, Copy, PartialEq)]
enum Case {
    Baseline,
    ConntrackHit,
    NewFlowMaglev,
    AffinityHit,
}

impl Case {
    const ALL: [Case; 4] = [
        Case::Baseline,
        Case::ConntrackHit,
        Case::NewFlowMaglev,
        Case::AffinityHit,
    ];

    fn name(self) -> &'static str {
        match self {
            Case::Baseline => "empty tc program",
            Case::ConntrackHit => "conntrack hit (DNAT)",
            Case::NewFlowMaglev => "new flow, Maglev choice",
            Case::AffinityHit => "new connection, affinity hit",
        }
    }

    /// The frame of run `n`.
    fn frame(self, n: u32) -> Vec<u8> {
        let client = [10, 244, 1, 9];
        match self {
            Case::Baseline | Case::ConntrackHit => {
                tcp_v4_flow(client, 40000, [10, 96, 0, 1], 80, false)
            }
            // One client's new connections: source ports never repeat within 64,000 runs
            // (the default run makes 18,000).
            Case::NewFlowMaglev => {
                tcp_v4_flow(client, 1024 + (n % 64_000) as u16, [10, 96, 0, 1], 80, true)
            }
            Case::AffinityHit => {
                tcp_v4_flow(client, 1024 + (n % 60_000) as u16, [10, 95, 0, 1], 80, true)
            }
        }
    }
}

/// tc's drop verdict.
const TC_ACT_SHOT: u32 = 2;

#[derive(Serialize)]
struct Row {
    case: &'static str,
    services: usize,
    /// The backends array's size.
    backends_capacity: u32,
    median_ns: f64,
    baseline_ns: f64,
    ratio_to_empty: f64,
    /// This case over the same case at 10 services in the default-size array.
    ratio_to_first: f64,
}

fn service(vip: [u8; 4], affinity: u32) -> ServicePort {
    let backends = (0..3)
        .map(|i| BackendAddr {
            ip: [192, 0, 2, 10 + i].into(),
            port: 8080,
        })
        .collect();
    ServicePort {
        name: format!("bench/{vip:?}"),
        kind: dataplane_user::lb::AddressKind::ClusterIp,
        key: ServiceKey {
            addr: addr16(vip.into()),
            port_be: 80u16.to_be_bytes(),
            protocol: 6,
            scope: SCOPE_CLUSTER,
        },
        affinity_timeout: affinity,
        ready: backends,
        terminating: Vec::new(),
        source_ranges: Vec::new(),
        topology: None,
    }
}

/// Programs loaded with `count` services (10.96.x.y:80), plus one with ClientIP affinity, in
/// a backends array of `backends` entries.
fn loaded_with(count: usize, backends: u32) -> anyhow::Result<Fixture> {
    let mut fixture = Fixture::load_with(&Capacities {
        backends,
        ..Capacities::default()
    })?;
    let mut ports: Vec<ServicePort> = (0..count)
        // 254 per /24, skipping .0 and .255 (`i & 0xff` + 1 overflowed at 255).
        .map(|i| service([10, 96, (i / 254) as u8, (i % 254) as u8 + 1], 0))
        .collect();
    ports.push(service([10, 95, 0, 1], 10_800));
    fixture.sync_lb(&mut LbState::default(), &ports)?;
    Ok(fixture)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        args.rounds > 0 && args.singles > 0,
        "rounds and singles must be positive"
    );
    let default = Capacities::default().backends;
    let sizes = [
        (10usize, default),
        (10_000, default),
        (10, MAX_BACKEND_SLOTS),
    ];
    let mut fixtures = Vec::new();
    for (services, backends) in sizes {
        fixtures.push(loaded_with(services, backends)?);
    }
    // samples[fixture][case]
    let mut samples = vec![vec![Vec::new(); Case::ALL.len()]; sizes.len()];
    let mut flow = 0u32;
    for _ in 0..args.rounds {
        for (f, fixture) in fixtures.iter_mut().enumerate() {
            for (c, case) in Case::ALL.iter().enumerate() {
                let program = if *case == Case::Baseline {
                    PROG_TC_BASELINE
                } else {
                    PROG_FROM_POD
                };
                let frames: Vec<Vec<u8>> = (0..args.singles)
                    .map(|_| {
                        flow += 1;
                        case.frame(flow)
                    })
                    .collect();
                let mut round = Vec::with_capacity(frames.len());
                // The client pod passes port security (set up outside the timing).
                fixture.port_as_sender_of(&frames[0])?;
                // The tracked flow is opened by its SYN, as any connection is (outside the
                // timing: only an opening makes entries).
                if *case == Case::ConntrackHit {
                    let syn = tcp_v4_flow([10, 244, 1, 9], 40000, [10, 96, 0, 1], 80, true);
                    fixture.run_tc(program, &syn, 1)?;
                }
                for frame in &frames {
                    let run = fixture.run_tc(program, frame, 1)?;
                    anyhow::ensure!(
                        run.action != TC_ACT_SHOT,
                        "{}: the program dropped the benchmark's packet",
                        case.name()
                    );
                    round.push(run.duration.as_nanos() as f64);
                }
                samples[f][c].push(median(&round));
            }
        }
    }
    let medians: Vec<Vec<f64>> = samples
        .iter_mut()
        .map(|cases| cases.iter().map(|s| median(s)).collect())
        .collect();
    let mut rows = Vec::new();
    for (f, &(services, backends_capacity)) in sizes.iter().enumerate() {
        for (c, case) in Case::ALL.iter().enumerate() {
            rows.push(Row {
                case: case.name(),
                services,
                backends_capacity,
                median_ns: medians[f][c],
                baseline_ns: medians[f][0],
                ratio_to_empty: medians[f][c] / medians[f][0],
                ratio_to_first: medians[f][c] / medians[0][c],
            });
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    println!(
        "service load-balancer, BPF_PROG_TEST_RUN single runs ({} rounds x {} runs, medians)",
        args.rounds, args.singles
    );
    println!(
        "{:<32} {:>9} {:>9} {:>9} {:>14} {:>16}",
        "case", "services", "backends", "ns/pkt", "x empty prog", "x first setup"
    );
    for row in &rows {
        println!(
            "{:<32} {:>9} {:>9} {:>9.1} {:>14.2} {:>16.2}",
            row.case,
            row.services,
            row.backends_capacity,
            row.median_ns,
            row.ratio_to_empty,
            row.ratio_to_first
        );
    }
    Ok(())
}
