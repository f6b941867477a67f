//! [`KernelError`]: what a fused step refuses.

/// Errors of the fused kernels.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// The flat buffers of one step differ in length.
    #[error(
        "fused Adam buffers differ in length: param {param}, grad {grad}, exp_avg {exp_avg}, exp_avg_sq {exp_avg_sq}, max_exp_avg_sq {max:?}; pass shards of one flat parameter"
    )]
    LengthMismatch {
        /// Elements of the parameter.
        param: usize,
        /// Elements of the gradient.
        grad: usize,
        /// Elements of the first moment.
        exp_avg: usize,
        /// Elements of the second moment.
        exp_avg_sq: usize,
        /// Elements of the AMSGrad maximum, when used.
        max: Option<usize>,
    },
}
