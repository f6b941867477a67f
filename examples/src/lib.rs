//! Models and data used by the burn-shard examples. The models are plain Burn modules: they
//! know nothing about sharding, which each example applies in one visible place.

pub mod char_data;
pub mod gpt;
