//! ACL audit logs, as OVN-Kubernetes writes them.
//!
//! - Which namespaces log: the annotation `k8s.ovn.org/acl-logging: '{"deny":"alert",
//!   "allow":"notice"}'` (either key may be absent). An invalid annotation is ignored with a
//!   warning.
//! - How: the Network operator's `ovnKubernetesConfig.policyAuditConfig` — `rateLimit`
//!   (records per second per node, default 20), `maxFileSize` (MB before the file rotates,
//!   default 50), `maxLogFiles` (rotated files kept, default 5), `destination` (`null`: the
//!   file only; `libc`: also syslog through /dev/log; `udp:<host>:<port>`; `unix:<path>`) and
//!   `syslogFacility` (default `local0`).
//! - Records come from the kernel through a ring buffer (one per denied packet, one per
//!   allowed connection), already limited per CPU; [`AuditLog`] applies the node-wide limit,
//!   formats each record like OVN's `acl_log` lines and writes them.

use std::sync::Arc;
use std::{
    fs::{self, File, OpenOptions},
    io::Write as _,
    net::UdpSocket,
    os::unix::net::UnixDatagram,
    path::{Path, PathBuf},
    time::{Instant, SystemTime},
};

use dataplane_common::acl::{
    ACL_DIRECTION_INGRESS, ACL_LOG_ALLOW, ACL_LOG_DENY, ACL_RULE_DEFAULT, ACL_VERDICT_DENY,
    AclEvent,
};
use k8s_openapi::api::core::v1::Namespace;
use serde::Deserialize;

use crate::{
    api::network::{AuditSettings, Destination},
    mapsync::ip_of,
};

/// The namespace annotation that turns audit logging on.
pub const ACL_LOGGING_ANNOTATION: &str = "k8s.ovn.org/acl-logging";

/// Syslog severities OVN-Kubernetes accepts in the annotation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Severity {
    Alert,
    Warning,
    Notice,
    Info,
    Debug,
}

impl Severity {
    fn parse(text: &str) -> Option<Self> {
        Some(match text {
            "alert" => Severity::Alert,
            "warning" => Severity::Warning,
            "notice" => Severity::Notice,
            "info" => Severity::Info,
            "debug" => Severity::Debug,
            _ => return None,
        })
    }

    fn name(self) -> &'static str {
        match self {
            Severity::Alert => "alert",
            Severity::Warning => "warning",
            Severity::Notice => "notice",
            Severity::Info => "info",
            Severity::Debug => "debug",
        }
    }

    /// The syslog severity number (RFC 5424).
    fn code(self) -> u8 {
        match self {
            Severity::Alert => 1,
            Severity::Warning => 4,
            Severity::Notice => 5,
            Severity::Info => 6,
            Severity::Debug => 7,
        }
    }
}

/// A namespace's audit levels.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NamespaceLogging {
    pub deny: Option<Severity>,
    pub allow: Option<Severity>,
}

impl NamespaceLogging {
    /// The `ACL_LOG_*` flags the kernel reads.
    pub fn flags(self) -> u8 {
        let mut flags = 0;
        if self.deny.is_some() {
            flags |= ACL_LOG_DENY;
        }
        if self.allow.is_some() {
            flags |= ACL_LOG_ALLOW;
        }
        flags
    }
}

/// The audit levels of every namespace that asks for them, and one warning per invalid
/// annotation (that namespace does not log).
pub fn namespace_logging<'a>(
    namespaces: impl IntoIterator<Item = &'a Arc<Namespace>>,
) -> (Vec<(String, NamespaceLogging)>, Vec<String>) {
    let mut levels = Vec::new();
    let mut warnings = Vec::new();
    for namespace in namespaces {
        let name = namespace.metadata.name.clone().unwrap_or_default();
        let Some(text) = namespace
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(ACL_LOGGING_ANNOTATION))
        else {
            continue;
        };
        match parse_annotation(text) {
            Ok(logging) => levels.push((name, logging)),
            Err(problem) => warnings.push(format!(
                "Namespace {name}: annotation {ACL_LOGGING_ANNOTATION} ignored: {problem}"
            )),
        }
    }
    (levels, warnings)
}

pub(super) fn parse_annotation(text: &str) -> Result<NamespaceLogging, String> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Levels {
        deny: Option<String>,
        allow: Option<String>,
    }
    let levels: Levels = serde_json::from_str(text).map_err(|e| format!("not valid: {e}"))?;
    let level = |key: &str, value: Option<String>| -> Result<Option<Severity>, String> {
        match value {
            None => Ok(None),
            Some(v) => Severity::parse(&v).map(Some).ok_or_else(|| {
                format!("{key}: {v:?} is not alert, warning, notice, info or debug")
            }),
        }
    };
    Ok(NamespaceLogging {
        deny: level("deny", levels.deny)?,
        allow: level("allow", levels.allow)?,
    })
}

/// What a record names besides its packet: who decided and at which level.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordSource {
    pub namespace: String,
    /// `EF:<namespace>:<object>` for an EgressFirewall.
    pub acl_name: String,
    pub severity: Severity,
    /// The rule index the record names, when not the event's (an admin policy's rule index
    /// in its object).
    pub rule: Option<u32>,
}

/// One record as an OVN `acl_log` line (without the trailing newline).
pub fn format_record(
    event: &AclEvent,
    source: &RecordSource,
    time: SystemTime,
    sequence: u64,
) -> String {
    let rule = match source.rule {
        Some(rule) => rule.to_string(),
        None if event.rule == ACL_RULE_DEFAULT => "default".to_owned(),
        None => event.rule.to_string(),
    };
    let verdict = if event.verdict == ACL_VERDICT_DENY {
        "drop"
    } else {
        "allow"
    };
    let direction = if event.direction == ACL_DIRECTION_INGRESS {
        "to-lport"
    } else {
        "from-lport"
    };
    let src = ip_of(&event.src);
    let dst = ip_of(&event.dst);
    let (proto, (src_key, dst_key)) = match (event.protocol, src.is_ipv4()) {
        (6, true) => ("tcp".to_owned(), ("nw_src", "nw_dst")),
        (17, true) => ("udp".to_owned(), ("nw_src", "nw_dst")),
        (132, true) => ("sctp".to_owned(), ("nw_src", "nw_dst")),
        (1, true) => ("icmp".to_owned(), ("nw_src", "nw_dst")),
        (6, false) => ("tcp6".to_owned(), ("ipv6_src", "ipv6_dst")),
        (17, false) => ("udp6".to_owned(), ("ipv6_src", "ipv6_dst")),
        (132, false) => ("sctp6".to_owned(), ("ipv6_src", "ipv6_dst")),
        (58, false) => ("icmp6".to_owned(), ("ipv6_src", "ipv6_dst")),
        (other, true) => (format!("ip,nw_proto={other}"), ("nw_src", "nw_dst")),
        (other, false) => (format!("ipv6,nw_proto={other}"), ("ipv6_src", "ipv6_dst")),
    };
    let ports = if matches!(event.protocol, 6 | 17 | 132) {
        format!(",tp_src={},tp_dst={}", event.src_port, event.dst_port)
    } else {
        String::new()
    };
    let suppressed = if event.suppressed > 0 {
        format!(
            " ({} earlier records suppressed by the rate limit)",
            event.suppressed
        )
    } else {
        String::new()
    };
    format!(
        "{}|{sequence:05}|acl_log(dataplane)|{}|name=\"{}:{rule}\", verdict={verdict}, severity={}, direction={direction}: {proto},{src_key}={src},{dst_key}={dst}{ports}{suppressed}",
        rfc3339(time),
        source.severity.name().to_ascii_uppercase(),
        source.acl_name,
        source.severity.name(),
    )
}

/// UTC time as `YYYY-MM-DDTHH:MM:SS.mmmZ`.
fn rfc3339(time: SystemTime) -> String {
    let since = time
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    let secs = since.as_secs();
    let (days, rest) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60,
        since.subsec_millis()
    )
}

/// The node-wide limit: a token bucket of `rate` records per second (burst `rate`).
#[derive(Debug)]
pub struct RateLimiter {
    rate: f64,
    tokens: f64,
    last: Instant,
}

impl RateLimiter {
    pub fn new(rate: u32, now: Instant) -> Self {
        Self {
            rate: f64::from(rate),
            tokens: f64::from(rate),
            last: now,
        }
    }

    /// Whether one more record may go out at `now`.
    pub fn admit(&mut self, now: Instant) -> bool {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.rate).min(self.rate);
        self.last = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// A log file that rotates when it would exceed its size: `path` becomes `path.1`, `path.1`
/// becomes `path.2` and so on; the oldest beyond `keep` is removed.
#[derive(Debug)]
pub struct RotatingFile {
    path: PathBuf,
    max_bytes: u64,
    keep: u32,
    file: File,
    size: u64,
}

impl RotatingFile {
    pub fn open(path: &Path, max_bytes: u64, keep: u32) -> std::io::Result<Self> {
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir)?;
        }
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        let size = file.metadata()?.len();
        Ok(Self {
            path: path.to_owned(),
            max_bytes,
            keep,
            file,
            size,
        })
    }

    pub fn write_line(&mut self, line: &str) -> std::io::Result<()> {
        let bytes = line.len() as u64 + 1;
        if self.size > 0 && self.size + bytes > self.max_bytes {
            self.rotate()?;
        }
        writeln!(self.file, "{line}")?;
        self.size += bytes;
        Ok(())
    }

    fn rotated(&self, n: u32) -> PathBuf {
        let mut name = self.path.clone().into_os_string();
        name.push(format!(".{n}"));
        name.into()
    }

    fn rotate(&mut self) -> std::io::Result<()> {
        let _ = fs::remove_file(self.rotated(self.keep));
        for n in (1..self.keep).rev() {
            let _ = fs::rename(self.rotated(n), self.rotated(n + 1));
        }
        fs::rename(&self.path, self.rotated(1))?;
        self.file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)?;
        self.size = 0;
        Ok(())
    }
}

/// Writes records: rate-limited node-wide, to the file and the configured destination.
pub struct AuditLog {
    settings: AuditSettings,
    limiter: RateLimiter,
    file: RotatingFile,
    sequence: u64,
    /// Records dropped by the node-wide limit since the last one written.
    pub suppressed: u64,
    hostname: String,
}

impl AuditLog {
    pub fn open(settings: AuditSettings, path: &Path) -> std::io::Result<Self> {
        let file = RotatingFile::open(path, settings.max_file_bytes, settings.max_log_files)?;
        let hostname = crate::kernel::netdev::host_name().unwrap_or_else(|_| "-".into());
        Ok(Self {
            limiter: RateLimiter::new(settings.rate_limit, Instant::now()),
            settings,
            file,
            sequence: 0,
            suppressed: 0,
            hostname,
        })
    }

    /// Writes one record unless the node-wide limit says no; returns whether it was written.
    pub fn record(&mut self, event: &AclEvent, source: &RecordSource) -> std::io::Result<bool> {
        if !self.limiter.admit(Instant::now()) {
            self.suppressed += 1;
            return Ok(false);
        }
        self.sequence += 1;
        let mut event = *event;
        event.suppressed = event
            .suppressed
            .saturating_add(u32::try_from(self.suppressed).unwrap_or(u32::MAX));
        self.suppressed = 0;
        let line = format_record(&event, source, SystemTime::now(), self.sequence);
        self.file.write_line(&line)?;
        self.send_to_destination(&line, source.severity);
        Ok(true)
    }

    /// Syslog (RFC 5424) to the destination; failures are logged and the record stays in the
    /// file.
    fn send_to_destination(&self, line: &str, severity: Severity) {
        let priority = u16::from(self.settings.facility) * 8 + u16::from(severity.code());
        let message = format!("<{priority}>1 - {} dataplane - - - {line}", self.hostname);
        let sent = match &self.settings.destination {
            Destination::FileOnly => return,
            Destination::Libc => UnixDatagram::unbound()
                .and_then(|s| s.send_to(message.as_bytes(), "/dev/log").map(drop)),
            Destination::Unix(path) => {
                UnixDatagram::unbound().and_then(|s| s.send_to(message.as_bytes(), path).map(drop))
            }
            Destination::Udp(target) => UdpSocket::bind(if target.is_ipv4() {
                "0.0.0.0:0"
            } else {
                "[::]:0"
            })
            .and_then(|s| s.send_to(message.as_bytes(), target).map(drop)),
        };
        if let Err(error) = sent {
            tracing::debug!(%error, "audit record not sent to the syslog destination");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use dataplane_common::acl::{ACL_DIRECTION_EGRESS, ACL_KIND_FIREWALL, ACL_VERDICT_ALLOW};

    use super::*;
    use crate::mapsync::addr16;

    fn namespace(name: &str, annotation: Option<&str>) -> Arc<Namespace> {
        let mut ns = Namespace::default();
        ns.metadata.name = Some(name.into());
        if let Some(text) = annotation {
            ns.metadata.annotations =
                Some([(ACL_LOGGING_ANNOTATION.to_owned(), text.to_owned())].into());
        }
        Arc::new(ns)
    }

    #[test]
    fn annotations_give_levels_and_invalid_ones_are_ignored_with_a_warning() {
        let (levels, warnings) = namespace_logging(&[
            namespace("team", Some(r#"{"deny":"alert","allow":"notice"}"#)),
            namespace("quiet", None),
            namespace("denies", Some(r#"{"deny":"warning"}"#)),
            namespace("typo", Some(r#"{"deny":"loud"}"#)),
            namespace("junk", Some("deny=alert")),
        ]);
        assert_eq!(
            levels,
            vec![
                (
                    "team".to_owned(),
                    NamespaceLogging {
                        deny: Some(Severity::Alert),
                        allow: Some(Severity::Notice)
                    }
                ),
                (
                    "denies".to_owned(),
                    NamespaceLogging {
                        deny: Some(Severity::Warning),
                        allow: None
                    }
                ),
            ]
        );
        assert_eq!(levels[0].1.flags(), ACL_LOG_DENY | ACL_LOG_ALLOW);
        assert_eq!(warnings.len(), 2);
        assert!(warnings[0].starts_with(
            "Namespace typo: annotation k8s.ovn.org/acl-logging ignored: deny: \"loud\""
        ));
        assert!(warnings[1].starts_with("Namespace junk:"));
    }

    fn event(verdict: u8, rule: u32) -> AclEvent {
        AclEvent {
            time_ns: 0,
            set: 1,
            rule,
            src: addr16("10.244.1.9".parse().unwrap()),
            dst: addr16("192.0.2.5".parse().unwrap()),
            src_port: 40000,
            dst_port: 443,
            protocol: 6,
            verdict,
            direction: ACL_DIRECTION_EGRESS,
            kind: ACL_KIND_FIREWALL,
            suppressed: 0,
        }
    }

    #[test]
    fn records_read_like_ovn_acl_log_lines() {
        let source = RecordSource {
            namespace: "team".into(),
            acl_name: "EF:team:default".into(),
            severity: Severity::Alert,
            rule: None,
        };
        let time = SystemTime::UNIX_EPOCH + Duration::from_millis(1_779_000_000_123);
        assert_eq!(
            format_record(&event(ACL_VERDICT_DENY, 2), &source, time, 7),
            "2026-05-17T06:40:00.123Z|00007|acl_log(dataplane)|ALERT|name=\"EF:team:default:2\", \
             verdict=drop, severity=alert, direction=from-lport: tcp,nw_src=10.244.1.9,\
             nw_dst=192.0.2.5,tp_src=40000,tp_dst=443"
        );
        let mut v6 = event(ACL_VERDICT_ALLOW, ACL_RULE_DEFAULT);
        v6.src = addr16("fd00:10:244:1::9".parse().unwrap());
        v6.dst = addr16("2001:db8::1".parse().unwrap());
        v6.protocol = 58;
        v6.suppressed = 3;
        let line = format_record(&v6, &source, time, 8);
        assert!(line.ends_with(
            "name=\"EF:team:default:default\", verdict=allow, severity=alert, direction=from-lport: \
             icmp6,ipv6_src=fd00:10:244:1::9,ipv6_dst=2001:db8::1 (3 earlier records suppressed by the rate limit)"
        ), "{line}");
    }

    #[test]
    fn the_node_wide_limit_admits_its_rate_with_a_burst_of_one_second() {
        let start = Instant::now();
        let mut limiter = RateLimiter::new(5, start);
        let admitted = (0..20).filter(|_| limiter.admit(start)).count();
        assert_eq!(admitted, 5);
        assert!(limiter.admit(start + Duration::from_millis(200)));
        assert!(!limiter.admit(start + Duration::from_millis(200)));
        let later = start + Duration::from_secs(10);
        assert_eq!((0..20).filter(|_| limiter.admit(later)).count(), 5);
    }

    #[test]
    fn the_file_rotates_at_its_size_keeping_the_configured_count() {
        let dir = std::env::temp_dir().join(format!("audit-rotate-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let path = dir.join("acl-audit-log.log");
        let mut file = RotatingFile::open(&path, 100, 2).expect("open");
        for i in 0..10 {
            file.write_line(&format!("{i:039}")).expect("write");
        }
        // 40 bytes a line, 100 a file: two lines per file; the current and two rotated kept.
        let read = |p: PathBuf| fs::read_to_string(p).unwrap_or_default();
        assert_eq!(read(path.clone()).lines().count(), 2);
        assert!(read(path.with_extension("log.1")).starts_with(&format!("{:039}", 6)));
        assert!(read(path.with_extension("log.2")).starts_with(&format!("{:039}", 4)));
        assert!(!path.with_extension("log.3").exists());
        let _ = fs::remove_dir_all(&dir);
    }
}
