//! 32-bit words split into their high and low 16-bit halves, and joined back.
//!
//! The offload stores an fp32 master weight as only its low half: the model's
//! bf16 parameter, which exists anyway, is the high half. The high half
//! is rounded to nearest (ties away from zero on the magnitude bits: +1 when
//! the low half is `0x8000` or more), so the model gets the nearest bf16 and
//! the word is recovered exactly from the two halves: the rounding added 1
//! exactly when the low half is `0x8000` or more. All arithmetic on a half is
//! modulo 2^16, so every word (infinities and NaNs included) round-trips.
//!
//! Nothing here knows what the words mean; the caller passes slices of equal
//! length.

use std::thread;

/// Below this many words a call runs on the calling thread only.
const PARALLEL_MIN: usize = 1 << 20;

#[inline]
fn round_up(lo: u16) -> u16 {
    u16::from(lo >= 0x8000)
}

fn split_serial(src: &[u32], hi: &mut [u16], lo: &mut [u16]) {
    for ((w, h), l) in src.iter().zip(hi.iter_mut()).zip(lo.iter_mut()) {
        // Truncation to 16 bits is the point: the halves of the word.
        #[allow(clippy::cast_possible_truncation)]
        let (top, bottom) = ((w >> 16) as u16, *w as u16);
        *h = top.wrapping_add(round_up(bottom));
        *l = bottom;
    }
}

fn join_serial(hi: &[u16], lo: &[u16], out: &mut [u32]) {
    for ((h, l), w) in hi.iter().zip(lo.iter()).zip(out.iter_mut()) {
        let top = h.wrapping_sub(round_up(*l));
        *w = (u32::from(top) << 16) | u32::from(*l);
    }
}

fn chunk_len(n: usize, threads: usize) -> usize {
    let threads = if n < PARALLEL_MIN { 1 } else { threads.max(1) };
    n.div_ceil(threads).max(1)
}

/// Splits each word of `src` into its rounded high half (`hi`) and its low
/// half (`lo`), on up to `threads` threads.
///
/// # Panics
/// When the three slices differ in length.
pub fn split(src: &[u32], hi: &mut [u16], lo: &mut [u16], threads: usize) {
    assert!(
        src.len() == hi.len() && src.len() == lo.len(),
        "halves::split: slices differ in length"
    );
    let c = chunk_len(src.len(), threads);
    if c >= src.len() {
        return split_serial(src, hi, lo); // one chunk: no thread to start
    }
    thread::scope(|s| {
        for ((a, b), d) in src.chunks(c).zip(hi.chunks_mut(c)).zip(lo.chunks_mut(c)) {
            s.spawn(move || split_serial(a, b, d));
        }
    });
}

/// Joins the halves made by [`split`] back into the words, on up to
/// `threads` threads.
///
/// # Panics
/// When the three slices differ in length.
pub fn join(hi: &[u16], lo: &[u16], out: &mut [u32], threads: usize) {
    assert!(
        out.len() == hi.len() && out.len() == lo.len(),
        "halves::join: slices differ in length"
    );
    let c = chunk_len(out.len(), threads);
    if c >= out.len() {
        return join_serial(hi, lo, out);
    }
    thread::scope(|s| {
        for ((a, b), d) in hi.chunks(c).zip(lo.chunks(c)).zip(out.chunks_mut(c)) {
            s.spawn(move || join_serial(a, b, d));
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(words: &[u32], threads: usize) {
        let n = words.len();
        let (mut hi, mut lo, mut back) = (vec![0u16; n], vec![0u16; n], vec![0u32; n]);
        split(words, &mut hi, &mut lo, threads);
        join(&hi, &lo, &mut back, threads);
        assert_eq!(words, &back[..]);
    }

    #[test]
    fn every_low_half_and_edge_word_roundtrips() {
        let tops = [
            0x0000u32, 0x0001, 0x3F80, 0x7F7F, 0x7F80, 0x7FFF, 0x8000, 0xBF80, 0xFF7F, 0xFFFF,
        ];
        let words: Vec<u32> = tops
            .iter()
            .flat_map(|t| (0..=0xFFFFu32).map(move |l| (t << 16) | l))
            .collect();
        roundtrip(&words, 1);
        roundtrip(&words, 3);
    }

    #[test]
    fn the_high_half_is_the_nearest_bf16() {
        // 1.0 + 2^-8 + 2^-9 (1.5 bf16 ulps above 1.0): nearest is 1.0 + 2^-7.
        let cases = [
            (1.0f32, 0x3F80u16),
            (1.0 + 2f32.powi(-8) + 2f32.powi(-9), 0x3F81),
            (1.0 + 2f32.powi(-9), 0x3F80),  // below half an ulp
            (-1.0 - 2f32.powi(-8), 0xBF81), // a tie: away from zero
            (-2.5, 0xC020),
        ];
        for (x, want) in cases {
            let (mut hi, mut lo) = ([0u16], [0u16]);
            split(&[x.to_bits()], &mut hi, &mut lo, 1);
            assert_eq!(hi[0], want, "{x}");
        }
    }

    #[test]
    fn large_inputs_use_threads_and_agree() {
        let words: Vec<u32> = (0..(3 << 20) + 7)
            .map(|i: u32| i.wrapping_mul(2_654_435_761))
            .collect();
        roundtrip(&words, 4);
    }
}
