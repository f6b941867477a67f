//! One parameter's sharded state, attached to Burn's `Param` as a reparameterization.

use std::hash::{DefaultHasher, Hash, Hasher};

use burn::backend::Dispatch;
use burn::module::{Module, Param, Reparameterization, Reparameterizer};
use burn::tensor::{Shape, Tensor};

use super::context::FsdpContext;
use super::gather_op::{FsdpOps, GatherSpec};
use super::unit::current_unit_input;

/// The reparameterization of a stage-3 parameter: the `Param`'s stored value is this rank's
/// shard (`[1, .., 1, chunk]`), and `param.val()` all-gathers the full value on demand.
/// It holds no tensor of its own (the field is skipped by module traversal).
#[derive(Module, Debug)]
pub struct ShardedParam {
    #[module(skip)]
    spec: GatherSpec,
}

impl Reparameterization for ShardedParam {
    const NAME: &'static str = "fsdp_shard";

    fn apply<const D: usize>(&self, shard: Tensor<D>) -> Tensor<D> {
        let out = match current_unit_input() {
            Some(input) => {
                <Dispatch as FsdpOps>::fsdp_all_gather_in_unit(shard.into_dispatch(), input, self.spec.clone())
            }
            None => <Dispatch as FsdpOps>::fsdp_all_gather(shard.into_dispatch(), self.spec.clone()),
        };
        Tensor::from_dispatch(out)
    }
}

/// Replaces every float parameter by this rank's shard of it (a fresh leaf with the same
/// `ParamId` and require-grad setting) and attaches [`ShardedParam`].
pub(crate) struct Sharder {
    pub(crate) ctx: FsdpContext,
}

impl Reparameterizer for Sharder {
    type Reparam = ShardedParam;

    fn reparameterize<const D: usize>(
        &mut self,
        path: &str,
        param: Param<Tensor<D>>,
    ) -> (Param<Tensor<D>>, Option<ShardedParam>) {
        let (n, r) = (self.ctx.comm().world_size(), self.ctx.comm().rank());
        let (id, full, mapper) = param.consume();
        let require_grad = full.is_require_grad();
        let strategy = full.gradient_checkpointing_strategy();
        let (device, dtype) = (full.device(), full.dtype());
        let full_shape = full.shape();
        let numel = full_shape.num_elements();
        let chunk = numel.div_ceil(n);
        // Pad the flat parameter to `n·chunk` once, then every rank's slice exists, also for
        // parameters smaller than the group (a scalar on 4 ranks) and empty ones.
        let mut flat = full.inner().reshape([numel]);
        if numel < n * chunk {
            let inner_device = flat.device();
            flat = Tensor::cat(
                vec![flat, Tensor::zeros([n * chunk - numel], (&inner_device, dtype))],
                0,
            );
        }
        let mine = if chunk == 0 {
            flat
        } else {
            flat.narrow(0, r * chunk, chunk)
        };
        // A new leaf from data: a view of the full tensor would keep the full weight alive.
        let mut shard_dims = [1usize; D];
        shard_dims[D - 1] = chunk;
        let shard_shape = Shape::new(shard_dims);
        let mut shard: Tensor<D> = Tensor::<1>::from_data(mine.into_data(), (&device, dtype)).reshape(shard_dims);
        // The device does not carry the checkpointing strategy: copy it, or tensors of one op
        // would disagree (Burn panics on a mix).
        if let Some(strategy) = strategy {
            shard = shard.with_gradient_checkpointing_strategy(strategy);
        }
        if require_grad {
            shard = shard.require_grad();
        }
        let tag = {
            let mut h = DefaultHasher::new();
            path.hash(&mut h);
            h.finish() | 1 // never 0, which means "untagged"
        };
        let spec = GatherSpec {
            ctx: self.ctx.clone(),
            full_shape,
            shard_shape,
            numel,
            chunk,
            tag,
        };
        (Param::from_mapped_value(id, shard, mapper), Some(ShardedParam { spec }))
    }
}
