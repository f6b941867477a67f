//! Sharded checkpoints: resume exactly at the same world size and stage, resume at other world
//! sizes and stages, consolidate into a plain Burn record, and refuse bad checkpoints with an
//! error naming the file or the parameter, on every rank.

use std::path::{Path, PathBuf};

use burn::module::{Module, Param};
use burn::nn::{BatchNorm, BatchNormConfig};
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, AdamWConfig, SgdConfig};
use burn::prelude::*;
use burn::tensor::DType;
use burn_shard::checkpoint::{FileStatus, consolidate, consolidate_safetensors, inspect, reshard};
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
const LR: f64 = 1e-2;

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
            let (loaded, p) = optim.load_checkpoint(model, dir).expect("load");
            model = loaded;
            payload = Some(p);
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
                .save_checkpoint(&model, dir, &serde_json::json!({ "step": first + steps }))
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
        let report = consolidate(&dir, &file).expect("consolidate");
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
        consolidate_safetensors(&dir, &tensors).expect("consolidate to safetensors");
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
/// stages 0-3 on 2 ranks: `consolidate_selected(.., Selection::Trainable)` (and the CLI's
/// `ckpt consolidate --trainable-only`, byte for byte) writes its 4 adapter tensors alone, under their module paths, in
/// burnpack and safetensors, holding the trained adapters (at stage 3 too, where
/// `materialize()` merges them into the base); loaded over the frozen base (burn-store,
/// `allow_partial`) they give the fine-tuned model. The whole consolidation holds the base too.
#[test]
fn a_lora_checkpoint_consolidates_its_adapters_alone_at_every_stage() {
    use burn::module::Lora;
    use burn::nn::{Linear, LinearConfig};
    use burn_shard::checkpoint::{Selection, consolidate_safetensors_selected, consolidate_selected};
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
            optim.save_checkpoint(&model, &dir, &serde_json::Value::Null).unwrap();
            (model.adapters(), params_of(&model.valid().materialize()))
        })
        .unwrap();
        let (adapters, merged) = &ranks[0];
        let file = root.join(format!("s{stage}-adapters.safetensors"));
        let report = consolidate_safetensors_selected(&dir, &file, Selection::Trainable).unwrap();
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
        assert_eq!(
            consolidate_selected(&dir, &pack, Selection::Trainable).unwrap().entries,
            4
        );
        let whole = consolidate_selected(&dir, root.join(format!("s{stage}.bpk")), Selection::All).unwrap();
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
        optim.save_checkpoint(&model, &good, &serde_json::Value::Null).err()
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
/// equal 6, bitwise; a checkpoint saved without one says so.
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
                let (loaded, _, record) = optim.load_checkpoint_with_scheduler(model, dir).unwrap();
                model = loaded;
                scheduler = scheduler.load_record(record);
            }
            for step in first..first + steps {
                let l = loss(&model, step, rank, 2, &device);
                model = sharded_step(&mut optim, model, l, scheduler.step().base()).0;
            }
            if let Some(dir) = save {
                optim
                    .save_checkpoint_with_scheduler(&model, dir, &serde_json::Value::Null, scheduler.to_record())
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
    // Without a scheduler in the checkpoint, asking for one is a clear error.
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
    let errors = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
        let device = Device::flex().autodiff();
        let (model, mut optim) = ShardConfig::new(Stage::Two)
            .init(base.valid().train().fork(&device), AdamWConfig::new(), comm)
            .unwrap();
        optim
            .load_checkpoint_with_scheduler(model, &plain)
            .map(|_| ())
            .unwrap_err()
    })
    .unwrap();
    for err in errors {
        assert!(err.to_string().contains("holds no scheduler state"), "{err}");
    }
}

/// A sharded run's checkpoint continues as plain single-device Burn training: the model from
/// `consolidate`, Burn's own AdamW from `consolidate_optimizer`; 3 sharded + 3 single-device
/// steps equal 6 sharded ones.
#[test]
fn single_device_burn_resumes_from_a_consolidated_checkpoint() {
    use burn::optim::GradientsParams;
    use burn_shard::checkpoint::consolidate_optimizer;
    let device = Device::flex().autodiff();
    let base = Uneven::new(&device, false);
    let root = scratch("checkpoint-tests", "single-device");
    let cfg = AdamWConfig::new().with_weight_decay(0.1);
    let whole = train(&base, cfg.clone(), DType::F32, 2, Stage::Three, 0, 6, None, None);
    let dir = root.join("step-3");
    train(&base, cfg.clone(), DType::F32, 2, Stage::Three, 0, 3, None, Some(&dir));
    let (model_file, optim_file) = (root.join("model.bpk"), root.join("optim.bpk"));
    consolidate(&dir, &model_file).unwrap();
    let report = consolidate_optimizer(&dir, &optim_file).unwrap();
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

/// `list` orders checkpoints by the step that ends their names (not as text) and skips
/// incomplete ones; `keep_last` removes the oldest complete ones only.
#[test]
fn keep_last_removes_the_oldest_complete_checkpoints_only() {
    use burn_shard::checkpoint::{keep_last, list};
    let root = scratch("checkpoint-tests", "keep-last");
    for name in ["step-9", "step-100", "step-10", "step-1000000"] {
        std::fs::create_dir_all(root.join(name)).unwrap();
        std::fs::write(root.join(name).join("COMPLETE"), b"").unwrap();
    }
    std::fs::create_dir_all(root.join("step-5000000.partial")).unwrap();
    // A save killed between its COMPLETE marker and the rename: still not a checkpoint.
    std::fs::create_dir_all(root.join("step-6000000.partial")).unwrap();
    std::fs::write(root.join("step-6000000.partial").join("COMPLETE"), b"").unwrap();
    let names = |dirs: Vec<PathBuf>| -> Vec<String> {
        dirs.iter()
            .map(|d| d.file_name().unwrap().to_string_lossy().to_string())
            .collect()
    };
    assert_eq!(
        names(list(&root).unwrap()),
        ["step-9", "step-10", "step-100", "step-1000000"]
    );
    assert_eq!(names(keep_last(&root, 2).unwrap()), ["step-9", "step-10"]);
    assert_eq!(names(list(&root).unwrap()), ["step-100", "step-1000000"]);
    assert!(
        root.join("step-5000000.partial").exists() && root.join("step-6000000.partial").exists(),
        "an unfinished save is not touched, with or without its COMPLETE marker"
    );
}

/// The input (`step-9`, `step-10`, `step-12.partial` holding `COMPLETE`) through every
/// reader that decides "is this a checkpoint": `list`, `newest`, `keep_last`, and a load of the
/// `.partial` directory named directly (`CheckpointMeta::read`, which every load and
/// `inspect` start with).
#[test]
fn a_partial_directory_with_its_marker_is_no_checkpoint_anywhere() {
    use burn_shard::checkpoint::{CheckpointError, CheckpointMeta, keep_last, list, newest};
    let root = scratch("checkpoint-tests", "partial-with-marker");
    for name in ["step-9", "step-10", "step-12.partial"] {
        std::fs::create_dir_all(root.join(name)).unwrap();
        std::fs::write(root.join(name).join("COMPLETE"), b"").unwrap();
        std::fs::write(root.join(name).join("meta.json"), b"{}").unwrap();
    }
    let names = |dirs: Vec<PathBuf>| -> Vec<String> {
        dirs.iter()
            .map(|d| d.file_name().unwrap().to_string_lossy().to_string())
            .collect()
    };
    assert_eq!(names(list(&root).unwrap()), ["step-9", "step-10"]);
    assert_eq!(names(newest(&root).unwrap().into_iter().collect()), ["step-10"]);
    assert_eq!(names(keep_last(&root, 1).unwrap()), ["step-9"]);
    assert!(
        root.join("step-12.partial").join("COMPLETE").exists(),
        "keep_last left it alone"
    );
    let err = CheckpointMeta::read(&root.join("step-12.partial")).unwrap_err();
    assert!(matches!(err, CheckpointError::Incomplete { .. }), "{err}");
    assert!(err.to_string().contains("DIR.partial"), "{err}");

    // No save writes a checkpoint under a name the rule refuses, on any rank.
    let errors = burn_shard_comm::run_ranks(burn_shard_comm::InProcessGroup::new(2).unwrap(), |comm| {
        let device = Device::flex().autodiff();
        let (model, optim) = burn_shard::ShardConfig::new(burn_shard::Stage::One)
            .init(
                crate::common::TinyMlp::new(&device),
                burn::optim::AdamWConfig::new(),
                comm,
            )
            .unwrap();
        optim
            .save_checkpoint(&model, root.join("step-13.partial"), &serde_json::json!({}))
            .unwrap_err()
            .to_string()
    })
    .unwrap();
    for e in errors {
        assert!(e.contains("cannot end in .partial"), "{e}");
    }
}

/// Global batch of the lineage tests: divides by world sizes 1-4.
const TINY_BATCH: usize = 12;

/// One run of `TinyMlp` at `world_size` and `stage`: loads `resume` when given, then for each
/// `(step, dir)` of `saves` takes one step and saves into `dir` with `{"step", "run": tag}`;
/// with `keep`, rank 0 then calls `keep_last` on the directory (as the examples do). Returns
/// rank 0's parameters at the end.
fn tiny_run(
    world_size: usize,
    stage: Stage,
    resume: Option<&Path>,
    saves: &[(usize, PathBuf)],
    tag: &str,
    keep: Option<usize>,
) -> Vec<f32> {
    use crate::common::{IN, OUT, TinyMlp, batch, mse, rank_rows, rows};
    let base = TinyMlp::new(&Device::flex().autodiff());
    let outcomes = run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
        let device = Device::flex().autodiff();
        let (lo, hi) = rank_rows(comm.rank(), world_size, TINY_BATCH);
        let (mut model, mut optim) = ShardConfig::new(stage)
            .init(base.clone().fork(&device), AdamWConfig::new(), comm)
            .expect("init");
        if let Some(dir) = resume {
            model = optim.load_checkpoint(model, dir).expect("resume").0;
        }
        for (step, dir) in saves {
            // Each run its own data (a rollback after a loss spike changes something).
            let (x, y) = batch(
                *step + 1000 * tag.len() + tag.bytes().map(usize::from).sum::<usize>(),
                TINY_BATCH,
            );
            let l = mse(&model, rows(&x, IN, lo, hi, &device), rows(&y, OUT, lo, hi, &device));
            model = sharded_step(&mut optim, model, l, LR).0;
            let payload = serde_json::json!({ "step": step, "run": tag });
            optim.save_checkpoint(&model, dir, &payload).expect("the save succeeds");
            if let (Some(keep), 0) = (keep, optim.comm().rank()) {
                burn_shard::checkpoint::keep_last(dir.parent().unwrap(), keep).expect("keep_last");
            }
        }
        params_of(&model.valid().materialize())
    })
    .expect("no rank panics");
    outcomes.into_iter().next().unwrap()
}

/// Loads `dir` at `world_size` and `stage`: rank 0's parameters and the payload.
fn tiny_load(world_size: usize, stage: Stage, dir: &Path) -> (Vec<f32>, serde_json::Value) {
    use crate::common::TinyMlp;
    let base = TinyMlp::new(&Device::flex().autodiff());
    let outcomes = run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
        let device = Device::flex().autodiff();
        let (model, mut optim) = ShardConfig::new(stage)
            .init(base.clone().fork(&device), AdamWConfig::new(), comm)
            .expect("init");
        let (model, payload) = optim.load_checkpoint(model, dir).expect("load");
        (params_of(&model.valid().materialize()), payload)
    })
    .expect("no rank panics");
    outcomes.into_iter().next().unwrap()
}

fn step_dir(root: &Path, step: usize) -> PathBuf {
    root.join(format!("step-{step:06}"))
}

fn names_of(dirs: &[PathBuf]) -> Vec<String> {
    dirs.iter()
        .map(|d| d.file_name().unwrap().to_string_lossy().into_owned())
        .collect()
}

/// Copies the directory tree `from` to `to`.
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        match entry.file_type().unwrap().is_dir() {
            true => copy_tree(&entry.path(), &to.join(entry.file_name())),
            false => {
                std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
            }
        }
    }
}

/// The `abandoned-*` folders of `root` and the checkpoints in each.
fn abandoned(root: &Path) -> Vec<(PathBuf, Vec<String>)> {
    let mut found: Vec<(PathBuf, Vec<String>)> = std::fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with(burn_shard::checkpoint::ABANDONED_PREFIX)
        })
        .map(|p| {
            let mut inside: Vec<String> = std::fs::read_dir(&p)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            inside.sort();
            (p, inside)
        })
        .collect();
    found.sort();
    found
}

/// Every `*.partial` entry under `root` (recursively).
fn partials_under(root: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(root).unwrap() {
        let path = entry.unwrap().path();
        if path.to_string_lossy().ends_with(".partial") {
            found.push(path.clone());
        }
        if path.is_dir() {
            found.extend(partials_under(&path));
        }
    }
    found
}

/// Issue #30, 1: a rollback into the same save directory. Run A saved steps 4, 8 and 12; run B
/// resumes from step 4 and saves every 4 steps (8 and 12: A's names) or every 3 (6, 9, 12),
/// with `keep_last(2)` after each save, at every world size 1-4 and stage 0-3 (the save path
/// agrees on the move). B's saves succeed; A's steps 8 and 12 are moved into one
/// `abandoned-<run>/` folder, intact; `list` (what `--resume DIR` takes) and `keep_last` follow
/// B's lineage: B's newest loads with B's values and payload; the metadata names the parent.
#[test]
fn a_rollback_sets_the_abandoned_checkpoints_aside_at_every_world_size_and_stage() {
    use burn_shard::checkpoint::{CheckpointMeta, list};
    for world_size in 1..=4 {
        for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
            let case = format!("world size {world_size}, stage {stage}");
            let first = scratch("checkpoint-tests", &format!("rollback-{world_size}-{stage}"));
            let original = first.join("run-a");
            let saves_a: Vec<(usize, PathBuf)> = [4, 8, 12].map(|s| (s, step_dir(&original, s))).to_vec();
            let a_params = tiny_run(world_size, stage, None, &saves_a, "A", Some(3));
            let run_a = |root: &Path, step: usize| {
                CheckpointMeta::read(&step_dir(root, step))
                    .unwrap()
                    .lineage
                    .unwrap()
                    .run
            };
            let a_id = run_a(&original, 8);
            for (every, b_steps) in [(4, vec![8, 12]), (3, vec![6, 9, 12])] {
                let root = first.join(format!("every-{every}"));
                copy_tree(&original, &root);
                let saves_b: Vec<(usize, PathBuf)> = b_steps.iter().map(|&s| (s, step_dir(&root, s))).collect();
                let b_params = tiny_run(world_size, stage, Some(&step_dir(&root, 4)), &saves_b, "B", Some(2));
                let case = format!("{case}, every {every}");
                // B's lineage only, newest 2 kept.
                let listed = list(&root).unwrap();
                let expected: Vec<String> = b_steps[b_steps.len() - 2..]
                    .iter()
                    .map(|s| format!("step-{s:06}"))
                    .collect();
                assert_eq!(names_of(&listed), expected, "{case}: list");
                for dir in &listed {
                    let lineage = CheckpointMeta::read(dir).unwrap().lineage.unwrap();
                    assert_eq!(lineage.parent.as_deref(), Some("step-000004"), "{case}");
                    assert_ne!(lineage.run, a_id, "{case}: a new run");
                    assert_eq!(lineage.branches.len(), 1, "{case}");
                    assert_eq!(lineage.branches[0].run.as_deref(), Some(a_id.as_str()), "{case}");
                }
                // `--resume DIR` takes B's step 12, with B's values.
                let newest = listed.last().unwrap();
                assert_eq!(newest, &step_dir(&root, 12), "{case}");
                let (loaded, payload) = tiny_load(world_size, stage, newest);
                assert_eq!(payload["run"], "B", "{case}: --resume DIR takes the new run's newest");
                assert_eq!(loaded, b_params, "{case}: its values are B's last");
                assert_ne!(b_params, a_params, "{case}: the runs differ");
                // A's later checkpoints: moved, intact, loadable.
                let aside = abandoned(&root);
                assert_eq!(aside.len(), 1, "{case}: one abandoned folder: {aside:?}");
                assert_eq!(aside[0].1, ["step-000008", "step-000012"], "{case}");
                assert!(inspect(step_dir(&aside[0].0, 12)).unwrap().is_intact(), "{case}");
                assert_eq!(run_a(&aside[0].0, 12), a_id, "{case}");
                let (old, old_payload) = tiny_load(world_size, stage, &step_dir(&aside[0].0, 12));
                assert_eq!(
                    (old, &old_payload["run"]),
                    (a_params.clone(), &serde_json::json!("A")),
                    "{case}"
                );
                assert!(partials_under(&root).is_empty(), "{case}");
            }
        }
    }
}

/// Old checkpoints (no lineage in meta.json) still load, and a rollback among them sets the
/// later ones aside too. A fresh run moves nothing; `list` and `keep_last` then follow the
/// newest checkpoint's lineage and never remove another lineage's.
#[test]
fn checkpoints_without_a_lineage_load_and_roll_back_and_keep_last_keeps_other_lineages() {
    use burn_shard::checkpoint::{keep_last, list};
    let root = scratch("checkpoint-tests", "legacy");
    let saves: Vec<(usize, PathBuf)> = [4, 8, 12].map(|s| (s, step_dir(&root, s))).to_vec();
    tiny_run(2, Stage::Two, None, &saves, "A", None);
    // As written before lineages existed: no `lineage` key (meta.json is not in the digests).
    for (_, dir) in &saves {
        let path = dir.join("meta.json");
        let mut meta: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        meta.as_object_mut()
            .unwrap()
            .remove("lineage")
            .expect("a lineage was written");
        std::fs::write(&path, serde_json::to_string_pretty(&meta).unwrap()).unwrap();
    }
    assert_eq!(tiny_load(2, Stage::Two, &step_dir(&root, 12)).1["step"], 12);
    assert_eq!(
        names_of(&list(&root).unwrap()),
        ["step-000004", "step-000008", "step-000012"]
    );
    tiny_run(
        2,
        Stage::Two,
        Some(&step_dir(&root, 4)),
        &[(6, step_dir(&root, 6))],
        "B",
        None,
    );
    assert_eq!(names_of(&list(&root).unwrap()), ["step-000004", "step-000006"]);
    assert_eq!(abandoned(&root)[0].1, ["step-000008", "step-000012"]);

    // A fresh run saving into a directory of another run's checkpoints moves nothing; its
    // checkpoint sorts first, so the newest lineage is the other run's: keep_last never
    // removes the fresh run's checkpoint.
    let mixed = scratch("checkpoint-tests", "other-lineage");
    let saves: Vec<(usize, PathBuf)> = [8, 12].map(|s| (s, step_dir(&mixed, s))).to_vec();
    tiny_run(1, Stage::Zero, None, &saves, "A", None);
    tiny_run(1, Stage::Zero, None, &[(2, step_dir(&mixed, 2))], "C", None);
    assert_eq!(names_of(&list(&mixed).unwrap()), ["step-000008", "step-000012"]);
    assert_eq!(names_of(&keep_last(&mixed, 1).unwrap()), ["step-000008"]);
    assert!(
        step_dir(&mixed, 2).join("COMPLETE").exists(),
        "another lineage is never removed"
    );
    assert!(abandoned(&mixed).is_empty());
}

/// Issue #30, 2: a save that fails on one rank (a file where its directory should be, or a
/// model that is not the one `init` returned) fails on every rank and leaves no `*.partial`
/// behind, at every world size and stage; the group then saves there fine.
#[test]
fn a_failed_save_leaves_no_partial_directory_at_any_world_size() {
    use crate::common::TinyMlp;
    let base = TinyMlp::new(&Device::flex().autodiff());
    for world_size in 1..=4 {
        for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
            let root = scratch("checkpoint-tests", &format!("failed-save-{world_size}-{stage}"));
            let blocker = root.join("blocker");
            std::fs::write(&blocker, b"a file where a directory should be").unwrap();
            let target = step_dir(&root, 1);
            let last = world_size - 1;
            let outcomes = run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
                let rank = comm.rank();
                let device = Device::flex().autodiff();
                let (model, optim) = ShardConfig::new(stage)
                    .init(base.clone().fork(&device), AdamWConfig::new(), comm)
                    .expect("init");
                let payload = serde_json::Value::Null;
                // The last rank cannot write its file: its directory is a file.
                let dir = match rank == last {
                    true => blocker.join("step-000001"),
                    false => target.clone(),
                };
                let io = optim
                    .save_checkpoint(&model, &dir, &payload)
                    .expect_err("io")
                    .to_string();
                // Rank 0 (which writes at every stage) saves a model that is not the one init
                // returned.
                let stranger = TinyMlp::new(&device);
                let saved = match rank == 0 {
                    true => optim.save_checkpoint(&stranger, &target, &payload),
                    false => optim.save_checkpoint(&model, &target, &payload),
                };
                let unknown = saved.expect_err("unknown model").to_string();
                let leftovers = partials_under(&root);
                // The group saves fine afterwards.
                optim
                    .save_checkpoint(&model, &target, &payload)
                    .expect("the save succeeds");
                (io, unknown, leftovers)
            })
            .expect("no rank panics");
            for (rank, (io, unknown, leftovers)) in outcomes.into_iter().enumerate() {
                let case = format!("world size {world_size}, stage {stage}, rank {rank}");
                match rank == last {
                    true => assert!(io.contains("blocker"), "{case}: {io}"),
                    false => assert!(io.contains(&format!("rank(s) [{last}] failed")), "{case}: {io}"),
                }
                match rank {
                    0 => assert!(unknown.contains("l1") || unknown.contains("scale"), "{case}: {unknown}"),
                    _ => assert!(unknown.contains("rank(s) [0] failed"), "{case}: {unknown}"),
                }
                assert!(leftovers.is_empty(), "{case}: {leftovers:?}");
            }
            assert!(inspect(&target).unwrap().is_intact());
            assert!(partials_under(&root).is_empty());
        }
    }
}

/// A `*.partial` left by a crashed process (a save's files only) is removed by the next save
/// into its directory; a `*.partial` holding anything else is left alone.
#[test]
fn a_save_removes_what_a_crashed_save_left() {
    let root = scratch("checkpoint-tests", "crashed");
    let crashed = root.join("step-000002.partial");
    std::fs::create_dir_all(&crashed).unwrap();
    for (name, bytes) in [
        ("rank-0.bpk", &b"half a file"[..]),
        ("rank-0.sha256", b"00 11"),
        ("rank-1.bpk.4242-0.tmp", b"half"),
        ("meta.tmp", b"{"),
    ] {
        std::fs::write(crashed.join(name), bytes).unwrap();
    }
    let empty = root.join("step-000003.partial");
    std::fs::create_dir_all(&empty).unwrap();
    let foreign = root.join("notes.partial");
    std::fs::create_dir_all(foreign.join("drafts")).unwrap();
    tiny_run(2, Stage::Three, None, &[(4, step_dir(&root, 4))], "A", None);
    assert!(
        !crashed.exists() && !empty.exists(),
        "the crashed saves' leftovers are removed"
    );
    assert!(
        foreign.join("drafts").exists(),
        "a directory that is not a save's is left alone"
    );
    assert!(inspect(step_dir(&root, 4)).unwrap().is_intact());
}
