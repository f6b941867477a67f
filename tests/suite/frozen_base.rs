//! Checkpoints that refer to their frozen base instead of holding it
//! (`FrozenEntries::Fingerprinted`): a head-only fine-tune on pretrained weights and a LoRA
//! fine-tune, at stages 0-3, resume bitwise on the same base, within 1e-6 at another world size
//! and stage, refuse another base on every rank naming it, and the offline tools (inspect,
//! consolidate, reshard) handle the entries they do not hold.

use std::path::Path;

use burn::module::{Lora, Module};
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig};
use burn::optim::AdamWConfig;
use burn::prelude::*;
use burn_shard::checkpoint::{CheckpointMeta, Selection, consolidate, inspect, reshard};
use burn_shard::{FrozenEntries, Pretrained, ShardConfig, ShardError, Stage};
use burn_shard_comm::{Collective, InProcessGroup, run_ranks};
use burn_store::ModuleSnapshot;

use crate::common::{Rng, params_of, scratch, sharded_step};

#[derive(Module, Debug)]
struct Net {
    l1: Linear,
    norm: BatchNorm,
    l2: Linear,
}

impl Net {
    /// Lazy, as `burn::nn` builds it.
    fn new(device: &Device) -> Self {
        Self {
            l1: LinearConfig::new(5, 8).init(device),
            norm: BatchNormConfig::new(8).init(device),
            l2: LinearConfig::new(8, 3).init(device),
        }
    }

    /// The same batch on every rank: the averaged gradient is the same at every world size.
    fn loss(&self, step: usize, device: &Device) -> Tensor<1> {
        let x = Tensor::<2>::from_data(TensorData::new(Rng::new(90 + step as u64).vec(6 * 5), [6, 5]), device);
        let h = self.norm.forward(self.l1.forward(x)).tanh();
        self.l2.forward(h).sub_scalar(0.5).powi_scalar(2).mean()
    }
}

/// The two fine-tunes: which entries are frozen and how the base arrives.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Tune {
    /// `l1` frozen, the rest trained; the base read by `init_pretrained` from a safetensors file.
    HeadOnly,
    /// Burn's `Lora` on every `Linear` (adapters train; every other parameter is frozen);
    /// the base handed to `init` whole.
    Lora,
}

/// The pretrained base, as a whole model with LoRA applied (its random adapters drawn once) and
/// as a safetensors file.
struct Base {
    lora: Net,
    file: std::path::PathBuf,
}

impl Base {
    /// A base of its own: noise added to the initializers' values (each call draws its own).
    fn new(root: &Path, name: &str) -> Self {
        let device = Device::flex().autodiff();
        let model = crate::pretrained::perturbed(Net::new(&device));
        let file = root.join(format!("{name}.safetensors"));
        let _ = std::fs::remove_file(&file);
        model
            .clone()
            .save_into(&mut burn_store::SafetensorsStore::from_file(&file))
            .unwrap();
        Self {
            lora: model.apply_lora(Lora::new(2, 4.0)),
            file,
        }
    }
}

/// A rank's model and optimizer for `tune` on `base`, before any checkpoint is loaded.
fn start(
    tune: Tune,
    base: &Base,
    stage: Stage,
    frozen: FrozenEntries,
    comm: impl Collective + 'static,
) -> Result<(Net, burn_shard::ShardedOptimizer<impl burn_shard::MasterWeightStep>), ShardError> {
    let device = Device::flex().autodiff();
    let config = ShardConfig::new(stage).with_frozen_entries(frozen);
    match tune {
        Tune::HeadOnly => {
            let mut model = Net::new(&device);
            model.l1 = model.l1.no_grad();
            config.init_pretrained(model, Pretrained::safetensors(&base.file), AdamWConfig::new(), comm)
        }
        // `valid().train()`: BatchNorm's running statistics of its own (a clone shares them).
        Tune::Lora => config.init(base.lora.valid().train().fork(&device), AdamWConfig::new(), comm),
    }
}

/// Trains steps `first..first + steps` on `world_size` ranks, loading `load` first and saving
/// into `save` at the end; returns rank 0's model, materialized (LoRA merged), as `f32`s.
#[allow(clippy::too_many_arguments)]
fn run(
    tune: Tune,
    base: &Base,
    world_size: usize,
    stage: Stage,
    first: usize,
    steps: usize,
    load: Option<&Path>,
    save: Option<&Path>,
) -> Vec<f32> {
    let ranks = run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
        let device = Device::flex().autodiff();
        let (mut model, mut optim) = start(tune, base, stage, FrozenEntries::Fingerprinted, comm).expect("init");
        if let Some(dir) = load {
            model = optim.load_checkpoint(model, dir).expect("load").0;
        }
        for step in first..first + steps {
            let loss = model.loss(step, &device);
            model = sharded_step(&mut optim, model, loss, 1e-2).0;
        }
        if let Some(dir) = save {
            optim
                .save_checkpoint(&model, dir, serde_json::json!({ "step": first + steps }))
                .expect("save");
        }
        params_of(&model.valid().materialize())
    })
    .unwrap();
    ranks[0].clone()
}

/// Loads `dir` on 2 ranks into `tune` on `base` and returns each rank's error.
fn load_errors(tune: Tune, base: &Base, stage: Stage, dir: &Path, unfreeze: bool) -> Vec<String> {
    run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
        let device = Device::flex().autodiff();
        let outcome = match unfreeze {
            false => {
                let (model, mut optim) = start(tune, base, stage, FrozenEntries::Fingerprinted, comm).unwrap();
                optim.load_checkpoint(model, dir).map(drop)
            }
            // The head-only model with `l1` trainable: its checkpoint holds no state for it.
            true => {
                let (model, mut optim) = ShardConfig::new(stage)
                    .init_pretrained(
                        Net::new(&device),
                        Pretrained::safetensors(&base.file),
                        AdamWConfig::new(),
                        comm,
                    )
                    .unwrap();
                optim.load_checkpoint(model, dir).map(drop)
            }
        };
        match outcome {
            Ok(()) => "loaded".to_string(),
            Err(e) => e.to_string(),
        }
    })
    .unwrap()
}

/// The largest difference between `a` and `b` relative to `b`'s largest magnitude (the
/// checkpoint suite's measure for resumes at another world size).
fn max_rel_diff(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
    crate::common::max_abs_diff(a, b) / scale
}

/// For both fine-tunes at stages 0-3 on 2 ranks: 2 steps saved with
/// `FrozenEntries::Fingerprinted` hold the trained entries and the buffers but none of the frozen
/// base (format 2, the base named by its file); resumed on the same base, 2 + 2 steps equal 4
/// bitwise, and at 3 ranks and the next stage within 1e-6; resumed on another base (every value
/// drawn) every rank fails naming the base and the entries; a model in which the
/// frozen layer is trainable is refused; `consolidate` of the whole model names the fix and
/// `--trainable-only` works; a resharded copy keeps the fingerprints and resumes.
#[test]
fn a_checkpoint_that_refers_to_its_frozen_base_resumes_on_it_and_refuses_another() {
    let root = scratch("frozen-base", "fingerprinted");
    let base = Base::new(&root, "base");
    let other = Base::new(&root, "other");
    for tune in [Tune::HeadOnly, Tune::Lora] {
        for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
            let at = format!("{tune:?} stage {stage}");
            let dir = root.join(format!("{tune:?}-{stage}"));
            let whole = run(tune, &base, 2, stage, 0, 4, None, None);
            run(tune, &base, 2, stage, 0, 2, None, Some(&dir));

            // What the checkpoint holds.
            let meta = CheckpointMeta::read(&dir).unwrap();
            assert_eq!(meta.format_version, 2, "{at}");
            let base_meta = meta.base.as_ref().expect("the base is recorded");
            let origin = base_meta.origin.as_deref();
            match tune {
                Tune::HeadOnly => assert_eq!(origin, Some(base.file.display().to_string().as_str()), "{at}"),
                Tune::Lora => assert_eq!(origin, None, "{at}: `init` has no file to name"),
            }
            for entry in &meta.entries {
                let frozen = entry.kind != "buffer" && !entry.trainable;
                assert_eq!(entry.fingerprint.is_some(), frozen, "{at}: `{}`", entry.path);
                assert_eq!(entry.pieces.is_empty(), frozen, "{at}: `{}`", entry.path);
            }
            let frozen: Vec<&str> = meta
                .entries
                .iter()
                .filter(|e| !e.is_held())
                .map(|e| e.path.as_str())
                .collect();
            let expected_frozen = match tune {
                Tune::HeadOnly => vec!["l1.weight", "l1.bias"],
                // Burn's `Lora` freezes every tensor parameter but its adapters.
                Tune::Lora => vec![
                    "l1.weight",
                    "l1.bias",
                    "norm.gamma",
                    "norm.beta",
                    "l2.weight",
                    "l2.bias",
                ],
            };
            let mut sorted = frozen.clone();
            sorted.sort();
            let mut expected_sorted = expected_frozen.clone();
            expected_sorted.sort();
            assert_eq!(sorted, expected_sorted, "{at}");
            assert!(
                meta.entries.iter().any(|e| e.kind == "buffer" && e.is_held()),
                "{at}: BatchNorm's statistics are saved"
            );
            let inspection = inspect(&dir).unwrap();
            assert!(inspection.is_intact(), "{at}");

            // Resumed on the same base: bitwise at the same world size and stage.
            let resumed = run(tune, &base, 2, stage, 2, 2, Some(&dir), None);
            assert!(whole == resumed, "{at}: 2 + 2 steps must equal 4, bitwise");
            // At 3 ranks and the next stage: the fingerprints are summed over other pieces.
            let next = [Stage::One, Stage::Two, Stage::Three, Stage::Zero][stage.number() as usize];
            let elsewhere = run(tune, &base, 3, next, 2, 2, Some(&dir), None);
            let diff = max_rel_diff(&elsewhere, &whole);
            assert!(diff <= 1e-6, "{at}: resumed at 3 ranks, stage {next}: {diff}");

            // Another base: every rank names the checkpoint's base and the entries.
            for error in load_errors(tune, &other, stage, &dir, false) {
                assert!(
                    error.contains("was trained on the frozen base")
                        && error.contains(&format!("`{}`", expected_frozen[0]))
                        && error.contains(&base_meta.fingerprint[..16]),
                    "{at}: {error}"
                );
                if tune == Tune::HeadOnly {
                    assert!(error.contains(&base.file.display().to_string()), "{at}: {error}");
                }
            }
            if tune == Tune::HeadOnly {
                for error in load_errors(tune, &base, stage, &dir, true) {
                    assert!(
                        error.contains("`l1.weight` was frozen") && error.contains("trainable here"),
                        "{at}: {error}"
                    );
                }
            }

            // Offline tools.
            let out = root.join(format!("{tune:?}-{stage}.bpk"));
            let refused = consolidate(&dir, &out, Selection::All).unwrap_err().to_string();
            assert!(
                refused.contains("does not hold its frozen base") && refused.contains("--trainable-only"),
                "{at}: {refused}"
            );
            assert!(!out.exists(), "{at}: nothing written");
            let trained = consolidate(&dir, &out, Selection::Trainable).unwrap();
            assert_eq!(
                trained.entries,
                meta.entries.iter().filter(|e| e.trainable).count(),
                "{at}"
            );
            let resharded = root.join(format!("{tune:?}-{stage}-x3"));
            let copy = reshard(&dir, 3, &resharded).unwrap();
            assert_eq!(copy.base, meta.base, "{at}");
            let from_copy = run(tune, &base, 3, stage, 2, 2, Some(&resharded), None);
            let diff = max_rel_diff(&from_copy, &whole);
            assert!(diff <= 1e-6, "{at}: resumed from the resharded copy: {diff}");
        }
    }
}

/// The point of it: a fingerprinted checkpoint of a frozen base is the size of what trains.
#[test]
fn a_fingerprinted_checkpoint_is_the_size_of_what_trains() {
    let root = scratch("frozen-base", "sizes");
    let base = Base::new(&root, "base");
    let mut sizes = Vec::new();
    for frozen in [FrozenEntries::Saved, FrozenEntries::Fingerprinted] {
        let dir = root.join(format!("{frozen:?}"));
        run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
            let device = Device::flex().autodiff();
            let (model, mut optim) = start(Tune::HeadOnly, &base, Stage::Three, frozen, comm).unwrap();
            let loss = model.loss(0, &device);
            let model = sharded_step(&mut optim, model, loss, 1e-2).0;
            optim.save_checkpoint(&model, &dir, serde_json::Value::Null).unwrap();
        })
        .unwrap();
        let meta = CheckpointMeta::read(&dir).unwrap();
        let held: Vec<String> = meta
            .entries
            .iter()
            .filter(|e| e.is_held())
            .map(|e| e.path.clone())
            .collect();
        sizes.push((inspect(&dir).unwrap().bytes_per_rank().iter().sum::<u64>(), held));
    }
    let (saved, fingerprinted) = (&sizes[0], &sizes[1]);
    assert!(saved.1.iter().any(|n| n == "l1.weight"), "{:?}", saved.1);
    assert!(
        !fingerprinted.1.iter().any(|n| n.starts_with("l1.")),
        "the frozen layer is not written: {:?}",
        fingerprinted.1
    );
    // l1 is 8 x 5 + 8 f32s = 192 bytes of the model's values.
    assert!(
        saved.0 >= fingerprinted.0 + 192,
        "saved {} bytes, fingerprinted {}",
        saved.0,
        fingerprinted.0
    );
}

/// docs/checkpoints.md's LoRA flow as written: LoRA applied to a lazy model, then
/// `init_pretrained` from the base's file, which holds no adapters. The adapters are initialised
/// by the model (rank 0's, as `init` does; PEFT's behaviour) with no `allow_missing`, at stages
/// 0-3 on 1-3 ranks: every rank's model is the base bitwise (LoRA's `b` starts at zero, so the
/// merged weight is the base), its adapters are the same on every rank, and training moves them.
#[test]
fn lora_on_a_lazy_model_loads_its_base_and_initialises_its_adapters() {
    let root = scratch("frozen-base", "lora-pretrained");
    let base = Base::new(&root, "base");
    let expected = crate::sharded_init::entries_of(&base.lora.clone().materialize());
    for world_size in 1..=3 {
        for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
            let at = format!("stage {stage}, world size {world_size}");
            let ranks = run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
                let device = Device::flex().autodiff();
                let model = Net::new(&device).apply_lora(Lora::new(2, 4.0));
                let (model, mut optim) = ShardConfig::new(stage)
                    .init_pretrained(model, Pretrained::safetensors(&base.file), AdamWConfig::new(), comm)
                    .unwrap_or_else(|e| panic!("{at}: {e}"));
                let loaded = crate::sharded_init::entries_of(&model.clone().materialize());
                let (model, _) = sharded_step(&mut optim, model.clone(), model.loss(0, &device), 1e-2);
                (loaded, params_of(&model.materialize()))
            })
            .unwrap();
            for (rank, (loaded, trained)) in ranks.iter().enumerate() {
                crate::sharded_init::assert_bitwise(&format!("{at}, rank {rank}"), loaded, &expected);
                assert_eq!(trained, &ranks[0].1, "{at}, rank {rank}: the ranks' adapters differ");
            }
            assert_ne!(
                ranks[0].1,
                params_of(&base.lora.clone().materialize()),
                "{at}: a step moves the adapters"
            );
        }
    }
}
