//! Stages 0-2: each bucket of gradients is all-reduced (stages 0-1) or reduce-scattered
//! (stage 2) inside backward, as soon as its gradients are complete, while backward computes
//! the rest (PyTorch DDP's bucketed reducer, DeepSpeed ZeRO-2's `overlap_comm`).
//!
//! Where buckets are formed: `FlatLayout::from_slots` (`model/layout.rs`), once at
//! `ShardConfig::init`, the same on every rank. The trainable parameters are taken in the
//! module's traversal order, grouped by dtype (one dtype per bucket; traversal order kept inside
//! a group), and a bucket is closed when the next parameter would take it past
//! [`ShardConfig::bucket_numel`](crate::ShardConfig::bucket_numel) elements (a parameter larger
//! than that gets a bucket of its own). Each bucket is padded with zeros to a multiple of
//! `world_size` elements, so rank `r`'s shard of it is elements `r * shard_numel ..
//! (r + 1) * shard_numel`. Buckets are the unit of every gradient reduction and parameter
//! all-gather of stages 0-2 and of the optimizer step at every stage; stage 3's gather units
//! are chosen apart from them (`ShardConfig::with_units`, `fsdp/`).
//!
//! `ShardConfig::init` attaches a `BucketHook` (`bucket/hook.rs`) to every trainable parameter: `val()`
//! passes the parameter through an identity op whose backward hands the parameter's gradient to
//! the rank's `BucketReducer` (`bucket/reducer.rs`). Inside a [`unit`](fn@crate::fsdp::unit) scope the unit's
//! input is a second, gradient-less parent, so Burn's backward (deepest nodes first) runs the
//! hook right after the unit's backward; without units the hooks run at the end of backward and
//! nothing overlaps (the results are the same), so the layers after the last block are best a
//! unit too. A bucket whose gradients are all in is started
//! with one asynchronous collective on the rank's communication thread; buckets are started in
//! one order on every rank, learned once, so the collectives line up.
//!
//! Passes. The first step learns, while every gradient passes through to `GradientsParams`
//! and is reduced by the step as before: how many gradients each parameter receives in one
//! backward (a parameter used twice, two), the order in which backward completes the buckets
//! (rank 0's, broadcast once), and how many `accumulate` calls precede a step. From then on a
//! backward is reduced inside only when it is expected to end in a `step` (as many `accumulate`
//! calls have been made since the last step as before the learning step): micro-batches given to
//! `accumulate` still send nothing (DDP's `no_sync`, without the user saying so). A reduced
//! gradient is not registered on its parameter: the `GradientsParams` of such a backward lack
//! it, and the optimizer takes the reduced buckets from the reducer
//! (`BucketReducer::finish`).
//!
//! What was learned is revised: when a step's backwards differ from the learned ones (another
//! number of `accumulate` calls, a parameter that gets gradients only now or no longer, as after
//! a warm-up with a frozen body), the ranks agree on it in the all-reduce the step makes anyway,
//! forget what they learned, and the next step learns again, so overlap is back within two steps.
//!
//! A wrong expectation costs overlap, never results. Buckets still incomplete when the optimizer
//! is called are started then, in the same order on every rank (absent gradients as zeros, as
//! the step treats them); a gradient that arrives after its bucket was started, and every
//! gradient of a backward not expected to end in a step, passes through to `GradientsParams`
//! and is reduced by the step (which reduces a bucket only where some rank has such a gradient
//! for it, agreed in the same all-reduce that tells which parameters got one); reduced
//! gradients that reach `accumulate` are kept, reduced, until the step.
//!
//! Two rules follow from reducing inside backward. A backward whose gradients are not given to
//! `step` or `accumulate` (a skipped NaN loss) has reduced them already: drop them with
//! `ShardedOptimizer::discard_gradients` (PyTorch's `zero_grad`), or they add to the next
//! step. And a collective of the user's own between `backward()` and the optimizer call queues
//! behind the buckets each rank started, which differ between ranks whose backwards differ: make
//! such calls before backward (as the examples average the loss) or after the optimizer call.
//!
//! Only where the collective overlaps (`Collective::overlaps_compute`: the in-process backend)
//! and the parameters live on a device with the hook (Burn's CPU `Flex` device; a CubeCL device
//! with the `cube` feature, Burn's `fusion` on or off), with more than one rank: elsewhere an
//! early start would only move the wait, and the step reduces as before.
//!
//! Where the code is: `bucket/hook.rs` (the hook), `bucket/reducer.rs` (the
//! reducer), `step/` (the optimizer call that finishes it).

pub(crate) mod hook;
pub(crate) mod reducer;
