//! `ShardConfig::init_pretrained`: pretrained weights (safetensors, burnpack) loaded straight
//! into each rank's shards of a lazy model, against burn-store loading the same file into a
//! whole single-device model.

use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn_shard::{Pretrained, ShardConfig, Stage};
use burn_shard_comm::{Collective, InProcessGroup, run_ranks};
use burn_store::{BurnToPyTorchAdapter, BurnpackStore, ModuleSnapshot, PyTorchToBurnAdapter, SafetensorsStore};

use crate::common::{max_abs_diff, scratch};
use crate::modules::{Layer, MODULES, adamw, reference, train_rank, trainable_of};
use crate::nvme_offload::run_child;
use crate::sharded_init::{Mapped, assert_bitwise, bf16_device, entries_of, run_by_parent, status_bytes};

const STAGES: [Stage; 4] = [Stage::Zero, Stage::One, Stage::Two, Stage::Three];

/// How a sweep case opens its file.
type Open = fn(&Files) -> Pretrained;

/// `module` with every float entry (parameters and running-state buffers) moved by noise
/// uniform in [-0.5, 0.5): weights that differ from any initializer's (norms' ones and zeros,
/// BatchNorm's fresh statistics), so that an entry left unloaded shows.
pub(crate) fn perturbed<M: Module>(module: M) -> M {
    struct Noise;
    impl burn::module::ModuleMapper for Noise {
        fn map_float<const D: usize>(
            &mut self,
            param: burn::module::Param<Tensor<D>>,
        ) -> burn::module::Param<Tensor<D>> {
            param.map(|t| {
                let noise = t.random_like(burn::tensor::Distribution::Uniform(-0.5, 0.5));
                t + noise
            })
        }
    }
    module.map(&mut Noise)
}

/// The two files of a module's weights: safetensors in PyTorch's layout and names under a
/// `model.` prefix (burn-store's `BurnToPyTorchAdapter` and key remapping), and burnpack as
/// burn-store writes a Burn record.
struct Files {
    safetensors: PathBuf,
    burnpack: PathBuf,
}

impl Files {
    fn write<M: Module>(module: &M, dir: &Path) -> Self {
        let files = Self {
            safetensors: dir.join("model.safetensors"),
            burnpack: dir.join("model.bpk"),
        };
        module
            .save_into(
                &mut SafetensorsStore::from_file(&files.safetensors)
                    .with_to_adapter(BurnToPyTorchAdapter)
                    .with_key_remapping("^", "model."),
            )
            .unwrap();
        module
            .save_into(&mut BurnpackStore::from_file(&files.burnpack))
            .unwrap();
        files
    }

    /// The safetensors file as `init_pretrained` takes it: the prefix dropped, PyTorch's layout
    /// turned into Burn's.
    fn safetensors(&self) -> Pretrained {
        Pretrained::safetensors(&self.safetensors)
            .with_key_remapping(r"^model\.", "")
            .with_from_adapter(PyTorchToBurnAdapter)
    }

    /// The same through burn-store into a whole model.
    fn load_whole<M: Module>(&self, mut module: M) -> M {
        let mut store = SafetensorsStore::from_file(&self.safetensors)
            .with_from_adapter(PyTorchToBurnAdapter)
            .with_key_remapping(r"^model\.", "");
        let result = module.load_from(&mut store).unwrap();
        assert!(
            result.errors.is_empty() && result.missing.is_empty() && result.unused.is_empty(),
            "burn-store: {result:?}"
        );
        module
    }
}

/// Every module of the sweep (its weights written by burn-store from one lazy copy) at stages
/// 0-3 on 1-4 ranks as threads, each rank with its own fresh lazy copy loaded by
/// `init_pretrained`: from the safetensors file (PyTorch layout, renamed: the adapter's and the
/// remapping's paths) at every world size, from the burnpack record (byte ranges at stage 3) at
/// world sizes 1 and 3. Every rank's entries after `init` (gathered at stage 3) equal bitwise
/// those burn-store's `load_from` puts in a whole model from the same file (which equal the
/// saved ones), and three AdamW steps end within 1e-4 of single-device training of that model.
#[test]
fn pretrained_weights_load_into_shards_as_burn_store_loads_them_into_a_whole_model() {
    let device = Device::flex().autodiff();
    for name in MODULES {
        let saved = perturbed(Layer::new(name, &device));
        let files = Files::write(&saved, &scratch("pretrained", name));
        let whole = files.load_whole(Layer::new(name, &device));
        let expected = entries_of(&whole);
        assert_bitwise(&format!("{name}: burn-store's load"), &expected, &entries_of(&saved));
        for world_size in 1..=4 {
            let (trained, _) = reference(&whole, world_size);
            for stage in STAGES {
                let formats: &[(&str, Open)] = match world_size {
                    1 | 3 => &[
                        ("safetensors", Files::safetensors),
                        ("burnpack", |f| Pretrained::burnpack(&f.burnpack)),
                    ],
                    _ => &[("safetensors", Files::safetensors)],
                };
                for (format, pretrained) in formats {
                    let at = format!("{name} from {format}, stage {stage}, world size {world_size}");
                    let ranks = load_and_train(&at, name, &device, (stage, world_size), || pretrained(&files));
                    for (rank, (loaded, after)) in ranks.iter().enumerate() {
                        assert_bitwise(&format!("{at}, rank {rank}"), loaded, &expected);
                        let diff = max_abs_diff(after, &trained);
                        assert!(diff < 1e-4, "{at}, rank {rank}: trained parameters differ by {diff}");
                    }
                }
            }
        }
    }
}

/// On `world_size` ranks as threads: module `name` built lazily on `device`, loaded by
/// `init_pretrained` at `stage` from `pretrained()` (one per rank), then trained three steps.
/// Each rank's entries after `init` (gathered at stage 3) and trainable parameters after.
fn load_and_train(
    at: &str,
    name: &str,
    device: &Device,
    (stage, world_size): (Stage, usize),
    pretrained: impl Fn() -> Pretrained + Sync,
) -> Vec<(Vec<Vec<f32>>, Vec<f32>)> {
    run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
        let rank = comm.rank();
        let (model, mut optim) = ShardConfig::new(stage)
            .init_pretrained(Layer::new(name, device), pretrained(), adamw(), comm)
            .unwrap_or_else(|e| panic!("{at}: {e}"));
        let loaded = entries_of(&model.clone().materialize());
        let model = train_rank(model, &mut optim, rank, world_size, device);
        (loaded, trainable_of(&model.materialize()))
    })
    .unwrap_or_else(|e| panic!("{at}: a rank failed: {e:?}"))
}

/// The sweep in `bf16` with `f32` masters: a device whose default float dtype is `bf16`
/// (configured before its first tensor, so in a process of its own) builds every module lazily
/// in `bf16`; its weights are written as `f32` safetensors in PyTorch's layout and loaded by
/// `init_pretrained` into `bf16` models at stages 0-3 on 1-4 ranks (each tensor cast to the
/// parameter's dtype): every rank's entries are bitwise the saved `bf16` values (which
/// burn-store's load, cast back to `bf16`, also gives), and three steps leave every rank with
/// bitwise the same parameters.
#[test]
fn pretrained_f32_weights_load_into_a_bf16_model_cast_to_its_dtype() {
    run_child(
        "true",
        "pretrained::bf16_child",
        "BURN_SHARD_PRETRAINED_BF16",
        Path::new("."),
    );
}

#[test]
#[ignore = "run by pretrained_f32_weights_load_into_a_bf16_model_cast_to_its_dtype in a process of its own"]
fn bf16_child() {
    use burn::tensor::DType;
    use burn_store::{FloatCastAdapter, ModuleAdapter};
    run_by_parent("BURN_SHARD_PRETRAINED_BF16");
    let device = bf16_device();
    for name in MODULES {
        let saved = perturbed(Layer::new(name, &device));
        let expected = entries_of(&saved);
        let file = scratch("pretrained-bf16", name).join("model.safetensors");
        saved
            .save_into(
                &mut SafetensorsStore::from_file(&file)
                    .with_to_adapter(BurnToPyTorchAdapter.chain(FloatCastAdapter::to(DType::F32))),
            )
            .unwrap();
        let mut whole = Layer::new(name, &device);
        whole
            .load_from(
                &mut SafetensorsStore::from_file(&file)
                    .with_from_adapter(PyTorchToBurnAdapter.chain(FloatCastAdapter::to(DType::BF16))),
            )
            .unwrap();
        assert_bitwise(&format!("{name}: burn-store's load"), &entries_of(&whole), &expected);
        for world_size in 1..=4 {
            for stage in STAGES {
                let at = format!("{name} in bf16 from f32, stage {stage}, world size {world_size}");
                let ranks = load_and_train(&at, name, &device, (stage, world_size), || {
                    Pretrained::safetensors(&file).with_from_adapter(PyTorchToBurnAdapter)
                });
                for (rank, (loaded, after)) in ranks.iter().enumerate() {
                    assert_bitwise(&format!("{at}, rank {rank}"), loaded, &expected);
                    let same = after.iter().zip(&ranks[0].1).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{at}, rank {rank}: trained parameters differ from rank 0's");
                }
            }
        }
    }
}

/// Entries whose record is not their value: `Linear` layers with `LinearLayout::Col` (a load
/// mapper transposes the stored weight; a square and a non-square one) and a frozen layer,
/// from a burnpack record, at stages 0-3 on 1-4 ranks, built lazily and built eagerly (every
/// parameter initialised before `init_pretrained`, to other values than the file's): every
/// rank's entries after `init` equal bitwise burn-store's load of the record into a whole
/// model.
#[test]
fn pretrained_weights_of_col_layout_frozen_and_eager_layers_load_as_into_a_whole_model() {
    let device = Device::flex().autodiff();
    let files = Files::write(&perturbed(Mapped::new(&device)), &scratch("pretrained", "mapped"));
    let mut whole = Mapped::new(&device);
    whole.load_from(&mut BurnpackStore::from_file(&files.burnpack)).unwrap();
    let expected = entries_of(&whole);
    for eager in [false, true] {
        for world_size in 1..=4 {
            for stage in STAGES {
                let built = if eager { "eager" } else { "lazy" };
                let at = format!("{built} Col-layout and frozen Linear, stage {stage}, world size {world_size}");
                let ranks = run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
                    let model = match eager {
                        // `Param::map` reads (so initialises) every value.
                        true => Mapped::new(&device).map(&mut Touch),
                        false => Mapped::new(&device),
                    };
                    let (model, _) = ShardConfig::new(stage)
                        .init_pretrained(model, Pretrained::burnpack(&files.burnpack), adamw(), comm)
                        .unwrap_or_else(|e| panic!("{at}: {e}"));
                    entries_of(&model.materialize())
                })
                .unwrap_or_else(|e| panic!("{at}: a rank failed: {e:?}"));
                for (rank, loaded) in ranks.iter().enumerate() {
                    assert_bitwise(&format!("{at}, rank {rank}"), loaded, &expected);
                }
            }
        }
    }
}

/// Initialises every float entry of a module (`Param::map` reads its value).
struct Touch;

impl burn::module::ModuleMapper for Touch {
    fn map_float<const D: usize>(&mut self, param: burn::module::Param<Tensor<D>>) -> burn::module::Param<Tensor<D>> {
        param.map(|t| t)
    }
}

/// Two `Linear` layers, `a: 4 -> 3` and `b: 3 -> out`, and an optional third.
#[derive(Module, Debug)]
struct Two {
    a: Linear,
    b: Linear,
    c: Option<Linear>,
}

impl Two {
    fn new(out: usize, third: bool, device: &Device) -> Self {
        Self {
            a: LinearConfig::new(4, 3).init(device),
            b: LinearConfig::new(3, out).init(device),
            c: third.then(|| LinearConfig::new(2, 2).init(device)),
        }
    }
}

/// A file that does not fit the model fails `init_pretrained` on every rank, at every stage,
/// within seconds, with one message naming the file, each tensor and both shapes (or what is
/// missing, unused or of another kind): weights of another size, of a smaller model, of a larger
/// one, an integer tensor where a float parameter is, a tensor of a dtype Burn has no type for
/// (fp8), and a file that is not safetensors.
/// `allow_missing` and `ignore_unused` then let the intended differences through.
#[test]
fn a_pretrained_file_that_does_not_fit_fails_init_on_every_rank_naming_each_tensor() {
    let device = Device::flex().autodiff();
    let dir = scratch("pretrained", "misfits");
    let write = |name: &str, module: &Two| {
        let path = dir.join(name);
        module.save_into(&mut SafetensorsStore::from_file(&path)).unwrap();
        path
    };
    let wider = write("wider.safetensors", &Two::new(5, false, &device));
    let fewer = dir.join("fewer.safetensors");
    let mut store = SafetensorsStore::from_file(&fewer).with_regex("^a\\.");
    Two::new(2, false, &device).save_into(&mut store).unwrap();
    let more = write("more.safetensors", &Two::new(2, true, &device));
    // `a.weight` of another dtype: I64 (a Burn dtype of the wrong kind), F8_E4M3 (none).
    let with_weight = |name: &str, dtype: safetensors::Dtype, weight: Vec<u8>| {
        let other: Vec<(&str, Vec<usize>, Vec<u8>, safetensors::Dtype)> = vec![
            ("a.weight", vec![4, 3], weight, dtype),
            ("a.bias", vec![3], vec![0; 12], safetensors::Dtype::F32),
            ("b.weight", vec![3, 2], vec![0; 24], safetensors::Dtype::F32),
            ("b.bias", vec![2], vec![0; 8], safetensors::Dtype::F32),
        ];
        let views: Vec<(&str, safetensors::tensor::TensorView)> = other
            .iter()
            .map(|(n, s, b, d)| (*n, safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        let path = dir.join(name);
        safetensors::serialize_to_file(views, None, &path).unwrap();
        path
    };
    let ints = with_weight(
        "ints.safetensors",
        safetensors::Dtype::I64,
        (0..12i64).flat_map(|v| v.to_le_bytes()).collect(),
    );
    let fp8 = with_weight("fp8.safetensors", safetensors::Dtype::F8_E4M3, vec![0; 12]);
    let garbage = dir.join("garbage.safetensors");
    std::fs::write(&garbage, b"not a safetensors file").unwrap();

    let cases: [(&Path, &[&str]); 6] = [
        (
            &wider,
            &[
                "`b.weight` has shape [3, 5], and `b.weight` has shape [3, 2]",
                "`b.bias` has shape [5]",
            ],
        ),
        (
            &fewer,
            &[
                "2 of the model's entries are not in the file",
                "`b.weight` [3, 2]",
                "allow_missing",
            ],
        ),
        (
            &more,
            &[
                "2 tensors of the file have no place in the model",
                "`c.weight`",
                "`c.bias`",
            ],
        ),
        (
            &ints,
            &["tensor `a.weight` is I64, and `a.weight` is a float parameter"],
        ),
        (
            &fp8,
            &["tensor `a.weight` for `a.weight`: dtype F8_E4M3 has no Burn type"],
        ),
        (
            &garbage,
            &["cannot read the pretrained weights", "not a safetensors file"],
        ),
    ];
    for (file, expected) in cases {
        for stage in STAGES {
            let at = format!("{}, stage {stage}", file.display());
            let started = std::time::Instant::now();
            let errors = init_errors(stage, |_| (Two::new(2, false, &device), file));
            for (rank, err) in errors.iter().enumerate() {
                let err = err
                    .as_deref()
                    .unwrap_or_else(|| panic!("{at}, rank {rank}: init succeeded"));
                assert!(
                    err.contains(&file.display().to_string()) && expected.iter().all(|e| err.contains(e)),
                    "{at}, rank {rank}: {err}"
                );
            }
            assert!(started.elapsed().as_secs() < 10, "{at}: within seconds");
        }
    }

    // Only one rank's file is unreadable: that rank names it, the other fails within seconds
    // naming the rank (it would otherwise wait for it at the first collective).
    let started = std::time::Instant::now();
    let errors = init_errors(Stage::Three, |rank| {
        let file = if rank == 1 { &garbage } else { &wider };
        (Two::new(5, false, &device), file.as_path())
    });
    for (rank, err) in errors.iter().enumerate() {
        let err = err
            .as_deref()
            .unwrap_or_else(|| panic!("one garbage file, rank {rank}: init succeeded"));
        assert!(
            err.contains("garbage.safetensors"),
            "one garbage file, rank {rank}: {err}"
        );
    }
    assert!(started.elapsed().as_secs() < 10, "one garbage file: within seconds");

    // A model with an integer parameter, whose file holds it: named, with the fix.
    #[derive(Module, Debug)]
    struct Counted {
        a: Linear,
        seen: burn::module::Param<Tensor<1, Int>>,
    }
    let counted = |device: &Device| Counted {
        a: LinearConfig::new(4, 3).init(device),
        seen: burn::module::Param::initialized(burn::module::ParamId::new(), Tensor::<1, Int>::arange(0..3, device)),
    };
    let with_int = dir.join("with-int.safetensors");
    counted(&device)
        .save_into(&mut SafetensorsStore::from_file(&with_int))
        .unwrap();
    let errors = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
        ShardConfig::new(Stage::Three)
            .init_pretrained(counted(&device), Pretrained::safetensors(&with_int), adamw(), comm)
            .err()
            .map(|e| e.to_string())
    })
    .unwrap();
    for (rank, err) in errors.iter().enumerate() {
        let err = err
            .as_deref()
            .unwrap_or_else(|| panic!("integer parameter, rank {rank}: init succeeded"));
        assert!(
            err.contains("`seen`, an integer or boolean parameter") && err.contains("ignore_unused"),
            "integer parameter, rank {rank}: {err}"
        );
    }

    // The intended differences let through: `b` initialised as without weights (rank 0's,
    // so every rank's), `c` skipped.
    type Let = fn(Pretrained) -> Pretrained;
    let through: [(&Path, Let, usize); 2] = [
        (&fewer, |p| p.allow_missing(["^b\\."]), 2),
        (&more, |p| p.ignore_unused(["^c\\."]), 4),
    ];
    for (file, let_through, from_file) in through {
        let mut whole = Two::new(2, false, &device);
        whole
            .load_from(&mut SafetensorsStore::from_file(file).allow_partial(true))
            .unwrap();
        let expected = entries_of(&whole)[..from_file].to_vec();
        let loaded = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
            let pretrained = let_through(Pretrained::safetensors(file));
            let (model, _) = ShardConfig::new(Stage::Three)
                .init_pretrained(Two::new(2, false, &device), pretrained, adamw(), comm)
                .unwrap();
            entries_of(&model.materialize())
        })
        .unwrap();
        for (rank, got) in loaded.iter().enumerate() {
            let at = format!("{}, rank {rank}", file.display());
            assert_bitwise(&at, &got[..from_file], &expected);
            assert_eq!(got, &loaded[0], "{at}: differs from rank 0");
        }
    }
}

/// On 2 ranks at `stage`: `init_pretrained` of the model and safetensors file `case(rank)`
/// gives; each rank's error, if any.
fn init_errors<'a>(stage: Stage, case: impl Fn(usize) -> (Two, &'a Path) + Sync) -> Vec<Option<String>> {
    run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
        let (model, file) = case(comm.rank());
        ShardConfig::new(stage)
            .init_pretrained(model, Pretrained::safetensors(file), adamw(), comm)
            .err()
            .map(|e| e.to_string())
    })
    .unwrap()
}

/// `LAYERS` square linear layers of `WIDTH`: 8.4 M parameters, 32 MiB of `f32`.
#[derive(Module, Debug)]
struct Tower {
    layers: Vec<Linear>,
}

const LAYERS: usize = 32;
const WIDTH: usize = 512;

impl Tower {
    fn new(device: &Device) -> Self {
        Self {
            layers: (0..LAYERS)
                .map(|_| LinearConfig::new(WIDTH, WIDTH).init(device))
                .collect(),
        }
    }
}

/// Peak resident memory and bytes read while 4 ranks (threads of one process) load a 32 MiB
/// safetensors file into a lazy model at stage 3: the process holds the ranks' shards (one
/// model together) plus about one parameter per rank, and reads the file once in all (each
/// rank its own byte ranges), not once per rank. Measured in a child process: the kernel's peak
/// (`VmHWM`, reset before `init`) and the bytes read by system calls (`rchar` of
/// `/proc/self/io`).
#[test]
fn stage3_pretrained_load_reads_each_ranks_byte_ranges_and_holds_its_shards() {
    if !Path::new("/proc/self/clear_refs").exists() || !Path::new("/proc/self/io").exists() {
        println!("skipped: no /proc/self/clear_refs or /proc/self/io (Linux only) to measure the load");
        return;
    }
    let dir = scratch("pretrained", "peak");
    Tower::new(&Device::flex())
        .save_into(&mut SafetensorsStore::from_file(dir.join("tower.safetensors")))
        .unwrap();
    run_child("true", "pretrained::load_peak_child", "BURN_SHARD_LOAD_PEAK", &dir);
}

fn rchar() -> u64 {
    let io = std::fs::read_to_string("/proc/self/io").unwrap();
    let line = io.lines().find(|l| l.starts_with("rchar:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
#[ignore = "run by stage3_pretrained_load_reads_each_ranks_byte_ranges_and_holds_its_shards in a process of its own"]
fn load_peak_child() {
    run_by_parent("BURN_SHARD_LOAD_PEAK");
    const WORLD: usize = 4;
    let file = PathBuf::from(std::env::var_os("BURN_SHARD_LOAD_PEAK").unwrap()).join("tower.safetensors");
    let file_bytes = std::fs::metadata(&file).unwrap().len();
    let device = Device::flex().autodiff();
    let model_bytes = (LAYERS * (WIDTH * WIDTH + WIDTH) * 4) as u64;
    let param_bytes = (WIDTH * WIDTH * 4) as u64;
    // Threads, collectives and Burn's first ops allocate once: warm them up on a tiny model.
    let warm: Vec<Linear> = (0..WORLD).map(|_| LinearConfig::new(4, 4).init(&device)).collect();
    let warm = std::sync::Mutex::new(warm);
    run_ranks(InProcessGroup::new(WORLD).unwrap(), |comm| {
        let model = warm.lock().unwrap().pop().unwrap();
        drop(ShardConfig::new(Stage::Three).init(model, adamw(), comm).unwrap());
    })
    .unwrap();
    let models: Vec<Tower> = (0..WORLD).map(|_| Tower::new(&device)).collect();
    let models = std::sync::Mutex::new(models);
    let (rss_before, read_before) = (status_bytes("VmRSS"), rchar());
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
    let held = run_ranks(InProcessGroup::new(WORLD).unwrap(), |comm| {
        let model = models.lock().unwrap().pop().unwrap();
        let pretrained = Pretrained::safetensors(&file);
        ShardConfig::new(Stage::Three)
            .init_pretrained(model, pretrained, adamw(), comm)
            .unwrap()
    })
    .unwrap();
    let (grown, read) = (status_bytes("VmHWM").saturating_sub(rss_before), rchar() - read_before);
    // The values are the file's: the last layer, gathered on every rank.
    let held = std::sync::Mutex::new(held);
    let last = run_ranks(InProcessGroup::new(WORLD).unwrap(), |comm| {
        let (model, _) = held.lock().unwrap().remove(0);
        drop(comm);
        model.layers[LAYERS - 1]
            .weight
            .val()
            .into_data()
            .iter::<f32>()
            .collect::<Vec<_>>()
    })
    .unwrap();
    let tensors = std::fs::read(&file).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&tensors).unwrap();
    let saved = tensors.tensor(&format!("layers.{}.weight", LAYERS - 1)).unwrap();
    let saved: Vec<f32> = saved
        .data()
        .chunks(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    for (rank, got) in last.iter().enumerate() {
        assert!(got == &saved, "rank {rank}: the last layer's weight is not the file's");
    }
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let bound = model_bytes + 2 * WORLD as u64 * param_bytes + (16 << 20);
    println!(
        "stage-3 load of a {:.1} MiB file on {WORLD} ranks: peak grew by {:.1} MiB (bound {:.1}), {:.1} MiB read \
         (the file once: {:.1}; once per rank would be {:.1})",
        mib(file_bytes),
        mib(grown),
        mib(bound),
        mib(read),
        mib(file_bytes),
        mib(WORLD as u64 * file_bytes)
    );
    assert!(
        grown <= bound,
        "load peak grew by {:.1} MiB, over {:.1} MiB",
        mib(grown),
        mib(bound)
    );
    assert!(
        read <= file_bytes + (1 << 20),
        "read {:.1} MiB for a {:.1} MiB file: some rank read more than its byte ranges",
        mib(read),
        mib(file_bytes)
    );
    assert!(read >= model_bytes, "read {:.1} MiB: less than the weights", mib(read));
}

/// `dir/model.safetensors` split as Hugging Face splits large models: its tensors dealt over
/// 3 files `model-0000K-of-00003.safetensors`, with `model.safetensors.index.json` naming the
/// file of each. Returns the index's path.
fn split_in_three(whole: &Path, dir: &Path) -> PathBuf {
    let bytes = std::fs::read(whole).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names = file.names();
    names.sort();
    let mut weight_map = serde_json::Map::new();
    for part in 0..3 {
        let name = format!("model-{:05}-of-00003.safetensors", part + 1);
        let views: Vec<(String, safetensors::tensor::TensorView)> = names
            .iter()
            .skip(part)
            .step_by(3)
            .map(|n| (n.to_string(), file.tensor(n).unwrap()))
            .collect();
        for (n, _) in &views {
            weight_map.insert(n.clone(), serde_json::Value::String(name.clone()));
        }
        safetensors::serialize_to_file(views, None, &dir.join(&name)).unwrap();
    }
    let index = dir.join("model.safetensors.index.json");
    let json = serde_json::json!({ "metadata": { "total_size": bytes.len() }, "weight_map": weight_map });
    std::fs::write(&index, serde_json::to_string_pretty(&json).unwrap()).unwrap();
    index
}

/// A checkpoint split over 3 safetensors files loads from its index and from its directory,
/// at stages 0-3 on 1-4 ranks and with hybrid sharding (2 replicas of 2): every rank's entries
/// equal bitwise the model the whole file came from. What is not a checkpoint, an index naming
/// a missing file and an index placing a tensor in a file without it fail naming what was given
/// and what is expected.
#[test]
fn a_checkpoint_split_over_files_loads_from_its_index_or_directory() {
    use burn_shard_examples::gpt::{Gpt, GptConfig};
    let config = GptConfig {
        vocab_size: 11,
        block_size: 8,
        n_embd: 16,
        n_head: 2,
        n_layer: 2,
    };
    let device = Device::flex().autodiff();
    let saved = perturbed(Gpt::new(&config, &device));
    let dir = scratch("pretrained", "split");
    let whole = dir.join("whole.safetensors");
    saved.save_into(&mut SafetensorsStore::from_file(&whole)).unwrap();
    let split = dir.join("split");
    std::fs::create_dir_all(&split).unwrap();
    let index = split_in_three(&whole, &split);
    let expected = entries_of(&saved);
    let mut runs = Vec::new();
    for world_size in 1..=4 {
        for stage in STAGES {
            runs.push((world_size, stage, 1));
        }
    }
    runs.extend([(4, Stage::One, 2), (4, Stage::Three, 2)]);
    for (world_size, stage, replicas) in runs {
        for given in [&index, &split] {
            let at = format!(
                "{} at stage {stage}, world size {world_size}, {replicas} replicas",
                given.display()
            );
            let ranks = run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
                let mut shard = ShardConfig::new(stage);
                if replicas > 1 {
                    shard = shard.with_replicas(replicas);
                }
                let (model, _) = shard
                    .init_pretrained(
                        Gpt::new(&config, &device),
                        Pretrained::safetensors(given),
                        adamw(),
                        comm,
                    )
                    .unwrap_or_else(|e| panic!("{at}: {e}"));
                entries_of(&model.materialize())
            })
            .unwrap();
            for (rank, loaded) in ranks.iter().enumerate() {
                assert_bitwise(&format!("{at}, rank {rank}"), loaded, &expected);
            }
        }
    }

    // What is given and what is expected, for each way of getting it wrong.
    let problem = |p: Pretrained| p.problem().map(|e| e.to_string()).unwrap_or_default();
    // A file shorter than its header says (truncated, or still being copied): refused when
    // opened, naming both lengths, before any rank reads a tensor (the header is read, not
    // memory-mapped, so no access can kill the process).
    let bytes = std::fs::read(&whole).unwrap();
    let truncated = dir.join("truncated.safetensors");
    std::fs::write(&truncated, &bytes[..bytes.len() - 10]).unwrap();
    let e = problem(Pretrained::safetensors(&truncated));
    assert!(
        e.contains("truncated") && e.contains(&format!("file holds {}", bytes.len() - 10)),
        "{e}"
    );
    std::fs::write(&truncated, &bytes[..4]).unwrap();
    let e = problem(Pretrained::safetensors(&truncated));
    assert!(e.contains("not a safetensors file") && e.contains("4 bytes"), "{e}");
    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let e = problem(Pretrained::safetensors(&empty));
    assert!(e.contains("empty") && e.contains("model.safetensors"), "{e}");
    let e = problem(Pretrained::safetensors(dir.join("missing.safetensors")));
    assert!(
        e.contains("missing.safetensors") && e.contains(".safetensors.index.json"),
        "{e}"
    );
    let broken = dir.join("broken");
    std::fs::create_dir_all(&broken).unwrap();
    let broken_index = broken.join("model.safetensors.index.json");
    std::fs::copy(&index, &broken_index).unwrap();
    let e = problem(Pretrained::safetensors(&broken_index));
    assert!(
        e.contains("model-00001-of-00003.safetensors") && e.contains("is not a file"),
        "{e}"
    );
    for part in 1..=3 {
        let name = format!("model-{part:05}-of-00003.safetensors");
        std::fs::copy(split.join(&name), broken.join(&name)).unwrap();
    }
    let text = std::fs::read_to_string(&index).unwrap();
    let moved = text.replacen("model-00001-of-00003", "model-00002-of-00003", 1);
    std::fs::write(&broken_index, moved).unwrap();
    let e = problem(Pretrained::safetensors(&broken));
    assert!(e.contains("does not hold it"), "{e}");
    // An index that leaves its directory, or names a PyTorch .bin file.
    for (from, to) in [
        ("model-00002-of-00003.safetensors", "../whole.safetensors"),
        ("model-00002-of-00003.safetensors", "pytorch_model-00002.bin"),
    ] {
        std::fs::write(&broken_index, text.replace(from, to)).unwrap();
        let e = problem(Pretrained::safetensors(&broken_index));
        assert!(
            e.contains(to) && e.contains("expected the name of a .safetensors file beside the index"),
            "{e}"
        );
    }
}
