//! Installs what building and testing need, checking first so a ready machine takes a second:
//! Debian packages (LLVM 22 for bpf-linker, iproute2, ping, python3, ethtool, capture and iperf tools,
//! podman with runc and busybox for the CNI plugin's container tests), the rust-src component
//! for `-Z build-std=core`, bpf-linker 0.13 built against LLVM 22, and scapy (the independent
//! packet encoder/decoder of the tests).

use std::process::Command;

use anyhow::Context as _;

use crate::run_checked;

/// Debian packages the build and the tests use.
const PACKAGES: &[&str] = &[
    "llvm-22-dev",
    "iproute2",
    "iputils-ping",
    "python3",
    "util-linux",
    "procps",
    "tshark",
    "iperf3",
    "ethtool",
    "nftables",
    // A real container runtime for the CNI plugin's tests (its CNI network backend).
    "podman",
    "runc",
    "busybox-static",
    // The reference plugins (ptp, host-local): the CNI benchmark's baseline.
    "containernetworking-plugins",
    // The root certificates the agent's image carries (`cargo xtask image`).
    "ca-certificates",
];
const BPF_LINKER_VERSION: &str = "0.13.0";
const LLVM_PREFIX: &str = "/usr/lib/llvm-22";

pub fn run() -> anyhow::Result<()> {
    install_packages()?;
    install_rust_src()?;
    install_bpf_linker()?;
    install_scapy()?;
    eprintln!("setup: all present");
    Ok(())
}

fn install_packages() -> anyhow::Result<()> {
    let missing: Vec<&str> = PACKAGES
        .iter()
        .copied()
        .filter(|p| !package_installed(p))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!("setup: installing {}", missing.join(" "));
    run_checked(Command::new("apt-get").args(["update", "-q"]))?;
    run_checked(
        Command::new("apt-get")
            .args(["install", "-y", "-q", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
}

fn package_installed(name: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", name])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
}

fn install_rust_src() -> anyhow::Result<()> {
    let installed = Command::new("rustup")
        .args(["component", "list", "--installed"])
        .current_dir(crate::workspace_root())
        .output()
        .context("running rustup")?;
    if String::from_utf8_lossy(&installed.stdout)
        .lines()
        .any(|l| l.starts_with("rust-src"))
    {
        return Ok(());
    }
    run_checked(
        Command::new("rustup")
            .args(["component", "add", "rust-src"])
            .current_dir(crate::workspace_root()),
    )
}

fn install_bpf_linker() -> anyhow::Result<()> {
    let present = Command::new("bpf-linker")
        .arg("--version")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains(BPF_LINKER_VERSION));
    if present {
        return Ok(());
    }
    eprintln!("setup: building bpf-linker {BPF_LINKER_VERSION} against LLVM 22 (about a minute)");
    run_checked(
        crate::cargo()
            .args([
                "install",
                "bpf-linker",
                "--locked",
                "--version",
                BPF_LINKER_VERSION,
            ])
            .args(["--no-default-features", "--features", "llvm-22", "--force"])
            .env("LLVM_PREFIX", LLVM_PREFIX),
    )
}

/// scapy from PyPI, for the machine's python3 (the tests run `python3`).
fn install_scapy() -> anyhow::Result<()> {
    let present = Command::new("python3")
        .args(["-c", "import scapy.contrib.geneve"])
        .output()
        .is_ok_and(|o| o.status.success());
    if present {
        return Ok(());
    }
    run_checked(Command::new("python3").args([
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
        "scapy>=2.5,<3",
    ]))
}
