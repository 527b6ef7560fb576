//! Files probe writes for the person who ran it (below the renderers: html and bundle both use it).
use std::path::Path;

/// Files made under sudo belong to the user who ran sudo, not root.
pub fn chown_to_sudo_caller(path: &Path) {
    let id = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u32>().ok());
    if let (Some(uid), Some(gid)) = (id("SUDO_UID"), id("SUDO_GID")) {
        let _ = std::os::unix::fs::chown(path, Some(uid), Some(gid));
    }
}
