//! Hybrid sharding (HSDP, `ShardConfig::with_replicas`): the mesh's groups on each backend,
//! training that equals flat sharding and single-device Burn for every mesh shape, stage,
//! clipping, loss scaling and accumulation, the module sweep, checkpoints written by one shard
//! group and resumed at any mesh, a lost rank failing every rank, and bad meshes refused.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::prelude::*;
use burn_shard::estimate::{ParamDtype, step_traffic};
use burn_shard::{LossScaler, MeshLayout, ShardConfig, ShardError, Stage};
use burn_shard_comm::{Collective, CollectiveKind, InProcessGroup, Mesh, ReduceOp, run_ranks};

use crate::common::*;
use crate::equivalence::{GLOBAL_BATCH, LR, STEPS};

/// `(replicas, shard_size)`: the shapes, both degenerate ones included.
const MESHES: [(usize, usize); 5] = [(1, 4), (4, 1), (2, 2), (2, 3), (3, 2)];
const SHARDED: [Stage; 3] = [Stage::One, Stage::Two, Stage::Three];

/// What a step does around the optimizer.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Recipe {
    Plain,
    /// Clip by a global norm small enough to act at every step.
    Clipped,
    /// A dynamic loss scaler, and each rank's share in 2 or 3 micro-batches given to
    /// `accumulate` before the step.
    ScaledAccumulated,
}

impl Recipe {
    fn config(self, stage: Stage) -> ShardConfig {
        let config = ShardConfig::new(stage);
        match self {
            Recipe::Plain => config,
            Recipe::Clipped => config.with_max_grad_norm(0.05),
            Recipe::ScaledAccumulated => config.with_loss_scaler(LossScaler::dynamic()),
        }
    }

    fn micro_batches(self, rows: usize) -> usize {
        match self {
            Recipe::ScaledAccumulated if rows.is_multiple_of(3) => 3,
            Recipe::ScaledAccumulated => 2,
            _ => 1,
        }
    }
}

/// What one rank ends with.
struct Run {
    /// The loss of the global batch at each step.
    losses: Vec<f32>,
    /// The pre-clip global norm each step reported (when measured).
    norms: Vec<f64>,
    params: Vec<f32>,
    /// All-reduces over the replica group per step, and the buckets of the layout (one each).
    replica_all_reduces: Vec<u64>,
    buckets: usize,
}

/// One rank: `STEPS` AdamW steps of `recipe` on its share of each global batch.
fn rank_run(comm: impl Collective + 'static, config: ShardConfig, base: &TinyMlp, recipe: Recipe) -> Run {
    let device = Device::flex().autodiff();
    let (lo, hi) = rank_rows(comm.rank(), comm.world_size(), GLOBAL_BATCH);
    let (mut model, mut optim) = config
        .init(base.clone().fork(&device), AdamWConfig::new(), comm)
        .expect("init");
    let k = recipe.micro_batches(hi - lo);
    let micro = (hi - lo) / k;
    let (mut losses, mut norms, mut replica_all_reduces) = (Vec::new(), Vec::new(), Vec::new());
    for step in 0..STEPS {
        let (x, y) = batch(step, GLOBAL_BATCH);
        let before = optim.mesh().map(|mesh| mesh.replicate().stats());
        let mut local = 0.0;
        for m in 0..k {
            let (a, b) = (lo + m * micro, lo + (m + 1) * micro);
            let loss = mse(&model, rows(&x, IN, a, b, &device), rows(&y, OUT, a, b, &device)).div_scalar(k as f32);
            local += loss.clone().into_scalar::<f32>();
            let grads = GradientsParams::from_grads(optim.scale_loss(loss).backward(), &model);
            match m + 1 < k {
                true => optim.accumulate(&model, grads).expect("accumulate"),
                false => model = optim.step(LR, model, grads).expect("step"),
            }
        }
        let global = optim
            .comm()
            .all_reduce(Tensor::<1>::from_floats([local], &device).inner(), ReduceOp::Avg)
            .expect("loss all_reduce");
        losses.push(global.into_scalar::<f32>());
        norms.extend(optim.report().last_grad_norm());
        if let (Some(mesh), Some(before)) = (optim.mesh(), before) {
            let calls = mesh
                .replicate()
                .stats()
                .since(&before)
                .get(CollectiveKind::AllReduce)
                .calls;
            replica_all_reduces.push(calls);
        }
    }
    let buckets = optim.report().layout().buckets().len();
    Run {
        losses,
        norms,
        params: params_of(&model.materialize()),
        replica_all_reduces,
        buckets,
    }
}

fn run(world_size: usize, config: ShardConfig, base: &TinyMlp, recipe: Recipe) -> Vec<Run> {
    run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
        rank_run(comm, config.clone(), base, recipe)
    })
    .expect("no rank panics")
}

fn relative(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-12)
}

/// The class: every mesh shape, every sharded stage, with clipping, with loss scaling
/// and accumulation. HSDP equals the flat run of the same world size (losses, reported global
/// norms and parameters within 1e-5: the two average in different orders) and, without a
/// recipe, single-device Burn within the suite's 1e-4; every rank holds the same parameters
/// bit for bit; `(1, W)` is the flat run bit for bit; the replicas all-reduce each bucket once
/// per step, also after `accumulate`. A norm summed over the replicas (the known HSDP bug)
/// would be `sqrt(replicas)` times too large.
#[test]
fn hybrid_sharding_trains_as_flat_sharding_and_single_device_for_every_mesh() {
    let device = Device::flex().autodiff();
    device.seed(13);
    let base = TinyMlp::new(&device);
    let reference = reference_run(&base, AdamWConfig::new().init(), STEPS, GLOBAL_BATCH, LR);
    for stage in SHARDED {
        for recipe in [Recipe::Plain, Recipe::Clipped, Recipe::ScaledAccumulated] {
            for world_size in [4, 6] {
                let flat = run(world_size, recipe.config(stage), &base, recipe);
                for (replicas, shard_size) in MESHES.into_iter().filter(|(r, s)| r * s == world_size) {
                    let at = format!("stage {stage}, {recipe:?}, mesh {replicas} x {shard_size}");
                    let config = recipe.config(stage).with_replicas(replicas);
                    let hsdp = run(world_size, config, &base, recipe);
                    for (rank, r) in hsdp.iter().enumerate() {
                        assert_eq!(r.params, hsdp[0].params, "{at}: rank {rank} holds other parameters");
                        let expected_calls = if replicas > 1 {
                            vec![r.buckets as u64; STEPS]
                        } else {
                            vec![]
                        };
                        assert_eq!(
                            r.replica_all_reduces, expected_calls,
                            "{at}: rank {rank}: one replica all-reduce per bucket and step"
                        );
                    }
                    let (h, f) = (&hsdp[0], &flat[0]);
                    if replicas == 1 {
                        assert_eq!((&h.losses, &h.params), (&f.losses, &f.params), "{at}: (1, W) is flat");
                    }
                    let diff = max_abs_diff(&h.params, &f.params);
                    assert!(diff <= 1e-5, "{at}: parameters off the flat run by {diff:e}");
                    for (step, (a, b)) in h.losses.iter().zip(&f.losses).enumerate() {
                        let rel = relative(f64::from(*a), f64::from(*b));
                        assert!(rel <= 1e-5, "{at}: step {step} loss {a} vs flat {b}");
                    }
                    assert_eq!(h.norms.len(), f.norms.len(), "{at}: norms measured as flat");
                    for (step, (a, b)) in h.norms.iter().zip(&f.norms).enumerate() {
                        assert!(
                            relative(*a, *b) <= 1e-5,
                            "{at}: step {step} global norm {a} vs flat {b}"
                        );
                    }
                    if recipe == Recipe::Clipped {
                        assert!(
                            h.norms.iter().all(|n| *n > 0.05),
                            "{at}: clipping must act at every step"
                        );
                    }
                    if recipe == Recipe::Plain {
                        let diff = max_abs_diff(&h.params, &reference.1);
                        assert!(diff <= 1e-4, "{at}: parameters off single-device Burn by {diff:e}");
                        for (step, (a, b)) in h.losses.iter().zip(&reference.0).enumerate() {
                            let rel = relative(f64::from(*a), f64::from(*b));
                            assert!(rel <= 1e-4, "{at}: step {step} loss {a} vs single device {b}");
                        }
                    }
                }
            }
        }
    }
}

/// Every `burn::nn` module of the sweep trains under a 2 x 2 mesh at stages 1-3 as on one
/// device, each rank with its own running-state buffers (as processes have).
#[test]
fn every_module_trains_under_a_two_by_two_mesh() {
    for name in crate::modules::MODULES {
        crate::modules::sweep_with(name, |stage| ShardConfig::new(stage).with_replicas(2), &SHARDED, 4);
    }
}

/// The mesh's groups: consecutive shard groups are the ranks of one "node", interleaved ones
/// one rank of each; collectives stay in their group; the traffic is counted per group.
#[test]
fn a_mesh_splits_the_world_into_shard_and_replica_groups() {
    for layout in [MeshLayout::Consecutive, MeshLayout::Interleaved] {
        let results = run_ranks(InProcessGroup::new(6).unwrap(), |comm| {
            let rank = comm.rank();
            let mesh = Mesh::new(Arc::new(comm), 2, layout).expect("mesh");
            // Which world ranks share this rank's shard group: the sum of one-hot vectors.
            let mut hot = vec![0.0f32; 6];
            hot[rank] = 1.0;
            let hot = Tensor::<1>::from_floats(hot.as_slice(), &Device::flex());
            let shard: Vec<f32> = mesh
                .shard()
                .all_reduce(hot.clone(), ReduceOp::Sum)
                .unwrap()
                .into_data()
                .try_into_vec()
                .unwrap();
            let replica: Vec<f32> = mesh
                .replicate()
                .all_reduce(hot, ReduceOp::Sum)
                .unwrap()
                .into_data()
                .try_into_vec()
                .unwrap();
            let members = |v: &[f32]| (0..6).filter(|&r| v[r] == 1.0).collect::<Vec<_>>();
            let stats = (mesh.shard().stats(), mesh.replicate().stats(), mesh.world().stats());
            (
                rank,
                members(&shard),
                members(&replica),
                mesh.replica_index(),
                mesh.shard_size(),
                stats,
            )
        })
        .unwrap();
        for (rank, shard, replica, replica_index, shard_size, (s, r, w)) in results {
            assert_eq!(shard_size, 3);
            let expected = match layout {
                MeshLayout::Consecutive => (rank / 3 * 3..rank / 3 * 3 + 3).collect::<Vec<_>>(),
                MeshLayout::Interleaved => (0..3).map(|i| rank % 2 + 2 * i).collect(),
            };
            assert_eq!(shard, expected, "{layout:?}: rank {rank}'s shard group");
            assert_eq!(replica.len(), 2, "{layout:?}: rank {rank}'s replica group");
            assert!(replica.contains(&rank) && !shard.iter().any(|s| *s != rank && replica.contains(s)));
            assert_eq!(replica_index, replica.iter().position(|&r| r == rank).unwrap());
            // One all-reduce in each sub-group; the world's own traffic: one agreement and the splits.
            assert_eq!(
                (
                    s.get(CollectiveKind::AllReduce).calls,
                    r.get(CollectiveKind::AllReduce).calls
                ),
                (1, 1)
            );
            assert_eq!(w.get(CollectiveKind::AllReduce).calls, 0);
            assert_eq!(w.get(CollectiveKind::AllGather).calls, 3, "mesh agreement + two splits");
        }
    }
}

/// A rank that stops in the middle of training (its thread ends, its groups' handles drop) fails
/// every other rank of a 2 x 2 mesh within seconds at every stage, also the rank that shares no
/// group with it (rank 0 and rank 3 share only the world), with the default 5-minute timeout.
#[test]
fn a_lost_rank_fails_every_rank_of_the_mesh_within_seconds() {
    let base = TinyMlp::new(&Device::flex().autodiff());
    for stage in SHARDED {
        for lost in [0, 3] {
            let start = Instant::now();
            let results = run_ranks(InProcessGroup::new(4).unwrap(), |comm| {
                let device = Device::flex().autodiff();
                let rank = comm.rank();
                let (lo, hi) = rank_rows(rank, 4, GLOBAL_BATCH);
                let (mut model, mut optim) = ShardConfig::new(stage)
                    .with_replicas(2)
                    .init(base.clone().fork(&device), AdamWConfig::new(), comm)
                    .expect("init");
                for step in 0..STEPS {
                    if rank == lost && step == 3 {
                        return Ok(step);
                    }
                    let (x, y) = batch(step, GLOBAL_BATCH);
                    let loss = mse(&model, rows(&x, IN, lo, hi, &device), rows(&y, OUT, lo, hi, &device));
                    let grads = GradientsParams::from_grads(loss.backward(), &model);
                    model = match optim.step(LR, model, grads) {
                        Ok(model) => model,
                        Err(e) => return Err(e.to_string()),
                    };
                }
                Ok(STEPS)
            })
            .expect("no rank panics");
            let elapsed = start.elapsed();
            assert!(
                elapsed < Duration::from_secs(20),
                "stage {stage}, rank {lost} lost: took {elapsed:?}"
            );
            for (rank, outcome) in results.iter().enumerate().filter(|(r, _)| *r != lost) {
                assert!(
                    outcome.is_err(),
                    "stage {stage}: rank {rank} trained on without rank {lost}: {outcome:?}"
                );
            }
        }
    }
}

/// Bad meshes fail `init` on every rank, naming the fix: a number of replicas that does not
/// divide the world, replicas at stage 0, ranks that disagree on the mesh.
#[test]
fn bad_meshes_are_refused_on_every_rank() {
    let base = TinyMlp::new(&Device::flex().autodiff());
    let init = |config: &(dyn Fn(usize) -> ShardConfig + Sync)| {
        run_ranks(InProcessGroup::new(4).unwrap(), |comm| {
            let rank = comm.rank();
            let device = Device::flex().autodiff();
            config(rank)
                .init(base.clone().fork(&device), AdamWConfig::new(), comm)
                .map(drop)
        })
        .expect("no rank panics")
    };
    for result in init(&|_| ShardConfig::new(Stage::Two).with_replicas(3)) {
        let e = result.expect_err("3 replicas of 4 ranks");
        assert!(
            matches!(e, ShardError::InvalidConfig(_)) && e.to_string().contains("divisor of 4"),
            "{e}"
        );
    }
    for result in init(&|_| ShardConfig::new(Stage::Zero).with_replicas(2)) {
        let e = result.expect_err("stage 0 with replicas");
        assert!(e.to_string().contains("stage 0 (DDP) shards nothing"), "{e}");
    }
    for result in init(&|rank| ShardConfig::new(Stage::Three).with_replicas(if rank == 2 { 4 } else { 2 })) {
        // Agreed as part of the config, before any rank splits a mesh by it.
        let e = result.expect_err("ranks disagree");
        assert!(matches!(&e, ShardError::ConfigMismatch { .. }), "{e}");
    }
}

/// A checkpoint of a 2 x 2 mesh at stage 3 is written by shard group 0 alone: the files of a
/// world of 2. It resumes on the same mesh, flat on 2 and 3 ranks, on a 3 x 2 mesh at stage 1
/// and a 2 x 3 one at stage 2, and each continues as the uninterrupted run does (within 1e-5).
#[test]
fn a_hybrid_checkpoint_is_written_once_and_resumes_at_any_mesh_and_stage() {
    let device = Device::flex().autodiff();
    device.seed(17);
    let base = TinyMlp::new(&device);
    let dir = scratch("hsdp", "resume").join("step-4");
    let half = STEPS / 2;
    let train = |world_size: usize, config: ShardConfig, load: bool, save: bool| -> Vec<f32> {
        let runs = run_ranks(InProcessGroup::new(world_size).unwrap(), |comm| {
            let device = Device::flex().autodiff();
            let (lo, hi) = rank_rows(comm.rank(), world_size, GLOBAL_BATCH);
            let (mut model, mut optim) = config
                .clone()
                .init(base.clone().fork(&device), AdamWConfig::new(), comm)
                .expect("init");
            let first = if load {
                model = optim.load_checkpoint(model, &dir).expect("load").0;
                half
            } else {
                0
            };
            for step in first..STEPS {
                if save && step == half {
                    optim
                        .save_checkpoint(&model, &dir, serde_json::json!({}))
                        .expect("save");
                }
                let (x, y) = batch(step, GLOBAL_BATCH);
                let loss = mse(&model, rows(&x, IN, lo, hi, &device), rows(&y, OUT, lo, hi, &device));
                model = sharded_step(&mut optim, model, loss, LR).0;
            }
            params_of(&model.materialize())
        })
        .expect("no rank panics");
        runs.into_iter().next().unwrap()
    };
    let uninterrupted = train(4, ShardConfig::new(Stage::Three).with_replicas(2), false, true);
    assert_eq!(
        rank_files(&dir),
        [0, 1],
        "shard group 0 writes the files of a world of 2"
    );
    for (world_size, stage, replicas) in [(4, 3, 2), (2, 3, 1), (3, 2, 1), (6, 1, 3), (6, 2, 2)] {
        let stage = Stage::try_from(stage).unwrap();
        let resumed = train(world_size, ShardConfig::new(stage).with_replicas(replicas), true, false);
        let diff = max_abs_diff(&resumed, &uninterrupted);
        assert!(
            diff <= 1e-5,
            "resumed on {world_size} ranks, stage {stage}, {replicas} replicas: off by {diff:e}"
        );
    }
}

/// The ranks whose files a checkpoint directory holds (`rank-<r>...` file names).
fn rank_files(dir: &Path) -> Vec<usize> {
    let mut ranks: Vec<usize> = checkpoint_files(dir)
        .iter()
        .filter_map(|(path, _)| {
            let name = path.file_name()?.to_str()?;
            let digits: String = name
                .strip_prefix("rank")?
                .trim_start_matches(['-', '_'])
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            digits.parse().ok()
        })
        .collect();
    ranks.sort_unstable();
    ranks.dedup();
    ranks
}

/// Six 64 x 64 layers: large enough that the step's small agreements do not count, deep enough
/// that the first layer's weight, which backward does not re-gather (its input needs no
/// gradient), is a small part of the model.
#[derive(Module, Debug)]
struct Wide {
    layers: Vec<burn::nn::Linear>,
}

/// What crosses "nodes" (ranks 0-1 and 2-3) per rank and step at stage 3 on 4 ranks: flat, every
/// collective spans both nodes (two all-gathers and a reduce-scatter of the parameters, up to
/// `9/4 Ψ` elements sent per rank); on a 2 x 2 mesh only the replicas' all-reduce and the world's small
/// agreement do. The replicas' all-reduce sends the theory, `2(R-1)/R · Ψ/S` elements per rank
/// (`estimate::step_traffic`, within 5%), flat sends at most its theory, and the inter-node
/// bytes are at most a quarter of the flat run's (2/9 in theory).
#[test]
fn a_two_by_two_mesh_sends_a_quarter_of_flat_stage_3_across_nodes() {
    let device = Device::flex().autodiff();
    let base = Wide {
        layers: (0..6)
            .map(|_| burn::nn::LinearConfig::new(64, 64).init(&device))
            .collect(),
    };
    let cross = |replicas: usize| -> Vec<(u64, u64, usize)> {
        run_ranks(InProcessGroup::new(4).unwrap(), |comm| {
            let device = Device::flex().autodiff();
            let (mut model, mut optim) = ShardConfig::new(Stage::Three)
                .with_replicas(replicas)
                .init(base.clone().fork(&device), AdamWConfig::new(), comm)
                .expect("init");
            let mut measured = (0, 0);
            for step in 0..3 {
                let before = (optim.comm().stats(), optim.mesh().map(|m| m.replicate().stats()));
                let x = Tensor::<2>::ones([3, 64], &device).mul_scalar(step as f32 + 1.0);
                let out = model.layers.iter().fold(x, |x, layer| layer.forward(x));
                let loss = out.powi_scalar(2).mean();
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                model = optim.step(LR, model, grads).expect("step");
                let world = optim.comm().stats().since(&before.0).total_bytes_sent();
                let replica = match (optim.mesh(), before.1) {
                    (Some(mesh), Some(b)) => mesh.replicate().stats().since(&b).total_bytes_sent(),
                    _ => 0,
                };
                measured = (world, replica);
            }
            let padded: usize = optim.report().layout().buckets().iter().map(|b| b.padded_numel).sum();
            (measured.0, measured.1, padded)
        })
        .expect("no rank panics")
    };
    let flat = cross(1);
    let hsdp = cross(2);
    for rank in 0..4 {
        let (flat_world, _, _) = flat[rank];
        let (world, replica, local_numel) = hsdp[rank];
        // Stage 3's local layout holds this rank's shards: Ψ / S elements (padded); the theory
        // is `burn-shard estimate`'s.
        let psi = (local_numel * 2) as f64;
        let theory = step_traffic(psi, 4, 2, Stage::Three, ParamDtype::F32).replica_group_bytes;
        let flat_theory = step_traffic(psi, 4, 1, Stage::Three, ParamDtype::F32).shard_group_bytes;
        assert!(
            flat_world as f64 <= flat_theory,
            "rank {rank}: flat sent {flat_world} B, at most {flat_theory}"
        );
        let off = (replica as f64 - theory).abs() / theory;
        assert!(
            off <= 0.05,
            "rank {rank}: replica all-reduce sent {replica} bytes, theory {theory}"
        );
        let across = world + replica;
        assert!(
            across * 4 <= flat_world,
            "rank {rank}: {across} bytes across nodes per step on the mesh, {flat_world} flat"
        );
        println!(
            "rank {rank}: across nodes per step: flat {flat_world} B, 2 x 2 mesh {across} B (replicas {replica} B)"
        );
    }
}
