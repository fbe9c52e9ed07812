//! Byte planes of fixed-width elements, with the prediction from a reference
//! folded into the same pass (the inner loops of the `tsz1` codec).
//!
//! [`predict_split`] turns a chunk into `width` planes (byte *k* of every
//! element, in element order), each element first predicted from the same
//! element of the reference: `isub` stores the zigzag of the integer
//! difference of the two bit patterns, `xor` their exclusive or, `scaled`
//! (4-byte elements) the zigzag of the difference from the reference's
//! element times a scale (see [`Scale`]).
//! [`join_unpredict`] is its inverse. One pass over the data each way: the
//! loops are written so that the compiler vectorizes them, and on x86-64
//! they are compiled a second time for AVX2, chosen at run time.

// The loops are `#[inline(always)]` so that each is compiled into its
// caller: once plain and once inside the `#[target_feature(enable = "avx2")]`
// functions, whose AVX2 code is what the run-time dispatch picks.
#![allow(clippy::inline_always)]

/// How each element is predicted from the same element of the reference.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pred {
    None,
    Isub,
    Xor,
    /// `isub` against the reference's element times a scale (4-byte
    /// elements read as IEEE binary32).
    Scaled(Scale),
}

/// A positive scale factor (a normal binary32), applied to binary32 bit
/// patterns with integer arithmetic only: the result does not depend on the
/// floating-point environment (flush-to-zero, rounding mode) or the
/// platform, so an encoder and a decoder always predict the same bits.
/// Zeros, subnormals, infinities, NaNs, and products that would leave the
/// normal range are predicted as themselves. (The product's mantissa is
/// truncated, not rounded: a prediction only has to be close and the same
/// everywhere.)
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Scale {
    /// The scale's 24-bit significand, leading one included.
    m: u64,
    /// Its unbiased exponent.
    e: i32,
    bits: u32,
}

impl Scale {
    /// The scale whose binary32 bit pattern is `bits`, if it is a positive
    /// normal number.
    pub(crate) fn from_bits(bits: u32) -> Option<Scale> {
        let e = (bits >> 23) & 0xff;
        if bits >> 31 != 0 || e == 0 || e == 0xff {
            return None;
        }
        Some(Scale {
            m: u64::from((bits & 0x007f_ffff) | 0x0080_0000),
            e: e as i32 - 127,
            bits,
        })
    }

    pub(crate) fn bits(self) -> u32 {
        self.bits
    }

    /// `x` (binary32 bits) times the scale, as binary32 bits.
    #[inline(always)]
    pub(crate) fn apply(self, x: u32) -> u32 {
        let e = ((x >> 23) & 0xff) as i32;
        let p = u64::from((x & 0x007f_ffff) | 0x0080_0000) * self.m; // [2^46, 2^48)
        let hi = (p >> 47) as u32;
        let mant = ((p >> (23 + hi)) as u32) & 0x007f_ffff;
        let ne = e + self.e + hi as i32;
        let ok = (1..=0xfe).contains(&e) && (1..=0xfe).contains(&ne);
        if ok {
            (x & 0x8000_0000) | ((ne as u32) << 23) | mant
        } else {
            x
        }
    }
}

/// An unsigned element type of `W` bytes.
trait Lane: Copy {
    const W: usize;
    /// # Safety
    /// `p` points to `W` readable bytes.
    unsafe fn load(p: *const u8) -> Self;
    /// # Safety
    /// `p` points to `W` writable bytes.
    unsafe fn store(self, p: *mut u8);
    fn isub(a: Self, b: Self) -> Self;
    fn unisub(z: Self, b: Self) -> Self;
    fn xor(a: Self, b: Self) -> Self;
    fn byte(self, k: usize) -> u8;
    fn from_byte(b: u8, k: usize) -> Self;
    fn or(self, o: Self) -> Self;
    fn zero() -> Self;
}

macro_rules! lane {
    ($u:ty, $i:ty) => {
        impl Lane for $u {
            const W: usize = std::mem::size_of::<$u>();
            #[inline(always)]
            unsafe fn load(p: *const u8) -> Self {
                // SAFETY: per the trait's contract.
                <$u>::from_le(unsafe { p.cast::<$u>().read_unaligned() })
            }
            #[inline(always)]
            unsafe fn store(self, p: *mut u8) {
                // SAFETY: per the trait's contract.
                unsafe { p.cast::<$u>().write_unaligned(self.to_le()) }
            }
            #[inline(always)]
            fn isub(a: Self, b: Self) -> Self {
                let d = a.wrapping_sub(b) as $i;
                ((d << 1) ^ (d >> (<$u>::BITS - 1))) as $u
            }
            #[inline(always)]
            fn unisub(z: Self, b: Self) -> Self {
                let d = ((z >> 1) as $i) ^ (-((z & 1) as $i));
                b.wrapping_add(d as $u)
            }
            #[inline(always)]
            fn xor(a: Self, b: Self) -> Self {
                a ^ b
            }
            #[inline(always)]
            fn byte(self, k: usize) -> u8 {
                (self >> (8 * k)) as u8
            }
            #[inline(always)]
            fn from_byte(b: u8, k: usize) -> Self {
                <$u>::from(b) << (8 * k)
            }
            #[inline(always)]
            fn or(self, o: Self) -> Self {
                self | o
            }
            #[inline(always)]
            fn zero() -> Self {
                0
            }
        }
    };
}

lane!(u8, i8);
lane!(u16, i16);
lane!(u32, i32);
lane!(u64, i64);

/// Writes the `width` planes of `d` (predicted from `r` by `t` where `r` is
/// given) into `planes`: plane *k* is `planes[k * n..(k + 1) * n]` for `n`
/// elements.
///
/// # Panics
///
/// When `width` is not 1, 2, 4 or 8, does not divide `d.len()`, or `planes`
/// or `r` are not as long as `d`.
pub(crate) fn predict_split(d: &[u8], r: Option<&[u8]>, width: usize, t: Pred, planes: &mut [u8]) {
    assert!(matches!(width, 1 | 2 | 4 | 8) && d.len() % width == 0);
    assert!(
        !matches!(t, Pred::Scaled(_)) || width == 4,
        "scaled: 4-byte elements"
    );
    assert_eq!(planes.len(), d.len(), "one plane byte per data byte");
    if let Some(r) = r {
        assert_eq!(r.len(), d.len(), "a reference as long as the data");
    }
    let t = if r.is_some() { t } else { Pred::None };
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked above); the lengths are checked.
        unsafe { split_avx2(d, r, width, t, planes) };
        return;
    }
    split_any(d, r, width, t, planes);
}

/// Writes into `dst` the elements whose `width` planes are `planes` (each
/// `dst.len() / width` bytes), unpredicted from `r` by `t` where `r` is given.
///
/// # Panics
///
/// When `width` is not 1, 2, 4 or 8, does not divide `dst.len()`, or the
/// planes or `r` do not have their lengths.
pub(crate) fn join_unpredict(
    planes: &[&[u8]],
    r: Option<&[u8]>,
    width: usize,
    t: Pred,
    dst: &mut [u8],
) {
    assert!(matches!(width, 1 | 2 | 4 | 8) && dst.len() % width == 0);
    assert!(
        !matches!(t, Pred::Scaled(_)) || width == 4,
        "scaled: 4-byte elements"
    );
    assert_eq!(planes.len(), width, "one plane per byte of an element");
    let n = dst.len() / width;
    assert!(planes.iter().all(|p| p.len() == n), "planes of n bytes");
    if let Some(r) = r {
        assert_eq!(r.len(), dst.len(), "a reference as long as the data");
    }
    let t = if r.is_some() { t } else { Pred::None };
    let mut ptrs = [std::ptr::null::<u8>(); 8];
    for (p, s) in ptrs.iter_mut().zip(planes) {
        *p = s.as_ptr();
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked above); the lengths are checked.
        unsafe { join_avx2(&ptrs, r, width, t, dst) };
        return;
    }
    // SAFETY: the lengths are checked above.
    unsafe { join_any(&ptrs, r, width, t, dst) };
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn split_avx2(d: &[u8], r: Option<&[u8]>, width: usize, t: Pred, planes: &mut [u8]) {
    split_any(d, r, width, t, planes);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn join_avx2(
    ptrs: &[*const u8; 8],
    r: Option<&[u8]>,
    width: usize,
    t: Pred,
    dst: &mut [u8],
) {
    // SAFETY: the caller's (checked lengths).
    unsafe { join_any(ptrs, r, width, t, dst) };
}

#[inline(always)]
fn split_any(d: &[u8], r: Option<&[u8]>, width: usize, t: Pred, planes: &mut [u8]) {
    if let (Some(r), Pred::Scaled(sc)) = (r, t) {
        let n = d.len() / 4;
        // SAFETY: `d`, `r` and `planes` hold `n` elements of 4 bytes (checked
        // by the caller).
        unsafe {
            split_body::<u32>(n, d.as_ptr(), r.as_ptr(), planes.as_mut_ptr(), |a, b| {
                <u32 as Lane>::isub(a, sc.apply(b))
            });
        }
        return;
    }
    match width {
        1 => split_w::<u8>(d, r, t, planes),
        2 => split_w::<u16>(d, r, t, planes),
        4 => split_w::<u32>(d, r, t, planes),
        _ => split_w::<u64>(d, r, t, planes),
    }
}

#[inline(always)]
fn split_w<L: Lane>(d: &[u8], r: Option<&[u8]>, t: Pred, planes: &mut [u8]) {
    let n = d.len() / L::W;
    let (dp, out) = (d.as_ptr(), planes.as_mut_ptr());
    // SAFETY: `d`, `r` (checked as long as `d`) and `planes` (as long as
    // `d`) hold `n` elements of `W` bytes.
    unsafe {
        match (r, t) {
            (Some(r), Pred::Isub) => split_body::<L>(n, dp, r.as_ptr(), out, L::isub),
            (Some(r), Pred::Xor) => split_body::<L>(n, dp, r.as_ptr(), out, L::xor),
            _ => split_body::<L>(n, dp, dp, out, |a, _| a),
        }
    }
}

/// # Safety
///
/// `d` and `r` hold `n` elements, `out` has room for `n * W` bytes.
#[inline(always)]
unsafe fn split_body<L: Lane>(
    n: usize,
    d: *const u8,
    r: *const u8,
    out: *mut u8,
    f: impl Fn(L, L) -> L,
) {
    for i in 0..n {
        // SAFETY: the function's contract.
        unsafe {
            let x = f(L::load(d.add(i * L::W)), L::load(r.add(i * L::W)));
            for k in 0..L::W {
                *out.add(k * n + i) = x.byte(k);
            }
        }
    }
}

/// # Safety
///
/// The first `width` pointers each point to `dst.len() / width` readable bytes.
#[inline(always)]
unsafe fn join_any(ptrs: &[*const u8; 8], r: Option<&[u8]>, width: usize, t: Pred, dst: &mut [u8]) {
    // SAFETY: the function's contract.
    unsafe {
        if let (Some(r), Pred::Scaled(sc)) = (r, t) {
            let n = dst.len() / 4;
            join_body::<u32>(
                n,
                ptrs,
                r.as_ptr(),
                dst.as_mut_ptr(),
                |z, b| <u32 as Lane>::unisub(z, sc.apply(b)),
                true,
            );
            return;
        }
        match width {
            1 => join_w::<u8>(ptrs, r, t, dst),
            2 => join_w::<u16>(ptrs, r, t, dst),
            4 => join_w::<u32>(ptrs, r, t, dst),
            _ => join_w::<u64>(ptrs, r, t, dst),
        }
    }
}

/// # Safety
///
/// As [`join_any`].
#[inline(always)]
unsafe fn join_w<L: Lane>(ptrs: &[*const u8; 8], r: Option<&[u8]>, t: Pred, dst: &mut [u8]) {
    let n = dst.len() / L::W;
    let out = dst.as_mut_ptr();
    // SAFETY: the function's contract; `r` is as long as `dst`.
    unsafe {
        match (r, t) {
            (Some(r), Pred::Isub) => join_body::<L>(n, ptrs, r.as_ptr(), out, L::unisub, true),
            (Some(r), Pred::Xor) => join_body::<L>(n, ptrs, r.as_ptr(), out, L::xor, true),
            _ => join_body::<L>(n, ptrs, out, out, |a, _| a, false),
        }
    }
}

/// # Safety
///
/// The first `W` pointers of `ptrs` each point to `n` readable bytes; `r`
/// (read only where `with_ref`) holds `n` elements; `out` has room for them.
#[inline(always)]
unsafe fn join_body<L: Lane>(
    n: usize,
    ptrs: &[*const u8; 8],
    r: *const u8,
    out: *mut u8,
    f: impl Fn(L, L) -> L,
    with_ref: bool,
) {
    let mut p = [std::ptr::null::<u8>(); 8];
    p[..L::W].copy_from_slice(&ptrs[..L::W]);
    for i in 0..n {
        // SAFETY: the function's contract.
        unsafe {
            let mut x = L::zero();
            for (k, pk) in p.iter().enumerate().take(L::W) {
                x = x.or(L::from_byte(*pk.add(i), k));
            }
            let v = if with_ref {
                f(x, L::load(r.add(i * L::W)))
            } else {
                x
            };
            v.store(out.add(i * L::W));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The planes and the prediction the slow way, one byte at a time.
    fn reference_split(d: &[u8], r: Option<&[u8]>, w: usize, t: Pred) -> Vec<u8> {
        let n = d.len() / w;
        let mut out = vec![0u8; d.len()];
        for i in 0..n {
            let mut a = [0u8; 8];
            let mut b = [0u8; 8];
            a[..w].copy_from_slice(&d[i * w..(i + 1) * w]);
            if let Some(r) = r {
                b[..w].copy_from_slice(&r[i * w..(i + 1) * w]);
            }
            let (a, b) = (u64::from_le_bytes(a), u64::from_le_bytes(b));
            let bits = 8 * w as u32;
            let mask = if w == 8 { u64::MAX } else { (1u64 << bits) - 1 };
            let b = match t {
                Pred::Scaled(sc) => u64::from(slow_scale(a_u32(b), f32::from_bits(sc.bits()))),
                _ => b,
            };
            let x = match (r, t) {
                (Some(_), Pred::Isub | Pred::Scaled(_)) => {
                    // Sign-extend the w-byte difference, then zigzag.
                    let diff = a.wrapping_sub(b) & mask;
                    let s = ((diff << (64 - bits)) as i64) >> (64 - bits);
                    (((s << 1) ^ (s >> 63)) as u64) & mask
                }
                (Some(_), Pred::Xor) => a ^ b,
                _ => a,
            };
            for k in 0..w {
                out[k * n + i] = (x >> (8 * k)) as u8;
            }
        }
        out
    }

    fn a_u32(x: u64) -> u32 {
        u32::try_from(x).expect("a 4-byte element")
    }

    /// The scaled prediction the slow way: the exact product in binary64
    /// (24 x 24 significand bits fit its 53), truncated to binary32's 24.
    fn slow_scale(x: u32, s: f32) -> u32 {
        let xf = f32::from_bits(x);
        if !xf.is_normal() {
            return x;
        }
        let pb = (f64::from(xf) * f64::from(s)).to_bits();
        let ne = ((pb >> 52) & 0x7ff) as i32 - 1023 + 127;
        if !(1..=254).contains(&ne) {
            return x;
        }
        (x & 0x8000_0000) | ((ne as u32) << 23) | ((pb >> 29) as u32 & 0x007f_ffff)
    }

    #[test]
    fn scale_is_the_truncated_exact_product_and_keeps_specials() {
        let specials = [
            0u32,
            0x8000_0000,
            1,
            0x007f_ffff,
            0x0080_0000,
            0x7f7f_ffff,
            0xff7f_ffff,
            0x7f80_0000,
            0xff80_0000,
            0x7fc0_0001,
            0xffa0_0000,
            1.0f32.to_bits(),
            (-2.5f32).to_bits(),
        ];
        let mut seed = 7u64;
        let mut xs: Vec<u32> = specials.to_vec();
        for _ in 0..20_000 {
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            xs.push((seed >> 32) as u32);
        }
        for s in [
            0.348_678_4f32,
            0.990_045,
            1.0,
            1.999_999_9,
            3.0e-38,
            1.0e38,
            0.5,
        ] {
            let sc = Scale::from_bits(s.to_bits()).unwrap();
            for &x in &xs {
                assert_eq!(sc.apply(x), slow_scale(x, s), "x {x:#010x} s {s}");
            }
        }
        for bad in [
            0u32,
            0x8000_0000,
            1,
            0x7f80_0000,
            0x7fc0_0000,
            (-1.0f32).to_bits(),
        ] {
            assert!(Scale::from_bits(bad).is_none(), "{bad:#x}");
        }
    }

    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                (s >> 56) as u8
            })
            .collect()
    }

    #[test]
    fn split_and_join_match_the_byte_by_byte_definition() {
        for w in [1usize, 2, 4, 8] {
            for n in [0usize, 1, 7, 33, 1000] {
                let d = bytes(n * w, 1 + w as u64);
                let r = bytes(n * w, 99 + n as u64);
                let scaled = Scale::from_bits(0.348_678_4_f32.to_bits()).unwrap();
                for (rr, t) in [
                    (None, Pred::None),
                    (Some(&r[..]), Pred::None),
                    (Some(&r[..]), Pred::Isub),
                    (Some(&r[..]), Pred::Xor),
                    (Some(&r[..]), Pred::Scaled(scaled)),
                ] {
                    if matches!(t, Pred::Scaled(_)) && w != 4 {
                        continue;
                    }
                    let mut planes = vec![0u8; d.len()];
                    predict_split(&d, rr, w, t, &mut planes);
                    assert_eq!(planes, reference_split(&d, rr, w, t), "w {w} n {n} {t:?}");
                    let views: Vec<&[u8]> = (0..w).map(|k| &planes[k * n..(k + 1) * n]).collect();
                    let mut back = vec![0xAAu8; d.len()];
                    join_unpredict(&views, rr, w, t, &mut back);
                    assert_eq!(back, d, "w {w} n {n} {t:?}");
                }
            }
        }
    }

    #[test]
    fn planes_may_lie_anywhere() {
        // Joined from planes that are not one buffer (stored planes are read
        // from the payload in place), and from unaligned memory.
        let (w, n) = (4usize, 101usize);
        let d = bytes(n * w + 1, 5);
        let d = &d[1..];
        let mut planes = vec![0u8; d.len()];
        predict_split(d, None, w, Pred::None, &mut planes);
        let copies: Vec<Vec<u8>> = (0..w)
            .map(|k| planes[k * n..(k + 1) * n].to_vec())
            .collect();
        let views: Vec<&[u8]> = copies.iter().map(Vec::as_slice).collect();
        let mut back = vec![0u8; d.len() + 1];
        join_unpredict(&views, None, w, Pred::None, &mut back[1..]);
        assert_eq!(&back[1..], d);
    }
}
