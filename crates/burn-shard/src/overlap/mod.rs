//! What the two reducers that start collectives while backward runs share: stages 0-2's bucket
//! reducer ([`crate::bucket`]) and stage 3's unit reducer ([`crate::fsdp`]).
//! - `backward_log`: the gradients since the optimizer's last call, in arrival order, from
//!   which both reducers learn one backward;
//! - `call_tag`: how every collective call is named for the collectives' cross-rank check.
//!
//! A leaf: imports nothing of this crate.

pub(crate) mod backward_log;
pub(crate) mod call_tag;
