//! `IoPool`: the threads that read and write one rank's swap file off the compute thread.

use std::io;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::error::ShardError;
use crate::swap::file::SwapFile;

/// A read or write handed to the pool, answered on `reply`.
enum Job {
    Read {
        offset: u64,
        len: usize,
        reply: Sender<io::Result<Vec<u8>>>,
    },
    Write {
        offset: u64,
        /// Shared with the caller, which may read them while the write is queued.
        bytes: Arc<Vec<u8>>,
        reply: Sender<io::Result<()>>,
    },
}

/// `threads` threads taking jobs from one queue, in the order submitted; each job is one
/// positional read or write of the whole extent (no seek, so jobs run side by side).
pub(crate) struct IoPool {
    jobs: Option<Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
}

/// The answer to a job: wait on it with [`Pending::wait`].
pub(crate) struct Pending<T>(Receiver<io::Result<T>>);

impl<T> Pending<T> {
    /// The job's result (an error when the I/O thread died).
    pub(crate) fn wait(self) -> io::Result<T> {
        self.0
            .recv()
            .unwrap_or_else(|_| Err(io::Error::other("the swap file's I/O thread ended")))
    }
}

impl IoPool {
    /// Starts `threads` threads (at least one) on `file`, for rank `rank`.
    ///
    /// # Errors
    /// [`ShardError::Nvme`] naming the file when a thread cannot be started.
    pub(crate) fn start(file: Arc<SwapFile>, threads: usize, rank: usize) -> Result<Self, ShardError> {
        Self::spawn(file.clone(), threads, rank).map_err(|e| ShardError::Nvme {
            path: file.path().to_path_buf(),
            reason: format!("the I/O threads could not be started ({e})"),
            fix: "lower NvmeOffload::io_threads, or raise the process's thread limit (ulimit -u)".into(),
        })
    }

    fn spawn(file: Arc<SwapFile>, threads: usize, rank: usize) -> io::Result<Self> {
        let (jobs, queue) = channel::<Job>();
        let queue = Arc::new(Mutex::new(queue));
        let threads = (0..threads.max(1))
            .map(|i| {
                let (file, queue) = (file.clone(), queue.clone());
                std::thread::Builder::new()
                    .name(format!("burn-shard-swap-r{rank}-{i}"))
                    .spawn(move || {
                        loop {
                            // The lock is held only to take a job, not while doing it.
                            let job = queue.lock().map_err(|_| ()).and_then(|q| q.recv().map_err(|_| ()));
                            match job {
                                Ok(Job::Read { offset, len, reply }) => {
                                    let _ = reply.send(file.read_at(len, offset));
                                }
                                Ok(Job::Write { offset, bytes, reply }) => {
                                    let _ = reply.send(file.write_at(&bytes, offset));
                                }
                                Err(()) => break,
                            }
                        }
                    })
            })
            .collect::<io::Result<Vec<_>>>()?;
        Ok(Self {
            jobs: Some(jobs),
            threads,
        })
    }

    /// Reads `len` bytes at `offset`.
    pub(crate) fn read(&self, offset: u64, len: usize) -> Pending<Vec<u8>> {
        let (reply, answer) = channel();
        self.submit(Job::Read { offset, len, reply });
        Pending(answer)
    }

    /// Writes `bytes` at `offset`.
    pub(crate) fn write(&self, offset: u64, bytes: Arc<Vec<u8>>) -> Pending<()> {
        let (reply, answer) = channel();
        self.submit(Job::Write { offset, bytes, reply });
        Pending(answer)
    }

    /// Queues `job`; when every thread has ended, its reply sender is dropped here and the
    /// [`Pending`] reports it.
    fn submit(&self, job: Job) {
        if let Some(jobs) = &self.jobs {
            let _ = jobs.send(job);
        }
    }
}

impl Drop for IoPool {
    /// Lets the threads finish the queued jobs, then joins them.
    fn drop(&mut self) {
        drop(self.jobs.take());
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}
