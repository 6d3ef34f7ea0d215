//! NULLIO: reads return zeros, writes are discarded. Measures protocol cost.

use crate::{BlockDevice, Capabilities, FileRange, InPlaceRead, IoFuture, WriteMode};
use bytes::Bytes;
use std::sync::atomic::{AtomicU64, Ordering};

/// A device of a given size that stores nothing.
#[derive(Debug)]
pub struct NullBackend {
    size: AtomicU64,
}

impl NullBackend {
    pub fn new(size: u64) -> Self {
        NullBackend {
            size: AtomicU64::new(size),
        }
    }
}

impl BlockDevice for NullBackend {
    fn kind(&self) -> &'static str {
        "null"
    }
    fn size(&self) -> u64 {
        self.size.load(Ordering::Relaxed)
    }
    fn resize(&self, new_size: u64) -> Result<(), crate::BackendError> {
        self.size.store(new_size, Ordering::Relaxed);
        Ok(())
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            volatile: true,
            unmap: true,
            alignment: 1,
            discards_writes: true,
            write_zeroes: false,
        }
    }
    fn read(&self, _offset: u64, len: usize) -> IoFuture<'_, Bytes> {
        let data = crate::zeros(len);
        Box::pin(async move { Ok(data) })
    }
    /// Sent from the shared zero file when the connection allows it.
    fn read_in_place(&self, _offset: u64, len: usize, how: InPlaceRead) -> Option<FileRange> {
        crate::zeros_in_place(len, how)
    }
    fn write(&self, _offset: u64, _data: Bytes, _mode: WriteMode) -> IoFuture<'_, ()> {
        Box::pin(async { Ok(()) })
    }
    fn flush(&self) -> IoFuture<'_, ()> {
        Box::pin(async { Ok(()) })
    }
    fn unmap(&self, _offset: u64, _len: u64) -> IoFuture<'_, ()> {
        Box::pin(async { Ok(()) })
    }
}
