//! A small pool of I/O threads that runs blocking syscalls for file backends, so async callers
//! on the network side never block. Runtime-agnostic: results come back through a oneshot.

use crate::BackendError;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

type Job = Box<dyn FnOnce() + Send + 'static>;

/// A fixed set of worker threads fed through one queue.
#[derive(Clone)]
pub struct IoPool {
    tx: mpsc::Sender<Job>,
}

impl std::fmt::Debug for IoPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("IoPool")
    }
}

impl IoPool {
    /// Start `threads` workers (at least one). Workers exit when every handle is dropped.
    pub fn new(name: &str, threads: usize) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..threads.max(1) {
            let rx = Arc::clone(&rx);
            std::thread::Builder::new()
                .name(format!("{name}-io{i}"))
                .stack_size(256 * 1024)
                .spawn(move || loop {
                    let job = {
                        let guard = rx.lock().unwrap_or_else(|p| p.into_inner());
                        guard.recv()
                    };
                    match job {
                        Ok(job) => job(),
                        Err(_) => return,
                    }
                })?;
        }
        Ok(IoPool { tx })
    }

    /// Run `f` on a worker and await its result.
    pub async fn run<T, F>(&self, f: F) -> Result<T, BackendError>
    where
        T: Send + 'static,
        F: FnOnce() -> Result<T, BackendError> + Send + 'static,
    {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move || {
            let _ = tx.send(f());
        });
        self.tx
            .send(job)
            .map_err(|_| BackendError::Io("I/O pool stopped".into()))?;
        rx.await
            .map_err(|_| BackendError::Io("I/O worker died".into()))?
    }
}
