//! The README's test command: set-up, formatting, lints on both sides, then every test. Under
//! CI (any truthy `CI`) privileged tests that cannot run fail instead of returning early;
//! elsewhere they return early, and the closing line counts them as not run.

use std::{
    io::{BufRead as _, BufReader},
    process::{Command, Stdio},
};

use anyhow::{Context as _, bail};

use crate::run_checked;

#[derive(clap::Args)]
pub struct Args {
    /// Only run tests whose name contains this.
    filter: Option<String>,
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    crate::setup::run()?;
    run_checked(crate::cargo().args(["fmt", "--all", "--check"]))?;
    run_checked(crate::cargo().args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]))?;
    crate::build_ebpf::build(true)?;
    // The topology and CLI tests run the real agent and plugin binaries.
    run_checked(crate::cargo().args(["build", "--package", "dataplane-user", "--bins"]))?;
    // The image the DaemonSet runs, which a topology test runs the agents from.
    crate::image::run()?;
    let mut test = crate::cargo();
    // Every test binary runs even after one fails: a run's log shows every failure at once.
    test.args(["test", "--workspace", "--no-fail-fast"]);
    if let Some(filter) = &args.filter {
        test.args(["--", filter]);
    }
    // Privileged tests that return early write their names here (the tests' `privileged`
    // gate): libtest counts them as passed, the closing line must not.
    let not_run = std::env::temp_dir().join(format!("dataplane-not-run-{}", std::process::id()));
    let _ = std::fs::remove_file(&not_run);
    test.env(NOT_RUN_LOG, &not_run);
    // The service tests again with the agents translating at the socket (`--socket-lb on`):
    // every Service behaviour must hold in both modes, NetworkPolicy, admin policies and
    // EgressFirewall must judge the backend a socket was given as they judge the per-packet
    // DNAT's (the cluster DNS reached over unconnected UDP among them), and egress IPs and
    // multicast must not notice.
    let socket_pass = suites_again(
        &[
            "lb_topology",
            "policy_topology",
            "admin_topology",
            "acl_topology",
            "egressip_topology",
            "multicast_topology",
        ],
        (SOCKET_LB_MODE, "on"),
        &not_run,
        args.filter.as_deref(),
    );
    // The uplink tests again with the uplinks on tc alone (`--uplink-hook tc`; the first
    // passes run XDP then tc): Geneve and VXLAN unwrapped, NodePorts served, egress IPs
    // answered and multicast copied by tc, with the same outcomes.
    let uplink_pass = suites_again(
        &[
            "overlay_topology",
            "lb_topology",
            "hybrid_topology",
            "egressip_topology",
            "multicast_topology",
            "fragment_topology",
        ],
        (UPLINK_HOOK, "tc"),
        &not_run,
        args.filter.as_deref(),
    );
    let result = run_and_total(&mut [test, socket_pass, uplink_pass], &not_run);
    let _ = std::fs::remove_file(&not_run);
    result
}

/// A second run of the topology test `suites` with the environment variable `mode` set (the
/// agents then run in that mode), their early returns logged in `not_run`.
fn suites_again(
    suites: &[&str],
    mode: (&str, &str),
    not_run: &std::path::Path,
    filter: Option<&str>,
) -> Command {
    let mut pass = crate::cargo();
    pass.args(["test", "--no-fail-fast", "--package", "dataplane-tests"]);
    for suite in suites {
        pass.args(["--test", suite]);
    }
    pass.env(mode.0, mode.1).env(NOT_RUN_LOG, not_run);
    if let Some(filter) = filter {
        pass.args(["--", filter]);
    }
    pass
}

/// The variable the tests' `privileged` gate reads (tests/src/privileged.rs `NOT_RUN_LOG`).
const NOT_RUN_LOG: &str = "DATAPLANE_NOT_RUN_LOG";
/// The variable that runs the topology tests' agents with `--socket-lb on`
/// (tests/src/topology.rs `SOCKET_LB_MODE`).
const SOCKET_LB_MODE: &str = "DATAPLANE_TEST_SOCKET_LB";

/// The variable that runs the topology tests' agents with `--uplink-hook` set to its value
/// (tests/src/topology.rs `UPLINK_HOOK`).
const UPLINK_HOOK: &str = "DATAPLANE_TEST_UPLINK_HOOK";

/// Runs each cargo test command in turn, passing its output through, and closes with one
/// line totalling every test binary's result, so a reader (or CI) sees the whole count rather
/// than the last binary's, and how many privileged tests returned without running (named in
/// `not_run`). A failing command fails the run, after the others have run.
fn run_and_total(commands: &mut [Command], not_run: &std::path::Path) -> anyhow::Result<()> {
    let mut totals = Totals::default();
    let mut failed = Vec::new();
    for command in commands.iter_mut() {
        eprintln!("+ {}", crate::describe(command));
        let mut child = command
            .stdout(Stdio::piped())
            .spawn()
            .context("starting cargo test")?;
        let stdout = child.stdout.take().context("cargo test stdout")?;
        for line in BufReader::new(stdout).lines() {
            let line = line.context("reading cargo test output")?;
            println!("{line}");
            totals.add(&line);
        }
        let status = child.wait().context("waiting for cargo test")?;
        if !status.success() {
            failed.push(status);
        }
    }
    let not_run: Vec<String> = std::fs::read_to_string(not_run)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect();
    for test in &not_run {
        println!("not run (needs root): {test}");
    }
    println!("{}", totals.closing_line(not_run.len() as u64));
    if let Some(status) = failed.first() {
        bail!("cargo test failed: {status}");
    }
    if totals.passed <= not_run.len() as u64 {
        bail!("no test ran");
    }
    Ok(())
}

#[derive(Default)]
struct Totals {
    passed: u64,
    failed: u64,
    ignored: u64,
}

impl Totals {
    /// The run's last line: the counts, with the tests that returned early taken out of the
    /// passed ones, and a run that left some out called incomplete.
    fn closing_line(&self, not_run: u64) -> String {
        let passed = self.passed.saturating_sub(not_run);
        let counts = format!(
            "{passed} passed, {} failed, {} skipped, {not_run} not run",
            self.failed, self.ignored
        );
        if not_run == 0 {
            counts
        } else {
            format!(
                "{counts}: INCOMPLETE, {not_run} privileged test(s) returned without running (run as root for the whole suite)"
            )
        }
    }

    /// Adds a libtest summary line: `test result: ok. 4 passed; 0 failed; 1 ignored; ...`.
    fn add(&mut self, line: &str) {
        let Some(rest) = line.strip_prefix("test result: ") else {
            return;
        };
        for part in rest.split(';') {
            let mut words = part.split_whitespace().rev();
            let (Some(label), Some(count)) = (words.next(), words.next()) else {
                continue;
            };
            let Ok(count) = count.parse::<u64>() else {
                continue;
            };
            match label {
                "passed" => self.passed += count,
                "failed" => self.failed += count,
                "ignored" => self.ignored += count,
                _ => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Totals;

    #[test]
    fn totals_sum_libtest_summaries() {
        let mut totals = Totals::default();
        totals.add("test result: ok. 4 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 3.09s");
        totals
            .add("test result: FAILED. 2 passed; 3 failed; 0 ignored; 0 measured; 0 filtered out");
        totals.add("running 4 tests");
        assert_eq!((totals.passed, totals.failed, totals.ignored), (6, 3, 1));
        assert_eq!(
            totals.closing_line(0),
            "6 passed, 3 failed, 1 skipped, 0 not run"
        );
        assert_eq!(
            totals.closing_line(2),
            "4 passed, 3 failed, 1 skipped, 2 not run: INCOMPLETE, 2 privileged test(s) returned without running (run as root for the whole suite)"
        );
    }
}
