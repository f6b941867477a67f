//! [`NcclId`]: the 128-byte NCCL unique id that rank 0 creates and every rank joins with, and its
//! forms for passing it on (hex text, a file written atomically and waited for).

use std::fmt;
use std::time::{Duration, Instant};

use cudarc::nccl::{result as nccl, sys as ncclsys};

use super::library::cuda_device_count;
use crate::CommError;

/// The 128-byte NCCL unique id that rank 0 creates and every rank needs: pass it through the
/// launcher's rendezvous, a file ([`NcclId::write_file`]) or an environment variable
/// ([`NcclId::to_hex`]).
#[derive(Clone, PartialEq, Eq)]
pub struct NcclId([u8; 128]);

impl fmt::Debug for NcclId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NcclId({}…)", &self.to_hex()[..16])
    }
}

impl NcclId {
    /// A fresh id (call on rank 0 only).
    ///
    /// # Errors
    /// [`CommError::Unavailable`] without libnccl; [`CommError::Backend`] when NCCL fails.
    pub fn new() -> Result<Self, CommError> {
        cuda_device_count()?;
        let id = nccl::get_uniqueid().map_err(|e| CommError::Backend(format!("ncclGetUniqueId: {:?}", e.0)))?;
        Ok(Self(id.internal.map(|c| c as u8)))
    }

    /// Lowercase hex, 256 characters.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parses [`NcclId::to_hex`]'s output.
    ///
    /// # Errors
    /// [`CommError::Backend`] naming the problem when the text is not 256 hex digits.
    pub fn from_hex(hex: &str) -> Result<Self, CommError> {
        let hex = hex.trim();
        if hex.len() != 256 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(CommError::Backend(format!(
                "an NCCL id is 256 hex digits, got {} characters; pass the id rank 0 wrote",
                hex.len()
            )));
        }
        let mut out = [0u8; 128];
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("checked hex digits");
        }
        Ok(Self(out))
    }

    /// Writes the id atomically (temporary file + rename) so readers never see half of it.
    pub fn write_file(&self, path: &std::path::Path) -> std::io::Result<()> {
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, self.to_hex())?;
        std::fs::rename(tmp, path)
    }

    /// Waits up to `timeout` for `path` (written by rank 0) and reads it.
    pub fn read_file(path: &std::path::Path, timeout: Duration) -> Result<Self, CommError> {
        let start = Instant::now();
        loop {
            if let Ok(text) = std::fs::read_to_string(path) {
                return Self::from_hex(&text);
            }
            if start.elapsed() > timeout {
                return Err(CommError::Backend(format!(
                    "no NCCL id at {} after {timeout:?}: did rank 0 start and call NcclId::write_file?",
                    path.display()
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The 128 bytes, to pass the id through a collective (`split.rs`).
    pub(super) fn bytes(&self) -> [u8; 128] {
        self.0
    }

    /// An id from [`NcclId::bytes`].
    pub(super) fn from_bytes(bytes: [u8; 128]) -> Self {
        Self(bytes)
    }

    pub(super) fn raw(&self) -> ncclsys::ncclUniqueId {
        ncclsys::ncclUniqueId {
            internal: self.0.map(|b| b as std::ffi::c_char),
        }
    }
}
