//! Every process's CPU time from /proc/PID/stat (user + system ticks), read at two moments:
//! who used the CPUs in between. The one reading of other processes' CPU use (`probe bench`'s
//! machine state per level; competitors named by the trace come from the scheduler's events).
use std::collections::HashMap;

/// One process at one moment: its name and its CPU time so far, seconds.
#[derive(Clone, Debug)]
pub struct Proc {
    pub comm: String,
    pub ppid: u32,
    pub cpu_s: f64,
    /// When it started (ticks after boot): tells a reused pid from the same process (a kernel
    /// worker changes its name with its work, so the name cannot).
    pub start: u64,
}

/// (comm, ppid, utime + stime ticks, start time) of a /proc/PID/stat line; the comm may hold
/// spaces and parentheses, so the fields are counted from its last ')'.
pub fn parse_stat(text: &str) -> Option<(String, u32, u64, u64)> {
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    let comm = text.get(open + 1..close)?.to_string();
    let f: Vec<&str> = text.get(close + 2..)?.split_whitespace().collect();
    // After the comm: state(0) ppid(1) ... utime(11) stime(12).
    let ppid = f.get(1)?.parse().ok()?;
    let ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    Some((comm, ppid, ticks, f.get(19)?.parse().ok()?))
}

/// Every process now.
pub fn snapshot() -> HashMap<u32, Proc> {
    let hz = crate::os::procfs::clock_ticks() as f64;
    let mut out = HashMap::new();
    for pid in crate::os::procfs::all_pids() {
        let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        if let Some((comm, ppid, ticks, start)) = parse_stat(&text) {
            out.insert(pid, Proc { comm, ppid, cpu_s: ticks as f64 / hz, start });
        }
    }
    out
}

/// CPU seconds each process used between two snapshots (one that started in between counts
/// from zero; one that exited in between is not seen), largest first.
pub fn used(before: &HashMap<u32, Proc>, after: &HashMap<u32, Proc>) -> Vec<(u32, String, f64)> {
    let mut v: Vec<(u32, String, f64)> = after
        .iter()
        .map(|(pid, p)| (*pid, p.comm.clone(), p.cpu_s - before.get(pid).filter(|b| b.start == p.start).map_or(0.0, |b| b.cpu_s)))
        .filter(|(_, _, s)| *s > 0.0)
        .collect();
    v.sort_by(|a, b| b.2.total_cmp(&a.2));
    v
}

/// `root` and its descendants in a snapshot.
pub fn family(snap: &HashMap<u32, Proc>, root: u32) -> std::collections::HashSet<u32> {
    let parent: Vec<(u32, u32)> = snap.iter().map(|(pid, p)| (*pid, p.ppid)).collect();
    let mut set: std::collections::HashSet<u32> = crate::os::procfs::descendants_in(&parent, root).into_iter().collect();
    set.insert(root);
    set
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_lines_with_odd_names() {
        let line = "1234 (my (odd) name) R 77 1234 1234 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 3 0 100 0 0";
        assert_eq!(parse_stat(line), Some(("my (odd) name".into(), 77, 300, 100)));
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn a_busy_thread_shows_in_the_difference() {
        let me = std::process::id();
        let a = snapshot();
        let t = std::time::Instant::now();
        let mut x = 0u64;
        while t.elapsed() < std::time::Duration::from_millis(300) {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
        }
        let b = snapshot();
        let u = used(&a, &b);
        let mine = u.iter().find(|(p, _, _)| *p == me).map_or(0.0, |x| x.2);
        assert!(mine >= 0.1, "this process used {mine} s of CPU in a 300 ms busy loop: {u:?}");
        assert!(family(&b, 1).len() > 1);
        // A process that changed its name (a kernel worker does with its work) is the same one.
        let mut renamed = a.clone();
        for p in renamed.values_mut() {
            p.comm.push_str("-renamed");
        }
        let since = used(&renamed, &b);
        let total: f64 = since.iter().map(|x| x.2).sum();
        let all: f64 = b.values().map(|p| p.cpu_s).sum();
        assert!(total < all / 2.0 || all < 1.0, "cumulative CPU counted as used: {total} of {all}");
    }
}
