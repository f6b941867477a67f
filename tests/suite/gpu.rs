//! The GPU suite (feature `cuda`), run on every GPU by `cargo xtask multi-gpu-test` and, on a
//! machine without a Rust toolchain, by the bundle of `cargo xtask gpu-bundle` (built with
//! Burn's `fusion` on and off): NCCL collectives in `f32`, `bf16` and `f16` against
//! host-computed results, sharded training through NCCL and through the in-process backend
//! with 2 and 4 ranks on one GPU against single-device training on the CPU (TinyMlp, the module
//! sweep's small models, half precision with masters, on the device and offloaded), a
//! checkpoint saved on the GPU resumed on the CPU, and the fused Adam kernels on CUDA. Each
//! test prints why and returns when no GPU is found, unless `BURN_SHARD_REQUIRE_GPU` is set
//! (the bundle sets it): then a missing GPU fails the test.

use burn::optim::{AdamConfig, Optimizer};
use burn::prelude::*;
use burn::tensor::DType;
use burn_shard::{ShardConfig, Stage};
use burn_shard_comm::{Collective, NcclComm, NcclId, ReduceOp, cuda_device_count};
use burn_shard_kernels::{FusedAdamConfig, StepPath};

use crate::common::*;
use crate::fused_adam::reference_step;

/// GPUs to use: `BURN_SHARD_GPUS` (set by the xtask and the bundle) or all that CUDA reports.
pub(crate) fn gpus() -> usize {
    let n = std::env::var("BURN_SHARD_GPUS").ok().and_then(|v| v.parse().ok());
    match n.map(Ok).unwrap_or_else(cuda_device_count) {
        Ok(n) if n > 0 => n,
        found => {
            let reason = match found {
                Err(e) => e.to_string(),
                _ => "CUDA reports no device".into(),
            };
            if std::env::var_os("BURN_SHARD_REQUIRE_GPU").is_some() {
                panic!("BURN_SHARD_REQUIRE_GPU is set, so the GPU tests must run: {reason}");
            }
            eprintln!("skipped: no CUDA device (or no libcuda/libnccl) on this machine: {reason}");
            0
        }
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

/// Every collective, single and grouped (`*_many`), in `f32`, `bf16` and `f16`, against sums
/// computed on the host in `f64`, and a barrier. The inputs are multiples of 1/4 below 4 in
/// magnitude, exact in every dtype, so sums are exact; averages are within `n` units in the
/// last place at 4 (NCCL may scale each input by 1/n before summing).
#[test]
fn gpu_nccl_collectives_match_host_results() {
    let n = gpus();
    if n == 0 {
        return;
    }
    let len = 12 * n;
    let input = |rank: usize, salt: u64| -> Vec<f32> {
        let mut rng = Rng::new(40 + 100 * salt + rank as u64);
        rng.vec(len)
            .into_iter()
            .map(|x| (x * 16.0).round().clamp(-15.0, 15.0) / 4.0)
            .collect()
    };
    for (salt, dtype) in [DType::F32, DType::BF16, DType::F16].into_iter().enumerate() {
        let salt = salt as u64;
        // One unit in the last place at 4 (f32: 2^-21, bf16: 2^-5, f16: 2^-8), per rank.
        let ulp_at_4: f64 = match dtype {
            DType::F32 => 2f64.powi(-21),
            DType::BF16 => 2f64.powi(-5),
            _ => 2f64.powi(-8),
        };
        let tolerance = n as f64 * ulp_at_4;
        let out = on_all_gpus(n, |comm| {
            let device = comm.device().clone();
            let t = |v: Vec<f32>| Tensor::<1>::from_data(TensorData::new(v.clone(), [v.len()]), &device).cast(dtype);
            let mine = input(comm.rank(), salt);
            let sum = comm.all_reduce(t(mine.clone()), ReduceOp::Sum).unwrap();
            assert_eq!(sum.dtype(), dtype, "all_reduce keeps the dtype");
            let avg = host(comm.all_reduce(t(mine.clone()), ReduceOp::Avg).unwrap());
            let rs = host(comm.reduce_scatter(t(mine.clone()), ReduceOp::Avg).unwrap());
            let rs_sum = host(comm.reduce_scatter(t(mine.clone()), ReduceOp::Sum).unwrap());
            let ag = host(comm.all_gather(t(mine[..6].to_vec())).unwrap());
            let bc = host(comm.broadcast(t(mine.clone()), 0).unwrap());
            let ag_many: Vec<Vec<f32>> = comm
                .all_gather_many(vec![t(mine[..3].to_vec()), t(mine[3..6].to_vec())])
                .unwrap()
                .into_iter()
                .map(host)
                .collect();
            let rs_many: Vec<Vec<f32>> = comm
                .reduce_scatter_many(
                    vec![t(mine[..3 * n].to_vec()), t(mine[3 * n..6 * n].to_vec())],
                    ReduceOp::Sum,
                )
                .unwrap()
                .into_iter()
                .map(host)
                .collect();
            comm.barrier().unwrap();
            (host(sum), avg, rs, rs_sum, ag, bc, ag_many, rs_many)
        });
        let total: Vec<f64> = (0..len)
            .map(|i| (0..n).map(|r| input(r, salt)[i] as f64).sum())
            .collect();
        let chunk = len / n;
        let ctx = format!("{dtype:?}, {n} GPU(s)");
        let close = |got: f32, want: f64| (got as f64 - want).abs() <= tolerance;
        for (rank, (sum, avg, rs, rs_sum, ag, bc, ag_many, rs_many)) in out.into_iter().enumerate() {
            for i in 0..len {
                assert_eq!(
                    sum[i] as f64, total[i],
                    "{ctx}: all_reduce(Sum) rank {rank} element {i}"
                );
                let want = total[i] / n as f64;
                assert!(
                    close(avg[i], want),
                    "{ctx}: all_reduce(Avg) rank {rank} element {i}: {} vs {want}",
                    avg[i]
                );
            }
            for i in 0..chunk {
                let want = total[rank * chunk + i];
                assert_eq!(
                    rs_sum[i] as f64, want,
                    "{ctx}: reduce_scatter(Sum) rank {rank} element {i}"
                );
                let want = want / n as f64;
                assert!(
                    close(rs[i], want),
                    "{ctx}: reduce_scatter(Avg) rank {rank} element {i}: {} vs {want}",
                    rs[i]
                );
            }
            let want_ag: Vec<f32> = (0..n).flat_map(|r| input(r, salt)[..6].to_vec()).collect();
            assert_eq!(ag, want_ag, "{ctx}: all_gather rank {rank}");
            assert_eq!(bc, input(0, salt), "{ctx}: broadcast rank {rank}");
            let gathered = |range: std::ops::Range<usize>| -> Vec<f32> {
                (0..n).flat_map(|r| input(r, salt)[range.clone()].to_vec()).collect()
            };
            assert_eq!(
                ag_many,
                [gathered(0..3), gathered(3..6)],
                "{ctx}: all_gather_many rank {rank}"
            );
            let scattered =
                |offset: usize| -> Vec<f32> { (0..3).map(|i| total[offset + rank * 3 + i] as f32).collect() };
            assert_eq!(
                rs_many,
                [scattered(0), scattered(3 * n)],
                "{ctx}: reduce_scatter_many rank {rank}"
            );
        }
    }
}

/// How far training on CUDA may drift from the same training in `f32` on the CPU (losses
/// relative, parameters absolute). CubeCL's matmul autotune may pick tensor-core kernels that
/// run `f32` matmuls as TF32 on sm_80 and newer (a 10-bit mantissa, about 1e-3 relative per
/// product), and Adam turns a small gradient difference into a parameter difference of up to the
/// learning rate per step. The CPU and wgpu suites hold the same checks to 1e-4; the GPU tests
/// print the differences they saw.
pub(crate) const CUDA_TOLERANCE: f32 = 1e-2;

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
            assert!(
                (a - b).abs() / b.abs() < CUDA_TOLERANCE,
                "stage {stage}: loss {a} vs {b}"
            );
        }
        let diff = max_abs_diff(&out[0].1, &ref_params);
        eprintln!("NCCL, stage {stage}: max |param - reference| = {diff:e}");
        assert!(diff < CUDA_TOLERANCE, "stage {stage}: parameters off by {diff:e}");
    }
}

/// Hybrid sharding over NCCL (`ncclCommSplit`, or new communicators before NCCL 2.18): every
/// GPU's rank in 2 shard groups of `n / 2` when `n` is even (`n` groups of 1 otherwise), stages 1-3, against single-device
/// training, every rank holding the same parameters. Skipped without 2 GPUs.
#[test]
fn gpu_hybrid_sharding_over_nccl_matches_single_device() {
    let n = gpus();
    if n < 2 {
        eprintln!("skipped: hybrid sharding needs at least 2 GPUs, found {n}");
        return;
    }
    // 2 shard groups of n/2 GPUs (n even), or n groups of 1: always a real split.
    let replicas = if n.is_multiple_of(2) { 2 } else { n };
    let device = Device::flex().autodiff();
    let base = TinyMlp::new(&device);
    let global_batch = 4 * n;
    let (_, ref_params) = reference_run(&base, AdamConfig::new().init(), 10, global_batch, 1e-2);
    for stage in [Stage::One, Stage::Two, Stage::Three] {
        let out = on_all_gpus(n, |comm| {
            let rank = comm.rank();
            let device = comm.device().clone().autodiff();
            let (mut model, mut optim) = ShardConfig::new(stage)
                .with_replicas(replicas)
                .init(base.clone().fork(&device), AdamConfig::new(), comm)
                .unwrap_or_else(|e| panic!("stage {stage}, {replicas} replicas: {e}"));
            assert!(optim.mesh().is_some(), "a mesh of {replicas} replicas");
            for step in 0..10 {
                let (x, y) = batch(step, global_batch);
                let (a, b) = (rank * 4, rank * 4 + 4);
                let loss = mse(&model, rows(&x, IN, a, b, &device), rows(&y, OUT, a, b, &device));
                model = sharded_step(&mut optim, model, loss, 1e-2).0;
            }
            params_of(&model.materialize())
        });
        for (rank, params) in out.iter().enumerate() {
            assert_eq!(params, &out[0], "stage {stage}: rank {rank} holds other parameters");
        }
        let diff = max_abs_diff(&out[0], &ref_params);
        eprintln!(
            "NCCL HSDP {replicas} x {}, stage {stage}: max |param - reference| = {diff:e}",
            n / replicas
        );
        assert!(diff < CUDA_TOLERANCE, "stage {stage}: parameters off by {diff:e}");
    }
}

/// The in-process backend with 2 and 4 ranks as threads, their tensors on GPU 0: stages 0-3
/// against single-device training on the CPU (the same check as the wgpu test, through
/// CUDA's kernels, Burn's `fusion` on or off as the build has it).
#[test]
fn gpu_in_process_ranks_on_one_gpu_match_single_device_on_the_cpu() {
    if gpus() == 0 {
        return;
    }
    crate::equivalence::check_on_cube_device(&Device::cuda(0), [2, 4], CUDA_TOLERANCE);
}

/// The module sweep's small models (every `burn::nn` module with parameters or buffers) at
/// stages 0-3 with 2 and 4 ranks on GPU 0, against single-device training on the CPU.
#[test]
fn gpu_module_sweep_on_one_gpu_matches_single_device_on_the_cpu() {
    if gpus() == 0 {
        return;
    }
    let device = Device::cuda(0).autodiff();
    for name in crate::modules::MODULES {
        let start = std::time::Instant::now();
        crate::modules::sweep_on(name, &device, [2, 4], CUDA_TOLERANCE);
        eprintln!("{name}: {:.1} s", start.elapsed().as_secs_f64());
    }
}

/// Half precision with `f32` masters on GPU 0 (bf16 and f16), with the optimizer state on the
/// device and offloaded to the host, against each other at stages 0-3 (the offload suite's
/// check, on CUDA); `f32` the same. Forward and backward run the same kernels in both runs; the
/// update does not (CUDA's kernel, compiled with fused multiply-adds, against the host's loop),
/// so a half-precision parameter may round one unit apart: bf16's unit is 2^-8 relative.
#[test]
fn gpu_mixed_precision_and_offload_train_alike_at_every_stage() {
    if gpus() == 0 {
        return;
    }
    let cuda = Device::cuda(0);
    for (dtype, tolerance) in [(DType::F32, 1e-5), (DType::BF16, 1e-2), (DType::F16, 1e-2)] {
        crate::offload::on_cube::check_offload(&cuda, dtype, tolerance);
    }
}

/// Stage 3 with the parameter shards in host memory on GPU 0, against the shards on the GPU
/// (the offload suite's check, on CUDA): bitwise alike in f32, bf16 and f16, the same
/// checkpoint files, no shard bytes left on the GPU.
#[test]
fn gpu_param_offload_trains_bitwise_as_device_resident_shards() {
    if gpus() == 0 {
        return;
    }
    let cuda = Device::cuda(0);
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        crate::offload::on_cube::check_param_offload(&cuda, dtype);
    }
}

/// A checkpoint saved by 2 ranks at stage 3 on GPU 0 resumes on the CPU at 3 ranks and stage 1,
/// and the resumed run ends where an uninterrupted CPU run does.
#[test]
fn gpu_checkpoint_saved_on_the_gpu_resumes_on_the_cpu() {
    if gpus() == 0 {
        return;
    }
    let flex = Device::flex().autodiff();
    flex.seed(5);
    let base = TinyMlp::new(&flex);
    let dir = scratch("gpu", "saved-on-gpu");
    let whole = tiny_steps(&base, &flex, 2, Stage::Two, 0..6, None, None);
    tiny_steps(
        &base,
        &Device::cuda(0).autodiff(),
        2,
        Stage::Three,
        0..3,
        None,
        Some(&dir),
    );
    let meta = burn_shard::checkpoint::inspect(&dir).expect("the checkpoint reads back");
    assert!(meta.is_intact(), "every rank's file is there and whole: {meta:?}");
    let resumed = tiny_steps(&base, &flex, 3, Stage::One, 3..6, Some(&dir), None);
    let diff = max_abs_diff(&resumed, &whole);
    eprintln!("resumed on the CPU: off the uninterrupted CPU run by {diff:e}");
    assert!(
        diff <= CUDA_TOLERANCE,
        "resumed on the CPU: off the uninterrupted run by {diff:e}"
    );
}

/// Steps `steps` of TinyMlp with Adam at `world_size` and `stage`, ranks on `device`; loads
/// `resume` first and saves into `save` at the end when given. Returns rank 0's parameters.
fn tiny_steps(
    base: &TinyMlp,
    device: &Device,
    world_size: usize,
    stage: Stage,
    steps: std::ops::Range<usize>,
    resume: Option<&std::path::Path>,
    save: Option<&std::path::Path>,
) -> Vec<f32> {
    const GLOBAL: usize = 12;
    let group = burn_shard_comm::InProcessGroup::new(world_size).unwrap();
    let out = burn_shard_comm::run_ranks(group, |comm| {
        let (lo, hi) = rank_rows(comm.rank(), world_size, GLOBAL);
        let (mut model, mut optim) = ShardConfig::new(stage)
            .init(base.clone().fork(device), AdamConfig::new(), comm)
            .expect("init");
        if let Some(dir) = resume {
            model = optim.load_checkpoint(model, dir).expect("resume").0;
        }
        for step in steps.clone() {
            let (x, y) = batch(step, GLOBAL);
            let loss = mse(&model, rows(&x, IN, lo, hi, device), rows(&y, OUT, lo, hi, device));
            model = sharded_step(&mut optim, model, loss, 1e-2).0;
        }
        if let Some(dir) = save {
            optim
                .save_checkpoint(&model, dir, serde_json::json!({}))
                .expect("the save succeeds");
        }
        params_of(&model.materialize())
    })
    .expect("no rank panics");
    out.into_iter().next().unwrap()
}
