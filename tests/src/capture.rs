//! Packet captures decoded by tshark (Wireshark's dissectors), an implementation independent
//! of ours: what crossed a wire, as tshark reads it.

use std::{
    io::{BufRead as _, BufReader},
    process::{Child, Command, Stdio},
    sync::mpsc,
    thread,
    time::Duration,
};

use anyhow::{Context as _, bail};

pub struct Capture {
    child: Child,
}

impl Capture {
    /// Starts tshark on `interface` inside `netns` with a capture `filter`, printing `fields`
    /// for up to `count` packets (or 15 seconds), and waits until it is capturing.
    pub fn start(
        netns: &str,
        interface: &str,
        filter: &str,
        count: u32,
        fields: &[&str],
    ) -> anyhow::Result<Self> {
        Self::start_for(netns, interface, filter, count, 15, fields)
    }

    /// [`Capture::start`] ending after `seconds` at most.
    pub fn start_for(
        netns: &str,
        interface: &str,
        filter: &str,
        count: u32,
        seconds: u32,
        fields: &[&str],
    ) -> anyhow::Result<Self> {
        let mut command = Command::new("nsenter");
        command
            .arg(format!("--net=/run/netns/{netns}"))
            .args(["tshark", "-n", "-l", "-i", interface, "-f", filter])
            .args([
                "-c",
                &count.to_string(),
                "-a",
                &format!("duration:{seconds}"),
                "-T",
                "fields",
            ])
            .args(["-E", "separator=|"]);
        for field in fields {
            command.args(["-e", field]);
        }
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting tshark")?;
        let stderr = child.stderr.take().context("tshark stderr")?;
        let (ready_tx, ready_rx) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if line.contains("Capturing on") {
                    let _ = ready_tx.send(());
                }
            }
        });
        if ready_rx.recv_timeout(Duration::from_secs(20)).is_err() {
            let _ = child.kill();
            bail!("tshark did not start capturing on {interface} in {netns}");
        }
        // dumpcap announces the capture a moment before its socket sees packets.
        thread::sleep(Duration::from_secs(1));
        Ok(Self { child })
    }

    /// Waits for the capture to end and returns one line per packet.
    pub fn finish(self) -> anyhow::Result<Vec<String>> {
        let out = self
            .child
            .wait_with_output()
            .context("waiting for tshark")?;
        Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_owned)
            .collect())
    }
}
