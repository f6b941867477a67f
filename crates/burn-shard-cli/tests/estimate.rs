//! `burn-shard estimate`, run as a user runs it. (Being an integration test of this package is
//! also what makes `cargo test --workspace` build the `burn-shard` binary, which the suite in
//! `tests/` runs too; this test links nothing but std.)

use std::process::{Command, Output};

fn estimate(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_burn-shard"))
        .arg("estimate")
        .args(args)
        .output()
        .unwrap()
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn estimate_one_stage_with_offload() {
    let out = estimate(&["--params", "7.5e9", "--world-size", "64", "--stage", "3", "--offload"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let rows: Vec<&str> = stdout.lines().filter(|l| l.starts_with(['0', '1', '2', '3'])).collect();
    assert_eq!(rows.len(), 1, "{stdout}");
    assert!(rows[0].starts_with('3'), "{stdout}");
    // 12Ψ/N = 1.40625 GB of optimizer state in host memory; 4Ψ/N = 0.469 GB on the device.
    assert!(stdout.contains("host"), "{stdout}");
    assert!(rows[0].ends_with("1.4 GB / 1.3 GiB"), "{stdout}");
    assert!(rows[0].contains("0.469 GB"), "{stdout}");
    assert!(stdout.contains("ZeRO-Offload"), "{stdout}");
}

#[test]
fn estimate_f32_uses_the_f32_accounting() {
    let out = estimate(&["--params", "1e9", "--world-size", "8", "--dtype", "f32"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    // 16Ψ, 8Ψ+8Ψ/N, 4Ψ+12Ψ/N, 16Ψ/N for Ψ = 1e9, N = 8.
    for (stage, total) in [("0", "16.0 GB"), ("1", "9.0 GB"), ("2", "5.5 GB"), ("3", "2.0 GB")] {
        let row = stdout.lines().find(|l| l.starts_with(stage)).unwrap();
        assert!(row.contains(total), "stage {stage}: {row}");
    }
}

#[test]
fn estimate_rejects_bad_input_with_clap_errors() {
    for (args, expect) in [
        (&["--params", "0", "--world-size", "8"][..], "above 0"),
        (&["--params", "-3", "--world-size", "8"][..], "above 0"),
        (&["--params", "seven", "--world-size", "8"][..], "not a number"),
        (&["--params", "inf", "--world-size", "8"][..], "finite"),
        (&["--params", "1e9", "--world-size", "0"][..], "--world-size"),
        (&["--params", "1e9", "--world-size", "8", "--stage", "4"][..], "--stage"),
        (
            &["--params", "1e9", "--world-size", "8", "--dtype", "f64"][..],
            "--dtype",
        ),
        (&["--world-size", "8"][..], "--params"),
    ] {
        let out = estimate(args);
        let (_, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.contains("error") && stderr.contains(expect),
            "{args:?}: {stderr}"
        );
    }
}
