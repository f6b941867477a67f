//! The burn-shard test suite: one binary, one module per area.

mod accumulation;
mod architecture;
mod async_save;
mod checkpoint;
mod checkpoint_dirs;
mod clipping;
mod cluster;
#[cfg(feature = "mpi")]
mod cluster_mpi;
mod comm;
mod common;
mod config;
mod default_adam;
mod editing;
mod elastic;
mod element_wise;
mod equivalence;
mod estimate;
mod examples;
mod frozen_base;
mod fused_adam;
#[cfg(feature = "wgpu")]
mod fused_adam_wgpu;
#[cfg(feature = "cuda")]
mod gpu;
mod gpu_bundle;
mod grouped_collectives;
mod hsdp;
mod job_fixtures;
mod launcher;
mod launcher_killed;
mod layout;
mod learner;
mod learner_items;
mod loss_scaling;
mod memory;
mod mixed_precision;
mod modules;
#[cfg(feature = "mpi")]
mod mpi;
mod nvme_offload;
mod nvme_params;
mod offload;
mod overlap;
mod param_groups;
mod param_kinds;
mod pretrained;
mod rendezvous_env;
mod rendezvous_membership;
mod rendezvous_store;
mod sharded_init;
mod stage3;
mod stage3_schedule;
mod store_auth;
mod unequal_shares;
mod whole_params;
