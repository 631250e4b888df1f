//! `cargo xtask fuzz [--frames N] [--objects N] [--seed S]`: hostile input at scale through
//! every entry program (`tests/src/fuzz.rs` says what is sent and which invariants are
//! checked), then hostile cluster objects through the decoding and every compile
//! (`tests/src/object_fuzz.rs`). Built in
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
    /// Mutated clusters through the object decoding and every stage's compile.
    #[arg(long, default_value_t = 2_000)]
    objects: u64,
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
            "--objects".into(),
            args.objects.to_string(),
        ],
    )
}
