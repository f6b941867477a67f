//! `SwapFile`: one rank's swap file.

use std::fs::{File, OpenOptions, TryLockError};
use std::io;
use std::path::{Path, PathBuf};

use crate::error::ShardError;

/// One rank's swap file in the configured directory (`burn-shard-rank{rank}.swap` for the
/// optimizer state; stage-3 shards use [`SwapFile::create_unlinked`], which has no name):
/// exclusively locked while it is open (an advisory `flock`, released by the kernel when the process ends,
/// also when it is killed), read and written at offsets from any thread, removed on drop.
pub(crate) struct SwapFile {
    path: PathBuf,
    file: File,
    /// `(device, inode)` of the file created, to notice it being deleted or replaced.
    identity: (u64, u64),
    /// Whether the file has a name (see [`SwapFile::create_unlinked`]).
    linked: bool,
}

impl SwapFile {
    /// Creates (or takes over, when a killed job left it) the file `name` in `dir`, locked.
    ///
    /// # Errors
    /// [`ShardError::Nvme`] when `dir` is not an existing directory, the file cannot be created
    /// or written there, or another job holds it.
    pub(crate) fn create(dir: &Path, name: &str) -> Result<Self, ShardError> {
        // Absolute, so that a later change of the working directory does not make the file
        // look deleted (or keep it from being removed).
        let dir = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
        if !dir.is_dir() {
            return Err(ShardError::Nvme {
                reason: match dir.exists() {
                    true => "this is not a directory".into(),
                    false => "this directory does not exist".into(),
                },
                path: dir,
                fix: "create it (mkdir -p) on a local disk with room for what is offloaded, or name another \
                      directory (NvmeOffload::new, Home::Disk)"
                    .into(),
            });
        }
        let path = dir.join(name);
        let not_writable = |e: io::Error| ShardError::Nvme {
            path: path.clone(),
            reason: format!("the swap file cannot be created and written ({e})"),
            fix: "name a writable directory on a local disk (NvmeOffload::new, Home::Disk), not a read-only mount"
                .into(),
        };
        // A job that ends removes its file after its lock is taken: the file locked must still
        // be the one at the path, else open again.
        let (file, identity) = loop {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .map_err(not_writable)?;
            match file.try_lock() {
                Ok(()) => {}
                Err(TryLockError::WouldBlock) => {
                    return Err(ShardError::Nvme {
                        path,
                        reason: "another job (or another optimizer in this one) is using this swap file".into(),
                        fix: "give each job, and each sharded optimizer, its own NvmeOffload directory".into(),
                    });
                }
                Err(TryLockError::Error(e)) => return Err(not_writable(e)),
            }
            let identity = os::identity(&file.metadata().map_err(not_writable)?);
            if std::fs::metadata(&path).is_ok_and(|m| os::identity(&m) == identity) {
                break (file, identity);
            }
        };
        // Left by a job that was killed (its lock died with it): this job's state starts empty.
        file.set_len(0).map_err(not_writable)?;
        // A write that reaches the disk: a read-only or full filesystem fails here, at init.
        os::write_at(&file, &[0; 8], 0)
            .and_then(|()| file.sync_data())
            .map_err(not_writable)?;
        Ok(Self {
            identity,
            path,
            file,
            linked: true,
        })
    }

    /// As [`SwapFile::create`], under a name no other file has (`name.{pid}.{n}`), which is then
    /// removed at once on Unix: the file lives as long as this handle, so no other program can
    /// delete, truncate or overwrite it, two jobs never share it, and its space is freed
    /// whenever this process ends, also when it is killed or when something holds the handle
    /// until the process exits. (Elsewhere it keeps its name and is removed on drop.)
    ///
    /// # Errors
    /// As [`SwapFile::create`].
    pub(crate) fn create_unlinked(dir: &Path, name: &str) -> Result<Self, ShardError> {
        use std::sync::atomic::{AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let unique = format!("{name}.{}.{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
        let mut file = Self::create(dir, &unique)?;
        if cfg!(unix) {
            std::fs::remove_file(&file.path).map_err(|e| ShardError::Nvme {
                path: file.path.clone(),
                reason: format!("the file could not be unlinked after it was created ({e})"),
                fix: "name a directory on a local disk that allows removing files".into(),
            })?;
            file.linked = false;
        }
        Ok(file)
    }

    /// The file's path.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `bytes` at `offset`.
    pub(crate) fn write_at(&self, bytes: &[u8], offset: u64) -> io::Result<()> {
        os::write_at(&self.file, bytes, offset)
    }

    /// The file's length in bytes.
    pub(crate) fn len(&self) -> io::Result<u64> {
        self.file.metadata().map(|m| m.len())
    }

    /// Shortens the file to `len` bytes (gives back what a failed write past it took).
    pub(crate) fn truncate(&self, len: u64) -> io::Result<()> {
        self.file.set_len(len)
    }

    /// Reads `len` bytes at `offset`; an error when the file ends before (truncated).
    pub(crate) fn read_at(&self, len: usize, offset: u64) -> io::Result<Vec<u8>> {
        let mut bytes = vec![0; len];
        os::read_at(&self.file, &mut bytes, offset)?;
        Ok(bytes)
    }

    /// Whether the file is still at its path: a deleted file stays readable through the open
    /// handle on Linux, but is gone for everyone else (and its space is lost on a crash), so a
    /// job whose swap file was deleted or replaced stops.
    ///
    /// # Errors
    /// [`ShardError::Nvme`] naming the file.
    pub(crate) fn check_present(&self) -> Result<(), ShardError> {
        if !self.linked {
            return Ok(());
        }
        match std::fs::metadata(&self.path) {
            Ok(meta) if os::identity(&meta) == self.identity => Ok(()),
            found => Err(ShardError::Nvme {
                path: self.path.clone(),
                reason: match found {
                    Ok(_) => "the swap file was replaced by another file while the job ran".into(),
                    Err(e) => format!("the swap file was deleted while the job ran ({e})"),
                },
                fix: "the optimizer state on disk is lost: resume from the last checkpoint, and keep other \
                      programs (cleanup jobs, a second run) out of the NvmeOffload directory"
                    .into(),
            }),
        }
    }

    /// The error for a failed read or write of `bytes` bytes in a step, with the fix its cause
    /// calls for (the state on disk may be lost: resume from the last checkpoint).
    pub(crate) fn io_error(&self, what: &str, bytes: usize, e: &io::Error) -> ShardError {
        self.io_error_then(what, bytes, e, "resume from the last checkpoint")
    }

    /// As [`SwapFile::io_error`], the fix ending with `then` once the disk is fixed.
    pub(crate) fn io_error_then(&self, what: &str, bytes: usize, e: &io::Error, then: &str) -> ShardError {
        let fix = match e.kind() {
            io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded | io::ErrorKind::FileTooLarge => format!(
                "the disk (or this user's quota or file-size limit) is full: free space there or name a larger \
                 disk (NvmeOffload::new, Home::Disk), then {then}"
            ),
            io::ErrorKind::UnexpectedEof => "the swap file was truncated while the job ran: the optimizer state on \
                                             disk is lost; resume from the last checkpoint, and keep other \
                                             programs out of the NvmeOffload directory"
                .into(),
            _ => format!("check the disk (dmesg), then {then}"),
        };
        ShardError::Nvme {
            path: self.path.clone(),
            reason: format!("{what} of {bytes} bytes failed ({e})"),
            fix,
        }
    }
}

impl Drop for SwapFile {
    /// Removes the file, unless it is no longer this job's (replaced at its path).
    fn drop(&mut self) {
        if self.linked && self.check_present().is_ok() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Positional I/O and file identity: Unix (`pread`/`pwrite`, device and inode); elsewhere
/// through Windows' `seek_read`/`seek_write` and no identity check.
mod os {
    use std::fs::{File, Metadata};
    use std::io;

    /// `(device, inode)`: equal for two handles of the same file.
    #[cfg(unix)]
    pub(super) fn identity(meta: &Metadata) -> (u64, u64) {
        use std::os::unix::fs::MetadataExt;
        (meta.dev(), meta.ino())
    }

    #[cfg(unix)]
    pub(super) fn write_at(file: &File, bytes: &[u8], offset: u64) -> io::Result<()> {
        std::os::unix::fs::FileExt::write_all_at(file, bytes, offset)
    }

    #[cfg(unix)]
    pub(super) fn read_at(file: &File, bytes: &mut [u8], offset: u64) -> io::Result<()> {
        std::os::unix::fs::FileExt::read_exact_at(file, bytes, offset)
    }

    #[cfg(windows)]
    pub(super) fn identity(_meta: &Metadata) -> (u64, u64) {
        (0, 0)
    }

    #[cfg(windows)]
    pub(super) fn write_at(file: &File, mut bytes: &[u8], mut offset: u64) -> io::Result<()> {
        use std::os::windows::fs::FileExt;
        while !bytes.is_empty() {
            let n = file.seek_write(bytes, offset)?;
            bytes = &bytes[n..];
            offset += n as u64;
        }
        Ok(())
    }

    #[cfg(windows)]
    pub(super) fn read_at(file: &File, mut bytes: &mut [u8], mut offset: u64) -> io::Result<()> {
        use std::os::windows::fs::FileExt;
        while !bytes.is_empty() {
            match file.seek_read(bytes, offset)? {
                0 => return Err(io::ErrorKind::UnexpectedEof.into()),
                n => {
                    bytes = &mut std::mem::take(&mut bytes)[n..];
                    offset += n as u64;
                }
            }
        }
        Ok(())
    }
}
