//! How sharding hooks into a user's model and Burn's autodiff, with model code unchanged: the
//! [`unit`](crate::fsdp::unit) scope (`unit`), the stage 0-2 gradient hook (`bucket_hook`), the
//! stage-3 gather op (`gather_op`), sharded parameters (`sharded_param`) and reading or replacing
//! their shards (`exchange`). Imports `overlap`, `placement`, `model` and `error` of
//! this crate.

pub(crate) mod bucket_hook;
pub(crate) mod exchange;
pub(crate) mod gather_op;
pub(crate) mod sharded_param;
pub mod unit;
