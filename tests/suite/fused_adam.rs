//! The fused Adam/AdamW path against a float64 reference and against Burn's own optimizers,
//! and its state against Burn's `AdamState`.

use burn::optim::{AdamConfig, AdamState, AdamWConfig, Optimizer};
use burn::prelude::*;
use burn::tensor::DType;
use burn_shard_kernels::{AdamHyper, FusedAdam, FusedAdamConfig, cpu};

use crate::common::{Rng, max_abs_diff};

/// Float64 Adam/AdamW, written from the papers' formulas (Kingma & Ba 2015, Algorithm 1;
/// Loshchilov & Hutter 2019, Algorithm 2; Reddi et al. 2018 for AMSGrad).
#[allow(clippy::too_many_arguments)] // the float64 reference takes each Adam buffer on its own
pub(crate) fn reference_step(
    h: &AdamHyper,
    lr: f64,
    t: i32,
    p: &mut [f64],
    g: &[f64],
    m: &mut [f64],
    v: &mut [f64],
    vmax: &mut [f64],
) {
    let (b1, b2, eps, wd) = (
        h.beta_1 as f64,
        h.beta_2 as f64,
        h.epsilon as f64,
        h.weight_decay as f64,
    );
    for i in 0..p.len() {
        let gi = if h.decoupled_weight_decay {
            g[i]
        } else {
            g[i] + wd * p[i]
        };
        m[i] = b1 * m[i] + (1.0 - b1) * gi;
        v[i] = b2 * v[i] + (1.0 - b2) * gi * gi;
        vmax[i] = vmax[i].max(v[i]);
        let v_used = if h.amsgrad { vmax[i] } else { v[i] };
        let m_hat = m[i] / (1.0 - b1.powi(t));
        let v_hat = v_used / (1.0 - b2.powi(t));
        if h.decoupled_weight_decay {
            p[i] *= 1.0 - lr * wd;
        }
        p[i] -= lr * m_hat / (v_hat.sqrt() + eps);
    }
}

pub(crate) fn variants() -> Vec<(&'static str, FusedAdamConfig)> {
    vec![
        ("adam", FusedAdamConfig::adam()),
        ("adam+l2", FusedAdamConfig::adam().with_weight_decay(0.05)),
        (
            "adamw",
            FusedAdamConfig::adamw().with_weight_decay(0.1).with_epsilon(1e-8),
        ),
        ("adamw+amsgrad", FusedAdamConfig::adamw().with_amsgrad(true)),
    ]
}

#[test]
fn cpu_kernel_matches_a_float64_reference() {
    // Odd lengths, an empty one, and one that spans several rayon chunks with a ragged tail.
    for n in [0usize, 1, 7, 1000, 3 * 65536 + 5] {
        for (name, cfg) in variants() {
            let h = cfg.hyper();
            let mut rng = Rng::new(n as u64 + 3);
            let mut p: Vec<f32> = rng.vec(n);
            let (mut m, mut v, mut vmax) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
            let mut p64: Vec<f64> = p.iter().map(|&x| x as f64).collect();
            let (mut m64, mut v64, mut vmax64) = (vec![0f64; n], vec![0f64; n], vec![0f64; n]);
            for t in 1..=4 {
                let g: Vec<f32> = rng.vec(n).iter().map(|x| x * 3.0).collect();
                let g64: Vec<f64> = g.iter().map(|&x| x as f64).collect();
                let lr = 1e-2;
                let vmax_arg = h.amsgrad.then_some(vmax.as_mut_slice());
                cpu::adam_step(&h.scalars(lr, t), &mut p, &g, &mut m, &mut v, vmax_arg).unwrap();
                reference_step(&h, lr, t as i32, &mut p64, &g64, &mut m64, &mut v64, &mut vmax64);
            }
            for i in 0..n {
                let err = (p[i] as f64 - p64[i]).abs();
                assert!(
                    err <= 1e-6 + 1e-5 * p64[i].abs(),
                    "{name} n={n} element {i}: {} vs {}",
                    p[i],
                    p64[i]
                );
                assert!(
                    (m[i] as f64 - m64[i]).abs() <= 1e-6 + 1e-5 * m64[i].abs(),
                    "{name} n={n} exp_avg {i}"
                );
                assert!(
                    (v[i] as f64 - v64[i]).abs() <= 1e-6 + 1e-5 * v64[i].abs(),
                    "{name} n={n} exp_avg_sq {i}"
                );
            }
        }
    }
}

#[test]
fn mismatched_lengths_are_an_error() {
    let h = FusedAdamConfig::adam().hyper();
    let (mut p, g, mut m, mut v) = (vec![0f32; 4], vec![0f32; 3], vec![0f32; 4], vec![0f32; 4]);
    let err = cpu::adam_step(&h.scalars(1e-3, 1), &mut p, &g, &mut m, &mut v, None).unwrap_err();
    assert!(err.to_string().contains("grad 3"), "{err}");
}

fn tensor(values: Vec<f32>, shape: [usize; 2]) -> Tensor<2> {
    Tensor::from_data(TensorData::new(values, shape), &Device::flex())
}

fn host<const D: usize>(t: &Tensor<D>) -> Vec<f32> {
    t.to_data().convert::<f32>().iter::<f32>().collect()
}

/// Runs `steps` steps of `optim` from `state` on the deterministic gradient stream.
fn run<O: Optimizer>(
    optim: &O,
    mut p: Tensor<2>,
    mut state: Option<O::State<2>>,
    steps: std::ops::Range<u64>,
) -> (Tensor<2>, Option<O::State<2>>) {
    let [rows, cols] = p.dims();
    for s in steps {
        let g = tensor(Rng::new(900 + s).vec(rows * cols), [rows, cols]);
        let (np, ns) = optim.step(3e-3, p, g, state);
        p = np;
        state = ns;
    }
    (p, state)
}

/// `a` and `b` hold the same numbers (`==` per element: bit for bit but for the sign of a zero,
/// which Burn's first step can give as `-0` where the fused loop gives `+0`).
fn same(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x == y)
}

/// On Burn's Flex backend the fused step is Burn's `Adam`/`AdamW` bit for bit: every variant
/// (plain, L2, decoupled decay, AMSGrad, PyTorch's epsilon), a shape smaller than one vector
/// and one that spans several rayon chunks with a ragged tail (every SIMD tier the CPU has runs
/// the same loop), over 40 steps.
#[test]
fn fused_optimizer_is_burn_adam_and_adamw_bit_for_bit() {
    use burn::optim::decay::WeightDecayConfig;
    type Burn = Box<dyn Fn(Tensor<2>, std::ops::Range<u64>) -> Tensor<2>>;
    let cases: Vec<(&str, FusedAdam, Burn)> = vec![
        ("adam", FusedAdam::from_burn_adam(&AdamConfig::new()), {
            let burn = AdamConfig::new().build();
            Box::new(move |p, s| run(&burn, p, None, s).0)
        }),
        ("adam+l2", FusedAdamConfig::adam().with_weight_decay(0.05).init(), {
            let burn = AdamConfig::new()
                .with_weight_decay(Some(WeightDecayConfig::new(0.05)))
                .build();
            Box::new(move |p, s| run(&burn, p, None, s).0)
        }),
        (
            "adam+amsgrad",
            FusedAdam::from_burn_adam(&AdamConfig::new().with_amsgrad(true)),
            {
                let burn = AdamConfig::new().with_amsgrad(true).build();
                Box::new(move |p, s| run(&burn, p, None, s).0)
            },
        ),
        ("adamw", FusedAdam::from_burn_adamw(&AdamWConfig::new()), {
            let burn = AdamWConfig::new().build();
            Box::new(move |p, s| run(&burn, p, None, s).0)
        }),
        (
            "adamw+decay+eps1e-8",
            FusedAdam::from_burn_adamw(&AdamWConfig::new().with_weight_decay(0.1).with_epsilon(1e-8)),
            {
                let burn = AdamWConfig::new().with_weight_decay(0.1).with_epsilon(1e-8).build();
                Box::new(move |p, s| run(&burn, p, None, s).0)
            },
        ),
        (
            "adamw+amsgrad",
            FusedAdamConfig::adamw()
                .with_weight_decay(0.1)
                .with_amsgrad(true)
                .init(),
            {
                let burn = AdamWConfig::new().with_weight_decay(0.1).with_amsgrad(true).build();
                Box::new(move |p, s| run(&burn, p, None, s).0)
            },
        ),
    ];
    for shape in [[5, 7], [300, 257]] {
        let p0 = tensor(Rng::new(1).vec(shape[0] * shape[1]), shape);
        for (name, fused, burn_run) in &cases {
            assert_eq!(
                fused.path_for(&p0),
                burn_shard_kernels::StepPath::FusedCpu,
                "{name}: the fused CPU loop must run"
            );
            let (ours, state) = run(fused, p0.clone(), None, 0..40);
            let theirs = burn_run(p0.clone(), 0..40);
            assert!(
                same(&host(&ours), &host(&theirs)),
                "{name} {shape:?}: fused vs Burn: max abs diff {:e}",
                max_abs_diff(&host(&ours), &host(&theirs))
            );
            assert_ne!(host(&ours), host(&p0), "the step must move the parameters");
            assert_eq!(state.unwrap().momentum.time, 40);
        }
    }
}

#[test]
fn state_moves_between_fused_and_burn_adamw() {
    let p0 = tensor(Rng::new(2).vec(35), [5, 7]);
    let fused = FusedAdamConfig::adamw().with_weight_decay(0.1).init();
    let burn = AdamWConfig::new().with_weight_decay(0.1).build();
    let (all_burn, _) = run(&burn, p0.clone(), None, 0..6);

    // Three fused steps, then the state goes to Burn's AdamW for three more.
    let (p, s) = run(&fused, p0.clone(), None, 0..3);
    let (fused_then_burn, _) = run(&burn, p, s.map(FusedAdam::to_adamw_state), 3..6);
    // And the other way round.
    let (p, s) = run(&burn, p0.clone(), None, 0..3);
    let (burn_then_fused, _) = run(&fused, p, s.map(FusedAdam::from_adamw_state), 3..6);

    assert!(same(&host(&fused_then_burn), &host(&all_burn)));
    assert!(same(&host(&burn_then_fused), &host(&all_burn)));
}

#[test]
fn fused_state_is_burn_adam_state() {
    // The record of the fused optimizer's state is the one Burn's Adam writes.
    let fused = FusedAdamConfig::adam().init();
    let (_, state) = run(&fused, tensor(Rng::new(4).vec(35), [5, 7]), None, 0..2);
    let state: AdamState<2> = state.unwrap();
    let mut sink = burn::optim::StateSink::default();
    burn::optim::RecordState::state_flatten(&state, "p", &mut sink);
    let names: Vec<_> = sink.tensors.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["p.momentum.moment_1", "p.momentum.moment_2"]);
}

#[test]
fn master_weight_step_matches_a_float64_reference_in_bf16_and_f16() {
    use half::{bf16, f16};
    // The f32 master follows the float64 reference; the low-precision copy is exactly the
    // master rounded to nearest; updates far below half a bf16 ulp still move the master.
    fn check<P: cpu::Element + PartialEq + std::fmt::Debug>(name: &str, n: usize) {
        for (variant, cfg) in variants() {
            let h = cfg.hyper();
            let mut rng = Rng::new(n as u64 + 11);
            let mut master: Vec<f32> = rng.vec(n).iter().map(|x| 1.0 + x * 0.5).collect();
            let start = master.clone();
            let mut param: Vec<P> = vec![P::from_f32(0.0); n];
            let (mut m, mut v, mut vmax) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
            let mut p64: Vec<f64> = master.iter().map(|&x| x as f64).collect();
            let (mut m64, mut v64, mut vmax64) = (vec![0f64; n], vec![0f64; n], vec![0f64; n]);
            // lr 1e-4: each step moves a weight near 1 by about 1e-4, far below bf16's half ulp (2^-8).
            let lr = 1e-4;
            for t in 1..=5 {
                let g: Vec<P> = rng.vec(n).iter().map(|x| P::from_f32(x * 3.0)).collect();
                let g64: Vec<f64> = g.iter().map(|x| x.to_f32() as f64).collect();
                let vmax_arg = h.amsgrad.then_some(vmax.as_mut_slice());
                cpu::adam_step_master(&h.scalars(lr, t), &mut master, &mut param, &g, &mut m, &mut v, vmax_arg)
                    .unwrap();
                reference_step(&h, lr, t as i32, &mut p64, &g64, &mut m64, &mut v64, &mut vmax64);
            }
            for i in 0..n {
                let err = (master[i] as f64 - p64[i]).abs();
                assert!(
                    err <= 1e-6,
                    "{name} {variant} n={n} master {i}: {} vs {}",
                    master[i],
                    p64[i]
                );
                assert_eq!(param[i], P::from_f32(master[i]), "{name} {variant} n={n} param {i}");
            }
            let moved = (0..n).filter(|&i| (master[i] - start[i]).abs() > 1e-4).count();
            assert!(
                n == 0 || moved * 2 > n,
                "{name} {variant}: the master must accumulate small updates"
            );
        }
    }
    for n in [0usize, 1, 7, 3 * 65536 + 5] {
        check::<bf16>("bf16", n);
        check::<f16>("f16", n);
    }
    let mut short = vec![bf16::ZERO; 3];
    let h = FusedAdamConfig::adam().hyper();
    let err = cpu::adam_step_master(
        &h.scalars(1e-3, 1),
        &mut [0.0; 4],
        &mut short,
        &[0f32; 4],
        &mut [0.0; 4],
        &mut [0.0; 4],
        None,
    )
    .unwrap_err();
    assert!(err.to_string().contains("param 3"), "{err}");
}

#[test]
fn step_with_master_takes_the_fused_path_and_equals_the_cast_fallback() {
    // The one-pass Flex path and the generic "step the master, then cast" path agree.
    for dtype in [DType::BF16, DType::F16] {
        let cfg = FusedAdamConfig::adamw().with_weight_decay(0.1).with_amsgrad(true);
        let fused = cfg.init();
        let master0 = tensor(Rng::new(21).vec(35), [5, 7]);
        let (mut w1, mut p1, mut s1) = (master0.clone(), master0.clone().cast(dtype), None);
        let (mut w2, mut s2) = (master0.clone(), None);
        for step in 0..4 {
            let g = tensor(Rng::new(300 + step).vec(35), [5, 7]).cast(dtype);
            assert_eq!(
                fused.master_path_for(&w1, &p1, &g),
                burn_shard_kernels::StepPath::FusedCpu,
                "{dtype:?}: the one-pass loop must run"
            );
            let (w, p, s) = fused.step_with_master(1e-2, w1, p1, g.clone(), s1);
            (w1, p1, s1) = (w, p, s);
            let (w, s) = fused.step(1e-2, w2, g.cast(DType::F32), s2);
            (w2, s2) = (w, s);
        }
        assert_eq!(p1.dtype(), dtype);
        assert_eq!(w1.dtype(), DType::F32);
        assert!(
            max_abs_diff(&host(&w1), &host(&w2)) <= 1e-6,
            "{dtype:?}: master differs"
        );
        assert_eq!(
            host(&p1),
            host(&w1.clone().cast(dtype)),
            "{dtype:?}: param is the rounded master"
        );
        assert_eq!(s1.unwrap().momentum.time, 4);
        assert_ne!(host(&w1), host(&master0));
    }
}

#[test]
fn burn_configs_convert_to_the_fused_optimizer() {
    use burn::grad_clipping::GradientClippingConfig;
    use burn::optim::decay::WeightDecayConfig;
    use burn_shard_kernels::StepPath;

    let p0 = tensor(Rng::new(7).vec(35), [5, 7]);
    let adamw = AdamWConfig::new()
        .with_beta_1(0.8)
        .with_beta_2(0.95)
        .with_epsilon(1e-8)
        .with_weight_decay(0.2)
        .with_amsgrad(true);
    let fused = FusedAdam::from_burn_adamw(&adamw);
    let expected = AdamHyper {
        beta_1: 0.8,
        beta_2: 0.95,
        epsilon: 1e-8,
        weight_decay: 0.2,
        decoupled_weight_decay: true,
        amsgrad: true,
    };
    assert_eq!(fused.hyper(), Some(expected));
    assert_eq!(fused.path_for(&p0), StepPath::FusedCpu);
    assert!(!fused.clips_gradients());
    let diff = max_abs_diff(
        &host(&run(&fused, p0.clone(), None, 0..6).0),
        &host(&run(&adamw.build(), p0.clone(), None, 0..6).0),
    );
    assert!(diff <= 1e-6, "converted AdamW vs Burn's: {diff:e}");

    // Adam: the L2 penalty is read from WeightDecayConfig; none means 0.
    let adam = AdamConfig::new().with_weight_decay(Some(WeightDecayConfig::new(0.05)));
    let h = FusedAdam::from_burn_adam(&adam).hyper().unwrap();
    assert_eq!(
        (h.weight_decay, h.decoupled_weight_decay, h.epsilon),
        (0.05, false, 1e-5)
    );
    assert_eq!(
        FusedAdam::from_burn_adam(&AdamConfig::new())
            .hyper()
            .unwrap()
            .weight_decay,
        0.0
    );

    // Cautious weight decay has no fused form: Burn's AdamW runs, bit for bit.
    let cautious = AdamWConfig::new()
        .with_weight_decay(0.3)
        .with_cautious_weight_decay(true);
    let fused = FusedAdam::from_burn_adamw(&cautious);
    assert_eq!(fused.hyper(), None);
    assert_eq!(fused.path_for(&p0), StepPath::BurnFallback);
    assert_eq!(
        host(&run(&fused, p0.clone(), None, 0..4).0),
        host(&run(&cautious.build(), p0, None, 0..4).0)
    );

    // Clipping is reported so the sharded optimizer can refuse it.
    let clipped = AdamWConfig::new().with_grad_clipping(Some(GradientClippingConfig::Norm(1.0)));
    assert!(FusedAdam::from_burn_adamw(&clipped).clips_gradients());
}

/// `x` rounded to `dtype` and widened back, on the host.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn round_to(dtype: DType, x: f32) -> f32 {
    match dtype {
        DType::F16 => half::f16::from_f32(x).to_f32(),
        DType::BF16 => half::bf16::from_f32(x).to_f32(),
        _ => x,
    }
}

/// The CubeCL master-weight kernel on `device` (wgpu or CUDA) for parameters and gradients of
/// each of `dtypes`, against the float64 reference: the master within f32 rounding, the
/// parameter exactly the rounded master. Asserts that the kernel path is taken.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub(crate) fn check_master_kernel(device: &Device, dtypes: &[DType], lengths: &[usize]) {
    use burn_shard_kernels::StepPath;
    for &dtype in dtypes {
        for &n in lengths {
            for (name, cfg) in variants() {
                let ctx = format!("{dtype:?} {name} n={n}");
                let h = cfg.hyper();
                let optim = cfg.init();
                let mut rng = Rng::new(n as u64 + 29);
                let w0: Vec<f32> = rng.vec(n).iter().map(|x| 1.0 + 0.5 * x).collect();
                let mut master = Tensor::<1>::from_data(TensorData::new(w0.clone(), [n]), device);
                let mut param = master.clone().cast(dtype);
                let mut state = None;
                let mut p64: Vec<f64> = w0.iter().map(|&x| x as f64).collect();
                let (mut m64, mut v64, mut vmax64) = (vec![0f64; n], vec![0f64; n], vec![0f64; n]);
                for t in 1..=3 {
                    let g: Vec<f32> = rng.vec(n).iter().map(|x| round_to(dtype, x * 2.0)).collect();
                    let g64: Vec<f64> = g.iter().map(|&x| x as f64).collect();
                    let grad = Tensor::<1>::from_data(TensorData::new(g, [n]), device).cast(dtype);
                    assert_eq!(
                        optim.master_path_for(&master, &param, &grad),
                        StepPath::CubeKernel,
                        "{ctx}: the CubeCL master kernel must run"
                    );
                    let (w, p, s) = optim.step_with_master(1e-3, master, param, grad, state);
                    (master, param, state) = (w, p, s);
                    reference_step(&h, 1e-3, t, &mut p64, &g64, &mut m64, &mut v64, &mut vmax64);
                }
                assert_eq!(param.dtype(), dtype, "{ctx}");
                let w: Vec<f32> = master.into_data().convert::<f32>().iter::<f32>().collect();
                let p: Vec<f32> = param.into_data().convert::<f32>().iter::<f32>().collect();
                assert_eq!((w.len(), p.len()), (n, n), "{ctx}");
                for i in 0..n {
                    let err = (w[i] as f64 - p64[i]).abs();
                    assert!(
                        err <= 1e-6 + 1e-5 * p64[i].abs(),
                        "{ctx} master {i}: {} vs {}",
                        w[i],
                        p64[i]
                    );
                    assert_eq!(p[i], round_to(dtype, w[i]), "{ctx} param {i} is the rounded master");
                }
            }
        }
    }
}

#[test]
fn mismatched_operand_dtypes_are_cast_instead_of_misread() {
    use burn_shard_kernels::StepPath;
    // A bf16 gradient for an f32 parameter: the fused loop would misread it as f32; it is cast
    // to the parameter's dtype first.
    let fused = FusedAdamConfig::adamw().init();
    let p0 = tensor(Rng::new(31).vec(35), [5, 7]);
    let g = tensor(Rng::new(32).vec(35), [5, 7]);
    assert_eq!(fused.path_for(&p0), StepPath::FusedCpu);
    let (ours, _) = fused.step(1e-2, p0.clone(), g.clone().cast(DType::BF16), None);
    let (theirs, _) = AdamWConfig::new()
        .build()
        .step(1e-2, p0.clone(), g.cast(DType::BF16).cast(DType::F32), None);
    assert!(max_abs_diff(&host(&ours), &host(&theirs)) <= 1e-6);
    // A state whose moments are bf16 (a checkpoint of another precision): cast back, and the
    // fused step equals Burn's from the same cast state.
    let (_, state) = fused.step(1e-2, p0.clone(), tensor(Rng::new(33).vec(35), [5, 7]), None);
    let mut state = state.unwrap();
    state.momentum.moment_1 = state.momentum.moment_1.cast(DType::BF16);
    let g = tensor(Rng::new(34).vec(35), [5, 7]);
    let mut reference_state = state.clone();
    reference_state.momentum.moment_1 = reference_state.momentum.moment_1.cast(DType::F32);
    let (ours, _) = fused.step(1e-2, p0.clone(), g.clone(), Some(state));
    let (theirs, _) =
        AdamWConfig::new()
            .build()
            .step(1e-2, p0.clone(), g, Some(FusedAdam::to_adamw_state(reference_state)));
    assert!(max_abs_diff(&host(&ours), &host(&theirs)) <= 1e-6);
}
