//! Pretrained weights loaded by `ShardConfig::init_pretrained`, straight into each rank's
//! shards: `weights` ([`Pretrained`]: the file and how its tensor names and layouts map onto the
//! model), `open` (reading safetensors and burnpack headers into byte windows of the file),
//! `plan` (matching them to the model's entries, every check, and reading a whole tensor or a
//! range of one).

mod open;
pub(crate) mod plan;
mod weights;

pub use weights::Pretrained;
