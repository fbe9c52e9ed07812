//! End-to-end engine tests on real files, under every backend this machine has.

use std::path::Path;
use std::sync::Arc;

use proptest::prelude::*;
use tierstore_core::engine::{Config, Engine, Mode};
use tierstore_core::file::EngineFile;
use tierstore_core::io::Class;
use tierstore_core::plan::Source;
use tierstore_core::reader::{read_records, ReadSpec};
use tierstore_core::task::TaskState;
use tierstore_core::writer::{ContainerWriter, WriteOptions};
use tierstore_core::zip::{self, read_directory};
use tierstore_core::Error;

fn modes() -> Vec<Mode> {
    let mut v = vec![Mode::Threads, Mode::Buffered];
    if tierstore_core::probe::io_uring_status().is_ok() {
        v.push(Mode::IoUring);
    } else {
        eprintln!("io_uring unavailable here; skipping that backend");
    }
    v
}

fn engine(mode: Mode) -> Arc<Engine> {
    let cfg = Config {
        mode: Some(mode),
        chunk_size: 64 << 10,
        pool_bytes: 4 * (64 << 10),
        queue_depth: 8,
        ..Config::default()
    };
    Engine::start(cfg, Some("test")).unwrap()
}

fn write(
    engine: &Arc<Engine>,
    path: &Path,
    records: &[(String, Vec<u8>)],
    trailing: &[(String, Vec<u8>)],
) {
    let mut w = ContainerWriter::create(engine, path, WriteOptions::default()).unwrap();
    for (n, d) in records {
        // SAFETY: `records` outlives the write (we join before returning).
        w.add(n, unsafe { Source::mem(d.as_ptr(), d.len()) })
            .unwrap();
    }
    let w = w.write_data(TaskState::new()).unwrap().join().unwrap();
    let mut w = w;
    for (n, d) in trailing {
        w.add(n, Source::Bytes(d.clone().into())).unwrap();
    }
    w.commit(TaskState::new()).unwrap().join().unwrap();
}

fn read_all(
    engine: &Arc<Engine>,
    path: &Path,
    verify: bool,
) -> Result<Vec<(String, Vec<u8>)>, Error> {
    let f = Arc::new(EngineFile::open_read(path, engine.mode().direct())?);
    let dir = read_directory(&std::fs::read(path).unwrap()[..], path)?;
    let mut specs = Vec::new();
    for e in &dir.entries {
        let probe = f.read_small(
            e.header_offset,
            (dir.cd_offset - e.header_offset).min(zip::local_header_probe_len(e.name.len())),
            "header",
        )?;
        let off = zip::data_offset_from_local(&probe, e, &dir, path)?;
        specs.push(ReadSpec {
            name: e.name.clone(),
            offset: off,
            size: e.size,
            crc: Some(e.crc),
        });
    }
    let bufs = read_records(
        engine,
        f,
        specs.clone(),
        verify,
        Class::Foreground,
        TaskState::new(),
    )?
    .join()?;
    Ok(specs
        .into_iter()
        .zip(bufs)
        .map(|(s, b)| (s.name, b.data().to_vec()))
        .collect())
}

fn sample() -> Vec<(String, Vec<u8>)> {
    [0usize, 1, 100, 4096, 65_536, 65_537, 300_000, 17]
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            (
                format!("ckpt/data/{i}"),
                (0..n).map(|x| (x * 31 + i * 7) as u8).collect(),
            )
        })
        .collect()
}

#[test]
fn roundtrip_every_backend() {
    let d = tempfile::tempdir().unwrap();
    for mode in modes() {
        let e = engine(mode);
        let p = d.path().join(format!("{mode}.pt"));
        let recs = sample();
        let trailing = vec![("ckpt/data.pkl".to_string(), b"\x80\x02}q\x00.".to_vec())];
        write(&e, &p, &recs, &trailing);
        // Python's zip reader rules: data is aligned, CRCs match.
        let back = read_all(&e, &p, true).unwrap();
        let mut want = recs.clone();
        want.extend(trailing.clone());
        assert_eq!(back, want, "backend {mode}");
        let dir = read_directory(&std::fs::read(&p).unwrap()[..], &p).unwrap();
        for ent in &dir.entries {
            let bytes = std::fs::read(&p).unwrap();
            let off =
                zip::data_offset_from_local(&bytes[ent.header_offset as usize..], ent, &dir, &p)
                    .unwrap();
            assert_eq!(off % 4096, 0, "record {} aligned", ent.name);
        }
        let leftovers: Vec<_> = std::fs::read_dir(d.path())
            .unwrap()
            .filter_map(Result::ok)
            .filter(|x| x.file_name().to_string_lossy().contains("tierstore-tmp"))
            .collect();
        assert!(leftovers.is_empty());
    }
}

#[test]
fn many_chunks_populated_by_two_helpers_read_back_exactly() {
    // 64 KiB chunks: a 3 MiB record is 48 work items, populated alternately
    // by two helpers; the reads may only follow the populated prefix.
    let d = tempfile::tempdir().unwrap();
    for mode in modes() {
        let cfg = Config {
            mode: Some(mode),
            chunk_size: 64 << 10,
            pool_bytes: 4 * (64 << 10),
            queue_depth: 8,
            cpu_threads: 2,
            ..Config::default()
        };
        let e = Engine::start(cfg, Some("test")).unwrap();
        let p = d.path().join(format!("many-{mode}.pt"));
        let recs: Vec<(String, Vec<u8>)> = (0..3usize)
            .map(|i| {
                let n = (3 << 20) + i * 4099;
                (
                    format!("ckpt/data/{i}"),
                    (0..n).map(|x| (x * 131 + i) as u8).collect(),
                )
            })
            .collect();
        write(&e, &p, &recs, &[]);
        assert_eq!(read_all(&e, &p, true).unwrap(), recs, "backend {mode}");
    }
}

#[test]
fn flipped_byte_is_reported_with_the_record_name() {
    let d = tempfile::tempdir().unwrap();
    for mode in modes() {
        let e = engine(mode);
        let p = d.path().join("x.pt");
        write(&e, &p, &sample(), &[]);
        let mut bytes = std::fs::read(&p).unwrap();
        let dir = read_directory(&bytes[..], &p).unwrap();
        let ent = dir
            .entries
            .iter()
            .find(|x| x.name == "ckpt/data/6")
            .unwrap();
        let off = zip::data_offset_from_local(&bytes[ent.header_offset as usize..], ent, &dir, &p)
            .unwrap();
        bytes[off as usize + 12345] ^= 0x40;
        std::fs::write(&p, &bytes).unwrap();
        match read_all(&e, &p, true) {
            Err(Error::Checksum { record, .. }) => assert_eq!(record, "ckpt/data/6"),
            other => panic!(
                "expected a checksum error, got {:?}",
                other.map(|v| v.len())
            ),
        }
        // verify=false skips the check.
        assert!(read_all(&e, &p, false).is_ok());
    }
}

#[test]
fn truncated_file_is_reported() {
    let d = tempfile::tempdir().unwrap();
    let e = engine(Mode::Threads);
    let p = d.path().join("t.pt");
    write(&e, &p, &sample(), &[]);
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    let err = read_directory(&std::fs::read(&p).unwrap()[..], &p).unwrap_err();
    assert!(matches!(err, Error::Truncated { .. }), "{err}");
    // A record range past the end is refused before any allocation.
    let f = Arc::new(EngineFile::open_read(&p, true).unwrap());
    let spec = ReadSpec {
        name: "huge".into(),
        offset: 1 << 40,
        size: 1 << 40,
        crc: None,
    };
    let err = read_records(&e, f, vec![spec], true, Class::Foreground, TaskState::new())
        .err()
        .unwrap();
    assert!(err.to_string().contains("huge"), "{err}");
}

#[test]
fn cancelled_save_leaves_old_file_and_no_temp() {
    let d = tempfile::tempdir().unwrap();
    let e = engine(Mode::Threads);
    let p = d.path().join("c.pt");
    std::fs::write(&p, b"old contents").unwrap();
    let big = vec![3u8; 8 << 20];
    let mut w = ContainerWriter::create(&e, &p, WriteOptions::default()).unwrap();
    // SAFETY: `big` outlives the task (joined below).
    w.add("c/data/0", unsafe { Source::mem(big.as_ptr(), big.len()) })
        .unwrap();
    let st = TaskState::new();
    st.cancel();
    let r = w.write_data(st).unwrap().join();
    assert!(matches!(r, Err(Error::Cancelled)));
    assert_eq!(std::fs::read(&p).unwrap(), b"old contents");
    assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn random_records_roundtrip(sizes in proptest::collection::vec(0usize..200_000, 0..12), seed in any::<u8>()) {
        let d = tempfile::tempdir().unwrap();
        let e = engine(if seed % 2 == 0 { Mode::Threads } else { Mode::Buffered });
        let recs: Vec<(String, Vec<u8>)> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| (format!("a/data/{i}"), (0..n).map(|x| (x as u8) ^ seed ^ (i as u8)).collect()))
            .collect();
        let p = d.path().join("r.pt");
        write(&e, &p, &recs, &[("a/version".into(), b"3\n".to_vec())]);
        let back = read_all(&e, &p, true).unwrap();
        prop_assert_eq!(back.len(), recs.len() + 1);
        for (a, b) in back.iter().zip(&recs) {
            prop_assert_eq!(a, b);
        }
    }
}

/// Page-aligned memory is written without the staging copy (every backend),
/// including memory still being filled behind a gate; the file reads back
/// with correct checksums.
#[test]
fn aligned_and_gated_memory_is_written_directly() {
    use tierstore_core::buf::AlignedBuf;
    use tierstore_core::plan::Gate;
    for mode in modes() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("direct.pt");
        let e = engine(mode);
        let n = 300_000;
        let mut a = AlignedBuf::new(n, 4096).unwrap();
        for (i, b) in a.as_mut_slice()[..n].iter_mut().enumerate() {
            *b = (i * 13 % 251) as u8;
        }
        let mut g = AlignedBuf::new(n, 4096).unwrap();
        let gp = g.as_mut_ptr() as usize;
        let gate = Gate::new();
        let mut w = ContainerWriter::create(&e, &p, WriteOptions::default()).unwrap();
        // SAFETY: both buffers outlive the write; `g` is filled before its gate opens.
        unsafe {
            w.add("x/data/0", Source::mem(a.as_ptr(), n)).unwrap();
            w.add(
                "x/data/1",
                Source::gated(gp as *const u8, n, Arc::clone(&gate), 1),
            )
            .unwrap();
        }
        let task = w.write_data(TaskState::new()).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(30));
        // SAFETY: nothing reads `g` before the gate opens.
        unsafe { std::slice::from_raw_parts_mut(gp as *mut u8, n) }.fill(0x5A);
        gate.advance(1);
        let w = task.join().unwrap();
        w.commit(TaskState::new()).unwrap().join().unwrap();
        let back = read_all(&e, &p, true).unwrap();
        assert_eq!(back[0].1, a.as_slice()[..n].to_vec(), "{mode}");
        assert!(back[1].1.iter().all(|&b| b == 0x5A), "{mode}");
    }
}

/// A foreground range transfer of `r` on `f`, without turns.
///
/// # Safety
///
/// As for `transfer_ranges`: the ranges' memory outlives the task.
unsafe fn transfer(
    e: &Arc<Engine>,
    f: EngineFile,
    r: Vec<tierstore_core::ranges::IoRange>,
    op: tierstore_core::io::Op,
    crc: Option<(String, u32)>,
) -> tierstore_core::Result<tierstore_core::task::Task<u64>> {
    // SAFETY: forwarded contract.
    unsafe {
        tierstore_core::ranges::transfer_ranges(
            e,
            Arc::new(f),
            r,
            op,
            Class::Foreground,
            TaskState::new(),
            None,
            crc,
        )
    }
}

#[test]
fn ranges_are_rewritten_in_place() {
    use tierstore_core::buf::AlignedBuf;
    use tierstore_core::io::Op;
    use tierstore_core::ranges::IoRange;
    for mode in modes() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("scratch.bin");
        let e = engine(mode);
        let n = 3 * 64 * 1024 + 8192; // several chunks, page multiple
        let mut a = AlignedBuf::new(n, 4096).unwrap();
        let mut round = |fill: u8| {
            for (i, b) in a.as_mut_slice()[..n].iter_mut().enumerate() {
                *b = (i % 251) as u8 ^ fill;
            }
            let f = EngineFile::open_write(&p, mode.direct(), 2 * n as u64).unwrap();
            assert_eq!(f.len, 2 * n as u64, "{mode}: extended to the size asked");
            let r = vec![IoRange {
                offset: n as u64,
                len: n,
                buf: a.as_mut_ptr(),
            }];
            // SAFETY: `a` outlives the joined task and nothing else touches it.
            let t = unsafe { transfer(&e, f, r, Op::Write, None) };
            assert_eq!(t.unwrap().join().unwrap(), n as u64);
            let mut b = AlignedBuf::new(n, 4096).unwrap();
            let f = EngineFile::open_read(&p, mode.direct()).unwrap();
            let r = vec![IoRange {
                offset: n as u64,
                len: n,
                buf: b.as_mut_ptr(),
            }];
            // SAFETY: as above.
            let t = unsafe { transfer(&e, f, r, Op::Read, None) };
            t.unwrap().join().unwrap();
            assert_eq!(b.as_slice()[..n], a.as_slice()[..n], "{mode}");
        };
        round(0);
        round(0xA5); // the same file rewritten, not recreated
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 2 * n as u64);
        // A range beyond the end is refused before any I/O.
        let f = EngineFile::open_read(&p, false).unwrap();
        let mut b = vec![0u8; 16];
        let r = vec![IoRange {
            offset: 2 * n as u64,
            len: 16,
            buf: b.as_mut_ptr(),
        }];
        // SAFETY: `b` outlives the call.
        let err = unsafe { transfer(&e, f, r, Op::Read, None) };
        assert!(err.is_err(), "{mode}");
    }
}

/// A read with an expected CRC-32 is verified by the engine as its chunks
/// arrive: the right CRC passes, a flipped bit on disk fails naming the record.
#[test]
fn range_reads_are_verified_against_an_expected_crc() {
    use tierstore_core::buf::AlignedBuf;
    use tierstore_core::io::Op;
    use tierstore_core::ranges::IoRange;
    for mode in modes() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("state.bin");
        let n = 5 * (8 << 20) + 4096; // several engine chunks
        let data: Vec<u8> = (0..n).map(|i| (i * 7 % 253) as u8).collect();
        std::fs::write(&p, &data).unwrap();
        let crc = crc32fast::hash(&data);
        let e = engine(mode);
        let read = |expect: u32| {
            let mut b = AlignedBuf::new(n, 4096).unwrap();
            let f = EngineFile::open_read(&p, mode.direct()).unwrap();
            let r = vec![IoRange {
                offset: 0,
                len: n,
                buf: b.as_mut_ptr(),
            }];
            // SAFETY: `b` outlives the joined task and nothing else touches it.
            let t =
                unsafe { transfer(&e, f, r, Op::Read, Some(("subgroup 3".to_owned(), expect))) };
            t.unwrap().join()
        };
        assert_eq!(read(crc).unwrap(), n as u64, "{mode}");
        let err = read(crc ^ 1).unwrap_err().to_string();
        assert!(
            err.contains("subgroup 3") && err.contains("checksum mismatch"),
            "{mode}: {err}"
        );
    }
}

/// A chunk that holds several records: each page-aligned record's interior
/// goes out from its own memory, the edges between records (tails, headers,
/// padding, small or unaligned records) through the staging buffer; gated
/// memory waits for its gate. Every backend; the file reads back exactly,
/// with every CRC verified.
#[test]
fn chunks_over_several_records_write_each_records_interior_directly() {
    use tierstore_core::buf::AlignedBuf;
    use tierstore_core::plan::Gate;
    for mode in modes() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("mixed.pt");
        let cfg = Config {
            mode: Some(mode),
            chunk_size: 1 << 20,
            pool_bytes: 4 << 20,
            queue_depth: 8,
            ..Config::default()
        };
        let e = Engine::start(cfg, Some("test")).unwrap();
        // Sizes: page multiples and not, under and over the 64 KiB minimum, and over a chunk.
        let sizes = [
            200_000usize,
            4096 * 40,
            70_000,
            3000,
            1 << 20,
            (3 << 20) + 123,
            65_536,
            12_345,
        ];
        let mut bufs: Vec<AlignedBuf> = Vec::new();
        for (i, &n) in sizes.iter().enumerate() {
            let mut b = AlignedBuf::new(n.max(1), 4096).unwrap();
            for (j, x) in b.as_mut_slice()[..n].iter_mut().enumerate() {
                *x = (j * 7 + i * 31) as u8;
            }
            bufs.push(b);
        }
        let unaligned: Vec<u8> = (0..150_000u32).map(|x| (x % 253) as u8).collect();
        let mut g = AlignedBuf::new(500_000, 4096).unwrap();
        let gp = g.as_mut_ptr() as usize;
        let gate = Gate::new();
        let mut w = ContainerWriter::create(&e, &p, WriteOptions::default()).unwrap();
        // SAFETY: every buffer outlives the write; `g` is filled before its gate opens.
        unsafe {
            for (i, (b, &n)) in bufs.iter().zip(&sizes).enumerate() {
                w.add_aligned(&format!("m/data/{i}"), Source::mem(b.as_ptr(), n), 4096)
                    .unwrap();
                if i == 2 {
                    w.add("m/data/u", Source::mem(unaligned.as_ptr().add(1), 140_000))
                        .unwrap();
                    w.add_aligned(
                        "m/data/g",
                        Source::gated(gp as *const u8, 500_000, Arc::clone(&gate), 1),
                        4096,
                    )
                    .unwrap();
                }
            }
        }
        let task = w.write_data(TaskState::new()).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        // SAFETY: nothing reads `g` before the gate opens.
        unsafe { std::slice::from_raw_parts_mut(gp as *mut u8, 500_000) }.fill(0xA5);
        gate.advance(1);
        let w = task.join().unwrap();
        w.commit(TaskState::new()).unwrap().join().unwrap();
        let back = read_all(&e, &p, true).unwrap();
        let by_name: std::collections::HashMap<_, _> = back.into_iter().collect();
        for (i, (b, &n)) in bufs.iter().zip(&sizes).enumerate() {
            assert_eq!(
                by_name[&format!("m/data/{i}")],
                b.as_slice()[..n].to_vec(),
                "{mode}: record {i}"
            );
        }
        assert_eq!(
            by_name["m/data/u"],
            unaligned[1..140_001].to_vec(),
            "{mode}"
        );
        assert!(by_name["m/data/g"].iter().all(|&x| x == 0xA5), "{mode}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    /// With chunk sums, the write pass gives every memory record the CRC-32
    /// of each chunk (`chunks::CHUNK` bytes; and its zip CRC) whatever the record sizes,
    /// the memory's alignment and the backend: records written straight from
    /// memory, gathered with their neighbours, or split over staging chunks.
    #[test]
    fn chunk_sums_of_the_write_pass_match_a_separate_pass(
        sizes in proptest::collection::vec(0usize..300_000, 1..10),
        shift in 0usize..2,
        seed in any::<u8>(),
    ) {
        use tierstore_core::buf::AlignedBuf;
        use tierstore_core::chunks::{compute, Algo, CHUNK};
        let d = tempfile::tempdir().unwrap();
        let mode = [Mode::Threads, Mode::Buffered][seed as usize % 2];
        let e = engine(mode);
        let p = d.path().join("c.pt");
        // Page-aligned memory (written directly) or one byte off (staged).
        let bufs: Vec<(AlignedBuf, usize)> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let mut b = AlignedBuf::new(n + 4096, 4096).unwrap();
                for (k, x) in b.as_mut_slice()[shift..shift + n].iter_mut().enumerate() {
                    *x = (k as u8).wrapping_mul(31) ^ seed ^ (i as u8);
                }
                (b, n)
            })
            .collect();
        let opts = WriteOptions { chunk_sums: true, ..WriteOptions::default() };
        let mut w = ContainerWriter::create(&e, &p, opts).unwrap();
        for (i, (b, n)) in bufs.iter().enumerate() {
            // SAFETY: `bufs` outlives the writer.
            w.add(&format!("a/data/{i}"), unsafe { Source::mem(b.as_ptr().add(shift), *n) }).unwrap();
        }
        let w = w.write_data(TaskState::new()).unwrap().join().unwrap();
        for (i, (b, n)) in bufs.iter().enumerate() {
            let data = &b.as_slice()[shift..shift + n];
            let want = compute(&[data], CHUNK as usize, Algo::Crc32, 1).remove(0);
            // Built by the write pass itself (not the fallback computing it afterwards).
            prop_assert!(*n == 0 || w.plan().chunk_table_built(i), "record {} of {} bytes", i, n);
            prop_assert_eq!(w.plan().chunk_table(i).unwrap(), want, "record {}", i);
            prop_assert_eq!(w.plan().crc(i), Some(crc32fast::hash(data)));
        }
        w.commit(TaskState::new()).unwrap().join().unwrap();
        let back = read_all(&e, &p, true).unwrap();
        prop_assert_eq!(back.len(), sizes.len());
    }
}
