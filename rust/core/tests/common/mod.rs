//! What the zip property tests (`tests/fuzz_parsers.rs`) and the cargo-fuzz
//! harness (`fuzz/src/lib.rs`, which includes this file by path) share:
//! which errors a parse may return, where the fields of a valid archive
//! are, and the check that an accepted data offset keeps to its record.
// Each includer uses its own part of it.
#![allow(dead_code)]

use tierstore_core::zip::{CdEntry, Directory};
use tierstore_core::Error;

/// The name parse errors give the file.
pub const P: &str = "fuzz.zip";

/// Whether `e` is one of the errors a parse of damaged bytes may return.
pub fn format_error(e: &Error) -> bool {
    matches!(
        e,
        Error::NotAContainer { .. } | Error::Truncated { .. } | Error::Corrupt { .. }
    )
}

/// The little-endian value of the `n` bytes at `at`.
pub fn le(b: &[u8], at: usize, n: usize) -> u64 {
    (0..n).fold(0, |v, i| v | (u64::from(b[at + i]) << (8 * i)))
}

/// Writes the low `n` bytes of `v` at `at`, as far as the buffer reaches.
pub fn put(b: &mut [u8], at: usize, n: usize, v: u64) {
    for i in 0..n {
        if let Some(x) = at.checked_add(i).and_then(|j| b.get_mut(j)) {
            *x = (v >> (8 * i)) as u8;
        }
    }
}

/// The value of the `n`-byte field at `at`, or 0 where it reaches past the end.
pub fn field(b: &[u8], at: usize, n: usize) -> u64 {
    if at + n <= b.len() {
        le(b, at, n)
    } else {
        0
    }
}

/// Where the fields of a valid archive are.
#[derive(Clone, Debug, Default)]
pub struct Map {
    /// Local headers: (offset, name length).
    pub locals: Vec<(usize, usize)>,
    /// Central-directory entries: (offset, offset of the zip64 extra field).
    pub cds: Vec<(usize, Option<usize>)>,
    pub cd_offset: usize,
    pub zip64: Option<usize>,
    pub locator: Option<usize>,
    pub eocd: usize,
}

/// Maps a valid archive whose end record is at `eocd`.
pub fn map(file: &[u8], eocd: usize) -> Map {
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
        let nl = le(file, p + 28, 2) as usize;
        let xl = le(file, p + 30, 2) as usize;
        let cl = le(file, p + 32, 2) as usize;
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
            let z = z64.expect("zip64 extra");
            let sizes = if le(file, p + 24, 4) == 0xffff_ffff {
                16
            } else {
                0
            };
            h = le(file, z + 4 + sizes, 8);
        }
        m.locals
            .push((h as usize, le(file, h as usize + 26, 2) as usize));
        m.cds.push((p, z64));
        p += 46 + nl + xl + cl;
    }
    m
}

/// Checks that a directory entry's header and size fit in the record area.
pub fn check_entry_fits(dir: &Directory, e: &CdEntry) {
    assert!(e.compressed_size <= dir.cd_offset, "{e:?}");
    assert!(
        e.header_offset
            .checked_add(30)
            .is_some_and(|x| x <= dir.cd_offset),
        "{e:?}"
    );
}

/// Checks that a range `check_data_range` or `data_offset_from_local`
/// accepted for `e` keeps to the record area, after the entry's own header
/// and before any other record's header (`headers`: all of them, sorted).
pub fn check_accepted(dir: &Directory, headers: &[u64], e: &CdEntry, data_offset: u64) {
    let min = u128::from(e.header_offset) + 30 + e.name.len() as u128;
    let end = u128::from(data_offset) + u128::from(e.compressed_size);
    assert!(
        u128::from(data_offset) >= min,
        "data at {data_offset} starts inside its own header ({e:?})"
    );
    assert!(
        end <= u128::from(dir.cd_offset),
        "data [{data_offset}, {end}) runs into the directory at {} ({e:?})",
        dir.cd_offset
    );
    let next = headers.partition_point(|&h| h <= e.header_offset);
    if let Some(&h) = headers.get(next) {
        assert!(
            end <= u128::from(h),
            "data of '{}' [{data_offset}, {end}) runs over the local header at {h}",
            e.name
        );
    }
}

// The fields of each structure worth overwriting: (offset, length).
pub const EOCD_FIELDS: &[(usize, usize)] = &[
    (0, 4),
    (4, 2),
    (6, 2),
    (8, 2),
    (10, 2),
    (12, 4),
    (16, 4),
    (20, 2),
];
pub const ZIP64_FIELDS: &[(usize, usize)] = &[
    (0, 4),
    (4, 8),
    (16, 4),
    (20, 4),
    (24, 8),
    (32, 8),
    (40, 8),
    (48, 8),
];
pub const LOCATOR_FIELDS: &[(usize, usize)] = &[(0, 4), (4, 4), (8, 8), (16, 4)];
pub const CD_FIELDS: &[(usize, usize)] = &[
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
/// Fields of a zip64 extra field: id, length, then up to three u64 values.
pub const CD_ZIP64_FIELDS: &[(usize, usize)] = &[(0, 2), (2, 2), (4, 8), (12, 8), (20, 8)];
/// Fields of a local header; offsets past 30 are relative to the name's end
/// (the padding extra field's id and length): see [`local_field`].
pub const LOCAL_FIELDS: &[(usize, usize)] = &[
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

/// Where field offset `off` of [`LOCAL_FIELDS`] lies in a local header at
/// `base` whose name is `name_len` bytes long.
pub fn local_field(base: usize, name_len: usize, off: usize) -> usize {
    if off >= 30 {
        base + name_len + off
    } else {
        base + off
    }
}

/// How the end of an archive is re-encoded.
#[derive(Clone, Debug, Default)]
pub struct Form {
    /// Zip64 end record and locator, with these end-record fields (bits:
    /// count, size, offset) set to "see zip64" (0 = plain end record).
    pub zip64_end: u8,
    /// Sizes in a zip64 extra field.
    pub zip64_sizes: bool,
    /// Header offsets in a zip64 extra field.
    pub zip64_offsets: bool,
    /// An unrelated extra field before the zip64 one.
    pub other_extra: bool,
    pub comment: Vec<u8>,
}

/// Re-encodes the directory and end records of `f`, a valid archive mapped
/// by `m`, in `form`; returns the new file and its map.
pub fn reshape(f: &[u8], m: &Map, form: &Form) -> (Vec<u8>, Map) {
    let cd_offset = m.cd_offset;
    let mut out = f[..cd_offset].to_vec();
    for &(p, _) in &m.cds {
        let nl = le(f, p + 28, 2) as usize;
        let mut fixed = f[p..p + 46].to_vec();
        let name = &f[p + 46..p + 46 + nl];
        let mut extra = Vec::new();
        if form.other_extra {
            extra.extend_from_slice(&[0x55, 0x54, 5, 0, 1, 2, 3, 4, 5]);
        }
        if form.zip64_sizes || form.zip64_offsets {
            let mut body = Vec::new();
            if form.zip64_sizes {
                body.extend_from_slice(&le(f, p + 24, 4).to_le_bytes());
                body.extend_from_slice(&le(f, p + 20, 4).to_le_bytes());
                put(&mut fixed, 20, 4, 0xffff_ffff);
                put(&mut fixed, 24, 4, 0xffff_ffff);
            }
            if form.zip64_offsets {
                body.extend_from_slice(&le(f, p + 42, 4).to_le_bytes());
                put(&mut fixed, 42, 4, 0xffff_ffff);
            }
            extra.extend_from_slice(&1u16.to_le_bytes());
            extra.extend_from_slice(&(body.len() as u16).to_le_bytes());
            extra.extend_from_slice(&body);
        }
        put(&mut fixed, 30, 2, extra.len() as u64);
        out.extend_from_slice(&fixed);
        out.extend_from_slice(name);
        out.extend_from_slice(&extra);
    }
    let n = m.cds.len() as u64;
    let cd_size = (out.len() - cd_offset) as u64;
    let (mut n16, mut size32, mut off32) = (n, cd_size, cd_offset as u64);
    if form.zip64_end != 0 {
        let z = out.len() as u64;
        out.extend_from_slice(&0x0606_4b50u32.to_le_bytes());
        out.extend_from_slice(&44u64.to_le_bytes());
        out.extend_from_slice(&[0x2d, 3, 45, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        for v in [n, n, cd_size, cd_offset as u64] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&0x0706_4b50u32.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&z.to_le_bytes());
        out.extend_from_slice(&1u32.to_le_bytes());
        if form.zip64_end & 1 != 0 {
            n16 = 0xffff;
        }
        if form.zip64_end & 2 != 0 {
            size32 = 0xffff_ffff;
        }
        if form.zip64_end & 4 != 0 {
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
    let mut comment = form.comment.clone();
    unambiguous(&mut comment);
    out.extend_from_slice(&(comment.len() as u16).to_le_bytes());
    out.extend_from_slice(&comment);
    let map = map(&out, eocd);
    (out, map)
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
