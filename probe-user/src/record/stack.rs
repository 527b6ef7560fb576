//! One stack sample (`StackRecord`) and its v2 binary frame: how the collector encodes it and
//! the reader decodes it.
use super::{put_varint, take_varint, unzigzag, zigzag};

/// One stack sample as the collector unwound it: user frames as (module id, file offset) with the
/// module table in `module` records, kernel addresses named by `ksyms` records. In v1
/// recordings it was a JSON record of `type: "stack"` with these fields.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StackRecord {
    pub what: StackKind,
    pub pid: u32,
    pub tid: u32,
    pub ts_ns: u64,
    /// Innermost first; module -1 for an address in no known module.
    #[serde(default)]
    pub user: Vec<(i64, u64)>,
    /// Innermost first.
    #[serde(default)]
    pub kernel: Vec<u64>,
    /// Unwound to the end of the stack.
    #[serde(default)]
    pub complete: bool,
    /// Fault and IO stacks: the address or sector; 0 otherwise.
    #[serde(default)]
    pub addr: u64,
    /// Off-CPU stacks: the task state at the switch.
    #[serde(default)]
    pub state: u32,
    /// Off-CPU stacks: the class of the wait (crate::analysis::ksyms::WAITS), decided at trace time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait: Option<String>,
    /// Off-CPU stacks: how long the thread stayed off the CPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blocked_ns: Option<u64>,
    /// Still off the CPU when the trace ended (blocked_ns runs to the end).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub still_blocked: bool,
    /// Off-CPU stacks: the target thread that woke it (tid), when one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waker: Option<u32>,
    /// Why the user stack stops short of its end, when it does (recordings before this: None).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cut: Option<Cut>,
    /// User frames the reader counted and left undecoded (its `user_frames` off: a report
    /// needs their number, never their addresses); `user` is empty then.
    #[serde(skip)]
    pub user_not_read: u32,
}

impl StackRecord {
    /// How many user frames the stack has, read or not.
    pub fn user_depth(&self) -> usize {
        self.user.len() + self.user_not_read as usize
    }
}

crate::closed_set! {
    /// What a stack sample is of (serialized as today's words).
    StackKind {
        /// On-CPU samples at the sampling frequency.
        #[default]
        Cpu = "cpu",
        /// Blocked time: the stack at the switch-out, weighted by the time off the CPU.
        Offcpu = "offcpu",
        /// Major page faults.
        Fault = "fault",
        /// Block IO requests, at issue.
        Io = "io",
    }
}

/// Why unwinding stopped before the end of a user stack.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Cut {
    /// The copied stack bytes ran out (a larger copy would have gone further).
    Bytes,
    /// No unwind information (CFI) for a frame.
    Cfi,
    /// A read of the stack failed (an address below the stack pointer or far past the copy).
    Read,
}

impl Cut {
    pub const ALL: [Cut; 3] = [Cut::Bytes, Cut::Cfi, Cut::Read];

    /// The words for people.
    pub fn words(self) -> &'static str {
        match self {
            Cut::Bytes => "the copied stack ran out",
            Cut::Cfi => "no unwind info for a frame",
            Cut::Read => "a stack read failed",
        }
    }

    fn bits(c: Option<Cut>) -> u8 {
        match c {
            None => 0,
            Some(Cut::Bytes) => 1,
            Some(Cut::Cfi) => 2,
            Some(Cut::Read) => 3,
        }
    }

    fn from_bits(b: u8) -> Option<Cut> {
        [None, Some(Cut::Bytes), Some(Cut::Cfi), Some(Cut::Read)][usize::from(b & 3)]
    }
}

impl StackRecord {
    /// The binary form (frame type 3).
    pub(super) fn encode(&self, prev_ts: u64, out: &mut Vec<u8>) {
        let kind = self.what as u8 + 1;
        let flags = u8::from(self.complete)
            | u8::from(self.wait.is_some()) << 1
            | u8::from(self.blocked_ns.is_some()) << 2
            | u8::from(self.still_blocked) << 3
            | Cut::bits(self.cut) << 4
            | u8::from(self.waker.is_some()) << 6;
        out.extend_from_slice(&[kind, flags]);
        put_varint(out, zigzag(self.ts_ns.wrapping_sub(prev_ts) as i64));
        put_varint(out, u64::from(self.pid));
        put_varint(out, zigzag(i64::from(self.tid) - i64::from(self.pid)));
        put_varint(out, self.addr);
        put_varint(out, u64::from(self.state));
        if let Some(w) = &self.wait {
            put_varint(out, w.len() as u64);
            out.extend_from_slice(w.as_bytes());
        }
        if let Some(b) = self.blocked_ns {
            put_varint(out, b);
        }
        if let Some(w) = self.waker {
            put_varint(out, u64::from(w));
        }
        put_varint(out, self.user.len() as u64);
        let mut prev = 0i64;
        for &(m, off) in &self.user {
            put_varint(out, zigzag(m.wrapping_sub(prev)));
            put_varint(out, off);
            prev = m;
        }
        put_varint(out, self.kernel.len() as u64);
        let mut prev = 0u64;
        for &a in &self.kernel {
            put_varint(out, zigzag(a.wrapping_sub(prev) as i64));
            prev = a;
        }
    }

    #[cfg(test)]
    pub(super) fn decode(b: &[u8], prev_ts: u64) -> Option<StackRecord> {
        Self::decode_with(b, prev_ts, true)
    }

    /// `user`: decode the user frames (else count them in `user_not_read`; off-CPU stacks' always).
    pub(super) fn decode_with(b: &[u8], prev_ts: u64, user: bool) -> Option<StackRecord> {
        fn string(b: &[u8]) -> Option<(String, &[u8])> {
            let (n, b) = take_varint(b)?;
            let n = usize::try_from(n).ok().filter(|&n| n <= b.len())?;
            Some((String::from_utf8(b[..n].to_vec()).ok()?, &b[n..]))
        }
        let (&[kind, flags], b) = b.split_first_chunk::<2>()?;
        let (dts, b) = take_varint(b)?;
        let (pid, b) = take_varint(b)?;
        let (dtid, b) = take_varint(b)?;
        let (addr, b) = take_varint(b)?;
        let (state, mut b) = take_varint(b)?;
        let mut s = StackRecord {
            ts_ns: prev_ts.wrapping_add(unzigzag(dts) as u64),
            pid: u32::try_from(pid).ok()?,
            tid: u32::try_from(pid as i64 + unzigzag(dtid)).ok()?,
            addr,
            state: u32::try_from(state).ok()?,
            complete: flags & 1 != 0,
            still_blocked: flags & 8 != 0,
            cut: Cut::from_bits(flags >> 4),
            ..Default::default()
        };
        s.what = *StackKind::ALL.get(usize::from(kind).checked_sub(1)?)?;
        // Off-CPU stacks' frames name where a thread waited on a request's critical path, which
        // every report has.
        let user = user || s.what == StackKind::Offcpu;
        if flags & 2 != 0 {
            let (w, rest) = string(b)?;
            s.wait = Some(w);
            b = rest;
        }
        if flags & 4 != 0 {
            let (v, rest) = take_varint(b)?;
            s.blocked_ns = Some(v);
            b = rest;
        }
        if flags & 64 != 0 {
            let (v, rest) = take_varint(b)?;
            s.waker = Some(u32::try_from(v).ok()?);
            b = rest;
        }
        let (n, mut b) = take_varint(b)?;
        // Every frame takes at least two bytes: a count beyond that is corruption.
        if n > b.len() as u64 {
            return None;
        }
        if user {
            s.user.reserve_exact(n as usize);
        } else {
            s.user_not_read = u32::try_from(n).ok()?;
        }
        let mut prev = 0i64;
        for _ in 0..n {
            let (dm, rest) = take_varint(b)?;
            let (off, rest) = take_varint(rest)?;
            if user {
                prev = prev.wrapping_add(unzigzag(dm));
                s.user.push((prev, off));
            }
            b = rest;
        }
        let (n, mut b) = take_varint(b)?;
        if n > b.len() as u64 {
            return None;
        }
        s.kernel.reserve_exact(n as usize);
        let mut prev = 0u64;
        for _ in 0..n {
            let (d, rest) = take_varint(b)?;
            prev = prev.wrapping_add(unzigzag(d) as u64);
            s.kernel.push(prev);
            b = rest;
        }
        b.is_empty().then_some(s)
    }
}
