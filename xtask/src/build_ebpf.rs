//! Builds the kernel programs on their own, the same way dataplane-user's build script does
//! (stable toolchain, `-Z build-std=core` enabled for this build only, BTF emitted).

use crate::{run_checked, workspace_root};

#[derive(clap::Args)]
pub struct Args {
    /// Only lint the kernel crate (clippy for the BPF target, warnings denied).
    #[arg(long)]
    clippy: bool,
}

const TARGET: &str = "bpfel-unknown-none";

pub fn run(args: &Args) -> anyhow::Result<()> {
    crate::setup::run()?;
    build(args.clippy)
}

/// Builds (or, with `clippy`, lints) the kernel crate for the BPF target.
pub fn build(clippy: bool) -> anyhow::Result<()> {
    let subcommand = if clippy { "clippy" } else { "build" };
    let mut command = crate::cargo();
    command
        .args([
            subcommand,
            "--package",
            "dataplane-ebpf",
            "--release",
            "--target",
            TARGET,
        ])
        .args(["-Z", "build-std=core"])
        .env("RUSTC_BOOTSTRAP", "1")
        .env("CARGO_ENCODED_RUSTFLAGS", bpf_rustflags());
    if clippy {
        command.args(["--", "-D", "warnings"]);
    }
    run_checked(&mut command)?;
    if !clippy {
        let object = workspace_root()
            .join("target")
            .join(TARGET)
            .join("release")
            .join("dataplane-ebpf");
        println!("{}", object.display());
    }
    Ok(())
}

/// The flags aya-build passes: the target architecture cfg, debug info, and BTF from the linker.
fn bpf_rustflags() -> String {
    let arch = std::env::consts::ARCH;
    [
        format!("--cfg=bpf_target_arch=\"{arch}\""),
        "-Cdebuginfo=2".into(),
        "-Clink-arg=--btf".into(),
    ]
    .join("\x1f")
}
