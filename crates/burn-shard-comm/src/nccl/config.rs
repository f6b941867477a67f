//! NCCL versions and the configuration a non-blocking communicator is created with: the
//! `NCCL_VERSION` encoding, the first version with non-blocking communicators (2.14), and
//! `ncclConfig_t` in NCCL 2.14's layout, built by hand ([`NcclConfigV21400`]).

use std::ffi::{c_int, c_uint};

/// `NCCL_VERSION(X,Y,Z)` of nccl.h: the encoding of `ncclGetVersion` and of `ncclConfig_t::version`.
const fn nccl_version(major: c_uint, minor: c_uint, patch: c_uint) -> c_uint {
    if major <= 2 && minor <= 8 {
        major * 1000 + minor * 100 + patch
    } else {
        major * 10000 + minor * 100 + patch
    }
}

/// The first NCCL with `ncclConfig_t`, `ncclCommInitRankConfig` and non-blocking communicators.
pub(super) const NCCL_2_14: c_uint = nccl_version(2, 14, 0);
/// `NCCL_API_MAGIC` of nccl.h: the `magic` NCCL_CONFIG_INITIALIZER writes and NCCL checks.
const NCCL_CONFIG_MAGIC: c_uint = 0xcafe_beef;
/// `NCCL_CONFIG_UNDEF_INT` of nccl.h (`INT_MIN`): "let NCCL choose".
const NCCL_CONFIG_UNDEF_INT: c_int = c_int::MIN;

/// `ncclConfig_t` as NCCL 2.14's nccl.h declares it (`struct ncclConfig_v21400 { size_t size;
/// unsigned int magic; unsigned int version; int blocking; }`), filled like its
/// `NCCL_CONFIG_INITIALIZER` (`sizeof`, `0xcafebeef`, the header's version, `NCCL_CONFIG_UNDEF_INT`
/// for every attribute) except `blocking = 0`.
///
/// Built by hand rather than from cudarc's `ncclConfig_t`, whose layout follows whichever
/// `nccl-0xxxx` feature is on. NCCL accepts any older layout: `ncclCommInitRankConfig` copies
/// `min(config.size, sizeof(its ncclConfig_t))` bytes and resets every attribute newer than
/// `config.version` to its default (`parseCommConfig` in NCCL's src/init.cc), which is how a
/// program built against 2.14's header runs on a newer libnccl.
#[repr(C)]
pub(super) struct NcclConfigV21400 {
    size: usize,
    magic: c_uint,
    version: c_uint,
    blocking: c_int,
    /// The C struct's 4 bytes of tail padding, written so that NCCL copies no uninitialised
    /// byte. NCCL ≥ 2.17 reads them as `cgaClusterSize`, then resets that to its default since
    /// `version` < 2.17; `NCCL_CONFIG_UNDEF_INT` is that field's initializer value anyway.
    padding: c_int,
}

#[cfg(target_pointer_width = "64")]
const _: () = assert!(
    size_of::<NcclConfigV21400>() == 24,
    "sizeof(struct ncclConfig_v21400) on LP64"
);

impl NcclConfigV21400 {
    /// `NCCL_CONFIG_INITIALIZER` of NCCL 2.14 with `blocking = 0`.
    pub(super) fn non_blocking() -> Self {
        Self {
            size: size_of::<Self>(),
            magic: NCCL_CONFIG_MAGIC,
            version: NCCL_2_14,
            blocking: 0,
            padding: NCCL_CONFIG_UNDEF_INT,
        }
    }
}

/// `ncclGetVersion`'s code as `major.minor.patch`.
pub(super) fn version_string(code: c_uint) -> String {
    if code >= 10000 {
        format!("{}.{}.{}", code / 10000, code / 100 % 100, code % 100)
    } else {
        format!("{}.{}.{}", code / 1000, code / 100 % 10, code % 100)
    }
}
