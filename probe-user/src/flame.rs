//! Flamegraphs from a recording: stack records (frames as module + file offset, kernel
//! addresses) are symbolized with blazesym (ELF symbols, demangled C++/Rust; kernel names
//! from the recording, see crate::ksyms), folded (`root;caller;callee weight`, flamegraph.pl / speedscope format) and
//! rendered to SVG with inferno.
use std::collections::{BTreeMap, HashMap};

use blazesym::symbolize::{Input, Symbolized, Symbolizer, source::{Elf, Source}};

use crate::recording::Recording;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Cpu,
    Offcpu,
    Faults,
    Io,
}

impl Kind {
    pub const ALL: [Kind; 4] = [Kind::Cpu, Kind::Offcpu, Kind::Faults, Kind::Io];

    pub fn parse(s: &str) -> Option<Kind> {
        Some(match s {
            "cpu" => Kind::Cpu,
            "offcpu" => Kind::Offcpu,
            "faults" | "fault" => Kind::Faults,
            "io" => Kind::Io,
            _ => return None,
        })
    }
    pub fn name(self) -> &'static str {
        match self {
            Kind::Cpu => "cpu",
            Kind::Offcpu => "offcpu",
            Kind::Faults => "faults",
            Kind::Io => "io",
        }
    }
    /// The `what` of the stack records this graph is made of.
    fn what(self) -> &'static str {
        match self {
            Kind::Cpu => "cpu",
            Kind::Offcpu => "offcpu",
            Kind::Faults => "fault",
            Kind::Io => "io",
        }
    }
    fn unit(self) -> &'static str {
        match self {
            Kind::Cpu => "samples",
            Kind::Offcpu => "us",
            Kind::Faults => "major faults",
            Kind::Io => "block requests",
        }
    }
}

/// Which stacks: a time window (CLOCK_MONOTONIC ns).
#[derive(Clone, Copy, Debug, Default)]
pub struct Window {
    pub from_ns: Option<u64>,
    pub to_ns: Option<u64>,
}

/// Names for (module, file offset) and kernel addresses, resolved once per recording.
pub struct Symbols {
    user: HashMap<(i64, u64), String>,
    /// Kernel names and wait classes come from the recording (see crate::ksyms).
    pub kernel: crate::ksyms::Names,
}

fn sym_name(s: &Symbolized<'_>) -> Option<String> {
    match s {
        Symbolized::Sym(sym) => Some(sym.name.to_string()),
        Symbolized::Unknown(_) => None,
    }
}

impl Symbols {
    pub fn resolve(rec: &Recording) -> Symbols {
        let modules: HashMap<i64, String> = rec
            .json
            .iter()
            .filter(|v| v["type"] == "module")
            .filter_map(|v| Some((v["id"].as_i64()?, v["path"].as_str()?.to_string())))
            .collect();
        let mut wanted: BTreeMap<i64, Vec<u64>> = BTreeMap::new();
        for v in rec.json.iter().filter(|v| v["type"] == "stack") {
            for f in v["user"].as_array().into_iter().flatten() {
                if let (Some(id), Some(off)) = (f[0].as_i64(), f[1].as_u64()) {
                    wanted.entry(id).or_default().push(off);
                }
            }
        }
        let symbolizer = Symbolizer::new();
        let mut user = HashMap::new();
        for (id, mut offs) in wanted {
            offs.sort_unstable();
            offs.dedup();
            let Some(path) = modules.get(&id) else { continue };
            let base = path.rsplit('/').next().unwrap_or(path);
            let names = symbolizer.symbolize(&Source::Elf(Elf::new(path)), Input::FileOffset(&offs)).unwrap_or_default();
            for (i, off) in offs.iter().enumerate() {
                let name = names.get(i).and_then(sym_name).unwrap_or_else(|| format!("{base}+{off:#x}"));
                user.insert((id, *off), name);
            }
        }
        Symbols { user, kernel: crate::ksyms::Names::of(rec) }
    }

    fn user(&self, id: i64, off: u64) -> String {
        self.user.get(&(id, off)).cloned().unwrap_or_else(|| if id < 0 { format!("[unknown] {off:#x}") } else { format!("[module {id}]+{off:#x}") })
    }
}

/// Folded stacks of one kind: `comm;outer;...;inner;kernel_[k]` → weight, sorted by stack.
pub fn folded(rec: &Recording, syms: &Symbols, kind: Kind, window: Window) -> BTreeMap<String, u64> {
    let meta = rec.json.iter().find(|v| v["type"] == "meta");
    let root_pid = meta.and_then(|m| m["pid"].as_u64()).unwrap_or(0);
    let root_comm = meta.and_then(|m| m["comm"].as_str()).unwrap_or("target").to_string();
    let mut out = BTreeMap::new();
    for v in rec.json.iter().filter(|v| v["type"] == "stack" && v["what"] == kind.what()) {
        let ts = v["ts_ns"].as_u64().unwrap_or(0);
        if window.from_ns.is_some_and(|f| ts < f) || window.to_ns.is_some_and(|t| ts > t) {
            continue;
        }
        let pid = v["pid"].as_u64().unwrap_or(0);
        let mut frames = vec![if pid == root_pid { root_comm.clone() } else { format!("pid {pid}") }];
        let kernel: Vec<String> = crate::ksyms::kernel_addrs(v).into_iter().map(|a| syms.kernel.frame(a)).collect();
        if kind == Kind::Offcpu {
            frames.push(syms.kernel.wait_of(v).to_string());
        }
        let user: Vec<String> = v["user"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|f| Some(syms.user(f[0].as_i64()?, f[1].as_u64()?)))
            .collect();
        frames.extend(user.into_iter().rev());
        frames.extend(kernel.into_iter().rev().map(|k| format!("{k}_[k]")));
        let weight = match kind {
            Kind::Offcpu => v["blocked_ns"].as_u64().unwrap_or(0) / 1000,
            _ => 1,
        };
        if weight > 0 {
            // ';' separates frames in the folded format.
            let line = frames.iter().map(|f| f.replace(';', ":")).collect::<Vec<_>>().join(";");
            *out.entry(line).or_default() += weight;
        }
    }
    out
}

pub fn folded_text(f: &BTreeMap<String, u64>) -> String {
    f.iter().map(|(k, v)| format!("{k} {v}\n")).collect()
}

/// An interactive SVG (inferno), deterministic for the same input.
pub fn svg(f: &BTreeMap<String, u64>, kind: Kind, title: &str) -> std::io::Result<Vec<u8>> {
    let mut opts = inferno::flamegraph::Options::default();
    opts.title = title.to_string();
    opts.count_name = kind.unit().to_string();
    opts.deterministic = true;
    opts.hash = true;
    if kind == Kind::Offcpu {
        opts.colors = inferno::flamegraph::color::Palette::Basic(inferno::flamegraph::color::BasicPalette::Blue);
    }
    let text = folded_text(f);
    let mut out = Vec::new();
    inferno::flamegraph::from_lines(&mut opts, text.lines(), &mut out)?;
    Ok(out)
}

/// Write `<dir>/flame-<kind>.svg` and `.folded` for every kind that has stacks; returns what
/// was written (path, stacks weight).
pub fn write_defaults(rec: &Recording, syms: &Symbols, dir: &std::path::Path) -> std::io::Result<Vec<(std::path::PathBuf, u64)>> {
    let mut written = Vec::new();
    for kind in Kind::ALL {
        let f = folded(rec, syms, kind, Window::default());
        if f.is_empty() {
            continue;
        }
        let path = dir.join(format!("flame-{}.svg", kind.name()));
        std::fs::write(&path, svg(&f, kind, &format!("probe: {} stacks", kind.name()))?)?;
        std::fs::write(path.with_extension("folded"), folded_text(&f))?;
        written.push((path, f.values().sum()));
    }
    Ok(written)
}
