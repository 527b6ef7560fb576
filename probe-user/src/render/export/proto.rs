//! The protobuf wire format, encode only: enough for pprof's profile.proto and OTLP's trace
//! messages (varints, length-delimited fields, packed repeated integers, fixed64). Fields are
//! written in the order they are added; readers accept any order.

/// One message being encoded.
#[derive(Default, Clone)]
pub struct Msg(Vec<u8>);

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

impl Msg {
    pub fn new() -> Msg {
        Msg::default()
    }

    fn key(&mut self, field: u32, wire: u8) {
        varint(&mut self.0, (u64::from(field) << 3) | u64::from(wire));
    }

    /// An integer field (int32/int64/uint64/bool/enum); zero is the default and is left out.
    pub fn uint(&mut self, field: u32, v: u64) -> &mut Msg {
        if v != 0 {
            self.key(field, 0);
            varint(&mut self.0, v);
        }
        self
    }

    /// An integer field written even when zero (a oneof member, a bool that is false).
    pub fn uint_always(&mut self, field: u32, v: u64) -> &mut Msg {
        self.key(field, 0);
        varint(&mut self.0, v);
        self
    }

    /// An int64 that may be negative (two's complement, ten bytes).
    pub fn int(&mut self, field: u32, v: i64) -> &mut Msg {
        self.uint(field, v as u64)
    }

    pub fn fixed64(&mut self, field: u32, v: u64) -> &mut Msg {
        if v != 0 {
            self.key(field, 1);
            self.0.extend_from_slice(&v.to_le_bytes());
        }
        self
    }

    pub fn double(&mut self, field: u32, v: f64) -> &mut Msg {
        self.key(field, 1);
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// A bytes or string field, written even when empty (a repeated string table keeps its
    /// empty first entry).
    pub fn bytes(&mut self, field: u32, b: &[u8]) -> &mut Msg {
        self.key(field, 2);
        varint(&mut self.0, b.len() as u64);
        self.0.extend_from_slice(b);
        self
    }

    pub fn str(&mut self, field: u32, s: &str) -> &mut Msg {
        self.bytes(field, s.as_bytes())
    }

    pub fn msg(&mut self, field: u32, m: &Msg) -> &mut Msg {
        self.bytes(field, &m.0)
    }

    /// A packed repeated integer field (left out when empty).
    pub fn packed(&mut self, field: u32, vs: &[u64]) -> &mut Msg {
        if vs.is_empty() {
            return self;
        }
        let mut b = Vec::with_capacity(vs.len() * 2);
        vs.iter().for_each(|&v| varint(&mut b, v));
        self.bytes(field, &b)
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_the_wire_format() {
        // The examples of the protobuf encoding guide: field 1 = 150, field 2 = "testing".
        let mut m = Msg::new();
        m.uint(1, 150);
        assert_eq!(m.clone().into_bytes(), [0x08, 0x96, 0x01]);
        let mut s = Msg::new();
        s.str(2, "testing");
        assert_eq!(s.into_bytes(), [0x12, 0x07, b't', b'e', b's', b't', b'i', b'n', b'g']);
        let mut p = Msg::new();
        p.packed(4, &[3, 270, 86942]);
        assert_eq!(p.into_bytes(), [0x22, 0x06, 0x03, 0x8E, 0x02, 0x9E, 0xA7, 0x05]);
        let mut n = Msg::new();
        n.int(1, -1);
        assert_eq!(n.into_bytes().len(), 11);
    }
}
