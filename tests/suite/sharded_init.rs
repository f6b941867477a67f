//! `ShardConfig::init` on a lazy model (every `burn::nn` module is lazy until its first
//! `val()`): rank 0 initialises one entry at a time and every other rank receives it, never
//! running its own initializer.
//!
//! Both tests run in a child process of this binary: the values depend on Burn's random
//! generator, which is one per process (`Device::seed`), and the peak resident memory is one
//! per process, so neither can share the process with the other tests.

use std::path::Path;

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::{Linear, LinearConfig};
use burn::optim::AdamWConfig;
use burn::prelude::*;
use burn::tensor::Distribution;
use burn_shard::{ShardConfig, Stage};
use burn_shard_comm::{Collective, InProcessGroup, run_ranks};

use crate::common::max_abs_diff;
use crate::modules::{Layer, MODULES, adamw, reference, train_rank, trainable_of};
use crate::nvme_offload::run_child;

const STAGES: [Stage; 4] = [Stage::Zero, Stage::One, Stage::Two, Stage::Three];
const SEED: u64 = 41;

/// A child test refuses to run alone: its parent sets `var`.
fn run_by_parent(var: &str) {
    assert!(
        std::env::var_os(var).is_some(),
        "run by the parent test, which sets {var}"
    );
}

/// Every float entry of `module` (parameters, frozen ones and buffers), flattened, in
/// traversal order.
fn entries_of<M: Module>(module: &M) -> Vec<Vec<f32>> {
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
fn next_draws(device: &Device) -> Vec<f32> {
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
    let device = Device::flex().autodiff();
    for name in MODULES {
        device.seed(SEED);
        let single = Layer::new(name, &device);
        let expected = entries_of(&single);
        let expected_draws = next_draws(&device);
        for world_size in 1..=4 {
            let (trained, _) = reference(&single, world_size);
            for stage in STAGES {
                device.seed(SEED);
                // Built before the ranks start, rank 0's first; lazy, so nothing is drawn yet.
                let models: Vec<Layer> = (0..world_size).map(|_| Layer::new(name, &device)).collect();
                let models = std::sync::Mutex::new(models.into_iter().map(Some).collect::<Vec<_>>());
                let at = format!("{name}, stage {stage}, world size {world_size}");
                let ranks = run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
                    let rank = comm.rank();
                    let model = models.lock().unwrap()[rank].take().unwrap();
                    let (model, mut optim) = ShardConfig::new(stage)
                        .init(model, adamw(), comm)
                        .unwrap_or_else(|e| panic!("{at}: {e}"));
                    let initial = entries_of(&model.clone().materialize());
                    let model = train_rank(model, &mut optim, rank, world_size, &device);
                    (initial, trainable_of(&model.materialize()))
                })
                .unwrap_or_else(|e| panic!("{at}: a rank failed: {e:?}"));
                for (rank, (got, after)) in ranks.iter().enumerate() {
                    // Trainable like the ranks' own values (require-grad and autodiff as the
                    // initializer would have made them): training matches single-device Burn.
                    let diff = max_abs_diff(after, &trained);
                    assert!(diff < 1e-4, "{at}, rank {rank}: trained parameters differ by {diff}");
                    assert_eq!(got.len(), expected.len(), "{at}, rank {rank}: entries");
                    for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
                        let same = g.len() == e.len() && g.iter().zip(e).all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "{at}, rank {rank}: entry {i} differs from single-device init");
                    }
                }
                assert_eq!(
                    next_draws(&device),
                    expected_draws,
                    "{at}: the random generator moved otherwise than in single-device init"
                );
            }
        }
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
fn status_bytes(field: &str) -> u64 {
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
        drop(
            ShardConfig::new(Stage::Three)
                .init(model, AdamWConfig::new(), comm)
                .unwrap(),
        );
    })
    .unwrap();
    let models = std::sync::Mutex::new(models);
    let before = status_bytes("VmRSS");
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
    let held = run_ranks(InProcessGroup::new(WORLD).unwrap(), |comm| {
        let model = models.lock().unwrap().pop().unwrap();
        ShardConfig::new(Stage::Three)
            .init(model, AdamWConfig::new(), comm)
            .unwrap()
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

/// A module whose lazy parameter's own initializer makes `bf16` on a device whose default
/// float dtype is `f32`.
#[derive(Module, Debug)]
struct OwnInit {
    w: Param<Tensor<2>>,
}

/// A lazy parameter whose initializer makes another dtype than the one `init` laid it out with
/// (the device's default) fails `init` on every rank within seconds, naming the parameter, both
/// dtypes and the fix, at every stage.
#[test]
fn a_lazy_initializer_that_makes_another_dtype_fails_init_on_every_rank() {
    for stage in STAGES {
        let started = std::time::Instant::now();
        let results = run_ranks(InProcessGroup::new(2).unwrap(), |comm| {
            let device = Device::flex().autodiff();
            let w = Param::uninitialized(
                burn::module::ParamId::new(),
                |device: &Device, require_grad: bool| {
                    let t = Tensor::<2>::zeros([4, 3], (device, burn::tensor::DType::BF16));
                    if require_grad { t.require_grad() } else { t }
                },
                device,
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
            let err = err
                .as_deref()
                .unwrap_or_else(|| panic!("stage {stage}, rank {rank}: init succeeded"));
            assert!(
                err.contains("`w`") && err.contains("BF16") && err.contains("F32") && err.contains("float_dtype"),
                "stage {stage}, rank {rank}: {err}"
            );
        }
        assert!(started.elapsed().as_secs() < 10, "stage {stage}: within seconds");
    }
}
