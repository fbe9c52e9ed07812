//! Aligned buffers and the bounded, reusable pool of staging buffers.
//!
//! O_DIRECT needs the memory address, the file offset and the length of every
//! transfer aligned to the file system's DIO alignment. [`AlignedBuf`] owns
//! such memory; [`BufferPool`] hands out fixed-size staging buffers for writes
//! and takes them back, so that a save of any size holds at most
//! `pool_bytes` of staging memory, allocated once and reused across calls.

use std::alloc::{self, Layout};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};

/// Default alignment of buffers and of records in the container.
pub const DEFAULT_ALIGN: usize = 4096;

/// Buffers at least this large are mapped directly from the kernel (page
/// aligned, never fragmenting the heap, returned to the system on drop).
const MMAP_MIN: usize = 256 << 10;
/// Mappings at least this large may ask for transparent huge pages
/// ([`AlignedBuf::with_pages`]).
const HUGE_MIN: usize = 4 << 20;

/// An owned, aligned, fixed-capacity byte buffer.
///
/// The contents are not zeroed by us (mapped buffers come zeroed from the
/// kernel); callers only expose what they filled.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    cap: usize,
    align: usize,
    mapped: bool,
}

// SAFETY: `AlignedBuf` owns its allocation exclusively (like `Vec<u8>`), so it can
// move between threads and be shared immutably.
unsafe impl Send for AlignedBuf {}
// SAFETY: see `Send`; `&AlignedBuf` only permits reads.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Allocates `cap` bytes aligned to `align` (a power of two), on the
    /// system's default pages.
    ///
    /// Returns `None` when `align` is not a power of two or the allocation fails.
    pub fn new(cap: usize, align: usize) -> Option<Self> {
        Self::with_pages(cap, align, false)
    }

    /// As [`AlignedBuf::new`]; with `huge`, a mapping of at least 4 MiB asks
    /// for transparent huge pages: physically contiguous memory lets direct
    /// I/O go out in requests larger than the block layer's segment limit
    /// allows for scattered 4 KiB pages, and fills with far fewer faults.
    /// (Whether that pays is the engine's choice: see `Config::huge_pages`.)
    pub fn with_pages(cap: usize, align: usize, huge: bool) -> Option<Self> {
        if !align.is_power_of_two() {
            return None;
        }
        if cap == 0 {
            return Some(AlignedBuf {
                ptr: NonNull::dangling(),
                cap: 0,
                align,
                mapped: false,
            });
        }
        if cap >= MMAP_MIN && align <= 4096 {
            // SAFETY: anonymous private mapping; no file, no fixed address.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    cap,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                return None;
            }
            if huge && cap >= HUGE_MIN {
                // SAFETY: advice on a mapping we own; failure is harmless.
                unsafe { libc::madvise(p, cap, libc::MADV_HUGEPAGE) };
            }
            return NonNull::new(p.cast::<u8>()).map(|ptr| AlignedBuf {
                ptr,
                cap,
                align,
                mapped: true,
            });
        }
        let layout = Layout::from_size_align(cap, align).ok()?;
        // SAFETY: `layout` has a non-zero size.
        let raw = unsafe { alloc::alloc(layout) };
        NonNull::new(raw).map(|ptr| AlignedBuf {
            ptr,
            cap,
            align,
            mapped: false,
        })
    }

    pub fn capacity(&self) -> usize {
        self.cap
    }

    pub fn align(&self) -> usize {
        self.align
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// A writable pointer to the memory for I/O into a shared buffer.
    ///
    /// The memory is owned through a raw pointer, not a Rust reference, so
    /// writing through this pointer is sound as long as no slice of the same
    /// bytes (from `as_slice`) is alive meanwhile; readers wait for the writes.
    pub fn io_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The whole buffer as a slice.
    ///
    /// Bytes that were never written hold unspecified (but initialised-as-u8)
    /// values; callers only read what they wrote or read in.
    pub fn as_slice(&self) -> &[u8] {
        if self.cap == 0 {
            return &[];
        }
        // SAFETY: the allocation is `cap` bytes long and owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.cap) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        if self.cap == 0 {
            return &mut [];
        }
        // SAFETY: the allocation is `cap` bytes long and uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.cap) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.cap == 0 {
            return;
        }
        if self.mapped {
            // SAFETY: mapped in `new` with exactly this length.
            unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.cap) };
            return;
        }
        let layout = Layout::from_size_align(self.cap, self.align).expect("layout was valid");
        // SAFETY: allocated in `new` with exactly this layout.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) };
    }
}

/// A bounded pool of equally sized aligned staging buffers.
///
/// Buffers are created lazily up to `max_buffers` and recycled through a
/// lock-free channel; `acquire` blocks while all buffers are in use.
pub struct BufferPool {
    buf_size: usize,
    align: usize,
    max_buffers: usize,
    huge: bool,
    created: AtomicUsize,
    tx: Sender<AlignedBuf>,
    rx: Receiver<AlignedBuf>,
}

impl BufferPool {
    pub fn new(buf_size: usize, align: usize, max_buffers: usize, huge: bool) -> Arc<Self> {
        let max_buffers = max_buffers.max(2);
        let (tx, rx) = crossbeam_channel::bounded(max_buffers);
        Arc::new(BufferPool {
            buf_size,
            align,
            max_buffers,
            huge,
            created: AtomicUsize::new(0),
            tx,
            rx,
        })
    }

    pub fn buf_size(&self) -> usize {
        self.buf_size
    }

    pub fn max_buffers(&self) -> usize {
        self.max_buffers
    }

    /// Bytes currently allocated by the pool (in use or idle).
    pub fn allocated_bytes(&self) -> usize {
        self.created.load(Ordering::Relaxed) * self.buf_size
    }

    /// Takes a buffer, creating one if the pool is below its bound, else
    /// waiting up to `timeout` for one to come back. `None` on timeout.
    /// The buffer goes back to the pool when the returned guard is dropped.
    pub fn acquire(self: &Arc<Self>, timeout: Duration) -> Option<PooledBuf> {
        self.acquire_raw(timeout).map(|buf| PooledBuf {
            buf: Some(buf),
            pool: Arc::clone(self),
        })
    }

    fn acquire_raw(&self, timeout: Duration) -> Option<AlignedBuf> {
        if let Ok(b) = self.rx.try_recv() {
            return Some(b);
        }
        let mut n = self.created.load(Ordering::Relaxed);
        while n < self.max_buffers {
            match self
                .created
                .compare_exchange(n, n + 1, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => {
                    return AlignedBuf::with_pages(self.buf_size, self.align, self.huge).or_else(
                        || {
                            self.created.fetch_sub(1, Ordering::AcqRel);
                            None
                        },
                    );
                }
                Err(cur) => n = cur,
            }
        }
        self.rx.recv_timeout(timeout).ok()
    }

    fn release(&self, buf: AlignedBuf) {
        debug_assert_eq!(buf.capacity(), self.buf_size);
        // The channel's capacity equals the number of buffers ever created, so
        // this cannot fail while the pool is alive.
        let _ = self.tx.try_send(buf);
    }
}

/// A staging buffer on loan from a [`BufferPool`]; returns itself on drop.
pub struct PooledBuf {
    buf: Option<AlignedBuf>,
    pool: Arc<BufferPool>,
}

impl std::ops::Deref for PooledBuf {
    type Target = AlignedBuf;
    fn deref(&self) -> &AlignedBuf {
        self.buf.as_ref().expect("present until drop")
    }
}

impl std::ops::DerefMut for PooledBuf {
    fn deref_mut(&mut self) -> &mut AlignedBuf {
        self.buf.as_mut().expect("present until drop")
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.pool.release(b);
        }
    }
}

/// Rounds `x` down to a multiple of `a` (a power of two).
#[inline]
pub fn align_down(x: u64, a: u64) -> u64 {
    x & !(a - 1)
}

/// Rounds `x` up to a multiple of `a` (a power of two).
#[inline]
pub fn align_up(x: u64, a: u64) -> u64 {
    (x + a - 1) & !(a - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_alloc_is_aligned() {
        for align in [512, 4096, 65536] {
            for cap in [12345, 300_000, 5 << 20] {
                let mut b = AlignedBuf::new(cap, align).unwrap();
                assert_eq!(b.as_ptr() as usize % align, 0);
                assert_eq!(b.capacity(), cap);
                b.as_mut_slice()[cap - 1] = 7;
            }
        }
        assert!(AlignedBuf::new(10, 3).is_none());
    }

    #[test]
    fn pool_is_bounded_and_reuses() {
        let pool = BufferPool::new(8192, 4096, 2, false);
        let a = pool.acquire(Duration::from_millis(1)).unwrap();
        let b = pool.acquire(Duration::from_millis(1)).unwrap();
        assert!(pool.acquire(Duration::from_millis(5)).is_none());
        let pa = a.as_ptr();
        drop(a);
        let c = pool.acquire(Duration::from_millis(1)).unwrap();
        assert_eq!(
            c.as_ptr(),
            pa,
            "a released buffer is reused, not reallocated"
        );
        assert_eq!(pool.allocated_bytes(), 2 * 8192);
        drop(b);
        drop(c);
    }

    #[test]
    fn rounding() {
        assert_eq!(align_down(4097, 4096), 4096);
        assert_eq!(align_up(4097, 4096), 8192);
        assert_eq!(align_up(0, 4096), 0);
        assert_eq!(align_up(4096, 4096), 4096);
    }
}
