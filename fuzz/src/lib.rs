//! The harness of the cargo-fuzz targets: the properties every parse must
//! keep, and valid archives (built with `tierstore_core::plan::Plan`) mutated
//! as the fuzzer's bytes say. `rust/core/tests/fuzz_parsers.rs` runs the same
//! properties and mutations as proptest targets in `cargo test`.

use std::path::Path;

use libfuzzer_sys::arbitrary::{Result, Unstructured};
use tierstore_core::plan::{Plan, Source};
use tierstore_core::zip::{self, CdEntry, Directory};
use tierstore_core::Error;

const P: &str = "fuzz.zip";

fn format_error(e: &Error) -> bool {
    matches!(
        e,
        Error::NotAContainer { .. } | Error::Truncated { .. } | Error::Corrupt { .. }
    )
}

/// Checks that a data offset accepted for `e` keeps its data inside the
/// record area, after its own header and before the next record's header
/// (`headers`: every entry's header offset, sorted).
fn check_accepted(dir: &Directory, headers: &[u64], e: &CdEntry, data_offset: u64) {
    let min = u128::from(e.header_offset) + 30 + e.name.len() as u128;
    let end = u128::from(data_offset) + u128::from(e.compressed_size);
    assert!(
        u128::from(data_offset) >= min,
        "data inside its own header: {e:?} at {data_offset}"
    );
    assert!(
        end <= u128::from(dir.cd_offset),
        "data runs into the directory: {e:?} at {data_offset}"
    );
    let next = headers.partition_point(|&h| h <= e.header_offset);
    if let Some(&h) = headers.get(next) {
        assert!(
            end <= u128::from(h),
            "data over the next header at {h}: {e:?} at {data_offset}"
        );
    }
}

/// Parses `file` and checks every promise of the directory: only format
/// errors; on success the directory inside the file, each entry's header
/// and data in the record area, data offsets from the local headers (as the
/// readers probe them) keeping to their own space, no two records sharing
/// bytes. Also `check_data_range` on offsets around the true one.
pub fn check_file(file: &[u8]) -> Option<Directory> {
    let p = Path::new(P);
    let dir = match zip::read_directory(file, p) {
        Ok(d) => d,
        Err(e) => {
            assert!(format_error(&e), "unexpected kind of error: {e:?}");
            return None;
        }
    };
    let len = file.len() as u64;
    assert_eq!(dir.file_len, len);
    assert!(dir.cd_offset <= len);
    let mut headers: Vec<u64> = dir.entries.iter().map(|e| e.header_offset).collect();
    headers.sort_unstable();
    let mut spans = Vec::new();
    for e in &dir.entries {
        assert!(e.compressed_size <= dir.cd_offset, "{e:?}");
        assert!(
            e.header_offset
                .checked_add(30)
                .is_some_and(|x| x <= dir.cd_offset),
            "{e:?}"
        );
        let end = (e.header_offset + zip::local_header_probe_len(e.name.len())).min(dir.cd_offset);
        let probe = &file[e.header_offset as usize..end as usize];
        match zip::data_offset_from_local(probe, e, &dir, p) {
            Ok(d) => {
                check_accepted(&dir, &headers, e, d);
                let end = d + e.compressed_size;
                // In bounds of the file.
                std::hint::black_box(&file[d as usize..end as usize]);
                spans.push((e.header_offset, end));
                for off in [d.wrapping_sub(1), d + 1, u64::MAX - e.compressed_size / 2] {
                    match zip::check_data_range(e, off, &dir, p) {
                        Ok(()) => check_accepted(&dir, &headers, e, off),
                        Err(err) => assert!(format_error(&err), "{err:?}"),
                    }
                }
            }
            Err(err) => assert!(format_error(&err), "unexpected kind of error: {err:?}"),
        }
    }
    spans.sort_unstable();
    for w in spans.windows(2) {
        assert!(w[0].1 <= w[1].0, "records overlap: {w:?}");
    }
    Some(dir)
}

fn le(b: &[u8], at: usize, n: usize) -> u64 {
    (0..n).fold(0, |v, i| v | (u64::from(b[at + i]) << (8 * i)))
}

/// Writes the low `n` bytes of `v` at `at`, as far as the buffer reaches.
fn put(b: &mut [u8], at: usize, n: usize, v: u64) {
    for i in 0..n {
        if let Some(x) = at.checked_add(i).and_then(|j| b.get_mut(j)) {
            *x = (v >> (8 * i)) as u8;
        }
    }
}

/// Where the fields of a valid archive are.
#[derive(Default)]
pub struct Map {
    /// Local headers: (offset, name length).
    pub locals: Vec<(usize, usize)>,
    /// Central-directory entries: (offset, offset of their zip64 extra field).
    pub cds: Vec<(usize, Option<usize>)>,
    pub cd_offset: usize,
    pub zip64: Option<usize>,
    pub locator: Option<usize>,
    pub eocd: usize,
}

fn map(file: &[u8], eocd: usize) -> Map {
    let mut m = Map {
        eocd,
        ..Map::default()
    };
    let mut n = le(file, eocd + 10, 2);
    m.cd_offset = le(file, eocd + 16, 4) as usize;
    if n == 0xffff || le(file, eocd + 12, 4) == 0xffff_ffff || m.cd_offset == 0xffff_ffff {
        let loc = eocd - 20;
        let z = le(file, loc + 8, 8) as usize;
        m.locator = Some(loc);
        m.zip64 = Some(z);
        n = le(file, z + 32, 8);
        m.cd_offset = le(file, z + 48, 8) as usize;
    }
    let mut p = m.cd_offset;
    for _ in 0..n {
        let (nl, xl, cl) = (
            le(file, p + 28, 2) as usize,
            le(file, p + 30, 2) as usize,
            le(file, p + 32, 2) as usize,
        );
        let mut x = p + 46 + nl;
        let mut z64 = None;
        while x + 4 <= p + 46 + nl + xl {
            if le(file, x, 2) == 1 {
                z64 = Some(x);
            }
            x += 4 + le(file, x + 2, 2) as usize;
        }
        let mut h = le(file, p + 42, 4);
        if h == 0xffff_ffff {
            let sizes = if le(file, p + 24, 4) == 0xffff_ffff {
                16
            } else {
                0
            };
            h = le(file, z64.expect("zip64 extra") + 4 + sizes, 8);
        }
        m.locals
            .push((h as usize, le(file, h as usize + 26, 2) as usize));
        m.cds.push((p, z64));
        p += 46 + nl + xl + cl;
    }
    m
}

/// A valid archive the fuzzer's bytes describe: up to six records (names,
/// lengths, alignments), then the directory re-encoded with zip64 end
/// records, zip64 extras (sizes, offsets), another extra field, a comment.
pub fn archive(u: &mut Unstructured<'_>) -> Result<(Vec<u8>, Map)> {
    let n = u.int_in_range(1..=6)?;
    let mut plan = Plan::new(4096).expect("align");
    for i in 0..n {
        let suffix: String = (0..u.int_in_range(0..=12)?)
            .map(|_| u.choose(b"abz09/._-").map(|&c| c as char))
            .collect::<Result<_>>()?;
        let len = usize::from(u.int_in_range(0u16..=5000)?);
        let seed: u8 = u.arbitrary()?;
        let align = *u.choose(&[1u64, 8, 64, 4096])?;
        let data: Vec<u8> = (0..len)
            .map(|j| (j as u8).wrapping_mul(31) ^ seed)
            .collect();
        plan.add_aligned(
            &format!("a/data/{i}{suffix}"),
            Source::Bytes(data.into()),
            align,
        )
        .expect("record");
    }
    plan.compute_missing_crcs(1);
    plan.finalize().expect("finalize");
    let mut file = vec![0u8; plan.file_end() as usize];
    plan.gather(0, &mut file, 1, false).expect("gather");
    let m = map(&file, file.len() - 22);

    let zip64_end: u8 = u.int_in_range(0..=7)?;
    let (sizes, offsets) = if zip64_end != 0 {
        (u.arbitrary::<bool>()?, u.arbitrary::<bool>()?)
    } else {
        (false, false)
    };
    let other_extra: bool = u.arbitrary()?;
    let comment_len = usize::from(u.int_in_range(0u8..=40)?);
    let mut comment: Vec<u8> = (0..comment_len)
        .map(|_| u.arbitrary())
        .collect::<Result<_>>()?;
    unambiguous(&mut comment);

    let f = &file;
    let mut out = f[..m.cd_offset].to_vec();
    for &(p, _) in &m.cds {
        let nl = le(f, p + 28, 2) as usize;
        let mut fixed = f[p..p + 46].to_vec();
        let mut extra = Vec::new();
        if other_extra {
            extra.extend_from_slice(&[0x55, 0x54, 5, 0, 1, 2, 3, 4, 5]);
        }
        if sizes || offsets {
            let mut body = Vec::new();
            if sizes {
                body.extend_from_slice(&le(f, p + 24, 4).to_le_bytes());
                body.extend_from_slice(&le(f, p + 20, 4).to_le_bytes());
                put(&mut fixed, 20, 4, 0xffff_ffff);
                put(&mut fixed, 24, 4, 0xffff_ffff);
            }
            if offsets {
                body.extend_from_slice(&le(f, p + 42, 4).to_le_bytes());
                put(&mut fixed, 42, 4, 0xffff_ffff);
            }
            extra.extend_from_slice(&1u16.to_le_bytes());
            extra.extend_from_slice(&(body.len() as u16).to_le_bytes());
            extra.extend_from_slice(&body);
        }
        put(&mut fixed, 30, 2, extra.len() as u64);
        out.extend_from_slice(&fixed);
        out.extend_from_slice(&f[p + 46..p + 46 + nl]);
        out.extend_from_slice(&extra);
    }
    let count = m.cds.len() as u64;
    let cd_size = (out.len() - m.cd_offset) as u64;
    let (mut n16, mut size32, mut off32) = (count, cd_size, m.cd_offset as u64);
    if zip64_end != 0 {
        let z = out.len() as u64;
        out.extend_from_slice(&0x0606_4b50u32.to_le_bytes());
        out.extend_from_slice(&44u64.to_le_bytes());
        out.extend_from_slice(&[0x2d, 3, 45, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        for v in [count, count, cd_size, m.cd_offset as u64] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&0x0706_4b50u32.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&z.to_le_bytes());
        out.extend_from_slice(&1u32.to_le_bytes());
        if zip64_end & 1 != 0 {
            n16 = 0xffff;
        }
        if zip64_end & 2 != 0 {
            size32 = 0xffff_ffff;
        }
        if zip64_end & 4 != 0 {
            off32 = 0xffff_ffff;
        }
    }
    let eocd = out.len();
    out.extend_from_slice(&0x0605_4b50u32.to_le_bytes());
    out.extend_from_slice(&[0, 0, 0, 0]);
    out.extend_from_slice(&(n16 as u16).to_le_bytes());
    out.extend_from_slice(&(n16 as u16).to_le_bytes());
    out.extend_from_slice(&(size32 as u32).to_le_bytes());
    out.extend_from_slice(&(off32 as u32).to_le_bytes());
    out.extend_from_slice(&(comment.len() as u16).to_le_bytes());
    out.extend_from_slice(&comment);
    let m = map(&out, eocd);
    Ok((out, m))
}

/// Breaks every end-record signature in `comment` that would make a
/// complete end record of its own (one whose comment reaches exactly to the
/// end of the file): such a file is another archive (the search for the end
/// record finds the last one), not the one built. Other signatures stay, to
/// exercise the search.
pub fn unambiguous(comment: &mut [u8]) {
    for j in 0..comment.len().saturating_sub(3) {
        if comment[j..j + 4] == *b"PK\x05\x06"
            && j + 22 <= comment.len()
            && le(comment, j + 20, 2) == (comment.len() - j - 22) as u64
        {
            comment[j] = b'Q';
        }
    }
}

const EOCD_FIELDS: &[(usize, usize)] = &[
    (0, 4),
    (4, 2),
    (6, 2),
    (8, 2),
    (10, 2),
    (12, 4),
    (16, 4),
    (20, 2),
];
const ZIP64_FIELDS: &[(usize, usize)] = &[
    (0, 4),
    (4, 8),
    (16, 4),
    (20, 4),
    (24, 8),
    (32, 8),
    (40, 8),
    (48, 8),
];
const LOCATOR_FIELDS: &[(usize, usize)] = &[(0, 4), (4, 4), (8, 8), (16, 4)];
const CD_FIELDS: &[(usize, usize)] = &[
    (0, 4),
    (8, 2),
    (10, 2),
    (16, 4),
    (20, 4),
    (24, 4),
    (28, 2),
    (30, 2),
    (32, 2),
    (34, 2),
    (42, 4),
];
const CD_ZIP64_FIELDS: &[(usize, usize)] = &[(0, 2), (2, 2), (4, 8), (12, 8), (20, 8)];
/// Offsets past 30 are relative to the name's end (the padding field).
const LOCAL_FIELDS: &[(usize, usize)] = &[
    (0, 4),
    (6, 2),
    (8, 2),
    (14, 4),
    (18, 4),
    (22, 4),
    (26, 2),
    (28, 2),
    (30, 2),
    (32, 2),
];

/// A value for a field: small constants, all ones, a power of two, the
/// field's value nudged, the file length, the directory offset, a record's
/// header offset (each nudged), or raw bits.
fn value(u: &mut Unstructured<'_>, file: &[u8], m: &Map, cur: u64) -> Result<u64> {
    let d = i64::from(u.int_in_range(-64i8..=63)?);
    Ok(match u.int_in_range(0..=8)? {
        0 => 0,
        1 => 1,
        2 => u64::MAX,
        3 => 1 << u.int_in_range(0..=63)?,
        4 => cur.wrapping_add_signed(d),
        5 => (file.len() as u64).wrapping_add_signed(d),
        6 => (m.cd_offset as u64).wrapping_add_signed(d),
        7 => {
            let h = if m.locals.is_empty() {
                0
            } else {
                u.choose(&m.locals)?.0
            };
            (h as u64).wrapping_add_signed(d)
        }
        _ => u.arbitrary()?,
    })
}

fn set_field(
    u: &mut Unstructured<'_>,
    file: &mut [u8],
    m: &Map,
    base: usize,
    fields: &[(usize, usize)],
) -> Result<()> {
    let (off, n) = *u.choose(fields)?;
    let at = base + off;
    let cur = if at + n <= file.len() {
        le(file, at, n)
    } else {
        0
    };
    let v = value(u, file, m, cur)?;
    put(file, at, n, v);
    Ok(())
}

/// Applies up to eight mutations the fuzzer's bytes choose: byte and bit
/// flips, truncation, overwrite and insertion of copied bytes, insertion of
/// new bytes, deletion, and writes to the end records, directory entries,
/// zip64 extras and local headers.
pub fn mutate(u: &mut Unstructured<'_>, file: &mut Vec<u8>, m: &Map) -> Result<()> {
    for _ in 0..8 {
        if u.is_empty() {
            break;
        }
        let len = file.len();
        let pos = |u: &mut Unstructured<'_>, n: usize| -> Result<usize> {
            if n == 0 {
                Ok(0)
            } else {
                u.int_in_range(0..=n - 1)
            }
        };
        match u.int_in_range(0..=12)? {
            0 => {
                let i = pos(u, len)?;
                if let Some(b) = file.get_mut(i) {
                    *b ^= u.int_in_range(1u8..=255)?;
                }
            }
            1 => {
                let i = pos(u, len)?;
                let bit = u.int_in_range(0..=7)?;
                if let Some(b) = file.get_mut(i) {
                    *b ^= 1 << bit;
                }
            }
            2 => file.truncate(pos(u, len + 1)?),
            3 => {
                let (s, d) = (pos(u, len)?, pos(u, len)?);
                let n = usize::from(u.int_in_range(1u8..=200)?)
                    .min(len - s)
                    .min(len - d);
                file.copy_within(s..s + n, d);
            }
            4 => {
                let (s, d) = (pos(u, len)?, pos(u, len + 1)?);
                let n = usize::from(u.int_in_range(1u8..=200)?).min(len - s);
                let piece = file[s..s + n].to_vec();
                file.splice(d..d, piece);
            }
            5 => {
                let d = pos(u, len + 1)?;
                let bytes: Vec<u8> = (0..u.int_in_range(1..=64)?)
                    .map(|_| u.arbitrary())
                    .collect::<Result<_>>()?;
                file.splice(d..d, bytes);
            }
            6 => {
                let s = pos(u, len)?;
                let n = usize::from(u.int_in_range(1u8..=200)?).min(len - s);
                file.drain(s..s + n);
            }
            7 => set_field(u, file, m, m.eocd, EOCD_FIELDS)?,
            8 => {
                if let Some(z) = m.zip64 {
                    set_field(u, file, m, z, ZIP64_FIELDS)?;
                }
            }
            9 => {
                if let Some(l) = m.locator {
                    set_field(u, file, m, l, LOCATOR_FIELDS)?;
                }
            }
            10 => {
                let base = u.choose(&m.cds)?.0;
                set_field(u, file, m, base, CD_FIELDS)?;
            }
            11 => {
                if let Some(x) = u.choose(&m.cds)?.1 {
                    set_field(u, file, m, x, CD_ZIP64_FIELDS)?;
                }
            }
            _ => {
                let (base, nl) = *u.choose(&m.locals)?;
                let (off, n) = *u.choose(LOCAL_FIELDS)?;
                let at = if off >= 30 {
                    base + nl + off
                } else {
                    base + off
                };
                let cur = if at + n <= file.len() {
                    le(file, at, n)
                } else {
                    0
                };
                let v = value(u, file, m, cur)?;
                put(file, at, n, v);
            }
        }
    }
    Ok(())
}
