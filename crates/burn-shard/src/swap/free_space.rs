//! `FreeSpace`: which bytes of a swap file no slot uses, so that new and grown slots and a
//! load's staged state reuse the space of the state they replace instead of growing the file.

/// The free regions of a swap file below its end, and the end (where the file grows).
#[derive(Clone, Debug)]
pub(crate) struct FreeSpace {
    /// `(offset, bytes)` of each free region, by offset, none adjacent; whole blocks.
    regions: Vec<(u64, u64)>,
    /// The first offset past every slot and region.
    end: u64,
}

impl FreeSpace {
    /// Nothing free below `end`.
    pub(crate) fn new(end: u64) -> Self {
        Self {
            regions: Vec::new(),
            end,
        }
    }

    /// Where `bytes` bytes go: the start of the first free region that holds them (its rest
    /// stays free), else the end, which moves past them.
    pub(crate) fn take(&mut self, bytes: u64) -> u64 {
        if let Some(i) = self.regions.iter().position(|&(_, len)| len >= bytes) {
            let (offset, len) = self.regions[i];
            match len == bytes {
                true => {
                    self.regions.remove(i);
                }
                false => self.regions[i] = (offset + bytes, len - bytes),
            }
            return offset;
        }
        let offset = self.end;
        self.end += bytes;
        offset
    }

    /// Frees `bytes` bytes at `offset` (a slot that moved, a state a load replaced, a parameter
    /// shard the optimizer replaced). Adjacent free regions merge, so that freed space of any
    /// sizes serves a larger request.
    pub(crate) fn give(&mut self, offset: u64, bytes: u64) {
        self.regions.push((offset, bytes));
        self.regions.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(self.regions.len());
        for &(at, len) in &self.regions {
            match merged.last_mut() {
                Some((start, size)) if *start + *size == at => *size += len,
                _ => merged.push((at, len)),
            }
        }
        self.regions = merged;
    }
}
