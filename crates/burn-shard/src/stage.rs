//! The ZeRO stages.

use std::fmt;
use std::str::FromStr;

use crate::error::ShardError;

/// What is partitioned across ranks (Rajbhandari et al., 2020, "ZeRO: Memory Optimizations
/// Toward Training Trillion Parameter Models", §5).
///
/// Per-rank model-state bytes for `Ψ` fp32 parameters trained with Adam on `N` ranks:
/// stage 0: `16Ψ` (params 4Ψ, grads 4Ψ, Adam moments 8Ψ); stage 1: `8Ψ + 8Ψ/N`;
/// stage 2: `4Ψ + 12Ψ/N`; stage 3: `16Ψ/N`.
///
/// In a Burn config (`config.json`) a stage is its number, `0` to `3`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "u8", into = "u8")]
pub enum Stage {
    /// Plain data parallelism: gradients all-reduced, everything replicated.
    Zero,
    /// Optimizer state sharded; gradients all-reduced and kept whole.
    One,
    /// Optimizer state and gradients sharded; gradients reduce-scattered.
    Two,
    /// Parameters sharded too (FSDP): each parameter is all-gathered when used and freed
    /// after, re-gathered in backward, and its gradient reduce-scattered once it is complete,
    /// together with the rest of its unit's. See [`crate::fsdp`].
    Three,
}

impl Stage {
    /// The stage number (0 to 3).
    pub fn number(self) -> u8 {
        match self {
            Stage::Zero => 0,
            Stage::One => 1,
            Stage::Two => 2,
            Stage::Three => 3,
        }
    }

    /// Whether the optimizer state is partitioned.
    pub fn shards_optimizer_state(self) -> bool {
        self >= Stage::One
    }

    /// Whether only this rank's shard of the gradients is kept.
    pub fn shards_gradients(self) -> bool {
        self >= Stage::Two
    }

    /// Whether only this rank's shard of the parameters is kept between uses.
    pub fn shards_parameters(self) -> bool {
        self >= Stage::Three
    }
}

impl From<Stage> for u8 {
    fn from(stage: Stage) -> u8 {
        stage.number()
    }
}

impl TryFrom<u8> for Stage {
    type Error = ShardError;

    fn try_from(n: u8) -> Result<Self, ShardError> {
        match n {
            0 => Ok(Stage::Zero),
            1 => Ok(Stage::One),
            2 => Ok(Stage::Two),
            3 => Ok(Stage::Three),
            _ => Err(ShardError::InvalidConfig(format!(
                "stage must be 0, 1, 2 or 3, got {n}"
            ))),
        }
    }
}

impl FromStr for Stage {
    type Err = ShardError;

    fn from_str(s: &str) -> Result<Self, ShardError> {
        let n: u8 = s
            .trim()
            .parse()
            .map_err(|_| ShardError::InvalidConfig(format!("stage must be 0, 1, 2 or 3, got `{s}`")))?;
        Stage::try_from(n)
    }
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.number())
    }
}
