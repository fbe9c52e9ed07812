//! The harness of the cargo-fuzz targets: the properties every parse must
//! keep, and valid archives (built with `tierstore_core::plan::Plan`) mutated
//! as the fuzzer's bytes say. `rust/core/tests/fuzz_parsers.rs` runs the same
//! properties and mutations as proptest targets in `cargo test`.

use std::path::Path;

use libfuzzer_sys::arbitrary::{Result, Unstructured};
use tierstore_core::plan::{Plan, Source};
use tierstore_core::zip::{self, Directory};

// The zip helpers the property tests in `cargo test` use too.
#[path = "../../rust/core/tests/common/mod.rs"]
mod common;
pub use common::Map;
use common::{
    check_accepted, check_entry_fits, field, format_error, local_field, map, put, reshape, Form,
    CD_FIELDS, CD_ZIP64_FIELDS, EOCD_FIELDS, LOCAL_FIELDS, LOCATOR_FIELDS, P, ZIP64_FIELDS,
};

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
        check_entry_fits(&dir, e);
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
    let comment: Vec<u8> = (0..comment_len)
        .map(|_| u.arbitrary())
        .collect::<Result<_>>()?;

    let form = Form {
        zip64_end,
        zip64_sizes: sizes,
        zip64_offsets: offsets,
        other_extra,
        comment,
    };
    Ok(reshape(&file, &m, &form))
}

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
    let v = value(u, file, m, field(file, at, n))?;
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
                let at = local_field(base, nl, off);
                let v = value(u, file, m, field(file, at, n))?;
                put(file, at, n, v);
            }
        }
    }
    Ok(())
}
