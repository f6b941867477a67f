//! The GPU suite (feature `cuda`), run on every GPU by `cargo xtask multi-gpu-test`: NCCL
//! collectives against host-computed results, sharded training against single-device training,
//! and the fused Adam kernel on CUDA. Each test prints why and returns when no GPU is found.

use burn::optim::{AdamConfig, Optimizer};
use burn::prelude::*;
use burn::tensor::DType;
use burn_shard::{ShardConfig, Stage};
use burn_shard_comm::{Collective, NcclComm, NcclId, ReduceOp, cuda_device_count};
use burn_shard_kernels::{FusedAdamConfig, StepPath};

use crate::common::*;
use crate::fused_adam::reference_step;

/// GPUs to use: `BURN_SHARD_GPUS` (set by the xtask) or all that CUDA reports.
pub(crate) fn gpus() -> usize {
    let n = std::env::var("BURN_SHARD_GPUS").ok().and_then(|v| v.parse().ok());
    match n.map(Ok).unwrap_or_else(cuda_device_count) {
        Ok(0) | Err(_) => {
            eprintln!("skipped: no CUDA device (or no libcuda/libnccl) on this machine");
            0
        }
        Ok(n) => n,
    }
}

/// Runs `f(comm)` on one thread per GPU, each rank joined to one NCCL communicator.
fn on_all_gpus<T: Send>(n: usize, f: impl Fn(NcclComm) -> T + Sync) -> Vec<T> {
    let id = NcclId::new().expect("NCCL id");
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let (id, f) = (&id, &f);
                s.spawn(move || f(NcclComm::new(rank, rank, n, id).expect("NCCL communicator")))
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
    })
}

pub(crate) fn host(t: Tensor<1>) -> Vec<f32> {
    t.into_data().convert::<f32>().iter::<f32>().collect()
}

#[test]
fn gpu_nccl_collectives_match_host_results() {
    let n = gpus();
    if n == 0 {
        return;
    }
    let len = 6 * n + 6;
    let input = |rank: usize| Rng::new(40 + rank as u64).vec(len);
    let out = on_all_gpus(n, |comm| {
        let device = comm.device().clone();
        let t = |v: Vec<f32>| Tensor::<1>::from_data(TensorData::new(v.clone(), [v.len()]), &device);
        let mine = input(comm.rank());
        let sum = host(comm.all_reduce(t(mine.clone()), ReduceOp::Sum).unwrap());
        let rs = host(comm.reduce_scatter(t(mine.clone()), ReduceOp::Avg).unwrap());
        let ag = host(comm.all_gather(t(mine[..6].to_vec())).unwrap());
        let bc = host(comm.broadcast(t(mine), 0).unwrap());
        (sum, rs, ag, bc)
    });
    let total: Vec<f64> = (0..len).map(|i| (0..n).map(|r| input(r)[i] as f64).sum()).collect();
    let chunk = len / n;
    for (rank, (sum, rs, ag, bc)) in out.into_iter().enumerate() {
        for i in 0..len {
            assert!(
                (sum[i] as f64 - total[i]).abs() < 1e-5,
                "all_reduce rank {rank} element {i}"
            );
        }
        for i in 0..chunk {
            let want = total[rank * chunk + i] / n as f64;
            assert!(
                (rs[i] as f64 - want).abs() < 1e-5,
                "reduce_scatter rank {rank} element {i}"
            );
        }
        let want_ag: Vec<f32> = (0..n).flat_map(|r| input(r)[..6].to_vec()).collect();
        assert_eq!(ag, want_ag, "all_gather rank {rank}");
        assert_eq!(bc, input(0), "broadcast rank {rank}");
    }
}

#[test]
fn gpu_fused_adam_kernel_matches_a_float64_reference() {
    if gpus() == 0 {
        return;
    }
    let device = Device::cuda(0);
    let n = 100_003;
    let cfg = FusedAdamConfig::adamw().with_weight_decay(0.1);
    let (h, optim) = (cfg.hyper(), cfg.init());
    let mut rng = Rng::new(9);
    let p0 = rng.vec(n);
    let mut p = Tensor::<1>::from_data(TensorData::new(p0.clone(), [n]), &device);
    assert_eq!(optim.path_for(&p), StepPath::CubeKernel);
    let mut p64: Vec<f64> = p0.iter().map(|&x| x as f64).collect();
    let (mut m64, mut v64, mut vmax64) = (vec![0f64; n], vec![0f64; n], vec![0f64; n]);
    let mut state = None;
    for t in 1..=3 {
        let g = rng.vec(n);
        let g64: Vec<f64> = g.iter().map(|&x| x as f64).collect();
        let (np, ns) = optim.step(1e-2, p, Tensor::from_data(TensorData::new(g, [n]), &device), state);
        p = np;
        state = ns;
        reference_step(&h, 1e-2, t, &mut p64, &g64, &mut m64, &mut v64, &mut vmax64);
    }
    let got = host(p);
    let worst = got
        .iter()
        .zip(&p64)
        .map(|(a, b)| (*a as f64 - b).abs())
        .fold(0.0, f64::max);
    assert!(worst < 1e-5, "max abs error {worst:e}");
}

#[test]
fn gpu_master_weight_kernel_matches_a_float64_reference_in_bf16_and_f16() {
    if gpus() == 0 {
        return;
    }
    let dtypes = [DType::BF16, DType::F16, DType::F32];
    crate::fused_adam::check_master_kernel(&Device::cuda(0), &dtypes, &[1, 7, 100_003]);
}

#[test]
fn gpu_sharded_training_matches_single_device() {
    let n = gpus();
    if n == 0 {
        return;
    }
    let device = Device::flex().autodiff();
    let base = TinyMlp::new(&device);
    let global_batch = 4 * n;
    let (ref_losses, ref_params) = reference_run(&base, AdamConfig::new().init(), 10, global_batch, 1e-2);
    // Stage 3 runs its gather op on CUDA tensors; `AdamConfig` selects the fused CubeCL kernel.
    for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
        let out = on_all_gpus(n, |comm| {
            let rank = comm.rank();
            let device = comm.device().clone().autodiff();
            let (mut model, mut optim) = ShardConfig::new(stage)
                .init(base.clone().fork(&device), AdamConfig::new(), comm)
                .unwrap();
            let mut losses = Vec::new();
            for step in 0..10 {
                let (x, y) = batch(step, global_batch);
                let (a, b) = (rank * 4, rank * 4 + 4);
                let loss = mse(&model, rows(&x, IN, a, b, &device), rows(&y, OUT, a, b, &device));
                let (next, global) = sharded_step(&mut optim, model, loss, 1e-2);
                model = next;
                losses.push(global);
            }
            (losses, params_of(&model.materialize()))
        });
        for (a, b) in out[0].0.iter().zip(&ref_losses) {
            assert!((a - b).abs() / b.abs() < 1e-4, "stage {stage}: loss {a} vs {b}");
        }
        assert!(max_abs_diff(&out[0].1, &ref_params) < 1e-4, "stage {stage}: parameters");
    }
}
