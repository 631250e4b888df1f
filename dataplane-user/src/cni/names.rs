//! The names a container runtime gives the plugin (container id, interface name), checked
//! before anything is made of them: they key the address allocations and reach netlink
//! requests, the egress router's `ip -batch` lines and `/proc/sys` paths.

/// The longest interface name the kernel takes: IFNAMSIZ (16) less its terminating zero.
pub const IFNAME_MAX: usize = 15;
/// The longest container id taken: runtimes use 64 hex digits; room for others' schemes.
pub const CONTAINER_ID_MAX: usize = 256;
/// Whether `name` may be given to the kernel as a pod's interface name, and written into an
/// `ip -batch` line and a `/proc/sys/net/.../conf/<name>/` path: 1 to 15 characters of
/// `[A-Za-z0-9_.-]`, not `.` or `..` (path components), not `all` or `default` (the sysctl
/// directories that change every interface of the namespace).
pub fn check_ifname(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > IFNAME_MAX {
        return Err(format!(
            "CNI_IFNAME {name:?}: an interface name has 1 to {IFNAME_MAX} characters"
        ));
    }
    if !name.bytes().all(is_name_byte) {
        return Err(format!(
            "CNI_IFNAME {name:?}: only letters, digits, '_', '.' and '-' are allowed"
        ));
    }
    if matches!(name, "." | ".." | "all" | "default") {
        return Err(format!("CNI_IFNAME {name:?} is reserved"));
    }
    Ok(())
}

/// Whether `id` is a container id as the specification allows it: 1 to
/// [`CONTAINER_ID_MAX`] characters of `[A-Za-z0-9_.-]` (it keys the address allocations and
/// appears in logs).
pub fn check_container_id(id: &str) -> Result<(), String> {
    if id.is_empty() || id.len() > CONTAINER_ID_MAX {
        return Err(format!(
            "CNI_CONTAINERID: a container id has 1 to {CONTAINER_ID_MAX} characters (got {})",
            id.len()
        ));
    }
    if !id.bytes().all(is_name_byte) {
        return Err(format!(
            "CNI_CONTAINERID {:?}: only letters, digits, '_', '.' and '-' are allowed",
            id.chars().take(80).collect::<String>()
        ));
    }
    Ok(())
}

fn is_name_byte(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || matches!(byte, b'_' | b'.' | b'-')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interface_names_that_could_reach_a_command_or_a_path_are_refused() {
        for good in ["eth0", "net1", "a", "veth_1.2-x", "abcdefghijklmno"] {
            assert_eq!(check_ifname(good), Ok(()), "{good}");
        }
        for bad in [
            "",
            "abcdefghijklmnop",
            "eth0\nlink del eth0",
            "eth0 type dummy",
            "../../x",
            "a/b",
            ".",
            "..",
            "all",
            "default",
            "eth0\0",
            "é",
        ] {
            assert!(check_ifname(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn container_ids_are_checked_as_the_specification_says() {
        assert_eq!(check_container_id(&"f".repeat(64)), Ok(()));
        assert!(check_container_id("").is_err());
        assert!(check_container_id(&"f".repeat(CONTAINER_ID_MAX + 1)).is_err());
        assert!(check_container_id("abc/../x").is_err());
        assert!(check_container_id("abc\ndef").is_err());
    }
}
