//! Fuzz targets for the parsers, run as proptest properties by `cargo test`.
//!
//! - `zip::read_directory` on random bytes, and on valid archives built with
//!   `plan::Plan` (plain, with comments, with zip64 end records and zip64
//!   extras, and one with 65535 records where the writer itself needs zip64)
//!   after mutations: byte and bit flips, truncations, insertions, deletions,
//!   splices, and overwrites of the end records, central-directory entries and
//!   local headers with values chosen to hurt (0, all ones, the file length,
//!   the directory offset, another record's header, ...). Each entry then goes
//!   through `zip::data_offset_from_local` and `zip::check_data_range`.
//!   Properties: no panic, bounded time and memory (a counting allocator), only
//!   format errors, and an `Ok` directory keeps every record's header and data
//!   inside the record area, before the directory, without overlaps.
//! - `chunks::compute` against a plain per-chunk reference, and
//!   `chunks::read_ranges_verified` on real files (every engine backend this
//!   machine has) with random ranges (rows, columns, shared chunks, empty
//!   ranges, partial last chunks), both coverages, chunk tables of many sizes
//!   and whole-record tables with the zip CRC, and one damaged byte anywhere.
//!   Properties: without damage in a checked chunk, the memory holds the
//!   file's bytes and `checked` is exactly the bytes of the checked chunks;
//!   with it, a checksum error; bad ranges and tables are errors; nothing is
//!   written outside the ranges' memory (guard bytes).
//!
//! The case counts keep the file well under a minute of
//! `cargo test -p tierstore-core --release` (unoptimized builds run a quarter
//! of them). Runs are deterministic (a fixed seed); for longer or different
//! runs set `PROPTEST_CASES` and `PROPTEST_RNG_SEED`. The cargo-fuzz targets
//! in `fuzz/` run the zip properties for long campaigns; `zip_corpus_files`
//! replays their artifacts (`TIERSTORE_ZIP_CORPUS`).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{RngSeed, TestRunner};
use tierstore_core::chunks::{self, Algo, ChunkTable, Coverage, TableRange, Verified};
use tierstore_core::engine::{Config, Engine, Mode};
use tierstore_core::file::EngineFile;
use tierstore_core::io::Class;
use tierstore_core::plan::{Plan, Source};
use tierstore_core::ranges::IoRange;
use tierstore_core::zip::{self, Directory};
use tierstore_core::Error;

mod common;
use common::{
    check_accepted, check_entry_fits, field, format_error, le, local_field, map, put, Form, Map,
    CD_FIELDS, CD_ZIP64_FIELDS, EOCD_FIELDS, LOCAL_FIELDS, LOCATOR_FIELDS, P, ZIP64_FIELDS,
};

// ---------------------------------------------------------------------------
// Harness: configuration, an allocation meter, a clock.
// ---------------------------------------------------------------------------

/// `cases` cases (unless `PROPTEST_CASES` says otherwise), from a fixed seed
/// (unless `PROPTEST_RNG_SEED` says otherwise).
fn config(cases: u32) -> ProptestConfig {
    let mut c = ProptestConfig::default();
    if std::env::var_os("PROPTEST_CASES").is_none() {
        // Unoptimized builds (plain `cargo test`) run a quarter of the cases:
        // they add overflow checks, at several times the cost per case.
        c.cases = if cfg!(debug_assertions) {
            cases.div_ceil(4)
        } else {
            cases
        };
    }
    if c.rng_seed == RngSeed::Random {
        c.rng_seed = RngSeed::Fixed(0x7469_6572_7374_6f72);
    }
    // Runs repeat from the seed; no regression files in the source tree.
    c.failure_persistence = None;
    c
}

fn run<S: Strategy>(cases: u32, strategy: S, test: impl Fn(S::Value)) {
    let mut runner = TestRunner::new(config(cases));
    let r = runner.run(&strategy, |v| {
        test(v);
        Ok(())
    });
    if let Err(e) = r {
        panic!("{e}");
    }
}

/// Counts the bytes each thread has allocated and the most it held at once.
struct Meter;

thread_local! {
    static LIVE: Cell<i64> = const { Cell::new(0) };
    static PEAK: Cell<i64> = const { Cell::new(0) };
}

fn note(delta: i64) {
    let _ = LIVE.try_with(|live| {
        let v = live.get() + delta;
        live.set(v);
        let _ = PEAK.try_with(|p| {
            if v > p.get() {
                p.set(v);
            }
        });
    });
}

// SAFETY: every call is forwarded to the system allocator unchanged; the
// meter only counts (in thread-locals that never allocate).
unsafe impl GlobalAlloc for Meter {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, forwarded.
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            note(l.size() as i64);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, forwarded.
        let p = unsafe { System.alloc_zeroed(l) };
        if !p.is_null() {
            note(l.size() as i64);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.dealloc(p, l) };
        note(-(l.size() as i64));
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        // SAFETY: the caller's contract, forwarded.
        let q = unsafe { System.realloc(p, l, new) };
        if !q.is_null() {
            note(new as i64 - l.size() as i64);
        }
        q
    }
}

#[global_allocator]
static METER: Meter = Meter;

/// Runs `f` on this thread; returns its result, the most bytes it held
/// allocated at once, and how long it took.
fn metered<T>(f: impl FnOnce() -> T) -> (T, u64, Duration) {
    let base = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(base));
    let t = Instant::now();
    let r = f();
    let took = t.elapsed();
    let peak = (PEAK.with(Cell::get) - base).max(0);
    (r, peak as u64, took)
}

/// No parse of these small inputs takes this long, even unoptimized.
const TIME_LIMIT: Duration = Duration::from_secs(5);

/// The most a parse of `len` bytes may allocate: a few times the input
/// (tail, directory, entries and names), never what a size field claims.
fn alloc_budget(len: usize) -> u64 {
    16 * len as u64 + (1 << 20)
}

// ---------------------------------------------------------------------------
// Archives: building valid ones, and a map of where their fields are.
// ---------------------------------------------------------------------------

#[derive(Clone, Debug)]
struct Rec {
    name: String,
    len: usize,
    seed: u8,
    align: u64,
}

fn rec_bytes(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| ((i * 131 + usize::from(seed) * 7 + (i >> 9)) % 251) as u8)
        .collect()
}

struct Archive {
    file: Vec<u8>,
    map: Map,
    recs: Vec<Rec>,
}

fn build(recs: &[Rec]) -> Archive {
    let mut plan = Plan::new(4096).unwrap();
    for r in recs {
        plan.add_aligned(
            &r.name,
            Source::Bytes(rec_bytes(r.len, r.seed).into()),
            r.align,
        )
        .unwrap();
    }
    plan.compute_missing_crcs(1);
    plan.finalize().unwrap();
    let mut file = vec![0u8; plan.file_end() as usize];
    plan.gather(0, &mut file, 1, false).unwrap();
    let eocd = file.len() - 22;
    let map = map(&file, eocd);
    Archive {
        file,
        map,
        recs: recs.to_vec(),
    }
}

/// Re-encodes the directory and end records of `a` in `form`.
fn reshape(a: &Archive, form: &Form) -> Archive {
    let (file, map) = common::reshape(&a.file, &a.map, form);
    Archive {
        file,
        map,
        recs: a.recs.clone(),
    }
}

fn arb_rec(i: usize) -> impl Strategy<Value = Rec> {
    (
        "[a-z0-9/._-]{0,24}",
        prop_oneof![
            3 => 0usize..600,
            2 => 0usize..5000,
            1 => Just(4096usize),
            1 => 4090usize..4100,
        ],
        any::<u8>(),
        prop_oneof![Just(1u64), Just(8), Just(64), Just(4096)],
    )
        .prop_map(move |(suffix, len, seed, align)| Rec {
            name: format!("a/data/{i}{suffix}"),
            len,
            seed,
            align,
        })
}

fn arb_recs() -> impl Strategy<Value = Vec<Rec>> {
    (1usize..7).prop_flat_map(|n| (0..n).map(arb_rec).collect::<Vec<_>>())
}

fn arb_comment() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        3 => Just(Vec::new()),
        1 => prop::collection::vec(any::<u8>(), 0..40),
        // A comment that holds end-record signatures of its own.
        1 => (prop::collection::vec(any::<u8>(), 0..30), 0usize..30).prop_map(|(mut v, at)| {
            let at = at.min(v.len());
            v.splice(at..at, b"PK\x05\x06".iter().copied());
            v
        }),
    ]
}

fn arb_form() -> impl Strategy<Value = Form> {
    (
        prop_oneof![2 => Just(0u8), 1 => 1u8..8],
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        arb_comment(),
    )
        .prop_map(
            |(zip64_end, zip64_sizes, zip64_offsets, other_extra, comment)| Form {
                zip64_end,
                zip64_sizes: zip64_sizes && zip64_end != 0,
                zip64_offsets: zip64_offsets && zip64_end != 0,
                other_extra,
                comment,
            },
        )
}

fn arb_archive() -> impl Strategy<Value = Archive> {
    (arb_recs(), arb_form()).prop_map(|(recs, form)| reshape(&build(&recs), &form))
}

impl std::fmt::Debug for Archive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Archive {{ {} bytes, {:?}, {:?} }}",
            self.file.len(),
            self.recs,
            self.map
        )
    }
}

// ---------------------------------------------------------------------------
// Mutations.
// ---------------------------------------------------------------------------

/// A value to write into a field, chosen relative to the archive.
#[derive(Clone, Debug)]
enum Val {
    Zero,
    One,
    AllOnes,
    Pow2(u32),
    /// The field's present value plus this.
    Add(i32),
    FileLen(i32),
    CdOffset(i32),
    /// Another record's local header offset plus this.
    Header(Index, i32),
    Raw(u64),
}

fn arb_val() -> impl Strategy<Value = Val> {
    prop_oneof![
        Just(Val::Zero),
        Just(Val::One),
        Just(Val::AllOnes),
        (0u32..64).prop_map(Val::Pow2),
        (-64i32..64).prop_map(Val::Add),
        (-64i32..64).prop_map(Val::FileLen),
        (-64i32..64).prop_map(Val::CdOffset),
        (any::<Index>(), -40i32..40).prop_map(|(i, d)| Val::Header(i, d)),
        any::<u64>().prop_map(Val::Raw),
    ]
}

fn offset_by(base: u64, d: i32) -> u64 {
    base.wrapping_add_signed(i64::from(d))
}

impl Val {
    fn resolve(&self, file: &[u8], map: &Map, cur: u64) -> u64 {
        match *self {
            Val::Zero => 0,
            Val::One => 1,
            Val::AllOnes => u64::MAX,
            Val::Pow2(k) => 1 << k,
            Val::Add(d) => offset_by(cur, d),
            Val::FileLen(d) => offset_by(file.len() as u64, d),
            Val::CdOffset(d) => offset_by(map.cd_offset as u64, d),
            Val::Header(ref i, d) => {
                let h = if map.locals.is_empty() {
                    0
                } else {
                    map.locals[i.index(map.locals.len())].0
                };
                offset_by(h as u64, d)
            }
            Val::Raw(v) => v,
        }
    }
}

#[derive(Clone, Debug)]
enum Mut {
    Xor(Index, u8),
    Bit(Index, u8),
    Truncate(Index),
    /// Copy `len` bytes from one place over another.
    Overwrite(Index, Index, usize),
    /// Insert a copy of `len` bytes from one place at another.
    Splice(Index, Index, usize),
    Insert(Index, Vec<u8>),
    Delete(Index, usize),
    Eocd(Index, Val),
    Zip64(Index, Val),
    Locator(Index, Val),
    Cd(Index, Index, Val),
    CdZip64(Index, Index, Val),
    Local(Index, Index, Val),
}

fn arb_mut() -> impl Strategy<Value = Mut> {
    prop_oneof![
        2 => (any::<Index>(), 1u8..=255).prop_map(|(i, x)| Mut::Xor(i, x)),
        2 => (any::<Index>(), 0u8..8).prop_map(|(i, b)| Mut::Bit(i, b)),
        1 => any::<Index>().prop_map(Mut::Truncate),
        1 => (any::<Index>(), any::<Index>(), 1usize..200).prop_map(|(a, b, n)| Mut::Overwrite(a, b, n)),
        1 => (any::<Index>(), any::<Index>(), 1usize..200).prop_map(|(a, b, n)| Mut::Splice(a, b, n)),
        1 => (any::<Index>(), prop::collection::vec(any::<u8>(), 1..64)).prop_map(|(i, v)| Mut::Insert(i, v)),
        1 => (any::<Index>(), 1usize..200).prop_map(|(i, n)| Mut::Delete(i, n)),
        4 => (any::<Index>(), arb_val()).prop_map(|(f, v)| Mut::Eocd(f, v)),
        3 => (any::<Index>(), arb_val()).prop_map(|(f, v)| Mut::Zip64(f, v)),
        2 => (any::<Index>(), arb_val()).prop_map(|(f, v)| Mut::Locator(f, v)),
        6 => (any::<Index>(), any::<Index>(), arb_val()).prop_map(|(e, f, v)| Mut::Cd(e, f, v)),
        3 => (any::<Index>(), any::<Index>(), arb_val()).prop_map(|(e, f, v)| Mut::CdZip64(e, f, v)),
        4 => (any::<Index>(), any::<Index>(), arb_val()).prop_map(|(e, f, v)| Mut::Local(e, f, v)),
    ]
}

/// Overwrites field `fields[f]` of the structure at `base` with `v`.
fn set_field(
    file: &mut [u8],
    map: &Map,
    base: usize,
    fields: &[(usize, usize)],
    f: Index,
    v: &Val,
) {
    let (off, n) = fields[f.index(fields.len())];
    let at = base + off;
    let x = v.resolve(file, map, field(file, at, n));
    put(file, at, n, x);
}

fn pos(i: Index, len: usize) -> usize {
    if len == 0 {
        0
    } else {
        i.index(len)
    }
}

fn apply(file: &mut Vec<u8>, map: &Map, m: &Mut) {
    let len = file.len();
    match m {
        Mut::Xor(i, x) => {
            if len > 0 {
                file[i.index(len)] ^= x;
            }
        }
        Mut::Bit(i, b) => {
            if len > 0 {
                file[i.index(len)] ^= 1 << b;
            }
        }
        Mut::Truncate(i) => file.truncate(pos(*i, len)),
        Mut::Overwrite(a, b, n) => {
            let (s, d) = (pos(*a, len), pos(*b, len));
            let n = (*n).min(len - s).min(len - d);
            file.copy_within(s..s + n, d);
        }
        Mut::Splice(a, b, n) => {
            let (s, d) = (pos(*a, len), pos(*b, len + 1));
            let n = (*n).min(len - s);
            let piece = file[s..s + n].to_vec();
            file.splice(d..d, piece);
        }
        Mut::Insert(i, v) => {
            let d = pos(*i, len + 1);
            file.splice(d..d, v.iter().copied());
        }
        Mut::Delete(i, n) => {
            let s = pos(*i, len);
            let n = (*n).min(len - s);
            file.drain(s..s + n);
        }
        Mut::Eocd(f, v) => set_field(file, map, map.eocd, EOCD_FIELDS, *f, v),
        Mut::Zip64(f, v) => {
            if let Some(z) = map.zip64 {
                set_field(file, map, z, ZIP64_FIELDS, *f, v);
            }
        }
        Mut::Locator(f, v) => {
            if let Some(l) = map.locator {
                set_field(file, map, l, LOCATOR_FIELDS, *f, v);
            }
        }
        Mut::Cd(e, f, v) => {
            if !map.cds.is_empty() {
                let base = map.cds[e.index(map.cds.len())].0;
                set_field(file, map, base, CD_FIELDS, *f, v);
            }
        }
        Mut::CdZip64(e, f, v) => {
            if !map.cds.is_empty() {
                if let Some(x) = map.cds[e.index(map.cds.len())].1 {
                    set_field(file, map, x, CD_ZIP64_FIELDS, *f, v);
                }
            }
        }
        Mut::Local(e, f, v) => {
            if !map.locals.is_empty() {
                let (base, nl) = map.locals[e.index(map.locals.len())];
                let (off, n) = LOCAL_FIELDS[f.index(LOCAL_FIELDS.len())];
                let at = local_field(base, nl, off);
                let x = v.resolve(file, map, field(file, at, n));
                put(file, at, n, x);
            }
        }
    }
}

// ---------------------------------------------------------------------------
// The zip properties.
// ---------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, Default)]
struct Tally {
    cases: u64,
    parsed: u64,
    entries: u64,
    resolved: u64,
}

/// The local header offsets of a directory, sorted.
fn headers(dir: &Directory) -> Vec<u64> {
    let mut h: Vec<u64> = dir.entries.iter().map(|e| e.header_offset).collect();
    h.sort_unstable();
    h
}

/// Parses `file`; on success checks every promise of the directory and
/// resolves every entry's data offset. Returns the directory and the data
/// offsets (where the local header gave one).
fn check_file(file: &[u8], tally: &Cell<Tally>) -> Option<(Directory, Vec<Option<u64>>)> {
    let p = Path::new(P);
    let mut t = tally.get();
    t.cases += 1;
    let (res, peak, took) = metered(|| zip::read_directory(file, p));
    assert!(took < TIME_LIMIT, "read_directory took {took:?}");
    assert!(
        peak <= alloc_budget(file.len()),
        "read_directory of {} bytes held {peak} bytes at once",
        file.len()
    );
    let dir = match res {
        Ok(d) => d,
        Err(e) => {
            assert!(format_error(&e), "unexpected kind of error: {e:?}");
            tally.set(t);
            return None;
        }
    };
    t.parsed += 1;
    // The archive is the whole file, or (bytes after it) the prefix a
    // forward walk over its headers found.
    let len = dir.file_len;
    assert!(len <= file.len() as u64);
    if len < file.len() as u64 {
        assert_eq!(zip::archive_extent(file), Some(len));
    }
    assert!(
        dir.cd_offset <= len,
        "directory at {} past the end",
        dir.cd_offset
    );
    let hs = headers(&dir);
    let mut offs = Vec::with_capacity(dir.entries.len());
    let mut spans = Vec::new();
    for e in &dir.entries {
        t.entries += 1;
        check_entry_fits(&dir, e);
        // What the readers do: a probe of the header, clipped to the record area.
        let probe_end =
            (e.header_offset + zip::local_header_probe_len(e.name.len())).min(dir.cd_offset);
        let probe = &file[e.header_offset as usize..probe_end as usize];
        let (r, peak, took) = metered(|| zip::data_offset_from_local(probe, e, &dir, p));
        assert!(took < TIME_LIMIT && peak < 1 << 20, "{took:?} {peak}");
        match r {
            Ok(d) => {
                t.resolved += 1;
                check_accepted(&dir, &hs, e, d);
                let end = d + e.compressed_size;
                // The data is there to read (in bounds of the file).
                let _ = Algo::Crc32c.sum(&file[d as usize..end as usize]);
                spans.push((e.header_offset, end, e.name.clone()));
                offs.push(Some(d));
            }
            Err(err) => {
                assert!(format_error(&err), "unexpected kind of error: {err:?}");
                offs.push(None);
            }
        }
    }
    spans.sort();
    for w in spans.windows(2) {
        assert!(
            w[0].1 <= w[1].0,
            "records overlap: '{}' [{}, {}) and '{}' from {}",
            w[0].2,
            w[0].0,
            w[0].1,
            w[1].2,
            w[1].0
        );
    }
    tally.set(t);
    Some((dir, offs))
}

/// A valid archive parses, and every record reads back as written.
fn check_valid(a: &Archive) {
    let tally = Cell::new(Tally::default());
    let (dir, offs) = check_file(&a.file, &tally).expect("a valid archive parses");
    assert_eq!(dir.entries.len(), a.recs.len());
    for ((e, off), r) in dir.entries.iter().zip(&offs).zip(&a.recs) {
        let data = rec_bytes(r.len, r.seed);
        assert_eq!(e.name, r.name);
        assert_eq!(e.size, r.len as u64);
        assert_eq!(e.compressed_size, r.len as u64);
        assert_eq!(e.method, 0);
        assert_eq!(e.crc, crc32fast::hash(&data));
        let off = off.expect("valid local header") as usize;
        assert_eq!(&a.file[off..off + r.len], &data[..], "record {}", r.name);
        assert_eq!(off as u64 % r.align, 0);
    }
}

#[test]
fn fuzz_zip_valid_archives_parse() {
    run(1000, arb_archive(), |a| check_valid(&a));
}

#[test]
fn fuzz_zip_random_bytes() {
    let tally = Cell::new(Tally::default());
    let s = prop_oneof![
        // Anything at all.
        prop::collection::vec(any::<u8>(), 0..600),
        // Random bytes that end in an end record with random fields (so that
        // the search succeeds and the fields are read).
        (
            prop::collection::vec(any::<u8>(), 0..600),
            prop::collection::vec(any::<u8>(), 18),
            prop::collection::vec(any::<u8>(), 0..8),
        )
            .prop_map(|(mut v, fields, comment)| {
                v.extend_from_slice(b"PK\x05\x06");
                v.extend_from_slice(&fields[..16]);
                v.extend_from_slice(&(comment.len() as u16).to_le_bytes());
                v.extend_from_slice(&comment);
                v
            }),
        // Random bytes after a local header signature.
        prop::collection::vec(any::<u8>(), 0..100).prop_map(|mut v| {
            v.splice(0..0, b"PK\x03\x04".iter().copied());
            v
        }),
        // Random records, then directory entries with random fields (small
        // lengths, so that several follow each other), and an end record
        // that points at them: the entry parser and its checks are reached.
        (
            prop::collection::vec(any::<u8>(), 0..400),
            prop::collection::vec(
                (
                    prop::collection::vec(any::<u8>(), 46),
                    0u16..20,
                    0u16..40,
                    0u16..4,
                    any::<u16>(),
                ),
                0..5,
            ),
            any::<bool>(),
        )
            .prop_map(|(records, cds, extra_slack)| {
                let mut v = records;
                let cd_offset = v.len();
                for (mut fixed, nl, xl, cl, seed) in cds.iter().cloned() {
                    fixed[..4].copy_from_slice(b"PK\x01\x02");
                    put(&mut fixed, 28, 2, u64::from(nl));
                    put(&mut fixed, 30, 2, u64::from(xl));
                    put(&mut fixed, 32, 2, u64::from(cl));
                    // Header offsets mostly inside the records.
                    if seed % 2 == 0 {
                        put(
                            &mut fixed,
                            42,
                            4,
                            u64::from(seed >> 4) % (cd_offset as u64 + 1),
                        );
                    }
                    // Sizes mostly small enough to fit.
                    if seed % 3 != 0 {
                        put(&mut fixed, 20, 4, u64::from(seed % 16));
                    }
                    v.extend_from_slice(&fixed);
                    let body = usize::from(nl + xl + cl);
                    v.extend((0..body).map(|i| (i as u16 ^ seed) as u8));
                }
                if extra_slack {
                    v.extend_from_slice(&[0; 7]);
                }
                let cd_size = v.len() - cd_offset;
                let n = cds.len() as u64;
                v.extend_from_slice(b"PK\x05\x06\0\0\0\0");
                v.extend_from_slice(&(n as u16).to_le_bytes());
                v.extend_from_slice(&(n as u16).to_le_bytes());
                v.extend_from_slice(&(cd_size as u32).to_le_bytes());
                v.extend_from_slice(&(cd_offset as u32).to_le_bytes());
                v.extend_from_slice(&[0, 0]);
                v
            }),
    ];
    run(4000, s, |v| {
        check_file(&v, &tally);
    });
    eprintln!("random bytes: {:?}", tally.get());
}

#[test]
fn fuzz_zip_mutated_archives() {
    let tally = Cell::new(Tally::default());
    let s = (arb_archive(), prop::collection::vec(arb_mut(), 1..5));
    run(4000, s, |(a, muts)| {
        let mut file = a.file.clone();
        for m in &muts {
            apply(&mut file, &a.map, m);
        }
        check_file(&file, &tally);
    });
    let t = tally.get();
    eprintln!("mutated archives: {t:?}");
    // The mutations leave enough archives readable to test what comes after.
    assert!(t.parsed * 10 > t.cases, "{t:?}");
}

/// Mutations aimed at one structure at a time, so that each field's checks
/// are reached with the rest of the archive intact.
#[test]
fn fuzz_zip_single_field_mutations() {
    let tally = Cell::new(Tally::default());
    let field = prop_oneof![
        (any::<Index>(), arb_val()).prop_map(|(f, v)| Mut::Eocd(f, v)),
        (any::<Index>(), arb_val()).prop_map(|(f, v)| Mut::Zip64(f, v)),
        (any::<Index>(), arb_val()).prop_map(|(f, v)| Mut::Locator(f, v)),
        (any::<Index>(), any::<Index>(), arb_val()).prop_map(|(e, f, v)| Mut::Cd(e, f, v)),
        (any::<Index>(), any::<Index>(), arb_val()).prop_map(|(e, f, v)| Mut::CdZip64(e, f, v)),
        (any::<Index>(), any::<Index>(), arb_val()).prop_map(|(e, f, v)| Mut::Local(e, f, v)),
    ];
    run(3000, (arb_archive(), field), |(a, m)| {
        let mut file = a.file.clone();
        apply(&mut file, &a.map, &m);
        check_file(&file, &tally);
    });
    let t = tally.get();
    eprintln!("single-field mutations: {t:?}");
    assert!(t.parsed * 4 > t.cases, "{t:?}");
}

/// `data_offset_from_local` on damaged local headers (the probe a reader
/// passes), and `check_data_range` on any offset a manifest might state.
#[test]
fn fuzz_zip_local_headers_and_data_ranges() {
    #[derive(Clone, Debug)]
    enum Probe {
        Field(Index, Val),
        Xor(Index, u8),
        Cut(Index),
    }
    let probe = prop_oneof![
        3 => (any::<Index>(), arb_val()).prop_map(|(f, v)| Probe::Field(f, v)),
        1 => (any::<Index>(), 1u8..=255).prop_map(|(i, x)| Probe::Xor(i, x)),
        1 => any::<Index>().prop_map(Probe::Cut),
    ];
    let s = (
        arb_archive(),
        any::<Index>(),
        prop::collection::vec(probe, 1..4),
        prop::collection::vec(arb_val(), 1..6),
    );
    run(2000, s, |(a, which, probes, offsets)| {
        let p = Path::new(P);
        let dir = zip::read_directory(&a.file[..], p).expect("valid");
        let e = &dir.entries[which.index(dir.entries.len())];
        let h = e.header_offset as usize;
        let end = (e.header_offset + zip::local_header_probe_len(e.name.len())).min(dir.cd_offset);
        let mut buf = a.file[h..end as usize].to_vec();
        let nl = le(&buf, 26, 2) as usize;
        for m in &probes {
            match m {
                Probe::Field(f, v) => {
                    let (off, n) = LOCAL_FIELDS[f.index(LOCAL_FIELDS.len())];
                    let at = local_field(0, nl, off);
                    let x = v.resolve(&a.file, &a.map, field(&buf, at, n));
                    put(&mut buf, at, n, x);
                }
                Probe::Xor(i, x) => {
                    if !buf.is_empty() {
                        let i = i.index(buf.len());
                        buf[i] ^= x;
                    }
                }
                Probe::Cut(i) => buf.truncate(pos(*i, buf.len() + 1)),
            }
        }
        let hs = headers(&dir);
        match zip::data_offset_from_local(&buf, e, &dir, p) {
            Ok(d) => check_accepted(&dir, &hs, e, d),
            Err(err) => assert!(format_error(&err), "{err:?}"),
        }
        let good = zip::data_offset_from_local(&a.file[h..end as usize], e, &dir, p).unwrap();
        zip::check_data_range(e, good, &dir, p).unwrap();
        for v in &offsets {
            let off = v.resolve(&a.file, &a.map, good);
            match zip::check_data_range(e, off, &dir, p) {
                Ok(()) => check_accepted(&dir, &hs, e, off),
                Err(err) => assert!(format_error(&err), "{err:?}"),
            }
        }
    });
}

/// Entries that no parse produces (any header offset, size and name), given
/// to the public functions that take one: no panic, and an accepted range
/// keeps to the record area.
#[test]
fn fuzz_zip_forged_entries() {
    let s = (
        arb_archive(),
        any::<Index>(),
        arb_val(),
        arb_val(),
        0usize..300,
        prop::collection::vec(any::<u8>(), 0..64),
        arb_val(),
    );
    run(2000, s, |(a, which, hv, sv, name_len, local, dv)| {
        let p = Path::new(P);
        let dir = zip::read_directory(&a.file[..], p).expect("valid");
        let mut e = dir.entries[which.index(dir.entries.len())].clone();
        e.header_offset = hv.resolve(&a.file, &a.map, e.header_offset);
        e.compressed_size = sv.resolve(&a.file, &a.map, e.compressed_size);
        e.name = "n".repeat(name_len);
        let mut buf = b"PK\x03\x04".to_vec();
        buf.extend_from_slice(&local);
        buf.resize(buf.len().max(30), 0);
        let hs = headers(&dir);
        match zip::data_offset_from_local(&buf, &e, &dir, p) {
            Ok(d) => check_accepted(&dir, &hs, &e, d),
            Err(err) => assert!(format_error(&err), "{err:?}"),
        }
        let off = dv.resolve(&a.file, &a.map, e.header_offset);
        match zip::check_data_range(&e, off, &dir, p) {
            Ok(()) => check_accepted(&dir, &hs, &e, off),
            Err(err) => assert!(format_error(&err), "{err:?}"),
        }
    });
}

/// An archive of 65535 records: the writer itself switches to the zip64 end
/// records. It parses, and mutations of its end records are handled.
#[test]
fn fuzz_zip_many_records_zip64() {
    static BIG: OnceLock<Archive> = OnceLock::new();
    let a = BIG.get_or_init(|| {
        let recs: Vec<Rec> = (0..0xffff)
            .map(|i| Rec {
                name: format!("z/{i}"),
                len: i % 3,
                seed: i as u8,
                align: 1,
            })
            .collect();
        build(&recs)
    });
    assert!(a.map.zip64.is_some(), "the writer used zip64 end records");
    check_valid(a);
    let tally = Cell::new(Tally::default());
    let m = prop_oneof![
        (any::<Index>(), arb_val()).prop_map(|(f, v)| Mut::Eocd(f, v)),
        (any::<Index>(), arb_val()).prop_map(|(f, v)| Mut::Zip64(f, v)),
        (any::<Index>(), arb_val()).prop_map(|(f, v)| Mut::Locator(f, v)),
        (any::<Index>(), any::<Index>(), arb_val()).prop_map(|(e, f, v)| Mut::Cd(e, f, v)),
    ];
    run(64, m, |m| {
        let mut file = a.file.clone();
        apply(&mut file, &a.map, &m);
        check_file(&file, &tally);
    });
    eprintln!("zip64 (65535 records) mutations: {:?}", tally.get());
}

/// Files on disk through the same checks: the archives in the repository's
/// test data (written by torch and tierstore; they must parse), and every
/// file in `$TIERSTORE_ZIP_CORPUS` when set (a cargo-fuzz corpus or crash
/// directory, or archives from other writers), which need only keep the
/// properties.
#[test]
fn zip_corpus_files() {
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data");
    let mut files: Vec<(std::path::PathBuf, bool)> = Vec::new();
    let mut add = |dir: &Path, must_parse: bool| {
        if let Ok(rd) = std::fs::read_dir(dir) {
            for f in rd.flatten() {
                let p = f.path();
                let zipish = p
                    .extension()
                    .is_some_and(|x| x == "pt" || x == "zip" || x == "pth");
                if p.is_file() && (zipish || !must_parse) {
                    files.push((p, must_parse));
                }
            }
        }
    };
    add(&data, true);
    if let Some(dir) = std::env::var_os("TIERSTORE_ZIP_CORPUS") {
        add(Path::new(&dir), false);
    }
    files.sort();
    let tally = Cell::new(Tally::default());
    for (p, must_parse) in &files {
        let bytes = std::fs::read(p).unwrap();
        let before = tally.get();
        let parsed = check_file(&bytes, &tally);
        let after = tally.get();
        eprintln!(
            "{}: {}",
            p.display(),
            match &parsed {
                Some(_) => format!(
                    "{} entries, {} data offsets resolved",
                    after.entries - before.entries,
                    after.resolved - before.resolved
                ),
                None => zip::read_directory(&bytes[..], p).unwrap_err().to_string(),
            }
        );
        if *must_parse {
            let (dir, offs) = parsed.unwrap_or_else(|| panic!("{} does not parse", p.display()));
            assert!(offs.iter().all(Option::is_some), "{}: {dir:?}", p.display());
        }
    }
    eprintln!("corpus: {:?}", tally.get());
}

// ---------------------------------------------------------------------------
// Chunk checksums.
// ---------------------------------------------------------------------------

fn reference_sums(data: &[u8], chunk: usize, algo: Algo) -> Vec<u32> {
    data.chunks(chunk)
        .map(|c| match algo {
            Algo::Crc32 => crc32fast::hash(c),
            Algo::Crc32c => crc32c::crc32c(c),
        })
        .collect()
}

fn arb_algo() -> impl Strategy<Value = Algo> {
    prop_oneof![Just(Algo::Crc32), Just(Algo::Crc32c)]
}

#[test]
fn fuzz_chunks_compute_matches_reference() {
    let s = (
        prop::collection::vec(
            (
                prop_oneof![3 => 0usize..5000, 1 => 0usize..70_000],
                any::<u8>(),
            ),
            0..6,
        ),
        prop_oneof![1usize..=64, 4095usize..=4097, 1usize..=20_000, Just(65536)],
        arb_algo(),
        1usize..5,
    );
    run(1000, s, |(regions, chunk, algo, threads)| {
        let datas: Vec<Vec<u8>> = regions.iter().map(|&(n, s)| rec_bytes(n, s)).collect();
        let slices: Vec<&[u8]> = datas.iter().map(Vec::as_slice).collect();
        let got = chunks::compute(&slices, chunk, algo, threads);
        assert_eq!(got.len(), slices.len());
        for (d, sums) in slices.iter().zip(&got) {
            assert_eq!(
                sums.len() as u64,
                chunks::chunk_count(d.len() as u64, chunk as u64)
            );
            assert_eq!(sums, &reference_sums(d, chunk, algo));
        }
    });
}

/// Regions larger than one work item (4 MiB), split between threads.
#[test]
fn chunks_compute_large_regions() {
    let big = rec_bytes(9 << 20, 5);
    let regions: Vec<&[u8]> = vec![
        &big,
        big.split_at((4 << 20) - 1).0,
        &big[..4 << 20],
        big.split_at((4 << 20) + 1).0,
        &[],
        &big[..1],
    ];
    for chunk in [4096usize, 1000, 1 << 20, (4 << 20) + 1, 5 << 20, 16 << 20] {
        for threads in [1usize, 3] {
            let got = chunks::compute(&regions, chunk, Algo::Crc32c, threads);
            for (r, sums) in regions.iter().zip(&got) {
                assert_eq!(
                    sums,
                    &reference_sums(r, chunk, Algo::Crc32c),
                    "chunk {chunk}"
                );
            }
        }
    }
}

fn engines() -> &'static [Arc<Engine>] {
    static E: OnceLock<Vec<Arc<Engine>>> = OnceLock::new();
    E.get_or_init(|| {
        let mut modes = vec![Mode::Threads, Mode::Buffered];
        if tierstore_core::probe::io_uring_status().is_ok() {
            modes.push(Mode::IoUring);
        }
        modes
            .into_iter()
            .map(|mode| {
                let cfg = Config {
                    mode: Some(mode),
                    chunk_size: 64 << 10,
                    pool_bytes: 4 * (64 << 10),
                    queue_depth: 8,
                    cpu_threads: 3,
                    ..Config::default()
                };
                Engine::start(cfg, Some("fuzz")).unwrap()
            })
            .collect()
    })
}

/// How a record's checksum table is made.
#[derive(Clone, Copy, Debug)]
enum TableKind {
    Chunks(u64, Algo),
    /// One chunk as long as the record, with the zip CRC-32 (files without
    /// chunk checksums).
    Whole,
}

fn arb_table_kind() -> impl Strategy<Value = TableKind> {
    prop_oneof![
        3 => arb_algo().prop_map(|a| TableKind::Chunks(4096, a)),
        1 => arb_algo().prop_map(|a| TableKind::Chunks(512, a)),
        1 => (1u64..=9000, arb_algo()).prop_map(|(c, a)| TableKind::Chunks(c, a)),
        1 => (1u64..=4, arb_algo()).prop_map(|(c, a)| TableKind::Chunks(c, a)),
        1 => arb_algo().prop_map(|a| TableKind::Chunks(1 << 20, a)),
        1 => arb_algo().prop_map(|a| TableKind::Chunks(u64::MAX, a)),
        2 => Just(TableKind::Whole),
    ]
}

/// A range of a read, relative to its record.
#[derive(Clone, Debug)]
enum RangeSpec {
    /// Any part of the record.
    Span(Index, Index, Index),
    /// Many short ranges a stride apart (a column shard): start, width,
    /// stride, count.
    Column(Index, usize, usize, usize),
    /// The last `n` bytes (the partial last chunk).
    Tail(usize),
    /// Whole chunks `[first, first + n)` (read straight into place).
    Chunks(Index, u64),
    Empty(Index),
    Whole,
}

fn arb_range() -> impl Strategy<Value = (Index, RangeSpec)> {
    let spec = prop_oneof![
        4 => (any::<Index>(), any::<Index>(), any::<Index>()).prop_map(|(a, b, c)| RangeSpec::Span(a, b, c)),
        2 => (any::<Index>(), 1usize..64, 1usize..5000, 1usize..40).prop_map(|(a, w, s, n)| RangeSpec::Column(a, w, s, n)),
        // Rows of a wider column: each row's run spans several chunks, partial at
        // its ends (one segment each, joined with neighbours sharing a chunk).
        1 => (any::<Index>(), 64usize..3000, 1usize..8000, 1usize..40).prop_map(|(a, w, s, n)| RangeSpec::Column(a, w, s, n)),
        1 => (0usize..5000).prop_map(RangeSpec::Tail),
        2 => (any::<Index>(), 1u64..4).prop_map(|(a, n)| RangeSpec::Chunks(a, n)),
        1 => any::<Index>().prop_map(RangeSpec::Empty),
        1 => Just(RangeSpec::Whole),
    ];
    (any::<Index>(), spec)
}

/// Record-relative ranges `[s, e)` of a record of `size` bytes.
fn resolve_range(spec: &RangeSpec, size: u64, chunk: u64) -> Vec<(u64, u64)> {
    let at = |i: &Index, n: u64| {
        if n == 0 {
            0
        } else {
            i.index(n as usize + 1) as u64
        }
    };
    match spec {
        RangeSpec::Span(a, b, c) => {
            let s = at(a, size);
            // Mostly short, sometimes to anywhere after `s`.
            let short = (c.index(64) as u64).min(size - s);
            let e = if b.index(4) == 0 {
                s + at(c, size - s)
            } else {
                s + short
            };
            vec![(s, e)]
        }
        RangeSpec::Column(a, w, stride, n) => {
            let s0 = at(a, size);
            (0..*n as u64)
                .map(|k| s0 + k * *stride as u64)
                .take_while(|&s| s < size)
                .map(|s| (s, (s + *w as u64).min(size)))
                .collect()
        }
        RangeSpec::Tail(n) => vec![(size - (*n as u64).min(size), size)],
        RangeSpec::Chunks(a, n) => {
            let count = chunks::chunk_count(size, chunk);
            if count == 0 {
                return vec![(0, 0)];
            }
            let first = a.index(count as usize) as u64;
            let last = (first + n).min(count);
            vec![(first * chunk, (last.saturating_mul(chunk)).min(size))]
        }
        RangeSpec::Empty(a) => {
            let s = at(a, size);
            vec![(s, s)]
        }
        RangeSpec::Whole => vec![(0, size)],
    }
}

/// A file with two records that have checksum tables (and one that has
/// none in front), the tables, and the records' places.
struct ChunkFile {
    _dir: tempfile::TempDir,
    path: std::path::PathBuf,
    bytes: Vec<u8>,
    tables: Vec<ChunkTable>,
}

#[derive(Clone, Debug)]
struct ChunkSetup {
    pre: usize,
    lens: [usize; 2],
    seeds: [u8; 2],
    align: u64,
    kinds: [TableKind; 2],
}

fn arb_setup() -> impl Strategy<Value = ChunkSetup> {
    let len = prop_oneof![
        1 => Just(0usize),
        2 => 1usize..100,
        4 => 1usize..20_000,
        2 => (1usize..6).prop_map(|k| k * 4096),
        2 => (1usize..40).prop_map(|k| k * 4096 + 1),
        1 => 100_000usize..300_000,
    ];
    (
        0usize..3000,
        [len.clone(), len],
        any::<[u8; 2]>(),
        prop_oneof![Just(1u64), Just(64), Just(4096)],
        [arb_table_kind(), arb_table_kind()],
    )
        .prop_map(|(pre, lens, seeds, align, kinds)| ChunkSetup {
            pre,
            lens,
            seeds,
            align,
            kinds,
        })
}

fn make_file(s: &ChunkSetup) -> ChunkFile {
    let mut plan = Plan::new(4096).unwrap();
    plan.add_aligned("c/pre", Source::Bytes(rec_bytes(s.pre, 9).into()), 1)
        .unwrap();
    for k in 0..2 {
        plan.add_aligned(
            &format!("c/data/{k}"),
            Source::Bytes(rec_bytes(s.lens[k], s.seeds[k]).into()),
            s.align,
        )
        .unwrap();
    }
    plan.compute_missing_crcs(1);
    plan.finalize().unwrap();
    let mut bytes = vec![0u8; plan.file_end() as usize];
    plan.gather(0, &mut bytes, 1, false).unwrap();
    // The places and CRCs as a reader learns them: from the directory.
    let p = Path::new("chunks.zip");
    let dir = zip::read_directory(&bytes[..], p).unwrap();
    let mut tables = Vec::new();
    for (k, kind) in s.kinds.iter().enumerate() {
        let e = &dir.entries[k + 1];
        let h = e.header_offset as usize;
        let off = zip::data_offset_from_local(&bytes[h..], e, &dir, p).unwrap();
        let data = &bytes[off as usize..(off + e.size) as usize];
        let (chunk, algo, sums) = match *kind {
            TableKind::Whole if e.size > 0 => (e.size, Algo::Crc32, vec![e.crc]),
            // An empty record has no chunks.
            TableKind::Whole => (4096, Algo::Crc32, Vec::new()),
            TableKind::Chunks(c, a) => {
                let sums = chunks::compute(&[data], c as usize, a, 1).remove(0);
                assert_eq!(sums, reference_sums(data, c as usize, a));
                (c, a, sums)
            }
        };
        tables.push(ChunkTable {
            record: e.name.clone(),
            data_offset: off,
            size: e.size,
            chunk,
            algo,
            sums,
        });
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("chunks.bin");
    std::fs::write(&path, &bytes).unwrap();
    ChunkFile {
        _dir: dir,
        path,
        bytes,
        tables,
    }
}

const GUARD: usize = 16;
const GUARD_BYTE: u8 = 0xA5;

/// Destination memory with guard bytes on both sides of every range.
struct Dests {
    bufs: Vec<Vec<u8>>,
}

impl Dests {
    fn new(lens: &[usize]) -> Self {
        Dests {
            bufs: lens
                .iter()
                .map(|&n| vec![GUARD_BYTE; n + 2 * GUARD])
                .collect(),
        }
    }

    fn ranges(&mut self, file_ranges: &[(usize, u64, usize)]) -> Vec<TableRange> {
        file_ranges
            .iter()
            .zip(&mut self.bufs)
            .map(|(&(table, offset, len), b)| TableRange {
                range: IoRange {
                    offset,
                    len,
                    buf: b[GUARD..].as_mut_ptr(),
                },
                table,
            })
            .collect()
    }

    fn data(&self, i: usize) -> &[u8] {
        let b = &self.bufs[i];
        &b[GUARD..b.len() - GUARD]
    }

    fn guards_intact(&self) -> bool {
        self.bufs.iter().all(|b| {
            b[..GUARD].iter().all(|&x| x == GUARD_BYTE)
                && b[b.len() - GUARD..].iter().all(|&x| x == GUARD_BYTE)
        })
    }
}

/// Runs a verified read of `ranges` (table, file offset, length).
fn verified_read(
    engine: &Arc<Engine>,
    path: &Path,
    ranges: &[(usize, u64, usize)],
    tables: &[ChunkTable],
    coverage: Coverage,
) -> (Result<Verified, Error>, Dests) {
    let file = Arc::new(EngineFile::open_read(path, false).unwrap());
    let lens: Vec<usize> = ranges.iter().map(|r| r.2).collect();
    let mut dests = Dests::new(&lens);
    let tr = dests.ranges(ranges);
    // SAFETY: every range's memory is its own Vec (no overlap), `len` bytes
    // long past the guard, and untouched by anything else until the call
    // returns.
    let r = unsafe {
        chunks::read_ranges_verified(engine, &file, &tr, tables, coverage, Class::Foreground)
    };
    assert!(
        dests.guards_intact(),
        "a write outside the destination memory"
    );
    (r, dests)
}

/// How the second reader of [`shared_read`] departs from reading exactly
/// the rest of each chunk.
#[derive(Clone, Copy, Debug)]
enum Other {
    /// The exact complement: every piece can be proven.
    Exact,
    /// One of its spans left out (a gap).
    Drop,
    /// One of its spans one byte longer at the front (an overlap).
    Overlap,
    /// One of its spans read twice.
    Twice,
    /// One of its pieces reported with a different checksum (its bytes
    /// differed, as a failing read would make them).
    Differs,
}

/// The record of `tables` holding file offset `off`.
fn table_at(tables: &[ChunkTable], off: u64) -> usize {
    tables
        .iter()
        .position(|t| off >= t.data_offset && off < t.data_offset + t.size)
        .expect("a piece inside a record")
}

/// What the second reader of [`shared_read`] reads: the rest of every chunk
/// `v` read in part, changed as `other_mode` says.
fn rest_of_chunks(
    v: &Verified,
    tables: &[ChunkTable],
    other_mode: Other,
    pick: Index,
) -> Vec<(usize, u64, usize)> {
    let table_of = |off: u64| table_at(tables, off);
    let mut by_chunk: std::collections::BTreeMap<u64, (u64, Vec<(u64, u64)>)> =
        std::collections::BTreeMap::new();
    for p in &v.pieces {
        assert!(
            p.len > 0
                && p.offset >= p.chunk_offset
                && p.offset + p.len <= p.chunk_offset + p.chunk_len
        );
        let e = by_chunk
            .entry(p.chunk_offset)
            .or_insert((p.chunk_len, Vec::new()));
        e.1.push((p.offset, p.offset + p.len));
    }
    let mut other: Vec<(usize, u64, usize)> = Vec::new();
    for (&c, (len, spans)) in &mut by_chunk {
        spans.sort_unstable();
        let mut at = c;
        for &(s, e) in spans.iter() {
            if s > at {
                other.push((table_of(c), at, (s - at) as usize));
            }
            at = at.max(e);
        }
        // The first reader's pieces of a chunk are disjoint spans.
        assert!(
            spans.windows(2).all(|w| w[0].1 <= w[1].0),
            "overlapping pieces {spans:?}"
        );
        if at < c + *len {
            other.push((table_of(c), at, (c + *len - at) as usize));
        }
    }
    if !other.is_empty() {
        let k = pick.index(other.len());
        match other_mode {
            Other::Exact | Other::Differs => {}
            Other::Drop => {
                other.remove(k);
            }
            Other::Overlap => {
                let (t, off, len) = other[k];
                if off > tables[t].data_offset {
                    other[k] = (t, off - 1, len + 1);
                }
            }
            Other::Twice => other.push(other[k]),
        }
    }
    other
}

/// A [`Coverage::Shared`] read of `ranges` as one of two readers: a second
/// reader reads the rest of every chunk the first read in part (as `other`
/// says), the pieces of both are proven together, and the first re-reads,
/// checking whole chunks, what was not proven (as a sharded load does
/// across ranks). Also returns how many of the first reader's pieces were
/// proven.
fn shared_read(
    engine: &Arc<Engine>,
    path: &Path,
    ranges: &[(usize, u64, usize)],
    tables: &[ChunkTable],
    other_mode: Other,
    pick: Index,
) -> (Result<Verified, Error>, Dests, usize) {
    let (r, dests) = verified_read(engine, path, ranges, tables, Coverage::Shared);
    let v = match r {
        Ok(v) => v,
        Err(e) => return (Err(e), dests, 0),
    };
    let table_of = |off: u64| table_at(tables, off);
    let other = rest_of_chunks(&v, tables, other_mode, pick);
    let (r2, _rest) = verified_read(engine, path, &other, tables, Coverage::Shared);
    let mut v2 = match r2 {
        Ok(v2) => v2,
        Err(e) => return (Err(e), dests, 0),
    };
    if let (Other::Differs, false) = (other_mode, v2.pieces.is_empty()) {
        let k = pick.index(v2.pieces.len());
        v2.pieces[k].sum ^= 0x0400_0000;
    }
    let all: Vec<(u64, chunks::Piece)> =
        v.pieces.iter().chain(&v2.pieces).map(|p| (7, *p)).collect();
    let proven = chunks::prove_pieces(&all);
    let proven_mine = proven[..v.pieces.len()].iter().filter(|&&x| x).count();
    let unproven: std::collections::BTreeSet<u64> = v
        .pieces
        .iter()
        .zip(&proven)
        .filter(|(_, &ok)| !ok)
        .map(|(p, _)| p.chunk_offset)
        .collect();
    let redo: Vec<TableRange> = v
        .filled
        .iter()
        .filter(|f| unproven.contains(&f.chunk_offset))
        .map(|f| TableRange {
            range: IoRange {
                offset: f.offset,
                len: f.len as usize,
                buf: f.mem as *mut u8,
            },
            table: table_of(f.offset),
        })
        .collect();
    let file = Arc::new(EngineFile::open_read(path, false).unwrap());
    // SAFETY: the memory the first read filled, still owned by `dests`.
    let again = unsafe {
        chunks::read_ranges_verified(
            engine,
            &file,
            &redo,
            tables,
            Coverage::Touched,
            Class::Foreground,
        )
    };
    assert!(
        dests.guards_intact(),
        "a write outside the destination memory"
    );
    (again.map(|_| v), dests, proven_mine)
}

fn chunk_len(t: &ChunkTable, i: u64) -> u64 {
    let s = i * t.chunk;
    s.saturating_add(t.chunk).min(t.size) - s
}

/// Which chunks a verified read of `rel` (table, start, end in the record)
/// must check, how many bytes they hold, and how many bytes the touched
/// chunks hold.
fn expected_checks(
    tables: &[ChunkTable],
    rel: &[(usize, u64, u64)],
    full: bool,
) -> (Vec<Vec<bool>>, u64, u64) {
    let mut checked: Vec<Vec<bool>> = tables.iter().map(|t| vec![full; t.sums.len()]).collect();
    let mut touched_bytes = 0u64;
    for (ti, t) in tables.iter().enumerate() {
        let mut seen = vec![false; t.sums.len()];
        for &(_, s, e) in rel.iter().filter(|r| r.0 == ti && r.1 < r.2) {
            for i in s / t.chunk..e.div_ceil(t.chunk) {
                checked[ti][i as usize] = true;
                seen[i as usize] = true;
            }
        }
        touched_bytes += (0..t.sums.len() as u64)
            .filter(|&i| seen[i as usize])
            .map(|i| chunk_len(t, i))
            .sum::<u64>();
    }
    let want_checked: u64 = tables
        .iter()
        .enumerate()
        .map(|(ti, t)| {
            (0..t.sums.len() as u64)
                .filter(|&i| checked[ti][i as usize])
                .map(|i| chunk_len(t, i))
                .sum::<u64>()
        })
        .sum();
    (checked, want_checked, touched_bytes)
}

/// An unverified read returned the ranges' bytes as the file holds them
/// now, read once where they overlap.
fn check_unverified(
    r: Result<Verified, Error>,
    dests: &Dests,
    file_ranges: &[(usize, u64, usize)],
    bytes: &[u8],
) {
    let v = r.unwrap_or_else(|e| panic!("unverified read: {e}"));
    let sum: u64 = file_ranges.iter().map(|r| r.2 as u64).sum();
    let mut iv: Vec<(u64, u64)> = file_ranges
        .iter()
        .filter(|r| r.2 > 0)
        .map(|r| (r.1, r.1 + r.2 as u64))
        .collect();
    iv.sort_unstable();
    let (mut union, mut reach) = (0u64, 0u64);
    for (s, e) in iv {
        let s = s.max(reach);
        if e > s {
            union += e - s;
            reach = e;
        }
    }
    assert!(
        union <= v.read && v.read <= sum && v.checked == 0,
        "unverified read counts {v:?}, union {union}, sum {sum}"
    );
    assert_ranges_read(dests, file_ranges, bytes);
}

/// Every range's memory holds the file's bytes `bytes` at its offset.
fn assert_ranges_read(dests: &Dests, file_ranges: &[(usize, u64, usize)], bytes: &[u8]) {
    for (i, &(_, off, len)) in file_ranges.iter().enumerate() {
        let off = off as usize;
        assert!(
            dests.data(i) == &bytes[off..off + len],
            "range {i} [{off}, +{len}) read wrong bytes"
        );
    }
}

#[test]
#[allow(clippy::too_many_lines)]
fn fuzz_chunks_verified_reads() {
    #[derive(Clone, Copy, Debug, Default)]
    struct Counts {
        cases: u64,
        ok: u64,
        detected: u64,
        damaged_unread: u64,
    }
    let counts = Cell::new(Counts::default());
    let s = (
        arb_setup(),
        prop::collection::vec(arb_range(), 0..12),
        (0usize..4, 0usize..5, any::<Index>()),
        prop_oneof![1 => Just(None), 2 => (any::<Index>(), 1u8..=255).prop_map(Some)],
        any::<Index>(),
    );
    run(
        1500,
        s,
        |(setup, specs, (mode, other, pick), damage, engine)| {
            let other = [
                Other::Exact,
                Other::Drop,
                Other::Overlap,
                Other::Twice,
                Other::Differs,
            ][other];
            let mut f = make_file(&setup);
            let coverage = [
                Coverage::Touched,
                Coverage::Full,
                Coverage::None,
                Coverage::Shared,
            ][mode];
            let full = coverage == Coverage::Full;
            // Record-relative ranges per table, then file ranges.
            let mut rel: Vec<(usize, u64, u64)> = Vec::new();
            for (ti, spec) in &specs {
                let t = ti.index(f.tables.len());
                let tab = &f.tables[t];
                for (s, e) in resolve_range(spec, tab.size, tab.chunk.min(tab.size.max(1))) {
                    assert!(s <= e && e <= tab.size);
                    rel.push((t, s, e));
                }
            }
            let file_ranges: Vec<(usize, u64, usize)> = rel
                .iter()
                .map(|&(t, s, e)| (t, f.tables[t].data_offset + s, (e - s) as usize))
                .collect();
            let (checked, want_checked, touched_bytes) = expected_checks(&f.tables, &rel, full);
            let original = f.bytes.clone();
            let mut hit = false;
            if let Some((at, x)) = &damage {
                let q = at.index(f.bytes.len());
                f.bytes[q] ^= x;
                std::fs::write(&f.path, &f.bytes).unwrap();
                let q = q as u64;
                hit = f.tables.iter().enumerate().any(|(ti, t)| {
                    q >= t.data_offset
                        && q < t.data_offset + t.size
                        && checked[ti][((q - t.data_offset) / t.chunk) as usize]
                });
            }
            let eng = &engines()[engine.index(engines().len())];
            let (r, dests, proven) = if coverage == Coverage::Shared {
                shared_read(eng, &f.path, &file_ranges, &f.tables, other, pick)
            } else {
                let (r, d) = verified_read(eng, &f.path, &file_ranges, &f.tables, coverage);
                (r, d, 0)
            };
            let mut c = counts.get();
            c.cases += 1;
            if coverage == Coverage::None {
                check_unverified(r, &dests, &file_ranges, &f.bytes);
                c.ok += 1;
                counts.set(c);
                return;
            }
            if hit {
                c.detected += 1;
                assert!(
                    matches!(r, Err(Error::ChunkChecksum { .. } | Error::Checksum { .. })),
                    "damage in a checked chunk went unnoticed: {r:?}"
                );
            } else {
                let v = r.unwrap_or_else(|e| panic!("no damage read: {e}"));
                c.ok += 1;
                if damage.is_some() {
                    c.damaged_unread += 1;
                }
                if coverage == Coverage::Shared {
                    // Every touched chunk is checked here or read in part (its
                    // pieces proven with the other reader's).
                    let partial: std::collections::BTreeMap<u64, u64> = v
                        .pieces
                        .iter()
                        .map(|p| (p.chunk_offset, p.chunk_len))
                        .collect();
                    assert_eq!(
                        v.checked + partial.values().sum::<u64>(),
                        want_checked,
                        "{v:?}"
                    );
                    // With the exact complement and no damage, every piece is proven.
                    if matches!(other, Other::Exact) && damage.is_none() {
                        assert_eq!(proven, v.pieces.len(), "{v:?}");
                    }
                } else {
                    assert_eq!(v.checked, want_checked, "checked bytes");
                    assert!(
                        v.checked >= touched_bytes && v.read >= touched_bytes,
                        "{v:?}"
                    );
                }
                assert_ranges_read(&dests, &file_ranges, &original);
            }
            counts.set(c);
        },
    );
    eprintln!("verified reads: {:?}", counts.get());
}

/// Direct reads go in batches of 32 MiB, each verified while the next is
/// read, and shared chunks through 8 MiB windows: a record of 70 MiB read
/// whole, in pieces and as a column (short ranges sharing every chunk), with
/// damage in the first batch or window (the read in flight is cancelled), in
/// a later one, and in the partial last chunk.
#[test]
fn chunks_verified_reads_in_batches() {
    let size = (70 << 20) + 1000;
    let setup = ChunkSetup {
        pre: 100,
        lens: [size, 10],
        seeds: [3, 4],
        align: 4096,
        kinds: [TableKind::Chunks(4096, Algo::Crc32c), TableKind::Whole],
    };
    let mut f = make_file(&setup);
    let (off, size) = (f.tables[0].data_offset, f.tables[0].size);
    let original = f.bytes.clone();
    let whole = vec![(0, off, size as usize)];
    let pieces: Vec<(usize, u64, usize)> = (0..size)
        .step_by(20 << 20)
        .map(|s| (0, off + s, ((20 << 20).min(size - s)) as usize))
        .collect();
    // A column of a row-major matrix: 1,000 of every 5,000 bytes, so every
    // chunk is shared or partial and goes through the windows (9 of them).
    let column: Vec<(usize, u64, usize)> = (0..size - 2234)
        .step_by(5000)
        .map(|s| (0, off + s + 1234, 1000))
        .collect();
    let damages = [None, Some(5000u64), Some(50 << 20), Some(size - 10)];
    for (k, damage) in damages.iter().enumerate() {
        f.bytes.copy_from_slice(&original);
        if let Some(d) = damage {
            f.bytes[(off + d) as usize] ^= 0x10;
        }
        std::fs::write(&f.path, &f.bytes).unwrap();
        for (ri, ranges) in [&whole, &pieces, &column].into_iter().enumerate() {
            let is_column = ri == 2;
            for coverage in [Coverage::Touched, Coverage::Full] {
                let eng = &engines()[k % engines().len()];
                let (r, dests) = verified_read(eng, &f.path, ranges, &f.tables, coverage);
                // The column's reads end before the last chunks.
                let col_end = (column.last().unwrap().1 - off + 1000).div_ceil(4096) * 4096;
                let read_there =
                    damage.is_some_and(|d| coverage == Coverage::Full || !is_column || d < col_end);
                if read_there {
                    assert!(
                        matches!(r, Err(Error::ChunkChecksum { .. })),
                        "damage at {damage:?} not detected: {r:?}"
                    );
                    continue;
                }
                let v = r.unwrap();
                let want = if coverage == Coverage::Full {
                    size + 10
                } else if is_column {
                    // Every chunk up to the one the last range ends in.
                    let end = column.last().unwrap().1 - off + 1000;
                    (end.div_ceil(4096) * 4096).min(size)
                } else {
                    size
                };
                assert_eq!(v.checked, want);
                for (i, &(_, o, n)) in ranges.iter().enumerate() {
                    let o = o as usize;
                    assert!(dests.data(i) == &original[o..o + n], "range {i}");
                }
            }
        }
    }
}

/// Ranges outside their record, tables that do not fit the file or do not
/// add up: an error, never a panic or a write outside the ranges' memory.
#[test]
fn fuzz_chunks_bad_requests() {
    #[derive(Clone, Debug)]
    enum Fault {
        RangeBefore(u64, usize),
        RangeAfter(u64),
        RangeOtherRecord,
        NoSuchTable(usize),
        TableBeyondFile(u64),
        TableOffsetHuge(u64),
        TableSizeHuge,
        SumsCount(i8),
        ChunkZero,
    }
    let fault = prop_oneof![
        (1u64..5000, 0usize..5000).prop_map(|(b, n)| Fault::RangeBefore(b, n)),
        (1u64..5000).prop_map(Fault::RangeAfter),
        Just(Fault::RangeOtherRecord),
        (0usize..3).prop_map(Fault::NoSuchTable),
        (1u64..10_000).prop_map(Fault::TableBeyondFile),
        (0u64..100).prop_map(Fault::TableOffsetHuge),
        Just(Fault::TableSizeHuge),
        prop_oneof![-3i8..0, 1i8..4].prop_map(Fault::SumsCount),
        Just(Fault::ChunkZero),
    ];
    let s = (
        arb_setup(),
        prop::collection::vec(arb_range(), 0..6),
        fault,
        any::<bool>(),
        any::<Index>(),
        any::<Index>(),
    );
    run(1000, s, |(setup, specs, fault, full, which, engine)| {
        let mut f = make_file(&setup);
        let coverage = if full {
            Coverage::Full
        } else {
            Coverage::Touched
        };
        let mut ranges: Vec<(usize, u64, usize)> = Vec::new();
        for (ti, spec) in &specs {
            let t = ti.index(f.tables.len());
            let tab = &f.tables[t];
            for (s, e) in resolve_range(spec, tab.size, tab.chunk.min(tab.size.max(1))) {
                ranges.push((t, tab.data_offset + s, (e - s) as usize));
            }
        }
        let w = which.index(2);
        let (off, size) = (f.tables[w].data_offset, f.tables[w].size);
        let file_len = f.bytes.len() as u64;
        match fault {
            Fault::RangeBefore(by, len) => {
                let s = off.saturating_sub(by);
                ranges.push((w, s, len.max((off - s + 1) as usize)));
            }
            Fault::RangeAfter(by) => {
                let s = (off + size).saturating_sub(by);
                ranges.push((w, s, (off + size + by - s) as usize));
            }
            Fault::RangeOtherRecord => {
                // A range of the other record, named with this one's table.
                let o = &f.tables[1 - w];
                if o.size == 0 && size == 0 {
                    return;
                }
                if o.size == 0 {
                    ranges.push((1 - w, off, 1));
                } else {
                    ranges.push((w, o.data_offset, o.size as usize));
                }
            }
            Fault::NoSuchTable(k) => ranges.push((2 + k, off, 0)),
            Fault::TableBeyondFile(by) => {
                f.tables[w].size = file_len - off + by;
                // The sums fit the new size, so that the file length is the fault.
                let n = chunks::chunk_count(f.tables[w].size, f.tables[w].chunk);
                f.tables[w].sums.resize(n as usize, 0);
            }
            Fault::TableOffsetHuge(k) => f.tables[w].data_offset = u64::MAX - k,
            Fault::TableSizeHuge => f.tables[w].size = u64::MAX - off + 1,
            Fault::SumsCount(d) => {
                let n = f.tables[w].sums.len() as i64 + i64::from(d);
                if n < 0 {
                    return;
                }
                f.tables[w].sums.resize(n as usize, 7);
            }
            Fault::ChunkZero => f.tables[w].chunk = 0,
        }
        let eng = &engines()[engine.index(engines().len())];
        let (r, _) = verified_read(eng, &f.path, &ranges, &f.tables, coverage);
        match r {
            Err(Error::Corrupt { .. } | Error::Truncated { .. } | Error::Invalid(_)) => {}
            other => panic!("{fault:?}: expected an error, got {other:?}"),
        }
    });
}

/// Known bug (chunks.rs, not fixed here): the end of a range is computed as
/// `offset + len` without an overflow check. A range near `u64::MAX` panics
/// (unoptimized: "attempt to add with overflow" at the range check;
/// optimized: the end wraps, and the chunk loop indexes out of bounds), and
/// in an optimized build a range whose wrapped end lands inside the record is
/// accepted: Ok, with nothing read into its memory and nothing checked.
#[test]
fn chunks_range_end_overflow_is_refused() {
    let f = make_file(&ChunkSetup {
        pre: 10,
        lens: [5000, 10],
        seeds: [1, 2],
        align: 4096,
        kinds: [TableKind::Chunks(4096, Algo::Crc32c); 2],
    });
    let off = f.tables[0].data_offset;
    let mut wrong = Vec::new();
    for (offset, len) in [(u64::MAX - 3, 8), (u64::MAX - 3, off as usize + 10)] {
        let r = std::panic::catch_unwind(|| {
            verified_read(
                &engines()[0],
                &f.path,
                &[(0, offset, len)],
                &f.tables,
                Coverage::Touched,
            )
            .0
        });
        match r {
            Ok(Err(Error::Corrupt { .. })) => {}
            Ok(other) => wrong.push(format!("[{offset}, +{len}): {other:?}")),
            Err(_) => wrong.push(format!("[{offset}, +{len}): panicked")),
        }
    }
    assert!(wrong.is_empty(), "expected errors: {wrong:?}");
}

/// The whole-record table of an empty record (as the Python side builds it
/// for files without chunk checksums: chunk size 1, no sums) is accepted.
#[test]
fn chunks_whole_record_table_of_empty_record() {
    let f = make_file(&ChunkSetup {
        pre: 10,
        lens: [0, 10],
        seeds: [1, 2],
        align: 4096,
        kinds: [TableKind::Chunks(4096, Algo::Crc32c); 2],
    });
    let e = &f.tables[0];
    for (chunk, sums) in [(1u64, vec![]), (4096, vec![])] {
        let t = ChunkTable {
            record: e.record.clone(),
            data_offset: e.data_offset,
            size: 0,
            chunk,
            algo: Algo::Crc32,
            sums,
        };
        let r = verified_read(
            &engines()[0],
            &f.path,
            &[(0, e.data_offset, 0)],
            std::slice::from_ref(&t),
            Coverage::Full,
        )
        .0;
        assert!(r.is_ok(), "chunk {chunk}: {r:?}");
    }
}
