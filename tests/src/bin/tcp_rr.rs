//! TCP request/response load for the topology benchmarks, run inside a pod's namespace (as
//! netperf's TCP_RR and TCP_CRR measure it): `serve` answers every one-byte request with one
//! byte; `rr` times round trips over one connection; `crr` times whole short connections
//! (connect, one request and its answer, close). The clients print one JSON line: what users
//! of a request/response service feel, where a packet rate says little.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream},
    time::{Duration, Instant},
};

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use serde::Serialize;

#[derive(Parser)]
struct Args {
    #[command(subcommand)]
    mode: Mode,
}

#[derive(Subcommand)]
enum Mode {
    /// Answer one-byte requests on `port` (every address) until `seconds` have passed.
    Serve {
        #[arg(long)]
        port: u16,
        #[arg(long, default_value_t = 60)]
        seconds: u64,
    },
    /// Round trips over one connection to `target` for `seconds`.
    Rr {
        target: SocketAddr,
        #[arg(long, default_value_t = 3)]
        seconds: u64,
    },
    /// Short connections to `target`, one after another, for `seconds`.
    Crr {
        target: SocketAddr,
        #[arg(long, default_value_t = 3)]
        seconds: u64,
    },
}

/// What a client measured: transactions (round trips or connections) per second and the
/// latency of one, at the median and the 99th percentile, on average and at most (a rate
/// below what the median says comes from the transactions past the 99th percentile).
#[derive(Serialize)]
struct Measured {
    transactions: u64,
    per_second: f64,
    p50_us: f64,
    p99_us: f64,
    mean_us: f64,
    max_us: f64,
}

/// How long a client keeps trying to reach a server that may still be starting.
const CONNECT_PATIENCE: Duration = Duration::from_secs(5);

fn main() -> anyhow::Result<()> {
    match Args::parse().mode {
        Mode::Serve { port, seconds } => serve(port, Duration::from_secs(seconds)),
        Mode::Rr { target, seconds } => print(&round_trips(target, Duration::from_secs(seconds))?),
        Mode::Crr { target, seconds } => print(&connections(target, Duration::from_secs(seconds))?),
    }
}

fn print(measured: &Measured) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string(measured)?);
    Ok(())
}

fn serve(port: u16, lifetime: Duration) -> anyhow::Result<()> {
    let listener = TcpListener::bind(("0.0.0.0", port)).context("binding the server")?;
    // The benchmark stops the server; this bounds its life if the benchmark cannot.
    std::thread::spawn(move || {
        std::thread::sleep(lifetime);
        std::process::exit(0);
    });
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        std::thread::spawn(move || answer(stream));
    }
    Ok(())
}

/// Answers each byte with one byte until the client closes.
fn answer(mut stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let mut byte = [0u8; 1];
    while stream.read_exact(&mut byte).is_ok() {
        if stream.write_all(&byte).is_err() {
            break;
        }
    }
}

/// One request and its answer.
fn exchange(stream: &mut TcpStream) -> anyhow::Result<()> {
    let mut byte = [1u8; 1];
    stream.write_all(&byte).context("request")?;
    stream.read_exact(&mut byte).context("answer")
}

fn connect_patiently(target: SocketAddr) -> anyhow::Result<TcpStream> {
    let give_up = Instant::now() + CONNECT_PATIENCE;
    loop {
        match TcpStream::connect(target) {
            Ok(stream) => return Ok(stream),
            Err(_) if Instant::now() < give_up => std::thread::sleep(Duration::from_millis(50)),
            Err(error) => return Err(error).context("connecting"),
        }
    }
}

fn round_trips(target: SocketAddr, duration: Duration) -> anyhow::Result<Measured> {
    let mut stream = connect_patiently(target)?;
    stream.set_nodelay(true)?;
    // The first exchange warms the path (the flow's first packets take the slow paths).
    exchange(&mut stream)?;
    let mut samples = Vec::new();
    let start = Instant::now();
    while start.elapsed() < duration {
        let at = Instant::now();
        exchange(&mut stream)?;
        samples.push(at.elapsed());
    }
    Ok(measured(samples, start.elapsed()))
}

fn connections(target: SocketAddr, duration: Duration) -> anyhow::Result<Measured> {
    // Wait for the server once; every timed connection must then succeed.
    drop(connect_patiently(target)?);
    let mut samples = Vec::new();
    let start = Instant::now();
    while start.elapsed() < duration {
        let at = Instant::now();
        let mut stream = TcpStream::connect(target).context("connecting")?;
        stream.set_nodelay(true)?;
        exchange(&mut stream)?;
        drop(stream);
        samples.push(at.elapsed());
    }
    Ok(measured(samples, start.elapsed()))
}

fn measured(mut samples: Vec<Duration>, elapsed: Duration) -> Measured {
    samples.sort_unstable();
    let at = |quantile: f64| {
        samples
            .get(((samples.len() as f64 - 1.0) * quantile).round() as usize)
            .map_or(f64::NAN, |d| d.as_secs_f64() * 1e6)
    };
    let total: Duration = samples.iter().sum();
    Measured {
        transactions: samples.len() as u64,
        per_second: samples.len() as f64 / elapsed.as_secs_f64(),
        p50_us: at(0.5),
        p99_us: at(0.99),
        mean_us: total.as_secs_f64() * 1e6 / samples.len().max(1) as f64,
        max_us: at(1.0),
    }
}
