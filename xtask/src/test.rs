//! The README's test command: set-up, formatting, lints on both sides, then every test. Under
//! `CI=true` privileged tests that cannot run fail instead of returning early.

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
    let mut test = crate::cargo();
    test.args(["test", "--workspace"]);
    if let Some(filter) = &args.filter {
        test.args(["--", filter]);
    }
    run_and_total(&mut test)
}

/// Runs cargo test, passing its output through, and closes with one line totalling every test
/// binary's result, so a reader (or CI) sees the whole count rather than the last binary's.
fn run_and_total(command: &mut Command) -> anyhow::Result<()> {
    eprintln!("+ {}", crate::describe(command));
    let mut child = command
        .stdout(Stdio::piped())
        .spawn()
        .context("starting cargo test")?;
    let stdout = child.stdout.take().context("cargo test stdout")?;
    let mut totals = Totals::default();
    for line in BufReader::new(stdout).lines() {
        let line = line.context("reading cargo test output")?;
        println!("{line}");
        totals.add(&line);
    }
    let status = child.wait().context("waiting for cargo test")?;
    println!(
        "{} passed, {} failed, {} skipped",
        totals.passed, totals.failed, totals.ignored
    );
    if !status.success() {
        bail!("cargo test failed: {status}");
    }
    if totals.passed == 0 {
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
    }
}
