//! [`Pinned`]: a buffer handed to a non-blocking MPI call, freed only once the call completed
//! and leaked when it was abandoned (MPI may still write into it).

/// A buffer handed to MPI for a non-blocking call, which needs it to outlive the request: the
/// memory is owned through a raw pointer and freed only by [`Pinned::into_vec`], once the call
/// completed. A `Pinned` dropped without `into_vec` leaks, which is what an abandoned call
/// needs (MPI may still write into it).
pub(super) struct Pinned<T: 'static> {
    ptr: *mut [T],
}

impl<T: 'static> Pinned<T> {
    pub(super) fn new(values: Vec<T>) -> Self {
        Self {
            ptr: Box::into_raw(values.into_boxed_slice()),
        }
    }

    /// # Safety
    /// The reference must not be used after [`Pinned::into_vec`], nor alongside a mutable one.
    pub(super) unsafe fn as_static(&self) -> &'static [T] {
        // SAFETY: `ptr` came from `Box::into_raw` and is freed only by `into_vec`.
        unsafe { &*self.ptr }
    }

    /// # Safety
    /// As [`Pinned::as_static`]; only one such reference may exist.
    pub(super) unsafe fn as_static_mut(&mut self) -> &'static mut [T] {
        // SAFETY: as in `as_static`.
        unsafe { &mut *self.ptr }
    }

    /// # Safety
    /// Only once no MPI request uses the buffer any more.
    pub(super) unsafe fn into_vec(self) -> Vec<T> {
        // SAFETY: `ptr` came from `Box::into_raw` and is taken back once (this consumes self).
        unsafe { Box::from_raw(self.ptr) }.into_vec()
    }
}
