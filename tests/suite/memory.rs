//! Measured per-rank memory against the ZeRO formulas (Rajbhandari et al., 2020, §5.1).

use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams};
use burn::prelude::*;
use burn_shard::{MemoryReport, ShardConfig, Stage};
use burn_shard_comm::{InProcessGroup, run_ranks};

#[derive(Module, Debug)]
struct Wide {
    a: Linear,
    b: Linear,
}

/// Ψ = 64·96 + 96 + 96·33 + 33 = 9_441 parameters (odd, so padding is exercised).
const PSI: usize = 64 * 96 + 96 + 96 * 33 + 33;

fn reports(world_size: usize, stage: Stage) -> Vec<MemoryReport> {
    let device = Device::flex().autodiff();
    let base = Wide {
        a: LinearConfig::new(64, 96).init(&device),
        b: LinearConfig::new(96, 33).init(&device),
    };
    run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
        let device = Device::flex().autodiff();
        let (mut model, mut optim) = ShardConfig::new(stage)
            .init(base.clone().fork(&device), AdamConfig::new().build(), comm)
            .unwrap();
        for _ in 0..2 {
            let x = Tensor::<2>::ones([4, 64], &device);
            let loss = model.b.forward(model.a.forward(x)).powi_scalar(2).mean();
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(1e-3, model, grads).unwrap();
        }
        optim.report().memory(&model)
    })
    .unwrap()
}

/// `measured` within 5% of `formula` bytes, plus `padding` bytes.
fn assert_near(measured: usize, formula: usize, padding: usize, what: &str) {
    let lo = formula as f64 * 0.95;
    let hi = formula as f64 * 1.05 + padding as f64;
    assert!(
        (lo..=hi).contains(&(measured as f64)),
        "{what}: measured {measured} B, formula {formula} B (+{padding} B padding)"
    );
}

#[test]
fn optimizer_state_and_gradients_follow_the_zero_formulas() {
    let n = 4;
    let pad = PSI.div_ceil(n) * n - PSI; // padding elements of the single bucket
    for r in reports(n, Stage::Zero) {
        assert_eq!(r.parameters_bytes, 4 * PSI);
        assert_near(r.optimizer_state_bytes, 8 * PSI, 8 * pad, "stage 0 Adam state");
        assert_near(r.gradients_bytes, 4 * PSI, 4 * pad, "stage 0 gradients");
    }
    for r in reports(n, Stage::One) {
        assert_near(r.optimizer_state_bytes, 8 * PSI / n, 8 * pad, "stage 1 Adam state");
        assert_near(r.gradients_bytes, 4 * PSI, 4 * pad, "stage 1 gradients");
    }
    for r in reports(n, Stage::Two) {
        assert_eq!(r.parameters_bytes, 4 * PSI, "stage 2 keeps whole parameters");
        assert_near(r.optimizer_state_bytes, 8 * PSI / n, 8 * pad, "stage 2 Adam state");
        assert_near(r.gradients_bytes, 4 * PSI / n, 4 * pad, "stage 2 gradients");
        assert!(
            r.temporary_peak_bytes >= 4 * PSI,
            "the unreduced flat bucket is a measured transient"
        );
    }
}
