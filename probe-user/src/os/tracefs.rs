//! tracefs: find (or mount) it, and check the tracepoint layouts probe's programs read against
//! the running kernel's `format` files before attaching.
use std::{ffi::CString, fs, path::PathBuf};

use probe_common::tracepoints::Layout;

const CANDIDATES: [&str; 2] = ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"];

/// The tracefs mount point, mounting it at /sys/kernel/tracing when nothing is mounted (root).
pub fn ensure_mounted() -> Result<PathBuf, String> {
    if let Some(p) = CANDIDATES.iter().map(PathBuf::from).find(|p| p.join("events").is_dir()) {
        return Ok(p);
    }
    let target = CString::new(CANDIDATES[0]).unwrap_or_default();
    let fstype = CString::new("tracefs").unwrap_or_default();
    // SAFETY: valid NUL-terminated strings; no data argument.
    let rc = unsafe { libc::mount(fstype.as_ptr(), target.as_ptr(), fstype.as_ptr(), 0, std::ptr::null()) };
    // Another probe may have mounted it meanwhile.
    if rc != 0 && !PathBuf::from(CANDIDATES[0]).join("events").is_dir() {
        return Err(format!(
            "tracefs is not mounted and mounting it on {} failed ({}): mount it with `mount -t tracefs tracefs {}`",
            CANDIDATES[0],
            std::io::Error::last_os_error(),
            CANDIDATES[0]
        ));
    }
    Ok(PathBuf::from(CANDIDATES[0]))
}

/// A field of a tracepoint format file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FormatField {
    pub name: String,
    pub offset: usize,
    pub size: usize,
}

/// Fields of a `format` file ("field:unsigned long pfn;\toffset:8;\tsize:8;\tsigned:0;").
pub fn parse_format(text: &str) -> Vec<FormatField> {
    text.lines()
        .filter_map(|l| {
            let l = l.trim();
            let decl = l.strip_prefix("field:")?.split(';').next()?;
            // The name is the last word of the declaration, without any array suffix.
            let name = decl.split_whitespace().last()?.split('[').next()?.to_string();
            let num = |key: &str| -> Option<usize> { l.split(';').find_map(|p| p.trim().strip_prefix(key)?.parse().ok()) };
            Some(FormatField { name, offset: num("offset:")?, size: num("size:")? })
        })
        .collect()
}

/// Why a layout does not match a format file, or `None` when every field probe reads matches.
pub fn check_layout(layout: &Layout, format: &str) -> Option<String> {
    let fields = parse_format(format);
    for want in layout.fields {
        match fields.iter().find(|f| f.name == want.name) {
            None => return Some(format!("field `{}` is missing", want.name)),
            Some(f) if f.offset != want.offset || f.size != want.size => {
                return Some(format!(
                    "field `{}` is at offset {} size {} here, probe reads offset {} size {}",
                    want.name, f.offset, f.size, want.offset, want.size
                ));
            }
            Some(_) => {}
        }
    }
    None
}

/// Read a tracepoint's format file: `Err` says why it cannot be used.
pub fn format(root: &std::path::Path, group: &str, name: &str) -> Result<String, String> {
    fs::read_to_string(root.join("events").join(group).join(name).join("format"))
        .map_err(|e| format!("tracepoint {group}:{name} not available in this kernel ({e})"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use probe_common::tracepoints::{block_rq_issue, mm_filemap_add_to_page_cache};

    const ISSUE_6_18: &str = include_str!("../../../tests/data/tracefs/block_rq_issue.format");

    #[test]
    fn parses_fields() {
        let f = parse_format(ISSUE_6_18);
        let rwbs = f.iter().find(|f| f.name == "rwbs").unwrap();
        assert_eq!((rwbs.offset, rwbs.size), (34, 10));
        assert!(f.iter().any(|f| f.name == "common_pid"));
        assert!(f.iter().any(|f| f.name == "cmd" && f.offset == 60));
    }

    #[test]
    fn layout_check_catches_moved_fields() {
        assert_eq!(check_layout(&block_rq_issue::LAYOUT, ISSUE_6_18), None);
        // Kernels before 6.10 have no ioprio: rwbs sits at 32 and the check must refuse.
        let old = ISSUE_6_18
            .replace("\tfield:unsigned short ioprio;\toffset:32;\tsize:2;\tsigned:0;\n", "")
            .replace("offset:34;\tsize:10", "offset:32;\tsize:10");
        let why = check_layout(&block_rq_issue::LAYOUT, &old).unwrap();
        assert!(why.contains("`rwbs` is at offset 32"), "{why}");
        assert!(check_layout(&mm_filemap_add_to_page_cache::LAYOUT, ISSUE_6_18).unwrap().contains("missing"));
    }
}
