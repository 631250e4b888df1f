//! Builds the kernel programs (dataplane-ebpf) for the BPF target and leaves the object in
//! OUT_DIR, where `src/ebpf.rs` embeds it. One toolchain: the stable one, with unstable flags
//! (`-Z build-std=core`) enabled for this nested build only.

fn main() -> anyhow::Result<()> {
    // SAFETY: build scripts are single-threaded; the variable is read by aya-build and inherited
    // by the nested cargo it spawns, nothing else in this process reads the environment.
    unsafe { std::env::set_var("RUSTC_BOOTSTRAP", "1") };
    let package = aya_build::Package {
        name: "dataplane-ebpf",
        root_dir: concat!(env!("CARGO_MANIFEST_DIR"), "/../dataplane-ebpf"),
        ..Default::default()
    };
    aya_build::build_ebpf([package], aya_build::Toolchain::Custom("stable"))
}
