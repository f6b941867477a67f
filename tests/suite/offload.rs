//! ZeRO-Offload (`with_optimizer_state_on(Home::Host)`): the optimizer state, the `f32` masters
//! and the update move to host memory and the fused CPU Adam, the parameters and gradients stay
//! on the device. Trained on wgpu (lavapipe on CI), offloading changes neither the result (against
//! the same training with the state on the device) nor the parameters' and gradients' bytes,
//! and moves exactly the device's optimizer-state bytes to the host. Stage 3's parameter
//! offload (`with_params_on(Home::Host)`) also keeps the shards in host memory: bitwise the
//! same training, the same checkpoint files.

use burn::optim::AdamWConfig;
use burn::prelude::*;
use burn_shard::{Home, ShardConfig, ShardError, Stage};
use burn_shard_comm::InProcessGroup;

use crate::common::*;

fn adamw() -> AdamWConfig {
    AdamWConfig::new().with_weight_decay(0.1)
}

/// The optimizer state in host memory needs parameters on an accelerator: a model on Burn's Flex
/// CPU device is refused at `init` with the fix named, not trained with an offload that moves
/// nothing.
#[test]
fn offloading_a_model_that_lives_on_the_host_is_refused_at_init() {
    let device = Device::flex().autodiff();
    for stage in [Stage::Zero, Stage::Two, Stage::Three] {
        let comm = InProcessGroup::new(1).unwrap().into_comms().pop().unwrap();
        let err = ShardConfig::new(stage)
            .with_optimizer_state_on(Home::Host)
            .init(TinyMlp::new(&device), adamw(), comm)
            .err()
            .expect("offload of a host model must be refused");
        assert!(matches!(err, ShardError::InvalidConfig(_)), "{err:?}");
        let msg = err.to_string();
        assert!(
            msg.contains("placement.optimizer_state") && msg.contains("already live") && msg.contains("Home::Disk"),
            "stage {stage}: the error names the cause and the fix: {msg}"
        );
    }
}

/// Parameter offload of a model whose parameters live in host memory already (Burn's `Flex`)
/// moves nothing: refused at `init`, naming what saves memory there (the disk), whatever the
/// optimizer state's home.
#[test]
fn offloading_parameters_of_a_host_model_is_refused() {
    for state in [Home::Device, Home::Host] {
        let model = TinyMlp::new(&Device::flex().autodiff());
        let comm = InProcessGroup::new(1).unwrap().into_comms().pop().unwrap();
        let err = ShardConfig::new(Stage::Three)
            .with_params_on(Home::Host)
            .with_optimizer_state_on(state)
            .init(model, adamw(), comm)
            .err()
            .expect("refused")
            .to_string();
        assert!(
            err.contains("placement.params")
                && err.contains("already live in host memory")
                && err.contains("Home::Disk"),
            "{err}"
        );
    }
}

/// The runs on a CubeCL device (offloading needs parameters on an accelerator): the tests on
/// wgpu; [`on_cube::check_offload`] also runs on CUDA in the GPU suite.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub(crate) mod on_cube {
    use burn::optim::{AdamState, GradientsParams, Optimizer};
    use burn::prelude::*;
    use burn::tensor::DType;
    use burn_shard::{Home, IntoOptimizer, MemoryReport, NvmeOffload, ShardConfig, Stage};
    #[cfg(feature = "wgpu")]
    use burn_shard::{MasterWeightStep, ShardedOptimizer};
    use burn_shard_comm::{Collective, InProcessGroup, ReduceOp, run_ranks};

    use super::adamw;
    use crate::common::*;

    const WORLD_SIZE: usize = 2;
    const STEPS: usize = 8;
    const GLOBAL_BATCH: usize = 8;
    const LR: f64 = 1e-2;

    /// What one rank ends a run with.
    struct RankRun {
        /// Global mean loss per step.
        losses: Vec<f32>,
        /// Every parameter (materialised), as `f32`.
        params: Vec<f32>,
        /// This rank's `f32` masters, concatenated in layout order (empty for `f32` parameters).
        masters: Vec<f32>,
        report: MemoryReport,
        /// The devices the optimizer state's moments and the masters were on at the end.
        state_devices: Vec<Device>,
    }

    /// The checkpoints one run reads and writes.
    #[derive(Clone, Copy, Default)]
    struct Checkpoints<'a> {
        /// Loaded after `init`, before the first step.
        resume: Option<&'a std::path::Path>,
        /// Saved after the last step.
        save: Option<&'a std::path::Path>,
    }

    /// `steps` sharded steps of `dtype` parameters on `device` (an autodiff device), starting from
    /// `base`. `f16` uses a fixed loss scale (the same in every run compared).
    /// `save`: a checkpoint directory written after the last step.
    #[allow(clippy::too_many_arguments)]
    fn train_rank<O: IntoOptimizer, C: Collective + 'static>(
        comm: C,
        device: &Device,
        base: &TinyMlp,
        optim: O,
        mut config: ShardConfig,
        dtype: DType,
        steps: usize,
        checkpoints: Checkpoints,
    ) -> RankRun
    where
        O::Optimizer: Optimizer<State<1> = AdamState<1>>,
    {
        let (rank, world_size) = (comm.rank(), comm.world_size());
        if dtype == DType::F16 {
            config = config.with_loss_scaler(burn_shard::LossScaler::fixed(256.0));
        }
        let model = cast(base.clone().fork(device), dtype);
        let (mut model, mut optim) = config.init(model, optim, comm).expect("init");
        if let Some(dir) = checkpoints.resume {
            model = optim.load_checkpoint(model, dir).expect("load").0;
        }
        let (start, end) = rank_rows(rank, world_size, GLOBAL_BATCH);
        let mut losses = Vec::new();
        for step in 0..steps {
            let (x, y) = batch(step, GLOBAL_BATCH);
            let x = rows(&x, IN, start, end, device).cast(dtype);
            let y = rows(&y, OUT, start, end, device).cast(dtype);
            let loss = mse(&model, x, y);
            let global = optim
                .comm()
                .all_reduce(loss.clone().inner().cast(DType::F32), ReduceOp::Avg)
                .expect("loss all_reduce")
                .into_scalar::<f32>();
            losses.push(global);
            let grads = GradientsParams::from_grads(optim.scale_loss(loss).backward(), &model);
            model = optim.step(LR, model, grads).expect("sharded step");
        }
        if let Some(dir) = checkpoints.save {
            optim.save_checkpoint(&model, dir, serde_json::json!({})).expect("save");
        }
        let report = optim.report().memory(&model);
        let mut state_devices: Vec<Device> = optim
            .report()
            .slot_states()
            .iter()
            .flatten()
            .flat_map(|s| [s.momentum.moment_1.device(), s.momentum.moment_2.device()])
            .collect();
        state_devices.extend(optim.report().master_weights().iter().flatten().map(|m| m.device()));
        let masters = optim
            .report()
            .master_weights()
            .iter()
            .flatten()
            .flat_map(|m| m.clone().into_data().convert::<f32>().iter::<f32>().collect::<Vec<_>>())
            .collect();
        RankRun {
            losses,
            params: params_of(&model.materialize()),
            masters,
            report,
            state_devices,
        }
    }

    /// [`run_with`] at `stage` with the optimizer state at `state`, on [`WORLD_SIZE`] ranks.
    fn run(device: &Device, base: &TinyMlp, state: Home, stage: Stage, dtype: DType) -> Vec<RankRun> {
        run_with(
            device,
            base,
            adamw(),
            ShardConfig::new(stage).with_optimizer_state_on(state),
            dtype,
            WORLD_SIZE,
            Checkpoints::default(),
        )
    }

    /// [`run`] with `config` on `world_size` ranks, reading and writing `checkpoints`.
    fn run_with<O: IntoOptimizer + Clone + Send + Sync>(
        device: &Device,
        base: &TinyMlp,
        optim: O,
        config: ShardConfig,
        dtype: DType,
        world_size: usize,
        checkpoints: Checkpoints,
    ) -> Vec<RankRun>
    where
        O::Optimizer: Optimizer<State<1> = AdamState<1>>,
    {
        run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
            train_rank(
                comm,
                device,
                base,
                optim.clone(),
                config.clone(),
                dtype,
                STEPS,
                checkpoints,
            )
        })
        .expect("no rank panics")
    }

    /// Largest `|a - b| / max(|b|, floor)` over the elements.
    fn max_rel_diff(a: &[f32], b: &[f32], floor: f32) -> f32 {
        assert_eq!(a.len(), b.len(), "compared buffers differ in length");
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs() / y.abs().max(floor))
            .fold(0.0, f32::max)
    }

    /// Trains `dtype` parameters with and without offload at stages 0-3 on the CubeCL device
    /// `wgpu` (named for the suite's runs; the GPU suite passes CUDA) and checks:
    /// same losses and parameters (and masters) within `tolerance` relative; the state and the
    /// masters on the host with offload, on the device without; device optimizer bytes 0 with
    /// offload, host bytes exactly the device bytes of the run without, parameter and gradient
    /// bytes unchanged.
    pub(crate) fn check_offload(wgpu: &Device, dtype: DType, tolerance: f32) {
        let device = Device::flex().autodiff();
        device.seed(7);
        let base = TinyMlp::new(&device);
        let autodiff = wgpu.clone().autodiff();
        let host = Device::flex();
        for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
            let ctx = format!("{dtype:?}, stage {stage}");
            let resident = run(&autodiff, &base, Home::Device, stage, dtype);
            let offloaded = run(&autodiff, &base, Home::Host, stage, dtype);
            assert!(
                resident[0].losses[STEPS - 1] < resident[0].losses[0],
                "{ctx}: the run must learn: {:?}",
                resident[0].losses
            );
            for (rank, (r, o)) in resident.iter().zip(&offloaded).enumerate() {
                let ctx = format!("{ctx}, rank {rank}");
                let losses = max_rel_diff(&o.losses, &r.losses, 1e-12);
                let params = max_rel_diff(&o.params, &r.params, 1e-3);
                let masters = max_rel_diff(&o.masters, &r.masters, 1e-3);
                println!(
                    "{ctx}: offloaded vs resident: max rel diff losses {losses:e}, params {params:e}, masters {masters:e}"
                );
                assert!(losses <= tolerance, "{ctx}: losses {:?} vs {:?}", o.losses, r.losses);
                assert!(params <= tolerance, "{ctx}: parameters differ by {params:e} relative");
                assert!(masters <= tolerance, "{ctx}: masters differ by {masters:e} relative");
                assert_eq!(
                    o.masters.is_empty(),
                    dtype == DType::F32,
                    "{ctx}: masters exactly for half dtypes"
                );

                assert!(!r.state_devices.is_empty(), "{ctx}: the optimizer holds state");
                assert!(
                    r.state_devices.iter().all(|d| d == wgpu),
                    "{ctx}: without offload the state stays on the device"
                );
                assert!(
                    o.state_devices.iter().all(|d| *d == host),
                    "{ctx}: with offload the state and masters live on the host: {:?}",
                    o.state_devices
                );

                let (r, o) = (&r.report, &o.report);
                println!(
                    "{ctx}: bytes (params, grads, device optim, host): resident ({}, {}, {}, {}), offloaded ({}, {}, {}, {})",
                    r.parameters_bytes,
                    r.gradients_bytes,
                    r.optimizer_state_bytes,
                    r.host_bytes,
                    o.parameters_bytes,
                    o.gradients_bytes,
                    o.optimizer_state_bytes,
                    o.host_bytes
                );
                assert!(r.optimizer_state_bytes > 0 && r.host_bytes == 0, "{ctx}: {r:?}");
                assert_eq!(o.optimizer_state_bytes, 0, "{ctx}: no optimizer state on the device");
                assert_eq!(
                    o.host_bytes, r.optimizer_state_bytes,
                    "{ctx}: what the device held moves to the host"
                );
                assert_eq!(o.parameters_bytes, r.parameters_bytes, "{ctx}: parameters stay");
                assert_eq!(o.gradients_bytes, r.gradients_bytes, "{ctx}: gradients stay");
                assert_eq!(o.model_state_bytes() + o.host_bytes, r.model_state_bytes(), "{ctx}");
                assert_eq!(o.total_bytes(), r.total_bytes(), "{ctx}");
            }
            // Ranks agree with each other as well.
            assert_eq!(
                offloaded[0].params, offloaded[1].params,
                "{ctx}: ranks hold identical parameters"
            );
        }
    }

    #[cfg(feature = "wgpu")]
    #[test]
    fn offloaded_f32_training_on_wgpu_matches_device_resident_training() {
        let Some(wgpu) = crate::fused_adam_wgpu::device() else {
            return;
        };
        check_offload(&wgpu, DType::F32, 1e-5);
    }

    /// bf16 parameters with their `f32` masters on the host; where the adapter has no bf16 (wgpu:
    /// WGSL has none), f16, which takes the same master-weight path.
    #[cfg(feature = "wgpu")]
    #[test]
    fn offloaded_half_precision_training_on_wgpu_keeps_masters_on_the_host() {
        use burn_shard_kernels::cube_supports;
        let Some(wgpu) = crate::fused_adam_wgpu::device() else {
            return;
        };
        let mut ran = false;
        for dtype in [DType::BF16, DType::F16] {
            if !cube_supports(&wgpu, dtype) {
                eprintln!("skipped {dtype:?}: this wgpu adapter has no {dtype:?} shader support");
                continue;
            }
            check_offload(&wgpu, dtype, 1e-5);
            ran = true;
        }
        if !ran && std::env::var_os("BURN_SHARD_REQUIRE_WGPU").is_some() {
            panic!("BURN_SHARD_REQUIRE_WGPU is set, but the wgpu adapter has neither bf16 nor f16");
        }
    }

    /// Stage 3 with the parameter shards in host memory (`with_params_on(Home::Host)`)
    /// on the CubeCL device `device`, against the same training with the shards on the device
    /// (both with the optimizer offloaded, which parameter offload requires), at world sizes
    /// 1-3, gathering parameter by parameter and unit by unit (`with_units`, one grouped
    /// gather per unit): bitwise the same losses, parameters and masters (the same kernels
    /// run on the same values; only where the shards wait between uses changes); byte for
    /// byte the same checkpoint rank files; no parameter bytes left on the device, the shards
    /// counted in host memory instead (`host_bytes` grows by what the resident run's
    /// `parameters_bytes` was), gradients unchanged. Then each checkpoint resumes in the other
    /// configuration: the same training from there, the loaded shards in host memory.
    pub(crate) fn check_param_offload(device: &Device, dtype: DType) {
        let host = Device::flex().autodiff();
        host.seed(11);
        let base = TinyMlp::new(&host);
        let autodiff = device.clone().autodiff();
        // The device in the scratch path: the wgpu and CUDA suites may share a target dir.
        let device_name: String = format!("{device:?}")
            .chars()
            .filter(char::is_ascii_alphanumeric)
            .collect();
        for world_size in 1..=3 {
            for units in [vec![], vec!["l1", "l2"]] {
                let ctx = format!("{dtype:?}, world size {world_size}, units {units:?}");
                let dir = scratch(
                    "param-offload",
                    &format!("{device_name}-{dtype:?}-{world_size}-{}", units.len()),
                );
                let resident = ShardConfig::new(Stage::Three)
                    .with_units(units.clone())
                    .with_optimizer_state_on(Home::Host);
                let offloaded = resident.clone().with_params_on(Home::Host);
                let (saved_resident, saved_offloaded) = (dir.join("resident"), dir.join("offloaded"));
                let run = |config: &ShardConfig, checkpoints| {
                    run_with(
                        &autodiff,
                        &base,
                        adamw(),
                        config.clone(),
                        dtype,
                        world_size,
                        checkpoints,
                    )
                };
                let saving = |dir| Checkpoints {
                    resume: None,
                    save: Some(dir),
                };
                let r = run(&resident, saving(&saved_resident));
                let o = run(&offloaded, saving(&saved_offloaded));
                assert!(
                    r[0].losses[STEPS - 1] < r[0].losses[0],
                    "{ctx}: the run must learn: {:?}",
                    r[0].losses
                );
                for (rank, (r, o)) in r.iter().zip(&o).enumerate() {
                    let ctx = format!("{ctx}, rank {rank}");
                    assert_eq!(o.losses, r.losses, "{ctx}: losses");
                    assert_eq!(o.params, r.params, "{ctx}: parameters");
                    assert_eq!(o.masters, r.masters, "{ctx}: masters");
                    let (r, o) = (&r.report, &o.report);
                    println!("{ctx}: resident {r:?}\n{ctx}: offloaded {o:?}");
                    assert!(
                        r.parameters_bytes > 0,
                        "{ctx}: the resident run holds its shards on the device"
                    );
                    assert_eq!(o.parameters_bytes, 0, "{ctx}: no parameter shard left on the device");
                    assert_eq!(
                        o.host_bytes,
                        r.host_bytes + r.parameters_bytes,
                        "{ctx}: the shards are in host memory"
                    );
                    assert_eq!(o.gradients_bytes, r.gradients_bytes, "{ctx}: gradients stay");
                    assert_eq!(o.total_bytes(), r.total_bytes(), "{ctx}");
                }
                assert_eq!(
                    checkpoint_files(&saved_offloaded),
                    checkpoint_files(&saved_resident),
                    "{ctx}: the checkpoints differ"
                );
                // The shards on disk instead (`with_params_on(Home::Disk(..))`): read into host memory
                // and copied to the device per gather; the gradient shards go to disk as backward
                // reduces them. The same numbers and checkpoint, and neither parameters nor
                // gradients left in memory.
                let nvme = dir.join("nvme");
                std::fs::create_dir_all(&nvme).unwrap();
                let saved_stored = dir.join("stored");
                let stored = offloaded.clone().with_params_on(Home::Disk(NvmeOffload::new(&nvme)));
                let s = run(&stored, saving(&saved_stored));
                for (rank, (r, s)) in r.iter().zip(&s).enumerate() {
                    let ctx = format!("{ctx}, rank {rank}, shards on disk");
                    assert_eq!(s.losses, r.losses, "{ctx}: losses");
                    assert_eq!(s.params, r.params, "{ctx}: parameters");
                    assert_eq!(s.masters, r.masters, "{ctx}: masters");
                    let (r, s) = (&r.report, &s.report);
                    assert_eq!((s.parameters_bytes, s.gradients_bytes), (0, 0), "{ctx}: {s:?}");
                    assert_eq!(
                        s.host_bytes, r.host_bytes,
                        "{ctx}: only the optimizer state in host memory"
                    );
                    assert_eq!(s.disk_bytes, r.parameters_bytes, "{ctx}: the shards on disk");
                }
                assert_eq!(
                    checkpoint_files(&saved_stored),
                    checkpoint_files(&saved_resident),
                    "{ctx}: the checkpoints differ"
                );
                // Each checkpoint loads into the other configuration and training goes on as
                // it would have in the one that saved it: the same numbers, and with offload
                // the loaded shards in host memory.
                let resuming = |dir| Checkpoints {
                    resume: Some(dir),
                    save: None,
                };
                let offloaded_from_resident = run(&offloaded, resuming(&saved_resident));
                let resident_from_offloaded = run(&resident, resuming(&saved_offloaded));
                for (rank, (a, b)) in offloaded_from_resident.iter().zip(&resident_from_offloaded).enumerate() {
                    let ctx = format!("{ctx}, rank {rank}, resumed");
                    assert!(
                        a.losses[0] < r[rank].losses[0],
                        "{ctx}: the run resumes trained weights: {:?} vs {:?}",
                        a.losses,
                        r[rank].losses
                    );
                    assert_eq!(a.losses, b.losses, "{ctx}: losses");
                    assert_eq!(a.params, b.params, "{ctx}: parameters");
                    assert_eq!(a.masters, b.masters, "{ctx}: masters");
                    assert_eq!(a.report.parameters_bytes, 0, "{ctx}: loaded shards in host memory");
                    assert_eq!(a.report.host_bytes, o[rank].report.host_bytes, "{ctx}: host bytes");
                }
            }
        }
    }

    #[cfg(feature = "wgpu")]
    #[test]
    fn param_offload_on_wgpu_trains_bitwise_as_device_resident_shards() {
        use burn_shard_kernels::cube_supports;
        let Some(wgpu) = crate::fused_adam_wgpu::device() else {
            return;
        };
        check_param_offload(&wgpu, DType::F32);
        // bf16 with `f32` masters; f16 (with loss scaling) where the adapter has no bf16 (WGSL).
        match [DType::BF16, DType::F16].into_iter().find(|d| cube_supports(&wgpu, *d)) {
            Some(half) => check_param_offload(&wgpu, half),
            None => eprintln!("skipped the half dtypes: this wgpu adapter has neither bf16 nor f16"),
        }
    }

    /// `init` refuses parameter offload where it would move nothing or could not step, naming
    /// the fix: below stage 3, and with an optimizer whose state stays on the device (the
    /// model on the host: `offloading_parameters_of_a_host_model_is_refused`).
    #[cfg(feature = "wgpu")]
    #[test]
    fn param_offload_below_stage_3_or_without_offload_is_refused_at_init() {
        let Some(wgpu) = crate::fused_adam_wgpu::device() else {
            return;
        };
        let model = || TinyMlp::new(&wgpu.clone().autodiff());
        let comm = || InProcessGroup::new(1).unwrap().into_comms().pop().unwrap();
        let err = ShardConfig::new(Stage::Two)
            .with_params_on(Home::Host)
            .with_optimizer_state_on(Home::Host)
            .init(model(), adamw(), comm())
            .err()
            .expect("refused")
            .to_string();
        assert!(err.contains("at stage 2") && err.contains("Stage::Three"), "{err}");
        let err = ShardConfig::new(Stage::Three)
            .with_params_on(Home::Host)
            .init(model(), adamw(), comm())
            .err()
            .expect("refused")
            .to_string();
        assert!(err.contains("with_optimizer_state_on(Home::Host)"), "{err}");
    }

    /// One step of `optim` on rows `start..end` of step `step`'s global batch.
    #[cfg(feature = "wgpu")]
    fn step_rows<O: MasterWeightStep>(
        model: TinyMlp,
        optim: &mut ShardedOptimizer<O>,
        step: usize,
        (start, end): (usize, usize),
        device: &Device,
    ) -> TinyMlp {
        let (x, y) = batch(step, GLOBAL_BATCH);
        let loss = mse(
            &model,
            rows(&x, IN, start, end, device),
            rows(&y, OUT, start, end, device),
        );
        sharded_step(optim, model, loss, LR).0
    }

    /// A checkpoint saved without offload resumes with offload: the loaded state and masters land
    /// on the host (not on the parameters' device), and training continues as without offload.
    #[cfg(feature = "wgpu")]
    #[test]
    fn checkpoint_of_a_resident_run_resumes_offloaded_with_the_state_on_the_host() {
        let Some(wgpu) = crate::fused_adam_wgpu::device() else {
            return;
        };
        let device = Device::flex().autodiff();
        device.seed(11);
        let base = TinyMlp::new(&device);
        let autodiff = wgpu.autodiff();
        let dir = scratch("offload", "resume").join("ckpt");
        let (first, then) = (3, 3);
        let straight = run_ranks(InProcessGroup::new(WORLD_SIZE).unwrap(), |comm| {
            train_rank(
                comm,
                &autodiff,
                &base,
                adamw(),
                ShardConfig::new(Stage::Two),
                DType::F32,
                first + then,
                Checkpoints::default(),
            )
        })
        .unwrap();
        let resumed = run_ranks(InProcessGroup::new(WORLD_SIZE).unwrap(), |comm| {
            let comm = std::sync::Arc::new(comm);
            let (rank, world_size) = (comm.rank(), comm.world_size());
            let mine = rank_rows(rank, world_size, GLOBAL_BATCH);
            // Resident for `first` steps, saved.
            let (mut model, mut optim) = ShardConfig::new(Stage::Two)
                .init(base.clone().fork(&autodiff), adamw(), comm.clone())
                .unwrap();
            for s in 0..first {
                model = step_rows(model, &mut optim, s, mine, &autodiff);
            }
            let saved = optim.report().memory(&model);
            optim.save_checkpoint(&model, &dir, serde_json::json!({})).unwrap();
            // Offloaded from the checkpoint on.
            let (model, mut offloaded) = ShardConfig::new(Stage::Two)
                .with_optimizer_state_on(Home::Host)
                .init(base.clone().fork(&autodiff), adamw(), comm.clone())
                .unwrap();
            let (mut model, _) = offloaded.load_checkpoint(model, &dir).unwrap();
            let loaded = offloaded.report().memory(&model);
            let state = offloaded
                .report()
                .slot_states()
                .iter()
                .flatten()
                .next()
                .expect("loaded state");
            assert_eq!(
                offloaded.optimizer().path_for(&state.momentum.moment_1),
                burn_shard_kernels::StepPath::FusedCpu,
                "the offloaded step runs the fused CPU Adam"
            );
            for s in first..first + then {
                model = step_rows(model, &mut offloaded, s, mine, &autodiff);
            }
            (saved, loaded, params_of(&model))
        })
        .unwrap();
        for (rank, (saved, loaded, params)) in resumed.iter().enumerate() {
            assert!(saved.optimizer_state_bytes > 0);
            assert_eq!(
                loaded.optimizer_state_bytes, 0,
                "rank {rank}: the loaded state is not on the device"
            );
            assert_eq!(
                loaded.host_bytes, saved.optimizer_state_bytes,
                "rank {rank}: all of it is on the host"
            );
            let diff = max_rel_diff(params, &straight[rank].params, 1e-3);
            assert!(
                diff <= 1e-5,
                "rank {rank}: resumed offloaded vs straight resident: {diff:e}"
            );
        }
    }

    #[cfg(feature = "wgpu")]
    #[derive(Module, Debug)]
    struct Wide {
        a: burn::nn::Linear,
        b: burn::nn::Linear,
    }

    /// Every rank's report after one step of `Wide` in `dtype` at `stage`.
    #[cfg(feature = "wgpu")]
    fn wide_reports(device: &Device, base: &Wide, state: Home, stage: Stage, dtype: DType) -> Vec<MemoryReport> {
        run_ranks(InProcessGroup::new(WORLD_SIZE).unwrap(), |comm| {
            let mut config = ShardConfig::new(stage).with_optimizer_state_on(state.clone());
            if dtype == DType::F16 {
                config = config.with_loss_scaler(burn_shard::LossScaler::fixed(256.0));
            }
            let model = cast(base.clone().fork(device), dtype);
            let (model, mut optim) = config.init(model, adamw(), comm).unwrap();
            let x = Tensor::<2>::ones([2, 512], device).cast(dtype);
            let loss = model.b.forward(model.a.forward(x)).powi_scalar(2).mean();
            let grads = GradientsParams::from_grads(optim.scale_loss(loss).backward(), &model);
            let model = optim.step(1e-3, model, grads).unwrap();
            optim.report().memory(&model)
        })
        .unwrap()
    }

    /// Ψ = 512·512 + 512 + 512·512 + 512 = 525_312 parameters: per-rank bytes with and without
    /// offload at every stage, for f32 and (where the adapter has it) f16 (the table in docs/training.md).
    #[cfg(feature = "wgpu")]
    #[test]
    fn offload_moves_the_optimizer_state_of_a_wider_model_to_the_host() {
        let Some(wgpu) = crate::fused_adam_wgpu::device() else {
            return;
        };
        const PSI: usize = 2 * (512 * 512 + 512);
        let device = wgpu.clone().autodiff();
        let base = Wide {
            a: burn::nn::LinearConfig::new(512, 512).init(&device),
            b: burn::nn::LinearConfig::new(512, 512).init(&device),
        };
        let mut dtypes = vec![DType::F32];
        if burn_shard_kernels::cube_supports(&wgpu, DType::F16) {
            dtypes.push(DType::F16);
        }
        for dtype in dtypes {
            for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
                let resident = wide_reports(&device, &base, Home::Device, stage, dtype);
                let offloaded = wide_reports(&device, &base, Home::Host, stage, dtype);
                for (r, o) in resident.iter().zip(&offloaded) {
                    println!(
                        "Ψ = {PSI}, {dtype:?}, {WORLD_SIZE} ranks: {r}\n    offloaded: {o}\n    \
                         device model state {} B -> {} B, host {} B",
                        r.model_state_bytes(),
                        o.model_state_bytes(),
                        o.host_bytes
                    );
                    assert_eq!(o.optimizer_state_bytes, 0);
                    assert_eq!(o.host_bytes, r.optimizer_state_bytes);
                    assert_eq!(
                        (o.parameters_bytes, o.gradients_bytes),
                        (r.parameters_bytes, r.gradients_bytes)
                    );
                    assert_eq!(r.model_state_bytes() - o.model_state_bytes(), o.host_bytes);
                }
                // Adam's moments (and an f32 master per half-precision element) of this rank's
                // piece: 8 (12) bytes per element, Ψ elements at stage 0, Ψ/N (+ padding) at 1-3.
                let per_element = if dtype == DType::F32 { 8 } else { 12 };
                let stepped = if stage == Stage::Zero {
                    PSI
                } else {
                    PSI.div_ceil(WORLD_SIZE)
                };
                assert!(offloaded[0].host_bytes >= per_element * stepped - per_element * WORLD_SIZE);
                assert!(offloaded[0].host_bytes <= per_element * stepped);
            }
        }
    }
}
