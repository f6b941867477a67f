//! Facts about the model, independent of hooks and of the step: what each float entry is
//! (`census`), where each trainable parameter lives in the flat buckets (`layout`), moving
//! values between parameters and buckets (`flat`), reading an entry without initialising it
//! (`lazy`), starting every rank from rank 0's values (`root_values`) or from pretrained
//! weights (`pretrained`), the running-state buffers (`buffers`), the
//! bytes held (`memory`) and units named by path (`units`). Imports only `error` and `stage` of
//! this crate.

pub(crate) mod buffers;
pub(crate) mod census;
pub(crate) mod flat;
pub(crate) mod layout;
pub(crate) mod lazy;
pub(crate) mod memory;
pub(crate) mod pretrained;
pub(crate) mod root_values;
pub(crate) mod units;
