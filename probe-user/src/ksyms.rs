//! Kernel symbols and off-CPU wait classes, resolved while tracing and stored in the recording.
//!
//! Kernel addresses mean something only on the machine and boot that made them: kallsyms reads
//! as zeros without root and KASLR moves the kernel at every boot. So `probe trace` names each
//! kernel address the first time a stack carries it (a `ksyms` record) and classifies every
//! off-CPU stack's wait (`wait` in the stack record). `probe report`, `timeline`, `flamegraph`
//! and `bundle` then read names and classes from the recording only: the same report as root,
//! as another user, after a reboot or on another machine.
use std::collections::HashMap;

use blazesym::symbolize::{
    Input, Symbolized, Symbolizer,
    source::{Kernel, Source},
};

use crate::recording::Recording;

/// What an off-CPU wait was, from the kernel stack at the switch. The closed set of classes.
pub const WAITS: [&str; 9] = [
    "[memory wait]",
    "[swap wait]",
    "[page-fault wait]",
    "[io wait]",
    "[lock wait]",
    "[sleep]",
    "[poll wait]",
    "[network wait]",
    "[other wait]",
];

/// Classify a wait by its kernel frames (names, innermost first).
pub fn wait_class<S: AsRef<str>>(kernel: &[S]) -> &'static str {
    let has = |s: &str| kernel.iter().any(|f| f.as_ref().contains(s));
    if has("try_to_free_")
        || has("shrink_")
        || has("compact_zone")
        || has("__alloc_pages_slowpath")
        || has("mem_cgroup_handle_over_high")
        || has("reclaim")
    {
        "[memory wait]"
    } else if has("do_swap_page") || has("swapin_readahead") || has("swap_read_folio") || has("swap_readpage") {
        // Faulting anonymous memory back in from swap (or zswap): a memory stall, whatever
        // device the swap area is on.
        "[swap wait]"
    } else if has("io_schedule") || has("folio_wait") || has("blk_") || has("bio_") || has("wait_on_page") {
        if has("page_fault") || has("filemap_fault") || has("handle_mm_fault") { "[page-fault wait]" } else { "[io wait]" }
    } else if has("futex") {
        "[lock wait]"
    } else if has("nanosleep") {
        "[sleep]"
    } else if has("ep_poll") || has("do_sys_poll") || has("do_select") || has("poll_schedule") {
        "[poll wait]"
    } else if has("sk_wait") || has("inet_csk_accept") || has("wait_woken") {
        "[network wait]"
    } else {
        "[other wait]"
    }
}

fn sym_name(s: &Symbolized<'_>) -> Option<String> {
    match s {
        Symbolized::Sym(sym) => Some(sym.name.to_string()),
        Symbolized::Unknown(_) => None,
    }
}

/// Names kernel addresses on the live machine (kallsyms), each address once.
pub struct Resolver {
    symbolizer: Symbolizer,
    known: HashMap<u64, Option<String>>,
}

impl Default for Resolver {
    fn default() -> Self {
        Resolver { symbolizer: Symbolizer::new(), known: HashMap::new() }
    }
}

impl Resolver {
    /// Resolve the addresses not seen before; returns them as a `ksyms` record to write (None when
    /// all were known). An address kallsyms cannot name is remembered as unnamed.
    pub fn learn(&mut self, addrs: &[u64]) -> Option<crate::recording::records::Ksyms> {
        let mut fresh: Vec<u64> = addrs.iter().copied().filter(|a| !self.known.contains_key(a)).collect();
        if fresh.is_empty() {
            return None;
        }
        fresh.sort_unstable();
        fresh.dedup();
        let names = self.symbolizer.symbolize(&Source::Kernel(Kernel::default()), Input::AbsAddr(&fresh)).unwrap_or_default();
        let mut syms = Vec::new();
        for (i, a) in fresh.iter().enumerate() {
            let name = names.get(i).and_then(sym_name);
            if let Some(n) = &name {
                syms.push((*a, n.clone()));
            }
            self.known.insert(*a, name);
        }
        (!syms.is_empty()).then_some(crate::recording::records::Ksyms { syms })
    }

    /// The names of `addrs` (innermost first), for the ones that have one.
    pub fn names(&self, addrs: &[u64]) -> Vec<&str> {
        addrs.iter().filter_map(|a| self.known.get(a)?.as_deref()).collect()
    }
}

/// The kernel names a recording carries.
#[derive(Clone, Debug, Default)]
pub struct Names {
    by_addr: HashMap<u64, String>,
    /// A recording from before `ksyms` records: waits are classified with this machine's
    /// kallsyms (right only on the machine and boot that traced).
    pub legacy: bool,
}

/// [`Names`] gathered record by record (the report streams a recording).
#[derive(Debug, Default)]
pub struct NamesBuilder {
    by_addr: HashMap<u64, String>,
    traced_with_names: bool,
    /// Kernel addresses of stack records, kept only while the recording might be an old one.
    addrs: std::collections::HashSet<u64>,
}

impl NamesBuilder {
    pub fn feed_ksyms(&mut self, k: &crate::recording::records::Ksyms) {
        self.traced_with_names = true;
        self.addrs.clear();
        for (a, n) in &k.syms {
            self.by_addr.insert(*a, n.clone());
        }
    }

    pub fn feed_stack(&mut self, s: &crate::recording::StackRecord) {
        if s.wait.is_some() {
            self.traced_with_names = true;
            self.addrs.clear();
        }
        if !self.traced_with_names {
            self.addrs.extend(s.kernel.iter().copied());
        }
    }

    pub fn finish(self) -> Names {
        if self.traced_with_names || self.addrs.is_empty() {
            return Names { by_addr: self.by_addr, legacy: false };
        }
        // An old recording: name its addresses here, as probe did before.
        let mut r = Resolver::default();
        let addrs: Vec<u64> = self.addrs.into_iter().collect();
        r.learn(&addrs);
        Names { by_addr: r.known.into_iter().filter_map(|(a, n)| Some((a, n?))).collect(), legacy: true }
    }
}

impl Names {
    pub fn of(rec: &Recording) -> Names {
        let mut b = NamesBuilder::default();
        for r in &rec.records {
            if let crate::recording::records::UserRecord::Ksyms(k) = r {
                b.feed_ksyms(k);
            }
        }
        for s in &rec.stacks {
            b.feed_stack(s);
        }
        b.finish()
    }

    /// A frame's name: its symbol, or the bare address when the trace could not name it.
    pub fn frame(&self, addr: u64) -> String {
        self.by_addr.get(&addr).cloned().unwrap_or_else(|| format!("{addr:#x}"))
    }

    /// [`Names::wait_of`] of a typed stack record.
    pub fn wait_of_stack(&self, s: &crate::recording::StackRecord) -> &'static str {
        if let Some(w) = &s.wait {
            return WAITS.iter().copied().find(|c| c == w).unwrap_or("[other wait]");
        }
        let names: Vec<&str> = s.kernel.iter().filter_map(|a| self.by_addr.get(a).map(String::as_str)).collect();
        wait_class(&names)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// Kernel stacks as this kernel (6.18) leaves them at the switch, innermost first.
    #[test]
    fn waits_are_classed_by_their_frames() {
        let swap_in = ["__schedule", "io_schedule", "folio_wait_bit_common", "do_swap_page", "__handle_mm_fault", "exc_page_fault"];
        assert_eq!(wait_class(&swap_in), "[swap wait]");
        let file = ["__schedule", "io_schedule", "folio_wait_bit_common", "filemap_fault", "__do_fault", "handle_mm_fault"];
        assert_eq!(wait_class(&file), "[page-fault wait]");
        // Reclaim on the way to a swap-in (a full cgroup) is reclaim.
        let charge = ["__schedule", "try_to_free_mem_cgroup_pages", "try_charge_memcg", "do_swap_page"];
        assert_eq!(wait_class(&charge), "[memory wait]");
        assert_eq!(wait_class(&["__schedule", "io_schedule", "blk_mq_submit_bio", "ext4_file_read_iter"]), "[io wait]");
        assert!(WAITS.contains(&wait_class(&swap_in)));
    }

    #[test]
    fn recorded_names_and_waits_win_over_the_live_machine() {
        let rec = Recording::from_json(vec![
            json!({"type": "ksyms", "syms": [[0xffff_ffff_8100_0000u64, "io_schedule"], [0xffff_ffff_8100_1000u64, "filemap_fault"]]}),
            json!({"type": "stack", "what": "offcpu", "pid": 1, "tid": 1, "ts_ns": 5, "kernel": [0xffff_ffff_8100_0000u64, 0xffff_ffff_8100_1000u64], "wait": "[page-fault wait]"}),
            json!({"type": "stack", "what": "offcpu", "pid": 1, "tid": 1, "ts_ns": 6, "kernel": [0xffff_ffff_8100_0000u64]}),
        ]);
        assert_eq!(rec.stacks.len(), 2);
        let n = Names::of(&rec);
        assert!(!n.legacy);
        assert_eq!(n.frame(0xffff_ffff_8100_1000), "filemap_fault");
        assert_eq!(n.frame(0x1234), "0x1234");
        assert_eq!(n.wait_of_stack(&rec.stacks[0]), "[page-fault wait]");
        // No recorded class: classified from the recorded names.
        assert_eq!(n.wait_of_stack(&rec.stacks[1]), "[io wait]");
        let made_up = crate::recording::StackRecord { wait: Some("[made up]".into()), ..Default::default() };
        assert_eq!(n.wait_of_stack(&made_up), "[other wait]");
    }
}
