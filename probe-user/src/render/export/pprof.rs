//! Stacks → pprof (profile.proto, gzipped): the format `go tool pprof`, Pyroscope, Grafana,
//! Parca and speedscope read. One profile per kind of stack, each with its own sample types:
//!
//! | file            | sample types                                   |
//! |-----------------|------------------------------------------------|
//! | cpu.pb.gz       | samples/count, cpu/nanoseconds (1/hz each)     |
//! | offcpu.pb.gz    | waits/count, off_cpu/nanoseconds               |
//! | faults.pb.gz    | major_faults/count                             |
//! | io.pb.gz        | block_requests/count                           |
//!
//! Labels per sample: `pid`, `tid` (numbers), `comm` (the process), `wait` (off-CPU: the wait
//! class) and `request`, once per request in flight at the sample (its id in report.json).
//! Frames keep what the recording has: user frames are (module, file offset), so each module is
//! a mapping with its path and GNU build ID at a base of its own (address = base + file offset),
//! and functions carry the names the flamegraphs use. Kernel frames sit in a `[kernel.kallsyms]`
//! mapping at their own addresses. A Python frame (`module.qualname (file.py:line)`) is a
//! function `module.qualname` of file `file.py`, at its line.
use std::collections::{BTreeMap, HashMap};

use super::proto::Msg;
use crate::{
    analysis::{
        flame::{Kind, Symbols},
        samples::{Key, Samples},
    },
    record::records::Meta,
};

/// A mapping's base for module `id`: modules never overlap (1 TiB apart).
fn base(id: i64) -> u64 {
    ((id.max(0) as u64) + 1) << 40
}
const KERNEL_MAPPING: u64 = 1;

/// The profile being built: string table, functions, locations, mappings, samples.
struct Builder {
    strings: Vec<String>,
    string_ids: HashMap<String, u64>,
    functions: HashMap<String, u64>,
    function_msgs: Vec<Msg>,
    /// (module id or i64::MIN for the kernel, offset or address) → location id.
    locations: HashMap<(i64, u64), u64>,
    location_msgs: Vec<Msg>,
    /// module id → mapping id (the kernel's is [`KERNEL_MAPPING`]).
    mappings: BTreeMap<i64, u64>,
}

impl Builder {
    fn new() -> Builder {
        let mut b = Builder {
            strings: Vec::new(),
            string_ids: HashMap::new(),
            functions: HashMap::new(),
            function_msgs: Vec::new(),
            locations: HashMap::new(),
            location_msgs: Vec::new(),
            mappings: BTreeMap::new(),
        };
        b.s("");
        b
    }

    fn s(&mut self, s: &str) -> u64 {
        if let Some(&i) = self.string_ids.get(s) {
            return i;
        }
        let i = self.strings.len() as u64;
        self.strings.push(s.to_string());
        self.string_ids.insert(s.to_string(), i);
        i
    }

    fn function(&mut self, name: &str, file: &str) -> u64 {
        if let Some(&id) = self.functions.get(name) {
            return id;
        }
        let id = self.function_msgs.len() as u64 + 1;
        let (n, f) = (self.s(name), self.s(file));
        let mut m = Msg::new();
        m.uint(1, id).uint(2, n).uint(3, n).uint(4, f);
        self.function_msgs.push(m);
        self.functions.insert(name.to_string(), id);
        id
    }

    /// The location of a user frame (module `id`, file offset) or, with `id == i64::MIN`, of a
    /// kernel address.
    fn location(&mut self, syms: &Symbols, id: i64, off: u64) -> u64 {
        if let Some(&l) = self.locations.get(&(id, off)) {
            return l;
        }
        let loc = self.location_msgs.len() as u64 + 1;
        let (mapping, address, name, file) = if id == i64::MIN {
            (KERNEL_MAPPING, off, syms.kernel.frame(off), "[kernel.kallsyms]".to_string())
        } else {
            let n = self.mappings.len() as u64 + 2;
            let mapping = if id >= 0 { *self.mappings.entry(id).or_insert(n) } else { 0 };
            let address = if id >= 0 { base(id) + off } else { off };
            (mapping, address, syms.user(id, off), syms.module(id).unwrap_or_default().to_string())
        };
        let (name, file, lineno) = match (id == crate::record::records::PY_MODULE).then(|| python_frame(&name)).flatten() {
            Some((n, f, l)) => (n.to_string(), f.to_string(), l),
            None => (name, file, None),
        };
        let f = self.function(&name, &file);
        let mut line = Msg::new();
        line.uint(1, f);
        if let Some(l) = lineno {
            line.uint(2, l);
        }
        let mut m = Msg::new();
        m.uint(1, loc).uint(2, mapping).uint(3, address).msg(4, &line);
        self.location_msgs.push(m);
        self.locations.insert((id, off), loc);
        loc
    }
}

/// A Python frame's name split: `module.qualname (file.py:12)` → (`module.qualname`, `file.py`,
/// 12); without a line (`(file.py)`), None for it.
fn python_frame(name: &str) -> Option<(&str, &str, Option<u64>)> {
    let (func, rest) = name.rsplit_once(" (")?;
    let inner = rest.strip_suffix(')')?;
    Some(match inner.rsplit_once(':') {
        Some((file, l)) if l.parse::<u64>().is_ok() => (func, file, l.parse().ok()),
        _ => (func, inner, None),
    })
}

/// Every kind's profile (kinds without stacks are left out), gzipped.
pub fn profiles(samples: &Samples, syms: &Symbols, meta: &Meta) -> Vec<(Kind, Vec<u8>)> {
    let span = (samples.first_ns, samples.last_ns);
    samples.raw.iter().map(|(kind, raw)| (*kind, gzip(&encode(*kind, raw, syms, meta, span)))).collect()
}

/// The sample types of a kind's profile: (type, unit).
fn sample_types(kind: Kind, cpu_hz: u64) -> Vec<(&'static str, &'static str)> {
    match kind {
        Kind::Cpu if cpu_hz > 0 => vec![("samples", "count"), ("cpu", "nanoseconds")],
        Kind::Cpu => vec![("samples", "count")],
        Kind::Offcpu => vec![("waits", "count"), ("off_cpu", "nanoseconds")],
        Kind::Faults => vec![("major_faults", "count")],
        Kind::Io => vec![("block_requests", "count")],
    }
}

/// A sample's values, in [`sample_types`]' order, from its count and summed value.
fn values(kind: Kind, cpu_hz: u64, n: u64, sum: u64) -> Vec<u64> {
    match kind {
        Kind::Cpu if cpu_hz > 0 => vec![n, n * (1_000_000_000 / cpu_hz)],
        Kind::Offcpu => vec![n, sum],
        _ => vec![n],
    }
}

fn encode(kind: Kind, samples: &HashMap<Key, (u64, u64)>, syms: &Symbols, meta: &Meta, (first_ns, last_ns): (u64, u64)) -> Vec<u8> {
    let mut b = Builder::new();
    let types = sample_types(kind, meta.cpu_hz);
    let type_msgs: Vec<Msg> = types
        .iter()
        .map(|(t, u)| {
            let mut m = Msg::new();
            m.uint(1, b.s(t)).uint(2, b.s(u));
            m
        })
        .collect();
    let (k_pid, k_tid, k_comm, k_wait, k_req) = (b.s("pid"), b.s("tid"), b.s("comm"), b.s("wait"), b.s("request"));
    let comm = b.s(&meta.comm);
    let k_id_unit = b.s("count");
    // Heaviest first: readers that stop early see what matters. Ties in key order, so the same
    // recording gives the same bytes every time.
    let mut samples: Vec<(&Key, &(u64, u64))> = samples.iter().collect();
    samples.sort_by(|a, b| b.1.1.cmp(&a.1.1).then(b.1.0.cmp(&a.1.0)).then_with(|| a.0.cmp(b.0)));
    let mut sample_msgs = Vec::with_capacity(samples.len());
    for (key, &(n, sum)) in samples {
        let mut locs: Vec<u64> = key.kernel.iter().map(|&a| b.location(syms, i64::MIN, a)).collect();
        locs.extend(key.user.iter().map(|&(id, off)| b.location(syms, id, off)));
        let mut m = Msg::new();
        m.packed(1, &locs).packed(2, &values(kind, meta.cpu_hz, n, sum));
        let label = |key: u64, s: u64, num: u64| {
            let mut l = Msg::new();
            l.uint(1, key).uint(2, s).uint(3, num);
            l
        };
        // A request id is a plain number (without a unit pprof would print it as bytes).
        let request_label = |num: u64| {
            let mut l = Msg::new();
            l.uint(1, k_req).uint(3, num).uint(4, k_id_unit);
            l
        };
        m.msg(3, &label(k_pid, 0, u64::from(key.pid))).msg(3, &label(k_tid, 0, u64::from(key.tid)));
        if key.pid == meta.pid {
            m.msg(3, &label(k_comm, comm, 0));
        }
        if !key.wait.is_empty() {
            let w = b.s(key.wait);
            m.msg(3, &label(k_wait, w, 0));
        }
        // One numeric label per request in flight: pprof keeps several values of a key, so
        // `-tagfocus request=3` (a numeric range to pprof) picks every sample taken while
        // request 3 was in flight.
        for &id in &key.requests {
            m.msg(3, &request_label(id));
        }
        sample_msgs.push(m);
    }
    let mut p = Msg::new();
    type_msgs.iter().for_each(|t| {
        p.msg(1, t);
    });
    sample_msgs.iter().for_each(|s| {
        p.msg(2, s);
    });
    // Mappings: the target's executable first (pprof names a profile after its first mapping),
    // the other modules (path and build ID; names are already given), the kernel last.
    let mut mappings: Vec<(i64, u64)> = b.mappings.iter().map(|(&k, &v)| (k, v)).collect();
    mappings.sort_by_key(|(id, _)| syms.module(*id) != Some(meta.exe.as_str()));
    for (id, mid) in mappings {
        let path = syms.module(id).unwrap_or_default().to_string();
        let build_id = syms.build_id(id).unwrap_or_default();
        let mut m = Msg::new();
        m.uint(1, mid).uint(2, base(id)).uint(3, base(id) + (1 << 40)).uint(4, 0).uint(5, b.s(&path)).uint(6, b.s(&build_id)).uint(7, 1);
        p.msg(3, &m);
    }
    let mut kernel = Msg::new();
    kernel.uint(1, KERNEL_MAPPING).uint(2, 0xffff_8000_0000_0000).uint(3, u64::MAX).uint(5, b.s("[kernel.kallsyms]")).uint(7, 1);
    p.msg(3, &kernel);
    b.location_msgs.iter().for_each(|l| {
        p.msg(4, l);
    });
    b.function_msgs.iter().for_each(|f| {
        p.msg(5, f);
    });
    let (start_unix_ns, duration) = (
        meta.start_unix_ms.saturating_mul(1_000_000) + first_ns.saturating_sub(meta.start_ns).min(u64::MAX / 4),
        last_ns.saturating_sub(first_ns),
    );
    let period_type = {
        let (t, u) = types[types.len() - 1];
        let mut m = Msg::new();
        m.uint(1, b.s(t)).uint(2, b.s(u));
        m
    };
    let comment = b.s(&format!("probe {} {} stacks of {} (pid {})", meta.probe_version, kind.name(), meta.comm, meta.pid));
    let default_type = b.s(types[types.len() - 1].0);
    for s in &b.strings {
        p.str(6, s);
    }
    p.int(9, start_unix_ns as i64).int(10, duration as i64).msg(11, &period_type);
    if kind == Kind::Cpu && meta.cpu_hz > 0 {
        p.int(12, (1_000_000_000 / meta.cpu_hz) as i64);
    }
    p.packed(13, &[comment]).int(14, default_type as i64);
    p.into_bytes()
}

fn gzip(b: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    let _ = e.write_all(b);
    e.finish().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_frames_split_into_function_file_and_line() {
        assert_eq!(python_frame("llama_cpp.llama.Llama.eval (llama.py:651)"), Some(("llama_cpp.llama.Llama.eval", "llama.py", Some(651))));
        assert_eq!(python_frame("<module> (<string>)"), Some(("<module>", "<string>", None)));
        assert_eq!(python_frame("f (a (b).py:3)"), Some(("f (a", "b).py", Some(3))));
        assert_eq!(python_frame("[python code 0x10]"), None);
    }
}
