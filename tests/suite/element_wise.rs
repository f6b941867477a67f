//! `ElementWise` holds its contract: Burn's optimizers that are not element-wise (LAMB,
//! Adafactor, Muon) and any optimizer of the user's that reads other elements are refused at
//! `init`, on every rank and at every stage, instead of training silently wrong on flat
//! shards; every element-wise optimizer Burn ships passes and trains as single-device Burn.

use burn::optim::{
    AdaGradConfig, AdafactorConfig, AdamWConfig, AdanConfig, LambConfig, LearningRate, LionConfig, MuonConfig,
    Optimizer, RmsPropConfig, SgdConfig,
};
use burn::prelude::*;
use burn_shard::{ElementWise, ShardConfig, ShardError, Stage};
use burn_shard_comm::{InProcessGroup, run_ranks};

use crate::common::*;

/// `init` with `optim` at world sizes 1-4 and stages 0-3: the error of every rank.
fn init_errors<O: Optimizer>(optim: ElementWise<O>) -> Vec<String> {
    let device = Device::flex().autodiff();
    let base = TinyMlp::new(&device);
    let mut errors = Vec::new();
    for world_size in 1..=4 {
        for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
            let results = run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
                ShardConfig::new(stage)
                    .init(base.clone().fork(&device), optim.clone(), comm)
                    .map(|_| ())
            })
            .expect("no rank panics");
            for (rank, result) in results.into_iter().enumerate() {
                match result {
                    Err(e @ ShardError::InvalidConfig(_)) => errors.push(e.to_string()),
                    other => panic!(
                        "world_size {world_size}, stage {stage}, rank {rank}: expected InvalidConfig, got {:?}",
                        other.map_err(|e| e.to_string())
                    ),
                }
            }
        }
    }
    assert_eq!(errors.len(), 40, "every rank of every run fails");
    errors
}

#[test]
fn burn_optimizers_that_mix_elements_are_refused_on_every_rank() {
    for (name, errors) in [
        ("Lamb", init_errors(ElementWise(LambConfig::new().build()))),
        ("Adafactor", init_errors(ElementWise(AdafactorConfig::new().build()))),
        ("Muon", init_errors(ElementWise(MuonConfig::new().build()))),
    ] {
        for e in errors {
            assert!(e.contains(name) && e.contains("refused"), "{name}: {e}");
        }
    }
}

/// A user's optimizer that is not element-wise: SGD on the gradient normalised by its norm over
/// the whole tensor (as LARS-like and normalised-gradient methods do).
#[derive(Clone)]
struct NormalizedSgd;

impl Optimizer for NormalizedSgd {
    type State<const D: usize> = ();

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        _state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        let norm = grad.clone().square().sum().sqrt().into_scalar::<f32>();
        (tensor - grad.div_scalar(norm).mul_scalar(lr), None)
    }

    fn to_device<const D: usize>(state: Self::State<D>, _device: &Device) -> Self::State<D> {
        state
    }
}

#[test]
fn a_users_optimizer_that_reads_other_elements_is_refused() {
    for e in init_errors(ElementWise(NormalizedSgd)) {
        assert!(e.contains("NormalizedSgd") && e.contains("is not element-wise"), "{e}");
    }
}

/// Every element-wise optimizer Burn ships passes the probe through `ElementWise` and trains as
/// single-device Burn: world size 1 bitwise; stage 2 on 3 ranks within 1e-4 (but Lion, whose
/// update is `lr·sign(..)`: a gradient summed in another order may flip a sign near 0, a
/// difference of `2·lr`, so only its world size 1 is compared).
#[test]
fn burn_element_wise_optimizers_pass_and_train_as_single_device() {
    fn check<O: Optimizer>(name: &str, reference: burn::optim::ModuleOptimizer, optim: O, world_sizes: &[usize]) {
        let device = Device::flex().autodiff();
        device.seed(7);
        let base = TinyMlp::new(&device);
        let steps = 10;
        let (ref_losses, ref_params) = reference_run(&base, reference, steps, 12, 1e-2);
        for &world_size in world_sizes {
            let runs = run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
                let (rank, world) = (burn_shard_comm::Collective::rank(&comm), world_size);
                let (mut model, mut optim) = ShardConfig::new(Stage::Two)
                    .init(base.clone().fork(&device), ElementWise(optim.clone()), comm)
                    .unwrap_or_else(|e| panic!("{name}: {e}"));
                let mut losses = Vec::new();
                for step in 0..steps {
                    let (x, y) = batch(step, 12);
                    let (start, end) = rank_rows(rank, world, 12);
                    let loss = mse(
                        &model,
                        rows(&x, IN, start, end, &device),
                        rows(&y, OUT, start, end, &device),
                    );
                    let (next, global) = sharded_step(&mut optim, model, loss, 1e-2);
                    model = next;
                    losses.push(global);
                }
                (losses, params_of(&model))
            })
            .unwrap();
            let (losses, params) = &runs[0];
            if world_size == 1 {
                assert_eq!(losses, &ref_losses, "{name}: world size 1 losses");
                assert_eq!(params, &ref_params, "{name}: world size 1 parameters");
            } else {
                let diff = max_abs_diff(params, &ref_params);
                assert!(
                    diff <= 1e-4,
                    "{name}, world size {world_size}: max |param - reference| = {diff:e}"
                );
            }
        }
    }
    check("Sgd", SgdConfig::new().init(), SgdConfig::new().build(), &[1, 3]);
    check("AdamW", AdamWConfig::new().init(), AdamWConfig::new().build(), &[1, 3]);
    check(
        "AdaGrad",
        AdaGradConfig::new().init(),
        AdaGradConfig::new().build(),
        &[1, 3],
    );
    check(
        "RmsProp",
        RmsPropConfig::new().init(),
        RmsPropConfig::new().build(),
        &[1, 3],
    );
    check("Adan", AdanConfig::new().init(), AdanConfig::new().build(), &[1, 3]);
    check("Lion", LionConfig::new().init(), LionConfig::new().build(), &[1]);
}
