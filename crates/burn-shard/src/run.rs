//! A training run's identity and history ([`Lineage`]): carried by the optimizer from `init` or
//! a load, recorded in every checkpoint it saves (see the `checkpoint` module's "Lineage"), so a
//! rollback can tell the abandoned run's checkpoints from the current one's; and the base it
//! started from ([`FrozenEntries`], [`Base`]), which its checkpoints may name instead of holding.
//! At the bottom of the crate: the step holds them, the checkpoint layer reads and writes them.

use serde::{Deserialize, Serialize};

/// The history of a checkpoint. A run starts at `init` (a fresh run) or at a load (a run
/// resumed from a checkpoint) and gets a new id; its checkpoints record the id, the checkpoint
/// it resumed from, and the runs before it with where each was left. A checkpoint `X` is in
/// the lineage of checkpoint `C` when `X` was saved by `C`'s run no later than `C`, or by one
/// of the earlier runs no later than where the next run resumed from it ("later" in the order
/// of [`list`](crate::checkpoint::list): the number that ends the directory name, then the name).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Lineage {
    /// Id of the run that saved the checkpoint (16 hex digits, rank 0's).
    pub run: String,
    /// Directory name of the checkpoint that run resumed from; `None` for a fresh run.
    #[serde(default)]
    pub parent: Option<String>,
    /// The runs before it, oldest first, each with its last checkpoint in this history.
    #[serde(default)]
    pub branches: Vec<Branch>,
}

/// What a checkpoint holds of the parameters the optimizer does not train (a LoRA or head-only
/// fine-tune's frozen base), chosen with
/// [`ShardConfig::with_frozen_entries`](crate::ShardConfig::with_frozen_entries).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum FrozenEntries {
    /// Their values, in every checkpoint (the default): a checkpoint stands alone.
    #[default]
    Saved,
    /// A fingerprint of each (a 64-bit hash of its elements, see the `checkpoint` module's
    /// "Frozen entries") and the origin of the weights `init_pretrained` loaded, instead of the
    /// values: a LoRA fine-tune's checkpoints hold its adapters and their optimizer state only.
    /// A resume needs the same base in the model (load it as the run did, then
    /// `load_checkpoint`): the fingerprints are checked and a different base is an error naming
    /// the one the checkpoint was trained on. Buffers (BatchNorm's statistics) are always saved.
    Fingerprinted,
}

/// The base a run's checkpoints refer to: how they hold frozen entries, and where the
/// pretrained weights came from (`init_pretrained`'s file; `None` after `init`).
#[derive(Clone, Debug, Default)]
pub(crate) struct Base {
    pub(crate) frozen: FrozenEntries,
    pub(crate) origin: Option<String>,
}

/// An earlier run in a [`Lineage`], and where the next run branched off it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Branch {
    /// The run's id; `None` for checkpoints saved before lineages were recorded.
    pub run: Option<String>,
    /// Directory name of the checkpoint the next run resumed from.
    pub until: String,
}

impl Lineage {
    /// A fresh run's: a new id, no history.
    pub(crate) fn fresh() -> Self {
        Self {
            run: new_run_id(),
            parent: None,
            branches: Vec::new(),
        }
    }

    /// The lineage of a new run resumed from the checkpoint named `name`, whose own lineage
    /// is `of` (`None` for a checkpoint saved before lineages were recorded).
    pub(crate) fn resumed_from(name: &str, of: Option<&Lineage>) -> Self {
        let mut branches = of.map(|l| l.branches.clone()).unwrap_or_default();
        branches.push(Branch {
            run: of.map(|l| l.run.clone()),
            until: name.to_string(),
        });
        Self {
            run: new_run_id(),
            parent: Some(name.to_string()),
            branches,
        }
    }

    /// Whether the checkpoint named `name`, of lineage `other` (`None`: saved before lineages
    /// were recorded), belongs to this history: saved by this run (no later than `upto` when
    /// given), or by an earlier run no later than where the next one branched off.
    pub fn contains(&self, upto: Option<&str>, name: &str, other: Option<&Lineage>) -> bool {
        let run = other.map(|l| l.run.as_str());
        let own = run == Some(self.run.as_str()) && upto.is_none_or(|u| order(name) <= order(u));
        own || self
            .branches
            .iter()
            .any(|b| b.run.as_deref() == run && order(name) <= order(&b.until))
    }
}

/// A new run id: 16 hex digits from the clock, the process and a per-process counter, hashed
/// with a random key (unique across runs; rank 0's is the one saved).
pub(crate) fn new_run_id() -> String {
    use std::hash::{BuildHasher, Hash, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default()
        .hash(&mut h);
    std::process::id().hash(&mut h);
    NEXT.fetch_add(1, Ordering::Relaxed).hash(&mut h);
    format!("{:016x}", h.finish())
}

/// The order of checkpoint directory names: by the number that ends the name (`step-123`
/// before `step-1000`; names without one first), then by name.
pub(crate) fn order(name: &str) -> (Option<u64>, &str) {
    let digits = name.len() - name.trim_end_matches(|c: char| c.is_ascii_digit()).len();
    (name[name.len() - digits..].parse().ok(), name)
}
