//! Loading the libraries: whether `libcuda` and `libnccl` can be loaded on this machine, how many
//! GPUs it has, and whether the loaded libnccl exports a symbol (cudarc resolves NCCL's symbols
//! lazily and panics on a missing one, so every optional call is probed here first).

use std::ffi::{CStr, c_void};

use cudarc::nccl::sys as ncclsys;

use crate::CommError;

/// Whether `libcuda` and `libnccl` can be loaded on this machine (never panics).
pub fn nccl_available() -> bool {
    // SAFETY: both only try to dlopen the library (running its initialisers, as cudarc's own
    // first use does) and close it again; no symbol is called.
    unsafe { cudarc::driver::sys::is_culib_present() && cudarc::nccl::sys::is_culib_present() }
}

/// Number of CUDA devices, or an error naming what is missing.
pub fn cuda_device_count() -> Result<usize, CommError> {
    if !nccl_available() {
        return Err(CommError::Unavailable(
            "libcuda or libnccl cannot be loaded: install the NVIDIA driver and NCCL (libnccl2), or use InProcessGroup on the CPU".into(),
        ));
    }
    cudarc::driver::result::init().map_err(|e| CommError::Backend(format!("cuInit failed: {e:?}")))?;
    let n = cudarc::driver::result::device::get_count()
        .map_err(|e| CommError::Backend(format!("cannot count CUDA devices: {e:?}")))?;
    Ok(n.max(0) as usize)
}

/// Whether the loaded libnccl exports `name`. cudarc resolves a symbol on its first call and
/// panics ("Missing symbol") when it is absent; this asks first. Call only once
/// [`nccl_available`] is true (cudarc's loader panics without a libnccl).
pub(super) fn nccl_has_symbol(name: &CStr) -> bool {
    // SAFETY: `culib` returns the libnccl cudarc loads for every NCCL call (present: the callers
    // checked `nccl_available`). `get` only looks the name up (dlsym); the symbol is never
    // called or read, so the pointer type it is given does not matter.
    unsafe { ncclsys::culib().get::<*const c_void>(name).is_ok() }
}
