//! Collectives in flight: the [`Work`] handle an asynchronous call returns, and the per-rank
//! communication thread that runs a rank's calls in the order they were made.
//!
//! The model is PyTorch's `async_op=True` / NCCL's stream: a rank's collectives form one queue,
//! so an asynchronous call takes its place in the rank's order when it is *made*, not when it
//! is waited for, and every rank sees the same order as long as every rank makes the same calls
//! in the same order. Waiting is what costs: the time a caller is blocked in [`Work::wait`] (or
//! in a synchronous call) is *exposed*; the rest of the time the call ran is hidden behind
//! whatever the caller did meanwhile. Both are counted in [`crate::CommStats`].

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use crate::CommError;

/// What [`Work::on_error`] runs.
type OnError = Box<dyn FnOnce(&CommError) + Send>;

/// A collective call that has been started. [`Work::wait`] returns its result.
///
/// Dropping a `Work` without waiting lets the call finish on its own (the other ranks expect
/// it); its result is discarded.
#[must_use = "a started collective returns its result through wait()"]
pub struct Work<T> {
    state: State<T>,
    /// Called with the call's error when [`Work::wait`] returns one (see [`Work::on_error`]).
    on_error: Option<OnError>,
}

enum State<T> {
    Done(Result<T, CommError>),
    Pending {
        rx: Receiver<Result<T, CommError>>,
        timing: Arc<CallTiming>,
    },
}

impl<T> Work<T> {
    /// A call that already completed on the caller's thread (backends without a communication
    /// thread return this from the `*_async` calls).
    pub fn done(result: Result<T, CommError>) -> Self {
        Self {
            state: State::Done(result),
            on_error: None,
        }
    }

    /// Runs `f` with the call's error when [`Work::wait`] returns one, before returning it (a
    /// wrapper that aborts related groups on any failure, see [`crate::Mesh`]), after any
    /// earlier `on_error`. Nothing runs for a `Work` dropped without `wait`.
    pub fn on_error(mut self, f: impl FnOnce(&CommError) + Send + 'static) -> Self {
        self.on_error = Some(match self.on_error.take() {
            Some(earlier) => Box::new(move |e: &CommError| {
                earlier(e);
                f(e)
            }),
            None => Box::new(f),
        });
        self
    }

    /// Blocks until the call has completed and returns its result. The time spent blocked here
    /// is counted as exposed communication.
    ///
    /// # Errors
    /// The call's own error, or [`CommError::Aborted`] when the communication thread is gone.
    pub fn wait(self) -> Result<T, CommError> {
        let out = match self.state {
            State::Done(result) => result,
            State::Pending { rx, timing } => {
                let start = Instant::now();
                let out = rx
                    .recv()
                    .unwrap_or_else(|_| Err(CommError::Aborted("the communication thread has stopped".into())));
                timing.add_exposed(start.elapsed());
                out
            }
        };
        if let (Err(e), Some(f)) = (&out, self.on_error) {
            f(e);
        }
        out
    }

    /// Waits for every started call of `works` (`None`: nothing started there), also after one
    /// has failed, since none may be left running while the rank moves on, and returns their
    /// results in the same positions, or the first error.
    ///
    /// # Errors
    /// The first failed call's error, as [`Work::wait`] returns it.
    pub fn wait_all(works: impl IntoIterator<Item = Option<Work<T>>>) -> Result<Vec<Option<T>>, CommError> {
        let mut failed = None;
        let results: Vec<Option<T>> = works
            .into_iter()
            .map(|work| match work.map(Work::wait) {
                Some(Ok(out)) => Some(out),
                Some(Err(e)) => {
                    failed.get_or_insert(e);
                    None
                }
                None => None,
            })
            .collect();
        match failed {
            Some(e) => Err(e),
            None => Ok(results),
        }
    }
}

/// Time one rank spent in collectives, in nanoseconds: how long calls ran (`busy`) and how
/// long callers were blocked waiting for them (`exposed`, at most `busy` per call).
#[derive(Debug, Default)]
pub(crate) struct CallTiming {
    busy: AtomicU64,
    exposed: AtomicU64,
}

impl CallTiming {
    pub(crate) fn add_busy(&self, d: Duration) {
        self.busy.fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }

    pub(crate) fn add_exposed(&self, d: Duration) {
        self.exposed.fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }

    /// `(busy, exposed)` so far.
    pub(crate) fn snapshot(&self) -> (Duration, Duration) {
        (
            Duration::from_nanos(self.busy.load(Ordering::Relaxed)),
            Duration::from_nanos(self.exposed.load(Ordering::Relaxed)),
        )
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// One rank's communication thread, started by the first asynchronous call.
///
/// Before it starts, calls run on the caller's thread (no hand-off cost for code that never
/// overlaps). Once it runs, every call of the rank goes through its queue, synchronous ones
/// included, so the rank's collectives keep the order in which they were made.
pub(crate) struct CommThread {
    name: String,
    queue: Mutex<Option<Sender<Job>>>,
    timing: Arc<CallTiming>,
}

impl CommThread {
    /// `name` names the OS thread (e.g. `burn-shard-comm-rank-0`).
    pub(crate) fn new(name: String) -> Self {
        Self {
            name,
            queue: Mutex::new(None),
            timing: Arc::new(CallTiming::default()),
        }
    }

    pub(crate) fn timing(&self) -> &CallTiming {
        &self.timing
    }

    /// Runs `call` to completion: on the communication thread when it runs, else here.
    pub(crate) fn run<T: Send + 'static>(
        &self,
        call: impl FnOnce() -> Result<T, CommError> + Send + 'static,
    ) -> Result<T, CommError> {
        let queue = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        match queue.as_ref() {
            Some(tx) => {
                let work = self.enqueue(tx, call);
                drop(queue);
                work.wait()
            }
            None => {
                drop(queue);
                let start = Instant::now();
                let out = call();
                let took = start.elapsed();
                self.timing.add_busy(took);
                self.timing.add_exposed(took);
                out
            }
        }
    }

    /// Starts `call` on the communication thread (starting the thread if needed) and returns
    /// at once.
    pub(crate) fn start<T: Send + 'static>(
        &self,
        call: impl FnOnce() -> Result<T, CommError> + Send + 'static,
    ) -> Work<T> {
        let mut queue = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        if queue.is_none() {
            let (tx, rx) = mpsc::channel::<Job>();
            let spawned = thread::Builder::new().name(self.name.clone()).spawn(move || {
                // Ends when the rank's handle (the only sender) is dropped and the queue is empty.
                for job in rx {
                    job();
                }
            });
            match spawned {
                Ok(_) => *queue = Some(tx),
                Err(e) => {
                    // No thread: run here, as before the first asynchronous call.
                    drop(queue);
                    tracing::warn!("could not start {}: {e}; collectives stay synchronous", self.name);
                    return Work::done(self.run(call));
                }
            }
        }
        let tx = queue.as_ref().expect("the queue was just set");
        self.enqueue(tx, call)
    }

    fn enqueue<T: Send + 'static>(
        &self,
        tx: &Sender<Job>,
        call: impl FnOnce() -> Result<T, CommError> + Send + 'static,
    ) -> Work<T> {
        let (done_tx, done_rx) = mpsc::channel();
        let timing = self.timing.clone();
        let job: Job = Box::new(move || {
            let start = Instant::now();
            // A panic inside a call must not take the thread (and every later call) with it.
            let out = catch_unwind(AssertUnwindSafe(call)).unwrap_or_else(|_| {
                Err(CommError::Aborted(
                    "a collective panicked on the communication thread".into(),
                ))
            });
            timing.add_busy(start.elapsed());
            let _ = done_tx.send(out);
        });
        if tx.send(job).is_err() {
            return Work::done(Err(CommError::Aborted("the communication thread has stopped".into())));
        }
        Work {
            state: State::Pending {
                rx: done_rx,
                timing: self.timing.clone(),
            },
            on_error: None,
        }
    }
}
