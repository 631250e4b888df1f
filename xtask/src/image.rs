//! `cargo xtask image`: the agent's container image (deploy/Containerfile), built with no image
//! registry: a root filesystem of the release binaries (`dataplane`, `dataplane-cni`, `egress-router`) and the
//! two programs the agent runs (`ip` from iproute2, `nft` from nftables, which `cargo xtask
//! setup` installs), each with the shared libraries `ldd` names, and the root certificates,
//! copied from this machine;
//! then `podman build` from scratch. `cargo xtask test` builds it before the tests, and a
//! topology test runs the agents from it the way the DaemonSet does.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail};

use crate::run_checked;

/// The image's name in the local store (tag it for your registry to push it).
pub const IMAGE: &str = "localhost/dataplane:dev";

/// Builds the release binaries and the image.
pub fn run() -> anyhow::Result<()> {
    crate::build_release_agent()?;
    build()
}

/// Builds the image from the release binaries already built.
pub fn build() -> anyhow::Result<()> {
    let root = crate::workspace_root();
    let context = root.join("target/image");
    let rootfs = context.join("rootfs");
    if rootfs.exists() {
        fs::remove_dir_all(&rootfs).with_context(|| format!("clearing {}", rootfs.display()))?;
    }
    for dir in [
        "usr/local/bin",
        "usr/sbin",
        "etc",
        "tmp",
        "run",
        "var/lib",
        "var/log",
    ] {
        fs::create_dir_all(rootfs.join(dir))?;
    }
    let release = root.join("target/release");
    for binary in ["dataplane", "dataplane-cni", "egress-router"] {
        place(
            &release.join(binary),
            &rootfs.join("usr/local/bin").join(binary),
        )?;
    }
    for program in ["ip", "nft"] {
        let found = which(program)?;
        place(&found, &rootfs.join("usr/sbin").join(program))?;
    }
    // The TLS client of the API server loads the system's root certificates and refuses to
    // start with none (even where the service account's CA is the one that signs).
    let certificates = Path::new("/etc/ssl/certs/ca-certificates.crt");
    fs::create_dir_all(rootfs.join("etc/ssl/certs"))?;
    fs::copy(
        certificates,
        rootfs.join("etc/ssl/certs/ca-certificates.crt"),
    )
    .with_context(|| format!("{} (Debian's ca-certificates)", certificates.display()))?;
    // The agent resolves nothing by name but its API server; nsswitch keeps glibc to files
    // and DNS.
    fs::write(rootfs.join("etc/nsswitch.conf"), "hosts: files dns\n")?;
    fs::write(
        rootfs.join("etc/passwd"),
        "root:x:0:0:root:/:/usr/sbin/nologin\n",
    )?;
    run_checked(
        Command::new("podman")
            .env("CONTAINERS_CONF", containers_conf(&context)?)
            .args(["build", "--quiet", "--file"])
            .arg(root.join("deploy/Containerfile"))
            .args(["--tag", IMAGE])
            .arg(&context),
    )
}

/// Copies `binary` to `to` and every shared library it links to its own path under the
/// root filesystem `to` is in.
fn place(binary: &Path, to: &Path) -> anyhow::Result<()> {
    fs::copy(binary, to).with_context(|| format!("copying {}", binary.display()))?;
    let rootfs = to
        .ancestors()
        .find(|a| a.ends_with("rootfs"))
        .context("a path under rootfs")?
        .to_owned();
    for library in libraries(binary)? {
        let inside = rootfs.join(library.strip_prefix("/").unwrap_or(&library));
        if inside.exists() {
            continue;
        }
        fs::create_dir_all(inside.parent().context("a library's directory")?)?;
        // The file itself, under the name the binary asks for (symbolic links resolved).
        fs::copy(&library, &inside).with_context(|| format!("copying {}", library.display()))?;
    }
    Ok(())
}

/// The shared libraries (and the dynamic loader) `binary` needs, as `ldd` resolves them.
fn libraries(binary: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(binary)
        .output()
        .context("running ldd")?;
    if !out.status.success() {
        bail!(
            "ldd {}: {}",
            binary.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| {
            let path = match line.split_once("=>") {
                Some((_, resolved)) => resolved.split_whitespace().next()?,
                None => line.split_whitespace().next()?,
            };
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect())
}

fn which(program: &str) -> anyhow::Result<PathBuf> {
    for dir in ["/usr/sbin", "/sbin", "/usr/bin", "/bin"] {
        let path = Path::new(dir).join(program);
        if path.exists() {
            return Ok(path);
        }
    }
    bail!("{program} not found (cargo xtask setup installs it)")
}

/// podman's configuration for the build: this machine's hard limits are below podman's
/// default ulimits.
fn containers_conf(dir: &Path) -> anyhow::Result<PathBuf> {
    let path = dir.join("containers.conf");
    fs::write(
        &path,
        "[containers]\ndefault_ulimits = [\"nofile=1024:1024\", \"nproc=1024:1024\"]\n",
    )?;
    Ok(path)
}
