//! What the fuzz targets share: a cursor that reads an input as a plain binary format (fixed-width
//! little-endian fields, then bytes), simple enough that `fuzz/seeds.py` writes real streams in it.
//! Every read past the end gives zeros / empty, so any input is a valid one.

/// Reads fields from the front of a fuzz input.
pub struct Input<'a> {
    data: &'a [u8],
}

impl<'a> Input<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Input { data }
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    pub fn u8(&mut self) -> u8 {
        let Some((&b, rest)) = self.data.split_first() else { return 0 };
        self.data = rest;
        b
    }

    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }

    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }

    /// Up to `n` bytes (fewer at the end of the input).
    pub fn bytes(&mut self, n: usize) -> &'a [u8] {
        let (b, rest) = self.data.split_at(n.min(self.data.len()));
        self.data = rest;
        b
    }

    /// A length-prefixed (u16) byte string, at most `max` long.
    pub fn blob(&mut self, max: usize) -> &'a [u8] {
        let n = self.u16() as usize % (max + 1);
        self.bytes(n)
    }

    /// Everything left.
    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.data)
    }
}

/// Cut points in `0..=len` from raw u16 fields (each modulo len + 1), sorted, with both ends.
pub fn cuts(raw: &[u16], len: usize) -> Vec<usize> {
    let mut c: Vec<usize> = raw.iter().map(|&r| usize::from(r) % (len + 1)).collect();
    c.push(0);
    c.push(len);
    c.sort_unstable();
    c
}
