//! Kernel records → typed events. Pure: bytes in, [`Event`] out; never trusts the kind blindly.
use probe_common::{
    EventHeader, EventKind,
    blockio::BlockIoEvent,
    engine::EngineEvent,
    fault::FaultEvent,
    filemap::FilemapEvent,
    mem::MemEvent,
    mmap::MmapEvent,
    proc::ProcEvent,
    sock::SockEvent,
    stack::{SchedEvent, StackEvent},
    stream::DataEvent,
};

// Stack records are big (a 512-byte kernel stack inline) and never stored in a recording (the
// collector unwinds them into stack records): boxed, so that every other event in a Vec takes
// the size of the largest of them, not of a stack.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    BlockIo(BlockIoEvent),
    Fault(FaultEvent),
    Filemap(FilemapEvent),
    /// Boxed, as the stack record is: the largest record (152 bytes) and a rare one, it would
    /// make every event as large (analysis moves millions of them).
    Mmap(Box<MmapEvent>),
    Sock(SockEvent),
    Proc(ProcEvent),
    /// The fixed part of a stream data record; the payload is in [`data_payload`].
    Data(Box<DataEvent>),
    /// The fixed part of a stack record; the raw user stack is in [`data_payload`].
    Stack(Box<StackEvent>),
    Sched(SchedEvent),
    Mem(MemEvent),
    /// Boxed: 272 bytes, one per decode step.
    Engine(Box<EngineEvent>),
    /// Boxed: a CPython thread's frames at a stack event (1 KiB), just before its stack record.
    PyStack(Box<probe_common::python::PyStackEvent>),
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("record of {len} bytes is shorter than its header")]
    NoHeader { len: usize },
    #[error("unknown event kind {0}")]
    UnknownKind(u32),
    #[error("{kind} record has {len} bytes, expected {want}")]
    Size { kind: &'static str, len: usize, want: usize },
}

impl Event {
    pub fn header(&self) -> &EventHeader {
        match self {
            Event::BlockIo(e) => &e.hdr,
            Event::Fault(e) => &e.hdr,
            Event::Filemap(e) => &e.hdr,
            Event::Mmap(e) => &e.hdr,
            Event::Sock(e) => &e.hdr,
            Event::Proc(e) => &e.hdr,
            Event::Data(e) => &e.hdr,
            Event::Stack(e) => &e.hdr,
            Event::Sched(e) => &e.hdr,
            Event::Mem(e) => &e.hdr,
            Event::Engine(e) => &e.hdr,
            Event::PyStack(e) => &e.hdr,
        }
    }
    pub fn kind(&self) -> EventKind {
        match self {
            Event::BlockIo(_) => EventKind::BlockIo,
            Event::Fault(_) => EventKind::Fault,
            Event::Filemap(_) => EventKind::Filemap,
            Event::Mmap(_) => EventKind::Mmap,
            Event::Sock(_) => EventKind::Sock,
            Event::Proc(_) => EventKind::Proc,
            Event::Data(_) => EventKind::Data,
            Event::Stack(_) => EventKind::Stack,
            Event::Sched(_) => EventKind::Sched,
            Event::Mem(_) => EventKind::Mem,
            Event::Engine(_) => EventKind::Engine,
            Event::PyStack(_) => EventKind::PyStack,
        }
    }
}

/// The kind of a raw record, from its first 4 bytes.
pub fn kind_of(bytes: &[u8]) -> Result<EventKind, DecodeError> {
    let raw: [u8; 4] = bytes.get(..4).and_then(|b| b.try_into().ok()).ok_or(DecodeError::NoHeader { len: bytes.len() })?;
    EventKind::try_from(u32::from_ne_bytes(raw)).map_err(DecodeError::UnknownKind)
}

/// A block record as probe wrote it before it carried `matched`, `ino` and `ino_dev`.
const BLOCK_IO_V1: usize = 80;

fn read<T: Copy>(bytes: &[u8], kind: EventKind) -> Result<T, DecodeError> {
    let want = size_of::<T>();
    if bytes.len() != want {
        return Err(DecodeError::Size { kind: kind.name(), len: bytes.len(), want });
    }
    // SAFETY: length checked above; T is a #[repr(C)] plain-integer record from probe-common for
    // which every bit pattern is valid; read_unaligned copes with any alignment of `bytes`.
    Ok(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<T>()) })
}

/// A record with a fixed part `T` followed by `tail(T)` bytes.
fn read_var<T: Copy>(bytes: &[u8], kind: EventKind, tail: impl Fn(&T) -> u32) -> Result<T, DecodeError> {
    let want = size_of::<T>();
    let fixed = bytes.get(..want).ok_or(DecodeError::Size { kind: kind.name(), len: bytes.len(), want })?;
    let ev: T = read(fixed, kind)?;
    let want = want + tail(&ev) as usize;
    if bytes.len() != want {
        return Err(DecodeError::Size { kind: kind.name(), len: bytes.len(), want });
    }
    Ok(ev)
}

/// A stack record: its user stack follows, and the kernel's two largest copies may leave the rest
/// of their fixed room (128 and 64 KiB) unused (filled up to the end of the stack's mapping).
fn read_stack(bytes: &[u8]) -> Result<StackEvent, DecodeError> {
    let kind = EventKind::Stack;
    let fixed = size_of::<StackEvent>();
    let ev: StackEvent = read(bytes.get(..fixed).ok_or(DecodeError::Size { kind: kind.name(), len: bytes.len(), want: fixed })?, kind)?;
    let want = fixed + ev.ustack_bytes as usize;
    let roomy = [probe_common::stack::USTACK_CAP, probe_common::stack::USTACK_WIDE].map(|n| fixed + n);
    if bytes.len() != want && !(roomy.contains(&bytes.len()) && want <= bytes.len()) {
        return Err(DecodeError::Size { kind: kind.name(), len: bytes.len(), want });
    }
    Ok(ev)
}

/// The fixed part `T` at the start of a raw record, without checking its kind or size beyond
/// what `T` needs (for routing a record without decoding it whole).
pub fn prefix<T: Copy>(bytes: &[u8]) -> Option<T> {
    let b = bytes.get(..size_of::<T>())?;
    // SAFETY: `b` holds size_of::<T>() bytes; T is a #[repr(C)] plain-integer record from
    // probe-common for which every bit pattern is valid; read_unaligned copes with any alignment.
    Some(unsafe { std::ptr::read_unaligned(b.as_ptr().cast::<T>()) })
}

pub fn decode(bytes: &[u8]) -> Result<Event, DecodeError> {
    if bytes.len() < size_of::<EventHeader>() {
        return Err(DecodeError::NoHeader { len: bytes.len() });
    }
    let kind = kind_of(bytes)?;
    Ok(match kind {
        EventKind::BlockIo if bytes.len() == BLOCK_IO_V1 => {
            // Written before block records named their file and how they were matched: those
            // fields read as 0 (issued by the target, file unknown).
            let mut whole = bytes.to_vec();
            whole.resize(size_of::<BlockIoEvent>(), 0);
            Event::BlockIo(read(&whole, kind)?)
        }
        EventKind::BlockIo => Event::BlockIo(read(bytes, kind)?),
        EventKind::Fault => Event::Fault(read(bytes, kind)?),
        EventKind::Filemap => Event::Filemap(read(bytes, kind)?),
        EventKind::Mmap => Event::Mmap(Box::new(read(bytes, kind)?)),
        EventKind::Sock => Event::Sock(read(bytes, kind)?),
        EventKind::Proc => Event::Proc(read(bytes, kind)?),
        EventKind::Data => Event::Data(Box::new(read_var(bytes, kind, |e: &DataEvent| e.captured)?)),
        EventKind::Stack => Event::Stack(Box::new(read_stack(bytes)?)),
        EventKind::Sched => Event::Sched(read(bytes, kind)?),
        EventKind::Mem => Event::Mem(read(bytes, kind)?),
        EventKind::Engine => Event::Engine(Box::new(read(bytes, kind)?)),
        EventKind::PyStack => Event::PyStack(Box::new(read(bytes, kind)?)),
    })
}

/// The bytes after a variable-length record's fixed part: a stream record's payload, a stack
/// record's raw user stack (empty for other records).
pub fn data_payload(bytes: &[u8]) -> &[u8] {
    match kind_of(bytes) {
        Ok(EventKind::Data) => bytes.get(size_of::<DataEvent>()..).unwrap_or_default(),
        Ok(EventKind::Stack) => {
            let n = prefix::<StackEvent>(bytes).map_or(0, |e| e.ustack_bytes as usize);
            bytes.get(size_of::<StackEvent>()..).map_or(&[], |t| &t[..n.min(t.len())])
        }
        _ => &[],
    }
}

/// The raw bytes of a decoded event (without a stream record's payload or a stack's user stack).
pub fn encode_event(ev: &Event) -> Vec<u8> {
    match ev {
        Event::BlockIo(e) => encode(e),
        Event::Fault(e) => encode(e),
        Event::Filemap(e) => encode(e),
        Event::Mmap(e) => encode(&**e),
        Event::Sock(e) => encode(e),
        Event::Proc(e) => encode(e),
        Event::Data(e) => encode(&probe_common::stream::DataEvent { captured: 0, ..**e }),
        Event::Stack(e) => encode(&StackEvent { ustack_bytes: 0, ..**e }),
        Event::Sched(e) => encode(e),
        Event::Mem(e) => encode(e),
        Event::Engine(e) => encode(&**e),
        Event::PyStack(e) => encode(&**e),
    }
}

/// The raw bytes of a record (what the kernel sends), for writing recordings and tests.
pub fn encode<T: probe_common::Record>(ev: &T) -> Vec<u8> {
    // SAFETY: T is a #[repr(C)] record with explicit padding fields, so all its bytes are initialised.
    unsafe { std::slice::from_raw_parts((ev as *const T).cast::<u8>(), size_of::<T>()) }.to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;
    use probe_common::Record;

    fn hdr<T: Record>() -> EventHeader {
        EventHeader { kind: T::KIND as u32, pid: 7, tid: 8, cpu: 1, ts_ns: 42 }
    }

    #[test]
    fn round_trips_every_kind() {
        let f = FaultEvent { hdr: hdr::<FaultEvent>(), addr: 0x7f00_0000_1000, ip: 0x4010, flags: 1, _pad: 0 };
        assert_eq!(decode(&encode(&f)), Ok(Event::Fault(f)));
        let b = BlockIoEvent {
            hdr: hdr::<BlockIoEvent>(),
            dev: 254 << 20,
            bytes: 4096,
            sector: 9,
            rwbs: *b"RA\0\0\0\0\0\0",
            ..Default::default()
        };
        assert_eq!(decode(&encode(&b)), Ok(Event::BlockIo(b)));
        let m = MmapEvent { hdr: hdr::<MmapEvent>(), op: 1, fd: 3, ret: 0x1000, ..Default::default() };
        assert_eq!(decode(&encode(&m)).unwrap().kind(), EventKind::Mmap);
    }

    #[test]
    fn variable_length_records_carry_their_tail() {
        use probe_common::stack::StackEvent;
        let mut ev = StackEvent { hdr: hdr::<StackEvent>(), ustack_bytes: 16, ..Default::default() };
        let mut bytes = encode(&ev);
        bytes.extend_from_slice(&[7u8; 16]);
        assert_eq!(decode(&bytes), Ok(Event::Stack(Box::new(ev))));
        assert_eq!(data_payload(&bytes), &[7u8; 16]);
        ev.ustack_bytes = 32; // claims more than it carries
        let mut short = encode(&ev);
        short.extend_from_slice(&[7u8; 16]);
        assert!(matches!(decode(&short), Err(DecodeError::Size { kind: "stack", .. })));
        // The kernel's largest copy: 128 KiB of room, filled up to the end of the stack's mapping.
        ev.ustack_bytes = 40 << 10;
        let mut roomy = encode(&ev);
        roomy.resize(roomy.len() + probe_common::stack::USTACK_CAP, 9);
        assert_eq!(decode(&roomy), Ok(Event::Stack(Box::new(ev))));
        assert_eq!(data_payload(&roomy).len(), 40 << 10);
        ev.ustack_bytes = probe_common::stack::USTACK_CAP as u32 + 8;
        let mut over = encode(&ev);
        over.resize(over.len() + probe_common::stack::USTACK_CAP, 9);
        assert!(decode(&over).is_err(), "claims more than the room");
        // So may the second largest; no other.
        ev.ustack_bytes = 50 << 10;
        let mut wide = encode(&ev);
        wide.resize(wide.len() + probe_common::stack::USTACK_WIDE, 9);
        assert_eq!(decode(&wide), Ok(Event::Stack(Box::new(ev))));
        ev.ustack_bytes = probe_common::stack::USTACK_WIDE as u32 + 8;
        let mut over = encode(&ev);
        over.resize(over.len() + probe_common::stack::USTACK_WIDE, 9);
        assert!(decode(&over).is_err(), "claims more than the second largest room");
        ev.ustack_bytes = 3000;
        let mut part = encode(&ev);
        part.resize(part.len() + 4096, 9);
        assert!(decode(&part).is_err(), "a 4 KiB record carrying 3000 bytes");
    }

    #[test]
    fn rejects_bad_records() {
        assert_eq!(decode(&[1, 0, 0]), Err(DecodeError::NoHeader { len: 3 }));
        let mut bad = encode(&FaultEvent { hdr: hdr::<FaultEvent>(), ..Default::default() });
        bad[0] = 99;
        assert_eq!(decode(&bad), Err(DecodeError::UnknownKind(99)));
        let short = encode(&FaultEvent { hdr: hdr::<FaultEvent>(), ..Default::default() });
        assert!(matches!(decode(&short[..40]), Err(DecodeError::Size { kind: "fault", len: 40, want: 48 })));
    }
}
