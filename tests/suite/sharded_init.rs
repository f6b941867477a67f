//! `ShardConfig::init` on a lazy model (every `burn::nn` module is lazy until its first
//! `val()`): rank 0 initialises one entry at a time and every other rank receives it, never
//! running its own initializer.
//!
//! Both tests run in a child process of this binary: the values depend on Burn's random
//! generator, which is one per process (`Device::seed`), and the peak resident memory is one
//! per process, so neither can share the process with the other tests.

use std::path::Path;

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::{Linear, LinearConfig, LinearLayout};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::Distribution;
use burn_shard::{ShardConfig, ShardedOptimizer, Stage};
use burn_shard_comm::{Collective, InProcessGroup, run_ranks};
use burn_shard_kernels::FusedAdam;

use crate::common::{max_abs_diff, sharded_step};
use crate::modules::{Layer, MODULES, adamw, reference, train_rank, trainable_of};
use crate::nvme_offload::run_child;

const STAGES: [Stage; 4] = [Stage::Zero, Stage::One, Stage::Two, Stage::Three];
const SEED: u64 = 41;

/// A child test refuses to run alone: its parent sets `var`.
pub(crate) fn run_by_parent(var: &str) {
    assert!(
        std::env::var_os(var).is_some(),
        "run by the parent test, which sets {var}"
    );
}

/// Every float entry of `module` (parameters, frozen ones and buffers), flattened, in
/// traversal order.
pub(crate) fn entries_of<M: Module>(module: &M) -> Vec<Vec<f32>> {
    struct Collect(Vec<Vec<f32>>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            self.0
                .push(p.val().into_data().convert::<f32>().iter::<f32>().collect());
        }
    }
    let mut c = Collect(Vec::new());
    module.visit(&mut c);
    c.0
}

/// The next values of the process's random generator: equal in two runs only if both drew
/// the same numbers since the same seed.
pub(crate) fn next_draws(device: &Device) -> Vec<f32> {
    Tensor::<1>::random([8], Distribution::Default, device)
        .into_data()
        .iter::<f32>()
        .collect()
}

/// Every module of the sweep at every stage 0-3 on 1-4 ranks as threads, each rank with its own
/// lazy copy: after `init`, every rank's parameters and buffers (gathered at stage 3) equal
/// bitwise what single-device Burn initialises from the same seed in traversal order, the
/// random generator's next draws are the single-device run's (no rank but 0 ran an
/// initializer), and three AdamW steps from there end within 1e-4 of single-device training
/// (the module sweep's bound: the ranks' entries train like the ones the initializer makes).
#[test]
fn init_of_a_lazy_model_gives_every_rank_single_device_values_bitwise() {
    run_child(
        "true",
        "sharded_init::lazy_values_child",
        "BURN_SHARD_LAZY_INIT",
        Path::new("."),
    );
}

#[test]
#[ignore = "run by init_of_a_lazy_model_gives_every_rank_single_device_values_bitwise in a process of its own"]
fn lazy_values_child() {
    run_by_parent("BURN_SHARD_LAZY_INIT");
    let plain = Device::flex().autodiff();
    // Two modules once more on a device with gradient checkpointing: the receiving ranks' values
    // carry the device's strategy, as the initializer's would.
    let checkpointing = plain.clone().gradient_checkpointing();
    let cases = MODULES
        .iter()
        .map(|name| (*name, &plain))
        .chain([("Linear", &checkpointing), ("TransformerEncoder", &checkpointing)]);
    for (name, device) in cases {
        sweep_lazy(
            name,
            &format!("{name} on {device:?}"),
            device,
            |at, ranks, single, world_size| {
                // Trainable like the initializer's values (require-grad and autodiff as it would
                // have made them): training matches single-device Burn.
                let (trained, _) = reference(single, world_size);
                for (rank, after) in ranks.iter().enumerate() {
                    let diff = max_abs_diff(after, &trained);
                    assert!(diff < 1e-4, "{at}, rank {rank}: trained parameters differ by {diff}");
                }
            },
        );
    }
    mapped_and_frozen(&plain);
}

/// The same in `bf16`: a device whose default float dtype is `bf16` (configured before its
/// first tensor, so in a process of its own) builds every module lazily in `bf16`; after `init`
/// (with `f32` masters) every rank's entries are bitwise single-device Burn's `bf16` init from
/// the same seed, the random generator moved as there, and three steps leave every rank with
/// bitwise the same parameters.
#[test]
fn init_of_a_lazy_bf16_model_gives_every_rank_single_device_values_bitwise() {
    run_child(
        "true",
        "sharded_init::lazy_bf16_child",
        "BURN_SHARD_LAZY_INIT",
        Path::new("."),
    );
}

#[test]
#[ignore = "run by init_of_a_lazy_bf16_model_gives_every_rank_single_device_values_bitwise in a process of its own"]
fn lazy_bf16_child() {
    run_by_parent("BURN_SHARD_LAZY_INIT");
    let device = bf16_device();
    assert_eq!(
        burn::tensor::DType::from(device.settings().float_dtype),
        burn::tensor::DType::BF16
    );
    for name in MODULES {
        sweep_lazy(name, &format!("{name} in bf16"), &device, |at, ranks, _, _| {
            for (rank, after) in ranks.iter().enumerate() {
                let same = after.iter().zip(&ranks[0]).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{at}, rank {rank}: trained parameters differ from rank 0's");
            }
        });
    }
}

/// The autodiff Flex device with `bf16` as its default float dtype: configured before its first
/// tensor, so only in a process of its own (a child test).
pub(crate) fn bf16_device() -> Device {
    let mut plain = Device::flex();
    plain
        .configure(burn::tensor::FloatDType::BF16)
        .expect("the first use of the device in this process");
    plain.autodiff()
}

/// Module `name` of the sweep, built lazily on `device` from the seed: once on one device (the
/// reference) and on every rank at stages 0-3 and world sizes 1-4. Asserts every rank's entries
/// after `init` bitwise the reference's and the random generator's next draws the reference's
/// (no rank but 0 drew), then hands each rank's trainable parameters after three steps to
/// `check_trained(at, ranks, reference, world_size)`.
fn sweep_lazy(name: &str, label: &str, device: &Device, check_trained: impl Fn(&str, &[Vec<f32>], &Layer, usize)) {
    device.seed(SEED);
    let single = Layer::new(name, device);
    let expected = entries_of(&single);
    let expected_draws = next_draws(device);
    for world_size in 1..=4 {
        for stage in STAGES {
            let at = format!("{label}, stage {stage}, world size {world_size}");
            let ranks = init_lazy(
                &at,
                device,
                world_size,
                stage,
                |d| Layer::new(name, d),
                |model, mut optim, rank| {
                    let model = train_rank(model, &mut optim, rank, world_size, device);
                    trainable_of(&model.materialize())
                },
            );
            let (initial, trained): (Vec<_>, Vec<_>) = ranks.into_iter().unzip();
            for (rank, got) in initial.iter().enumerate() {
                assert_bitwise(&format!("{at}, rank {rank}"), got, &expected);
            }
            assert_eq!(
                next_draws(device),
                expected_draws,
                "{at}: the random generator moved otherwise than in single-device init"
            );
            check_trained(&at, &trained, &single, world_size);
        }
    }
}

/// `Linear` layers whose lazy weight has load, save and init mappers (`LinearLayout::Col`
/// holds it transposed, in a square and a non-square layer) and a lazily frozen layer.
#[derive(Module, Debug)]
pub(crate) struct Mapped {
    square: Linear,
    rect: Linear,
    frozen: Linear,
}

impl Mapped {
    pub(crate) fn new(device: &Device) -> Self {
        Self {
            square: LinearConfig::new(6, 6).with_layout(LinearLayout::Col).init(device),
            rect: LinearConfig::new(5, 3).with_layout(LinearLayout::Col).init(device),
            frozen: LinearConfig::new(3, 2).init(device).no_grad(),
        }
    }

    /// `[4, 6]` -> `[4, 2]`; the loss of a fixed batch.
    fn loss(&self, device: &Device) -> Tensor<1> {
        let x = Tensor::<1, Int>::arange(0..24, device)
            .float()
            .reshape([4, 6])
            .div_scalar(24.0);
        let h = self.square.forward(x).narrow(1, 0, 5);
        self.frozen.forward(self.rect.forward(h)).powi_scalar(2).mean()
    }
}

/// [`Mapped`] at every stage on 1-4 ranks, every rank on the same batch (so the mean gradient
/// is single-device Burn's): values after `init` bitwise single-device init, three steps within
/// 1e-5 of single-device AdamW, the frozen layer unchanged.
fn mapped_and_frozen(device: &Device) {
    const STEPS: usize = 3;
    device.seed(SEED);
    let single = Mapped::new(device);
    let expected = entries_of(&single);
    let mut reference = single.clone();
    let mut optim = adamw().init();
    for _ in 0..STEPS {
        let grads = GradientsParams::from_grads(reference.loss(device).backward(), &reference);
        reference = optim.step(1e-2, reference, grads);
    }
    let trained = entries_of(&reference);
    for world_size in 1..=4 {
        for stage in STAGES {
            let at = format!("Col-layout and frozen Linear, stage {stage}, world size {world_size}");
            let ranks = init_lazy(
                &at,
                device,
                world_size,
                stage,
                Mapped::new,
                |mut model, mut optim, _| {
                    for _ in 0..STEPS {
                        model = sharded_step(&mut optim, model.clone(), model.loss(device), 1e-2).0;
                    }
                    entries_of(&model.materialize())
                },
            );
            for (rank, (got, after)) in ranks.iter().enumerate() {
                assert_bitwise(&format!("{at}, rank {rank}"), got, &expected);
                let diff = max_abs_diff(&after.concat(), &trained.concat());
                assert!(diff < 1e-5, "{at}, rank {rank}: trained parameters differ by {diff}");
                assert_eq!(after[4..], expected[4..], "{at}, rank {rank}: the frozen layer changed");
            }
        }
    }
}

/// Seeds `device`, builds `world_size` lazy copies with `build` (rank 0's first; lazy, so
/// nothing is drawn), and on each rank `init`s its copy at `stage`, reads its entries
/// (gathered at stage 3), then runs `then`. Returns each rank's entries and `then`'s result.
fn init_lazy<M: Module, T: Send>(
    at: &str,
    device: &Device,
    world_size: usize,
    stage: Stage,
    build: impl Fn(&Device) -> M,
    then: impl Fn(M, ShardedOptimizer<FusedAdam>, usize) -> T + Sync,
) -> Vec<(Vec<Vec<f32>>, T)> {
    device.seed(SEED);
    let models: Vec<Option<M>> = (0..world_size).map(|_| Some(build(device))).collect();
    let models = std::sync::Mutex::new(models);
    run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
        let rank = comm.rank();
        let model = models.lock().unwrap()[rank].take().unwrap();
        let (model, optim) = ShardConfig::new(stage)
            .init(model, adamw(), comm)
            .unwrap_or_else(|e| panic!("{at}: {e}"));
        (entries_of(&model.clone().materialize()), then(model, optim, rank))
    })
    .unwrap_or_else(|e| panic!("{at}: a rank failed: {e:?}"))
}

/// Every entry of `got` equals `expected`'s bit for bit.
pub(crate) fn assert_bitwise(at: &str, got: &[Vec<f32>], expected: &[Vec<f32>]) {
    assert_eq!(got.len(), expected.len(), "{at}: entries");
    for (i, (g, e)) in got.iter().zip(expected).enumerate() {
        let same = g.len() == e.len() && g.iter().zip(e).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{at}: entry {i} differs from single-device init");
    }
}

/// `LAYERS` square linear layers of `WIDTH`: 8.4 M parameters, 32 MiB of `f32` in 1 MiB weights.
#[derive(Module, Debug)]
struct Tower {
    layers: Vec<Linear>,
}

const LAYERS: usize = 32;
const WIDTH: usize = 512;

/// Peak resident memory while 4 ranks (threads of one process) `init` a lazy 8.4 M-parameter
/// model at stage 3: the process holds every rank's shards (one model together) plus a few
/// copies of one parameter per rank, not one model per rank. Measured in a child process with
/// the kernel's peak (`VmHWM`, reset before `init` through `/proc/self/clear_refs`).
#[test]
fn stage3_init_of_a_lazy_model_holds_shards_plus_about_one_parameter_per_rank() {
    if !Path::new("/proc/self/clear_refs").exists() {
        println!("skipped: no /proc/self/clear_refs (Linux only) to reset the peak resident memory");
        return;
    }
    run_child(
        "true",
        "sharded_init::init_peak_child",
        "BURN_SHARD_INIT_PEAK",
        Path::new("."),
    );
}

/// A field of /proc/self/status in bytes (`VmHWM`, `VmRSS`).
pub(crate) fn status_bytes(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with(field)).unwrap();
    let kb: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kb * 1024
}

#[test]
#[ignore = "run by stage3_init_of_a_lazy_model_holds_shards_plus_about_one_parameter_per_rank in a process of its own"]
fn init_peak_child() {
    run_by_parent("BURN_SHARD_INIT_PEAK");
    const WORLD: usize = 4;
    let device = Device::flex().autodiff();
    let models: Vec<Tower> = (0..WORLD)
        .map(|_| Tower {
            layers: (0..LAYERS)
                .map(|_| LinearConfig::new(WIDTH, WIDTH).init(&device))
                .collect(),
        })
        .collect();
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
    let models = std::sync::Mutex::new(models);
    let before = status_bytes("VmRSS");
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
    let held = run_ranks(InProcessGroup::new(WORLD).unwrap(), |comm| {
        let model = models.lock().unwrap().pop().unwrap();
        ShardConfig::new(Stage::Three).init(model, adamw(), comm).unwrap()
    })
    .unwrap();
    let grown = status_bytes("VmHWM").saturating_sub(before);
    drop(held);
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    // The shards of all ranks are one model; each rank holds an entry it received (or, rank
    // 0, initialised) and the broadcast's host copies of it: 4 copies of the largest entry per
    // rank, and 16 MiB for the allocator's and the threads' own.
    let bound = model_bytes + 4 * WORLD as u64 * param_bytes + (16 << 20);
    println!(
        "stage-3 init of {:.1} MiB on {WORLD} ranks: peak grew by {:.1} MiB (bound {:.1} MiB; one model per rank would be {:.1} MiB)",
        mib(model_bytes),
        mib(grown),
        mib(bound),
        mib(WORLD as u64 * model_bytes)
    );
    assert!(
        grown <= bound,
        "init peak grew by {:.1} MiB, over {:.1} MiB",
        mib(grown),
        mib(bound)
    );
}

/// A module with one lazy parameter built by an initializer of the user's own.
#[derive(Module, Debug)]
struct OwnInit {
    w: Param<Tensor<2>>,
}

/// A lazy parameter whose own initializer makes what `init` could not know from its metadata
/// fails `init` on every rank within seconds, naming the parameter, what differs and the fix, at
/// every stage: `bf16` on a device whose default float dtype is `f32`, and a value that ignores
/// the `require_grad` Burn passes (rank 0 would freeze what the others train).
#[test]
fn a_lazy_initializer_that_makes_what_its_metadata_does_not_say_fails_init_on_every_rank() {
    type Init = fn(&Device, bool) -> Tensor<2>;
    let cases: [(&str, Init, &[&str]); 2] = [
        (
            "bf16",
            |device, require_grad| {
                let t = Tensor::<2>::zeros([4, 3], (device, burn::tensor::DType::BF16));
                if require_grad { t.require_grad() } else { t }
            },
            &["BF16", "F32", "float_dtype"],
        ),
        (
            "ignores require_grad",
            |device, _| Tensor::<2>::zeros([4, 3], device),
            &["does not require grad", "set to train", "set_require_grad(false)"],
        ),
    ];
    for (case, init, expected) in cases {
        for stage in STAGES {
            let started = std::time::Instant::now();
            let results = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
                let w = Param::uninitialized(
                    burn::module::ParamId::new(),
                    init,
                    Device::flex().autodiff(),
                    true,
                    [4, 3].into(),
                );
                ShardConfig::new(stage)
                    .init(OwnInit { w }, adamw(), comm)
                    .err()
                    .map(|e| e.to_string())
            })
            .unwrap();
            for (rank, err) in results.iter().enumerate() {
                let at = format!("{case}, stage {stage}, rank {rank}");
                let err = err.as_deref().unwrap_or_else(|| panic!("{at}: init succeeded"));
                assert!(
                    err.contains("`w`") && expected.iter().all(|e| err.contains(e)),
                    "{at}: {err}"
                );
            }
            assert!(
                started.elapsed().as_secs() < 10,
                "{case}, stage {stage}: within seconds"
            );
        }
    }
}
