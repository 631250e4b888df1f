//! TCP request/response measurements between namespaces of a topology, with the `tcp_rr`
//! tool built next to the benchmark binaries: round trips over one connection (TCP_RR) and
//! whole short connections (TCP_CRR), as users of a request/response service feel them.

use std::process::{Child, Command, Stdio};

use anyhow::{Context as _, bail};
use serde::{Deserialize, Serialize};

/// What one measurement gave: transactions per second and one transaction's latency at the
/// median and the 99th percentile, on average and at most.
#[derive(Clone, Copy, Debug, Deserialize, Serialize)]
pub struct Transactions {
    pub per_second: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub mean_us: f64,
    pub max_us: f64,
}

/// What is timed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// One-byte round trips over one connection (TCP_RR).
    RoundTrips,
    /// Connect, one round trip, close (TCP_CRR).
    Connections,
}

fn tool() -> anyhow::Result<std::path::PathBuf> {
    Ok(std::env::current_exe()?.with_file_name("tcp_rr"))
}

/// A `tcp_rr` server answering on `port` in a namespace; stopped when dropped.
pub struct Server(Child);

impl Server {
    /// Starts the server in `netns` (it gives up by itself after ten minutes).
    pub fn start(netns: &str, port: u16) -> anyhow::Result<Self> {
        let child = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{netns}"))
            .arg(tool()?)
            .args(["serve", "--port", &port.to_string(), "--seconds", "600"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting the tcp_rr server")?;
        Ok(Self(child))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Times `kind` from `netns` to `target` (address:port) for `seconds`.
pub fn measure(
    netns: &str,
    kind: Kind,
    target: &str,
    seconds: u64,
) -> anyhow::Result<Transactions> {
    let mode = match kind {
        Kind::RoundTrips => "rr",
        Kind::Connections => "crr",
    };
    if kind == Kind::Connections {
        // As connection-rate benchmarks run: the client may reuse its ports in TIME_WAIT
        // (TCP timestamps tell the segments apart), or its own 60 s of TIME_WAIT per port,
        // not the path, would bound the rate after a few seconds.
        crate::topology::run_in(netns, &["sysctl", "-qw", "net.ipv4.tcp_tw_reuse=1"])?;
    }
    let run = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{netns}"))
        .arg(tool()?)
        .args([mode, target, "--seconds", &seconds.to_string()])
        .output()
        .context("running the tcp_rr client")?;
    if !run.status.success() {
        bail!(
            "tcp_rr {mode} {target}: {}",
            String::from_utf8_lossy(&run.stderr)
        );
    }
    Ok(serde_json::from_slice(&run.stdout)?)
}

/// The median of one field over rounds.
pub fn median_of(runs: &[Transactions], field: fn(&Transactions) -> f64) -> f64 {
    crate::median(&runs.iter().map(field).collect::<Vec<_>>())
}

/// One line: the median rate and latencies, then each round's rate.
pub fn summary(runs: &[Transactions]) -> String {
    format!(
        "median {:.0}/s, p50 {:.1} us, p99 {:.1} us, mean {:.1} us, max {:.0} us  [{}]",
        median_of(runs, |r| r.per_second),
        median_of(runs, |r| r.p50_us),
        median_of(runs, |r| r.p99_us),
        median_of(runs, |r| r.mean_us),
        median_of(runs, |r| r.max_us),
        runs.iter()
            .map(|r| format!("{:.0}", r.per_second))
            .collect::<Vec<_>>()
            .join(", ")
    )
}
