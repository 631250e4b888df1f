//! Checks made before touching the kernel, so a missing privilege or an old kernel gets a clear
//! one-line answer instead of a raw errno from deep inside a load.

use std::ffi::CString;

use aya::util::KernelVersion;

use crate::{error::AgentError, error::KernelGap};

const CAP_NET_ADMIN: u32 = 12;
const CAP_SYS_ADMIN: u32 = 21;
const CAP_BPF: u32 = 39;

/// Oldest kernel the programs are written for (bounded loops, BTF, tc and XDP features used).
const MIN_KERNEL: (u8, u8) = (5, 15);

pub fn check_privileges() -> Result<(), AgentError> {
    let caps = effective_capabilities().unwrap_or(0);
    let has = |cap: u32| caps & (1u64 << cap) != 0;
    let bpf_ok = has(CAP_BPF) || has(CAP_SYS_ADMIN);
    if bpf_ok && has(CAP_NET_ADMIN) {
        Ok(())
    } else {
        Err(AgentError::NotPrivileged)
    }
}

pub fn check_kernel() -> Result<(), AgentError> {
    let unsupported = |gap| AgentError::KernelUnsupported { gap };
    let version = KernelVersion::current()
        .map_err(|e| unsupported(KernelGap::VersionUnreadable(Box::new(e))))?;
    if version < KernelVersion::new(MIN_KERNEL.0, MIN_KERNEL.1, 0) {
        return Err(unsupported(KernelGap::TooOld { running: version }));
    }
    if !std::path::Path::new("/sys/kernel/btf/vmlinux").exists() {
        return Err(unsupported(KernelGap::NoBtf));
    }
    Ok(())
}

/// The overlay forwards between pods and the underlay, and the kernel's FIB lookup for BPF
/// refuses to answer on a node that does not forward.
pub fn check_forwarding() -> Result<(), AgentError> {
    let path = super::sysctl::path("net/ipv4/conf/all/forwarding");
    let value = std::fs::read_to_string(&path).map_err(|source| AgentError::Io {
        action: "reading",
        path: path.clone(),
        source,
    })?;
    if value.trim() == "1" {
        Ok(())
    } else {
        Err(AgentError::ForwardingDisabled)
    }
}

/// The interface index of `name` in the current network namespace.
pub fn interface_index(name: &str) -> Result<u32, AgentError> {
    let not_found = || AgentError::InterfaceNotFound { name: name.into() };
    let c_name = CString::new(name).map_err(|_| not_found())?;
    // SAFETY: c_name is a valid NUL-terminated string.
    let index = unsafe { libc::if_nametoindex(c_name.as_ptr()) };
    if index == 0 {
        Err(not_found())
    } else {
        Ok(index)
    }
}

fn effective_capabilities() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let hex = status.lines().find_map(|l| l.strip_prefix("CapEff:"))?;
    u64::from_str_radix(hex.trim(), 16).ok()
}

/// The name of interface `ifindex` in this network namespace, if it exists.
pub fn interface_name(ifindex: u32) -> Option<String> {
    let mut buffer = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: buffer holds IF_NAMESIZE bytes, as if_indextoname requires.
    let name = unsafe { libc::if_indextoname(ifindex, buffer.as_mut_ptr()) };
    if name.is_null() {
        return None;
    }
    // SAFETY: on success if_indextoname wrote a NUL-terminated name into buffer.
    let name = unsafe { std::ffi::CStr::from_ptr(buffer.as_ptr()) };
    Some(name.to_string_lossy().into_owned())
}

/// The kernel's tick rate (HZ), for the programs' clock: the coarse monotonic clock's
/// resolution is one tick. None when the kernel does not say (the programs then keep the
/// coarse clock helper).
pub fn kernel_tick_hz() -> Option<u32> {
    let mut resolution = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid clock id and a valid out pointer.
    if unsafe { libc::clock_getres(libc::CLOCK_MONOTONIC_COARSE, &mut resolution) } != 0 {
        return None;
    }
    let nanos = resolution.tv_sec as u64 * 1_000_000_000 + resolution.tv_nsec as u64;
    tick_hz_from_resolution(nanos)
}

/// HZ from a tick length in nanoseconds: the nearest whole rate, if the kernel could be built
/// with it (10 to 10,000 ticks a second) and the tick is that rate's to within a nanosecond
/// per tick (HZ=300 gives 3,333,333 ns).
fn tick_hz_from_resolution(nanos: u64) -> Option<u32> {
    if nanos == 0 {
        return None;
    }
    let hz = (1_000_000_000 + nanos / 2) / nanos;
    let exact = (10..=10_000).contains(&hz) && (1_000_000_000 / hz).abs_diff(nanos) <= 1;
    exact.then_some(hz as u32)
}

#[cfg(test)]
mod tests {
    use super::tick_hz_from_resolution;

    #[test]
    fn tick_rates_the_kernel_can_be_built_with() {
        assert_eq!(tick_hz_from_resolution(10_000_000), Some(100));
        assert_eq!(tick_hz_from_resolution(4_000_000), Some(250));
        assert_eq!(tick_hz_from_resolution(3_333_333), Some(300));
        assert_eq!(tick_hz_from_resolution(1_000_000), Some(1000));
    }

    #[test]
    fn no_rate_from_a_resolution_that_is_not_a_tick() {
        // A high-resolution clock's 1 ns, nothing, and a length no whole rate gives.
        assert_eq!(tick_hz_from_resolution(1), None);
        assert_eq!(tick_hz_from_resolution(0), None);
        assert_eq!(tick_hz_from_resolution(3_500_000), None);
    }
}
