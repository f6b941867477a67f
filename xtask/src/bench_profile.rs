//! The per-phase profile of `cargo xtask bench sharding` (issue #15): one training step of rank
//! 0 split into forward, backward and optimizer step, on both sides, measured in the same runs as
//! the main table.
//!
//! Ours (the worker): wall time of forward (`Gpt::loss`: model forward and the loss), backward
//! (`loss.backward()` and `GradientsParams::from_grads`) and optimizer step
//! (`ShardedOptimizer::step`), and the time blocked on collectives (`CommStats::exposed`) split
//! by the phase it fell in: at stage 3 the all-gathers run in forward and backward and the
//! reduce-scatters in backward (backwards that do not match the learned structure leave
//! the last unit's to the step); at stages 0-2 every collective runs in the step. Burn's Flex CPU
//! backend executes each op eagerly when it is called (no queue: Burn's `fusion`, on in this
//! build, wraps only CubeCL devices, and Flex's own views only defer copies, never arithmetic), so
//! a phase's work has finished when its call returns and no read-back is needed to close it.
//! Stage 3's gradient checkpointing recomputes forward ops during `backward`: that work counts
//! as backward, as it does in PyTorch.
//!
//! PyTorch (`xtask/bench/torch_gpt.py`): wall time of forward (`zero_grad`, forward, loss),
//! backward (`loss.backward()`) and optimizer step (`opt.step()`, `loss.item()`). Its
//! collectives run inside DDP's and FSDP2's hooks and the ZeRO optimizer's step, so they are
//! part of those phases and not reported apart.
//!
//! Every number is the median over rank 0's timed steps of that phase alone, so the three
//! medians need not add up to the median step time of the main table.

use std::time::Instant;

use burn_shard::comm::CommStats;
use serde_json::{Value, json};

use super::{Row, floats, median, thousands};

/// One value per phase of a training step, in milliseconds.
#[derive(Clone, Copy, Debug)]
pub(super) struct Phases {
    /// Forward: model forward and loss (PyTorch: also `zero_grad`), ms.
    pub forward: f64,
    /// Backward: `loss.backward()` (ours: also `GradientsParams::from_grads`), ms.
    pub backward: f64,
    /// Optimizer step (ours: `ShardedOptimizer::step`; PyTorch: `opt.step()` and
    /// `loss.item()`), ms.
    pub optimizer: f64,
}

impl Phases {
    /// The JSON keys of the three per-step series, with `prefix` (e.g. `comm_`) before each.
    fn keys(prefix: &str) -> [String; 3] {
        ["forward_ms", "backward_ms", "optimizer_ms"].map(|k| format!("{prefix}{k}"))
    }

    /// Medians (ms) of the per-step series `{prefix}forward_ms`, `{prefix}backward_ms` and
    /// `{prefix}optimizer_ms` of a worker's or the PyTorch script's JSON line; NaN for a
    /// missing series.
    pub(super) fn median_of(v: &Value, prefix: &str) -> Self {
        let [f, b, o] = Self::keys(prefix).map(|k| median(&floats(&v[k.as_str()])));
        Self {
            forward: f,
            backward: b,
            optimizer: o,
        }
    }

    /// Medians (ms) of the per-step differences of the series `{a}…_ms` less `{b}…_ms`
    /// (e.g. a phase's wall time less its time in collectives, step by step); NaN for a missing
    /// series.
    pub(super) fn median_of_difference(v: &Value, a: &str, b: &str) -> Self {
        let (ka, kb) = (Self::keys(a), Self::keys(b));
        let [f, bw, o] = [0, 1, 2].map(|i| {
            let (xa, xb) = (floats(&v[ka[i].as_str()]), floats(&v[kb[i].as_str()]));
            match xa.len() == xb.len() {
                true => median(&xa.iter().zip(&xb).map(|(x, y)| x - y).collect::<Vec<_>>()),
                false => f64::NAN,
            }
        });
        Self {
            forward: f,
            backward: bw,
            optimizer: o,
        }
    }

    fn each(self) -> [f64; 3] {
        [self.forward, self.backward, self.optimizer]
    }
}

/// A point of one step on one rank: the wall clock and the time that rank has been blocked on
/// collectives so far ([`CommStats::exposed`], ns).
#[derive(Clone, Copy)]
pub(super) struct Mark {
    at: Instant,
    comm_nanos: u64,
}

impl Mark {
    /// Reads the clock and the rank's exposed collective time from `stats`.
    pub(super) fn now(stats: &CommStats) -> Self {
        Self {
            at: Instant::now(),
            comm_nanos: stats.exposed().as_nanos() as u64,
        }
    }
}

/// Per-step series of one rank's phases (ms, one entry per timed step): wall time and time
/// inside collectives, each split into forward, backward and optimizer step.
#[derive(Default)]
pub(super) struct PhaseSeries {
    /// Wall time of forward, backward, optimizer step per step, ms.
    wall: [Vec<f64>; 3],
    /// Time inside collective calls during forward, backward, optimizer step per step, ms.
    comm: [Vec<f64>; 3],
}

impl PhaseSeries {
    /// Adds one step from its four marks: before forward, after forward (loss computed), after
    /// backward (gradients taken), after the optimizer step. Returns the step's wall time and
    /// its time in collectives, ms.
    pub(super) fn push(&mut self, marks: [Mark; 4]) -> (f64, f64) {
        for i in 0..3 {
            let (a, b) = (marks[i], marks[i + 1]);
            self.wall[i].push((b.at - a.at).as_secs_f64() * 1e3);
            self.comm[i].push(b.comm_nanos.saturating_sub(a.comm_nanos) as f64 / 1e6);
        }
        let (first, last) = (marks[0], marks[3]);
        (
            (last.at - first.at).as_secs_f64() * 1e3,
            last.comm_nanos.saturating_sub(first.comm_nanos) as f64 / 1e6,
        )
    }

    /// The series as the worker's JSON fields: `forward_ms`, `backward_ms`, `optimizer_ms` (wall)
    /// and the same with `comm_` before them (inside collectives), each a list of ms per step.
    pub(super) fn to_json(&self) -> serde_json::Map<String, Value> {
        let mut out = serde_json::Map::new();
        for (prefix, series) in [("", &self.wall), ("comm_", &self.comm)] {
            for (key, v) in Phases::keys(prefix).into_iter().zip(series) {
                out.insert(key, json!(v));
            }
        }
        out
    }
}

/// The profile columns that `bench_sharding.csv` gains (after the existing ones).
pub(super) const CSV_HEADER: [&str; 13] = [
    "ours_forward_ms",
    "ours_backward_ms",
    "ours_optimizer_ms",
    "ours_collective_forward_ms",
    "ours_collective_backward_ms",
    "ours_collective_optimizer_ms",
    "ours_forward_less_collective_ms",
    "ours_backward_less_collective_ms",
    "ours_optimizer_less_collective_ms",
    "pytorch_forward_ms",
    "pytorch_backward_ms",
    "pytorch_optimizer_ms",
    "phase_sum_ours_over_pytorch",
];

/// One row's values of [`CSV_HEADER`]: medians over the timed steps in ms (3 decimals),
/// PyTorch's empty where it did not run, and the ratio of the sums of the three phase medians.
pub(super) fn csv_fields(row: &Row) -> Vec<String> {
    let o = &row.ours;
    let t = row.theirs.as_ref().ok();
    let ms = |x: f64| format!("{x:.3}");
    let mut out: Vec<String> = [o.phases, o.comm_phases, o.compute_phases]
        .into_iter()
        .flat_map(Phases::each)
        .map(ms)
        .collect();
    match t {
        Some(t) => {
            out.extend(t.phases.each().map(ms));
            out.push(ms(sum(o.phases) / sum(t.phases)));
        }
        None => out.extend(std::iter::repeat_n(String::new(), 4)),
    }
    out
}

fn sum(p: Phases) -> f64 {
    p.each().iter().sum()
}

/// Prints the second table, "per-phase profile (ms/step, rank 0)": ours next to PyTorch per
/// phase with the ratio, our time inside collectives per phase, and our phases less it.
pub(super) fn print_table(rows: &[Row]) {
    println!();
    println!("Per-phase profile (ms/step, rank 0): median over the timed steps of each phase alone.");
    println!(
        "Forward = model forward + loss (PyTorch: with zero_grad); backward = loss.backward() (ours: with \
         GradientsParams::from_grads); step = optimizer step (ours: ShardedOptimizer::step; PyTorch: opt.step() and \
         loss.item()). Both sides run eagerly on the CPU, so each phase's work is done when its call returns. \
         PyTorch's phases include its collectives (DDP and FSDP2 run them in hooks, ZeroRedundancyOptimizer in \
         opt.step()): they cannot be timed apart from outside and are not reported. Ours: collectives = time inside \
         collective calls in each phase (waiting for the other ranks included); less collectives = median of the \
         phase's wall time less that time, step by step."
    );
    println!();
    println!(
        "| model (Ψ) | ours | PyTorch | forward ours | forward PyTorch | forward ours/PyTorch \
         | backward ours | backward PyTorch | backward ours/PyTorch | step ours | step PyTorch | step ours/PyTorch \
         | ours collectives fwd / bwd / step | ours less collectives fwd / bwd / step |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        let o = &r.ours;
        let t = r.theirs.as_ref().ok();
        let mut cells = vec![
            format!("{} ({})", r.size.name(), thousands(o.params)),
            format!("{}, N={}", r.config.label, r.world_size),
            if t.is_some() {
                r.config.torch_label.to_string()
            } else {
                "-".into()
            },
        ];
        for (i, ours) in o.phases.each().into_iter().enumerate() {
            cells.push(format!("{ours:.1}"));
            match t {
                Some(t) => {
                    let theirs = t.phases.each()[i];
                    cells.push(format!("{theirs:.1}"));
                    cells.push(format!("{:.2}x", ours / theirs));
                }
                None => cells.extend(["n/a".to_string(), "n/a".to_string()]),
            }
        }
        let triple = |p: Phases| p.each().map(|x| format!("{x:.1}")).join(" / ");
        cells.push(triple(o.comm_phases));
        cells.push(triple(o.compute_phases));
        println!("| {} |", cells.join(" | "));
    }
}
