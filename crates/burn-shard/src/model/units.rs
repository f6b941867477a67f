//! Units by module path: which parameters [`crate::Stage3Config::units`] puts in one stage-3 unit,
//! for models whose `forward` has no [`crate::fsdp::unit`] calls (FSDP2's
//! `fully_shard(submodule)` from outside the model).

use crate::error::ShardError;
use crate::model::census::Census;

/// The units of a model, named by the module-path patterns of [`crate::Stage3Config::units`].
///
/// A pattern is a module path whose segments are names or `*` (any one segment), e.g.
/// `layers.*` (each element of a `Vec` field `layers`), `encoder.layers.*`, `head`. A parameter
/// (path `layers.3.mlp.fc1.weight`) belongs to the unit named by the first pattern that matches
/// the start of its path (`layers.3`); parameters that no pattern matches belong to no unit.
#[derive(Debug, Default)]
pub(crate) struct UnitPolicy {
    patterns: Vec<Vec<String>>,
    /// Each pattern's text, and whether it matched a parameter.
    used: Vec<(String, bool)>,
    /// The units met so far, in the order their first parameter was; a unit's number is its index.
    names: Vec<String>,
}

impl UnitPolicy {
    /// Parses `patterns`.
    ///
    /// # Errors
    /// [`ShardError::InvalidConfig`] for an empty pattern or an empty segment (`a..b`).
    pub(crate) fn new(patterns: &[String]) -> Result<Self, ShardError> {
        let mut parsed = Vec::with_capacity(patterns.len());
        for pattern in patterns {
            let segments: Vec<String> = pattern.split('.').map(str::to_string).collect();
            if segments.iter().any(String::is_empty) {
                return Err(ShardError::InvalidConfig(format!(
                    "unit pattern `{pattern}` has an empty segment: write module paths such as `layers.*` or `head`"
                )));
            }
            parsed.push(segments);
        }
        Ok(Self {
            patterns: parsed,
            used: patterns.iter().map(|p| (p.clone(), false)).collect(),
            names: Vec::new(),
        })
    }

    /// The number of the unit of the parameter at `path` (`a.b.weight`), if a pattern matches.
    pub(crate) fn unit_of(&mut self, path: &str) -> Option<u32> {
        let segments: Vec<&str> = path.split('.').collect();
        let (index, len) = self.patterns.iter().enumerate().find_map(|(i, pattern)| {
            let matches =
                pattern.len() < segments.len() && pattern.iter().zip(&segments).all(|(p, s)| p == "*" || p == s);
            matches.then_some((i, pattern.len()))
        })?;
        self.used[index].1 = true;
        let name = segments[..len].join(".");
        let number = match self.names.iter().position(|n| *n == name) {
            Some(number) => number,
            None => {
                self.names.push(name);
                self.names.len() - 1
            }
        };
        Some(number as u32)
    }

    /// After every parameter was asked for: an error naming the first pattern that matched
    /// none (a typo would otherwise silently leave the model without units), with module paths
    /// of `census` as examples.
    ///
    /// # Errors
    /// [`ShardError::InvalidConfig`].
    pub(crate) fn check_all_used(&self, census: &Census) -> Result<(), ShardError> {
        let Some((pattern, _)) = self.used.iter().find(|(_, used)| !used) else {
            return Ok(());
        };
        // Module paths (a parameter's path without its name): what patterns name.
        let mut examples: Vec<&str> = Vec::new();
        for (_, e) in census.entries() {
            let module = e.path.rsplit_once('.').map_or(e.path.as_str(), |(m, _)| m);
            if examples.len() < 3 && !examples.contains(&module) {
                examples.push(module);
            }
        }
        Err(ShardError::InvalidConfig(format!(
            "unit pattern `{pattern}` matches no sharded parameter; patterns name modules by path (`*` is any one \
             segment), e.g. `{}`",
            examples.join("`, `")
        )))
    }
}
