//! `cargo xtask fuzz [--frames N] [--seed S]`: hostile input at scale through every entry
//! program (`tests/src/fuzz.rs` says what is sent and which invariants are checked). Built in
//! the test profile, which `cargo xtask test` has already compiled: the kernel's work, not
//! the harness's, is what takes the time.

#[derive(clap::Args)]
pub struct Args {
    /// Frames per program.
    #[arg(long, default_value_t = 100_000)]
    frames: u64,
    /// Seed of the frame generator (the same seed gives the same frames).
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    crate::setup::run()?;
    crate::run_test_profile(
        "dataplane-tests",
        "fuzz",
        &[
            "--frames".into(),
            args.frames.to_string(),
            "--seed".into(),
            args.seed.to_string(),
        ],
    )
}
