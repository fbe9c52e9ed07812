//! Checking file-mapped memory: pages brought in a window at a time before
//! the checksum reads them.
//!
//! A mapped load (`load(mmap=True)`) and the windowed reads of partial
//! chunks verify bytes that live in a mapping of the file, most of them not
//! yet read from the device. Checksumming such memory straight through
//! faults its pages in under the checksum loop. On the 2-core VM this was
//! measured on, that gave erratic costs: of two identical cold 2 GiB mapped
//! loads, one spent 0.1 CPU s/GiB and the next 1.3, all of it inside the
//! CRC loop. Bringing each window in first with
//! `madvise(MADV_POPULATE_READ)` (one call maps the window's pages, reading
//! what the page cache lacks) and only then checksumming it measured
//! 0.10-0.12 CPU s/GiB in every run.
//!
//! The populate also turns a failing device or a file cut short under the
//! mapping into an error returned here, where touching the pages would
//! raise `SIGBUS` and end the process.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// The bytes brought in and checked as one unit.
pub const WINDOW: usize = 8 << 20;

const PAGE: usize = 4096;

/// Set once the kernel has refused `MADV_POPULATE_READ` as unknown (before
/// Linux 5.14); then the pages are faulted in by the reads themselves.
static UNSUPPORTED: AtomicBool = AtomicBool::new(false);

/// Maps the pages of `[addr, addr + len)` (rounded out to pages), reading
/// from the file what the page cache does not hold.
///
/// `Ok(false)` where the kernel does not know the advice (nothing done;
/// the caller's reads fault the pages in). `Err` where populating failed:
/// `EFAULT` for pages past the end of the file (it shrank), `EIO` or
/// `EHWPOISON` for a read the device could not serve.
///
/// # Safety
///
/// The range must lie inside one live mapping of the caller's.
pub unsafe fn populate(addr: *const u8, len: usize) -> io::Result<bool> {
    if len == 0 || UNSUPPORTED.load(Ordering::Relaxed) {
        return Ok(false);
    }
    let start = addr as usize / PAGE * PAGE;
    let end = (addr as usize + len).div_ceil(PAGE) * PAGE;
    let mut tries = 0;
    loop {
        // SAFETY: the pages hold bytes of the caller's mapping (contract);
        // rounding out to pages stays within it. The advice only reads.
        let rc = unsafe {
            libc::madvise(
                start as *mut libc::c_void,
                end - start,
                libc::MADV_POPULATE_READ,
            )
        };
        if rc == 0 {
            return Ok(true);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINVAL) => {
                UNSUPPORTED.store(true, Ordering::Relaxed);
                return Ok(false);
            }
            Some(libc::EINTR | libc::EAGAIN) if tries < 8 => tries += 1,
            _ => return Err(e),
        }
    }
}

/// A failure to bring in a region's pages: which region, and why.
#[derive(Debug)]
pub struct PopulateError {
    pub region: usize,
    pub error: io::Error,
}

/// A piece of one region: `(region, offset in it, length)`, inside one window.
type Piece = (usize, usize, usize);

/// What one thread summed, and the failure that stopped it, if any.
type Summed = (Vec<(Piece, u32)>, Option<PopulateError>);

/// CRC-32 of each `(address, length)` region of mapped memory, on `threads`
/// threads: the regions are cut at [`WINDOW`] boundaries of the address
/// space, and each thread takes a window, populates it, and checksums its
/// pieces. The first region (in address order) whose pages could not be
/// brought in is reported.
///
/// # Safety
///
/// Every region must lie inside a live mapping (or other memory) that stays
/// mapped and unchanged during the call.
pub unsafe fn crc32_regions(
    regions: &[(usize, usize)],
    threads: usize,
) -> std::result::Result<Vec<u32>, PopulateError> {
    let mut order: Vec<usize> = (0..regions.len()).collect();
    order.sort_by_key(|&i| regions[i].0);
    let mut windows: Vec<Vec<Piece>> = Vec::new();
    let mut current: Option<usize> = None;
    for &r in &order {
        let (addr, len) = regions[r];
        let mut off = 0;
        while off < len {
            let a = addr + off;
            let w = a / WINDOW;
            let n = ((w + 1) * WINDOW - a).min(len - off);
            if current != Some(w) {
                windows.push(Vec::new());
                current = Some(w);
            }
            windows.last_mut().expect("pushed").push((r, off, n));
            off += n;
        }
    }
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let run = || {
        let mut sums: Vec<(Piece, u32)> = Vec::new();
        let mut err: Option<PopulateError> = None;
        while !failed.load(Ordering::Relaxed) {
            let k = next.fetch_add(1, Ordering::Relaxed);
            let Some(pieces) = windows.get(k) else { break };
            // One populate per run of pieces whose pages touch (records
            // with only a header between them are one run).
            let mut i = 0;
            while i < pieces.len() {
                let (r0, o0, n0) = pieces[i];
                let start = regions[r0].0 + o0;
                let mut end = start + n0;
                let mut j = i + 1;
                while j < pieces.len() {
                    let (r, o, n) = pieces[j];
                    let s = regions[r].0 + o;
                    if s / PAGE > end.div_ceil(PAGE) {
                        break;
                    }
                    end = end.max(s + n);
                    j += 1;
                }
                // SAFETY: the run is made of caller regions (contract) and
                // the pages between them, which share pages with them.
                if let Err(e) = unsafe { populate(start as *const u8, end - start) } {
                    // Name the first piece of the run whose pages failed.
                    let region = pieces[i..j]
                        .iter()
                        .find(|&&(r, o, n)| {
                            // SAFETY: as above, one piece at a time.
                            unsafe { populate((regions[r].0 + o) as *const u8, n) }.is_err()
                        })
                        .map_or(r0, |p| p.0);
                    err = Some(PopulateError { region, error: e });
                    failed.store(true, Ordering::Relaxed);
                    return (sums, err);
                }
                i = j;
            }
            for &(r, o, n) in pieces {
                // SAFETY: inside region `r` (cut so), alive (contract).
                let data =
                    unsafe { std::slice::from_raw_parts((regions[r].0 + o) as *const u8, n) };
                sums.push(((r, o, n), crc32fast::hash(data)));
            }
        }
        (sums, err)
    };
    let threads = threads.clamp(1, windows.len().max(1));
    let results: Vec<Summed> = if threads == 1 {
        vec![run()]
    } else {
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads).map(|_| s.spawn(run)).collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("crc thread"))
                .collect()
        })
    };
    let mut first_err: Option<PopulateError> = None;
    let mut all: Vec<(Piece, u32)> = Vec::new();
    for (sums, err) in results {
        all.extend(sums);
        if let Some(e) = err {
            let earlier = first_err
                .as_ref()
                .is_none_or(|f| regions[e.region].0 < regions[f.region].0);
            if earlier {
                first_err = Some(e);
            }
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    all.sort_unstable_by_key(|&((r, o, _), _)| (r, o));
    let mut out = vec![0u32; regions.len()];
    for ((r, _, n), c) in all {
        out[r] = crate::crc::combine(out[r], c, n as u64);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::io::AsRawFd;

    fn map(file: &std::fs::File, len: usize) -> *const u8 {
        // SAFETY: a private read-only mapping of an open file.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_PRIVATE,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        p.cast::<u8>().cast_const()
    }

    #[test]
    fn sums_match_the_plain_crc_across_windows_and_gaps() {
        let len = 3 * WINDOW + 12_345;
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4099) as u8).collect();
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&data).unwrap();
        let base = map(&f, len);
        // Regions out of order, one across two window boundaries, small
        // ones with gaps between them, an empty one.
        let regions = [
            (WINDOW - 100, 2 * WINDOW + 300),
            (17, 4000),
            (4100, 10),
            (4200, 0),
            (3 * WINDOW + 5, 12_000),
        ];
        let addrs: Vec<(usize, usize)> = regions
            .iter()
            .map(|&(o, n)| (base as usize + o, n))
            .collect();
        for threads in [1, 2, 3] {
            // SAFETY: every region lies inside the mapping, alive until the munmap below.
            let got = unsafe { crc32_regions(&addrs, threads) }.unwrap();
            let want: Vec<u32> = regions
                .iter()
                .map(|&(o, n)| crc32fast::hash(&data[o..o + n]))
                .collect();
            assert_eq!(got, want, "{threads} threads");
        }
        // SAFETY: mapped above with this length.
        unsafe { libc::munmap(base.cast_mut().cast(), len) };
    }

    #[test]
    fn a_file_cut_short_under_the_mapping_is_an_error_not_a_signal() {
        let len = 2 * WINDOW;
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&vec![5u8; len]).unwrap();
        let base = map(&f, len);
        // SAFETY: the first page of the mapping.
        if !unsafe { populate(base, 1) }.unwrap() {
            eprintln!("MADV_POPULATE_READ unknown to this kernel: nothing to test");
            return;
        }
        f.set_len(WINDOW as u64 + 4096).unwrap();
        let regions = [(base as usize, 4096), (base as usize + WINDOW + 8192, 100)];
        // SAFETY: inside the mapping; the pages past the end are touched by
        // nothing but the populate (supported, checked above), which reports them.
        let err = unsafe { crc32_regions(&regions, 2) }.unwrap_err();
        assert_eq!(err.region, 1);
        assert_eq!(err.error.raw_os_error(), Some(libc::EFAULT));
        // SAFETY: mapped above with this length.
        unsafe { libc::munmap(base.cast_mut().cast(), len) };
    }
}
