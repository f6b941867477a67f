//! [`ParamDtype`]: the dtype parameters are trained in, and what it costs per element.

use std::fmt;
use std::str::FromStr;

/// `K` of the ZeRO paper (§5.1): bytes of optimizer state per parameter for mixed-precision
/// Adam, an `f32` master copy of the parameters (4 bytes), Adam's first moment (4 bytes) and
/// second moment (4 bytes).
pub const MIXED_PRECISION_ADAM_K: f64 = 12.0;

/// The dtype the parameters are trained in, for [`zero_formula`](super::zero_formula).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ParamDtype {
    /// `f32` parameters and gradients, Adam moments in `f32`, no master copy.
    F32,
    /// `bf16` parameters and gradients with `f32` master weights and Adam moments (mixed
    /// precision, as in the ZeRO paper).
    Bf16,
    /// `f16` parameters and gradients with `f32` master weights and Adam moments (mixed
    /// precision, the ZeRO paper's case).
    F16,
}

impl ParamDtype {
    /// Bytes of one parameter element, and of one gradient element: 4 (`f32`) or 2.
    pub fn element_bytes(self) -> f64 {
        match self {
            ParamDtype::F32 => 4.0,
            ParamDtype::Bf16 | ParamDtype::F16 => 2.0,
        }
    }

    /// Bytes of Adam's optimizer state per parameter: `K` = 12 with mixed precision (`f32`
    /// master 4, first moment 4, second moment 4; ZeRO §5.1), 8 for `f32` (the two moments:
    /// the parameters are their own master).
    pub fn optimizer_state_bytes(self) -> f64 {
        match self {
            ParamDtype::F32 => 8.0,
            ParamDtype::Bf16 | ParamDtype::F16 => MIXED_PRECISION_ADAM_K,
        }
    }

    /// Whether this is mixed precision (`bf16`/`f16` with `f32` master weights).
    pub fn is_mixed_precision(self) -> bool {
        self != ParamDtype::F32
    }
}

impl FromStr for ParamDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f32" | "fp32" => Ok(ParamDtype::F32),
            "bf16" => Ok(ParamDtype::Bf16),
            "f16" | "fp16" => Ok(ParamDtype::F16),
            _ => Err(format!("dtype must be f32, bf16 or f16, got `{s}`")),
        }
    }
}

impl fmt::Display for ParamDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ParamDtype::F32 => "f32",
            ParamDtype::Bf16 => "bf16",
            ParamDtype::F16 => "f16",
        })
    }
}
