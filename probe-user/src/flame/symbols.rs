//! What frames are called: user frames (module + file offset) by their ELF symbols (blazesym,
//! demangled), kernel addresses by the names the recording carries (crate::ksyms). Resolved once
//! per recording, for the distinct frames only.
use std::collections::{BTreeMap, HashMap};

use blazesym::symbolize::{
    Input, Symbolized, Symbolizer,
    source::{Elf, Source},
};

use crate::recording::{Frame, ReadError, Reader, Recording, StackRecord, records::UserRecord};

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

    pub(super) fn user(&self, id: i64, off: u64) -> String {
        self.user
            .get(&(id, off))
            .cloned()
            .unwrap_or_else(|| if id < 0 { format!("[unknown] {off:#x}") } else { format!("[module {id}]+{off:#x}") })
    }
}
