//! Stage 3's part of `init`: each parameter replaced by this rank's shard as it is synced.

use std::sync::Arc;

use burn::module::Module;
use burn_shard_comm::Collective;

use crate::config::ShardConfig;
use crate::error::ShardError;
use crate::fsdp::context::FsdpContext;
use crate::fsdp::home::ParamHome;
use crate::fsdp::sharded_param::Sharder;
use crate::model::buffers::Buffers;
use crate::model::census::Census;
use crate::model::layout::FlatLayout;
use crate::model::root_values::RootValues;
use crate::model::units::UnitPolicy;
use crate::optim::master::MasterWeightStep;
use crate::sharded_optimizer::optimizer::ShardedOptimizer;
use crate::step::agreement::{agree_on_disk, flag_device};
use crate::step::options::StepOptions;
use crate::step::stage_plan::StagePlan;

/// Stage 3: keeps only this rank's shard of every parameter; `val()` gathers on demand. The
/// optimizer then works on the local shards alone (their gradients arrive reduced). `comm` is
/// the shard group, `world` every rank (the same group without hybrid sharding): rank 0's
/// values come over the world, so the world agrees on the shard file's writes.
#[allow(clippy::too_many_arguments)]
pub(super) fn shard_parameters<M: Module, O: MasterWeightStep>(
    config: &ShardConfig,
    model: M,
    optim: O,
    options: StepOptions,
    root: RootValues,
    [comm, world]: [Arc<dyn Collective>; 2],
    census: Census,
    buffers: Buffers,
    param_home: Option<ParamHome>,
) -> Result<(M, ShardedOptimizer<O>), ShardError> {
    let ctx = FsdpContext::new(comm.clone(), config.stage3.reshard_after_forward, param_home);
    let mut sharder = Sharder {
        ctx: ctx.clone(),
        census: census.clone(),
        root,
        slots: Vec::new(),
        units: UnitPolicy::new(&config.stage3.units)?,
    };
    let model = model.apply_reparameterization(&mut sharder);
    let Sharder { root, slots, units, .. } = sharder;
    root.finish()?;
    // A shard that could not be written to the shard file (NVMe parameter offload): the
    // writes were queued behind the sharding; all are done before `init` returns.
    let plan = StagePlan::sharded(ctx);
    let params = plan.params();
    let written = match params.take_error() {
        Some(e) => Err(e),
        None => params.flush_home(),
    };
    match params.shard_store() {
        // Every rank agrees on the writes before any of them returns (rank 0 may be a
        // broadcast ahead of the others, and its error aborts the world): each rank whose own
        // file failed names it, the others name those ranks.
        Some(_) => agree_on_disk(
            world.as_ref(),
            written,
            &flag_device(world.as_ref()),
            "in ShardConfig::init",
            params.shard_dir(),
        )?,
        None => written?,
    }
    units.check_all_used(&census)?;
    let local = Arc::new(FlatLayout::from_slots(slots, 1, config.bucket_numel)?);
    let optim = ShardedOptimizer::new(optim, comm, local, plan, census, buffers, options);
    Ok((model, optim))
}
