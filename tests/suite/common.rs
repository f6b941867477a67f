//! Reference models, deterministic data and the unwrapped single-device training loop that
//! every sharded run is compared against.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::nn::loss::{MseLoss, Reduction};
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::prelude::*;

/// A small MLP whose sizes divide by no world size in 2..=4 (5·7=35, 7, 7·3=21, 3) and whose
/// last bias (3 elements) is smaller than 4 ranks; `scale` is a scalar parameter.
#[derive(Module, Debug)]
pub struct TinyMlp {
    pub l1: Linear,
    pub act: Relu,
    pub l2: Linear,
    pub scale: Param<Tensor<1>>,
}

pub const IN: usize = 5;
pub const OUT: usize = 3;

impl TinyMlp {
    pub fn new(device: &Device) -> Self {
        Self {
            l1: LinearConfig::new(IN, 7).init(device),
            act: Relu::new(),
            l2: LinearConfig::new(7, OUT).init(device),
            scale: Param::from_tensor(Tensor::from_floats([1.5], device).require_grad()),
        }
    }

    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let h = self.l2.forward(self.act.forward(self.l1.forward(x)));
        h * self.scale.val().unsqueeze::<2>()
    }
}

/// A deterministic pseudo-random stream (SplitMix64), so data never depends on Burn's global RNG
/// or on which thread asks first.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_f32(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next_f32()).collect()
    }
}

/// The global batch of step `step`: fresh inputs `x` `[batch, IN]` and targets `y` `[batch, OUT]`
/// from a fixed linear teacher (so the loss can fall), as host rows.
pub fn batch(step: usize, batch: usize) -> (Vec<f32>, Vec<f32>) {
    let teacher = Rng::new(5).vec(IN * OUT);
    let x = Rng::new(1000 + step as u64).vec(batch * IN);
    let y = (0..batch)
        .flat_map(|b| {
            let (x, teacher) = (&x, &teacher);
            (0..OUT).map(move |o| (0..IN).map(|i| x[b * IN + i] * teacher[i * OUT + o]).sum::<f32>())
        })
        .collect();
    (x, y)
}

/// Rows `[start, end)` of a row-major host matrix as a tensor.
pub fn rows(data: &[f32], width: usize, start: usize, end: usize, device: &Device) -> Tensor<2> {
    let slice = data[start * width..end * width].to_vec();
    Tensor::from_data(TensorData::new(slice, [end - start, width]), device)
}

pub fn mse(model: &TinyMlp, x: Tensor<2>, y: Tensor<2>) -> Tensor<1> {
    MseLoss::new().forward(model.forward(x), y, Reduction::Mean)
}

/// Every float parameter of `module`, flattened in traversal order.
pub fn params_of<M: Module>(module: &M) -> Vec<f32> {
    struct Collect(Vec<f32>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            self.0.extend(p.val().into_data().convert::<f32>().iter::<f32>());
        }
    }
    let mut c = Collect(Vec::new());
    module.visit(&mut c);
    c.0
}

/// Unwrapped single-device Burn training on the whole global batch: per-step losses and the
/// final parameters.
pub fn reference_run(
    base: &TinyMlp,
    mut optim: ModuleOptimizer,
    steps: usize,
    global_batch: usize,
    lr: f64,
) -> (Vec<f32>, Vec<f32>) {
    reference_loop(base, steps, global_batch, |_, model, grads| {
        optim.step(lr, model, grads)
    })
}

/// The single-device loop of [`reference_run`] with the update left to `update(step, model,
/// grads)` (clipping, skipping, schedules): the per-step losses and the final parameters.
pub fn reference_loop<F>(base: &TinyMlp, steps: usize, global_batch: usize, mut update: F) -> (Vec<f32>, Vec<f32>)
where
    F: FnMut(usize, TinyMlp, GradientsParams) -> TinyMlp,
{
    let device = Device::flex().autodiff();
    let mut model = base.clone().fork(&device);
    let mut losses = Vec::new();
    for step in 0..steps {
        let (x, y) = batch(step, global_batch);
        let loss = mse(
            &model,
            rows(&x, IN, 0, global_batch, &device),
            rows(&y, OUT, 0, global_batch, &device),
        );
        losses.push(loss.clone().into_scalar::<f32>());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = update(step, model, grads);
    }
    (losses, params_of(&model))
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "compared buffers differ in length");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// One sharded training step on this rank's `loss`: returns the model after
/// [`ShardedOptimizer::step`](burn_shard::ShardedOptimizer::step) and the loss averaged over
/// ranks (the loss of the global batch when every rank holds an equal share of it).
pub fn sharded_step<M: Module, O: burn_shard::MasterWeightStep>(
    optim: &mut burn_shard::ShardedOptimizer<O>,
    model: M,
    loss: Tensor<1>,
    lr: impl Into<burn::lr_scheduler::module_lr_scheduler::ModuleLearningRate>,
) -> (M, f32) {
    let global = optim
        .comm()
        .all_reduce(loss.clone().inner(), burn_shard_comm::ReduceOp::Avg)
        .expect("loss all_reduce")
        .into_scalar::<f32>();
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    (optim.step(lr, model, grads).expect("sharded step"), global)
}

/// A fresh directory `area/name` under the target dir's test scratch space (or under
/// `BURN_SHARD_SCRATCH`, which the GPU bundle's run.sh sets: there the build's target dir does
/// not exist), removed first if a previous run left it.
pub fn scratch(area: &str, name: &str) -> std::path::PathBuf {
    let root = std::env::var_os("BURN_SHARD_SCRATCH")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")));
    let dir = root.join(area).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Every file of the checkpoint `dir` but `meta.json` (relative path, bytes), sorted: what two
/// runs that saved the same state write alike (`meta.json` also names the run that wrote it, a
/// random id). Panics when there is none.
pub fn checkpoint_files(dir: &std::path::Path) -> Vec<(std::path::PathBuf, Vec<u8>)> {
    let mut files = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            match path.is_dir() {
                true => todo.push(path),
                false if path.file_name().is_some_and(|n| n == "meta.json") => {}
                false => files.push((
                    path.strip_prefix(dir).unwrap().to_path_buf(),
                    std::fs::read(&path).unwrap(),
                )),
            }
        }
    }
    files.sort();
    assert!(!files.is_empty(), "no checkpoint under {}", dir.display());
    files
}

/// Rows `[start, end)` of a global batch of `global` rows that rank `rank` of `world_size`
/// trains on (equal shares; `global` divisible by `world_size`).
pub fn rank_rows(rank: usize, world_size: usize, global: usize) -> (usize, usize) {
    let per_rank = global / world_size;
    (rank * per_rank, (rank + 1) * per_rank)
}

/// Runs `rank_run(comm, stage)` on world sizes 1-4 at stages 0-3 (ranks as threads) and checks
/// that every rank ends with bitwise-identical parameters and that rank 0's per-step values
/// (losses, norms) and parameters equal `reference`'s: relative difference <= `tolerance` per
/// value, absolute difference <= `tolerance` per parameter.
pub fn sweep<F>(name: &str, reference: &(Vec<f32>, Vec<f32>), tolerance: f32, rank_run: F)
where
    F: Fn(burn_shard_comm::InProcessComm, burn_shard::Stage) -> (Vec<f32>, Vec<f32>) + Sync,
{
    use burn_shard::Stage;
    let (ref_values, ref_params) = reference;
    for world_size in 1..=4 {
        for stage in [Stage::Zero, Stage::One, Stage::Two, Stage::Three] {
            let ctx = format!("{name}, world_size {world_size}, stage {stage}");
            let group = burn_shard_comm::InProcessGroup::new(world_size).unwrap();
            let results = burn_shard_comm::run_ranks(group, |comm| rank_run(comm, stage)).expect("no rank panics");
            for (rank, (_, params)) in results.iter().enumerate().skip(1) {
                assert_eq!(
                    params, &results[0].1,
                    "{ctx}: rank {rank} holds other parameters than rank 0"
                );
            }
            let (values, params) = &results[0];
            assert_eq!(values.len(), ref_values.len(), "{ctx}: number of per-step values");
            for (step, (a, b)) in values.iter().zip(ref_values).enumerate() {
                let rel = (a - b).abs() / b.abs().max(1e-12);
                assert!(
                    rel <= tolerance,
                    "{ctx}: step {step}: {a} vs reference {b} (rel {rel:e})"
                );
            }
            let diff = max_abs_diff(params, ref_params);
            assert!(diff <= tolerance, "{ctx}: max |param - reference| = {diff:e}");
        }
    }
}

/// `param` with its value replaced by `f(value)` as a fresh leaf, its id and require-grad kept:
/// what a Burn mapper that computes new values must do (a computed tensor is no leaf, and would
/// get no gradient).
pub fn remap<const D: usize>(param: Param<Tensor<D>>, f: impl FnOnce(Tensor<D>) -> Tensor<D>) -> Param<Tensor<D>> {
    let (id, value, mapper) = param.consume();
    let require_grad = value.is_require_grad();
    let mut value = f(value).detach();
    if require_grad {
        value = value.require_grad();
    }
    Param::from_mapped_value(id, value, mapper)
}

/// `module` with every float parameter cast to `dtype` (ids and require-grad kept).
pub fn cast<M: Module>(module: M, dtype: burn::tensor::DType) -> M {
    struct Cast(burn::tensor::DType);
    impl ModuleMapper for Cast {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            remap(param, |value| value.cast(self.0))
        }
    }
    module.map(&mut Cast(dtype))
}

/// The ids of a module's float parameters, with their ranks.
pub fn param_ids<M: Module>(module: &M) -> Vec<(ParamId, usize)> {
    struct Ids(Vec<(ParamId, usize)>);
    impl ModuleVisitor for Ids {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            self.0.push((p.id, D));
        }
    }
    let mut ids = Ids(Vec::new());
    module.visit(&mut ids);
    ids.0
}

/// `f(grad)` for the gradient of `id` (rank `d`), written back.
pub fn map_grad(grads: &mut GradientsParams, id: ParamId, d: usize, mut f: impl FnMut(Tensor<2>) -> Tensor<2>) {
    match d {
        1 => {
            let g = grads.remove::<1>(id).expect("a gradient");
            let n = g.dims()[0];
            grads.register(id, f(g.reshape([1, n])).reshape([n]));
        }
        2 => {
            let g = grads.remove::<2>(id).expect("a gradient");
            grads.register(id, f(g));
        }
        _ => unreachable!("TinyMlp has rank-1 and rank-2 parameters"),
    }
}

/// The L2 norm of all of `grads` (the gradients of `model`'s parameters), in float64.
pub fn grad_norm(model: &TinyMlp, grads: &mut GradientsParams) -> f64 {
    let mut sum = 0.0f64;
    for (id, d) in param_ids(model) {
        map_grad(grads, id, d, |g| {
            let data = g.clone().into_data().convert::<f64>();
            sum += data.iter::<f64>().map(|v| v * v).sum::<f64>();
            g
        });
    }
    sum.sqrt()
}
