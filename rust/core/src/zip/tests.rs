//! Tests of the zip structures (and the archive builder other modules' tests use).

use std::path::Path;

use super::*;
use crate::error::Error;

/// The bytes of an archive holding `records`, as the writer lays it out.
pub(crate) fn build(records: &[(&str, &[u8])], align: u64) -> Vec<u8> {
    let mut lb = LayoutBuilder::new(align).unwrap();
    for (n, d) in records {
        lb.push(n, d.len() as u64).unwrap();
    }
    let end = lb.end();
    let mut file = vec![0u8; end as usize];
    for (e, (_, d)) in lb.entries_mut().iter_mut().zip(records) {
        e.crc = crc32fast::hash(d);
        let h = local_header(e);
        file[e.header_offset as usize..e.data_offset as usize].copy_from_slice(&h);
        file[e.data_offset as usize..e.data_end() as usize].copy_from_slice(d);
    }
    file.extend(central_directory(lb.entries(), end));
    file
}

#[test]
fn archive_extent_finds_the_end_of_the_first_of_several_archives() {
    let a = build(&[("a/data.pkl", b"abc"), ("a/data/0", &[7u8; 5000])], 64);
    let b = build(&[("b/data.pkl", b"xyz")], 64);
    let mut stream = a.clone();
    stream.extend_from_slice(b"between");
    stream.extend_from_slice(&b);
    assert_eq!(archive_extent(stream.as_slice()), Some(a.len() as u64));
    assert_eq!(archive_extent(b.as_slice()), Some(b.len() as u64));
    let w = Window {
        src: stream.as_slice(),
        len: a.len() as u64,
    };
    let dir = read_directory(&w, Path::new("s")).unwrap();
    assert_eq!(dir.entries.len(), 2);
    // An empty archive is its end record alone.
    let empty = build(&[], 64);
    assert_eq!(archive_extent(empty.as_slice()), Some(empty.len() as u64));
}

#[test]
fn read_directory_reads_an_archive_followed_by_other_bytes() {
    let a = build(&[("a/data.pkl", b"abc"), ("a/data/0", &[7u8; 100])], 64);
    for tail in [&b"x"[..], &vec![0u8; 70_000][..], &b"PK\x05\x06"[..]] {
        let mut f = a.clone();
        f.extend_from_slice(tail);
        let dir = read_directory(f.as_slice(), Path::new("t")).unwrap();
        assert_eq!(dir.file_len, a.len() as u64);
        assert_eq!(dir.entries.len(), 2);
    }
    // Damage at the end is still reported as such when no walk succeeds.
    let cut = &a[..a.len() - 3];
    assert!(matches!(
        read_directory(cut, Path::new("t")),
        Err(Error::Truncated { .. })
    ));
}

#[test]
fn archive_extent_declines_what_it_cannot_walk() {
    let a = build(&[("a/data.pkl", b"abc")], 64);
    // Cut anywhere: no end found.
    for cut in [0, 10, 40, a.len() - 1] {
        assert_eq!(archive_extent(&a[..cut]), None, "cut at {cut}");
    }
    // Sizes in a data descriptor (flag bit 3), or a local size that
    // lies: the walk declines, the end records are still found (alone in
    // the stream, or followed by more).
    let mut d = a.clone();
    d[6] |= 0x08;
    assert_eq!(walk_extent(d.as_slice()), Walk::DataDescriptor);
    assert_eq!(archive_extent(d.as_slice()), Some(a.len() as u64));
    let mut dd = d.clone();
    dd.extend_from_slice(&vec![1u8; 3 << 20]);
    dd.extend_from_slice(&a);
    assert_eq!(archive_extent(dd.as_slice()), Some(a.len() as u64));
    // A local size that lies (damage the directory does not share): a
    // stream is scanned; a file's fallback does not read it all.
    let mut l = a.clone();
    l[18] = 0xee;
    assert_eq!(walk_extent(l.as_slice()), Walk::Failed);
    assert_eq!(archive_extent(l.as_slice()), Some(a.len() as u64));
    l.extend_from_slice(&vec![1u8; 3 << 20]);
    l.extend_from_slice(&a);
    assert_eq!(archive_extent(l.as_slice()), Some(a.len() as u64));
    assert_eq!(extent(l.as_slice(), false), None);
    // End records whose directory does not end right before them.
    let mut g = d.clone();
    let eocd = g.len() - 22;
    g[eocd + 16] = g[eocd + 16].wrapping_sub(1);
    assert_eq!(archive_extent(g.as_slice()), None);
    // Not a zip at all.
    assert_eq!(
        archive_extent(&b"\x80\x02hello world, this is not a zip file"[..]),
        None
    );
}

#[test]
fn layout_aligns_every_record() {
    let mut lb = LayoutBuilder::new(4096).unwrap();
    for (i, size) in [0u64, 1, 4095, 4096, 10_000].iter().enumerate() {
        let e = lb
            .push(&format!("archive/data/{i}"), *size)
            .unwrap()
            .clone();
        assert_eq!(e.data_offset % 4096, 0);
        assert!(e.data_offset >= e.header_offset + 30 + e.name.len() as u64 + 4);
        assert!(e.data_offset - e.header_offset < 4096 + 30 + e.name.len() as u64 + 4);
        assert_eq!(
            local_header(&e).len() as u64,
            e.data_offset - e.header_offset
        );
    }
}

#[test]
fn roundtrip_directory() {
    let file = build(
        &[
            ("a/data.pkl", b"hello"),
            ("a/data/0", &[7u8; 5000]),
            ("a/x", b""),
        ],
        4096,
    );
    let dir = read_directory(file.as_slice(), Path::new("mem")).unwrap();
    assert_eq!(dir.entries.len(), 3);
    assert_eq!(dir.entries[1].name, "a/data/0");
    assert_eq!(dir.entries[1].size, 5000);
    assert_eq!(dir.entries[1].crc, crc32fast::hash(&[7u8; 5000]));
    let e = &dir.entries[1];
    let probe = &file[e.header_offset as usize..];
    let off = data_offset_from_local(probe, e, &dir, Path::new("mem")).unwrap();
    assert_eq!(off % 4096, 0);
    assert_eq!(&file[off as usize..off as usize + 5000], &[7u8; 5000][..]);
}

#[test]
fn zip64_fields_roundtrip_in_directory() {
    // A 5 GiB record placed beyond 4 GiB: only the directory is encoded.
    let e = Entry {
        name: "a/data/0".into(),
        size: 5 << 30,
        crc: 0x1234_5678,
        header_offset: 6 << 30,
        data_offset: (6 << 30) + 4096,
    };
    let cd_off = e.data_end();
    let cd = central_directory(std::slice::from_ref(&e), cd_off);
    // Simulate a file whose record area is sparse: a reader over a
    // virtual source that only serves the directory bytes.
    struct Sparse {
        cd_off: u64,
        cd: Vec<u8>,
    }
    impl ReadAt for Sparse {
        fn len(&self) -> u64 {
            self.cd_off + self.cd.len() as u64
        }
        fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
            for (i, b) in buf.iter_mut().enumerate() {
                let o = offset + i as u64;
                *b = if o >= self.cd_off {
                    self.cd[(o - self.cd_off) as usize]
                } else {
                    0
                };
            }
            Ok(())
        }
    }
    let src = Sparse { cd_off, cd };
    let dir = read_directory(&src, Path::new("virtual")).unwrap();
    assert_eq!(dir.entries[0].size, 5 << 30);
    assert_eq!(dir.entries[0].header_offset, 6 << 30);
    assert_eq!(dir.cd_offset, cd_off);
    let h = local_header(&e);
    assert_eq!(
        u32::from_le_bytes(h[18..22].try_into().unwrap()),
        0xffff_ffff
    );
}

fn set(file: &mut [u8], at: usize, v: &[u8]) {
    file[at..at + v.len()].copy_from_slice(v);
}

/// Offset of central-directory entry `i` (names of `name_len` bytes, no extras).
fn cd_entry(dir: &Directory, i: usize, name_len: usize) -> usize {
    dir.cd_offset as usize + i * (CENTRAL_HEADER_LEN as usize + name_len)
}

#[test]
fn overlapping_records_are_refused() {
    let p = Path::new("f");
    let recs: [(&str, &[u8]); 3] = [("a/r0", &[1u8; 100]), ("a/r1", &[2u8; 10]), ("a/r2", b"")];
    let file = build(&recs, 64);
    let dir = read_directory(file.as_slice(), p).unwrap();
    let h1 = dir.entries[1].header_offset as u32;
    // Two entries naming the same local header (and so the same data).
    let mut bad = file.clone();
    set(&mut bad, cd_entry(&dir, 2, 4) + 42, &h1.to_le_bytes());
    let err = read_directory(bad.as_slice(), p).unwrap_err();
    assert!(matches!(err, Error::Corrupt { .. }), "{err}");
    // An entry whose header lies inside the data of the one before it:
    // refused with the directory when the least spans overlap, ...
    let mut bad = file.clone();
    set(
        &mut bad,
        cd_entry(&dir, 1, 4) + 42,
        &(h1 - 40).to_le_bytes(),
    );
    let err = read_directory(bad.as_slice(), p).unwrap_err();
    assert!(err.to_string().contains("overlaps"), "{err}");
    // ... and otherwise when the local header places the data.
    let mut bad = file.clone();
    set(
        &mut bad,
        cd_entry(&dir, 1, 4) + 42,
        &(h1 - 20).to_le_bytes(),
    );
    let d = read_directory(bad.as_slice(), p).unwrap();
    assert!(data_offset_from_local(&bad, &d.entries[0], &d, p).is_err());
    // Found by tests/fuzz_parsers.rs: entry 0's header moved into the
    // padding before entry 1's data. Each entry's least span fits, but
    // entry 1's data (per its local header) would cover entry 0's header.
    let file = build(&[("a/data/0", b""), ("a/data/1", b"")], 256);
    let dir = read_directory(file.as_slice(), p).unwrap();
    let mut bad = file.clone();
    let moved = dir.cd_offset as u32 - 38;
    set(&mut bad, cd_entry(&dir, 0, 8) + 42, &moved.to_le_bytes());
    let dir = read_directory(bad.as_slice(), p).unwrap();
    let e = &dir.entries[1];
    let err = data_offset_from_local(&bad[e.header_offset as usize..], e, &dir, p).unwrap_err();
    assert!(err.to_string().contains("next record's header"), "{err}");
}

#[test]
fn data_may_not_run_into_the_next_record() {
    let p = Path::new("f");
    let file = build(&[("a/r0", &[1u8; 100]), ("a/r1", &[2u8; 10])], 64);
    let dir = read_directory(file.as_slice(), p).unwrap();
    let (e0, e1) = (&dir.entries[0], &dir.entries[1]);
    let good = data_offset_from_local(&file, e0, &dir, p).unwrap();
    // A longer extra field in the local header pushes the data over the
    // next record's header; so does an offset a manifest states.
    let mut bad = file.clone();
    set(&mut bad, 28, &(good as u16 - 30 - 4 + 16).to_le_bytes());
    assert!(data_offset_from_local(&bad, e0, &dir, p).is_err());
    assert!(check_data_range(e0, good + 16, &dir, p).is_err());
    assert!(check_data_range(e0, e1.header_offset - 100, &dir, p).is_ok());
    assert!(check_data_range(e0, e1.header_offset - 99, &dir, p).is_err());
    assert_eq!(dir.space_end(e0.header_offset), e1.header_offset);
    assert_eq!(dir.space_end(e1.header_offset), dir.cd_offset);
}

#[test]
fn forged_entries_do_not_overflow() {
    let p = Path::new("f");
    let file = build(&[("a/r0", &[1u8; 100])], 64);
    let dir = read_directory(file.as_slice(), p).unwrap();
    let mut e = dir.entries[0].clone();
    e.header_offset = u64::MAX - 10;
    assert!(data_offset_from_local(&file, &e, &dir, p).is_err());
    assert!(check_data_range(&e, 0, &dir, p).is_err());
    e.header_offset = 0;
    e.compressed_size = u64::MAX;
    assert!(check_data_range(&e, 64, &dir, p).is_err());
}

#[test]
fn rejects_garbage_and_truncation() {
    let p = Path::new("f");
    assert!(matches!(
        read_directory(&b"hello world, not a zip at all"[..], p),
        Err(Error::NotAContainer { .. })
    ));
    let file = build(
        &[("a/data.pkl", b"hello"), ("a/data/0", &[1u8; 9000])],
        4096,
    );
    let cut = &file[..file.len() - 10];
    assert!(matches!(
        read_directory(cut, p),
        Err(Error::Truncated { .. })
    ));
    // Absurd directory size: no huge allocation, a clear error.
    let mut bad = file.clone();
    let n = bad.len();
    bad[n - 10..n - 6].copy_from_slice(&0xfff0_0000u32.to_le_bytes());
    assert!(read_directory(bad.as_slice(), p).is_err());
}
