//! Sharded checkpoints: resume exactly at the same world size and stage, resume at other world
//! sizes and stages, consolidate into a plain Burn record, and refuse bad checkpoints with an
//! error naming the file or the parameter, on every rank.

use std::path::Path;

use burn::module::{Module, Param};
use burn::nn::{BatchNorm, BatchNormConfig};
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, AdamWConfig, SgdConfig};
use burn::prelude::*;
use burn::tensor::DType;
use burn_shard::checkpoint::{
    ConsolidateOptions, FileStatus, RecordFormat, SaveOptions, Selection, consolidate, inspect, reshard,
};
use burn_shard::{IntoOptimizer, ShardConfig, ShardError, Stage};
use burn_shard_comm::{Collective, InProcessGroup, run_ranks};
use burn_store::ModuleSnapshot;

use crate::common::{Rng, max_abs_diff, params_of, scratch, sharded_step};

/// Parameters of uneven sizes ([7, 3], [5], [1]) and, optionally, a BatchNorm with running
/// statistics (left out where world sizes are compared: BatchNorm normalises each rank's batch
/// by itself, so its training depends on the world size by design).
#[derive(Module, Debug)]
pub struct Uneven {
    w: Param<Tensor<2>>,
    b: Param<Tensor<1>>,
    s: Param<Tensor<1>>,
    norm: Option<BatchNorm>,
}

impl Uneven {
    fn new(device: &Device, with_norm: bool) -> Self {
        let mut rng = Rng::new(77);
        fn param<const D: usize>(rng: &mut Rng, shape: [usize; D], device: &Device) -> Param<Tensor<D>> {
            let data = TensorData::new(rng.vec(shape.iter().product()), shape);
            Param::from_tensor(Tensor::from_data(data, device).require_grad())
        }
        Self {
            w: param(&mut rng, [7, 3], device),
            b: param(&mut rng, [5], device),
            s: param(&mut rng, [1], device),
            norm: with_norm.then(|| BatchNormConfig::new(3).init(device)),
        }
    }

    /// `x`: `[batch, 7]` -> `[batch]` loss terms.
    fn forward(&self, x: Tensor<2>) -> Tensor<1> {
        let h = x.clone().matmul(self.w.val());
        let h = match &self.norm {
            // The norm stays f32 in a bf16 model (its statistics need the range).
            Some(norm) => norm.forward(h.clone().cast(DType::F32)).cast(h.dtype()),
            None => h,
        };
        let y = h.sum_dim(1) * self.s.val().unsqueeze() + (x.narrow(1, 0, 5) * self.b.val().unsqueeze()).sum_dim(1);
        y.squeeze_dim(1)
    }
}

const GLOBAL_BATCH: usize = 24;
pub(crate) const LR: f64 = 1e-2;

fn loss(model: &Uneven, step: usize, rank: usize, world_size: usize, device: &Device) -> Tensor<1> {
    let per_rank = GLOBAL_BATCH / world_size;
    let x = Rng::new(300 + step as u64).vec(GLOBAL_BATCH * 7);
    let x = &x[rank * per_rank * 7..(rank + 1) * per_rank * 7];
    let x = Tensor::<2>::from_data(TensorData::new(x.to_vec(), [per_rank, 7]), device).cast(model.w.dtype());
    model.forward(x).sub_scalar(0.5).powi_scalar(2).mean()
}

/// What one rank ends with: parameters and running statistics (full), per-step global losses.
#[derive(Clone, Debug, PartialEq)]
struct Outcome {
    params: Vec<f32>,
    losses: Vec<f32>,
}

/// Trains `steps` (global step numbers `first..first+steps`) at `world_size` and `stage`,
/// loading `load` first and saving to `save` at the end when given. Returns every rank's
/// outcome and the loaded payload.
#[allow(clippy::too_many_arguments)]
fn train<O: IntoOptimizer + Clone + Send + Sync>(
    base: &Uneven,
    optim: O,
    dtype: DType,
    world_size: usize,
    stage: Stage,
    first: usize,
    steps: usize,
    load: Option<&Path>,
    save: Option<&Path>,
) -> Vec<(Outcome, Option<serde_json::Value>)> {
    run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
        let rank = comm.rank();
        let device = Device::flex().autodiff();
        // Each rank its own running states, as separate processes have.
        let model = cast(base.valid().train().fork(&device), dtype);
        let (mut model, mut optim) = ShardConfig::new(stage).init(model, optim.clone(), comm).expect("init");
        let mut payload = None;
        if let Some(dir) = load {
            let (loaded, restored) = optim.load_checkpoint(model, dir).expect("load");
            model = loaded;
            payload = Some(restored.payload);
        }
        let mut losses = Vec::new();
        for step in first..first + steps {
            let l = loss(&model, step, rank, world_size, &device);
            let (next, global) = sharded_step(&mut optim, model, l, LR);
            model = next;
            losses.push(global);
        }
        if let Some(dir) = save {
            optim
                .save_checkpoint(&model, dir, serde_json::json!({ "step": first + steps }))
                .expect("save");
        }
        let full = model.valid().materialize();
        (
            Outcome {
                params: params_of(&cast(full, DType::F32)),
                losses,
            },
            payload,
        )
    })
    .expect("no rank panics")
}

/// `module` with every float entry outside its `norm` cast to `dtype`.
fn cast<M: Module>(module: M, dtype: DType) -> M {
    struct Cast(DType, Vec<String>);
    impl burn::module::ModuleMapper for Cast {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.1.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.1.pop();
        }
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let (id, value, mapper) = param.consume();
            if value.dtype() == self.0 || self.1.first().is_some_and(|m| m == "norm") {
                return Param::from_mapped_value(id, value, mapper);
            }
            let require_grad = value.is_require_grad();
            let mut value = value.cast(self.0).detach();
            if require_grad {
                value = value.require_grad();
            }
            Param::from_mapped_value(id, value, mapper)
        }
    }
    module.map(&mut Cast(dtype, Vec::new()))
}

fn check_exact_resume<O: IntoOptimizer + Clone + Send + Sync>(name: &str, optim: O, dtype: DType) {
    let device = Device::flex().autodiff();
    let base = Uneven::new(&device, true);
    for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
        let dir = scratch("checkpoint-tests", &format!("exact-{name}-{stage}")).join("step-3");
        let whole = train(&base, optim.clone(), dtype, 2, stage, 0, 6, None, None);
        train(&base, optim.clone(), dtype, 2, stage, 0, 3, None, Some(&dir));
        let resumed = train(&base, optim.clone(), dtype, 2, stage, 3, 3, Some(&dir), None);
        for (rank, ((w, _), (r, payload))) in whole.iter().zip(&resumed).enumerate() {
            assert_eq!(payload.as_ref().unwrap()["step"], 3, "{name}: the payload comes back");
            assert_eq!(
                &w.losses[3..],
                &r.losses[..],
                "{name} stage {stage} rank {rank}: losses after resuming"
            );
            assert_eq!(
                w.params, r.params,
                "{name} stage {stage} rank {rank}: 3 + 3 steps must equal 6, bitwise"
            );
        }
    }
}

#[test]
fn adamw_resumes_bitwise_at_the_same_world_size_and_stage() {
    check_exact_resume("AdamW", AdamWConfig::new().with_weight_decay(0.1), DType::F32);
}

#[test]
fn adam_resumes_bitwise_at_the_same_world_size_and_stage() {
    check_exact_resume("Adam", AdamConfig::new(), DType::F32);
}

#[test]
fn sgd_momentum_resumes_bitwise_at_the_same_world_size_and_stage() {
    let sgd = SgdConfig::new().with_momentum(Some(MomentumConfig::new())).build();
    check_exact_resume("SGD", sgd, DType::F32);
}

#[test]
fn bf16_with_f32_masters_resumes_bitwise() {
    check_exact_resume("AdamW-bf16", AdamWConfig::new(), DType::BF16);
}

/// A checkpoint of world size 4 at stage 2 resumes at world sizes 1, 3 and 8 and at stage 3;
/// one of stage 3 resumes at stage 2 on another world size. Continued training equals the
/// uninterrupted run.
#[test]
fn a_checkpoint_resumes_at_any_world_size_and_stage() {
    let device = Device::flex().autodiff();
    let base = Uneven::new(&device, false);
    let optim = AdamWConfig::new().with_weight_decay(0.1);
    let root = scratch("checkpoint-tests", "elsewhere");
    let whole = train(&base, optim.clone(), DType::F32, 4, Stage::Two, 0, 6, None, None);
    let expected = &whole[0].0;
    let from_stage_2 = root.join("w4-s2");
    train(
        &base,
        optim.clone(),
        DType::F32,
        4,
        Stage::Two,
        0,
        3,
        None,
        Some(&from_stage_2),
    );
    let from_stage_3 = root.join("w2-s3");
    train(
        &base,
        optim.clone(),
        DType::F32,
        2,
        Stage::Three,
        0,
        3,
        None,
        Some(&from_stage_3),
    );
    // The offline tool's rewrite for 3 ranks loads like the original.
    let resharded = root.join("w4-s2-as-3");
    let meta = reshard(&from_stage_2, 3, &resharded).expect("reshard");
    assert_eq!((meta.world_size, meta.files.len()), (3, 3));
    assert!(inspect(&resharded).unwrap().is_intact());
    let cases = [
        (&resharded, 3, Stage::Three),
        (&resharded, 2, Stage::Two),
        (&from_stage_2, 1, Stage::Two),
        (&from_stage_2, 3, Stage::Two),
        (&from_stage_2, 8, Stage::Two),
        (&from_stage_2, 4, Stage::Three),
        (&from_stage_2, 2, Stage::Zero),
        (&from_stage_3, 3, Stage::Two),
        (&from_stage_3, 4, Stage::One),
    ];
    for (dir, world_size, stage) in cases {
        let resumed = train(
            &base,
            optim.clone(),
            DType::F32,
            world_size,
            stage,
            3,
            3,
            Some(dir),
            None,
        );
        for (rank, (r, _)) in resumed.iter().enumerate() {
            let diff = max_abs_diff(&r.params, &expected.params);
            let scale = expected.params.iter().fold(0f32, |m, x| m.max(x.abs()));
            assert!(
                diff <= 1e-6 * scale,
                "{} at world size {world_size}, stage {stage}, rank {rank}: off the uninterrupted run by {diff} (scale {scale})",
                dir.display()
            );
        }
    }
}

/// The consolidated record loads into the plain, unsharded model with Burn's own `load_file`,
/// equal to the sharded model's values (buffers included).
#[test]
fn a_consolidated_checkpoint_loads_into_the_plain_model() {
    let device = Device::flex().autodiff();
    let base = Uneven::new(&device, true);
    let root = scratch("checkpoint-tests", "consolidate");
    for (stage, world_size) in [(Stage::Two, 3), (Stage::Three, 4), (Stage::Zero, 2)] {
        let dir = root.join(format!("s{stage}-w{world_size}"));
        let out = train(
            &base,
            AdamWConfig::new(),
            DType::F32,
            world_size,
            stage,
            0,
            2,
            None,
            Some(&dir),
        );
        let file = root.join(format!("s{stage}-w{world_size}.bpk"));
        let report = consolidate(&dir, &file, Selection::All).expect("consolidate");
        assert_eq!(
            report.entries,
            3 + 4,
            "w, b, s, the norm's gamma and beta, and its two running stats"
        );
        let plain = Uneven::new(&Device::flex().autodiff(), true).load_file(&file);
        let got = params_of(&plain);
        assert_eq!(
            got, out[0].0.params,
            "stage {stage}: the plain model holds the sharded values"
        );
        // And back: a plain record (pretrained weights) loaded before init starts a sharded run.
        let restarted = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
            let device = Device::flex().autodiff();
            let model = Uneven::new(&device, true).load_file(&file);
            let (model, _) = ShardConfig::new(Stage::Three)
                .init(model, AdamWConfig::new(), comm)
                .unwrap();
            params_of(&model.valid().materialize())
        })
        .unwrap();
        assert!(
            restarted.iter().all(|p| *p == got),
            "a plain record starts a stage-3 run"
        );
        // The same through safetensors, read back with burn-store.
        let tensors = root.join(format!("s{stage}-w{world_size}.safetensors"));
        consolidate(&dir, &tensors, RecordFormat::Safetensors).expect("consolidate to safetensors");
        let mut plain = Uneven::new(&Device::flex().autodiff(), true);
        let mut store = burn_store::SafetensorsStore::from_file(&tensors);
        let applied = plain.load_from(&mut store).expect("burn-store reads it");
        assert!(applied.errors.is_empty() && applied.missing.is_empty(), "{applied:?}");
        assert_eq!(
            params_of(&plain),
            got,
            "stage {stage}: safetensors holds the sharded values"
        );
    }
}

/// A LoRA fine-tune (Burn's `Lora` on two `Linear` layers: only the adapters train) saved at
/// stages 0-3 on 2 ranks: `consolidate(.., Selection::Trainable)` (and the CLI's
/// `ckpt consolidate --trainable-only`, byte for byte) writes its 4 adapter tensors alone, under their module paths, in
/// burnpack and safetensors, holding the trained adapters (at stage 3 too, where
/// `materialize()` merges them into the base); loaded over the frozen base (burn-store,
/// `allow_partial`) they give the fine-tuned model. The whole consolidation holds the base too.
#[test]
fn a_lora_checkpoint_consolidates_its_adapters_alone_at_every_stage() {
    use burn::module::Lora;
    use burn::nn::{Linear, LinearConfig};
    #[derive(Module, Debug)]
    struct Net {
        l1: Linear,
        l2: Linear,
    }
    impl Net {
        fn loss(&self, step: usize, device: &Device) -> Tensor<1> {
            let x = Tensor::<2>::from_data(TensorData::new(Rng::new(80 + step as u64).vec(4 * 5), [4, 5]), device);
            self.l2
                .forward(self.l1.forward(x).tanh())
                .sub_scalar(0.5)
                .powi_scalar(2)
                .mean()
        }
        /// The adapters' values: l1's a and b, then l2's (`val()`: gathered at stage 3).
        fn adapters(&self) -> Vec<Vec<f32>> {
            let values = |p: &Param<Tensor<2>>| p.val().into_data().iter::<f32>().collect();
            [&self.l1, &self.l2]
                .iter()
                .flat_map(|l| {
                    let adapter = l.weight.adapter().unwrap();
                    [values(&adapter.a), values(&adapter.b)]
                })
                .collect()
        }
    }
    let device = Device::flex().autodiff();
    let base = Net {
        l1: LinearConfig::new(5, 8).init(&device),
        l2: LinearConfig::new(8, 3).init(&device),
    };
    let base_values = params_of(&base);
    let base = base.apply_lora(Lora::new(2, 4.0));
    let root = scratch("checkpoint-tests", "lora-trainable");
    for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
        let dir = root.join(format!("s{stage}"));
        let ranks = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
            let device = Device::flex().autodiff();
            let (mut model, mut optim) = ShardConfig::new(stage)
                .init(base.clone().fork(&device), AdamWConfig::new(), comm)
                .unwrap();
            for step in 0..2 {
                let loss = model.loss(step, &device);
                model = sharded_step(&mut optim, model, loss, 1e-2).0;
            }
            optim.save_checkpoint(&model, &dir, serde_json::Value::Null).unwrap();
            (model.adapters(), params_of(&model.valid().materialize()))
        })
        .unwrap();
        let (adapters, merged) = &ranks[0];
        let file = root.join(format!("s{stage}-adapters.safetensors"));
        let report = consolidate(
            &dir,
            &file,
            ConsolidateOptions::new()
                .with_selection(Selection::Trainable)
                .with_format(RecordFormat::Safetensors),
        )
        .unwrap();
        assert_eq!(report.entries, 4, "stage {stage}: the 4 adapter tensors alone");
        let bytes = std::fs::read(&file).unwrap();
        let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut names = tensors.names();
        names.sort();
        assert!(
            names.iter().filter(|n| n.starts_with("l1.")).count() == 2
                && names.iter().filter(|n| n.starts_with("l2.")).count() == 2,
            "stage {stage}: {names:?}"
        );
        let mut in_file: Vec<Vec<f32>> = names
            .iter()
            .map(|n| {
                let t = tensors.tensor(n).unwrap();
                t.data()
                    .chunks(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                    .collect()
            })
            .collect();
        let mut expected = adapters.clone();
        let key = |v: &Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        in_file.sort_by_key(key);
        expected.sort_by_key(key);
        assert_eq!(in_file, expected, "stage {stage}: the file holds the trained adapters");
        // Over the frozen base: the fine-tuned model.
        let mut tuned = Net {
            l1: LinearConfig::new(5, 8).init(&device),
            l2: LinearConfig::new(8, 3).init(&device),
        };
        tuned = burn::module::Module::load_record(tuned, base.clone().materialize().into_record());
        assert_eq!(
            params_of(&tuned),
            base_values,
            "the base, unmerged (adapter b starts at zero)"
        );
        let mut tuned = tuned.apply_lora(Lora::new(2, 4.0));
        let mut store = burn_store::SafetensorsStore::from_file(&file).allow_partial(true);
        let applied = tuned.load_from(&mut store).unwrap();
        assert!(
            applied.errors.is_empty() && applied.unused.is_empty(),
            "stage {stage}: {applied:?}"
        );
        assert_eq!(
            &params_of(&tuned.materialize()),
            merged,
            "stage {stage}: base + adapters"
        );
        // The command line writes the same file.
        let by_cli = root.join(format!("s{stage}-adapters-cli.safetensors"));
        let out = std::process::Command::new(crate::estimate::burn_shard_bin())
            .args(["ckpt", "consolidate"])
            .arg(&dir)
            .arg("--out")
            .arg(&by_cli)
            .arg("--trainable-only")
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert!(
            std::fs::read(&by_cli).unwrap() == bytes,
            "stage {stage}: `ckpt consolidate --trainable-only`"
        );
        // Burnpack too; the whole consolidation also holds the base.
        let pack = root.join(format!("s{stage}-adapters.bpk"));
        assert_eq!(consolidate(&dir, &pack, Selection::Trainable).unwrap().entries, 4);
        let whole = consolidate(&dir, root.join(format!("s{stage}.bpk")), Selection::All).unwrap();
        assert!(whole.entries > 4, "stage {stage}: the whole model has its base too");
    }
}

/// Runs `load` on every rank of a 2-rank group at `stage` and returns each rank's error.
fn load_errors(base: &Uneven, dir: &Path, stage: Stage) -> Vec<ShardError> {
    run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
        let device = Device::flex().autodiff();
        let (model, mut optim) = ShardConfig::new(stage)
            .init(base.valid().train().fork(&device), AdamWConfig::new(), comm)
            .unwrap();
        optim.comm().barrier().unwrap();
        optim.load_checkpoint(model, dir).expect_err("the load must fail")
    })
    .unwrap()
}

#[test]
fn bad_checkpoints_are_clear_errors_on_every_rank_and_change_nothing() {
    let device = Device::flex().autodiff();
    let base = Uneven::new(&device, true);
    let root = scratch("checkpoint-tests", "bad");
    let good = root.join("good");
    train(
        &base,
        AdamWConfig::new(),
        DType::F32,
        2,
        Stage::Two,
        0,
        1,
        None,
        Some(&good),
    );
    let copy = |name: &str| {
        let dir = root.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        for f in std::fs::read_dir(&good).unwrap() {
            let f = f.unwrap();
            std::fs::copy(f.path(), dir.join(f.file_name())).unwrap();
        }
        dir
    };
    // A flipped byte in rank 1's file.
    let flipped = copy("flipped");
    let mut bytes = std::fs::read(flipped.join("rank-1.bpk")).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(flipped.join("rank-1.bpk"), &bytes).unwrap();
    // A truncated file, a missing file, a save that did not finish.
    let truncated = copy("truncated");
    let bytes = std::fs::read(truncated.join("rank-0.bpk")).unwrap();
    std::fs::write(truncated.join("rank-0.bpk"), &bytes[..bytes.len() - 7]).unwrap();
    let missing = copy("missing");
    std::fs::remove_file(missing.join("rank-1.bpk")).unwrap();
    let unfinished = copy("unfinished");
    std::fs::remove_file(unfinished.join("COMPLETE")).unwrap();
    let cases: [(&Path, &str); 4] = [
        (&flipped, "rank-1.bpk is corrupt"),
        (&truncated, "rank-0.bpk is corrupt"),
        (&missing, "rank-1.bpk is missing"),
        (&unfinished, "not a complete checkpoint"),
    ];
    // `inspect` reports each file's state without failing.
    let status = |dir: &Path| -> Vec<FileStatus> { inspect(dir).unwrap().files.into_iter().map(|(_, s)| s).collect() };
    assert_eq!(status(&good), [FileStatus::Ok, FileStatus::Ok]);
    assert!(matches!(
        status(&flipped)[..],
        [FileStatus::Ok, FileStatus::Mismatch { .. }]
    ));
    assert_eq!(status(&missing), [FileStatus::Ok, FileStatus::Missing]);
    for (dir, expected) in cases {
        let before: Vec<Vec<u8>> = files_of(dir);
        let start = std::time::Instant::now();
        for err in load_errors(&base, dir, Stage::Two) {
            assert!(err.to_string().contains(expected), "{}: {err}", dir.display());
        }
        assert!(start.elapsed().as_secs() < 10, "errors within seconds");
        assert_eq!(files_of(dir), before, "a failed load changes nothing on disk");
    }
    // A stage-3 checkpoint read at stage 3 on as many ranks: rank 0 never reads rank 1's file.
    // Rank 1 names the file, rank 0 names rank 1.
    let good3 = root.join("good3");
    train(
        &base,
        AdamWConfig::new(),
        DType::F32,
        2,
        Stage::Three,
        0,
        1,
        None,
        Some(&good3),
    );
    let flipped3 = root.join("flipped3");
    std::fs::create_dir_all(&flipped3).unwrap();
    for f in std::fs::read_dir(&good3).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), flipped3.join(f.file_name())).unwrap();
    }
    let mut bytes = std::fs::read(flipped3.join("rank-1.bpk")).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x01;
    std::fs::write(flipped3.join("rank-1.bpk"), &bytes).unwrap();
    let errors = load_errors(&base, &flipped3, Stage::Three);
    assert!(errors[1].to_string().contains("rank-1.bpk is corrupt"), "{}", errors[1]);
    assert!(
        errors[0].to_string().contains("rank(s) [1] failed in load_checkpoint"),
        "{}",
        errors[0]
    );
    // The group is still usable after a failed load: the ranks train on.
    let trained = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
        let device = Device::flex().autodiff();
        let (model, mut optim) = ShardConfig::new(Stage::Two)
            .init(base.valid().train().fork(&device), AdamWConfig::new(), comm)
            .unwrap();
        let rank = optim.comm().rank();
        let model = match optim.load_checkpoint(model.clone(), &flipped) {
            Ok(_) => panic!("a corrupt checkpoint must not load"),
            Err(_) => model,
        };
        let l = loss(&model, 0, rank, 2, &device);
        sharded_step(&mut optim, model, l, LR).1
    })
    .unwrap();
    assert!(trained.iter().all(|l| l.is_finite()));
    // Another model: a parameter of another shape is named, with both shapes.
    #[derive(Module, Debug)]
    struct Other {
        w: Param<Tensor<2>>,
        b: Param<Tensor<1>>,
        s: Param<Tensor<1>>,
        norm: BatchNorm,
    }
    let other = Other {
        w: Param::from_tensor(Tensor::<2>::zeros([7, 4], &device).require_grad()),
        b: Param::from_tensor(Tensor::<1>::zeros([5], &device).require_grad()),
        s: Param::from_tensor(Tensor::<1>::zeros([1], &device).require_grad()),
        norm: BatchNormConfig::new(4).init(&device),
    };
    let errors = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
        let device = Device::flex().autodiff();
        let (model, mut optim) = ShardConfig::new(Stage::Two)
            .init(other.valid().train().fork(&device), AdamWConfig::new(), comm)
            .unwrap();
        optim.comm().barrier().unwrap();
        optim
            .load_checkpoint(model, &good)
            .expect_err("another model must be refused")
    })
    .unwrap();
    for err in errors {
        assert!(matches!(err, ShardError::Checkpoint(_) | ShardError::Comm(_)), "{err}");
        let text = err.to_string();
        assert!(
            text.contains("`w`") && text.contains("[7, 4]") && text.contains("[7, 3]"),
            "{text}"
        );
    }
    // Saving over an existing checkpoint is refused and leaves it intact.
    let before = files_of(&good);
    let refused = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
        let device = Device::flex().autodiff();
        let (model, optim) = ShardConfig::new(Stage::Two)
            .init(base.valid().train().fork(&device), AdamWConfig::new(), comm)
            .unwrap();
        // Every rank is done with init before rank 0's refusal aborts the group.
        optim.comm().barrier().unwrap();
        optim.save_checkpoint(&model, &good, serde_json::Value::Null).err()
    })
    .unwrap();
    for err in refused {
        let err = err.expect("refused");
        assert!(err.to_string().contains("exists already"), "{err}");
    }
    assert_eq!(files_of(&good), before);
}

/// Every file of `dir`, sorted by name, as bytes.
fn files_of(dir: &Path) -> Vec<Vec<u8>> {
    let mut names: Vec<_> = std::fs::read_dir(dir).unwrap().map(|f| f.unwrap().path()).collect();
    names.sort();
    names.iter().map(|p| std::fs::read(p).unwrap()).collect()
}

/// A Burn scheduler's state travels with the checkpoint: 3 + 3 steps under a linear schedule
/// equal 6, bitwise; a checkpoint saved without one hands back none.
#[test]
fn a_learning_rate_scheduler_resumes_with_the_checkpoint() {
    use burn::lr_scheduler::linear::LinearLrSchedulerConfig;
    let device = Device::flex().autodiff();
    let base = Uneven::new(&device, false);
    let root = scratch("checkpoint-tests", "scheduler");
    let run = |first: usize, steps: usize, load: Option<&Path>, save: Option<&Path>| {
        run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
            let rank = comm.rank();
            let device = Device::flex().autodiff();
            let (mut model, mut optim) = ShardConfig::new(Stage::Two)
                .init(base.valid().train().fork(&device), AdamWConfig::new(), comm)
                .unwrap();
            let mut scheduler = LinearLrSchedulerConfig::new(2e-2, 1e-3, 6).init().unwrap();
            if let Some(dir) = load {
                let (loaded, restored) = optim.load_checkpoint(model, dir).unwrap();
                model = loaded;
                scheduler = scheduler.load_record(restored.scheduler.expect("saved with its scheduler"));
            }
            for step in first..first + steps {
                let l = loss(&model, step, rank, 2, &device);
                model = sharded_step(&mut optim, model, l, scheduler.step().base()).0;
            }
            if let Some(dir) = save {
                optim
                    .save_checkpoint(
                        &model,
                        dir,
                        SaveOptions::default().with_scheduler(scheduler.to_record()),
                    )
                    .unwrap();
            }
            params_of(&model)
        })
        .unwrap()
    };
    let whole = run(0, 6, None, None);
    let dir = root.join("step-3");
    run(0, 3, None, Some(&dir));
    assert_eq!(
        run(3, 3, Some(&dir), None),
        whole,
        "the schedule continues where it stopped"
    );
    // Without a scheduler in the checkpoint, the load hands back none.
    let plain = root.join("plain");
    train(
        &base,
        AdamWConfig::new(),
        DType::F32,
        2,
        Stage::Two,
        0,
        1,
        None,
        Some(&plain),
    );
    let restored = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
        let device = Device::flex().autodiff();
        let (model, mut optim) = ShardConfig::new(Stage::Two)
            .init(base.valid().train().fork(&device), AdamWConfig::new(), comm)
            .unwrap();
        optim.load_checkpoint(model, &plain).unwrap().1
    })
    .unwrap();
    for restored in restored {
        assert!(
            restored.scheduler.is_none(),
            "a checkpoint saved without a scheduler hands back none"
        );
    }
}

/// A sharded run's checkpoint continues as plain single-device Burn training: the model from
/// `consolidate`, Burn's own AdamW from its `Selection::OptimizerState`; 3 sharded + 3 single-device
/// steps equal 6 sharded ones.
#[test]
fn single_device_burn_resumes_from_a_consolidated_checkpoint() {
    use burn::optim::GradientsParams;
    let device = Device::flex().autodiff();
    let base = Uneven::new(&device, false);
    let root = scratch("checkpoint-tests", "single-device");
    let cfg = AdamWConfig::new().with_weight_decay(0.1);
    let whole = train(&base, cfg.clone(), DType::F32, 2, Stage::Three, 0, 6, None, None);
    let dir = root.join("step-3");
    train(&base, cfg.clone(), DType::F32, 2, Stage::Three, 0, 3, None, Some(&dir));
    let (model_file, optim_file) = (root.join("model.bpk"), root.join("optim.bpk"));
    consolidate(&dir, &model_file, Selection::All).unwrap();
    let report = consolidate(&dir, &optim_file, Selection::OptimizerState).unwrap();
    assert_eq!(report.entries, 3, "w, b and s have Adam state");
    let mut model = Uneven::new(&device, false).load_file(&model_file);
    let mut optim = cfg.init().load(&optim_file).expect("Burn reads the optimizer record");
    for step in 3..6 {
        let l = (loss(&model, step, 0, 2, &device) + loss(&model, step, 1, 2, &device)).div_scalar(2.0);
        let grads = GradientsParams::from_grads(l.backward(), &model);
        model = optim.step(LR, model, grads);
    }
    let (got, expected) = (params_of(&model), &whole[0].0.params);
    let diff = max_abs_diff(&got, expected);
    assert!(diff < 1e-5, "single-device continuation off the sharded run by {diff}");
    // Without the optimizer state (a fresh AdamW) the continuation differs: the record matters.
    let mut fresh_model = Uneven::new(&device, false).load_file(&model_file);
    let mut fresh = cfg.init();
    for step in 3..6 {
        let l = (loss(&fresh_model, step, 0, 2, &device) + loss(&fresh_model, step, 1, 2, &device)).div_scalar(2.0);
        let grads = GradientsParams::from_grads(l.backward(), &fresh_model);
        fresh_model = fresh.step(LR, fresh_model, grads);
    }
    assert!(max_abs_diff(&params_of(&fresh_model), expected) > 1e-4);
}
