//! [`OptimizerGroups`]: a base optimizer and groups of other optimizers, the sharded
//! counterpart of building Burn's `ModuleOptimizer` with `with_group`.

use burn::module::ParamGroup;
use burn::optim::grad_clipping::GradientClipping;

use crate::error::ShardError;
use crate::optim::any::AnyOptimizer;
use crate::optim::into_optimizer::IntoOptimizer;
use crate::optim::into_optimizer::OptimizerGroup;

/// A base optimizer for every parameter and groups that step the parameters they match with
/// another optimizer, each with its own per-parameter clipping: what Burn users build with
/// `ModuleOptimizer::with_group`, given to [`ShardConfig::init`](crate::ShardConfig::init) so
/// that the layout can give whole parameters to the groups whose optimizer needs them.
///
/// ```ignore
/// // Muon for the blocks' matrices, AdamW for embeddings, norms, biases and the head.
/// let optim = OptimizerGroups::new(AdamWConfig::new().with_weight_decay(0.1))
///     .with_group(ParamGroup::from_regex(r"^blocks\..*\.weight$").expect("a valid regex"), MuonConfig::new(), None);
/// let (model, mut optim) = ShardConfig::new(Stage::Two).init(model, optim, comm)?;
/// ```
///
/// Matching is Burn's: by `ParamId` or module path, and a parameter takes the last group that
/// matches it. Learning rates per group come, as in Burn, from a `ModuleLrScheduler` passed to
/// `step`. Each group's optimizer is any [`IntoOptimizer`]: Burn's configs or built optimizers
/// (Muon, LAMB and Adafactor included), [`AnyOptimizer::whole_params`], or another
/// `OptimizerGroups`' base.
#[derive(Clone)]
pub struct OptimizerGroups {
    base: Result<AnyOptimizer, ShardError>,
    base_clipping: Result<Option<GradientClipping>, ShardError>,
    groups: Vec<Result<OptimizerGroup<AnyOptimizer>, ShardError>>,
}

impl OptimizerGroups {
    /// `base` for every parameter no group matches (Burn's fallback optimizer), with its own
    /// clipping when it is a Burn config that carries one.
    pub fn new<C: IntoOptimizer>(base: C) -> Self {
        Self {
            base_clipping: base.grad_clipping(),
            base: AnyOptimizer::new(base),
            groups: Vec::new(),
        }
    }

    /// Steps the parameters `group` matches with `optim`, clipped by `grad_clipping` (`None`:
    /// no per-parameter clipping for the group), as `ModuleOptimizer::with_group` does. Errors
    /// (a config that carries its own clipping, an optimizer refused by
    /// [`IntoOptimizer::into_optimizer`]) are returned by `ShardConfig::init`.
    pub fn with_group<C: IntoOptimizer>(
        mut self,
        group: ParamGroup,
        optim: C,
        grad_clipping: Option<GradientClipping>,
    ) -> Self {
        let group = match optim.grad_clipping() {
            Ok(Some(_)) => Err(ShardError::InvalidConfig(
                "the optimizer config given to OptimizerGroups::with_group carries its own grad_clipping; pass the \
                 clipping as with_group's grad_clipping argument (as ModuleOptimizer::with_group takes it) and \
                 remove it from the config"
                    .to_string(),
            )),
            Ok(None) => AnyOptimizer::new(optim).map(|optim| (group, optim, grad_clipping)),
            Err(e) => Err(e),
        };
        self.groups.push(group);
        self
    }
}

impl IntoOptimizer for OptimizerGroups {
    type Optimizer = AnyOptimizer;

    /// The base optimizer alone (the groups are dropped: use
    /// [`IntoOptimizer::into_parts`], as `ShardConfig::init` does).
    fn into_optimizer(self) -> Result<AnyOptimizer, ShardError> {
        self.base
    }

    fn grad_clipping(&self) -> Result<Option<GradientClipping>, ShardError> {
        self.base_clipping.clone()
    }

    fn into_parts(self) -> Result<(AnyOptimizer, Vec<OptimizerGroup<AnyOptimizer>>), ShardError> {
        let groups = self.groups.into_iter().collect::<Result<Vec<_>, _>>()?;
        Ok((self.base?, groups))
    }
}
