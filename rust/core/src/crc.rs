//! CRC-32 (the IEEE polynomial zip uses) of a record and of each of its
//! [`CHUNK`]-byte chunks in one pass over the bytes.
//!
//! A record's zip CRC-32 and its chunk table (docs/FORMAT.md) cover the same
//! bytes. Rather than checksum the bytes twice, the chunks are checksummed
//! and the record's CRC is derived from the chunks' with the CRC's linearity:
//! `crc(A ‖ B) = crc(A)·x^(8·|B|) mod P  ⊕  crc(B)` (the conditioning of
//! both CRCs cancels out; it is zlib's `crc32_combine`). Multiplying by the
//! constant `x^(8·CHUNK) mod P` is a linear map of 32 bits, done with four
//! table lookups, so folding a chunk into the running CRC costs a few
//! nanoseconds against the ~30 ns of checksumming the chunk.
//!
//! Polynomials are in the reflected bit order the CRC uses: bit 31 is the
//! coefficient of x⁰.

use std::sync::OnceLock;

/// The CRC-32 polynomial, reflected.
const POLY: u32 = 0xedb8_8320;

/// The chunk size whose shift has tables.
pub const CHUNK: usize = 512;

/// `a(x)·b(x) mod P`.
fn mul_mod_p(a: u32, mut b: u32) -> u32 {
    let mut m = 1u32 << 31;
    let mut p = 0u32;
    while m != 0 {
        if a & m != 0 {
            p ^= b;
        }
        m >>= 1;
        b = if b & 1 != 0 { (b >> 1) ^ POLY } else { b >> 1 };
    }
    p
}

/// `x^(8·n) mod P`: the factor that shifts a CRC past `n` bytes.
fn x_pow_8n(n: u64) -> u32 {
    // x^(2^k) mod P for k = 3.. (x^8 = one byte), squared up as n's bits go.
    let mut sq = 1u32 << (31 - 8); // x^8
    let mut p = 1u32 << 31; // x^0
    let mut n = n;
    while n != 0 {
        if n & 1 != 0 {
            p = mul_mod_p(sq, p);
        }
        sq = mul_mod_p(sq, sq);
        n >>= 1;
    }
    p
}

/// The CRC-32 of `A ‖ B` from `crc(A)`, `crc(B)` and `|B|`.
pub fn combine(crc_a: u32, crc_b: u32, len_b: u64) -> u32 {
    mul_mod_p(x_pow_8n(len_b), crc_a) ^ crc_b
}

/// [`combine`] for many appends of a few distinct lengths: the factor of
/// each length is computed once.
#[derive(Default)]
pub struct Combiner {
    factors: std::collections::HashMap<u64, u32>,
}

impl Combiner {
    /// The CRC-32 of `A ‖ B` from `crc(A)`, `crc(B)` and `|B|`.
    pub fn combine(&mut self, crc_a: u32, crc_b: u32, len_b: u64) -> u32 {
        if crc_a == 0 {
            return crc_b; // shifting 0 gives 0
        }
        let f = *self.factors.entry(len_b).or_insert_with(|| x_pow_8n(len_b));
        mul_mod_p(f, crc_a) ^ crc_b
    }
}

/// Multiplication by `x^(8·CHUNK) mod P` as four byte tables.
struct Shift {
    tables: [[u32; 256]; 4],
}

impl Shift {
    fn new(len: u64) -> Self {
        let f = x_pow_8n(len);
        let mut tables = [[0u32; 256]; 4];
        for (k, t) in tables.iter_mut().enumerate() {
            for (b, slot) in t.iter_mut().enumerate() {
                *slot = mul_mod_p(f, (b as u32) << (8 * k));
            }
        }
        Shift { tables }
    }

    #[inline]
    fn apply(&self, c: u32) -> u32 {
        let t = &self.tables;
        t[0][(c & 0xff) as usize]
            ^ t[1][((c >> 8) & 0xff) as usize]
            ^ t[2][((c >> 16) & 0xff) as usize]
            ^ t[3][(c >> 24) as usize]
    }
}

fn chunk_shift() -> &'static Shift {
    static SHIFT: OnceLock<Shift> = OnceLock::new();
    SHIFT.get_or_init(|| Shift::new(CHUNK as u64))
}

/// Folds the CRC of the next `len` bytes into `acc` (the CRC of what came
/// before them).
#[inline]
pub fn append(acc: u32, crc: u32, len: usize) -> u32 {
    if acc == 0 && len > 0 {
        // crc(empty) is 0 and shifting 0 gives 0.
        return crc;
    }
    if len == CHUNK {
        chunk_shift().apply(acc) ^ crc
    } else {
        combine(acc, crc, len as u64)
    }
}

/// Checksums `data`, the bytes of a record from its offset `offset`, cut at
/// the record's chunk boundaries (multiples of [`CHUNK`]): pushes
/// `(offset in the record, length, CRC-32)` of every piece, a whole chunk
/// or the part of one that `data` holds, and returns the CRC-32 of `data`.
pub fn sum_chunks(data: &[u8], offset: u64, out: &mut Vec<(u64, u32, u32)>) -> u32 {
    let mut acc = 0u32;
    let mut pos = 0usize;
    while pos < data.len() {
        let at = offset + pos as u64;
        let room = CHUNK - (at % CHUNK as u64) as usize;
        let n = room.min(data.len() - pos);
        let c = crc32fast::hash(&data[pos..pos + n]);
        out.push((at, n as u32, c));
        acc = append(acc, c, n);
        pos += n;
    }
    acc
}

/// Copies `src` into `dst` (same length) and returns the CRC-32 of every
/// [`CHUNK`] of it (the last one possibly short): the chunk table a writer
/// would otherwise build with a second pass over `dst`.
///
/// Each chunk is checksummed from `src` and then copied while it is still in
/// the L1 cache, so the bytes cross the memory bus once. Where the CPU has
/// AVX2 and `dst` is 32-byte aligned the copy uses non-temporal stores: a
/// checkpoint capture of hundreds of MiB then leaves the training's working
/// set in the caches (glibc's `memmove` switches to such stores only above
/// a threshold of its own).
///
/// The sums are of the bytes read from `src`. If `src` changes during the
/// copy (its owner broke the capture contract), `dst` may hold other bytes
/// than the sums describe, and a later verification reports the record as
/// damaged instead of returning torn values.
pub fn copy_and_sum(dst: &mut [u8], src: &[u8]) -> Vec<u32> {
    assert_eq!(dst.len(), src.len(), "copy_and_sum: lengths differ");
    let mut sums = Vec::with_capacity(src.len().div_ceil(CHUNK));
    #[cfg(target_arch = "x86_64")]
    let stream = std::arch::is_x86_feature_detected!("avx2") && (dst.as_ptr() as usize) % 32 == 0;
    // `crc32fast::hash` detects the CPU's features at every call; a clone does not.
    let proto = crc32fast::Hasher::new();
    for (d, s) in dst.chunks_mut(CHUNK).zip(src.chunks(CHUNK)) {
        let mut h = proto.clone();
        h.update(s);
        sums.push(h.finalize());
        #[cfg(target_arch = "x86_64")]
        if stream && d.len() == CHUNK {
            // SAFETY: AVX2 is present, `d` is 32-byte aligned (a multiple of
            // CHUNK past an aligned start) and both slices are CHUNK long.
            unsafe { stream_chunk(d, s) };
            continue;
        }
        d.copy_from_slice(s);
    }
    #[cfg(target_arch = "x86_64")]
    if stream {
        // Non-temporal stores are weakly ordered: fence them before anyone
        // is told that the copy is done.
        // SAFETY: SSE is part of the x86_64 baseline.
        unsafe { std::arch::x86_64::_mm_sfence() };
    }
    sums
}

/// Copies one [`CHUNK`] with 32-byte non-temporal stores.
///
/// # Safety
///
/// The CPU must have AVX2, `dst` must be 32-byte aligned, and both slices
/// must be [`CHUNK`] bytes long.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn stream_chunk(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256};
    debug_assert!(dst.len() == CHUNK && src.len() == CHUNK);
    // `d` is 32-byte aligned (the caller's promise); `s` is read unaligned.
    #[allow(clippy::cast_ptr_alignment)]
    let d = dst.as_mut_ptr().cast::<__m256i>();
    #[allow(clippy::cast_ptr_alignment)]
    let s = src.as_ptr().cast::<__m256i>();
    for i in 0..CHUNK / 32 {
        // SAFETY: i * 32 + 32 <= CHUNK; `d` is aligned as the caller promised.
        unsafe { _mm256_stream_si256(d.add(i), _mm256_loadu_si256(s.add(i))) };
    }
}

/// The CRC-32 of a whole record from its chunk table (`len` bytes in all).
pub fn from_table(table: &[u32], len: u64) -> u32 {
    let mut acc = 0u32;
    let mut left = len;
    for &c in table {
        let n = left.min(CHUNK as u64);
        acc = append(acc, c, n as usize);
        left -= n;
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(n: usize, seed: u32) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                x as u8
            })
            .collect()
    }

    #[test]
    fn combine_matches_one_pass() {
        let d = bytes(20_000, 7);
        for cut in [0, 1, 7, 4095, 4096, 4097, 12_288, 19_999, 20_000] {
            let (a, b) = d.split_at(cut);
            let got = combine(crc32fast::hash(a), crc32fast::hash(b), b.len() as u64);
            assert_eq!(got, crc32fast::hash(&d), "cut at {cut}");
        }
        // Appending pieces of a few lengths, each length's factor reused.
        let mut c = Combiner::default();
        let (mut acc, mut at) = (0u32, 0usize);
        for len in [1280usize, 1280, 7, 1280, 0, 7, 4096, 3000]
            .iter()
            .cycle()
            .take(40)
        {
            let end = (at + len).min(d.len());
            acc = c.combine(acc, crc32fast::hash(&d[at..end]), (end - at) as u64);
            at = end;
            assert_eq!(acc, crc32fast::hash(&d[..at]), "after {at} bytes");
        }
    }

    #[test]
    fn chunk_shift_matches_combine() {
        for c in [0u32, 1, 0xdead_beef, u32::MAX, 0x8000_0000] {
            assert_eq!(chunk_shift().apply(c), mul_mod_p(x_pow_8n(CHUNK as u64), c));
        }
    }

    #[test]
    fn chunk_sums_give_the_record_crc_and_every_chunk() {
        let d = bytes(3 * CHUNK + 123, 11);
        // The record read in pieces that start anywhere, as a writer may.
        for starts in [
            vec![0],
            vec![0, 100, CHUNK + 200, 3 * CHUNK + 3],
            vec![0, CHUNK, 2 * CHUNK],
        ] {
            let mut pieces = Vec::new();
            let mut total = 0u32;
            for (i, &s) in starts.iter().enumerate() {
                let e = starts.get(i + 1).copied().unwrap_or(d.len());
                let c = sum_chunks(&d[s..e], s as u64, &mut pieces);
                assert_eq!(c, crc32fast::hash(&d[s..e]));
                total = append(total, c, e - s);
            }
            assert_eq!(total, crc32fast::hash(&d));
            // Pieces never cross a chunk boundary and cover the record in order.
            let mut at = 0u64;
            for &(o, n, c) in &pieces {
                assert_eq!(o, at);
                assert_eq!(o / CHUNK as u64, (o + u64::from(n) - 1) / CHUNK as u64);
                assert_eq!(c, crc32fast::hash(&d[o as usize..o as usize + n as usize]));
                at += u64::from(n);
            }
            assert_eq!(at, d.len() as u64);
        }
    }

    #[test]
    fn copy_and_sum_copies_and_matches_separate_passes() {
        for n in [0usize, 1, 31, 4095, 4096, 4097, 3 * CHUNK, 5 * CHUNK + 777] {
            let src = bytes(n, 3 + n as u32);
            // Aligned and unaligned destinations (the streaming and the plain copy).
            let mut backing = vec![0u8; n + 64];
            let base = backing.as_ptr() as usize;
            for shift in [(32 - base % 32) % 32, (32 - base % 32) % 32 + 8] {
                let dst = &mut backing[shift..shift + n];
                dst.fill(0xa5);
                let sums = copy_and_sum(dst, &src);
                assert_eq!(dst, &src[..], "n={n} shift={shift}");
                let mut table = vec![0u32; n.div_ceil(CHUNK)];
                crate::chunks::compute_into(&src, CHUNK, crate::chunks::Algo::Crc32, &mut table);
                assert_eq!(sums, table, "n={n}");
                assert_eq!(from_table(&sums, n as u64), crc32fast::hash(&src));
            }
        }
    }
}
