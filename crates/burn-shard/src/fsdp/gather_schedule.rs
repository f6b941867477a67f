//! Per-unit grouped all-gathers with prefetch (FSDP2's `FSDPParamGroup` and its prefetch).
//!
//! Stage 3 gathers a parameter when `param.val()` runs. One collective per parameter costs one
//! synchronisation of the ranks per parameter, and nothing overlaps compute. The schedule
//! gathers per unit instead, with the groups learned from the previous pass (a model gathers
//! in the same order at every step):
//! - a *group* is what one unit gathers in forward (inside one [`unit`](crate::fsdp::unit) scope), or
//!   what the same unit re-gathers in backward; its key is the phase and its first parameter;
//! - the first gather of a known group fetches the whole group with one all-gather of its
//!   concatenated shards (one per dtype), then starts the all-gather of the group that came
//!   next last time in the same phase, one unit ahead, which runs on the rank's communication
//!   thread while this unit computes;
//! - a gather takes its result from the fetched group when its shard is the one that was
//!   gathered (same [`ParamSpec::version`]); otherwise, on the first pass, and outside units,
//!   it is gathered alone.
//!
//! Every rank runs the same model code, so every rank learns the same groups and makes the same
//! calls in the same order, which the collectives require. Transitions are learned within a
//! pass only ([`Schedule::end_pass`] at each optimizer step), so nothing is prefetched across a
//! step, when the shards change. Memory: the unit being computed plus one unit in flight.

use std::collections::{HashMap, HashSet};

use burn::tensor::{DType, Tensor};
use burn_shard_comm::Work;

use crate::fsdp::collectives::dtype_group;
use crate::fsdp::comm_context::CommContext;
use crate::fsdp::home::ShardHome;
use crate::fsdp::read_ahead::ReadAhead;
use crate::fsdp::shard::Shard;
use crate::fsdp::spec::{ParamSpec, Phase};
use crate::overlap::call_tag::CallTag;

/// A group: the phase and the tag of the group's first parameter.
type GroupKey = (Phase, u64);

/// A parameter's current shard, as it was last written (`[chunk]`, plain; read when its group
/// is gathered).
struct Registered {
    version: u64,
    shard: Shard,
    numel: usize,
}

/// One parameter's place in a group's all-gather of `[world_size · width]` elements.
struct Member {
    tag: u64,
    version: u64,
    numel: usize,
    chunk: usize,
    /// Element offset of the parameter's chunk in each rank's `[width]` block.
    offset: usize,
}

/// The all-gathers of one group, one per dtype, started and not yet taken apart.
struct GroupGather {
    key: GroupKey,
    parts: Vec<(Vec<Member>, usize, Work<Tensor<1>>)>,
    /// Alive while the gathered buffers are in flight: the transient-memory probe's handle.
    _in_flight: Option<std::sync::Arc<()>>,
}

/// The group being computed in the current pass.
struct Current {
    key: GroupKey,
    /// The forward unit scope it belongs to (`None` in backward).
    scope: Option<u64>,
    /// Whether this is the group's first entry in the pass (the one that is learned).
    first: bool,
    /// Tags gathered so far, first occurrence order: the group's list for the next pass.
    tags: Vec<u64>,
}

/// What the previous pass gathered per unit, and the gathers this pass has fetched or started.
#[derive(Default)]
pub(crate) struct Schedule {
    registry: HashMap<u64, Registered>,
    /// Forward unit (its group's first tag) of each parameter gathered inside a unit.
    unit_of: HashMap<u64, u64>,
    groups: HashMap<GroupKey, Vec<u64>>,
    next: HashMap<GroupKey, GroupKey>,
    current: Option<Current>,
    /// Groups entered in this pass; forward groups with the unit scope of the entry. Every
    /// forward of a unit runs in a new scope, so a forward group entered again under another
    /// scope is another forward in the same step (two losses, a contrastive pair) that needs the
    /// whole group again. Backward groups are entered once per pass (a second entry may be a
    /// recompute of part of the unit).
    entered: HashSet<(GroupKey, Option<u64>)>,
    /// Fetched gathers of the current group not yet taken: tag -> (version, `[numel]`).
    ready: HashMap<u64, (u64, Tensor<1>)>,
    in_flight: Option<GroupGather>,
    /// How many times each forward group was fetched in the previous pass (once per forward in
    /// the step): a forward group is prefetched only while this pass has fetched it fewer times.
    fetches_last_pass: HashMap<GroupKey, usize>,
    /// With NVMe parameter offload: the shards of the group after the one in flight, being
    /// read from disk (ZeRO-Infinity's read-ahead, one unit ahead of the all-gather).
    ahead: ReadAhead,
}

impl Schedule {
    /// Records a parameter's current shard (called whenever a shard is created or replaced).
    pub(crate) fn register(&mut self, spec: &ParamSpec) {
        self.registry.insert(
            spec.tag,
            Registered {
                version: spec.version,
                shard: spec.shard.clone(),
                numel: spec.numel,
            },
        );
    }

    /// The full `[numel]` parameter of `spec` if its group fetched it; `None` means: gather it
    /// alone. Also learns the groups and starts the prefetch of the next one.
    pub(crate) fn take(&mut self, ctx: &CommContext, home: &ShardHome, spec: &ParamSpec) -> Option<Tensor<1>> {
        let key = match spec.phase {
            Phase::Forward => {
                let scope = spec.unit_scope?;
                match &self.current {
                    Some(c) if c.scope == Some(scope) => c.key,
                    _ => (Phase::Forward, spec.tag),
                }
            }
            Phase::Backward => (Phase::Backward, *self.unit_of.get(&spec.tag)?),
        };
        let same = self
            .current
            .as_ref()
            .is_some_and(|c| c.key == key && (spec.phase == Phase::Backward || c.scope == spec.unit_scope));
        if !same {
            self.enter(ctx, home, key, spec.unit_scope);
        }
        let current = self.current.as_mut().expect("entered above");
        if !current.tags.contains(&spec.tag) {
            current.tags.push(spec.tag);
        }
        if spec.phase == Phase::Forward {
            self.unit_of.insert(spec.tag, key.1);
        }
        match self.ready.remove(&spec.tag) {
            Some((version, full)) if version == spec.version => Some(full),
            _ => None,
        }
    }

    /// Ends a pass (the optimizer is about to replace the shards): keeps what was learned, drops
    /// what was fetched. A dropped in-flight gather still completes on every rank.
    pub(crate) fn end_pass(&mut self) {
        self.finish_current(None);
        self.fetches_last_pass = self.fetches();
        self.entered.clear();
        self.ready.clear();
        self.in_flight = None;
        self.ahead.clear();
    }

    /// Starts group `key` (in forward, under unit scope `scope`): on its first entry in this
    /// pass (in forward, under that scope: a second forward in the step fetches each group as the
    /// first did) its gathers become ready and the next group's are started. A backward group
    /// entered again in the same pass (gradient checkpointing recomputing an earlier unit in
    /// between, where that unit's output is no checkpoint boundary: see [`crate::fsdp::unit`])
    /// gathers alone: fetching it whole again would move its bytes twice. Only the first entry of
    /// the pass is learned.
    fn enter(&mut self, ctx: &CommContext, home: &ShardHome, key: GroupKey, scope: Option<u64>) {
        self.finish_current(Some(key));
        // Unused gathers of the previous group are freed here: one unit at a time.
        self.ready.clear();
        let first = !self.entered.iter().any(|(k, _)| *k == key);
        let fetch = self.entered.insert((key, scope.filter(|_| key.0 == Phase::Forward)));
        self.current = Some(Current {
            key,
            scope,
            first,
            tags: Vec::new(),
        });
        let in_flight = self.in_flight.take();
        if !fetch {
            return;
        }
        let fetched = match in_flight {
            Some(g) if g.key == key => Some(g),
            // A prefetch that guessed wrong is dropped; it completes unseen.
            _ => self.start_group(ctx, home, key),
        };
        if let Some(g) = fetched {
            self.finish(ctx, g);
        }
        // A forward group is prefetched while this pass has fetched it fewer times than the last
        // (one fetch per forward: after the last forward's last unit nothing is, though the
        // first forward's last unit was followed by the second's first); a backward group
        // already entered may be a recompute, which gathers alone.
        let fetched = |k: &GroupKey| self.entered.iter().filter(|(e, _)| e == k).count();
        if let Some(&next) = self.next.get(&key)
            && next.0 == key.0
            && match next.0 {
                Phase::Forward => fetched(&next) < self.fetches_last_pass.get(&next).copied().unwrap_or(1),
                Phase::Backward => fetched(&next) == 0,
            }
        {
            self.in_flight = self.start_group(ctx, home, next);
            // The group that came after `next` is read from disk (with NVMe parameter offload)
            // while this one computes and `next` is gathered; reads of a wrong guess are dropped.
            self.ahead.clear();
            if let Some(after) = self.next.get(&next).filter(|after| after.0 == next.0) {
                let tags = self.groups.get(after).into_iter().flatten();
                let shards = tags.filter_map(|tag| self.registry.get(tag)).map(|reg| &reg.shard);
                self.ahead.start(shards, true);
            }
        }
    }

    /// Learns the current group's first occurrence: its gathers, and the group that followed
    /// (`None` at the end of a pass).
    fn finish_current(&mut self, next: Option<GroupKey>) {
        let Some(done) = self.current.take() else { return };
        if !done.first {
            return;
        }
        self.groups.insert(done.key, done.tags);
        match next {
            Some(next) => self.next.insert(done.key, next),
            None => self.next.remove(&done.key),
        };
    }

    /// How many times each group was fetched in this pass so far.
    fn fetches(&self) -> HashMap<GroupKey, usize> {
        let mut counts = HashMap::new();
        for (key, _) in &self.entered {
            *counts.entry(*key).or_insert(0) += 1;
        }
        counts
    }

    /// Starts the all-gathers of group `key` as learned (one per dtype, in first-seen order);
    /// `None` for a group not seen yet.
    fn start_group(&mut self, ctx: &CommContext, home: &ShardHome, key: GroupKey) -> Option<GroupGather> {
        let world_size = ctx.comm().world_size();
        let mut by_dtype: Vec<(DType, Vec<Member>, Vec<Tensor<1>>, usize)> = Vec::new();
        for tag in self.groups.get(&key)? {
            let Some(reg) = self.registry.get(tag) else { continue };
            let dtype = reg.shard.dtype();
            let (_, members, shards, width) =
                dtype_group(&mut by_dtype, dtype, |g| g.0, || (dtype, Vec::new(), Vec::new(), 0));
            let chunk = reg.numel.div_ceil(world_size);
            members.push(Member {
                tag: *tag,
                version: reg.version,
                numel: reg.numel,
                chunk,
                offset: *width,
            });
            let read = self.ahead.take(&reg.shard);
            shards.push(home.wait_read(read, &reg.shard, |e| ctx.record_error(e)));
            *width += chunk;
        }
        if by_dtype.is_empty() {
            return None;
        }
        let bytes = by_dtype
            .iter()
            .map(|(dtype, _, _, width)| world_size * width * dtype.size())
            .sum();
        let mut sample = None;
        let parts = by_dtype
            .into_iter()
            .map(|(_, members, shards, width)| {
                let tags: Vec<u64> = members.iter().map(|m| m.tag).collect();
                let tag = CallTag::Group(&tags).value();
                // With parameter offload: one host-to-device copy of the group's shards.
                let flat = home.to_compute(Tensor::cat(shards, 0));
                sample.get_or_insert_with(|| flat.clone());
                (members, width, ctx.comm().all_gather_async(flat, tag))
            })
            .collect();
        Some(GroupGather {
            key,
            parts,
            _in_flight: sample.and_then(|sample| ctx.watch_in_flight(&sample, bytes)),
        })
    }

    /// Waits for a group's all-gathers and takes each parameter out of them (one copy each, so
    /// each full parameter is freed on its own once its consumers are done).
    fn finish(&mut self, ctx: &CommContext, group: GroupGather) {
        let world_size = ctx.comm().world_size();
        for (members, width, work) in group.parts {
            let gathered = match work.wait() {
                Ok(gathered) => gathered.reshape([world_size, width]),
                Err(e) => {
                    // Left unfetched: each parameter's own gather then reports the aborted group.
                    ctx.record_error(e);
                    continue;
                }
            };
            for m in members {
                let mut full = gathered
                    .clone()
                    .narrow(1, m.offset, m.chunk)
                    .reshape([world_size * m.chunk]);
                if m.numel < world_size * m.chunk {
                    full = full.narrow(0, 0, m.numel);
                }
                ctx.watch_tensor(&full, m.numel * full.dtype().size());
                self.ready.insert(m.tag, (m.version, full));
            }
        }
    }
}
