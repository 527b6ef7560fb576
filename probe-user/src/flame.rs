//! Flamegraphs from a recording: stack records (frames as module + file offset, kernel
//! addresses) are symbolized with blazesym (ELF symbols, demangled C++/Rust; kernel names
//! from the recording, see crate::ksyms), folded (`root;caller;callee weight`, flamegraph.pl / speedscope format) and
//! rendered to SVG with inferno.
use std::collections::{BTreeMap, HashMap};

use blazesym::symbolize::{
    Input, Symbolized, Symbolizer,
    source::{Elf, Source},
};

use crate::recording::{
    Frame, ReadError, Reader, Recording, StackKind, StackRecord,
    records::{Meta, UserRecord},
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
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
    /// The stack samples this graph is made of.
    pub fn what(self) -> StackKind {
        match self {
            Kind::Cpu => StackKind::Cpu,
            Kind::Offcpu => StackKind::Offcpu,
            Kind::Faults => StackKind::Fault,
            Kind::Io => StackKind::Io,
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

/// What symbolization needs from a recording: its module table, the user frames its stacks
/// use (each once) and its kernel names. Grows with distinct frames, not with samples.
#[derive(Default)]
struct Wanted {
    modules: HashMap<i64, String>,
    offsets: BTreeMap<i64, std::collections::BTreeSet<u64>>,
    names: crate::ksyms::NamesBuilder,
}

impl Wanted {
    fn record(&mut self, r: &UserRecord) {
        match r {
            UserRecord::Module(m) => {
                self.modules.insert(m.id, m.path.clone());
            }
            UserRecord::Ksyms(k) => self.names.feed_ksyms(k),
            _ => {}
        }
    }

    fn stack(&mut self, s: &StackRecord) {
        for &(id, off) in &s.user {
            self.offsets.entry(id).or_default().insert(off);
        }
        self.names.feed_stack(s);
    }
}

impl Symbols {
    pub fn resolve(rec: &Recording) -> Symbols {
        let mut w = Wanted::default();
        rec.records.iter().for_each(|r| w.record(r));
        rec.stacks.iter().for_each(|s| w.stack(s));
        Symbols::of(w)
    }

    /// Symbols for every stack of the recording in `dir`, streamed.
    pub fn resolve_dir(dir: &std::path::Path) -> Result<Symbols, ReadError> {
        let mut w = Wanted::default();
        let mut r = Reader::open(dir)?;
        while let Some(f) = r.next_frame() {
            match f {
                Frame::Stack(s) => w.stack(&s),
                Frame::Json(b) => match UserRecord::parse(&b) {
                    Ok(UserRecord::Stack(s)) => w.stack(&s),
                    Ok(u) => w.record(&u),
                    Err(_) => {}
                },
                Frame::Kernel(_) => {}
            }
        }
        Ok(Symbols::of(w))
    }

    fn of(w: Wanted) -> Symbols {
        let (modules, wanted) = (w.modules, w.offsets);
        let symbolizer = Symbolizer::new();
        let mut user = HashMap::new();
        for (id, offs) in wanted {
            let offs: Vec<u64> = offs.into_iter().collect();
            let Some(path) = modules.get(&id) else { continue };
            let base = path.rsplit('/').next().unwrap_or(path);
            let names = symbolizer.symbolize(&Source::Elf(Elf::new(path)), Input::FileOffset(&offs)).unwrap_or_default();
            for (i, off) in offs.iter().enumerate() {
                let name = names.get(i).and_then(sym_name).unwrap_or_else(|| format!("{base}+{off:#x}"));
                user.insert((id, *off), name);
            }
        }
        Symbols { user, kernel: w.names.finish() }
    }

    fn user(&self, id: i64, off: u64) -> String {
        self.user
            .get(&(id, off))
            .cloned()
            .unwrap_or_else(|| if id < 0 { format!("[unknown] {off:#x}") } else { format!("[module {id}]+{off:#x}") })
    }
}

/// Folded stacks: `comm;outer;...;inner;kernel_[k]` → weight, per kind, sorted by stack.
pub type Folded = BTreeMap<String, u64>;

/// Every kind's folded stacks of a recording, with the symbols they were named with.
pub struct Flames {
    pub symbols: Symbols,
    pub by_kind: BTreeMap<Kind, Folded>,
}

/// A distinct stack before it is named: kind, process, wait class, user and kernel frames.
type RawStack = (Kind, u32, &'static str, Vec<(i64, u64)>, Vec<u64>);

/// Folds stack samples one at a time: weights are summed per distinct raw stack, and each
/// distinct stack is named once at the end.
struct Folder<'a> {
    syms: &'a Symbols,
    root_pid: u32,
    root_comm: String,
    window: Window,
    raw: HashMap<RawStack, u64>,
}

impl Folder<'_> {
    fn add(&mut self, s: &StackRecord) {
        let Some(kind) = Kind::ALL.into_iter().find(|k| k.what() == s.what) else { return };
        if self.window.from_ns.is_some_and(|f| s.ts_ns < f) || self.window.to_ns.is_some_and(|t| s.ts_ns > t) {
            return;
        }
        let weight = match kind {
            Kind::Offcpu => s.blocked_ns.unwrap_or(0) / 1000,
            _ => 1,
        };
        if weight == 0 {
            return;
        }
        let wait = if kind == Kind::Offcpu { self.syms.kernel.wait_of_stack(s) } else { "" };
        *self.raw.entry((kind, s.pid, wait, s.user.clone(), s.kernel.clone())).or_default() += weight;
    }

    fn finish(self) -> BTreeMap<Kind, Folded> {
        let syms = self.syms;
        let mut out: BTreeMap<Kind, Folded> = BTreeMap::new();
        for ((kind, pid, wait, user, kernel), weight) in self.raw {
            let mut frames = vec![if pid == self.root_pid { self.root_comm.clone() } else { format!("pid {pid}") }];
            if kind == Kind::Offcpu {
                frames.push(wait.to_string());
            }
            frames.extend(user.iter().rev().map(|&(id, off)| syms.user(id, off)));
            frames.extend(kernel.iter().rev().map(|&a| format!("{}_[k]", syms.kernel.frame(a))));
            // ';' separates frames in the folded format.
            let line = frames.iter().map(|f| f.replace(';', ":")).collect::<Vec<_>>().join(";");
            *out.entry(kind).or_default().entry(line).or_default() += weight;
        }
        out
    }
}

fn root(meta: Option<&Meta>) -> (u32, String) {
    (meta.map_or(0, |m| m.pid), meta.map_or_else(|| "target".to_string(), |m| m.comm.clone()))
}

impl Flames {
    /// The flamegraphs of the recording in `dir`, streamed in two passes (symbols, then folding):
    /// memory grows with distinct stacks, not with samples.
    pub fn of_dir(dir: &std::path::Path, window: Window) -> Result<Flames, ReadError> {
        let symbols = Symbols::resolve_dir(dir)?;
        let mut r = Reader::open(dir)?;
        let mut meta = None;
        let mut folder: Option<Folder> = None;
        while let Some(f) = r.next_frame() {
            let s = match f {
                Frame::Stack(s) => s,
                Frame::Json(b) => match UserRecord::parse(&b) {
                    Ok(UserRecord::Meta(m)) if meta.is_none() => {
                        meta = Some(*m);
                        continue;
                    }
                    Ok(UserRecord::Stack(s)) => *s,
                    _ => continue,
                },
                Frame::Kernel(_) => continue,
            };
            folder
                .get_or_insert_with(|| {
                    let (root_pid, root_comm) = root(meta.as_ref());
                    Folder { syms: &symbols, root_pid, root_comm, window, raw: HashMap::new() }
                })
                .add(&s);
        }
        let by_kind = folder.map(Folder::finish).unwrap_or_default();
        Ok(Flames { symbols, by_kind })
    }

    /// Those of a recording in memory.
    pub fn of(rec: &Recording, window: Window) -> Flames {
        let symbols = Symbols::resolve(rec);
        let (root_pid, root_comm) = root(rec.meta());
        let mut f = Folder { syms: &symbols, root_pid, root_comm, window, raw: HashMap::new() };
        rec.stacks.iter().for_each(|s| f.add(s));
        let by_kind = f.finish();
        Flames { symbols, by_kind }
    }

    /// One kind's folded stacks (empty when there are none).
    pub fn get(&self, kind: Kind) -> Folded {
        self.by_kind.get(&kind).cloned().unwrap_or_default()
    }
}

/// Folded stacks of one kind in a recording in memory.
pub fn folded(rec: &Recording, syms: &Symbols, kind: Kind, window: Window) -> Folded {
    let (root_pid, root_comm) = root(rec.meta());
    let mut f = Folder { syms, root_pid, root_comm, window, raw: HashMap::new() };
    rec.stacks.iter().filter(|s| s.what == kind.what()).for_each(|s| f.add(s));
    f.finish().remove(&kind).unwrap_or_default()
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
pub fn write_defaults(flames: &Flames, dir: &std::path::Path) -> std::io::Result<Vec<(std::path::PathBuf, u64)>> {
    let mut written = Vec::new();
    for kind in Kind::ALL {
        let f = flames.get(kind);
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
