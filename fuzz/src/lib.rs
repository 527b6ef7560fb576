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

/// JSON values equal up to the last bits of floats (serde_json's default float parser may read a
/// number it wrote one unit in the last place off).
pub fn same_json(a: &serde_json::Value, b: &serde_json::Value) -> bool {
    use serde_json::Value;
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => match (x.as_f64(), y.as_f64()) {
            (Some(x), Some(y)) if x.fract() != 0.0 || y.fract() != 0.0 => (x - y).abs() <= 1e-12 * x.abs().max(y.abs()),
            _ => x == y,
        },
        (Value::Array(x), Value::Array(y)) => x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same_json(x, y)),
        (Value::Object(x), Value::Object(y)) => x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same_json(v, w))),
        _ => a == b,
    }
}
