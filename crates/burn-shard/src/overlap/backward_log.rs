//! What both reducers learn one backward from: the gradients handed to them since the
//! optimizer's last call, in arrival order. Stages 0-2's bucket reducer keys them by layout slot
//! and reads how many each slot got and when each bucket's last one arrived; stage 3's unit
//! reducer keys them by gather tag and reads one backward as the period of the sequence (several
//! identical backwards may precede one optimizer call).

use std::collections::HashMap;

/// The gradients of the backwards since the optimizer's last call, in arrival order.
#[derive(Debug, Default)]
pub(crate) struct BackwardLog {
    /// Every gradient's key (a layout slot, or a gather tag), in arrival order.
    arrivals: Vec<u64>,
    /// Per key: how many gradients it got, and the position in `arrivals` of its last one.
    keys: HashMap<u64, (usize, usize)>,
}

impl BackwardLog {
    /// Records one gradient of `key`.
    pub(crate) fn record(&mut self, key: u64) {
        let at = self.arrivals.len();
        self.arrivals.push(key);
        let entry = self.keys.entry(key).or_insert((0, at));
        entry.0 += 1;
        entry.1 = at;
    }

    /// Gradients recorded since the last [`BackwardLog::clear`].
    pub(crate) fn len(&self) -> usize {
        self.arrivals.len()
    }

    /// Gradients of `key` recorded.
    pub(crate) fn count(&self, key: u64) -> usize {
        self.keys.get(&key).map_or(0, |(n, _)| *n)
    }

    /// Gradients recorded for each of the keys `0..n` (the layout's slots).
    pub(crate) fn counts(&self, n: usize) -> Vec<usize> {
        (0..n as u64).map(|key| self.count(key)).collect()
    }

    /// Position among all arrivals of the last gradient of any of `keys`; `None` when none
    /// arrived.
    pub(crate) fn last_arrival(&self, keys: impl IntoIterator<Item = u64>) -> Option<usize> {
        keys.into_iter()
            .filter_map(|key| self.keys.get(&key).map(|(_, at)| *at))
            .max()
    }

    /// The length of the shortest prefix of the arrivals that repeats to make all of them: one
    /// backward's gradients when the optimizer's call followed several identical backwards
    /// (Burn's `GradientsAccumulator`, or a model back-propagated through twice per step).
    pub(crate) fn period(&self) -> usize {
        let keys = &self.arrivals;
        (1..=keys.len())
            .find(|&p| keys.len().is_multiple_of(p) && keys.iter().enumerate().all(|(i, k)| *k == keys[i % p]))
            .unwrap_or(keys.len())
    }

    /// Forgets every arrival: the optimizer's call ended them.
    pub(crate) fn clear(&mut self) {
        self.arrivals.clear();
        self.keys.clear();
    }
}
