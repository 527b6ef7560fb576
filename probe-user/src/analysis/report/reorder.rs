//! Putting kernel records back in time order: they arrive nearly sorted (one ring buffer, records
//! from several CPUs), so a bounded window is held back and sorted.
use crate::record::decode::Event;

/// Kernel records arrive nearly in time order (one ring buffer, records from several CPUs);
/// this many are held back and sorted before they are analysed.
const REORDER: usize = 1 << 16;

/// Sorts kernel records that arrive nearly in time order: holds back up to 2 × [`REORDER`],
/// sorts them (nearly sorted runs sort in about linear time) and lets the earlier half go. Exact
/// while no record arrives more than [`REORDER`] records late. Only the (time, slot) keys are
/// sorted; each record is moved into its slot once and at most once more when the held half is
/// compacted (sorting the records themselves moved each several times: most of a long report's
/// time went to copying them).
#[derive(Default)]
pub(crate) struct Reorder {
    slots: Vec<Option<Event>>,
    /// The other slot buffer, reused: the held half is compacted into it.
    spare: Vec<Option<Event>>,
    /// (time, slot), in arrival order until sorted: the stable sort keeps arrival order on ties.
    keys: Vec<(u64, u32)>,
}

impl Reorder {
    pub(crate) fn push(&mut self, ev: Event, out: &mut impl FnMut(&Event)) {
        self.keys.push((ev.header().ts_ns, self.slots.len() as u32));
        self.slots.push(Some(ev));
        if self.keys.len() >= 2 * REORDER {
            self.keys.sort_by_key(|k| k.0);
            for &(_, i) in &self.keys[..REORDER] {
                if let Some(e) = &self.slots[i as usize] {
                    out(e);
                }
            }
            // The held half, moved to the front in its sorted order.
            self.spare.clear();
            for (j, k) in self.keys[REORDER..].iter_mut().enumerate() {
                self.spare.push(self.slots[k.1 as usize].take());
                k.1 = j as u32;
            }
            std::mem::swap(&mut self.slots, &mut self.spare);
            self.keys.drain(..REORDER);
        }
    }

    pub(crate) fn drain(&mut self, out: &mut impl FnMut(&Event)) {
        self.keys.sort_by_key(|k| k.0);
        for &(_, i) in &self.keys {
            if let Some(e) = &self.slots[i as usize] {
                out(e);
            }
        }
        self.keys.clear();
        self.slots.clear();
    }
}
