//! Models, data and training-loop pieces used by the burn-shard examples. The models are plain
//! Burn modules: they know nothing about sharding, which each example applies in one visible
//! place (`ShardConfig::init` in its `train_rank`; `finetune_minilm_learner` goes through
//! burn-train's Learner, where the place is its `ShardedStrategy`).

pub mod bert;
pub mod char_data;
pub mod cli;
pub mod comm_bench;
mod data_dir;
pub mod finetune_minilm;
pub mod finetune_minilm_learner;
pub mod finetune_stories;
pub mod gpt;
pub mod gpu_bench;
pub mod llama;
pub mod llama2c_tokenizer;
pub mod metrics;
pub mod minilm_weights;
pub mod sentences;
pub mod training;

pub use data_dir::examples_data_dir;
