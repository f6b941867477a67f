//! Reading one variable of this process's environment, as the launch environment
//! (`env.rs`) and the job token (`token.rs`) both do.

use crate::RendezvousError;

/// Variable `var` of this process's environment; `None` when unset.
///
/// # Errors
/// [`RendezvousError::Env`] when it is not UTF-8 (its bytes are not shown: it may hold the job
/// token).
pub(crate) fn process_var(var: &'static str) -> Result<Option<String>, RendezvousError> {
    match std::env::var(var) {
        Ok(value) => Ok(Some(value)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(raw)) => Err(RendezvousError::Env {
            var,
            problem: format!("is not UTF-8 ({} bytes)", raw.len()),
        }),
    }
}
