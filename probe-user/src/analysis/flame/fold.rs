//! Stack samples → folded stacks (`root;caller;callee` → weight), per kind: weights summed per
//! distinct raw stack while the samples stream past, each distinct stack named once.
use std::collections::{BTreeMap, HashMap};

use super::{Kind, Symbols, Window};
use crate::record::{Recording, StackRecord, records::Meta};

/// Folded stacks: `comm;outer;...;inner;kernel_[k]` → weight, per kind, sorted by stack.
pub type Folded = BTreeMap<String, u64>;

/// Every kind's folded stacks of a recording, with the symbols they were named with.
#[derive(Default)]
pub struct Flames {
    pub symbols: Symbols,
    pub by_kind: BTreeMap<Kind, Folded>,
}

/// A distinct stack before it is named: kind, process, wait class, user and kernel frames.
type RawStack = (Kind, u32, &'static str, Vec<(i64, u64)>, Vec<u64>);

/// Folds stack samples one at a time: weights are summed per distinct raw stack, and each
/// distinct stack is named once at the end.
pub(crate) struct Folder<'a> {
    syms: &'a Symbols,
    root_pid: u32,
    root_comm: String,
    window: Window,
    raw: HashMap<RawStack, u64>,
}

impl<'a> Folder<'a> {
    /// Folds the stacks of the recording whose meta record is `meta`, inside `window`.
    pub(crate) fn new(syms: &'a Symbols, meta: Option<&Meta>, window: Window) -> Folder<'a> {
        let (root_pid, root_comm) = root(meta);
        Folder { syms, root_pid, root_comm, window, raw: HashMap::new() }
    }

    pub(crate) fn add(&mut self, s: &StackRecord) {
        let Some(kind) = Kind::ALL.into_iter().find(|k| k.what() == s.what) else { return };
        let w = self.window;
        let weight = if kind == Kind::Offcpu && w.request {
            // The part of the wait inside the request, if it ended inside it (µs).
            let (from, to) = (w.from_ns.unwrap_or(0), w.to_ns.unwrap_or(u64::MAX));
            let end = s.ts_ns + s.blocked_ns.unwrap_or(0);
            if end < from || end > to {
                return;
            }
            (end - s.ts_ns.max(from)) / 1000
        } else {
            if w.from_ns.is_some_and(|f| s.ts_ns < f) || w.to_ns.is_some_and(|t| s.ts_ns > t) {
                return;
            }
            match kind {
                Kind::Offcpu => s.blocked_ns.unwrap_or(0) / 1000,
                _ => 1,
            }
        };
        if weight == 0 {
            return;
        }
        let wait = if kind == Kind::Offcpu { self.syms.kernel.wait_of_stack(s) } else { "" };
        *self.raw.entry((kind, s.pid, wait, s.user.clone(), s.kernel.clone())).or_default() += weight;
    }

    pub(crate) fn finish(self) -> BTreeMap<Kind, Folded> {
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
    /// Those of a recording in memory.
    pub fn of(rec: &Recording, window: Window) -> Flames {
        let symbols = Symbols::resolve(rec);
        let mut f = Folder::new(&symbols, rec.meta(), window);
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
    let mut f = Folder::new(syms, rec.meta(), window);
    rec.stacks.iter().filter(|s| s.what == kind.what()).for_each(|s| f.add(s));
    f.finish().remove(&kind).unwrap_or_default()
}

/// The folded form as text: `root;caller;callee weight` a line (flamegraph.pl, speedscope).
pub fn folded_text(f: &BTreeMap<String, u64>) -> String {
    f.iter().map(|(k, v)| format!("{k} {v}\n")).collect()
}
