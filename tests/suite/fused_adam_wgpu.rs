//! The CubeCL fused Adam kernel, run for real through wgpu (on CI: Mesa's lavapipe, a Vulkan
//! driver on the CPU), against the float64 reference.

use burn::optim::Optimizer;
use burn::prelude::*;
use burn::tensor::DType;
use burn_shard_kernels::{StepPath, cube_supports, wgpu_cpu_device};

use crate::common::Rng;
use crate::fused_adam::{check_master_kernel, reference_step, variants};

/// The wgpu CPU device, or `None` with the reason printed. With `BURN_SHARD_REQUIRE_WGPU` set
/// (CI's run after `cargo xtask setup` installed lavapipe) a missing device fails the test: it
/// is then a broken set-up, not a skip.
pub(crate) fn device() -> Option<Device> {
    match wgpu_cpu_device() {
        Ok(d) => Some(d),
        Err(reason) if std::env::var_os("BURN_SHARD_REQUIRE_WGPU").is_some() => {
            panic!("BURN_SHARD_REQUIRE_WGPU is set, so the CubeCL kernel must run: {reason}")
        }
        Err(reason) => {
            eprintln!("skipped: {reason}");
            None
        }
    }
}

#[test]
fn cubecl_kernel_on_wgpu_matches_a_float64_reference() {
    let Some(device) = device() else { return };
    // Lengths divisible by 4 (vectorised body only), tails of 1, 2 and 3 (5, 6, 7), a tail with
    // no body (1) and zero.
    for n in [0usize, 1, 5, 6, 7, 1000, 4099, 65_539, 1_000_003] {
        for (name, cfg) in variants() {
            let h = cfg.hyper();
            let optim = cfg.init();
            let mut rng = Rng::new(n as u64 + 17);
            let p0 = rng.vec(n);
            let mut p = Tensor::<1>::from_data(TensorData::new(p0.clone(), [n]), &device);
            assert_eq!(
                optim.path_for(&p),
                StepPath::CubeKernel,
                "{name}: the CubeCL kernel must run, not Burn's Adam"
            );
            let mut state = None;
            let mut p64: Vec<f64> = p0.iter().map(|&x| x as f64).collect();
            let (mut m64, mut v64, mut vmax64) = (vec![0f64; n], vec![0f64; n], vec![0f64; n]);
            for t in 1..=3 {
                let g: Vec<f32> = rng.vec(n).iter().map(|x| x * 2.0).collect();
                let g64: Vec<f64> = g.iter().map(|&x| x as f64).collect();
                let grad = Tensor::<1>::from_data(TensorData::new(g, [n]), &device);
                let (np, ns) = optim.step(1e-2, p, grad, state);
                p = np;
                state = ns;
                reference_step(&h, 1e-2, t, &mut p64, &g64, &mut m64, &mut v64, &mut vmax64);
            }
            let got: Vec<f32> = p.into_data().convert::<f32>().iter::<f32>().collect();
            assert_eq!(got.len(), n);
            for i in 0..n {
                let err = (got[i] as f64 - p64[i]).abs();
                assert!(
                    err <= 1e-6 + 1e-5 * p64[i].abs(),
                    "{name} n={n} element {i}: {} vs {}",
                    got[i],
                    p64[i]
                );
            }
            if n > 0 {
                let m: Vec<f32> = state
                    .unwrap()
                    .momentum
                    .moment_1
                    .into_data()
                    .convert::<f32>()
                    .iter::<f32>()
                    .collect();
                assert!(
                    (m[n - 1] as f64 - m64[n - 1]).abs() <= 1e-6 + 1e-5 * m64[n - 1].abs(),
                    "{name} n={n} exp_avg"
                );
            }
        }
    }
}

#[test]
fn cubecl_master_weight_kernel_on_wgpu_matches_a_float64_reference() {
    let Some(device) = device() else { return };
    // wgpu has no bf16; f16 needs the adapter's SHADER_F16 (lavapipe has it, Mesa's OpenGL
    // adapter does not): ask the adapter, never assume.
    let mut dtypes = vec![DType::F32];
    for dtype in [DType::F16, DType::BF16] {
        if cube_supports(&device, dtype) {
            dtypes.push(dtype);
        } else {
            eprintln!("skipped {dtype:?}: this wgpu adapter has no {dtype:?} shader support");
        }
    }
    check_master_kernel(&device, &dtypes, &[0, 1, 5, 6, 7, 4099, 65_539]);
}

/// The kernel steps its buffers in place only where nothing else holds them: a parameter, a
/// gradient and moments that the caller still holds keep their values (with Burn's `fusion`
/// on, a shared fusion tensor comes out as a second handle of one buffer and is copied before
/// writing), and a lazily computed parameter (still queued on the fusion stream) is stepped
/// from its computed value.
#[test]
fn the_cubecl_kernel_never_writes_a_buffer_another_tensor_holds() {
    let Some(device) = device() else { return };
    for n in [5usize, 4099] {
        for (name, cfg) in variants() {
            let optim = cfg.init();
            let mut rng = Rng::new(n as u64 + 3);
            let (p0, g0) = (rng.vec(n), rng.vec(n));
            let values = |t: &Tensor<1>| -> Vec<f32> { t.clone().into_data().convert::<f32>().iter::<f32>().collect() };
            // Lazy: `p0 · 2 / 2` is queued, not computed, when the step takes it.
            let p = Tensor::<1>::from_data(TensorData::new(p0.clone(), [n]), &device)
                .mul_scalar(2.0)
                .div_scalar(2.0);
            let held_p = p.clone();
            let grad = Tensor::<1>::from_data(TensorData::new(g0.clone(), [n]), &device);
            let held_grad = grad.clone();
            let (p1, state) = optim.step(1e-2, p, grad, None);
            let state = state.expect("stepped");
            let held_m = state.momentum.moment_1.clone();
            let m1 = values(&held_m);
            let (p2, _) = optim.step(1e-2, p1.clone(), held_grad.clone(), Some(state));
            assert_eq!(values(&held_p), p0, "{name} n={n}: a held parameter was written");
            assert_eq!(values(&held_grad), g0, "{name} n={n}: a held gradient was written");
            assert_eq!(values(&held_m), m1, "{name} n={n}: held moments were written");
            let (v1, v2) = (values(&p1), values(&p2));
            assert!(v1 != p0 && v2 != v1, "{name} n={n}: each step moves the parameter");
        }
    }
}
