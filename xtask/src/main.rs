//! `cargo xtask <command>`: the project's set-up, build, test, benchmark and demo entry points.
//! Depends on nothing of the project itself, so `setup` can run before bpf-linker exists.

mod bench;
mod build_ebpf;
mod crds;
mod demo;
mod fuzz;
mod image;
mod setup;
mod test;
mod verify;

use std::{path::PathBuf, process::Command};

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "xtask", about = "Project tasks")]
struct Cli {
    #[command(subcommand)]
    command: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install what a fresh machine lacks (idempotent, quick when all is present).
    Setup,
    /// Build the kernel programs into an eBPF object.
    BuildEbpf(build_ebpf::Args),
    /// Formatting, lints (host and BPF target) and every test, privileged ones included.
    Test(test::Args),
    /// Per-packet cost of the programs next to an empty program measured in the same run.
    Bench(bench::Args),
    /// Bring up simulated nodes with pods, run the agent on each, show traffic, clean up.
    Demo(demo::Args),
    /// Load every kernel program into this kernel and show each one's verifier and stack
    /// margin; with limits, fail when one is over them.
    Verify(verify::Args),
    /// Random and mutated frames through every program, invariants checked on each result.
    Fuzz(fuzz::Args),
    /// Regenerate deploy/crds/ from the agent's Rust types (the tests only compare).
    Crds,
    /// Build the agent's container image (deploy/Containerfile) with no image registry.
    Image,
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Task::Setup => setup::run(),
        Task::BuildEbpf(args) => build_ebpf::run(&args),
        Task::Test(args) => test::run(&args),
        Task::Bench(args) => bench::run(&args),
        Task::Demo(args) => demo::run(&args),
        Task::Verify(args) => verify::run(&args),
        Task::Fuzz(args) => fuzz::run(&args),
        Task::Crds => crds::run(),
        Task::Image => image::run(),
    }
}

/// The workspace root (xtask lives one level below it).
fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask has a parent directory")
        .to_owned()
}

/// `cargo` as invoked by the current cargo (same toolchain), run from the workspace root.
fn cargo() -> Command {
    let mut command = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    command.current_dir(workspace_root());
    command
}

/// Builds the agent binary in release mode (the demo's and the topology benches' nodes run it).
fn build_release_agent() -> anyhow::Result<()> {
    build_release("dataplane-user", "dataplane")?;
    build_release("dataplane-user", "dataplane-cni")?;
    build_release("dataplane-user", "egress-router")
}

/// Builds one binary of the workspace in release mode.
fn build_release(package: &str, binary: &str) -> anyhow::Result<()> {
    run_checked(cargo().args([
        "build",
        "--quiet",
        "--release",
        "--package",
        package,
        "--bin",
        binary,
    ]))
}

/// Runs a binary of the test bed (bench, throughput, demo) in release mode with `args`.
fn run_testbed(binary: &str, args: &[String]) -> anyhow::Result<()> {
    run_checked(
        cargo()
            .args([
                "run",
                "--quiet",
                "--release",
                "--package",
                "dataplane-tests",
            ])
            .args(["--bin", binary, "--"])
            .args(args),
    )
}

/// Runs `binary` of `package` in the test profile (which `cargo xtask test` has built) with
/// `args`.
fn run_test_profile(package: &str, binary: &str, args: &[String]) -> anyhow::Result<()> {
    run_checked(
        cargo()
            .args([
                "run",
                "--quiet",
                "--package",
                package,
                "--bin",
                binary,
                "--",
            ])
            .args(args),
    )
}

/// Runs `command`, echoing it, and fails on a non-zero exit.
fn run_checked(command: &mut Command) -> anyhow::Result<()> {
    eprintln!("+ {}", describe(command));
    let status = command
        .status()
        .with_context(|| format!("starting {}", describe(command)))?;
    if !status.success() {
        bail!("{} failed: {status}", describe(command));
    }
    Ok(())
}

fn describe(command: &Command) -> String {
    let mut text = command.get_program().to_string_lossy().into_owned();
    for arg in command.get_args() {
        text.push(' ');
        text.push_str(&arg.to_string_lossy());
    }
    text
}
