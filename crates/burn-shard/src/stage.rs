//! The ZeRO stages.

use std::fmt;
use std::str::FromStr;

use crate::ShardError;

/// What is partitioned across ranks (Rajbhandari et al., 2020, "ZeRO: Memory Optimizations
/// Toward Training Trillion Parameter Models", §5).
///
/// Per-rank model-state bytes for `Ψ` fp32 parameters trained with Adam on `N` ranks:
/// stage 0: `16Ψ` (params 4Ψ, grads 4Ψ, Adam moments 8Ψ); stage 1: `8Ψ + 8Ψ/N`;
/// stage 2: `4Ψ + 12Ψ/N`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Stage {
    /// Plain data parallelism: gradients all-reduced, everything replicated.
    Zero,
    /// Optimizer state sharded; gradients all-reduced and kept whole.
    One,
    /// Optimizer state and gradients sharded; gradients reduce-scattered.
    Two,
}

impl Stage {
    /// The stage number (0, 1 or 2).
    pub fn number(self) -> u8 {
        match self {
            Stage::Zero => 0,
            Stage::One => 1,
            Stage::Two => 2,
        }
    }

    /// Whether the optimizer state (and the parameter shard it updates) is partitioned.
    pub fn shards_optimizer_state(self) -> bool {
        self >= Stage::One
    }

    /// Whether gradients are reduce-scattered and only this rank's shard is kept.
    pub fn shards_gradients(self) -> bool {
        self >= Stage::Two
    }
}

impl TryFrom<u8> for Stage {
    type Error = ShardError;

    fn try_from(n: u8) -> Result<Self, ShardError> {
        match n {
            0 => Ok(Stage::Zero),
            1 => Ok(Stage::One),
            2 => Ok(Stage::Two),
            _ => Err(ShardError::InvalidConfig(format!("stage must be 0, 1 or 2, got {n}"))),
        }
    }
}

impl FromStr for Stage {
    type Err = ShardError;

    fn from_str(s: &str) -> Result<Self, ShardError> {
        let n: u8 = s
            .trim()
            .parse()
            .map_err(|_| ShardError::InvalidConfig(format!("stage must be 0, 1 or 2, got `{s}`")))?;
        Stage::try_from(n)
    }
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.number())
    }
}
