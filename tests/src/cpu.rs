//! The machine's CPU time, for benchmarks that report what a path cost in CPU time beside the
//! rate it reached: on this testbed one flow's rate also depends on how its work lands on
//! the CPUs (inline in the sender's softirq, or deferred to another CPU), its CPU time does not.

use anyhow::Context as _;

/// The machine's CPU time from `/proc/stat`, in ticks summed over its CPUs: busy and all,
/// and how many CPUs the sums cover.
#[derive(Clone, Copy)]
pub struct CpuTicks {
    busy: u64,
    total: u64,
    cpus: usize,
}

impl CpuTicks {
    /// The counters as they stand now.
    pub fn read() -> anyhow::Result<Self> {
        let stat = std::fs::read_to_string("/proc/stat")?;
        let line = stat.lines().next().context("empty /proc/stat")?;
        let cpus = stat
            .lines()
            .filter(|l| l.starts_with("cpu") && !l.starts_with("cpu "))
            .count();
        // cpu user nice system idle iowait irq softirq steal ...
        let ticks: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .take(8)
            .map(str::parse)
            .collect::<Result<_, _>>()
            .context("parsing /proc/stat")?;
        anyhow::ensure!(ticks.len() == 8, "short cpu line in /proc/stat");
        // Busy: user, nice, system, irq and softirq. Idle, iowait and steal (a virtual CPU
        // waiting for its host) are not the paths' work.
        Ok(Self {
            busy: ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6],
            total: ticks.iter().sum(),
            cpus,
        })
    }

    /// CPUs busy on average from `self` to `later`.
    pub fn busy_cpus_until(self, later: CpuTicks) -> f64 {
        let total = later.total.saturating_sub(self.total).max(1) as f64;
        later.busy.saturating_sub(self.busy) as f64 / total * later.cpus as f64
    }
}
