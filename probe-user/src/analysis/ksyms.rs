//! Kernel symbols and off-CPU wait classes, resolved while tracing and stored in the recording.
//!
//! Kernel addresses mean something only on the machine and boot that made them: kallsyms reads
//! as zeros without root and KASLR moves the kernel at every boot. So `probe trace` names each
//! kernel address the first time a stack carries it (a `ksyms` record) and classifies every
//! off-CPU stack's wait (`wait` in the stack record). `probe report`, `timeline`, `flamegraph`
//! and `bundle` then read names and classes from the recording only: the same report as root,
//! as another user, after a reboot or on another machine.
use std::collections::HashMap;

use crate::record::Recording;

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

crate::closed_set! {
    /// An off-CPU wait's class ([`WAITS`], the words the recording stores), to compare as a value.
    Wait {
        Memory = "[memory wait]",
        Swap = "[swap wait]",
        PageFault = "[page-fault wait]",
        Io = "[io wait]",
        Lock = "[lock wait]",
        Sleep = "[sleep]",
        Poll = "[poll wait]",
        Network = "[network wait]",
        #[default]
        Other = "[other wait]",
    }
}

impl Wait {
    /// The class a word names; a word outside [`WAITS`] is `[other wait]`.
    pub fn of(word: &str) -> Wait {
        word.parse().unwrap_or(Wait::Other)
    }
}

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

/// The kernel's text symbols, sorted by address: a frame is named by the last symbol at or
/// below it (as kallsyms itself names addresses). Built from `/proc/kallsyms` (121,000 lines and
/// 36 ms of the kernel's time to print here, the first stack's naming was most of probe's CPU in
/// the second after attach) once per boot and kernel module set, then kept in `/run/probe`
/// ([`crate::os::kernel_cache`]): a later trace reads its own copy.
///
/// The table is kept in one form, in memory or mapped from the kept file ([`Table::to_bytes`]):
/// mapped, a trace's first kernel stack costs the few pages its lookups touch, where reading and
/// unpacking the 3–4 MB file took 5–8 ms of the drain's first turn, at normal priority, while the
/// request the user attached for was running.
struct Table {
    body: Body,
    /// Symbols in the table.
    n: usize,
}

/// Where a table's bytes are: built here from kallsyms, or mapped from the kept file.
enum Body {
    Owned(Vec<u8>),
    Mapped(crate::os::kernel_cache::Mapped),
}

impl Default for Table {
    fn default() -> Table {
        Table { body: Body::Owned(0u64.to_ne_bytes().to_vec()), n: 0 }
    }
}

const CACHE: &str = "kallsyms";

impl Table {
    /// The running kernel's table, one for the process (`watch --all` follows many servers):
    /// the one in memory while its key holds, else [`Table::load`].
    fn shared() -> std::sync::Arc<Table> {
        static SHARED: std::sync::Mutex<Option<(String, std::sync::Arc<Table>)>> = std::sync::Mutex::new(None);
        let key = cache_key();
        let mut g = SHARED.lock().unwrap_or_else(|e| e.into_inner());
        match &*g {
            Some((k, t)) if *k == key => t.clone(),
            _ => {
                let t = std::sync::Arc::new(Table::load(&key));
                *g = Some((key, t.clone()));
                t
            }
        }
    }

    /// The running kernel's table: kept from an earlier trace of this boot when its key still
    /// holds, else read from kallsyms (and kept for the next).
    fn load(key: &str) -> Table {
        let dir = std::path::Path::new(crate::os::run_dir::DIR);
        if let Some(t) = crate::os::kernel_cache::map_bytes(dir, CACHE, key, 256 << 20).and_then(|m| Table::from_body(Body::Mapped(m))) {
            return t;
        }
        let Ok(text) = std::fs::read_to_string("/proc/kallsyms") else { return Table::default() };
        let t = Table::parse(&text);
        if t.n > 0 {
            crate::os::kernel_cache::store_bytes(dir, CACHE, key, t.to_bytes());
        }
        t
    }

    /// The kept form: the count (u64), the addresses (u64 each), where each name starts (u32
    /// each), the names; native byte order (the same machine reads it back). Read back without
    /// parsing text: 2 ms where the 121,000 lines took 20; mapped, without reading at all.
    fn to_bytes(&self) -> &[u8] {
        match &self.body {
            Body::Owned(b) => b,
            Body::Mapped(m) => m,
        }
    }

    /// A table in its kept form; None when it does not hold together (the sizes, sorted
    /// addresses, name starts in order and inside the names). A name that is not UTF-8 is read as
    /// none.
    fn from_body(body: Body) -> Option<Table> {
        let b = match &body {
            Body::Owned(b) => &b[..],
            Body::Mapped(m) => &m[..],
        };
        let n = usize::try_from(u64::from_ne_bytes(b.get(..8)?.try_into().ok()?)).ok()?;
        let names_at = n.checked_mul(12)?.checked_add(8)?;
        if b.len() < names_at {
            return None;
        }
        let t = Table { n, body: Body::Owned(Vec::new()) };
        let (addr, at) = (|i| t.addr_in(b, i), |i| t.at_in(b, i));
        let names = b.len() - names_at;
        let fits = (1..n).all(|i| addr(i - 1) <= addr(i) && at(i - 1) <= at(i)) && (n == 0 || at(n - 1) as usize <= names);
        fits.then_some(Table { body, n })
    }

    #[cfg(test)]
    fn from_bytes(b: &[u8]) -> Option<Table> {
        Table::from_body(Body::Owned(b.to_vec()))
    }

    fn addr_in(&self, b: &[u8], i: usize) -> u64 {
        let o = 8 + 8 * i;
        u64::from_ne_bytes(b[o..o + 8].try_into().expect("8 bytes"))
    }

    fn at_in(&self, b: &[u8], i: usize) -> u32 {
        let o = 8 + 8 * self.n + 4 * i;
        u32::from_ne_bytes(b[o..o + 4].try_into().expect("4 bytes"))
    }

    /// kallsyms lines (`ADDR TYPE NAME [MODULE]`): text symbols (t, T, w, W) at a non-zero address
    /// (without root every address reads as zero: nothing is named).
    fn parse(text: &str) -> Table {
        let mut v: Vec<(u64, &str)> = text
            .lines()
            .filter_map(|l| {
                let (addr, rest) = l.split_once(' ')?;
                let (kind, rest) = rest.split_once(' ')?;
                let name = rest.split_once(['\t', ' ']).map_or(rest, |(n, _)| n);
                let addr = u64::from_str_radix(addr, 16).ok().filter(|&a| a != 0)?;
                matches!(kind, "t" | "T" | "w" | "W").then_some((addr, name))
            })
            .collect();
        v.sort_by_key(|&(a, _)| a);
        // Names past 4 GiB in all cannot be placed: the table ends before them.
        let mut names = String::new();
        let mut at = Vec::with_capacity(v.len());
        for &(_, n) in &v {
            let Ok(a) = u32::try_from(names.len()) else { break };
            at.push(a);
            names.push_str(n);
        }
        let n = at.len();
        let mut b = Vec::with_capacity(8 + n * 12 + names.len());
        b.extend_from_slice(&(n as u64).to_ne_bytes());
        b.extend(v.iter().take(n).flat_map(|(a, _)| a.to_ne_bytes()));
        b.extend(at.iter().flat_map(|a| a.to_ne_bytes()));
        b.extend_from_slice(names.as_bytes());
        Table { body: Body::Owned(b), n }
    }

    fn name(&self, i: usize) -> Option<&str> {
        let b = self.to_bytes();
        let names = &b[8 + 12 * self.n..];
        let from = self.at_in(b, i) as usize;
        let to = if i + 1 < self.n { self.at_in(b, i + 1) as usize } else { names.len() };
        std::str::from_utf8(names.get(from..to)?).ok()
    }

    /// The symbol holding `addr`: the last one at or below it.
    fn lookup(&self, addr: u64) -> Option<&str> {
        let b = self.to_bytes();
        // The first symbol above `addr` (a binary search over the kept form).
        let (mut lo, mut hi) = (0, self.n);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if self.addr_in(b, mid) <= addr {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        self.name(lo.checked_sub(1)?)
    }
}

/// What the kept table must match: this boot (KASLR moves the kernel at every boot), the kernel
/// build, and the modules loaded (each at its addresses).
fn cache_key() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let modules = std::fs::read("/proc/modules").unwrap_or_default();
    let mut h = std::hash::DefaultHasher::new();
    std::hash::Hash::hash(&modules, &mut h);
    format!("boot {} kernel {} modules {:016x}", boot.trim(), crate::os::kernel_cache::kernel_id(), std::hash::Hasher::finish(&h))
}

/// Names kernel addresses on the live machine (kallsyms), each address once.
#[derive(Default)]
pub struct Resolver {
    table: Option<std::sync::Arc<Table>>,
    known: HashMap<u64, Option<String>>,
    /// The wait class of each kernel stack seen (the same few stacks recur at every switch).
    classes: HashMap<Vec<u64>, &'static str>,
}

/// The most kernel stacks whose wait class is remembered (then the memory starts over).
const MAX_CLASSES: usize = 4096;

impl Resolver {
    /// Resolve the addresses not seen before; returns them as a `ksyms` record to write (None when
    /// all were known). An address kallsyms cannot name is remembered as unnamed.
    pub fn learn(&mut self, addrs: &[u64]) -> Option<crate::record::records::Ksyms> {
        let mut fresh: Vec<u64> = addrs.iter().copied().filter(|a| !self.known.contains_key(a)).collect();
        if fresh.is_empty() {
            return None;
        }
        fresh.sort_unstable();
        fresh.dedup();
        let table = self.table.get_or_insert_with(Table::shared);
        let mut syms = Vec::new();
        for a in fresh {
            let name = table.lookup(a).map(str::to_string);
            if let Some(n) = &name {
                syms.push((a, n.clone()));
            }
            self.known.insert(a, name);
        }
        (!syms.is_empty()).then_some(crate::record::records::Ksyms { syms })
    }

    /// The names of `addrs` (innermost first), for the ones that have one.
    pub fn names(&self, addrs: &[u64]) -> Vec<&str> {
        addrs.iter().filter_map(|a| self.known.get(a)?.as_deref()).collect()
    }

    /// [`wait_class`] of a kernel stack whose addresses were learnt, once per distinct stack.
    pub fn wait_class(&mut self, addrs: &[u64]) -> &'static str {
        if let Some(c) = self.classes.get(addrs) {
            return c;
        }
        let c = wait_class(&self.names(addrs));
        if self.classes.len() >= MAX_CLASSES {
            self.classes.clear();
        }
        self.classes.insert(addrs.to_vec(), c);
        c
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
    pub fn feed_ksyms(&mut self, k: &crate::record::records::Ksyms) {
        self.traced_with_names = true;
        self.addrs.clear();
        for (a, n) in &k.syms {
            self.by_addr.insert(*a, n.clone());
        }
    }

    pub fn feed_stack(&mut self, s: &crate::record::StackRecord) {
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
            if let crate::record::records::UserRecord::Ksyms(k) = r {
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
    pub fn wait_of_stack(&self, s: &crate::record::StackRecord) -> &'static str {
        if let Some(w) = &s.wait {
            return WAITS.iter().copied().find(|c| c == w).unwrap_or("[other wait]");
        }
        let names: Vec<&str> = s.kernel.iter().filter_map(|a| self.by_addr.get(a).map(String::as_str)).collect();
        wait_class(&names)
    }

    /// [`Names::wait_of_stack`] as a [`Wait`].
    pub fn wait_kind_of_stack(&self, s: &crate::record::StackRecord) -> Wait {
        Wait::of(self.wait_of_stack(s))
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
        // The enum and the words are one set.
        assert_eq!(Wait::ALL.iter().map(|w| w.name()).collect::<Vec<_>>(), WAITS);
        assert_eq!(Wait::of("[swap wait]"), Wait::Swap);
        assert_eq!(Wait::of("[made up]"), Wait::Other);
    }

    /// kallsyms lines: text symbols only, by address whatever the order, module names after a
    /// tab; a frame is the last symbol at or below it; the kept form reads back the same.
    #[test]
    fn a_frame_is_named_by_the_symbol_below_it() {
        let text = "ffffffffc0001000 t mod_fn\t[kvm]\nffffffff81000000 T _stext\nffffffff81000100 D some_data\nffffffff81000200 t io_schedule\n0000000000000000 T hidden\n";
        let t = Table::parse(text);
        assert_eq!(t.n, 3);
        assert_eq!(t.lookup(0xffff_ffff_8100_0250), Some("io_schedule"));
        assert_eq!(t.lookup(0xffff_ffff_8100_0150), Some("_stext"), "data symbols do not name code");
        assert_eq!(t.lookup(0xffff_ffff_c000_1010), Some("mod_fn"));
        assert_eq!(t.lookup(0x1000), None);
        let back = Table::from_bytes(t.to_bytes()).unwrap();
        assert_eq!((back.n, back.to_bytes()), (t.n, t.to_bytes()));
        assert_eq!(back.lookup(0xffff_ffff_8100_0250), Some("io_schedule"));
        let mut bad = t.to_bytes().to_vec();
        bad[8..16].copy_from_slice(&u64::MAX.to_ne_bytes());
        assert!(Table::from_bytes(&bad).is_none(), "unsorted addresses are refused");
        assert!(Table::from_bytes(&t.to_bytes()[..20]).is_none(), "a truncated table is refused");
        // Kept and mapped back, as a later trace of this boot reads it.
        let dir = std::env::temp_dir().join(format!("probe-ksyms-{}", std::process::id()));
        crate::os::kernel_cache::store_bytes(&dir, CACHE, "k", t.to_bytes());
        let mapped = Table::from_body(Body::Mapped(crate::os::kernel_cache::map_bytes(&dir, CACHE, "k", 1 << 20).unwrap())).unwrap();
        assert_eq!(mapped.lookup(0xffff_ffff_c000_1010), Some("mod_fn"));
        assert_eq!(mapped.lookup(0xffff_ffff_8100_0150), Some("_stext"));
        let _ = std::fs::remove_dir_all(&dir);
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
        let made_up = crate::record::StackRecord { wait: Some("[made up]".into()), ..Default::default() };
        assert_eq!(n.wait_of_stack(&made_up), "[other wait]");
    }
}
