//! A network namespace entered by the current thread only, for BPF_PROG_TEST_RUN cases whose
//! programs look up routes and neighbours: the test run executes in the calling thread's
//! namespace, so each test gets its own underlay. Left and deleted on drop.

use std::{fs::File, os::fd::AsRawFd as _, process::Command};

use anyhow::{Context as _, bail};

use crate::topology::ip_args;

pub struct ThreadNetns {
    pub name: String,
    original: File,
}

impl ThreadNetns {
    /// Creates a namespace and moves the calling thread into it.
    pub fn enter() -> anyhow::Result<Self> {
        let name = crate::unique_name("tn");
        let original =
            File::open("/proc/thread-self/ns/net").context("opening this thread's netns")?;
        ip_args(&["netns", "add", &name])?;
        let target = File::open(format!("/run/netns/{name}")).context("opening the new netns")?;
        // SAFETY: both are valid namespace file descriptors; setns affects only this thread.
        if unsafe { libc::setns(target.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            let error = std::io::Error::last_os_error();
            let _ = ip_args(&["netns", "del", &name]);
            bail!("setns into {name}: {error}");
        }
        let netns = Self { name, original };
        netns.ip(&["link", "set", "lo", "up"])?;
        Ok(netns)
    }

    /// Runs `ip -n <this netns> args`.
    pub fn ip(&self, args: &[&str]) -> anyhow::Result<()> {
        let mut full = vec!["-n", &self.name];
        full.extend_from_slice(args);
        ip_args(&full)
    }

    /// Sets a sysctl inside this netns (`key=value`).
    pub fn sysctl(&self, setting: &str) -> anyhow::Result<()> {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.name, "sysctl", "-qw", setting])
            .output()
            .context("running sysctl")?;
        if !out.status.success() {
            bail!(
                "sysctl {setting}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }

    /// Runs a whitespace-separated `ip` command line in this netns.
    pub fn sh(&self, line: &str) -> anyhow::Result<()> {
        let args: Vec<&str> = line.split_whitespace().collect();
        self.ip(&args)
    }
}

impl Drop for ThreadNetns {
    fn drop(&mut self) {
        // SAFETY: original is the thread's namespace from before enter().
        unsafe { libc::setns(self.original.as_raw_fd(), libc::CLONE_NEWNET) };
        let _ = ip_args(&["netns", "del", &self.name]);
    }
}
