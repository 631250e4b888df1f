//! A real container runtime calling the CNI plugin: Debian's podman 4.3 with its CNI network
//! backend (runc; crun cannot run here), running containers from a local busybox root
//! filesystem, so no image registry is involved. One `Podman` per node: its configuration
//! points at the network configuration the node's agent wrote and at the plugin binary.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Output},
};

use anyhow::{Context as _, bail};

/// The busybox applets the containers use (not wget: Debian's static busybox wget crashes).
const APPLETS: &[&str] = &["sh", "nc", "printf", "httpd", "sleep", "ip", "cat"];

pub struct Podman {
    dir: PathBuf,
    conf: PathBuf,
    rootfs: PathBuf,
    containers: Vec<String>,
    /// Environment podman runs with (its CNI plugins inherit it).
    env: Vec<(String, String)>,
    /// The network namespace podman runs in (`None`: the caller's).
    netns: Option<String>,
}

impl Podman {
    /// A podman whose networks are the configuration lists in `network_dir`, whose plugins are
    /// in `plugin_dir`.
    pub fn new(network_dir: &Path, plugin_dir: &Path) -> anyhow::Result<Self> {
        let dir = std::env::temp_dir().join(crate::unique_name("podman"));
        let rootfs = dir.join("rootfs");
        for sub in ["bin", "www", "proc", "sys", "dev", "etc", "tmp"] {
            fs::create_dir_all(rootfs.join(sub))?;
        }
        fs::copy("/bin/busybox", rootfs.join("bin/busybox"))
            .context("busybox-static (cargo xtask setup installs it)")?;
        for applet in APPLETS {
            std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet))?;
        }
        // What the web server serves: the same file in every container.
        fs::write(rootfs.join("www/index.html"), "hello from a container\n")?;
        let conf = dir.join("containers.conf");
        // The default ulimits exceed this machine's hard limits; the CNI backend is chosen
        // explicitly (podman 4 would pick netavark where it is installed).
        fs::write(
            &conf,
            format!(
                "[containers]\ndefault_ulimits = [\"nofile=1024:1024\", \"nproc=1024:1024\"]\n\
                 [network]\nnetwork_backend = \"cni\"\ncni_plugin_dirs = [\"{}\"]\nnetwork_config_dir = \"{}\"\n",
                plugin_dir.display(),
                network_dir.display()
            ),
        )?;
        Ok(Self {
            dir,
            conf,
            rootfs,
            containers: Vec::new(),
            env: Vec::new(),
            netns: None,
        })
    }

    /// Runs podman (and so the plugins) with `key` set to `value`.
    pub fn with_env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_owned(), value.to_owned()));
        self
    }

    /// Runs podman in network namespace `netns`, as the node's runtime: the plugins it runs
    /// see that node's interfaces (the egress router's macvlan master), never this machine's.
    pub fn in_netns(mut self, netns: &str) -> Self {
        self.netns = Some(netns.to_owned());
        self
    }

    fn podman(&self) -> Command {
        let mut command = match &self.netns {
            Some(netns) => {
                let mut command = Command::new("nsenter");
                command
                    .arg(format!("--net=/run/netns/{netns}"))
                    .arg("podman");
                with_podman_args(&mut command, &self.conf);
                command
            }
            None => command(&self.conf),
        };
        command.envs(self.env.iter().map(|(k, v)| (k, v)));
        command
    }

    fn run_args(&self, name: &str, networks: &[&str]) -> Vec<String> {
        let mut args: Vec<String> = vec!["run".into(), "--name".into(), name.into()];
        for network in networks {
            args.extend(["--network".to_owned(), (*network).to_owned()]);
        }
        args.extend([
            "--ulimit".into(),
            "nproc=1024:1024".into(),
            "--ulimit".into(),
            "nofile=1024:1024".into(),
            "--rootfs".into(),
            self.rootfs.display().to_string(),
        ]);
        args
    }

    /// Starts container `name` on `network` running `command`, in the background.
    pub fn start(&mut self, name: &str, network: &str, command: &[&str]) -> anyhow::Result<()> {
        self.start_on(name, &[network], command)
    }

    /// Starts container `name` attached to each of `networks` (in order: the first is its
    /// `eth0`), running `command`, in the background.
    pub fn start_on(
        &mut self,
        name: &str,
        networks: &[&str],
        command: &[&str],
    ) -> anyhow::Result<()> {
        self.containers.push(name.to_owned());
        let mut args = self.run_args(name, networks);
        args.insert(1, "--detach".into());
        let out = self.podman().args(&args).args(command).output()?;
        checked(&out, &format!("podman run {name}"))
    }

    /// Runs container `name` on `network` to completion (removed after); its output.
    pub fn run(&self, name: &str, network: &str, command: &[&str]) -> anyhow::Result<Output> {
        let mut args = self.run_args(name, &[network]);
        args.insert(1, "--rm".into());
        Ok(self.podman().args(&args).args(command).output()?)
    }

    /// The address the network gave container `name`.
    pub fn address(&self, name: &str, network: &str) -> anyhow::Result<String> {
        let format = format!("{{{{(index .NetworkSettings.Networks \"{network}\").IPAddress}}}}");
        let out = self
            .podman()
            .args(["inspect", "--format", &format, name])
            .output()?;
        checked(&out, &format!("podman inspect {name}"))?;
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    /// Stops and removes container `name` (the runtime calls DEL).
    pub fn remove(&mut self, name: &str) -> anyhow::Result<()> {
        self.containers.retain(|c| c != name);
        let out = self
            .podman()
            .args(["rm", "--force", "--time", "0", name])
            .output()?;
        checked(&out, &format!("podman rm {name}"))
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        for name in std::mem::take(&mut self.containers) {
            let _ = self.remove(&name);
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// podman as the tests run it: configuration `conf` (this machine's ulimits, the CNI backend
/// where it says so), runc (crun cannot run here), cgroupfs, events to a file.
pub fn command(conf: &Path) -> Command {
    let mut command = Command::new("podman");
    with_podman_args(&mut command, conf);
    command
}

/// The environment and global arguments of [`command`].
fn with_podman_args(command: &mut Command, conf: &Path) {
    command
        .env("CONTAINERS_CONF", conf)
        .args([
            "--runtime",
            "/usr/sbin/runc",
            "--cgroup-manager",
            "cgroupfs",
        ])
        .args(["--events-backend", "file"]);
}

fn checked(out: &Output, what: &str) -> anyhow::Result<()> {
    if out.status.success() {
        return Ok(());
    }
    bail!(
        "{what}: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}
