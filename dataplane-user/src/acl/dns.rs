//! The addresses of EgressFirewall `dnsName` rules: resolved by the agent against the node's
//! resolver (or a configured one), re-resolved when the answer's TTL runs out, retried with
//! exponential backoff on failure while the last good addresses stay in force.
//!
//! The schedule ([`DnsNames`]) is pure and driven by the caller's clock; [`Resolver`] does the
//! lookups (A and AAAA).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    path::Path,
    time::{Duration, Instant},
};

use hickory_resolver::{
    TokioResolver,
    config::{LookupIpStrategy, NameServerConfig, ResolverConfig},
    net::runtime::TokioRuntimeProvider,
};

/// Shortest time an answer is used before asking again (however small its TTL).
pub const MIN_REFRESH: Duration = Duration::from_secs(2);
/// Longest time an answer is used before asking again (however large its TTL).
pub const MAX_REFRESH: Duration = Duration::from_secs(30 * 60);
/// First retry after a failed lookup; doubled per failure up to `MAX_BACKOFF`.
pub const FIRST_BACKOFF: Duration = Duration::from_secs(1);
pub const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// What is known of one name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NameState {
    /// The last good answer (empty until the first one).
    pub addresses: BTreeSet<IpAddr>,
    /// When to ask again.
    pub next_refresh: Instant,
    /// Failed lookups since the last good answer.
    pub failures: u32,
}

/// Every name the firewalls use, with its addresses and refresh schedule.
#[derive(Clone, Debug, Default)]
pub struct DnsNames {
    names: BTreeMap<String, NameState>,
}

impl DnsNames {
    /// Tracks exactly `names`: new ones are due at once, ones no rule uses any more are
    /// forgotten.
    pub fn track(&mut self, names: &BTreeSet<String>, now: Instant) {
        self.names.retain(|name, _| names.contains(name));
        for name in names {
            self.names.entry(name.clone()).or_insert_with(|| NameState {
                addresses: BTreeSet::new(),
                next_refresh: now,
                failures: 0,
            });
        }
    }

    /// Names whose refresh time has come.
    pub fn due(&self, now: Instant) -> Vec<String> {
        self.names
            .iter()
            .filter(|(_, state)| state.next_refresh <= now)
            .map(|(name, _)| name.clone())
            .collect()
    }

    /// The earliest refresh time of any name.
    pub fn next_refresh(&self) -> Option<Instant> {
        self.names.values().map(|s| s.next_refresh).min()
    }

    /// Gives the names that have no addresses yet the ones `known` holds for them (a previous
    /// agent's last good answers), to use until a lookup answers; returns how many got some.
    pub fn seed(&mut self, known: &BTreeMap<String, BTreeSet<IpAddr>>) -> usize {
        let mut seeded = 0;
        for (name, state) in &mut self.names {
            if let Some(addresses) = known.get(name)
                && state.addresses.is_empty()
                && !addresses.is_empty()
            {
                state.addresses = addresses.clone();
                seeded += 1;
            }
        }
        seeded
    }

    /// Records a lookup's result; returns whether the name's addresses changed. A good answer
    /// is used until its expiry (clamped to `MIN_REFRESH..=MAX_REFRESH`); a failure or an
    /// empty answer keeps the last good addresses and retries after a backoff.
    pub fn record(
        &mut self,
        name: &str,
        result: Result<(BTreeSet<IpAddr>, Instant), String>,
        now: Instant,
    ) -> bool {
        let Some(state) = self.names.get_mut(name) else {
            return false;
        };
        match result {
            Ok((addresses, valid_until)) if !addresses.is_empty() => {
                let ttl = valid_until.saturating_duration_since(now);
                state.next_refresh = now + ttl.clamp(MIN_REFRESH, MAX_REFRESH);
                state.failures = 0;
                let changed = state.addresses != addresses;
                state.addresses = addresses;
                changed
            }
            Ok(_) | Err(_) => {
                let backoff = FIRST_BACKOFF
                    .saturating_mul(1 << state.failures.min(16))
                    .min(MAX_BACKOFF);
                state.failures += 1;
                state.next_refresh = now + backoff;
                false
            }
        }
    }

    /// The last good addresses of every name.
    pub fn addresses(&self) -> BTreeMap<String, BTreeSet<IpAddr>> {
        self.names
            .iter()
            .map(|(name, state)| (name.clone(), state.addresses.clone()))
            .collect()
    }

    pub fn state(&self, name: &str) -> Option<&NameState> {
        self.names.get(name)
    }
}

/// The file in the agent's run directory that keeps every name's last good addresses, so
/// that a restarted agent starts from them.
pub const CACHE_FILE: &str = "dns-names.json";

/// The names' addresses kept in `path`; nothing when there is no file or it does not parse
/// (said in the log: the names are then resolved afresh).
pub fn load_cache(path: &Path) -> BTreeMap<String, BTreeSet<IpAddr>> {
    let text = match std::fs::read(path) {
        Ok(text) => text,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return BTreeMap::new(),
        Err(error) => {
            tracing::warn!(%error, path = %path.display(), "reading the DNS names' last addresses");
            return BTreeMap::new();
        }
    };
    serde_json::from_slice(&text).unwrap_or_else(|error| {
        tracing::warn!(%error, path = %path.display(), "the DNS names' last addresses do not parse");
        BTreeMap::new()
    })
}

/// Writes the names' addresses to `path` atomically.
pub fn save_cache(
    path: &Path,
    addresses: &BTreeMap<String, BTreeSet<IpAddr>>,
) -> std::io::Result<()> {
    crate::kernel::state::write_json_atomically(path, addresses)
}

/// Looks names up (A and AAAA) against the node's resolver configuration, or against one
/// server.
pub struct Resolver {
    inner: TokioResolver,
}

impl Resolver {
    /// `server`: a name server to use instead of `/etc/resolv.conf`'s.
    pub fn new(server: Option<IpAddr>) -> Result<Self, String> {
        let mut builder = match server {
            Some(ip) => TokioResolver::builder_with_config(
                ResolverConfig::from_parts(
                    None,
                    Vec::new(),
                    vec![NameServerConfig::udp_and_tcp(ip)],
                ),
                TokioRuntimeProvider::default(),
            ),
            None => TokioResolver::builder_tokio()
                .map_err(|e| format!("reading the node's resolver configuration: {e}"))?,
        };
        let options = builder.options_mut();
        options.ip_strategy = LookupIpStrategy::Ipv4AndIpv6;
        options.timeout = Duration::from_secs(2);
        options.attempts = 1;
        // The schedule above decides when to ask again; a cache would only hide changes.
        options.cache_size = 0;
        let inner = builder
            .build()
            .map_err(|e| format!("building the DNS resolver: {e}"))?;
        Ok(Self { inner })
    }

    /// The name's addresses and when the answer expires.
    pub async fn lookup(&self, name: &str) -> Result<(BTreeSet<IpAddr>, Instant), String> {
        let fqdn = if name.ends_with('.') {
            name.to_owned()
        } else {
            format!("{name}.")
        };
        let answer = self
            .inner
            .lookup_ip(fqdn.as_str())
            .await
            .map_err(|e| e.to_string())?;
        Ok((answer.iter().collect(), answer.valid_until()))
    }
}

/// Whether `name` (key form) matches `pattern` (key form: a name, or `*.` and a name, which
/// matches one or more labels before it).
pub fn name_matches(pattern: &str, name: &str) -> bool {
    match pattern.strip_prefix("*.") {
        Some(suffix) => name
            .strip_suffix(suffix)
            .is_some_and(|head| head.len() > 1 && head.ends_with('.')),
        None => pattern == name,
    }
}

/// Checks a `dnsName` and returns it in the form used as its key (lower case, no trailing
/// dot).
pub fn normalize(name: &str) -> Result<String, String> {
    let trimmed = name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase();
    if trimmed.starts_with("*.") {
        return Err(format!(
            "to.dnsName {name:?}: wildcard names are not supported by this agent version"
        ));
    }
    let valid_label = |label: &str| {
        (1..=63).contains(&label.len())
            && label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-')
            && !label.starts_with('-')
            && !label.ends_with('-')
    };
    if trimmed.is_empty() || trimmed.len() > 253 || !trimmed.split('.').all(valid_label) {
        return Err(format!("to.dnsName {name:?} is not a valid DNS name"));
    }
    Ok(trimmed)
}

/// Shortest time an address learned from a DNS answer counts (however small the answer's
/// TTL): the pod connects right after the answer, and the agent's sync follows it.
pub const MIN_SNOOPED_TTL: Duration = Duration::from_secs(5);

/// The addresses of wildcard names (`*.example.com`), learned from the DNS answers this
/// node's pods receive (a wildcard cannot be looked up): every A and AAAA record of an answer
/// to a question the pattern matches, or named by a name it matches, counts for the
/// record's TTL (at least `MIN_SNOOPED_TTL`, at most `MAX_REFRESH`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snooped {
    /// Pattern -> address -> until when it counts.
    learned: BTreeMap<String, BTreeMap<IpAddr, Instant>>,
}

/// A name in its key form (lower case, no trailing dot).
fn key_form(name: &hickory_resolver::proto::rr::Name) -> String {
    let text = name.to_ascii().to_ascii_lowercase();
    text.strip_suffix('.').unwrap_or(&text).to_owned()
}

impl Snooped {
    /// Learns from one DNS message (`patterns`: the wildcards in use). Returns whether an
    /// address was added; a message that does not parse or is no answer teaches nothing.
    pub fn learn(&mut self, message: &[u8], patterns: &BTreeSet<String>, now: Instant) -> bool {
        use hickory_resolver::proto::{
            op::{Message, MessageType},
            rr::RData,
        };
        let Ok(message) = Message::from_vec(message) else {
            return false;
        };
        if message.metadata.message_type != MessageType::Response {
            return false;
        }
        let questions: Vec<String> = message.queries.iter().map(|q| key_form(q.name())).collect();
        let mut added = false;
        for record in &message.answers {
            let address: IpAddr = match &record.data {
                RData::A(a) => a.0.into(),
                RData::AAAA(a) => a.0.into(),
                _ => continue,
            };
            let name = key_form(&record.name);
            let ttl =
                Duration::from_secs(u64::from(record.ttl)).clamp(MIN_SNOOPED_TTL, MAX_REFRESH);
            for pattern in patterns {
                let answers_it = questions
                    .iter()
                    .chain(std::iter::once(&name))
                    .any(|n| name_matches(pattern, n));
                if !answers_it {
                    continue;
                }
                let until = self.learned.entry(pattern.clone()).or_default();
                match until.get_mut(&address) {
                    Some(at) => *at = (*at).max(now + ttl),
                    None => {
                        until.insert(address, now + ttl);
                        added = true;
                    }
                }
            }
        }
        added
    }

    /// Forgets what expired and the patterns no longer in use. Returns whether an address
    /// went.
    pub fn expire(&mut self, patterns: &BTreeSet<String>, now: Instant) -> bool {
        let before: usize = self.learned.values().map(BTreeMap::len).sum();
        self.learned.retain(|pattern, _| patterns.contains(pattern));
        for addresses in self.learned.values_mut() {
            addresses.retain(|_, until| *until > now);
        }
        self.learned.retain(|_, addresses| !addresses.is_empty());
        before != self.learned.values().map(BTreeMap::len).sum::<usize>()
    }

    /// When the next address expires.
    pub fn next_expiry(&self) -> Option<Instant> {
        self.learned
            .values()
            .flat_map(|a| a.values())
            .min()
            .copied()
    }

    /// The addresses in force, by pattern.
    pub fn addresses(&self) -> BTreeMap<String, BTreeSet<IpAddr>> {
        self.learned
            .iter()
            .map(|(pattern, addresses)| (pattern.clone(), addresses.keys().copied().collect()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(addresses: &[&str]) -> BTreeSet<IpAddr> {
        addresses
            .iter()
            .map(|a| a.parse().expect("address"))
            .collect()
    }

    #[test]
    fn answers_are_used_for_their_ttl_and_failures_back_off_keeping_the_last_good() {
        let start = Instant::now();
        let mut names = DnsNames::default();
        names.track(&["example.com".to_owned()].into(), start);
        assert_eq!(names.due(start), vec!["example.com"]);

        let good = set(&["192.0.2.1", "2001:db8::1"]);
        assert!(names.record(
            "example.com",
            Ok((good.clone(), start + Duration::from_secs(300))),
            start
        ));
        assert_eq!(names.next_refresh(), Some(start + Duration::from_secs(300)));
        assert!(names.due(start + Duration::from_secs(299)).is_empty());

        // The same answer again: nothing changed. A tiny TTL is clamped.
        let later = start + Duration::from_secs(300);
        assert!(!names.record("example.com", Ok((good.clone(), later)), later));
        assert_eq!(names.next_refresh(), Some(later + MIN_REFRESH));

        // Failures keep the addresses and back off 1, 2, 4 s ... up to a minute.
        let mut now = later + MIN_REFRESH;
        for expected in [1, 2, 4, 8, 16, 32, 60, 60] {
            assert!(!names.record("example.com", Err("timed out".into()), now));
            assert_eq!(
                names.next_refresh(),
                Some(now + Duration::from_secs(expected))
            );
            assert_eq!(names.addresses()["example.com"], good);
            now += Duration::from_secs(expected);
        }
        // An empty answer is a failure too; a new answer resets the backoff.
        assert!(!names.record("example.com", Ok((BTreeSet::new(), now)), now));
        let moved = set(&["192.0.2.9"]);
        assert!(names.record(
            "example.com",
            Ok((moved.clone(), now + Duration::from_secs(60))),
            now
        ));
        assert_eq!(names.state("example.com").map(|s| s.failures), Some(0));
        assert_eq!(names.addresses()["example.com"], moved);

        // A name no rule uses is forgotten.
        names.track(&BTreeSet::new(), now);
        assert!(names.addresses().is_empty());
    }

    #[test]
    fn names_are_checked_and_normalized() {
        assert_eq!(normalize("Example.COM.").as_deref(), Ok("example.com"));
        assert!(normalize("*.example.com").unwrap_err().contains("wildcard"));
        assert!(
            normalize("exa mple.com")
                .unwrap_err()
                .contains("not a valid DNS name")
        );
        assert!(normalize("-bad.example").is_err());
        assert!(normalize("").is_err());
    }

    /// A DNS answer for `question` with `records` (name, address, TTL), built by hickory.
    fn answer(question: &str, records: &[(&str, &str, u32)]) -> Vec<u8> {
        use hickory_resolver::proto::{
            op::{Message, MessageType, OpCode, Query},
            rr::{Name, RData, Record, RecordType, rdata},
        };
        let mut message = Message::new(7, MessageType::Response, OpCode::Query);
        message.add_query(Query::query(
            Name::from_ascii(question).unwrap(),
            RecordType::A,
        ));
        for (name, address, ttl) in records {
            let data = match address.parse::<IpAddr>().unwrap() {
                IpAddr::V4(a) => RData::A(rdata::A(a)),
                IpAddr::V6(a) => RData::AAAA(rdata::AAAA(a)),
            };
            message.add_answer(Record::from_rdata(
                Name::from_ascii(name).unwrap(),
                *ttl,
                data,
            ));
        }
        message.to_vec().unwrap()
    }

    #[test]
    fn wildcard_addresses_are_learned_from_answers_and_expire_with_their_ttl() {
        let patterns: BTreeSet<String> = ["*.example.com".to_owned()].into();
        let now = Instant::now();
        let mut snooped = Snooped::default();
        // A CNAME'd answer: the question matches, so the target's addresses count.
        let message = answer(
            "API.Example.com.",
            &[
                ("edge.cdn.net.", "192.0.2.7", 60),
                ("edge.cdn.net.", "2001:db8::7", 1),
            ],
        );
        assert!(snooped.learn(&message, &patterns, now));
        assert_eq!(
            snooped.addresses(),
            [(
                "*.example.com".to_owned(),
                set(&["192.0.2.7", "2001:db8::7"])
            )]
            .into()
        );
        // The same again adds nothing; another domain teaches nothing; neither does the bare
        // suffix (one or more labels must come before it) or a query.
        assert!(!snooped.learn(&message, &patterns, now));
        assert!(!snooped.learn(
            &answer("api.example.org.", &[("api.example.org.", "192.0.2.8", 60)]),
            &patterns,
            now
        ));
        assert!(!snooped.learn(
            &answer("example.com.", &[("example.com.", "192.0.2.9", 60)]),
            &patterns,
            now
        ));
        assert!(!snooped.learn(b"not dns", &patterns, now));
        // The 1 s TTL counts for the 5 s minimum, the 60 s one for 60 s.
        assert_eq!(snooped.next_expiry(), Some(now + MIN_SNOOPED_TTL));
        assert!(snooped.expire(&patterns, now + Duration::from_secs(6)));
        assert_eq!(
            snooped.addresses(),
            [("*.example.com".to_owned(), set(&["192.0.2.7"]))].into()
        );
        // A pattern no longer in use is forgotten.
        assert!(snooped.expire(&BTreeSet::new(), now + Duration::from_secs(7)));
        assert!(snooped.addresses().is_empty());
    }
}
