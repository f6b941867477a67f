//! The device's copy bandwidth: the physical limit that a memory-bound kernel (the fused Adam
//! step) is measured against in the GPU benchmark.

use std::time::Instant;

use crate::CommError;

/// Device-to-device copy bandwidth of CUDA device `device_index`, in GB/s (1e9 bytes per
/// second), counting the bytes read and the bytes written (`2 * bytes` per copy): the fastest of
/// `reps` timed `cuMemcpyDtoD` calls of `bytes` bytes (after one warm-up copy), each timed from
/// the host around a stream synchronisation. Allocates `2 * bytes` bytes on the device for the
/// call.
///
/// # Errors
/// [`CommError::Unavailable`] when `libcuda` cannot be loaded; [`CommError::Backend`] when the
/// context, the allocation (device memory too small for `2 * bytes`) or the copy fails.
pub fn cuda_copy_bandwidth(device_index: usize, bytes: usize, reps: usize) -> Result<f64, CommError> {
    // SAFETY: only tries to dlopen libcuda (cudarc's own first use does the same).
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CommError::Unavailable(
            "libcuda cannot be loaded: this needs an NVIDIA GPU and its driver".into(),
        ));
    }
    let cuda = |what: &str, e: cudarc::driver::DriverError| CommError::Backend(format!("{what}: {e:?}"));
    let ctx = cudarc::driver::CudaContext::new(device_index).map_err(|e| cuda("CUDA context", e))?;
    let stream = ctx.default_stream();
    let src = stream
        .alloc_zeros::<u8>(bytes)
        .map_err(|e| cuda("device allocation", e))?;
    let mut dst = stream
        .alloc_zeros::<u8>(bytes)
        .map_err(|e| cuda("device allocation", e))?;
    let mut best = f64::INFINITY;
    for i in 0..=reps.max(1) {
        stream.synchronize().map_err(|e| cuda("synchronize", e))?;
        let start = Instant::now();
        stream.memcpy_dtod(&src, &mut dst).map_err(|e| cuda("copy", e))?;
        stream.synchronize().map_err(|e| cuda("synchronize", e))?;
        if i > 0 {
            best = best.min(start.elapsed().as_secs_f64());
        }
    }
    Ok(2.0 * bytes as f64 / best / 1e9)
}
