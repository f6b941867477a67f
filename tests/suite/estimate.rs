//! The memory estimator: the ZeRO paper's published figures, the `burn-shard estimate` command,
//! and the extrapolation from a built model against direct measurements.

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::DType;
use burn_shard::estimate::{self, GB, ModelStateEstimate, OffloadTarget, ParamDtype, STAGES};
use burn_shard::{FlatLayout, MemoryReport, Stage};

use crate::common::cast;

/// The ZeRO paper's example (Rajbhandari et al. 2020, §5.1, Figure 1): 7.5B parameters on 64
/// ranks, mixed-precision Adam (K = 12).
const PAPER_PSI: f64 = 7.5e9;
const PAPER_N: usize = 64;
/// Per-rank GB at stages 0 to 3, as published (one decimal).
const PAPER_GB: [f64; 4] = [120.0, 31.4, 16.6, 1.9];

#[test]
fn zero_formula_gives_the_papers_figures_for_7_5b_on_64_ranks() {
    for (stage, published) in STAGES.into_iter().zip(PAPER_GB) {
        for dtype in [ParamDtype::Bf16, ParamDtype::F16] {
            let e = estimate::zero_formula(PAPER_PSI, PAPER_N, stage, dtype, OffloadTarget::None);
            let gb = (e.total_bytes() / GB * 10.0).round() / 10.0;
            assert_eq!(gb, published, "stage {stage} {dtype}: {} GB", e.total_bytes() / GB);
            assert_eq!(e.host_bytes, 0.0);
            assert_eq!(e.device_bytes(), e.total_bytes());
        }
    }
    // The components: (2+2+K)Ψ at stage 0, 2Ψ + 2Ψ + KΨ/N at stage 1, ...
    let s1 = estimate::zero_formula(PAPER_PSI, PAPER_N, Stage::One, ParamDtype::Bf16, OffloadTarget::None);
    assert_eq!(s1.parameters_bytes, 2.0 * PAPER_PSI);
    assert_eq!(s1.gradients_bytes, 2.0 * PAPER_PSI);
    assert_eq!(s1.optimizer_state_bytes, 12.0 * PAPER_PSI / 64.0);
    let s2 = estimate::zero_formula(PAPER_PSI, PAPER_N, Stage::Two, ParamDtype::Bf16, OffloadTarget::None);
    assert_eq!(s2.gradients_bytes, 2.0 * PAPER_PSI / 64.0);
}

#[test]
fn zero_formula_f32_and_offload() {
    let (psi, n) = (1e6, 8.0);
    let f32_totals = [
        16.0 * psi,
        8.0 * psi + 8.0 * psi / n,
        4.0 * psi + 12.0 * psi / n,
        16.0 * psi / n,
    ];
    for (stage, want) in STAGES.into_iter().zip(f32_totals) {
        let e = estimate::zero_formula(psi, n as usize, stage, ParamDtype::F32, OffloadTarget::None);
        assert!((e.total_bytes() - want).abs() < 1e-6, "stage {stage}: {e:?}");
    }
    // ZeRO-Offload: optimizer state and masters to the host, parameters and gradients stay.
    for stage in STAGES {
        let on = estimate::zero_formula(psi, n as usize, stage, ParamDtype::Bf16, OffloadTarget::Cpu);
        let off = estimate::zero_formula(psi, n as usize, stage, ParamDtype::Bf16, OffloadTarget::None);
        assert_eq!(on.optimizer_state_bytes, 0.0);
        assert_eq!(on.host_bytes, off.optimizer_state_bytes);
        assert_eq!(
            on.parameters_bytes + on.gradients_bytes,
            off.parameters_bytes + off.gradients_bytes
        );
        let expected_host = if stage == Stage::Zero {
            12.0 * psi
        } else {
            12.0 * psi / n
        };
        assert_eq!(on.host_bytes, expected_host, "stage {stage}");
        let f32_host = estimate::zero_formula(psi, n as usize, stage, ParamDtype::F32, OffloadTarget::Cpu).host_bytes;
        assert_eq!(f32_host, expected_host * 8.0 / 12.0, "stage {stage} f32");
        // ZeRO-Infinity's NVMe offload: the same bytes on disk, none in host memory.
        let nvme = estimate::zero_formula(psi, n as usize, stage, ParamDtype::Bf16, OffloadTarget::Nvme);
        assert_eq!(
            (nvme.optimizer_state_bytes, nvme.host_bytes),
            (0.0, 0.0),
            "stage {stage}"
        );
        assert_eq!(nvme.disk_bytes, expected_host, "stage {stage}");
        assert_eq!(nvme.device_bytes(), on.device_bytes(), "stage {stage}");
        assert_eq!(
            nvme.total_bytes(),
            on.device_bytes(),
            "stage {stage}: disk is not memory"
        );
    }
}

/// `--offload nvme` adds the disk column with `12Ψ/N` (bf16, stages 1-3), and names ZeRO-Infinity;
/// `--offload` alone stays host memory.
#[test]
fn estimate_command_offload_nvme_prints_disk_bytes() {
    let run = |extra: &[&str]| {
        let out = std::process::Command::new(burn_shard_bin())
            .args(["estimate", "--params", "7.5e9", "--world-size", "64", "--stage", "3"])
            .args(extra)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let nvme = run(&["--offload", "nvme"]);
    let row = nvme.lines().find(|l| l.starts_with('3')).expect("the stage 3 row");
    // 12 × 7.5e9 / 64 = 1.40625 GB on disk; 4 × 7.5e9 / 64 = 0.47 GB on the device.
    assert!(
        row.trim_end().ends_with("1.4 GB / 1.3 GiB"),
        "{row}
{nvme}"
    );
    assert!(
        row.contains("0.469 GB"),
        "{row}
{nvme}"
    );
    assert!(
        nvme.contains("disk (offloaded)") && nvme.contains("ZeRO-Infinity") && nvme.contains("SC21"),
        "{nvme}"
    );
    let cpu = run(&["--offload"]);
    assert!(cpu.contains("host (offloaded)") && !cpu.contains("disk"), "{cpu}");

    // --offload-params: stage 3's 2Ψ/N parameter bytes (0.234 GB) leave the device for the host.
    let both = run(&["--offload", "nvme", "--offload-params"]);
    let row = both.lines().find(|l| l.starts_with('3')).expect("the stage 3 row");
    let cells: Vec<&str> = row.split("  ").map(str::trim).filter(|c| !c.is_empty()).collect();
    assert_eq!(
        cells,
        [
            "3",
            "0.0 GB / 0.0 GiB",
            "0.234 GB / 0.218 GiB",
            "0.0 GB / 0.0 GiB",
            "0.234 GB / 0.218 GiB",
            "0.234 GB / 0.218 GiB",
            "1.4 GB / 1.3 GiB"
        ],
        "stage, parameters, gradients, optimizer state, device total, host, disk:\n{both}"
    );
    assert!(
        both.contains("Parameter offload") && both.contains("host (offloaded)"),
        "{both}"
    );
    // --offload-params nvme: the 2Ψ/N parameter and 2Ψ/N gradient shards join the 12Ψ/N of
    // optimizer state on disk (1.875 GB); nothing of the model state is left on the device.
    let disk = run(&["--offload", "nvme", "--offload-params", "nvme"]);
    let row = disk.lines().find(|l| l.starts_with('3')).expect("the stage 3 row");
    let cells: Vec<&str> = row.split("  ").map(str::trim).filter(|c| !c.is_empty()).collect();
    let zero = "0.0 GB / 0.0 GiB";
    assert_eq!(
        cells,
        ["3", zero, zero, zero, zero, "1.9 GB / 1.7 GiB"],
        "stage, parameters, gradients, optimizer state, device total, disk:\n{disk}"
    );
    assert!(
        disk.contains("Parameter offload to NVMe") && !disk.contains("host (offloaded)"),
        "{disk}"
    );
    // Without the optimizer offloaded, parameter offload is refused by clap (it needs --offload).
    let out = std::process::Command::new(burn_shard_bin())
        .args(["estimate", "--params", "1e9", "--world-size", "8", "--offload-params"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("required arguments were not provided") && stderr.contains("--offload ["),
        "{stderr}"
    );
}

/// `with_params_offloaded` moves stage 3's parameter shards (`2Ψ/N` in mixed precision, `4Ψ/N`
/// in f32) to host memory and leaves stages 0-2, whose parameters are whole, as they are.
#[test]
fn params_offloaded_moves_only_stage_3_parameters_to_the_host() {
    let (psi, n) = (1e9, 8usize);
    for dtype in [ParamDtype::Bf16, ParamDtype::F32] {
        for stage in STAGES {
            let e = estimate::zero_formula(psi, n, stage, dtype, OffloadTarget::Cpu);
            let p = e.with_params_offloaded();
            assert_eq!(p.total_bytes(), e.total_bytes(), "{stage} {dtype}: nothing lost");
            if stage == Stage::Three {
                let shard = dtype.element_bytes() * psi / n as f64;
                assert_eq!(
                    (p.parameters_bytes, p.host_bytes),
                    (0.0, e.host_bytes + shard),
                    "{dtype}"
                );
            } else {
                assert_eq!(p, e, "{stage} {dtype}: unchanged");
            }
        }
    }
}

/// `with_params_on_disk` moves stage 3's parameter and gradient shards (`2Ψ/N` each in mixed
/// precision, `4Ψ/N` in f32) to disk and leaves stages 0-2 as they are.
#[test]
fn params_on_disk_moves_only_stage_3_shards_to_disk() {
    let (psi, n) = (1e9, 8usize);
    for dtype in [ParamDtype::Bf16, ParamDtype::F32] {
        for stage in STAGES {
            let e = estimate::zero_formula(psi, n, stage, dtype, OffloadTarget::Nvme);
            let d = e.with_params_on_disk();
            if stage == Stage::Three {
                let shard = dtype.element_bytes() * psi / n as f64;
                assert_eq!(
                    (d.parameters_bytes, d.gradients_bytes, d.disk_bytes, d.total_bytes()),
                    (0.0, 0.0, e.disk_bytes + 2.0 * shard, 0.0),
                    "{dtype}"
                );
            } else {
                assert_eq!(d, e, "{stage} {dtype}: unchanged");
            }
        }
    }
}

/// The `burn-shard` binary of this build (cargo builds it for burn-shard-cli's own tests, in
/// the same `cargo test --workspace`).
pub(crate) fn burn_shard_bin() -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let bin = exe
        .parent()
        .and_then(|deps| deps.parent())
        .unwrap()
        .join(format!("burn-shard{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.exists(),
        "{} is missing: run the tests with `cargo test --release --workspace`, which builds it",
        bin.display()
    );
    bin
}

#[test]
fn estimate_command_prints_the_papers_figures() {
    let out = std::process::Command::new(burn_shard_bin())
        .args(["estimate", "--params", "7.5e9", "--world-size", "64"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<&str> = stdout.lines().filter(|l| l.starts_with(['0', '1', '2', '3'])).collect();
    assert_eq!(rows.len(), 4, "one row per stage:\n{stdout}");
    for (row, gb) in rows.iter().zip(PAPER_GB) {
        // The last column is the total.
        let total = row.rsplit("  ").next().unwrap().trim();
        assert!(total.starts_with(&format!("{gb:.1} GB")), "{row}\n{stdout}");
    }
    for figure in ["120.0", "31.4", "16.6", "1.9"] {
        assert!(stdout.contains(figure), "{figure} missing:\n{stdout}");
    }
    assert!(
        stdout.contains("ZeRO") && stdout.contains("§5.1") && stdout.contains("K=12"),
        "{stdout}"
    );
}

#[derive(Module, Debug)]
struct ThreeLinear {
    a: Linear,
    b: Linear,
    c: Linear,
}

/// Ψ = 13·17 + 17 + 17·9 + 9 + 9·5 + 5 = 450, every parameter of odd size, so buckets and
/// parameters are padded at 2 and 4 ranks.
fn three_linear(device: &Device) -> ThreeLinear {
    ThreeLinear {
        a: LinearConfig::new(13, 17).init(device),
        b: LinearConfig::new(17, 9).init(device),
        c: LinearConfig::new(9, 5).init(device),
    }
}

/// The largest of each component over the ranks.
fn busiest(reports: &[MemoryReport]) -> [usize; 3] {
    let max = |f: fn(&MemoryReport) -> usize| reports.iter().map(f).max().unwrap();
    [
        max(|r| r.parameters_bytes),
        max(|r| r.gradients_bytes),
        max(|r| r.optimizer_state_bytes),
    ]
}

fn components(e: &ModelStateEstimate) -> [f64; 3] {
    [e.parameters_bytes, e.gradients_bytes, e.optimizer_state_bytes]
}

/// The padding bound of `estimate_model`: fewer than `n` elements per padded unit (bucket at
/// stages 0-2, parameter at stage 3) for each tensor of parameter size in the component:
/// parameters 1, gradients 1, optimizer state 2 (Adam's moments, `f32`) plus the `f32` master.
fn bounds(units: usize, n: usize, elem: usize, master: bool) -> [f64; 3] {
    let per = (units * n) as f64;
    [
        per * elem as f64,
        per * elem as f64,
        per * (8 + if master { 4 } else { 0 }) as f64,
    ]
}

fn assert_within(what: &str, got: [f64; 3], want: [f64; 3], bound: [f64; 3]) {
    for (i, name) in ["parameters", "gradients", "optimizer state"].iter().enumerate() {
        assert!(
            (got[i] - want[i]).abs() < bound[i],
            "{what} {name}: {} B vs {} B (bound {} B)",
            got[i],
            want[i],
            bound[i]
        );
    }
}

/// Extrapolates `model` to 4 ranks, measures it on 4 ranks, and compares both with each other
/// and with the paper's formula for `dtype`.
fn check_against_direct_measurement<M: Module>(model: &M, dtype: ParamDtype) {
    let n = 4;
    let layout = FlatLayout::from_module(model, 1, 1 << 30).unwrap();
    let psi = layout.numel();
    let params = layout.slots().len();
    let elem = dtype.element_bytes() as usize;
    let master = dtype.is_mixed_precision();

    let estimated = estimate::estimate_model(model, n).unwrap();
    assert_eq!(estimated.parameter_count, psi);
    assert_eq!(estimated.world_size, n);
    assert_eq!(estimated.stages.len(), 4);
    for stage in STAGES {
        let e = estimated.stage(stage);
        assert_eq!((e.stage, e.world_size, e.host_bytes), (stage, n, 0.0));
        let reports = estimate::measure_memory(model, stage, n).unwrap();
        assert_eq!(reports.len(), n);
        assert!(reports.iter().all(|r| r.world_size == n && r.stage == stage.number()));
        let measured = busiest(&reports).map(|b| b as f64);
        // One bucket at stages 0-2 (the model is far below the default bucket size), one padded
        // unit per parameter at stage 3; `params` bounds both.
        let bound = bounds(params, n, elem, master);
        assert_within(
            &format!("{dtype} stage {stage}: extrapolated vs measured on {n} ranks"),
            components(e),
            measured,
            bound,
        );
        let formula = estimate::zero_formula(psi as f64, n, stage, dtype, OffloadTarget::None);
        assert_within(
            &format!("{dtype} stage {stage}: measured vs ZeRO formula"),
            measured,
            components(&formula),
            bound,
        );
    }
}

#[test]
fn estimate_model_extrapolates_to_what_4_ranks_measure_f32() {
    let device = Device::flex().autodiff();
    check_against_direct_measurement(&three_linear(&device), ParamDtype::F32);
}

#[test]
fn estimate_model_extrapolates_to_what_4_ranks_measure_bf16() {
    // bf16 parameters and gradients, f32 master weights and Adam moments: the paper's K = 12.
    let device = Device::flex().autodiff();
    check_against_direct_measurement(&cast(three_linear(&device), DType::BF16), ParamDtype::Bf16);
}

#[test]
fn estimate_model_refuses_a_model_without_autodiff() {
    let model = three_linear(&Device::flex());
    let err = estimate::estimate_model(&model, 4).unwrap_err().to_string();
    assert!(err.contains("autodiff"), "{err}");
    let err = estimate::estimate_model(&three_linear(&Device::flex().autodiff()), 0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("world size"), "{err}");
}

/// The main example's GPT (tiny-shakespeare defaults: 4 blocks of width 128, vocabulary 65,
/// context 64): what `cargo shakespeare --estimate --world-size 4` prints equals what 4
/// ranks measure training it, up to padding, and the ZeRO f32 formula.
#[test]
fn the_example_gpt_estimate_matches_its_measured_memory() {
    use burn_shard_examples::gpt::{Gpt, GptConfig};
    let device = Device::flex().autodiff();
    let config = GptConfig {
        vocab_size: 65,
        block_size: 64,
        n_embd: 128,
        n_head: 4,
        n_layer: 4,
    };
    check_against_direct_measurement(&Gpt::new(&config, &device), ParamDtype::F32);
}

/// `burn-shard estimate --replicas`: the memory of a flat run of `world_size / replicas` ranks,
/// and per step the bytes within a shard group and across replicas (`step_traffic`): for 7.5e9
/// bf16 parameters on 64 ranks as 8 nodes of 8 at stage 3, `3·7/8·Ψ·2` = 39.4 GB in the node and
/// `2·7/8·Ψ/8·2` = 3.3 GB across nodes, where flat stage 3 sends `3·63/64·Ψ·2` = 44.3 GB, all of
/// it across nodes. A `--replicas` that does not divide the world size is refused.
#[test]
fn estimate_command_takes_a_mesh_and_prints_the_traffic_by_group() {
    use burn_shard::estimate::{ParamDtype, step_traffic};
    let run = |extra: &[&str]| {
        std::process::Command::new(burn_shard_bin())
            .args(["estimate", "--params", "7.5e9", "--world-size", "64", "--stage", "3"])
            .args(extra)
            .output()
            .unwrap()
    };
    let out = run(&["--replicas", "8"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let memory = text.lines().find(|l| l.starts_with('3')).expect("the memory row");
    let traffic = text
        .lines()
        .find(|l| l.starts_with("stage 3"))
        .expect("the traffic row");
    // Memory: 16Ψ/8 = 15 GB per rank, as a flat run of 8 ranks.
    assert!(memory.trim_end().ends_with("15.0 GB / 14.0 GiB"), "{memory}\n{text}");
    assert!(
        traffic.contains("39.4 GB") && traffic.contains("3.3 GB"),
        "{traffic}\n{text}"
    );
    let hsdp = step_traffic(7.5e9, 64, 8, Stage::Three, ParamDtype::Bf16);
    let flat = step_traffic(7.5e9, 64, 1, Stage::Three, ParamDtype::Bf16);
    assert!((hsdp.shard_group_bytes - 3.0 * 7.0 / 8.0 * 7.5e9 * 2.0).abs() < 1.0);
    assert!((hsdp.replica_group_bytes - 2.0 * 7.0 / 8.0 * 7.5e9 / 8.0 * 2.0).abs() < 1.0);
    assert!((flat.shard_group_bytes - 3.0 * 63.0 / 64.0 * 7.5e9 * 2.0).abs() < 1.0);
    assert_eq!(flat.replica_group_bytes, 0.0);
    let bad = run(&["--replicas", "3"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("does not divide --world-size 64"));
}

/// `step_time` on 2 nodes of 2 ranks, 1e6 f32 parameters, 1 Gbit/s (1.25e8 bytes/s), 50 us one
/// way, 0.3 s without the link, 40 calls across: flat stage 3's link carries one rank's ring
/// volume, `3·3/4·Ψ·4` = 9 MB (0.072 s), and each call is 3 messages in a row (40·3·50 us =
/// 6 ms); on one group per node the link carries the 2 ranks' all-reduces of their shards,
/// `2·2·1/2·Ψ/2·4` = 4 MB (0.032 s), 2 messages a call. Half hidden halves the part added.
/// Meshes the model does not cover and bad inputs are refused.
#[test]
fn step_time_adds_the_ring_bytes_and_latency_across_nodes_to_the_step_without_the_link() {
    use burn_shard::estimate::{ComputeProfile, Links, ParamDtype, step_time};
    let links = Links {
        nodes: 2,
        ranks_per_node: 2,
        bytes_per_s: 1.25e8,
        latency_s: 50e-6,
    };
    let compute = ComputeProfile {
        step_s: 0.3,
        calls_across: 40.0,
        hidden_share: 0.0,
    };
    let close = |a: f64, b: f64| (a - b).abs() < 1e-9 * b.abs().max(1.0);
    let flat = step_time(1e6, Stage::Three, 1, ParamDtype::F32, &links, &compute).unwrap();
    assert!(close(flat.link_bytes, 9e6), "{flat:?}");
    assert!(close(flat.transfer_s, 0.072), "{flat:?}");
    assert!(close(flat.latency_s, 0.006), "{flat:?}");
    assert!(close(flat.step_s, 0.378), "{flat:?}");
    let hybrid = step_time(1e6, Stage::Three, 2, ParamDtype::F32, &links, &compute).unwrap();
    assert!(close(hybrid.link_bytes, 4e6), "{hybrid:?}");
    assert!(close(hybrid.latency_s, 0.004), "{hybrid:?}");
    assert!(close(hybrid.step_s, 0.3 + 0.032 + 0.004), "{hybrid:?}");
    let half = ComputeProfile {
        hidden_share: 0.5,
        ..compute
    };
    let hidden = step_time(1e6, Stage::Three, 1, ParamDtype::F32, &links, &half).unwrap();
    assert!(close(hidden.step_s, 0.3 + 0.039), "{hidden:?}");
    // One node: nothing crosses.
    let one = Links { nodes: 1, ..links };
    assert!(close(
        step_time(1e6, Stage::Three, 1, ParamDtype::F32, &one, &compute)
            .unwrap()
            .step_s,
        0.3
    ));
    for (replicas, nodes, bytes_per_s, why) in [
        (3, 4, 1.25e8, "replicas"),
        (1, 2, 0.0, "bandwidth"),
        (1, 0, 1.25e8, "nodes"),
    ] {
        let links = Links {
            nodes,
            bytes_per_s,
            ..links
        };
        let err = step_time(1e6, Stage::Three, replicas, ParamDtype::F32, &links, &compute).unwrap_err();
        assert!(err.to_string().contains(why), "{why}: {err}");
    }
}

/// `burn-shard estimate --time` for 7.5e9 bf16 parameters on 16 nodes x 8 GPUs with 400 Gbit/s
/// between nodes, 1 s per step without the link: flat stage 3 sends `3·127/128·Ψ·2` = 44.65 GB
/// per link (0.893 s at 50 GB/s), one group per node `2·15/16·Ψ·2` = 28.1 GB (0.5625 s) at
/// stages 1-3 alike; with 80 GB per GPU all three fit, and the tie goes to the least memory:
/// stage 3 on groups of 8 (15 GB of model state per rank). `--time` without its options is
/// refused.
#[test]
fn estimate_command_predicts_the_step_time_and_picks_a_stage_and_mesh() {
    let run = |extra: &[&str]| {
        std::process::Command::new(burn_shard_bin())
            .args(["estimate", "--params", "7.5e9", "--world-size", "128"])
            .args(extra)
            .output()
            .unwrap()
    };
    let out = run(&[
        "--time",
        "--nodes",
        "16",
        "--link-gbit",
        "400",
        "--step-s",
        "1",
        "--device-gb",
        "80",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}\n{text}", String::from_utf8_lossy(&out.stderr));
    let row = |stage: &str, mesh: &str| {
        text.lines()
            .find(|l| l.starts_with(&format!("stage {stage}")) && l.contains(mesh))
            .unwrap_or_else(|| panic!("no row for stage {stage}, {mesh}:\n{text}"))
            .to_string()
    };
    let flat3 = row("3", "flat");
    assert!(
        flat3.contains("44.648") && flat3.trim_end().ends_with("1.8930"),
        "{flat3}\n{text}"
    );
    let hybrid3 = row("3", "16 groups of 8");
    assert!(
        hybrid3.contains("28.125") && hybrid3.trim_end().ends_with("1.5625"),
        "{hybrid3}\n{text}"
    );
    let pick = text.lines().find(|l| l.starts_with("pick:")).expect("a pick");
    assert!(
        pick.contains("stage 3, 16 groups of 8") && pick.contains("1.5625 s"),
        "{pick}\n{text}"
    );
    assert!(text.contains("Extrapolated"), "{text}");
    let bad = run(&["--time", "--nodes", "16"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("--link-gbit"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
}

/// `comm-bench`'s probe (`burn_shard_examples::comm_bench::measure`) counts the bytes crossing
/// a node's link as `estimate::step_time` does for a stage-2 step, flat and one shard group per
/// node, so that its bandwidth goes into `--link-gbit` in the model's units; and those bytes are
/// what the ranks' ring collectives send (their own counters). 4 in-process ranks as 2 nodes of
/// 2, a 4096-parameter flat parameter in 2 calls, 3 timed iterations after 1.
#[test]
fn the_link_probe_counts_the_bytes_the_step_time_model_counts() {
    use std::sync::Arc;

    use burn_shard::comm::{Collective, CollectiveKind, InProcessGroup, run_ranks};
    use burn_shard::{Mesh, MeshLayout};
    use burn_shard_examples::comm_bench::measure;

    let (params, world, per_node, iterations) = (4096.0, 4, 2, 3);
    for replicas in [1, 2] {
        let traffic = estimate::step_traffic(params, world, replicas, Stage::Two, ParamDtype::F32);
        // Flat: the whole flat parameter; hybrid: one rank's shard of it.
        let bytes = (params * 4.0) as usize / if replicas == 1 { 1 } else { world / replicas };
        let group = InProcessGroup::new(world).unwrap();
        let results = run_ranks(group, |comm| {
            let mesh = Mesh::new(Arc::new(comm), replicas, MeshLayout::Consecutive).unwrap();
            // After the mesh's own agreement (an all-gather of two numbers).
            let before = (mesh.world().stats(), mesh.replicate().stats());
            let measured = measure(&mesh, bytes, 2, (1, iterations), per_node).unwrap();
            let sent = match replicas {
                1 => {
                    let stats = mesh.world().stats().since(&before.0);
                    stats.get(CollectiveKind::ReduceScatter).bytes_sent
                        + stats.get(CollectiveKind::AllGather).bytes_sent
                }
                _ => {
                    let stats = mesh.replicate().stats().since(&before.1);
                    stats.get(CollectiveKind::AllReduce).bytes_sent
                }
            };
            (measured, sent as f64 / (1 + iterations) as f64)
        })
        .unwrap();
        let model_link_bytes = match replicas {
            1 => traffic.shard_group_bytes,
            _ => per_node as f64 * traffic.replica_group_bytes,
        };
        // And what step_time itself says crosses a link at stage 2.
        let links = estimate::Links {
            nodes: world / per_node,
            ranks_per_node: per_node,
            bytes_per_s: 1e9,
            latency_s: 0.0,
        };
        let compute = estimate::ComputeProfile {
            step_s: 1.0,
            calls_across: 0.0,
            hidden_share: 0.0,
        };
        let modelled = estimate::step_time(params, Stage::Two, replicas, ParamDtype::F32, &links, &compute).unwrap();
        assert_eq!(modelled.link_bytes, model_link_bytes, "replicas {replicas}");
        for (rank, (measured, sent_per_iteration)) in results.into_iter().enumerate() {
            assert_eq!(
                measured.link_bytes, model_link_bytes,
                "replicas {replicas}, rank {rank}"
            );
            // Flat: the link carries one rank's ring volume; hybrid: the k replica rings' volumes.
            let rings = if replicas == 1 { 1.0 } else { per_node as f64 };
            assert_eq!(
                measured.link_bytes,
                rings * sent_per_iteration,
                "replicas {replicas}, rank {rank}"
            );
            assert!(measured.iteration_s > 0.0);
            assert_eq!(measured.link_bytes_per_s, measured.link_bytes / measured.iteration_s);
        }
    }
}
