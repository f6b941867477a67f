//! Parameter groups: which optimizer (hyper-parameters) and which per-parameter gradient
//! clipping step each parameter, chosen as Burn's `ModuleOptimizer::with_group` chooses them.
//!
//! The group is resolved once per layout slot from the slot's `ParamId` and module path (the
//! path Burn's optimizer mapper matches, e.g. `blocks.0.ln.beta`), so the step, which works on
//! pieces of flat buckets, needs no path matching.

use std::hash::{DefaultHasher, Hash, Hasher};

use burn::module::ParamGroup;
use burn::optim::grad_clipping::GradientClipping;

use crate::model::layout::FlatLayout;
use crate::optim::master::MasterWeightStep;

/// One optimizer and its clipping (the base group's matches every parameter).
struct Group<O> {
    optim: O,
    clipping: Option<GradientClipping>,
}

/// The base optimizer and the groups added to it, and each layout slot's group.
pub(crate) struct Groups<O> {
    groups: Vec<Group<O>>,
    /// Index into `groups` per layout slot: the last group whose selector matches it.
    of_slot: Vec<usize>,
}

impl<O: MasterWeightStep> Groups<O> {
    /// One group, `optim` with `clipping`, for every slot of `layout`.
    pub(crate) fn new(optim: O, clipping: Option<GradientClipping>, layout: &FlatLayout) -> Self {
        Self {
            groups: vec![Group { optim, clipping }],
            of_slot: vec![0; layout.slots().len()],
        }
    }

    /// Adds a group that takes precedence over the earlier ones for the slots `selector`
    /// matches (Burn's rule: the last matching group wins).
    pub(crate) fn add(
        &mut self,
        selector: ParamGroup,
        optim: O,
        clipping: Option<GradientClipping>,
        layout: &FlatLayout,
    ) {
        let index = self.groups.len();
        for (slot, _) in layout
            .slots()
            .iter()
            .enumerate()
            .filter(|(_, slot)| selector.matches(&slot.id, Some(&slot.path)))
        {
            self.of_slot[slot] = index;
        }
        self.groups.push(Group { optim, clipping });
    }

    /// The base optimizer (the one `ShardConfig::init` was given).
    pub(crate) fn base(&self) -> &O {
        &self.groups[0].optim
    }

    /// The optimizer that steps layout slot `slot`.
    pub(crate) fn optim(&self, slot: usize) -> &O {
        &self.groups[self.of_slot[slot]].optim
    }

    /// The per-parameter clipping of layout slot `slot`'s group.
    pub(crate) fn clipping(&self, slot: usize) -> Option<&GradientClipping> {
        self.groups[self.of_slot[slot]].clipping.as_ref()
    }

    /// A hash of which group steps each slot, which optimizer type each group has and how it
    /// clips, equal on ranks that added the same groups (the optimizers' hyper-parameters are
    /// not read).
    pub(crate) fn fingerprint(&self) -> u64 {
        let mut h = DefaultHasher::new();
        self.of_slot.hash(&mut h);
        for group in &self.groups {
            group.optim.fingerprint().hash(&mut h);
            clipping_key(group.clipping.as_ref()).hash(&mut h);
        }
        h.finish()
    }

    /// Whether some group clips by each parameter's norm (which needs the norms summed over
    /// the ranks).
    pub(crate) fn clips_by_norm(&self) -> bool {
        self.groups
            .iter()
            .any(|g| matches!(g.clipping, Some(GradientClipping::Norm(_))))
    }
}

/// A clipping as hashable bits: kind and threshold.
pub(crate) fn clipping_key(clipping: Option<&GradientClipping>) -> Option<(u8, u32)> {
    clipping.map(|c| match c {
        GradientClipping::Value(t) => (0, t.to_bits()),
        GradientClipping::Norm(t) => (1, t.to_bits()),
    })
}
