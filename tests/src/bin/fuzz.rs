//! `cargo xtask fuzz [--frames N] [--objects N] [--seed S]`: random and mutated frames through
//! every entry program against a node's maps, with the invariants of `dataplane_tests::fuzz`
//! checked on each result; then mutated clusters through the object decoding and every
//! stage's compile (`dataplane_tests::object_fuzz`). Prints one line per program and one for
//! the objects; exits non-zero at the first broken invariant.

use std::time::Instant;

use clap::Parser;

#[derive(Parser)]
#[command(about = "Fuzz the kernel programs with BPF_PROG_TEST_RUN")]
struct Args {
    /// Frames per program.
    #[arg(long, default_value_t = 100_000)]
    frames: u64,
    /// Seed of the frame generator (the same seed gives the same frames).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Mutated clusters through the object decoding and every stage's compile (after the
    /// frames; the same seed gives the same clusters).
    #[arg(long, default_value_t = 2_000)]
    objects: u64,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let started = Instant::now();
    let reports = dataplane_tests::fuzz::run(args.frames, args.seed)
        .map_err(|error| anyhow::anyhow!("{error:#}"))?;
    println!(
        "fuzz: {} frames per program, seed {}, {:.1} s; every invariant held",
        args.frames,
        args.seed,
        started.elapsed().as_secs_f64()
    );
    for report in &reports {
        let verdicts: Vec<String> = report
            .verdicts
            .iter()
            .map(|(verdict, n)| format!("{verdict} {n}"))
            .collect();
        let mut drops: Vec<(&str, u64)> = report.drops.iter().map(|(r, n)| (*r, *n)).collect();
        drops.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
        let top: Vec<String> = drops
            .iter()
            .take(6)
            .map(|(reason, n)| format!("{reason} {n}"))
            .collect();
        println!(
            "  {:<12} {:>9} frames  verdicts: {}  drop reasons: {} distinct ({}{})",
            report.program,
            report.frames,
            verdicts.join(", "),
            drops.len(),
            top.join(", "),
            if drops.len() > 6 { ", ..." } else { "" }
        );
    }
    let started = Instant::now();
    let objects = dataplane_tests::object_fuzz::run(args.objects, args.seed)
        .map_err(|error| anyhow::anyhow!("{error:#}"))?;
    let refused: Vec<String> = objects
        .refused
        .iter()
        .map(|(kind, n)| format!("{kind} {n}"))
        .collect();
    println!(
        "fuzz: {} mutated clusters, seed {}, {:.1} s (slowest {:?}); every invariant held: {} compiled, refusals by kind: {}",
        objects.cases,
        args.seed,
        started.elapsed().as_secs_f64(),
        objects.slowest,
        objects.compiled,
        refused.join(", ")
    );
    Ok(())
}
