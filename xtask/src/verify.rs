//! `cargo xtask verify`: loads every kernel program into this kernel (nothing attached) and
//! prints the room each leaves under the verifier's limits (`dataplane verify`). With limits
//! given, fails when a program is over them: CI guards the margin this way.

#[derive(clap::Args)]
pub struct Args {
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Fail when a program verifies at more than this share of the 1M-instruction budget.
    #[arg(long)]
    max_budget_percent: Option<f64>,
    /// Fail when a program's deepest call chain needs more stack than this many bytes.
    #[arg(long)]
    max_stack: Option<u32>,
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    crate::setup::run()?;
    let mut verify = vec!["verify".to_owned()];
    if args.json {
        verify.push("--json".into());
    }
    if let Some(max) = args.max_budget_percent {
        verify.extend(["--max-budget-percent".into(), max.to_string()]);
    }
    if let Some(max) = args.max_stack {
        verify.extend(["--max-stack".into(), max.to_string()]);
    }
    crate::run_test_profile("dataplane-user", "dataplane", &verify)
}
