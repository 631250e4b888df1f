//! The Prometheus endpoint: packets by hook and class and drops by reason (summed over CPUs from
//! the pinned counters), map fill, sync latency and outcome, and the objects the last sync
//! rejected. Map-backed figures are read at scrape time, so they are never staler than the
//! scrape; agent figures are kept in the registry as they happen.

use std::{fmt, sync::Arc, time::Duration};

use crate::{
    http::{Exposition, reply},
    kernel::pins::Pins,
    kernel::{fill, stats},
};
use dataplane_common::maps::ALL_MAPS;
use hyper::{Method, Request, StatusCode};
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric as _, text},
    metrics::{
        counter::{ConstCounter, Counter},
        family::Family,
        gauge::{ConstGauge, Gauge},
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry,
};

/// Histograms by label set, each made with the same buckets.
type HistogramsBy<L> = Family<L, Histogram, fn() -> Histogram>;

/// What the agent records; shared with the HTTP server.
pub struct Metrics {
    registry: Registry,
    syncs: Family<[(&'static str, &'static str); 1], Counter>,
    sync_seconds: Histogram,
    sync_lag: Histogram,
    sync_passes: Family<[(&'static str, &'static str); 1], Counter>,
    stage_runs: Family<[(&'static str, &'static str); 1], Counter>,
    full_sync_differences: Counter,
    rejected: Family<[(&'static str, &'static str); 1], Gauge>,
    cni_requests: Family<[(&'static str, String); 2], Counter>,
    cni_seconds: HistogramsBy<[(&'static str, &'static str); 1]>,
    /// The agent's loop's last turn (what `/healthz` answers from).
    pub heartbeat: Heartbeat,
}

impl Metrics {
    pub fn new(pins: &Pins) -> Self {
        let mut registry = Registry::with_prefix("dataplane");
        let syncs = Family::default();
        registry.register(
            "syncs",
            "Syncs of the cluster state into the maps, by result (ok or failed)",
            syncs.clone(),
        );
        // 1 ms .. ~16 s.
        let sync_seconds = Histogram::new(exponential_buckets(0.001, 2.0, 15));
        registry.register(
            "sync_duration_seconds",
            "Time from reading the cluster state to the maps holding it",
            sync_seconds.clone(),
        );
        // 1 ms .. ~16 s, as the syncs.
        let sync_lag = Histogram::new(exponential_buckets(0.001, 2.0, 15));
        registry.register(
            "sync_lag_seconds",
            "Time from the first change a source reported (a watch event, an inotify event) to the maps holding it",
            sync_lag.clone(),
        );
        let sync_passes = Family::default();
        registry.register(
            "sync_passes",
            "Successful syncs by kind: incremental (only the stages reading what changed) or full (everything re-read, every stage)",
            sync_passes.clone(),
        );
        let stage_runs = Family::default();
        registry.register(
            "sync_stage_runs",
            "Sync stages run, by stage (overlay, services, access_control, egress_ips)",
            stage_runs.clone(),
        );
        let full_sync_differences = Counter::default();
        registry.register(
            "full_sync_differences",
            "Map entries, routes and tables a periodic full recompute had to write: changes the incremental syncs missed (a bug indicator; should stay 0)",
            full_sync_differences.clone(),
        );
        let rejected = Family::default();
        registry.register(
            "rejected_objects",
            "Objects the last sync rejected (named in the log), by kind",
            rejected.clone(),
        );
        let cni_requests = Family::default();
        registry.register(
            "cni_requests",
            "CNI plugin requests the agent answered, by command and result (ok, or the CNI error code)",
            cni_requests.clone(),
        );
        // 1 ms .. ~16 s, as the syncs.
        let cni_seconds: HistogramsBy<_> =
            Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.001, 2.0, 15)));
        registry.register(
            "cni_request_duration_seconds",
            "Time from the plugin's request reaching the agent to its answer (ADD: wired, in the maps, programs attached), successful requests by command",
            cni_seconds.clone(),
        );
        registry.register_collector(Box::new(PinnedMaps {
            pins: pins.clone(),
            fills: std::sync::Mutex::new(None),
        }));
        Self {
            registry,
            syncs,
            sync_seconds,
            sync_lag,
            sync_passes,
            stage_runs,
            full_sync_differences,
            rejected,
            cni_requests,
            cni_seconds,
            heartbeat: Heartbeat::default(),
        }
    }

    /// Records one sync: how long it took, whether it held, and per kind how many objects it
    /// rejected (kinds it did not report keep their value).
    pub fn record_sync(&self, took: Duration, ok: bool, rejected: &[(&'static str, usize)]) {
        let result = if ok { "ok" } else { "failed" };
        self.syncs.get_or_create(&[("result", result)]).inc();
        if ok {
            self.sync_seconds.observe(took.as_secs_f64());
        }
        for &(kind, count) in rejected {
            let count = i64::try_from(count).unwrap_or(i64::MAX);
            self.rejected.get_or_create(&[("kind", kind)]).set(count);
        }
    }

    /// Records what a successful sync ran: `full` or incremental, its stages, and (for a
    /// periodic full recompute, not the first sync) the writes it found necessary.
    pub fn record_sync_work(
        &self,
        full: bool,
        stages: &[&'static str],
        differences: Option<usize>,
    ) {
        let kind = if full { "full" } else { "incremental" };
        self.sync_passes.get_or_create(&[("kind", kind)]).inc();
        for &stage in stages {
            self.stage_runs.get_or_create(&[("stage", stage)]).inc();
        }
        if let Some(differences) = differences {
            self.full_sync_differences.inc_by(differences as u64);
        }
    }

    /// Records how long after the source's first report of a change its sync held it.
    pub fn record_sync_lag(&self, lag: Duration) {
        self.sync_lag.observe(lag.as_secs_f64());
    }

    /// Records one answered CNI request: `error` is the CNI error code of a failed one.
    pub fn record_cni(&self, command: &'static str, error: Option<u32>, took: Duration) {
        let result = error.map_or_else(|| "ok".to_owned(), |code| code.to_string());
        self.cni_requests
            .get_or_create(&[("command", command.to_owned()), ("result", result)])
            .inc();
        if error.is_none() {
            self.cni_seconds
                .get_or_create(&[("command", command)])
                .observe(took.as_secs_f64());
        }
    }

    /// The exposition text (OpenMetrics).
    pub fn render(&self) -> Result<String, fmt::Error> {
        let mut out = String::new();
        text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

impl Exposition for Metrics {
    fn render(&self) -> Result<String, fmt::Error> {
        Metrics::render(self)
    }
}

/// Reads the pinned counters at each scrape, and the maps' fill at most every
/// [`FILL_EVERY`]: counting a hash map's entries walks its keys (a full conntrack map is a
/// quarter of a million of them), which a scrape every second must not repeat each time.
#[derive(Debug)]
struct PinnedMaps {
    pins: Pins,
    fills: std::sync::Mutex<Option<(std::time::Instant, Vec<fill::MapFill>)>>,
}

/// How long a count of the maps' entries is served before it is counted again.
const FILL_EVERY: Duration = Duration::from_secs(15);

impl PinnedMaps {
    fn fills(&self) -> Vec<fill::MapFill> {
        let mut cached = self.fills.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((at, fills)) = cached.as_ref()
            && at.elapsed() < FILL_EVERY
        {
            return fills.clone();
        }
        let fills: Vec<fill::MapFill> = ALL_MAPS
            .iter()
            .filter_map(|&name| fill::map_fill(&self.pins, name).ok().flatten())
            .collect();
        *cached = Some((std::time::Instant::now(), fills.clone()));
        fills
    }
}

impl Collector for PinnedMaps {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        // A scrape while the maps are being replaced reports what it can; a scrape error would
        // lose the agent's own figures too.
        if let Ok(counters) = stats::read(&self.pins) {
            let packets = encoder.encode_descriptor(
                "packets",
                "Packets seen, by attach point and class",
                None,
                prometheus_client::metrics::MetricType::Counter,
            )?;
            let mut packets = packets;
            for row in &counters.packets {
                let labels = [("hook", row.hook), ("class", row.class)];
                ConstCounter::new(row.count).encode(packets.encode_family(&labels)?)?;
            }
            let mut drops = encoder.encode_descriptor(
                "drops",
                "Packets dropped, by reason",
                None,
                prometheus_client::metrics::MetricType::Counter,
            )?;
            for row in &counters.drops {
                let labels = [("reason", row.reason)];
                ConstCounter::new(row.count).encode(drops.encode_family(&labels)?)?;
            }
        }
        let fills = self.fills();
        let mut entries = encoder.encode_descriptor(
            "map_entries",
            "Entries in use in each pinned map",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for fill in &fills {
            let labels = [("map", fill.name)];
            ConstGauge::new(i64::from(fill.used)).encode(entries.encode_family(&labels)?)?;
        }
        let mut capacity = encoder.encode_descriptor(
            "map_capacity",
            "Maximum entries of each pinned map",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for fill in &fills {
            let labels = [("map", fill.name)];
            ConstGauge::new(i64::from(fill.max_entries))
                .encode(capacity.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

/// Whether the process serving `/healthz` is healthy: `Err` says why not.
pub type Health = dyn Fn() -> Result<(), String> + Send + Sync;

/// The agent's loop's last sign of life, for `/healthz`: the loop wakes at least every 100 ms
/// (the egress IP tick), so a loop silent for [`STALLED_AFTER`] is stuck.
#[derive(Debug)]
pub struct Heartbeat {
    started: std::time::Instant,
    /// Milliseconds from `started` to the loop's last turn.
    last: std::sync::atomic::AtomicU64,
}

/// How long the agent's loop may go without a turn before `/healthz` says it is stuck.
pub const STALLED_AFTER: Duration = Duration::from_secs(60);

impl Default for Heartbeat {
    fn default() -> Self {
        Heartbeat {
            started: std::time::Instant::now(),
            last: std::sync::atomic::AtomicU64::new(0),
        }
    }
}

impl Heartbeat {
    /// The loop turned.
    pub fn beat(&self) {
        let now = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last.store(now, std::sync::atomic::Ordering::Relaxed);
    }

    /// `Err` when the loop has not turned for [`STALLED_AFTER`].
    pub fn check(&self) -> Result<(), String> {
        let last = Duration::from_millis(self.last.load(std::sync::atomic::Ordering::Relaxed));
        let silent = self.started.elapsed().saturating_sub(last);
        if silent > STALLED_AFTER {
            return Err(format!("the agent's loop has not turned for {silent:?}"));
        }
        Ok(())
    }
}

/// Serves `GET /metrics` and `GET /healthz` (200 while `health` says so, 503 with why not)
/// from `metrics` on `listener`, from a thread of its own ([`crate::http`]): a scrape never
/// waits on the agent's loop, nor the loop on a scrape.
pub fn spawn(
    listener: std::net::TcpListener,
    metrics: Arc<dyn Exposition>,
    health: Arc<Health>,
) -> std::io::Result<()> {
    if let Ok(address) = listener.local_addr() {
        tracing::info!(%address, "serving metrics on /metrics");
    }
    let handler = move |request: &Request<hyper::body::Incoming>, _peer| match (
        request.method(),
        request.uri().path(),
    ) {
        (&Method::GET, "/metrics") => match metrics.render() {
            Ok(body) => reply(
                StatusCode::OK,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                body,
            ),
            Err(_) => reply(
                StatusCode::INTERNAL_SERVER_ERROR,
                "text/plain",
                "encoding failed\n".into(),
            ),
        },
        (&Method::GET, "/healthz") => match health() {
            Ok(()) => reply(StatusCode::OK, "text/plain", "ok\n".into()),
            Err(why) => reply(
                StatusCode::SERVICE_UNAVAILABLE,
                "text/plain",
                format!("{why}\n"),
            ),
        },
        _ => reply(
            StatusCode::NOT_FOUND,
            "text/plain",
            "only /metrics and /healthz\n".into(),
        ),
    };
    crate::http::spawn("metrics", listener, Arc::new(handler))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agent_figures_are_exposed_with_their_labels() {
        let metrics = Metrics::new(&Pins::new("/nonexistent/dataplane-metrics-test"));
        metrics.record_sync(
            Duration::from_millis(3),
            true,
            &[("manifest", 2), ("service", 0)],
        );
        metrics.record_sync(Duration::from_millis(1), false, &[]);
        metrics.record_sync_lag(Duration::from_millis(120));
        let text = metrics.render().expect("render");
        assert!(
            text.contains("dataplane_sync_lag_seconds_count 1"),
            "{text}"
        );
        assert!(text.contains("dataplane_sync_lag_seconds_bucket{le=\"0.064\"} 0"));
        assert!(text.contains("dataplane_sync_lag_seconds_bucket{le=\"0.128\"} 1"));
        assert!(
            text.contains("dataplane_syncs_total{result=\"ok\"} 1"),
            "{text}"
        );
        assert!(text.contains("dataplane_syncs_total{result=\"failed\"} 1"));
        assert!(text.contains("dataplane_rejected_objects{kind=\"manifest\"} 2"));
        assert!(text.contains("dataplane_rejected_objects{kind=\"service\"} 0"));
        // One observation of 3 ms: in the 4 ms bucket, not in the 2 ms one.
        assert!(text.contains("dataplane_sync_duration_seconds_count 1"));
        assert!(text.contains("dataplane_sync_duration_seconds_bucket{le=\"0.002\"} 0"));
        assert!(text.contains("dataplane_sync_duration_seconds_bucket{le=\"0.004\"} 1"));
        assert!(text.ends_with("# EOF\n"));
    }
}
