//! `cargo xtask demo`: the README's main job on its embedded default.

use crate::run_checked;

#[derive(clap::Args)]
pub struct Args {
    /// Simulated nodes.
    #[arg(long, default_value_t = 2)]
    nodes: usize,
    /// Pods per node.
    #[arg(long, default_value_t = 2)]
    pods: usize,
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    crate::setup::run()?;
    crate::build_release_agent()?;
    run_checked(
        crate::cargo()
            .args([
                "run",
                "--quiet",
                "--release",
                "--package",
                "dataplane-tests",
                "--bin",
                "demo",
                "--",
            ])
            .args([
                "--nodes",
                &args.nodes.to_string(),
                "--pods",
                &args.pods.to_string(),
            ]),
    )
}
