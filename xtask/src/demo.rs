//! `cargo xtask demo`: the README's main job on its embedded default.

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
    let demo = [
        "--nodes".to_owned(),
        args.nodes.to_string(),
        "--pods".to_owned(),
        args.pods.to_string(),
    ];
    crate::run_testbed("demo", &demo)
}
