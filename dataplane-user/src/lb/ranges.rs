//! The load-balancer addresses' source ranges (`spec.loadBalancerSourceRanges`) as entries of
//! `LB_SOURCE_RANGES`, and their sync. Each load-balancer address and port with ranges gets
//! one entry per range (allow) and one for every other source (deny); the kernel answers a
//! new flow with one longest-prefix lookup, whatever the number of ranges. A change is
//! written so that a source allowed before and after it is never refused a flow meanwhile, and
//! no address is open to every source for a moment: what is added (allows, then denies)
//! before the service ports are installed, what goes (denies, then allows) after.

use std::collections::BTreeMap;

use aya::maps::{Map, MapData, lpm_trie::Key, lpm_trie::LpmTrie};
use dataplane_common::{
    lb::{
        SCOPE_EXTERNAL, SOURCE_RANGE_ALLOW, SOURCE_RANGE_DENY, SOURCE_RANGE_SERVICE_BITS,
        ServiceKey, SourceRangeKey,
    },
    maps,
    overlay::Addr,
};
use ipnet::IpNet;

use super::compile::ServicePort;
use crate::{
    error::AgentError,
    kernel::capacity::map_err,
    kernel::loader::Dataplane,
    kernel::pins::Pins,
    mapsync::{addr16, ip_of},
};

/// Bytes of a [`SourceRangeKey`], as the map's keys carry them.
pub const RANGE_KEY_LEN: usize = size_of::<SourceRangeKey>();

/// One entry's key: prefix length (bits) and data.
pub type RangeKey = (u32, [u8; RANGE_KEY_LEN]);

/// The entries of the map, wanted or written: key -> allow or deny.
pub type RangeEntries = BTreeMap<RangeKey, u8>;

/// The source ranges of the service port holding `key`, if it is a load-balancer address
/// reached from outside with ranges (its pods' key, `SCOPE_CLUSTER`, shares them: the kernel's
/// entries are by address, port and protocol).
pub(super) fn ranges_of(port: &ServicePort) -> Option<(ServiceKey, Vec<IpNet>)> {
    (port.key.scope == SCOPE_EXTERNAL && !port.source_ranges.is_empty())
        .then(|| (port.key, port.source_ranges.clone()))
}

/// Every entry the ranges of `ports` (load-balancer keys with their ranges) give.
pub fn range_entries(ports: &BTreeMap<ServiceKey, Vec<IpNet>>) -> RangeEntries {
    let mut entries = RangeEntries::new();
    for (key, ranges) in ports {
        let service = SourceRangeKey {
            addr: key.addr,
            port_be: key.port_be,
            protocol: key.protocol,
            _pad: 0,
            source: [0; 16],
        };
        entries.insert(
            (SOURCE_RANGE_SERVICE_BITS, key_bytes(&service)),
            SOURCE_RANGE_DENY,
        );
        for range in ranges {
            // IPv4 sources are keyed as `::ffff:a.b.c.d`: 96 bits of prefix before theirs.
            let mapped = if range.addr().is_ipv4() { 96 } else { 0 };
            let key = SourceRangeKey {
                source: addr16(range.network()),
                ..service
            };
            let bits = SOURCE_RANGE_SERVICE_BITS + mapped + u32::from(range.prefix_len());
            entries.insert((bits, key_bytes(&key)), SOURCE_RANGE_ALLOW);
        }
    }
    entries
}

/// The key as the map holds it.
fn key_bytes(key: &SourceRangeKey) -> [u8; RANGE_KEY_LEN] {
    let mut bytes = [0u8; RANGE_KEY_LEN];
    bytes[..16].copy_from_slice(&key.addr);
    bytes[16..18].copy_from_slice(&key.port_be);
    bytes[18] = key.protocol;
    bytes[19] = key._pad;
    bytes[20..].copy_from_slice(&key.source);
    bytes
}

/// The key's parts, for `dataplane inspect`.
pub fn key_parts(bytes: &[u8; RANGE_KEY_LEN]) -> SourceRangeKey {
    let mut key = SourceRangeKey::default();
    key.addr.copy_from_slice(&bytes[..16]);
    key.port_be.copy_from_slice(&bytes[16..18]);
    key.protocol = bytes[18];
    key.source.copy_from_slice(&bytes[20..]);
    key
}

/// The four steps of a change, in the order they are written: (entries to write, keys to
/// remove) for each.
struct RangeSteps {
    allows: Vec<(RangeKey, u8)>,
    gone_denies: Vec<RangeKey>,
    denies: Vec<(RangeKey, u8)>,
    gone_allows: Vec<RangeKey>,
}

/// What turns `written` into `wanted`, in the order that never refuses a source both allow.
fn steps(wanted: &RangeEntries, written: &RangeEntries) -> RangeSteps {
    let changed = wanted
        .iter()
        .filter(|(key, verdict)| written.get(key) != Some(verdict))
        .map(|(key, verdict)| (*key, *verdict));
    let (allows, denies): (Vec<_>, Vec<_>) =
        changed.partition(|(_, verdict)| *verdict == SOURCE_RANGE_ALLOW);
    let (gone_denies, gone_allows): (Vec<_>, Vec<_>) = written
        .iter()
        .filter(|(key, _)| !wanted.contains_key(key))
        .map(|(key, verdict)| (*key, *verdict))
        .partition(|(_, verdict)| *verdict == SOURCE_RANGE_DENY);
    RangeSteps {
        allows,
        gone_denies: gone_denies.into_iter().map(|(key, _)| key).collect(),
        denies,
        gone_allows: gone_allows.into_iter().map(|(key, _)| key).collect(),
    }
}

impl Dataplane {
    /// Writes the entries of `wanted` that `LB_SOURCE_RANGES` lacks or holds otherwise, allows
    /// first: before the service ports are installed, so that no new load-balancer address is
    /// open to every source for a moment. `written`: what this agent last wrote (`None`: what
    /// the map holds, read first); afterwards, the map's entries.
    pub(super) fn add_source_ranges(
        &mut self,
        wanted: &RangeEntries,
        written: &mut Option<RangeEntries>,
    ) -> Result<usize, AgentError> {
        let limit = self.capacities().service_ports.saturating_mul(2);
        if wanted.len() > limit as usize {
            return Err(AgentError::Capacity {
                what: "load-balancer source ranges (one entry per range, and one more, per \
                       load-balancer address and port)",
                needed: wanted.len(),
                map: maps::LB_SOURCE_RANGES,
                limit,
                flag: "--max-service-ports",
            });
        }
        let created = self.first_read_of_created(maps::LB_SOURCE_RANGES);
        let mut map: LpmTrie<&mut MapData, [u8; RANGE_KEY_LEN], u8> =
            self.typed_map(maps::LB_SOURCE_RANGES)?;
        // Taken: a failure leaves it unknown, and the next sync reads the map again.
        let mut current = match written.take() {
            Some(current) => current,
            None if created => RangeEntries::new(),
            None => read_entries(&map)?,
        };
        let RangeSteps { allows, denies, .. } = steps(wanted, &current);
        for (key, verdict) in allows.iter().chain(&denies) {
            insert(&mut map, key, *verdict)?;
            current.insert(*key, *verdict);
        }
        *written = Some(current);
        Ok(allows.len() + denies.len())
    }

    /// Removes the entries `wanted` no longer has, denies first: after the service ports are
    /// installed (or removed), so that a load-balancer address that goes is never open to
    /// every source for a moment, and a source allowed before and after is never refused.
    pub(super) fn remove_source_ranges(
        &mut self,
        wanted: &RangeEntries,
        written: &mut Option<RangeEntries>,
    ) -> Result<usize, AgentError> {
        let Some(mut current) = written.take() else {
            return Ok(0);
        };
        let mut map: LpmTrie<&mut MapData, [u8; RANGE_KEY_LEN], u8> =
            self.typed_map(maps::LB_SOURCE_RANGES)?;
        let RangeSteps {
            gone_denies,
            gone_allows,
            ..
        } = steps(wanted, &current);
        for (bits, data) in gone_denies.iter().chain(&gone_allows) {
            map.remove(&Key::new(*bits, *data))
                .map_err(map_err(maps::LB_SOURCE_RANGES, "remove"))?;
            current.remove(&(*bits, *data));
        }
        *written = Some(current);
        Ok(gone_denies.len() + gone_allows.len())
    }
}

fn insert(
    map: &mut LpmTrie<&mut MapData, [u8; RANGE_KEY_LEN], u8>,
    (bits, data): &RangeKey,
    verdict: u8,
) -> Result<(), AgentError> {
    map.insert(&Key::new(*bits, *data), verdict, 0)
        .map_err(map_err(maps::LB_SOURCE_RANGES, "write"))
}

/// Every entry the map holds.
fn read_entries(
    map: &LpmTrie<&mut MapData, [u8; RANGE_KEY_LEN], u8>,
) -> Result<RangeEntries, AgentError> {
    let mut entries = RangeEntries::new();
    for key in map.keys() {
        let key = key.map_err(map_err(maps::LB_SOURCE_RANGES, "read"))?;
        let verdict = map
            .get(&key, 0)
            .map_err(map_err(maps::LB_SOURCE_RANGES, "read"))?;
        entries.insert((key.prefix_len(), key.data()), verdict);
    }
    Ok(entries)
}

/// For `dataplane inspect services`, from the pins alone.
/// A service address, port (network byte order) and protocol.
pub type ServicePortKey = (Addr, [u8; 2], u8);

/// The sources each load-balancer address, port and protocol with source ranges admits
/// (`LB_SOURCE_RANGES`' allow entries), as prefixes; none for the others (every source).
pub fn admitted_sources(pins: &Pins) -> Result<BTreeMap<ServicePortKey, Vec<String>>, AgentError> {
    let name = maps::LB_SOURCE_RANGES;
    let map: LpmTrie<MapData, [u8; RANGE_KEY_LEN], u8> =
        LpmTrie::try_from(Map::LpmTrie(pins.open_map(name)?)).map_err(map_err(name, "open"))?;
    let mut ranges: BTreeMap<ServicePortKey, Vec<String>> = BTreeMap::new();
    for key in map.keys().filter_map(Result::ok) {
        let allowed = map.get(&key, 0).is_ok_and(|v| v == SOURCE_RANGE_ALLOW);
        let parts = key_parts(&key.data());
        let bits = key.prefix_len().saturating_sub(SOURCE_RANGE_SERVICE_BITS);
        let service = (parts.addr, parts.port_be, parts.protocol);
        let entry = ranges.entry(service).or_default();
        if allowed {
            let source = ip_of(&parts.source);
            // IPv4 sources sit under `::ffff:0:0/96`.
            let length = if source.is_ipv4() {
                bits.saturating_sub(96)
            } else {
                bits
            };
            entry.push(format!("{source}/{length}"));
        }
    }
    Ok(ranges)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(addr: &str, port: u16) -> ServiceKey {
        ServiceKey {
            addr: addr16(addr.parse().expect("address")),
            port_be: port.to_be_bytes(),
            protocol: 6,
            scope: SCOPE_EXTERNAL,
        }
    }

    #[test]
    fn each_range_allows_and_one_entry_denies_the_rest() {
        let ports = BTreeMap::from([(
            key("192.0.2.10", 443),
            vec![
                "198.51.100.0/24".parse().expect("range"),
                "2001:db8::/32".parse().expect("range"),
            ],
        )]);
        let entries = range_entries(&ports);
        let mut expected_service = [0u8; RANGE_KEY_LEN];
        expected_service[..16].copy_from_slice(&addr16("192.0.2.10".parse().expect("ip")));
        expected_service[16..18].copy_from_slice(&443u16.to_be_bytes());
        expected_service[18] = 6;
        let mut v4 = expected_service;
        v4[20..].copy_from_slice(&addr16("198.51.100.0".parse().expect("ip")));
        let mut v6 = expected_service;
        v6[20..].copy_from_slice(&addr16("2001:db8::".parse().expect("ip")));
        assert_eq!(
            entries,
            BTreeMap::from([
                ((160, expected_service), SOURCE_RANGE_DENY),
                ((160 + 96 + 24, v4), SOURCE_RANGE_ALLOW),
                ((160 + 32, v6), SOURCE_RANGE_ALLOW),
            ])
        );
        assert_eq!(
            key_parts(&v4).source,
            addr16("198.51.100.0".parse().expect("ip"))
        );
    }

    /// Between these sets of entries, every step leaves a source both allow allowed: the
    /// longest prefix matching it is an allow at every moment.
    #[test]
    fn a_change_never_refuses_a_source_allowed_before_and_after() {
        let range = |text: &str| -> IpNet { text.parse().expect("range") };
        let cases: [(Vec<IpNet>, Vec<IpNet>); 4] = [
            (vec![], vec![range("10.0.0.0/8")]),
            (vec![range("10.0.0.0/8")], vec![]),
            (vec![range("10.0.0.0/8")], vec![range("10.1.0.0/16")]),
            (vec![range("10.1.0.0/16")], vec![range("10.0.0.0/8")]),
        ];
        let source = addr16("10.1.2.3".parse().expect("ip"));
        for (before, after) in cases {
            let entries = |ranges: &Vec<IpNet>| {
                if ranges.is_empty() {
                    RangeEntries::new()
                } else {
                    range_entries(&BTreeMap::from([(key("192.0.2.10", 80), ranges.clone())]))
                }
            };
            let (old, new) = (entries(&before), entries(&after));
            let allowed =
                |map: &RangeEntries| longest_match(map, &source) != Some(SOURCE_RANGE_DENY);
            let both = allowed(&old) && allowed(&new);
            let s = steps(&new, &old);
            let mut map = old.clone();
            let mut moments = vec![map.clone()];
            // As written: the additions (allows, denies), then the removals (denies, allows).
            map.extend(s.allows.iter().copied());
            moments.push(map.clone());
            map.extend(s.denies.iter().copied());
            moments.push(map.clone());
            s.gone_denies.iter().for_each(|k| {
                map.remove(k);
            });
            moments.push(map.clone());
            s.gone_allows.iter().for_each(|k| {
                map.remove(k);
            });
            assert_eq!(map, new, "{before:?} -> {after:?}");
            if both {
                assert!(moments.iter().all(allowed), "{before:?} -> {after:?}");
            }
        }
    }

    /// The verdict of the longest entry matching `source` under the one service key used.
    fn longest_match(map: &RangeEntries, source: &[u8; 16]) -> Option<u8> {
        map.iter()
            .filter(|((bits, data), _)| {
                let source_bits = bits - SOURCE_RANGE_SERVICE_BITS;
                let prefix = u128::from_be_bytes(data[20..].try_into().expect("16 bytes"));
                let address = u128::from_be_bytes(*source);
                source_bits == 0 || (prefix ^ address) >> (128 - source_bits) == 0
            })
            .max_by_key(|((bits, _), _)| *bits)
            .map(|(_, verdict)| *verdict)
    }
}
