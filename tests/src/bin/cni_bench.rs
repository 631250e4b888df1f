//! How long a pod waits for its network, and what each pod costs the agent.
//!
//! ADD latency: `--pods` containers (100) created `--parallel` at a time (10), each ADD run as
//! a container runtime runs it, timed from the plugin's start to its exit: the pod's veth,
//! addresses, routes, its overlay entry, policy and service state in the maps and the programs
//! attached. Target: p99 under 200 ms. The baseline, measured in the same run on the same
//! node: the reference plugins `ptp` + `host-local` (containernetworking-plugins), which make
//! a veth pair and allocate an address, and install no dataplane state. DEL is timed too.
//!
//! Memory: the agent's resident set before and after the pods, per pod; and the IPAM state on
//! disk per pod. A benchmark: it reports, it does not pass or fail.

use std::{
    io::Write as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, ensure};
use clap::Parser;
use dataplane_tests::{
    cni::{self, Container},
    topology::{Mode, Topology, dataplane_binary},
};
use serde::Serialize;

#[derive(Parser)]
struct Args {
    /// Containers to create.
    #[arg(long, default_value_t = 100)]
    pods: usize,
    /// ADDs in flight at once.
    #[arg(long, default_value_t = 10)]
    parallel: usize,
    #[arg(long)]
    json: bool,
}

/// The reference plugins (Debian's containernetworking-plugins).
const REFERENCE_PLUGINS: &str = "/usr/lib/cni";

#[derive(Serialize)]
struct Latencies {
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
}

#[derive(Serialize)]
struct Report {
    pods: usize,
    parallel: usize,
    add: Latencies,
    del: Latencies,
    baseline_add: Latencies,
    baseline_del: Latencies,
    /// Our p99 over the reference plugins' p99.
    add_p99_ratio: f64,
    agent_rss_before_kib: u64,
    agent_rss_after_kib: u64,
    agent_kib_per_pod: f64,
    ipam_bytes_per_pod: f64,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    dataplane_tests::topology::agents_as_deployed();
    ensure!(
        args.pods >= 1 && args.parallel >= 1,
        "--pods and --parallel take 1 or more"
    );
    ensure!(args.pods <= 250, "at most 250 pods (one /24 of the node)");
    ensure!(
        Path::new(REFERENCE_PLUGINS).join("ptp").exists(),
        "{REFERENCE_PLUGINS}/ptp missing: cargo xtask setup installs containernetworking-plugins"
    );
    let _ = dataplane_binary();
    let mut topology = Topology::build_with(1, 0, Mode::Overlay)?;
    // As deployed (see `main`): the test bed's full recompute every 2 s would stall the
    // agent's loop for a few hundred milliseconds with 100 pods.
    let agent = topology.node(0).start_agent()?;
    let conf = cni::conf("1.1.0", &cni::socket(&agent));
    let pid = agent.pid().context("the agent's pid")?;
    // Let the agent settle after its first sync before taking its size.
    std::thread::sleep(Duration::from_millis(500));
    let rss_before = rss_kib(pid)?;

    let ours: Vec<Container> = (0..args.pods)
        .map(|i| cni::container(&mut topology, "default", &format!("bench-{i}")))
        .collect::<anyhow::Result<_>>()?;
    let add = timed_in_waves(&ours, args.parallel, |c| {
        let answer = c.run("ADD", &conf)?;
        ensure!(answer.success, "ADD failed: {:?}", answer.output);
        Ok(())
    })?;
    std::thread::sleep(Duration::from_millis(500));
    let rss_after = rss_kib(pid)?;
    let ipam_bytes = std::fs::metadata(agent.run_dir.join("ipam.json"))?.len();
    let del = timed_in_waves(&ours, args.parallel, |c| {
        let answer = c.run("DEL", &conf)?;
        ensure!(answer.success, "DEL failed: {:?}", answer.output);
        Ok(())
    })?;

    // The baseline: the same number of containers on the same node through ptp + host-local.
    let node_netns = topology.node(0).netns.clone();
    let data_dir = std::env::temp_dir().join(dataplane_tests::unique_name("host-local"));
    let reference: Vec<Container> = (0..args.pods)
        .map(|i| cni::container(&mut topology, "default", &format!("ref-{i}")))
        .collect::<anyhow::Result<_>>()?;
    let reference_conf = serde_json::json!({
        "cniVersion": "1.0.0",
        "name": "reference",
        "type": "ptp",
        "ipam": {"type": "host-local", "subnet": "10.250.0.0/24", "dataDir": data_dir},
    })
    .to_string();
    let baseline_add = timed_in_waves(&reference, args.parallel, |c| {
        reference_plugin(&node_netns, "ADD", c, &reference_conf)
    })?;
    let baseline_del = timed_in_waves(&reference, args.parallel, |c| {
        reference_plugin(&node_netns, "DEL", c, &reference_conf)
    })?;
    let _ = std::fs::remove_dir_all(&data_dir);
    if std::env::var("CNI_BENCH_LOG").is_ok() {
        eprintln!("{}", agent.log());
    }

    let add = latencies(add);
    let baseline_add = latencies(baseline_add);
    let report = Report {
        pods: args.pods,
        parallel: args.parallel,
        add_p99_ratio: add.p99_ms / baseline_add.p99_ms,
        add,
        del: latencies(del),
        baseline_add,
        baseline_del: latencies(baseline_del),
        agent_rss_before_kib: rss_before,
        agent_rss_after_kib: rss_after,
        agent_kib_per_pod: (rss_after as f64 - rss_before as f64) / args.pods as f64,
        ipam_bytes_per_pod: ipam_bytes as f64 / args.pods as f64,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report);
    }
    Ok(())
}

fn print_table(r: &Report) {
    println!(
        "CNI ADD/DEL: {} pods, {} at a time (ms; baseline: ptp + host-local, no dataplane state)",
        r.pods, r.parallel
    );
    println!("  {:<22} {:>8} {:>8} {:>8}", "", "p50", "p99", "max");
    for (name, l) in [
        ("dataplane-cni ADD", &r.add),
        ("ptp+host-local ADD", &r.baseline_add),
        ("dataplane-cni DEL", &r.del),
        ("ptp+host-local DEL", &r.baseline_del),
    ] {
        println!(
            "  {name:<22} {:>8.1} {:>8.1} {:>8.1}",
            l.p50_ms, l.p99_ms, l.max_ms
        );
    }
    println!(
        "  ADD p99 ratio to the baseline: {:.2} (target: p99 under 200 ms)",
        r.add_p99_ratio
    );
    println!(
        "agent memory: {} KiB before, {} KiB after: {:.1} KiB per pod; IPAM state {:.0} bytes per pod",
        r.agent_rss_before_kib, r.agent_rss_after_kib, r.agent_kib_per_pod, r.ipam_bytes_per_pod
    );
}

/// Runs `work` for every container, `parallel` at a time (a wave starts when the last one
/// ended), and returns each run's duration.
fn timed_in_waves(
    containers: &[Container],
    parallel: usize,
    work: impl Fn(&Container) -> anyhow::Result<()> + Sync,
) -> anyhow::Result<Vec<Duration>> {
    let mut durations = Vec::new();
    for wave in containers.chunks(parallel) {
        let results: Vec<anyhow::Result<Duration>> = std::thread::scope(|scope| {
            let handles: Vec<_> = wave
                .iter()
                .map(|container| {
                    let work = &work;
                    scope.spawn(move || {
                        let started = Instant::now();
                        work(container)?;
                        Ok(started.elapsed())
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("a bench thread"))
                .collect()
        });
        for result in results {
            durations.push(result?);
        }
    }
    Ok(durations)
}

/// Runs the reference `ptp` plugin for `container` in the node's namespace (where its host
/// side goes), as a runtime would.
fn reference_plugin(
    node_netns: &str,
    command: &str,
    container: &Container,
    conf: &str,
) -> anyhow::Result<()> {
    let netns = container.netns_path();
    let mut child = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{node_netns}"))
        .arg(PathBuf::from(REFERENCE_PLUGINS).join("ptp"))
        .env_clear()
        .env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", &container.id)
        .env("CNI_NETNS", &netns)
        .env("CNI_IFNAME", "eth0")
        .env("CNI_PATH", REFERENCE_PLUGINS)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    child
        .stdin
        .take()
        .context("stdin")?
        .write_all(conf.as_bytes())?;
    let out = child.wait_with_output()?;
    ensure!(
        out.status.success(),
        "ptp {command}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

fn latencies(mut samples: Vec<Duration>) -> Latencies {
    samples.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    // Nearest rank.
    let rank = |q: f64| {
        let index = ((q * samples.len() as f64).ceil() as usize).clamp(1, samples.len()) - 1;
        ms(samples[index])
    };
    Latencies {
        p50_ms: rank(0.50),
        p99_ms: rank(0.99),
        max_ms: ms(*samples.last().expect("samples")),
    }
}

/// The resident set of process `pid`.
fn rss_kib(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .context("VmRSS")
}
